"""Malformed rule files: every mistake is a `SourceError` at the offending token."""

from __future__ import annotations

from pathlib import Path

import pytest

from bbrules.cli import main
from bbrules.errors import SourceError
from bbrules.rulefile import load_pack, parse_rules

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "attention.bbp"

# (name, file text, line, column, part of the message)
CASES = [
    ("syntax", "rule a: ?x => ?x\nrule b: ?x * => ?x\n", 2, 14,
     "syntax error: unexpected '=>'; expected one of '(', '-', a name, a number, "
     "a pattern variable like ?x"),
    ("end of file", "rule a: ?x => ?x\nrule b: reduce(?a, sum, ?x\n", 2, 27,
     "unexpected end of file; expected one of ')', '*', '+', ',', '-', '/'"),
    ("stray character", "rule a: ?x => ?x\nrule b: ?x @ ?y => ?x\n", 2, 12,
     "unexpected '@'; expected one of '*', '+', '-', '/', an arrow (=>, <=>, !=>)"),
    ("unknown function", "rule a: ?x => ?x\n\nrule b: expo(?x) => ?x\n", 3, 9,
     "unknown function 'expo'"),
    ("arity", "rule a: ?x => ?x\nrule b: dot(?a, ?x) => ?x\n", 2, 9,
     "dot takes 3 arguments (axis, x, y), got 2"),
    ("unknown monoid", "rule a: reduce(?a, sum, ?x) => reduce(?a, online, ?x)\n", 1, 43,
     "unknown monoid 'online' (known: max, min, sum)"),
    ("unbound", "rule a: ?x * ?y =>\n  ?x * ?z\n", 2, 8,
     "?z is not bound by the left-hand side"),
    ("unbound two-way", "rule a: ?x * ?y <=> ?x * 2.0\n", 1, 14,
     "?y is not bound by the right-hand side"),
    ("guard unbound", "rule a: ?x * ?y => ?y * ?x\n  when ?a not in deps(?x)\n", 2, 8,
     "guard on ?a, which the left-hand side does not bind"),
    ("guard constant unbound", "rule a: ?x * const(?c) => ?x when ?c == 1 / extent(?e)\n",
     1, 52, "guard on ?e, which the left-hand side does not bind"),
    ("guard kind", "rule a: reduce(?a, sum, ?x) => reduce(?a, sum, ?x) when ?x in shape(?a)\n",
     1, 57, "?x is a value in the left-hand side, not an axis"),
    ("sides differ", "rule a: bsum(?a, ?x) => ?x\n", 1, 22,
     "the two sides differ in shape or dependencies"),
    ("guard too weak", "rule a: reduce(?a, sum, ?x * ?s) => reduce(?a, sum, ?x) * ?s "
     "when ?a not in shape(?s)\n", 1, 34, "the two sides differ in shape or dependencies"),
    ("ill-formed rhs", "rule a: bsum(?a, ?x) => reduce(?a, sum, ?x)\n", 1, 22,
     "the right-hand side is ill-formed where the left is not"),
    ("unknown check", "rule a: ?x => ?x\ncheck b: load(A[q])\n", 2, 7,
     "check names unknown rule or ruleset 'b'"),
    ("duplicate", "rule a: ?x => ?x\n# again\nrule a: ?y => ?y\n", 3, 6,
     "rule 'a' is declared twice"),
    ("monoid arity", "monoid two(m, l)\n  identity = (0.0, 0.0)\n  combine = (a.m + b.m)\n"
     "  finalize = (l)\n", 3, 13, "combine gives 1 expression, the state (m, l) has 2"),
    ("monoid variable", "monoid two(m, l)\n  identity = (0.0, 0.0)\n  combine = (a.m, b.l)\n"
     "  finalize = (a.l)\n", 4, 15, "unknown name 'a.l'"),
    ("unknown ruleset", "ruleset one\nrule a: ?x => ?x\nstage s: one, two\n", 3, 15,
     "stage 's' names unknown ruleset 'two' (known: one)"),
    ("variable kinds", "rule a: reduce(?a, sum, ?x) => reduce(?x, sum, ?x)\n", 1, 48,
     "?x is used as a value here but as an axis at bad.bbr:1:39"),
    ("lhs arithmetic", "rule a: const(?c + 1) => const(?c)\n", 1, 15,
     "constant arithmetic belongs on the right-hand side"),
    ("component index not a number", "rule a: get(nan, ?x) => ?x\n", 1, 13,
     "expected a component index (0, 1, ...)"),
    ("component index too large", "rule a: get(1e999, ?x) => ?x\n", 1, 13,
     "expected a component index (0, 1, ...)"),
    ("ill-formed check", "rule a: ?x => ?x\ncheck a: reduce(k, sum, load(A[k]))\n", 2, 10,
     "ill-formed check term: reduce over 'k' of a tile that still spans 'k'"),
    ("check not ground", "rule a: ?x => ?x\ncheck a: exp(?x)\n", 2, 14,
     "pattern variable ?x outside a rule"),
    ("tolerance", "rule a: ?x => ?x\ntolerance b = 0.1\n", 2, 11,
     "tolerance for unknown rule 'b'"),
    ("rule arrow", "rule a: ?x !=> ?x\n", 1, 12, "a rule rewrites with '=>' or '<=>'"),
    ("literal axis", "rule a: bsum(k, ?x) => bsum(k, ?x)\n", 1, 14,
     "an axis in a rule is a variable like ?k"),
    ("analysis", "rule a: bsum(?a, ?x) => bsum(?a, ?x) when ?a in size(?x)\n", 1, 49,
     "expected shape(...) or deps(...), not size(...)"),
    ("trips", "rule a: reduce(?a, sum, ?x) => reduce(?a, sum, ?x) when trips(?a) < trips(?a)\n",
     1, 67, "trip counts compare only with =="),
    ("unknown stage", "ruleset one\nrule a: ?x => ?x\nstage s: one\nstage fuse += one\n", 4, 7,
     "'stage fuse +=' names unknown stage 'fuse' (known: s)"),
    ("join unknown ruleset", "ruleset one\nrule a: ?x => ?x\nstage s: one\nstage s += two\n",
     4, 12, "stage 's' names unknown ruleset 'two' (known: one)"),
    ("join twice", "ruleset one\nrule a: ?x => ?x\nstage s: one\nstage s += one\n", 4, 12,
     "ruleset 'one' is already in stage 's'"),
    ("stage twice", "ruleset one\nrule a: ?x => ?x\nstage s: one\nstage s: one\n", 4, 7,
     "stage 's' is declared twice in this pack"),
    ("join iterations", "ruleset one\nrule a: ?x => ?x\nstage s: one\n"
     "stage s += one iterations 2\n", 4, 16, "syntax error: unexpected 'iterations'"),
]


