"""The e-graph engine: rules compiled to egglog, analyses, guards, staged budgeted saturation."""

from __future__ import annotations

import math

import pytest

from bbrules.ir import rename_axes
from bbrules.engine import Budget, Saturator, compile_pack
from bbrules.options import Options
from bbrules.errors import SourceError
from bbrules.frontend import parse_program
from bbrules.ir import (SUM, BlockReduce, Binary, Const, Dot, Load, Reduce, Tuple, Get, Unary,
                        type_of)
from bbrules.lower import lower
from bbrules.rule import PVar, Rule, RulePack, Stage
from bbrules.rulefile import parse_rules

A = Load("A", ("q", "k"))
B = Load("B", ("q",))
C = Load("C", ("k",))
DIMS = {"q": (8, 4), "k": (16, 4), "d": (4, 4)}


def saturate(text: str, terms: dict, dims=DIMS, budget: Budget = Budget(),
             options: Options = Options()):
    pack = parse_rules(text, "test.bbr")
    sat = Saturator(compile_pack(pack), dims, options)
    sat.add_terms(terms)
    stats = sat.run(budget)
    return sat, stats, sat.freeze()


def test_rule_rewrites_and_keeps_both_forms():
    hoist = Reduce("k", SUM, Binary("mul", BlockReduce("sum", "k", A), B))
    out = Binary("mul", Reduce("k", SUM, BlockReduce("sum", "k", A)), B)
    _, stats, g = saturate(
        "rule hoist: reduce(?a, sum, ?x * ?s) => reduce(?a, sum, ?x) * ?s "
        "when ?a not in deps(?s)", {"t": hoist})
    assert g.lookup(out) == g.named["t"]
    assert g.lookup(hoist) == g.named["t"]
    assert stats[-1].stop == "saturated"
    assert stats[-1].matches == {"hoist": 1}


def test_firings_are_recorded_with_their_class_bindings_and_iteration():
    hoist = Reduce("k", SUM, Binary("mul", BlockReduce("sum", "k", A), B))
    sat, _, _ = saturate(
        "rule hoist: reduce(?a, sum, ?x * ?s) => reduce(?a, sum, ?x) * ?s "
        "when ?a not in deps(?s)\n"
        "rule one: reduce(?a, sum, ?x) * ?s => reduce(?a, sum, ?x) * ?s * 1.0", {"t": hoist})
    g = sat.freeze(provenance=True)
    x = g.lookup(BlockReduce("sum", "k", A))
    by_rule = {(sat.compiled.egg_rules[f.ruleset], f.values["?x"]): f for f in g.firings()}
    first, second = by_rule["hoist", x], by_rule["one", x]
    assert first.root == g.named["t"] and first.iteration == 1
    assert first.values == {"?x": x, "?s": g.lookup(B), "?a": "k"}
    assert second.iteration == 2  # its left side exists only after hoist
    # `one` also matches reduce(k, sum, x * s) * 1.0, which it built itself.
    assert by_rule["one", g.lookup(Binary("mul", BlockReduce("sum", "k", A), B))].iteration == 3
    assert {s.rule: s.applications for s in sat.rule_stats(g)} == {"hoist": 1, "one": 2}


def test_not_in_deps_guard_blocks_a_factor_that_varies_along_the_loop():
    inner = BlockReduce("sum", "k", Load("D", ("q", "k")))  # deps {q, k}, shape {q}
    t = Reduce("k", SUM, Binary("mul", BlockReduce("sum", "k", A), inner))
    _, stats, g = saturate(
        "rule hoist: reduce(?a, sum, ?x * ?s) => reduce(?a, sum, ?x) * ?s "
        "when ?a not in deps(?s)", {"t": t})
    assert stats[-1].matches == {}
    assert len(g.classes[g.named["t"]]) == 1


def test_positive_shape_guard_sees_exact_shapes():
    text = ("rule split: dot(?a, ?x + ?y, ?z) => dot(?a, ?x, ?z) + dot(?a, ?y, ?z) "
            "when ?a in shape(?x), ?a in shape(?y)")
    spans = Dot("k", Binary("add", A, Load("E", ("k",))), Load("V", ("k", "d")))
    _, _, g = saturate(text, {"t": spans})
    assert g.lookup(Binary("add", Dot("k", A, Load("V", ("k", "d"))),
                           Dot("k", Load("E", ("k",)), Load("V", ("k", "d"))))) == g.named["t"]
    misses = Dot("k", Binary("add", A, B), Load("V", ("k", "d")))
    _, stats, _ = saturate(text, {"t": misses})
    assert stats[-1].matches == {}


