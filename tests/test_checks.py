"""Check cases: every `check` of the standard pack holds, and a wrong one is reported."""

from __future__ import annotations

from pathlib import Path

from bbrules.engine import run_checks
from bbrules.packs import load_packs
from bbrules.rulefile import load_pack, parse_rules

RULES = Path(__file__).parent.parent / "rules"

HOIST = ("rule hoist: reduce(?a, sum, ?x * ?s) => reduce(?a, sum, ?x) * ?s "
         "when ?a not in deps(?s)\n")


def test_standard_pack_checks_all_hold():
    pack = load_packs([])
    assert len(pack.checks) >= len(pack.rules) - 1  # forwarding is checked by the fusion tests
    assert run_checks(pack) == []


def test_every_standard_rule_file_has_checks_that_fire_and_checks_that_must_not():
    pack = load_pack(RULES, name="standard")
    for path in sorted(RULES.glob("*.bbr")):
        rules = {r.name for r in pack.rules if r.span.path == str(path)}
        if not rules or rules == {"forward"}:
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
