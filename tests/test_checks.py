"""Check cases: every `check` of the standard pack holds, and a wrong one is reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from bbrules.engine import run_checks
from bbrules.errors import SourceError
from bbrules.ir import Binary, Const, Load
from bbrules.packs import load_packs
from bbrules.rulefile import load_pack, parse_rules

RULES = Path(__file__).parent.parent / "rules"

HOIST = ("rule hoist: reduce(?a, sum, ?x * ?s) => reduce(?a, sum, ?x) * ?s "
         "when ?a not in deps(?s)\n")


def test_standard_pack_checks_all_hold():
    pack = load_packs([])
    assert len(pack.checks) >= len(pack.rules)
    assert run_checks(pack) == []


def test_every_standard_rule_is_shown_to_rewrite_by_a_check():
    pack = load_pack(RULES, name="standard")
    positive = {c.rule for c in pack.checks if not c.negated and c.expect is not None}
    assert [r.name for r in pack.rules
            if r.name not in positive and r.ruleset not in positive] == []


def test_every_guarded_standard_rule_has_a_check_its_guard_stops():
    pack = load_pack(RULES, name="standard")
    negative = {c.rule for c in pack.checks if c.negated}
    assert [r.name for r in pack.rules if r.guards and r.name not in negative] == []


def test_every_standard_rule_file_has_checks_that_fire_and_checks_that_must_not():
    pack = load_pack(RULES, name="standard")
    for path in sorted(RULES.glob("*.bbr")):
        rules = {r.name for r in pack.rules if r.span.path == str(path)}
        if not rules:
            continue
        mine = [c for c in pack.checks if c.span.path == str(path)]
        assert any(not c.negated for c in mine), path.name
        assert any(c.negated for c in mine), path.name


def test_a_check_that_does_not_hold_is_reported_with_its_position():
    pack = parse_rules(HOIST + """
check hoist: reduce(k, sum, bsum(k, load(A[q, k])) * load(B[q])) => reduce(k, sum, bsum(k, load(A[q, k]))) * load(B[q])
check hoist: reduce(k, sum, bsum(k, load(A[q, k])) * load(B[q])) => reduce(k, sum, bsum(k, load(A[q, k]))) * load(C[q])
""", "wrong.bbr")
    (failure,) = run_checks(pack)
    assert failure.check.span.line == 4
    assert str(failure).startswith("wrong.bbr:4:")
    assert "does not rewrite to" in str(failure)


def test_negative_checks_are_directional():
    # A one-way rule: the rewritten form must not rewrite back.
    pack = parse_rules(HOIST + """
check hoist: reduce(k, sum, bsum(k, load(A[q, k]))) * load(B[q]) !=> reduce(k, sum, bsum(k, load(A[q, k])) * load(B[q]))
check hoist: reduce(k, sum, bsum(k, load(A[q, k])) * load(B[q])) !=> reduce(k, sum, bsum(k, load(A[q, k]))) * load(B[q])
""", "direction.bbr")
    (failure,) = run_checks(pack)
    assert failure.check.span.line == 4
    assert "must not rewrite to" in str(failure)


def test_a_bare_check_fails_when_the_rule_matches():
    pack = parse_rules(HOIST + """
check hoist: reduce(k, sum, bsum(k, load(A[q, k])) * bsum(k, load(C[q, k])))
check hoist: reduce(k, sum, bsum(k, load(A[q, k])) * load(B[q]))
""", "bare.bbr")
    (failure,) = run_checks(pack)
    assert failure.check.span.line == 4
    assert "hoist matched" in str(failure)


def test_checks_read_axis_sizes_from_their_with_clause():
    pack = parse_rules("""
rule mean: reduce(?e, sum, bsum(?e, ?x)) * const(?c) => reduce(?e, sum, bsum(?e, ?x)) / const(extent(?e)) when ?c == 1 / extent(?e)
check mean: reduce(e, sum, bsum(e, load(X[m, e]))) * 0.25 => reduce(e, sum, bsum(e, load(X[m, e]))) / 4.0 with e = 4 / 2
check mean: reduce(e, sum, bsum(e, load(X[m, e]))) * 0.25 with e = 8 / 2
""", "sizes.bbr")
    assert run_checks(pack) == []


def test_a_check_may_name_a_ruleset():
    pack = parse_rules("""