def test_analysis_follows_tuples_and_monoid_finalize():
    # get(1, welford-like reduce) must get the shape of its own component, not the union.
    text = """
monoid pair_engine_test(s, t)
  identity = (0.0, 0.0)
  combine  = (a.s + b.s, a.t + b.t)
  finalize = (s, t)
rule hoist_second: get(1, reduce(?a, pair_engine_test, tuple(?x, ?y))) * ?s => ?s * get(1, reduce(?a, pair_engine_test, tuple(?x, ?y))) when ?a not in deps(?s)
"""
    [monoid] = parse_rules(text, "test.bbr").monoids
    pair = Reduce("k", monoid,
                  Tuple((BlockReduce("sum", "k", A), BlockReduce("sum", "k", Load("F", ("k", "d"))))))
    term = Binary("mul", Get(1, pair), Get(0, pair))
    _, stats, g = saturate(text, {"t": term})
    # get(0, pair) depends on q only, not k: the guard holds and the rule fires.
    assert stats[-1].matches == {"hoist_second": 1}
    assert type_of(Get(0, pair)).deps == frozenset("q")


def test_constant_folding_in_the_query_never_divides_by_zero():
    text = "rule fold_div: const(?c) / const(?d) => const(?c / ?d)"
    _, _, g = saturate(text, {"ok": Binary("div", Const(1.0), Const(8.0)),
                              "zero": Binary("div", Const(1.0), Const(0.0))})
    assert g.lookup(Const(0.125)) == g.named["ok"]
    assert len(g.classes[g.named["zero"]]) == 1


def test_a_nan_constant_in_a_rule_or_a_term_reaches_the_e_graph():
    """egglog spells NaN `NaN`: written `nan`, a rule with a NaN constant stopped the engine
    with an unbound name.  (NaN equals nothing, so the classes are looked at, not looked up.)"""
    _, stats, g = saturate("rule keep: ?x * 2.0 => where(1.0, ?x * 2.0, nan)",
                           {"t": Binary("mul", A, Const(2.0)),
                            "n": Binary("add", B, Const(float("nan")))})
    assert stats[-1].matches == {"keep": 1}
    assert {e.kind for e in g.classes[g.named["t"]]} == {"Binary", "Where"}
    [add] = g.classes[g.named["n"]]
    [nan] = g.classes[add.children[1]]
    assert nan.kind == "Const" and math.isnan(nan.attrs[0])


def test_axis_sizes_are_per_program():
    text = "rule mean: reduce(?e, sum, ?x) * const(?c) => reduce(?e, sum, ?x) * const(?c * trips(?e)) when ?c == 1 / extent(?e)"
    t = Binary("mul", Reduce("k", SUM, BlockReduce("sum", "k", A)), Const(1 / 16))
    _, stats, g = saturate(text, {"t": t})
    assert stats[-1].matches == {"mean": 1}
    assert g.lookup(Binary("mul", Reduce("k", SUM, BlockReduce("sum", "k", A)),
                           Const(0.25))) == g.named["t"]
    _, stats, _ = saturate(text, {"t": t}, dims={**DIMS, "k": (32, 4)})
    assert stats[-1].matches == {}


def test_forwarding_follows_renamed_references():
    prog = lower(parse_program("""
dim s = 16 / 4
dim t = 16 / 4
dim d = 4
input X[s, d] : f32
T[s, d] = X[s, d] * 2.0
Y[s, t] = sum[d] T[s, d] * T[t, d]
output Y
""", "renamed.bbp"))
    sat = Saturator(compile_pack(parse_rules("rule forward: load(store(?v)) => ?v", "f.bbr")),
                    {n: (d.extent, d.block) for n, d in prog.dims.items()})
    sat.add_terms({k.tensor: k.value for k in prog.stores},
                  {k.tensor: (k.axes, k.value) for k in prog.stores})
    sat.run()
    g = sat.freeze()
    forwarded = Reduce("d", SUM, Dot("d", Binary("mul", Load("X", ("s", "d")), Const(2.0)),
                                       Binary("mul", Load("X", ("t", "d")), Const(2.0))))
    assert g.lookup(forwarded) == g.named["Y"]


def test_rename_axes_refuses_to_capture():
    v = Reduce("d", SUM, Dot("d", Load("X", ("s", "d")), Load("Y", ("t", "d"))))
    assert rename_axes(v, {"s": "t", "t": "s"}) == Reduce(
        "d", SUM, Dot("d", Load("X", ("t", "d")), Load("Y", ("s", "d"))))
    assert rename_axes(v, {"s": "d"}) is None


