"""The reference interpreter against plain numpy, on hand-built block programs."""

from __future__ import annotations

import numpy as np
import pytest

from bbrules.interp import run
from bbrules.ir import SUM, MAX, BlockReduce, Const, Get, Load, Reduce, Store, Unary, Var

from irbuild import (ATTENTION_INPUTS, add, attention_reference, div, matmul, mul,
                     online_softmax, program, rand, softmax_fold, sub, welford_stats)

RTOL, ATOL = 1e-4, 1e-5


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


ATTN_DIMS = {"q": (16, 4), "k": (24, 8), "d": (8, 8)}


def attn_inputs() -> dict[str, np.ndarray]:
    return {"Q": rand(16, 8), "K": rand(24, 8, seed=1), "V": rand(24, 8, seed=2)}


def test_unfused_attention_returns_every_stored_tensor():
    s = Load("S", ("q", "k"))
    kernels = [
        Store("S", ("q", "k"), mul(matmul(Load("Q", ("q", "d")), Load("K", ("k", "d")), "d"),
                                   Const(0.125))),
        Store("M", ("q",), Reduce("k", MAX, BlockReduce("max", "k", s))),
        Store("E", ("q", "k"), Unary("exp", sub(s, Load("M", ("q",))))),
        Store("L", ("q",), Reduce("k", SUM, BlockReduce("sum", "k", Load("E", ("q", "k"))))),
        Store("P", ("q", "k"), div(Load("E", ("q", "k")), Load("L", ("q",)))),
        Store("O", ("q", "d"), matmul(Load("P", ("q", "k")), Load("V", ("k", "d")), "k")),
    ]
    x = attn_inputs()
    out = run(program(ATTN_DIMS, ATTENTION_INPUTS, kernels, ("O",)), x)
    assert set(out) == {"S", "M", "E", "L", "P", "O"}
    s_ref = x["Q"] @ x["K"].T * 0.125
    np.testing.assert_allclose(out["S"], s_ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["M"], s_ref.max(axis=1), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["O"], attention_reference(x["Q"], x["K"], x["V"], 0.125),
                               rtol=RTOL, atol=ATOL)


# Finalizes to (o / l, logsumexp): two results, each read by its own Get.
LSE_SOFTMAX = online_softmax("online_softmax_test",
                             (div(Var("o"), Var("l")), add(Var("m"), Unary("log", Var("l")))))


def test_multi_component_monoid_gives_one_pass_attention_and_get_reads_each_result():
    s = mul(matmul(Load("Q", ("q", "d")), Load("K", ("k", "d")), "d"), Const(0.125))
    flash = softmax_fold(LSE_SOFTMAX, s, Load("V", ("k", "d")))
    kernels = [Store("O", ("q", "d"), Get(0, flash)),
               Store("OL", ("q", "d"), add(Get(0, flash), Get(1, flash)))]
    x = attn_inputs()
    out = run(program(ATTN_DIMS, ATTENTION_INPUTS, kernels, ("O", "OL")), x)
    o_ref = attention_reference(x["Q"], x["K"], x["V"], scale=0.125)
    np.testing.assert_allclose(out["O"], o_ref, rtol=RTOL, atol=ATOL)
    s_ref = x["Q"].astype(np.float64) @ x["K"].T * 0.125
    lse = s_ref.max(axis=1) + np.log(np.exp(s_ref - s_ref.max(axis=1, keepdims=True)).sum(axis=1))
    np.testing.assert_allclose(out["OL"], o_ref + lse[:, None], rtol=RTOL, atol=ATOL)


def test_welford_monoid_gives_mean_and_variance_in_one_loop():
    x = rand(6, 32) + 100.0
    stats = welford_stats(Load("X", ("m", "e")), "e", 8)
    kernels = [Store("MU", ("m",), Get(0, stats)), Store("VAR", ("m",), Get(1, stats))]
    p = program({"m": (6, 3), "e": (32, 8)}, {"X": ("m", "e")}, kernels, ("MU", "VAR"))
    out = run(p, {"X": x})
    np.testing.assert_allclose(out["MU"], x.mean(axis=1), rtol=RTOL)
    np.testing.assert_allclose(out["VAR"], x.astype(np.float64).var(axis=1), rtol=1e-3)


def test_loop_invariant_body_is_still_folded_once_per_block():
    a = rand(8, 4)
    body = Reduce("d", SUM, BlockReduce("sum", "d", Load("A", ("q", "d"))))
    p = program({"q": (8, 4), "d": (4, 2), "k": (20, 4)}, {"A": ("q", "d")},
                [Store("R", ("q",), Reduce("k", SUM, body))], ("R",))
    np.testing.assert_allclose(run(p, {"A": a})["R"], 5 * a.sum(axis=1), rtol=RTOL, atol=ATOL)


def test_reduce_over_a_grid_axis_restores_the_grid_block_index():
    s = rand(8, 12)
    row_max = Reduce("k", MAX, BlockReduce("max", "k", Load("S", ("q", "k"))))
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