ruleset scale
rule fold: const(?c) * const(?d) => const(?c * ?d)
rule assoc: (?x * ?y) * ?z => ?x * (?y * ?z)
check scale: (load(A[q]) * 2.0) * 4.0 => load(A[q]) * 8.0
""", "ruleset.bbr")
    assert run_checks(pack) == []


# --------------------------------------------------------------------------------------------
# load(store(v)) in check terms

FORWARD = "rule forward: load(store(?v)) => ?v\n"


def test_a_stored_block_in_a_check_term_is_a_load_of_an_intermediate():
    pack = parse_rules(FORWARD + """
check forward: load(store(load(A[q, k]) * 2.0)) + 1.0 => load(A[q, k]) * 2.0 + 1.0
check forward: bsum(t, load(store(load(A[q, k]) * 2.0), rename(k, t))) => bsum(t, load(A[q, t]) * 2.0)
""", "stored.bbr")
    doubled = Binary("mul", Load("A", ("q", "k")), Const(2.0))
    plain, renamed = pack.checks
    assert plain.term == Binary("add", Load("store1", ("q", "k")), Const(1.0))
    assert plain.stored == {"store1": (("q", "k"), doubled)}
    assert renamed.term.x == Load("store1", ("q", "t"))  # read as a program reads S[q, t]
    assert renamed.stored == plain.stored
    assert run_checks(pack) == []


def test_forwarding_checks_fail_where_forwarding_does_not_give_the_expected_term():
    pack = parse_rules(FORWARD + """
check forward: load(store(load(A[q, k]) - load(B[k])), rename(q, k), rename(k, q)) => load(A[k, q]) - load(B[q])
check forward: load(store(load(A[q, k]) * 2.0), rename(k, t)) => load(A[q, k]) * 2.0
check forward: load(store(reduce(k, max, bmax(k, load(S[q, k])))), rename(q, k)) * load(A[q, k])
check forward: load(store(reduce(k, max, bmax(k, load(S[q, k])))), rename(q, t)) * load(A[q, k])
check forward: load(A[q, k]) * 2.0
""", "forward.bbr")
    # Lines 3, 5 and 7 hold: a transposed read, a renaming that would capture the reduction's
    # axis (not forwarded), a load of an input.  Line 4 expects the value without renaming;
    # line 6 renames q to t, which captures nothing, so forwarding fires.
    failures = run_checks(pack)
    assert [f.check.span.line for f in failures] == [4, 6]
    assert "load(store1[q, t]) does not rewrite to load(A[q, k]) * 2.0" in str(failures[0])
    assert "forward matched it" in str(failures[1])


@pytest.mark.parametrize("term, column, message", [
    ("store(load(A[q]))", 16, "store(...) appears only inside load(store(...))"),
    ("load(store(bsum(k, load(A[q, k]))))", 27,
     "only a tile whose shape equals its dependencies can be stored"),
    ("load(store(load(A[q]), load(B[q])))", 21, "store takes 1 argument (x), got 2"),
    ("load(store(load(A[q])), rename(k, t))", 47, "'k' is not an axis of the stored block"),
    ("load(store(load(A[q])), t)", 40, "expected rename(axis, new name)"),
    ("load(store(load(A[q, k])), rename(q, k))", 43, "two axes of the same name (k, k)"),
    ("load(store(load(A[q])), rename(q, t), rename(q, s))", 61, "'q' is renamed twice"),
    ("load(store(load(A[q]))) + load(store1[q])", 47, "'store1' names a stored block"),
])
def test_malformed_stored_blocks_in_checks_are_reported_where_they_are(term, column, message):
    with pytest.raises(SourceError) as err:
        parse_rules(FORWARD + f"check forward: {term}\n", "bad.bbr")
    assert (err.value.span.line, err.value.span.column) == (2, column)
    assert message in err.value.message
