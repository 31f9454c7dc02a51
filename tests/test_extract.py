"""Extraction by exact cost: the right program out of a saturated e-graph, and only valid ones."""

from __future__ import annotations

from pathlib import Path

import pytest

import bbrules.extract as extract_module
from bbrules.cost import cost_program
from bbrules.engine import Budget, ClassGraph, ENode, Saturator, compile_pack
from bbrules.extract import NoCandidate, extract
from bbrules.frontend import load_program
from bbrules.ir import (BlockProgram, BlockReduce, Binary, Const, Dot, Load, Reduce, Store,
                        TensorDecl, Tuple, Unary, Dim, show_program)
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.rulefile import parse_rules
from bbrules.targets import get_target

EXAMPLES = Path(__file__).parent.parent / "examples"
H100 = get_target("h100")


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


def saturated(program: BlockProgram, pack) -> ClassGraph:
    sat = Saturator(compile_pack(pack), {n: (d.extent, d.block) for n, d in program.dims.items()})
    sat.add_terms({k.tensor: k.value for k in program.kernels},
                  {k.tensor: (k.axes, k.value) for k in program.kernels})
    sat.run(Budget())
    return sat.freeze()


def attention_terms():
    q, k, v = Load("Q", ("q", "d")), Load("K", ("k", "d")), Load("V", ("k", "d"))
    s = Binary("mul", Reduce("d", "sum", Dot("d", q, k)), Const(0.125))
    m = Reduce("k", "max", BlockReduce("max", "k", s))
    e = Unary("exp", Binary("sub", s, m))
    den = Reduce("k", "sum", BlockReduce("sum", "k", e))
    three_pass = Reduce("k", "sum", Dot("k", Binary("div", e, den), v))
    bm = BlockReduce("max", "k", s)
    eb = Unary("exp", Binary("sub", s, bm))
    two_loops = Binary("div", Reduce("k", "online", Tuple((bm, Dot("k", eb, v)))),
                       Reduce("k", "online", Tuple((bm, BlockReduce("sum", "k", eb)))))
    return three_pass, two_loops


def with_output(p: BlockProgram, value) -> BlockProgram:
    tensors = {n: t for n, t in p.tensors.items() if t.role != "temp"}
    return BlockProgram(p.dims, tensors, (Store("O", ("q", "d"), value),), p.outputs,
                        {"online": extract_module.MONOIDS["online"]})


def test_three_pass_and_two_loop_forms_are_in_the_egraph_but_not_extracted(pack):
    p = lower(load_program(EXAMPLES / "attention.bbp"))
    g = saturated(p, pack)
    three_pass, two_loops = attention_terms()
    assert g.lookup(three_pass) == g.named["O"]
    assert g.lookup(two_loops) == g.named["O"]
    fused, cost, _ = extract(g, p, H100)
    (kernel,) = fused.kernels
    assert kernel.value not in (three_pass, two_loops)
    assert isinstance(kernel.value, Reduce) and kernel.value.monoid == "softmax"
    # Both rejected forms are legal one-kernel programs, just costlier.
    for value in (three_pass, two_loops):
        other = cost_program(with_output(p, value), H100)
        assert other.legal and other.n_kernels == 1
        assert other.key() > cost.key()
    # Three passes load K in each of the max, sum and output loops: nearly twice the traffic.
    assert cost_program(with_output(p, three_pass), H100).traffic > 1.9 * cost.traffic


@pytest.mark.parametrize("example", ["attention.bbp", "softmax.bbp", "rmsnorm_matmul.bbp"])
def test_local_search_agrees_with_exhaustive_search(pack, example, monkeypatch):
    p = lower(load_program(EXAMPLES / example))
    g = saturated(p, pack)
    exhaustive, cost_a, stats_a = extract(g, p, H100)
    monkeypatch.setattr(extract_module, "EXHAUSTIVE_LIMIT", 0)
    local, cost_b, stats_b = extract(g, p, H100)
    assert (stats_a.method, stats_b.method) == ("exhaustive", "local search")
    assert stats_b.candidates < stats_a.candidates
    assert cost_b.key() == cost_a.key()


def test_never_costlier_than_the_input():
    # A pack whose only rule makes things worse: the input comes back unchanged.
    worse = parse_rules("rule pessimise: exp(?x) => exp(?x) * 1.0", "worse.bbr")
    p = lower(load_program(EXAMPLES / "softmax.bbp"))
    g = saturated(p, worse)
    fused, cost, _ = extract(g, p, H100)
    assert fused.kernels == p.kernels
    assert cost.key() == cost_program(p, H100).key()


def test_max_kernels_bounds_the_result(pack):
    p = lower(load_program(EXAMPLES / "softmax.bbp", {"c": (4096, 64)}))
    g = saturated(p, pack)
    free, free_cost, _ = extract(g, p, H100)
    one, one_cost, _ = extract(g, p, H100, max_kernels=1)
    assert len(free.kernels) > 1
    assert len(one.kernels) == 1 and one_cost.legal
    assert one_cost.key() > free_cost.key()
    with pytest.raises(NoCandidate):
        extract(g, p, H100, max_kernels=0)


def test_extraction_is_deterministic(pack):
    p = lower(load_program(EXAMPLES / "layernorm_matmul.bbp"))
    texts = {show_program(extract(saturated(p, pack), p, H100)[0]) for _ in range(2)}
    assert len(texts) == 1


def test_ill_scoped_candidates_are_rejected():
    # A hand-made e-graph whose root class also holds a node of the wrong shape (a cheaper
    # one-axis load): extraction must recompute types and refuse it.
    dims = {"q": Dim("q", 8, 4), "k": Dim("k", 8, 4)}
    tensors = {"A": TensorDecl("A", ("q", "k"), role="input"),
               "B": TensorDecl("B", ("q",), role="input"),
               "O": TensorDecl("O", ("q", "k"), role="output")}
    value = Unary("exp", Load("A", ("q", "k")))
    p = BlockProgram(dims, tensors, (Store("O", ("q", "k"), value),), ("O",))
    graph = ClassGraph({0: (ENode("Unary", ("exp",), (1,)), ENode("Load", ("B", ("q",)), ())),
                        1: (ENode("Load", ("A", ("q", "k")), ()),)}, {"O": 0})
    fused, _, stats = extract(graph, p, H100)
    assert fused.kernels == p.kernels
    assert stats.rejected >= 1