def test_stages_run_in_order_and_report_iterations():
    text = """
ruleset first
rule a_to_b: exp(?x) => exp(?x) * 1.0
ruleset second
rule drop_one: ?x * 1.0 => ?x
stage one: first
stage two: second
"""
    sat, stats, g = saturate(text, {"t": Unary("exp", B)})
    assert [s.stage for s in stats] == ["one", "two"]
    assert stats[0].matches == {"a_to_b": 1} and stats[1].matches == {"drop_one": 1}
    assert all(s.stop == "saturated" for s in stats)
    assert [r for _, r, _ in sat.fired] == ["a_to_b", "drop_one"]


def _chain(n: int) -> Binary:
    term = Load("X0", ("q",))
    for i in range(1, n):
        term = Binary("add", term, Load(f"X{i}", ("q",)))
    return term


EXPLODE = """
rule add_comm: ?x + ?y => ?y + ?x
rule add_assoc: (?x + ?y) + ?z <=> ?x + (?y + ?z)
"""


def test_node_budget_stops_an_exploding_pack():
    _, stats, g = saturate(EXPLODE, {"t": _chain(14)}, budget=Budget(nodes=3_000))
    assert stats[-1].stop == "node limit"
    assert 1_000 < g.n_nodes <= 3_000  # an iteration too big for what is left runs by rule


def test_iteration_and_time_budgets():
    _, stats, _ = saturate(EXPLODE, {"t": _chain(14)}, budget=Budget(iterations=2))
    assert (stats[-1].iterations, stats[-1].stop) == (2, "iteration limit")
    _, stats, _ = saturate(EXPLODE, {"t": _chain(14)}, budget=Budget(seconds=0.0))
    assert (stats[-1].iterations, stats[-1].stop) == (1, "time limit")


def test_a_stage_cap_lower_than_the_budget_wins():
    pack = parse_rules(EXPLODE + "stage ac: t iterations 1\n", "t.bbr")
    sat = Saturator(compile_pack(pack), DIMS)
    sat.add_terms({"t": _chain(6)})
    stats = sat.run(Budget(iterations=50))
    assert (stats[0].iterations, stats[0].stop) == (1, "iteration limit")


_TWO_STAGES = EXPLODE + """
ruleset other
rule noop: exp(?x) => exp(?x)
stage ac: t
stage later: other
"""


def test_a_stage_over_its_node_share_leaves_the_later_stages_theirs():
    sat = Saturator(compile_pack(parse_rules(_TWO_STAGES, "t.bbr")), DIMS)
    sat.add_terms({"t": _chain(14)})
    stats = sat.run(Budget(nodes=500, iterations=50))
    # Both stages may run 50 iterations: the first gets half of the nodes.
    assert [s.stop for s in stats] == ["node limit", "saturated"]
    assert stats[0].enodes <= 500 // 2 + 40


def test_stages_after_the_whole_budget_is_spent_are_skipped():
    sat = Saturator(compile_pack(parse_rules(_TWO_STAGES, "t.bbr")), DIMS)
    sat.add_terms({"t": _chain(14)})
    stats = sat.run(Budget(seconds=0.0, iterations=50))
    assert [s.stop for s in stats] == ["time limit", "skipped (time limit)"]


def test_backoff_bans_a_rule_that_matches_too_much():
    sat, stats, _ = saturate(EXPLODE, {"t": _chain(6)}, budget=Budget(iterations=4),
                             options=Options(match_limit=3))
    per_iteration = {}
    for it, rule, n in sat.fired:
        per_iteration.setdefault(rule, []).append(it)
    # add_comm matches the 5 additions (> 3) in iteration 1 and sits out the next ones.
    assert per_iteration["add_comm"][0] == 1
    assert 2 not in per_iteration["add_comm"]


def test_rule_compile_errors_are_source_errors():
    bad = Rule("bare", PVar("?x"), PVar("?x"))
    with pytest.raises(SourceError, match="bare variable"):
        compile_pack(RulePack("p", [bad], stages=[Stage("s", ("default",))]))


def test_two_packs_may_give_one_monoid_name_different_meanings():
    """No registry: each pack's e-graph reads its monoid names back as its own definitions."""
    def pack(op: str):
        return parse_rules(f"monoid acc_engine_test(s)\n  identity = (0.0)\n"
                           f"  combine = ({op}(a.s, b.s))\n  finalize = (s)\n"
                           f"rule keep: reduce(?a, acc_engine_test, ?x) => "
                           f"reduce(?a, acc_engine_test, ?x)\n", "p.bbr")
    add, big = pack("add"), pack("max")
    assert add.monoids[0] != big.monoids[0]
    for p in (add, big):
        term = Reduce("k", p.monoids[0], BlockReduce("sum", "k", A))
        sat = Saturator(compile_pack(p), DIMS)
        sat.add_terms({"t": term})
        sat.run()
        g = sat.freeze()
        [node] = [n for n in g.classes[g.named["t"]] if n.kind == "Reduce"]
        assert node.attrs[1] is p.monoids[0]