@pytest.mark.parametrize("text, line, column, message",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_rule_file(text: str, line: int, column: int, message: str) -> None:
    with pytest.raises(SourceError) as err:
        parse_rules(text, "bad.bbr")
    e = err.value
    assert (e.span.path, e.span.line, e.span.column) == ("bad.bbr", line, column)
    assert message in e.message
    source_line, caret = str(e).splitlines()[1:3]
    assert source_line.strip() == text.splitlines()[line - 1].strip()
    assert caret.index("^") == column + 1  # printed with two spaces of indent


def test_a_stage_of_an_earlier_pack_is_joined_not_redeclared() -> None:
    base = parse_rules("ruleset one\nrule a: ?x => ?x\nstage fuse: one\n", "base.bbr")
    with pytest.raises(SourceError) as err:
        parse_rules("ruleset two\nrule b: ?y => ?y\nstage fuse: two\n", "later.bbr", base=base)
    assert (err.value.span.line, err.value.span.column) == (3, 7)
    assert "stage 'fuse' is declared by an earlier pack; 'stage fuse += RULESET' adds" in \
        err.value.message
    with pytest.raises(SourceError, match="ruleset 'one' is already in stage 'fuse'"):
        parse_rules("stage fuse += one\n", "later.bbr", base=base)


def test_the_cli_reports_joining_an_unknown_stage_and_exits_2(tmp_path: Path, capsys) -> None:
    (tmp_path / "join.bbr").write_text("ruleset mine\nrule a: ?x => ?x\nstage fusion += mine\n")
    for command in (["check"], ["apply", str(EXAMPLE), "--rules"]):
        assert main([*command, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{tmp_path / 'join.bbr'}:3:7: error: 'stage fusion +=' names "
                              f"unknown stage 'fusion' (known: forward, normalise, algebra, "
                              f"fuse, sink)")
        assert "Traceback" not in err


def test_error_in_another_file_of_the_pack_names_that_file(tmp_path: Path) -> None:
    (tmp_path / "a.bbr").write_text("rule a: ?x => ?x\n")
    (tmp_path / "b.bbr").write_text("check a: load(A[q])\n\ncheck c: load(A[q])\n")
    with pytest.raises(SourceError) as err:
        load_pack(tmp_path)
    assert str(err.value.span) == f"{tmp_path / 'b.bbr'}:3:7"
    assert "'c'" in err.value.message


def test_a_monoid_cannot_change_meaning_over_an_earlier_pack() -> None:
    one = parse_rules("monoid clash_test(s)\n  identity = (0.0)\n  combine = (a.s + b.s)\n"
                      "  finalize = (s)\n", "one.bbr")
    with pytest.raises(SourceError) as err:
        parse_rules("\nmonoid clash_test(s)\n  identity = (1.0)\n  combine = (a.s * b.s)\n"
                    "  finalize = (s)\n", "two.bbr", base=one)
    assert (err.value.span.line, err.value.span.column) == (2, 8)
    assert "already defined differently" in err.value.message


@pytest.mark.parametrize("command", [["check"], ["apply", str(EXAMPLE), "--rules"]])
@pytest.mark.parametrize("text, line, column, message",
                         [c[1:] for c in CASES[:4]], ids=[c[0] for c in CASES[:4]])
def test_the_cli_reports_rule_file_mistakes_and_exits_2(command, text, line, column, message,
                                                        tmp_path: Path, capsys) -> None:
    (tmp_path / "bad.bbr").write_text(text)
    assert main([*command, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{tmp_path / 'bad.bbr'}:{line}:{column}: error: ")
    assert message in err and "Traceback" not in err
