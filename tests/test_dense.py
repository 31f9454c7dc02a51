"""The dense evaluator against numpy written by hand from the math, at small sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bbrules.dense import evaluate
from bbrules.frontend import load_program, parse_program
from bbrules.inputs import random_inputs
from bbrules.lower import lower

from irbuild import reshaped_dims

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
INV_4096 = 1.0 / 4096  # the norms' mean constant: their width stays 4096 in these tests


def close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal up to float32 rounding: sums over thousands of terms cancel, so near-zero results
    are compared at the scale of the whole array."""
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x * 0.5 * (1.0 + np.tanh(0.5 * x))


def test_attention():
    p = load_program(EXAMPLES / "attention.bbp", {"q": (24, 8), "k": (40, 8), "d": (16, None)})
    x = random_inputs(p, seed=1)
    out = evaluate(p, x)
    s = x["Q"] @ x["K"].T * 0.125
    close(out["S"], s)
    close(out["M"], s.max(axis=1))
    close(out["P"], softmax(s))
    close(out["O"], softmax(s) @ x["V"])
    assert out["O"].dtype == np.float32
    assert set(out) == {"S", "M", "E", "L", "P", "O"}


def test_self_attention_uses_one_tensor_three_ways():
    p = load_program(EXAMPLES / "self_attention.bbp", {"s": (32, 8), "t": (32, 8), "d": (8, None)})
    x = random_inputs(p, seed=2)["X"]
    close(evaluate(p, {"X": x})["O"], softmax(x @ x.T / 8.0) @ x)


def test_layernorm_matmul():
    p = load_program(EXAMPLES / "layernorm_matmul.bbp", {"m": (8, 4), "e": (4096, 64), "n": (16, 8)})
    x = random_inputs(p, seed=3)
    out = evaluate(p, x)
    X = x["X"]
    mu = X.sum(axis=1) * INV_4096
    var = np.square(X - mu[:, None]).sum(axis=1) * INV_4096
    xn = (X - mu[:, None]) / np.sqrt(var[:, None] + 1e-5) * x["G"] + x["B"]
    close(out["MU"], mu)
    close(out["VAR"], var)
    close(out["XN"], xn)
    close(out["Y"], xn @ x["W"])


def test_rmsnorm_ffn_swiglu():
    p = load_program(EXAMPLES / "rmsnorm_ffn_swiglu.bbp",
                     {"m": (8, 4), "e": (4096, 64), "f": (24, 4), "n": (16, None)})
    x = random_inputs(p, seed=4)
    out = evaluate(p, x)
    X = x["X"]
    xn = X / np.sqrt(np.square(X).sum(axis=1, keepdims=True) * INV_4096 + 1e-5) * x["G"]
    h = silu(xn @ x["W1"]) * (xn @ x["W3"])
    close(out["XN"], xn)
    close(out["H"], h)
    close(out["Y"], h @ x["W2"])


def test_softmax_and_gated_mlp():
    p = load_program(EXAMPLES / "softmax.bbp", {"r": (8, 4), "c": (32, 8)})
    x = random_inputs(p)["X"]
    close(evaluate(p, {"X": x})["Y"], softmax(x))

    p = load_program(EXAMPLES / "gated_mlp.bbp",
                     {"m": (8, 4), "e": (16, 8), "f": (16, 8), "n": (8, 4)})
    x = random_inputs(p)
    a, u = x["X"] @ x["W1"], x["X"] @ x["W3"]
    gelu = 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3)))
    close(evaluate(p, x)["Y"], (gelu * u) @ x["W2"])


def test_axes_follow_the_target_order_and_renaming():
    p = parse_program("""\
dim i = 4
dim j = 6 / 2
dim k = 6 / 2
input A[i, j], B[j] : f32
T[j, i] = A[i, j] * B[j] + sum[k] A[i, k] * B[k] / B[j]
output T
""")
    x = random_inputs(p, seed=5)
    a, b = x["A"], x["B"]
    want = (a * b + (a @ b)[:, None] / b).T
    close(evaluate(p, x)["T"], want)


def test_nested_reductions_and_min():
    p = parse_program("""\
dim i = 4
dim j = 6 / 3
input A[i, j] : f32
T[i] = sum[j] A[i, j] * (min[i] A[i, j]) - max[j] abs(A[i, j])
output T
""")
    a = random_inputs(p, seed=6)["A"]
    want = (a * a.min(axis=0)).sum(axis=1) - np.abs(a).max(axis=1)
    close(evaluate(p, {"A": a})["T"], want)


def test_dtype_selects_the_precision():
    p = load_program(EXAMPLES / "layernorm_matmul.bbp", {"m": (4, 2), "e": (8, 4), "n": (4, 2)})
    x = random_inputs(p)
    out64 = evaluate(p, x, dtype=np.float64)
    assert out64["Y"].dtype == np.float64
    close(evaluate(p, x)["Y"], out64["Y"])


def test_random_inputs_are_deterministic_and_shaped_by_extents():
    p = load_program(EXAMPLES / "attention.bbp", {"q": (16, 8), "k": (24, 8), "d": (4, None)})
    a, b, c = random_inputs(p, seed=7), random_inputs(lower(p), seed=7), random_inputs(p, 8)
    assert {n: v.shape for n, v in a.items()} == {"Q": (16, 4), "K": (24, 4), "V": (24, 4)}
    assert all(v.dtype == np.float32 for v in a.values())
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["Q"], c["Q"])
    assert not np.array_equal(a["K"], a["V"])


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.bbp")))
def test_every_example_evaluates_to_finite_values(name):
    program = load_program(EXAMPLES / name)
    fixed = reshaped_dims(program)  # a view fixes the product of their sizes
    small = {d: (min(dim.extent, 16), None if dim.extent == dim.block else min(dim.block, 4))
             for d, dim in program.dims.items() if d not in fixed}
    p = load_program(EXAMPLES / name, small)
    out = evaluate(p, random_inputs(p))
    for o in p.outputs:
        assert np.isfinite(out[o]).all()
        assert out[o].shape == tuple(p.dims[a].extent for a in p.tensors[o].axes)
