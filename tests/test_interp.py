"""The reference interpreter against plain numpy, on hand-built block programs."""

from __future__ import annotations

import numpy as np
import pytest

from bbrules.interp import run
from bbrules.ir import (Binary, BlockProgram, BlockReduce, Const, Dim, Dot, Get, Load, Monoid,
                        Reduce, Store, TensorDecl, Tuple, Unary, Var)

RTOL, ATOL = 1e-4, 1e-5


def program(dims: dict[str, tuple[int, int]], inputs: dict[str, tuple[str, ...]],
            kernels: list[Store], outputs: tuple[str, ...],
            monoids: tuple[Monoid, ...] = ()) -> BlockProgram:
    """A block program whose stored tensors are declared by their kernels."""
    tensors = {n: TensorDecl(n, axes, "f32", "input") for n, axes in inputs.items()}
    for k in kernels:
        tensors[k.tensor] = TensorDecl(k.tensor, k.axes, "f32",
                                       "output" if k.tensor in outputs else "temp")
    return BlockProgram({n: Dim(n, e, b) for n, (e, b) in dims.items()}, tensors,
                        tuple(kernels), outputs, {m.name: m for m in monoids})


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def add(x, y):
    return Binary("add", x, y)


def sub(x, y):
    return Binary("sub", x, y)


def mul(x, y):
    return Binary("mul", x, y)


def div(x, y):
    return Binary("div", x, y)


def matmul(a: Load, b: Load, axis: str) -> Reduce:
    return Reduce(axis, "sum", Dot(axis, a, b))


def test_elementwise_broadcasts_by_axis_name_and_stores_in_declared_order():
    a, b = rand(12, 8), rand(12, seed=1)
    value = Unary("exp", sub(Load("A", ("q", "k")), Load("B", ("q",))))
    p = program({"q": (12, 4), "k": (8, 2)}, {"A": ("q", "k"), "B": ("q",)},
                [Store("T", ("k", "q"), value)], ("T",))
    out = run(p, {"A": a, "B": b})["T"]
    assert out.dtype == np.float32 and out.shape == (8, 12)
    np.testing.assert_allclose(out, np.exp(a - b[:, None]).T, rtol=RTOL, atol=ATOL)


def test_blocked_matmul_with_non_square_blocks():
    a, w = rand(12, 20), rand(20, 6, seed=1)
    p = program({"m": (12, 4), "e": (20, 5), "n": (6, 3)}, {"A": ("m", "e"), "W": ("e", "n")},
                [Store("C", ("m", "n"), matmul(Load("A", ("m", "e")), Load("W", ("e", "n")), "e"))],
                ("C",))
    np.testing.assert_allclose(run(p, {"A": a, "W": w})["C"], a @ w, rtol=RTOL, atol=ATOL)


def test_renamed_loads_read_the_block_of_the_use_axis():
    x = rand(16, 8)
    dims = {"s": (16, 4), "q": (16, 4), "k": (16, 4), "d": (8, 8)}
    gram = matmul(Load("X", ("q", "d")), Load("X", ("k", "d")), "d")
    p = program(dims, {"X": ("s", "d")}, [Store("G", ("q", "k"), gram)], ("G",))
    np.testing.assert_allclose(run(p, {"X": x})["G"], x @ x.T, rtol=RTOL, atol=ATOL)


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    s = q.astype(np.float64) @ k.T * 0.125
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)) @ v


ATTN_DIMS = {"q": (16, 4), "k": (24, 8), "d": (8, 8)}
ATTN_INPUTS = {"Q": ("q", "d"), "K": ("k", "d"), "V": ("k", "d")}


def attn_inputs() -> dict[str, np.ndarray]:
    return {"Q": rand(16, 8), "K": rand(24, 8, seed=1), "V": rand(24, 8, seed=2)}


def test_unfused_attention_returns_every_stored_tensor():
    s = Load("S", ("q", "k"))
    kernels = [
        Store("S", ("q", "k"), mul(matmul(Load("Q", ("q", "d")), Load("K", ("k", "d")), "d"),
                                   Const(0.125))),
        Store("M", ("q",), Reduce("k", "max", BlockReduce("max", "k", s))),
        Store("E", ("q", "k"), Unary("exp", sub(s, Load("M", ("q",))))),
        Store("L", ("q",), Reduce("k", "sum", BlockReduce("sum", "k", Load("E", ("q", "k"))))),
        Store("P", ("q", "k"), div(Load("E", ("q", "k")), Load("L", ("q",)))),
        Store("O", ("q", "d"), matmul(Load("P", ("q", "k")), Load("V", ("k", "d")), "k")),
    ]
    x = attn_inputs()
    out = run(program(ATTN_DIMS, ATTN_INPUTS, kernels, ("O",)), x)
    assert set(out) == {"S", "M", "E", "L", "P", "O"}
    s_ref = x["Q"] @ x["K"].T * 0.125
    np.testing.assert_allclose(out["S"], s_ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["M"], s_ref.max(axis=1), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["O"], attention_reference(x["Q"], x["K"], x["V"]),
                               rtol=RTOL, atol=ATOL)


def online_softmax() -> Monoid:
    """State (running max m, denominator l, numerator o); finalize to (o / l, logsumexp)."""
    am, bm, al, bl, ao, bo = (Var(v) for v in ("a.m", "b.m", "a.l", "b.l", "a.o", "b.o"))
    new_m = Binary("max", am, bm)
    sa, sb = Unary("exp", sub(am, new_m)), Unary("exp", sub(bm, new_m))
    return Monoid("online_softmax_test", ("m", "l", "o"),
                  (Const(float("-inf")), Const(0.0), Const(0.0)),
                  (new_m, add(mul(al, sa), mul(bl, sb)), add(mul(ao, sa), mul(bo, sb))),
                  (div(Var("o"), Var("l")), add(Var("m"), Unary("log", Var("l")))))


