"""The rule language: what each declaration parses to."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from bbrules.errors import SourceError
from bbrules.ir import (SUM, Binary, BlockReduce, Const, Dot, Get, Load, Monoid, Reduce,
                        Tuple, Unary, Var)
from bbrules.packs import load_packs
from bbrules.rule import (AxisEq, AxisIn, AxisSize, CExpr, Check, ConstCmp, PAxis, PConst, PMonoid,
                          PVar, RulePack, Stage, Stored, TripsEq)
from bbrules.rulefile import load_pack, parse_rules

SPEC = """\
# Reading back a block we just stored is the block itself.
ruleset forwarding                  # following rules belong to this ruleset (default: file stem)
rule forward: load(store(?v)) => ?v
# A loop-invariant factor leaves the loop:
#   sum_a(x * s) = sum_a(x) * s.
rule hoist_factor: reduce(?a, sum, ?x * ?s) => reduce(?a, sum, ?x) * ?s  when ?a not in deps(?s)
ruleset algebra
rule mul_comm: ?x * ?y <=> ?y * ?x
rule fold_mul: const(?c) * const(?d) => const(?c * ?d)
stage forward: forwarding                        # stages run in order of declaration
stage fuse: algebra, forwarding iterations 8     # optional per-stage iteration cap
# Online softmax: running max and rescaled sum.
monoid online_rulefile_test(m, l)
  identity = (-inf, 0.0)
  combine  = (max(a.m, b.m), a.l * exp(a.m - max(a.m, b.m)) + b.l * exp(b.m - max(a.m, b.m)))
  finalize = (l)
tolerance fold_mul = 0.2                      # relative tolerance the soundness check allows
check hoist_factor: reduce(k, sum, bsum(k, load(A[q, k])) * load(B[q]))
  => reduce(k, sum, bsum(k, load(A[q, k]))) * load(B[q])
check hoist_factor: reduce(k, sum, bsum(k, load(A[q, k])) * bsum(k, load(C[k])))
  !=> reduce(k, sum, bsum(k, load(A[q, k]))) * bsum(k, load(C[k]))
