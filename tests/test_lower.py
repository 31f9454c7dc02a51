"""Lowering: the unfused block program of each statement, and the form of its reductions."""

from __future__ import annotations

from pathlib import Path

import pytest

from bbrules.frontend import load_program, parse_program
from bbrules.ir import (MAX, MIN, SUM, Binary, BlockReduce, Const, Dot, Load, Node, Reduce, Store,
                        Unary, postorder, shape, validate)
from bbrules.lower import lower

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

Q, K, V = Load("Q", ("q", "d")), Load("K", ("k", "d")), Load("V", ("k", "d"))


def lowered(body: str) -> list[Store]:
    """The kernels of a program over a few small dims and tensors."""
    p = parse_program("""\
dim q = 8 / 4
dim k = 12 / 4
dim d = 4 / 2
input Q[q, d], K[k, d], V[k, d], s[d], w[k] : f32
""" + body)
    return list(lower(p).stores)


def test_attention_lowers_to_one_kernel_per_statement():
    p = lower(load_program(EXAMPLES / "attention.bbp"))
    S, M, E, L, P = (Load(t, ax) for t, ax in [("S", ("q", "k")), ("M", ("q",)),
                                               ("E", ("q", "k")), ("L", ("q",)),
                                               ("P", ("q", "k"))])
    assert p.stores == (
        Store("S", ("q", "k"), Binary("mul", Reduce("d", SUM, Dot("d", Q, K)), Const(0.125))),
        Store("M", ("q",), Reduce("k", MAX, BlockReduce("max", "k", S))),
        Store("E", ("q", "k"), Unary("exp", Binary("sub", S, M))),
        Store("L", ("q",), Reduce("k", SUM, BlockReduce("sum", "k", E))),
        Store("P", ("q", "k"), Binary("div", E, L)),
        Store("O", ("q", "d"), Reduce("k", SUM, Dot("k", P, V))),
    )
    assert p.outputs == ("O",)
    assert p.tensors["S"].role == "temp"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.bbp")))
def test_every_example_lowers_to_a_valid_program_with_dots_for_its_contractions(name):
    program = load_program(EXAMPLES / name)
    block = lower(program)
    validate(block)
    assert [k.tensor for k in block.stores] == [s.target for s in program.statements]
    # a block matmul: neither operand is a 3-axis tile (an axis of block 1, like a head axis,
    # is not a dimension of the tile); rotating a head's halves (RoPE, read through a view) is
    # a matmul batched over the query block: [q, p, i] tiles
    widest = 3 if any(t.role == "view" for t in block.tensors.values()) else 2
    for k in block.stores:
        for n in postorder(k.value):
            if isinstance(n, Dot):
                for operand in (n.x, n.y):
                    assert len([a for a in shape(operand) if block.dims[a].block > 1]) <= widest


def test_matmuls_of_the_ffn_are_dots():
    block = lower(load_program(EXAMPLES / "rmsnorm_ffn_swiglu.bbp"))
    kernels = {k.tensor: k.value for k in block.stores}
    assert kernels["A"] == Reduce("e", SUM, Dot("e", Load("XN", ("m", "e")),
                                                  Load("W1", ("e", "f"))))
    assert kernels["Y"] == Reduce("f", SUM, Dot("f", Load("H", ("m", "f")),
                                                  Load("W2", ("f", "n"))))


def test_renamed_reference_loads_under_its_use_names():
    block = lower(load_program(EXAMPLES / "self_attention.bbp"))
    assert block.stores[0].value == Binary(
        "div", Reduce("d", SUM, Dot("d", Load("X", ("s", "d")), Load("X", ("t", "d")))),
        Unary("sqrt", Const(64.0)))


def test_factors_not_spanning_the_axis_leave_the_sum():
    [k] = lowered("T[q, d] = sum[k] 2 * Q[q, d] * V[k, d] / s[d]\noutput T\n")
    # applied to the loop's result in source order: 2 and Q multiply, s divides
    loop = Reduce("k", SUM, BlockReduce("sum", "k", V))
    assert k.value == Binary("div", Binary("mul", Binary("mul", loop, Const(2.0)), Q),
                             Load("s", ("d",)))


def test_contraction_operands_stay_two_axis():
    # Q * K would be a [q, k, d] tile: s joins a side where both operands stay 2-axis.
    s = Load("s", ("d",))
    [k] = lowered("S[q, k] = sum[d] Q[q, d] * K[k, d] * s[d]\noutput S\n")
    assert k.value == Reduce("d", SUM, Dot("d", Q, Binary("mul", K, s)))
    [k] = lowered("S[q, k] = sum[d] s[d] * Q[q, d] * K[k, d]\noutput S\n")
    assert k.value == Reduce("d", SUM, Dot("d", Binary("mul", s, Q), K))


def test_divisors_spanning_the_axis_become_reciprocals_in_the_dot():
    [k] = lowered("S[q, k] = sum[d] Q[q, d] / K[k, d]\noutput S\n")
    assert k.value == Reduce("d", SUM, Dot("d", Q, Unary("recip", K)))


def test_max_and_min_reduce_the_whole_body():
    [k] = lowered("T[q] = max[d] Q[q, d] * 2\noutput T\n")
    assert k.value == Reduce("d", MAX, BlockReduce("max", "d", Binary("mul", Q, Const(2.0))))
    [k] = lowered("T[d] = min[k] V[k, d]\noutput T\n")
    assert k.value == Reduce("k", MIN, BlockReduce("min", "k", V))


def test_a_sum_over_two_axes_contracts_the_larger_block():
    # Written minor-last, as an interleaved RoPE's head axis: pairs (p, blocks of 1) of
    # 32-element halves.  Contracting the pairs would give a [q, k, i] tile; contracting i,
    # the tile is [q, k] and the pairs are summed block by block around it.
    def contraction(sums: str, i: str, p: str) -> Node:
        [k] = lower(parse_program(f"""\
dim q = 64 / 64
dim k = 64 / 64
dim i = {i}
dim p = {p}
input A[q, i, p], B[k, i, p] : f32
S[q, k] = sum[{sums}] A[q, i, p] * B[k, i, p]
output S
""")).stores
        return k.value

    a, b = Load("A", ("q", "i", "p")), Load("B", ("k", "i", "p"))
    i_inside = Reduce("p", SUM, BlockReduce("sum", "p", Reduce("i", SUM, Dot("i", a, b))))
    assert contraction("i, p", "32", "2 / 1") == i_inside
    assert contraction("p, i", "32", "2 / 1") == i_inside
    # of equal blocks, the axis written last
    assert contraction("i, p", "4 / 2", "6 / 2") == Reduce(
        "i", SUM, BlockReduce("sum", "i", Reduce("p", SUM, Dot("p", a, b))))


def test_nested_reductions_stay_in_one_kernel():
    [k] = lowered("T[q] = sum[k] w[k] * (max[d] Q[q, d] * V[k, d])\noutput T\n")
    inner = Reduce("d", MAX, BlockReduce("max", "d", Binary("mul", Q, V)))
    assert k.value == Reduce("k", SUM, Dot("k", Load("w", ("k",)), inner))


def test_subtraction_division_and_functions_are_elementwise_nodes():
    [k] = lowered("T[q, d] = max(Q[q, d] - s[d], 0) / -s[d]\noutput T\n")
    s = Load("s", ("d",))
    assert k.value == Binary("div", Binary("max", Binary("sub", Q, s), Const(0.0)),
                             Unary("neg", s))