def test_multi_component_monoid_gives_one_pass_attention_and_get_reads_each_result():
    s = mul(matmul(Load("Q", ("q", "d")), Load("K", ("k", "d")), "d"), Const(0.125))
    m = BlockReduce("max", "k", s)
    e = Unary("exp", sub(s, m))
    body = Tuple((m, BlockReduce("sum", "k", e), Dot("k", e, Load("V", ("k", "d")))))
    flash = Reduce("k", "online_softmax_test", body)
    kernels = [Store("O", ("q", "d"), Get(0, flash)),
               Store("OL", ("q", "d"), add(Get(0, flash), Get(1, flash)))]
    x = attn_inputs()
    out = run(program(ATTN_DIMS, ATTN_INPUTS, kernels, ("O", "OL"), (online_softmax(),)), x)
    o_ref = attention_reference(x["Q"], x["K"], x["V"])
    np.testing.assert_allclose(out["O"], o_ref, rtol=RTOL, atol=ATOL)
    s_ref = x["Q"].astype(np.float64) @ x["K"].T * 0.125
    lse = s_ref.max(axis=1) + np.log(np.exp(s_ref - s_ref.max(axis=1, keepdims=True)).sum(axis=1))
    np.testing.assert_allclose(out["OL"], o_ref + lse[:, None], rtol=RTOL, atol=ATOL)


def welford() -> Monoid:
    """State (count n, mean, M2); finalize to (mean, variance)."""
    an, bn, amu, bmu, am2, bm2 = (Var(v) for v in ("a.n", "b.n", "a.mean", "b.mean", "a.m2",
                                                     "b.m2"))
    n = add(an, bn)
    delta = sub(bmu, amu)
    return Monoid("welford_test", ("n", "mean", "m2"), (Const(0.0), Const(0.0), Const(0.0)),
                  (n, add(amu, div(mul(delta, bn), n)),
                   add(add(am2, bm2), div(mul(mul(Unary("square", delta), an), bn), n))),
                  (Var("mean"), div(Var("m2"), Var("n"))))


def test_welford_monoid_gives_mean_and_variance_in_one_loop():
    x = rand(6, 32) + 100.0
    xs = Load("X", ("m", "e"))
    block_mean = mul(BlockReduce("sum", "e", xs), Const(1 / 8))
    body = Tuple((Const(8.0), block_mean,
                  BlockReduce("sum", "e", Unary("square", sub(xs, block_mean)))))
    stats = Reduce("e", "welford_test", body)
    kernels = [Store("MU", ("m",), Get(0, stats)), Store("VAR", ("m",), Get(1, stats))]
    p = program({"m": (6, 3), "e": (32, 8)}, {"X": ("m", "e")}, kernels, ("MU", "VAR"),
                (welford(),))
    out = run(p, {"X": x})
    np.testing.assert_allclose(out["MU"], x.mean(axis=1), rtol=RTOL)
    np.testing.assert_allclose(out["VAR"], x.astype(np.float64).var(axis=1), rtol=1e-3)


def test_loop_invariant_body_is_still_folded_once_per_block():
    a = rand(8, 4)
    body = Reduce("d", "sum", BlockReduce("sum", "d", Load("A", ("q", "d"))))
    p = program({"q": (8, 4), "d": (4, 2), "k": (20, 4)}, {"A": ("q", "d")},
                [Store("R", ("q",), Reduce("k", "sum", body))], ("R",))
    np.testing.assert_allclose(run(p, {"A": a})["R"], 5 * a.sum(axis=1), rtol=RTOL, atol=ATOL)


def test_reduce_over_a_grid_axis_restores_the_grid_block_index():
    s = rand(8, 12)
    row_max = Reduce("k", "max", BlockReduce("max", "k", Load("S", ("q", "k"))))
    value = Unary("exp", add(Unary("neg", row_max), Load("S", ("q", "k"))))
    p = program({"q": (8, 4), "k": (12, 4)}, {"S": ("q", "k")},
                [Store("E", ("q", "k"), value)], ("E",))
    np.testing.assert_allclose(run(p, {"S": s})["E"], np.exp(s - s.max(axis=1, keepdims=True)),
                               rtol=RTOL, atol=ATOL)


def test_half_precision_inputs_are_computed_in_float32():
    a = rand(8, 4).astype(np.float16)
    p = program({"q": (8, 4), "d": (4, 2)}, {"A": ("q", "d")},
                [Store("B", ("q", "d"), mul(Load("A", ("q", "d")), Const(3.0)))], ("B",))
    out = run(p, {"A": a})["B"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, a.astype(np.float32) * 3)


@pytest.mark.parametrize("inputs, message", [
    ({}, "missing input 'A'"),
    ({"A": np.zeros((4, 8), np.float32)}, r"input 'A' has shape \(4, 8\)"),
])
def test_bad_inputs_are_reported(inputs, message):
    p = program({"q": (8, 4), "d": (4, 2)}, {"A": ("q", "d")},
                [Store("B", ("q", "d"), Load("A", ("q", "d")))], ("B",))
    with pytest.raises(ValueError, match=message):
        run(p, inputs)
