"""The forms and functions programs of real models use: mean and multi-axis reductions, scalar
results, named constants, output dtypes, `**`, erf, cos, sin, pow, softplus, elu, exp2, and
predicates over values and positions.

Each is checked four ways against numpy written here: the dense evaluator, and the lowered
program through the reference interpreter, the numpy backend and the CUDA C backend (run by
the emulator in tests/cuda_emu).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.codegen import cuda_gen, numpy_gen
from bbrules.frontend import parse_program
from bbrules.lower import lower
from bbrules.ops import ELEMENTWISE, ROWS_BY_INDEX, TILE_REDUCE

from cuda_emu import emulate

X = np.linspace(-3.0, 3.0, 48, dtype=np.float32).reshape(4, 6, 2)
T, C, P = np.ix_(range(4), range(6), range(2))  # positions along each axis


def outputs(text: str, inputs: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    ast = parse_program(text)
    block = lower(ast)
    return [dense.evaluate(ast, inputs, np.float64), interp.run(block, inputs),
            numpy_gen.run(block, inputs), emulate(cuda_gen.generate(block), inputs)]


HEADER = "dim t = 4 / 2\ndim c = 6 / 3\ndim p = 2\ninput X[t, c, p] : f32\n"

FUNCTIONS = {
    "erf(X[t, c, p])": np.vectorize(math.erf)(X.astype(np.float64)),
    "cos(X[t, c, p])": np.cos(X),
    "sin(X[t, c, p])": np.sin(X),
    "exp2(X[t, c, p])": np.exp2(X),
    "softplus(X[t, c, p])": np.log1p(np.exp(X.astype(np.float64))),
    "elu(X[t, c, p])": np.where(X > 0, X, np.expm1(X.astype(np.float64))),
    "pow(abs(X[t, c, p]), 1.5)": np.abs(X.astype(np.float64)) ** 1.5,
    "abs(X[t, c, p]) ** 1.5": np.abs(X.astype(np.float64)) ** 1.5,
    "-X[t, c, p] ** 2": -(X.astype(np.float64) ** 2),
    "where(X[t, c, p] > 0 and not (X[t, c, p] > 2) or c <= t and p == 1, X[t, c, p], 3)":
        np.where((X > 0) & ~(X > 2) | (C <= T) & (P == 1), X, 3),
}


@pytest.mark.parametrize("expr", FUNCTIONS)
def test_functions_compute_what_numpy_does(expr):
    for got in outputs(HEADER + f"Y[t, c, p] = {expr}\noutput Y\n", {"X": X}):
        np.testing.assert_allclose(got["Y"], FUNCTIONS[expr], rtol=2e-6, atol=3e-7)


def test_mean_and_reductions_over_several_axes():
    text = HEADER + ("M[t] = mean[c, p] X[t, c, p]\nS[p] = sum[t, c] X[t, c, p] * X[t, c, p]\n"
                     "N[] = max[t, c, p] X[t, c, p]\noutput M, S, N\n")
    x = X.astype(np.float64)
    for got in outputs(text, {"X": X}):
        np.testing.assert_allclose(got["M"], x.mean(axis=(1, 2)), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got["S"], (x * x).sum(axis=(0, 1)), rtol=1e-6)
        assert got["N"].shape == () and got["N"] == x.max()


def test_named_constants_scalar_results_and_output_dtypes():
    text = HEADER + ("scale = 1 / 8\nshift = scale * 2 - 0.5\n"
                     "LOSS[] = sum[t] sum[c] sum[p] (X[t, c, p] * scale + shift) ** 2\n"
                     "Y[t, c, p] = X[t, c, p] * LOSS[]\noutput LOSS : f32\noutput Y : bf16\n")
    ast = parse_program(text)
    assert ast.tensors["LOSS"].axes == () and ast.tensors["Y"].dtype == "bf16"
    loss = ((X.astype(np.float64) / 8 - 0.25) ** 2).sum()
    for got in outputs(text, {"X": X}):  # Y within a bf16 rounding where it is stored so
        np.testing.assert_allclose(got["LOSS"], loss, rtol=1e-6)
        np.testing.assert_allclose(got["Y"], X.astype(np.float64) * loss, rtol=2 ** -8)


@pytest.mark.parametrize("order", [(0, 1, 2), (0, 2, 1), (2, 1, 0), (1, 0, 2)])
def test_where_is_laid_out_as_its_value(order):
    """`where` selects what np.where selects, in the memory order of its first value operand:
    the numpy backend's attention scores are column-major, and a mask over them written in C
    order made every later step read across the grain.  Operands of fewer dimensions, scalars
    and a float64 operand broadcast and promote as they do for np.where."""
    where = ELEMENTWISE["where"].numpy
    rng = np.random.default_rng(7)
    x = np.ascontiguousarray(rng.standard_normal((3, 5, 4)).astype(np.float32)
                             .transpose(order)).transpose(np.argsort(order))
    mask = np.asarray(np.arange(5)[:, None] <= np.arange(4)[None, :], dtype=np.float32)
    y = np.float32(-np.inf) + x
    for c, a, b in [(mask, x, y), (mask, x, np.float32(0)), (x > 0, x, np.float64(2.5)),
                    (mask[None], x, rng.standard_normal(4))]:
        got = where(c, a, b)
        want = np.where(np.asarray(c) != 0, a, b)
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert np.argsort([-s for s in got.strides]).tolist() == list(order)


@pytest.mark.parametrize("op", ["max", "min"])
def test_tile_extremes_are_numpys_on_every_float(op):
    """The in-tile max and min, which reduce contiguous rows through argmax / argmin, give
    what np.max / np.min give over every axis, with keepdims or not, in either memory order
    and on rows apart in memory: NaN propagates, infinities are kept, rows past
    `ROWS_BY_INDEX` and small arrays too."""
    reduce, want_fn = TILE_REDUCE[op].numpy, getattr(np, op)
    rng = np.random.default_rng(3)
    for shape in [(512, 128), (2, 3, 64, 40), (4096, 1), (3, ROWS_BY_INDEX + 1), (5,), (4, 3)]:
        x = rng.standard_normal(shape).astype(np.float32)
        x.flat[rng.integers(0, x.size, 3)] = [np.nan, np.inf, -np.inf]
        x[..., -1:] = np.float32(np.inf if op == "min" else -np.inf)  # each row's own infinity
        wider = np.zeros(x.shape[:-1] + (2 * x.shape[-1] + 3,), np.float32)
        wider[..., 3:3 + x.shape[-1]] = x  # rows apart in memory, each one contiguous
        for a in (x, np.asfortranarray(x), x.astype(np.float64), wider[..., 3:3 + x.shape[-1]]):
            for axis in range(x.ndim):
                for keepdims in (True, False):
                    got = reduce(a, axis=axis, keepdims=keepdims)
                    want = want_fn(a, axis=axis, keepdims=keepdims)
                    assert got.shape == want.shape and got.dtype == want.dtype
                    assert np.array_equal(got, want, equal_nan=True), (shape, axis)