check algebra: load(A[q]) with q = 256 / 64, k = 8
"""

x, y, s, v = PVar("?x"), PVar("?y"), PVar("?s"), PVar("?v")


def test_the_documented_example() -> None:
    pack = parse_rules(SPEC, "spec.bbr")
    assert pack.name == "spec"
    assert [(r.name, r.ruleset, r.bidirectional) for r in pack.rules] == [
        ("forward", "forwarding", False), ("hoist_factor", "forwarding", False),
        ("mul_comm", "algebra", True), ("fold_mul", "algebra", False)]
    forward, hoist, comm, fold = pack.rules
    assert (forward.lhs, forward.rhs, forward.guards) == (Stored(v), v, ())
    assert hoist.lhs == Reduce(PAxis("?a"), SUM, Binary("mul", x, s))
    assert hoist.rhs == Binary("mul", Reduce(PAxis("?a"), SUM, x), s)
    assert hoist.guards == (AxisIn("?a", "deps", "?s", negated=True),)
    assert hoist.doc == "A loop-invariant factor leaves the loop:\nsum_a(x * s) = sum_a(x) * s."
    assert forward.doc == ""  # its comment sits above the ruleset line, not above the rule
    assert hoist.span is not None and (hoist.span.line, hoist.span.column) == (6, 6)
    assert (comm.lhs, comm.rhs) == (Binary("mul", x, y), Binary("mul", y, x))
    assert fold.lhs == Binary("mul", PConst("?c"), PConst("?d"))
    assert fold.rhs == CExpr("mul", (PConst("?c"), PConst("?d")))
    assert pack.stages == [Stage("forward", ("forwarding",)),
                           Stage("fuse", ("algebra", "forwarding"), 8)]
    assert pack.tolerances == {"fold_mul": 0.2}

    a, b = Var("a.m"), Var("b.m")
    new_max = Binary("max", a, b)
    rescale = Binary("add",
                     Binary("mul", Var("a.l"), Unary("exp", Binary("sub", a, new_max))),
                     Binary("mul", Var("b.l"), Unary("exp", Binary("sub", b, new_max))))
    online = Monoid("online_rulefile_test", ("m", "l"), (Const(float("-inf")), Const(0.0)),
                    (new_max, rescale), (Var("l"),))
    assert pack.monoids == [online]
    assert pack.monoids[0].doc == "Online softmax: running max and rescaled sum."

    aqk, bq = Load("A", ("q", "k")), Load("B", ("q",))
    row = BlockReduce("sum", "k", aqk)
    c = BlockReduce("sum", "k", Load("C", ("k",)))
    assert pack.checks == [
        Check("hoist_factor", Reduce("k", SUM, Binary("mul", row, bq)),
              Binary("mul", Reduce("k", SUM, row), bq)),
        Check("hoist_factor", Reduce("k", SUM, Binary("mul", row, c)),
              Binary("mul", Reduce("k", SUM, row), c), negated=True),
        Check("algebra", Load("A", ("q",)), None, negated=True,
              dims={"q": (256, 64), "k": (8, 8)}),
    ]


@pytest.mark.parametrize("guard, expected", [
    ("?a in shape(?x)", AxisIn("?a", "shape", "?x")),
    ("?a not in shape(?x)", AxisIn("?a", "shape", "?x", negated=True)),
    ("?a in deps(?y)", AxisIn("?a", "deps", "?y")),
    ("?a == ?b", AxisEq("?a", "?b")),
    ("?a != ?b", AxisEq("?a", "?b", negated=True)),
    ("trips(?a) == trips(?b)", TripsEq("?a", "?b")),
    ("?c > 0", ConstCmp("?c", ">", Const(0.0))),
    ("?c <= -1.5", ConstCmp("?c", "<=", Const(-1.5))),
    ("?c == 1 / extent(?b)",
     ConstCmp("?c", "==", CExpr("div", (Const(1.0), AxisSize("extent", "?b"))))),
    ("?c != block(?a) * trips(?a)",
     ConstCmp("?c", "!=", CExpr("mul", (AxisSize("block", "?a"), AxisSize("trips", "?a"))))),
])
def test_guards(guard: str, expected: object) -> None:
    text = (f"rule g: reduce(?a, sum, bsum(?b, ?x) * ?y) * const(?c)\n"
            f"  => reduce(?a, sum, bsum(?b, ?x) * ?y) * const(?c) when {guard}")
    assert parse_rules(text).rules[0].guards == (expected,)


def test_every_node_kind_in_patterns() -> None:
    text = ("rule r: tuple(get(0, reduce(?a, ?m, ?t)), dot(?b, ?x, ?y), bmin(?b, ?x), "
            "min(?x, -?y), sqrt(?x) - 2e-3)\n"
            "  => tuple(get(0, reduce(?a, ?m, ?t)), dot(?b, ?x, ?y), bmin(?b, ?x), "
            "min(?x, neg(?y)), sqrt(?x) - 0.002)")
    rule = parse_rules(text).rules[0]
    t = PVar("?t")
    a, b, m = PAxis("?a"), PAxis("?b"), PMonoid("?m")
    assert rule.lhs == Tuple((Get(0, Reduce(a, m, t)), Dot(b, x, y), BlockReduce("min", b, x), Binary("min", x, Unary("neg", y)),
                              Binary("sub", Unary("sqrt", x), Const(0.002))))
    assert rule.rhs == rule.lhs


def test_constant_arithmetic_on_the_right() -> None:
    text = "rule r: bsum(?a, ?x) * const(?c) => bsum(?a, ?x * const(-?c * block(?a) + 1))"
    rhs = parse_rules(text).rules[0].rhs
    folded = CExpr("add", (CExpr("mul", (CExpr("neg", (PConst("?c"),)),
                                         AxisSize("block", "?a"))), Const(1.0)))
    assert rhs == BlockReduce("sum", PAxis("?a"), Binary("mul", x, folded))


def test_layout_is_free_and_default_ruleset_is_the_file_stem() -> None:
    text = "rule a:\n  ?x +\n  ?y\n  =>\n  ?y + ?x\nrule b: ?x => ?x stage s: mine"
    pack = parse_rules(text, "dir/mine.bbr")
    assert [r.ruleset for r in pack.rules] == ["mine", "mine"]
    assert pack.stages == [Stage("s", ("mine",))]


def test_a_pack_reads_its_files_together(tmp_path: Path) -> None:
    (tmp_path / "a_monoids.bbr").write_text(
        "monoid sum_pack_test(s)\n  identity = (0.0)\n  combine = (a.s + b.s)\n"
        "  finalize = (s)\n"
        "rule swap: reduce(?a, sum_pack_test, ?x) => reduce(?a, sum, ?x)\n")
    (tmp_path / "b_use.bbr").write_text(
        "ruleset late\nrule back: reduce(?a, sum, ?x) => reduce(?a, sum_pack_test, ?x)\n"
        "stage one: a_monoids, late\n"
        "check swap: reduce(k, sum_pack_test, bsum(k, load(A[k]))) => "
        "reduce(k, sum, bsum(k, load(A[k])))\n")
    (tmp_path / "notes.txt").write_text("not a rule file")
    pack = load_pack(tmp_path)
    assert pack.name == tmp_path.name
    assert [(r.name, r.ruleset) for r in pack.rules] == [("swap", "a_monoids"), ("back", "late")]
    assert pack.stages == [Stage("one", ("a_monoids", "late"))]
    assert [c.rule for c in pack.checks] == ["swap"]
    assert pack.rules[0].span is not None and pack.rules[0].span.path.endswith("a_monoids.bbr")


def test_a_pack_builds_on_earlier_packs() -> None:
    base = parse_rules("monoid prod_base_test(p)\n  identity = (1.0)\n  combine = (a.p * b.p)\n"
                       "  finalize = (p)\nruleset early\nrule e: ?x => ?x\n", "base.bbr")
    pack = parse_rules("rule l: reduce(?a, prod_base_test, ?x) => exp(reduce(?a, sum, log(?x)))\n"
                       "stage s: early\ncheck e: load(A[q])\n", "later.bbr", base=base)
    assert [r.name for r in pack.rules] == ["l"]
    assert pack.monoids == []  # the base's monoid is used, not redeclared
    with pytest.raises(SourceError, match="rule 'e' is declared twice"):
        parse_rules("rule e: ?y => ?y", "again.bbr", base=base)


def test_a_pack_joins_stages_of_earlier_packs_and_its_own(tmp_path: Path) -> None:
    base = parse_rules("ruleset one\nrule a: ?x + ?y => ?y + ?x\nruleset two\n"
                       "rule b: ?x * ?y => ?y * ?x\nstage first: one\n"
                       "stage second: two iterations 3\n", "base.bbr")
    # A join may name a stage declared in a later file of the same pack.
    (tmp_path / "a_join.bbr").write_text("ruleset mine\nrule c: -(-?x) => ?x\n"
                                         "stage second += mine\nstage own += two\n")
    (tmp_path / "b_stage.bbr").write_text("stage own: mine\n")
    pack = load_pack(tmp_path, base=base)
    assert pack.stages == [Stage("own", ("mine", "two"))]
    assert pack.joins == {"second": ("mine",)}
    merged = base.merge(pack)
    # The joined stage keeps its place and its cap; the pack's own stages follow.
    assert merged.stages == [Stage("first", ("one",)), Stage("second", ("two", "mine"), 3),
                             Stage("own", ("mine", "two"))]
    assert merged.joins == {}
    # A pack merged before the one whose stage it joins keeps the join.
    assert pack.merge(RulePack("later")).joins == {"second": ("mine",)}


def test_the_reference_example_parses() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "rules.md").read_text()
    example = doc.split("```\n")[1]
    pack = parse_rules(example, "example.bbr")
    assert [r.name for r in pack.rules] == ["forward", "mul_comm", "fold_mul", "hoist_factor"]
    assert [c.rule for c in pack.checks] == ["hoist_factor", "hoist_factor", "fusion"]


def test_the_reference_join_example_joins_the_standard_fuse_stage() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "rules.md").read_text()
    (example,) = [b for b in doc.split("```\n") if "stage fuse +=" in b]
    standard = load_packs([])
    pack = parse_rules(textwrap.dedent(example), "neg_sub.bbr", base=standard)
    fuse = next(s for s in standard.merge(pack).stages if s.name == "fuse")
    assert fuse.rulesets[-1] == "neg_sub"
    assert fuse.iterations == next(s for s in standard.stages if s.name == "fuse").iterations
