"""The native product (`bbrules.codegen.native_matmul`, `matmul.c`): against float64 products
over the shapes its blocking cuts unevenly, every operand layout a generated module hands it
(transposed, strided, broadcast batches), its threads (shared by concurrent callers, gone after
a fork), and generated modules that call it against the reference interpreter (the examples
in `test_native.py`).  CI has a C
compiler (gcc), so these run there."""

from __future__ import annotations

import ast
import itertools
import multiprocessing
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from bbrules import interp
from bbrules.blockfile import parse_block_program
from bbrules.codegen import native, native_matmul, numpy_gen, numpy_plan, numpy_timing
from bbrules.frontend import parse_program
from bbrules.inputs import random_inputs
from bbrules.lower import lower

from test_numpy_backend import assert_close

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    """One cache folder for the session's compiled code, never the user's."""
    monkeypatch.setenv("BBRULES_CACHE", str(tmp_path_factory.getbasetemp() / "native-cache"))


def check(x: np.ndarray, y: np.ndarray, threads: int = 2) -> None:
    """`matmul(x, y)` within float32 rounding of the float64 product."""
    close_to_float64(native_matmul.matmul(x, y, threads), x, y)


def close_to_float64(got: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    """Each element's error bounded by k ulps of the sum of the terms' magnitudes."""
    want = np.matmul(x.astype(np.float64), y.astype(np.float64))
    bound = np.matmul(np.abs(x).astype(np.float64), np.abs(y).astype(np.float64))
    assert got.shape == want.shape and got.dtype == np.float32
    k = x.shape[-1]
    np.testing.assert_array_less(np.abs(got - want), k * 2.0 ** -23 * bound + 1e-30)


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# Rows around the micro-kernel's 6, columns around its panels of 64 (and the 32 and 16 of
# narrower vector units), a contraction past its blocks of 1024, and one of length 1.
@pytest.mark.parametrize("m", [1, 5, 6, 7, 61])
@pytest.mark.parametrize("n", [1, 15, 64, 65, 130])
@pytest.mark.parametrize("k", [1, 9, 64, 1100])
def test_every_shape_matches_the_float64_product(m, n, k):
    check(rand(m, k, seed=m), rand(k, n, seed=n))


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("n", [1, 3, 64, 67, 130])
@pytest.mark.parametrize("k", [1, 17, 64, 1100])
def test_thin_products_read_the_matrix_in_place(m, n, k, transposed):
    """Fewer rows than the micro-kernel's: the matrix read by rows where they are contiguous,
    by columns (dot products) where those are, any remainders of vectors and column groups."""
    x, y = rand(m, k, seed=m), rand(k, n, seed=n)
    if transposed:
        y = np.ascontiguousarray(y.T).T
    out = np.empty((m, n), np.float32)
    assert native_matmul.product()(out, x, y, None, 1.0, None, 2) == 0
    close_to_float64(out, x, y)


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("n", [3, 64, 67, 130])
@pytest.mark.parametrize("k", [1, 17, 1100])
def test_thin_products_read_a_packed_matrix_from_its_panels(m, n, k):
    """A decode step's projection: a constant weight comes packed, and a product of fewer rows
    than the micro-kernel's streams each panel, the zeros past the last column never stored;
    the addend and scale as any product applies them."""
    x, y, c = rand(m, k, seed=m), rand(k, n, seed=n), rand(1, n, seed=k)
    out = np.full((m, n), np.nan, np.float32)
    assert native_matmul.product()(out, x, y, c, 0.5, native_matmul.panels(y), 2) == 0
    want = c.astype(np.float64) + 0.5 * (x.astype(np.float64) @ y.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("layout", ["transposed", "strided", "column-major x", "both"])
def test_operands_in_any_layout(layout):
    """A weight read as W^T (columns contiguous: packed 16 x 16 at a time through registers),
    every other element of a larger array, a column-major left operand."""
    x, y = rand(70, 200, seed=1), rand(200, 150, seed=2)
    if layout in ("transposed", "both"):
        y = np.ascontiguousarray(y.T).T
    if layout in ("strided", "both"):
        x = np.repeat(x, 2, axis=1)[:, ::2]
        y = np.repeat(y, 3, axis=0)[::3]
    if layout == "column-major x":
        x = np.asfortranarray(x)
    check(x, y)


def test_batches_broadcast_as_numpys_do():
    x = rand(3, 1, 40, 30, seed=3)
    y = rand(1, 4, 30, 70, seed=4)
    check(x, y)
    check(x, np.broadcast_to(rand(30, 70, seed=5), (3, 4, 30, 70)))
    check(rand(2, 2, 128, 64, seed=6), rand(2, 2, 128, 64, seed=7).transpose(0, 1, 3, 2))


ADDENDS = {  # the addend's shape and layout, given the product's (batch, m, n)
    "whole": lambda b, m, n: rand(b, m, n, seed=11),
    "a bias (a row)": lambda b, m, n: rand(1, 1, n, seed=12),
    "a column": lambda b, m, n: rand(b, m, 1, seed=13),
    "one number": lambda b, m, n: rand(1, 1, 1, seed=14),
    "columns contiguous": lambda b, m, n: rand(b, n, m, seed=15).swapaxes(1, 2),
    "a mask shared by the batch": lambda b, m, n: rand(1, m, n, seed=16)[:, :, ::-1],
    "rows repeating (a mask of the query heads of a group)":
        lambda b, m, n: rand(1, m // 2 if m % 2 == 0 else m, n, seed=17),
}


@pytest.mark.parametrize("scale", [1.0, -0.75])
@pytest.mark.parametrize("addend", list(ADDENDS))
@pytest.mark.parametrize("m, n, k", [(5, 15, 9), (61, 130, 64), (30, 67, 1100), (7, 64, 0),
                                     (2, 2, 3), (64, 40, 20)])
def test_an_addend_is_added_as_the_contraction_starts(addend, m, n, k, scale):
    """`matmul(x, y, threads, add, scale)` is `add + scale * x @ y`, the addend broadcast
    along its dimensions of 1 and read at any strides: by thin products (added after), blocks
    of the micro-kernel, a contraction of several blocks (added once, each block scaled), an
    empty one (the addend), in a job of several products; `matmul` gives numpy's product
    (below `MIN_MACS`) the addend and the scale too.  An addend of half the rows is repeated
    (the rows of 30 cross a micro-kernel's block of 6 at row 15)."""
    batch = 3
    x, y = rand(batch, m, k, seed=m), rand(batch, k, n, seed=n)
    add = ADDENDS[addend](batch, m, n)
    full = np.tile(add, (1, m // add.shape[1], 1)) if add.shape[1] not in (1, m) else add
    product = np.matmul(x.astype(np.float64), y.astype(np.float64))
    want = full.astype(np.float64) + scale * product
    bound = np.abs(full) + np.matmul(np.abs(x).astype(np.float64), np.abs(y).astype(np.float64))
    alone, first, second = (np.empty((batch, m, n), np.float32) for _ in range(3))
    assert native_matmul.product()(alone, x, y, add, scale, None, 2) == 0
    assert native_matmul.products()(first, x, y, add, scale, None,
                                     second, x, y, None, 1.0, None, 2) == 0
    close_to_float64(second, x, y)
    for got in (alone, first, native_matmul.matmul(x, y, 2, add, scale),
                native_matmul.matmuls((x, y, add, scale), threads=2)[0]):
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_array_less(np.abs(got - want), (k + 2) * 2.0 ** -23 * bound + 1e-30)


def constant(a: np.ndarray) -> np.ndarray:
    """`a` as a model's weight comes: read-only, a constant (`numpy_runtime.relaid`)."""
    a = a.copy()
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("m, n, k", [(6, 1, 1), (61, 130, 64), (30, 67, 1100), (128, 64, 300)])
def test_a_product_reads_panels_packed_beforehand_as_it_packs_them(m, n, k, transposed):
    """`panels(b)` holds b's columns NR at a time, zero past its last (n of 1, 67, 130), the
    whole contraction in each (1100: past a block of 1024), aligned: a product given them
    computes what it computes packing b itself, bit for bit, with an addend and a scale, alone
    or in a job of several."""
    x, y, add = rand(m, k, seed=1), rand(k, n, seed=2), rand(1, n, seed=3)
    if transposed:
        y = np.ascontiguousarray(y.T).T
    panels = native_matmul.panels(y)
    assert panels.ctypes.data % 64 == 0 and panels.shape[1] == k
    packing, given, first, second = (np.empty((m, n), np.float32) for _ in range(4))
    assert native_matmul.product()(packing, x, y, add, -0.5, None, 2) == 0
    assert native_matmul.product()(given, x, y, add, -0.5, panels, 2) == 0
    assert native_matmul.products()(first, x, y, add, -0.5, panels,
                                     second, x, y, None, 1.0, panels, 2) == 0
    np.testing.assert_array_equal(given, packing)
    np.testing.assert_array_equal(first, packing)
    close_to_float64(second, x, y)


def test_panels_that_do_not_fit_the_product_are_refused():
    """Panels of another matrix's shape, or not on a cache line, leave the call to numpy (1),
    never read past their end."""
    x, y = rand(20, 30, seed=1), rand(30, 70, seed=2)
    out = np.empty((20, 70), np.float32)
    fitting = native_matmul.panels(y)
    memory = np.empty(fitting.size + 1, np.float32)
    unaligned = memory[1:] if memory.ctypes.data % 64 == 0 else memory[:-1]
    for wrong in (native_matmul.panels(rand(31, 70)), native_matmul.panels(rand(30, 200)),
                  unaligned.reshape(fitting.shape), fitting[:, :, ::2]):
        assert native_matmul.product()(out, x, y, None, 1.0, wrong, 2) == 1


def test_a_constant_operand_is_packed_once(monkeypatch):
    """A read-only right operand (a model's weight) is packed on first use and its panels
    kept, for a view of it too (as a module reads `W.T.reshape(..).T`), and the product is the
    one a call that packs it computes; a writeable one, which may change between calls, is
    packed by each product, as is a slice narrower than a panel; a product of a few rows
    reads the panels too; none is kept where `$BBRULES_PACK_CONSTANTS` is 0."""
    x, w = rand(40, 96, seed=1), rand(96, 200, seed=2)
    weight = constant(w)
    kept = native_matmul._constant_panels(x, weight)
    assert kept is not None and not kept.flags.writeable
    assert native_matmul._constant_panels(x, weight.T.T) is kept
    assert native_matmul._constant_panels(x, w) is None
    assert native_matmul._constant_panels(x[:1], weight) is kept
    np.testing.assert_array_equal(native_matmul.matmul(x[:1], weight, 2),
                                  native_matmul.matmul(x[:1], w, 2))
    narrow = weight[:, :native_matmul.panel_width() - 1]  # (a loop's slice: padded, kept)
    assert native_matmul._constant_panels(x, narrow) is None
    # Slices of one shape and strides are told apart by where they start (`bb_address`).
    top, bottom = weight[:48], weight[48:]
    assert native_matmul.address()(bottom) == bottom.__array_interface__["data"][0]
    assert native_matmul._constant_panels(x[:, :48], top) is not \
        native_matmul._constant_panels(x[:, :48], bottom)
    np.testing.assert_array_equal(native_matmul.matmul(x[:, 48:], bottom, 2),
                                  native_matmul.matmul(x[:, 48:], w[48:], 2))
    with monkeypatch.context() as patched:  # ($BBRULES_PACK_CONSTANTS=0)
        patched.setattr(native_matmul, "PACK_CONSTANTS", False)
        assert native_matmul._constant_panels(x, constant(w)) is None
    np.testing.assert_array_equal(native_matmul.matmul(x, weight, 2),
                                  native_matmul.matmul(x, w, 2))
    got, = native_matmul.matmuls((x, weight), threads=2)
    close_to_float64(got, x, w)


@pytest.mark.parametrize("addend", [None, (1, 1), (150, 1), (1, 70), (150, 70)])
def test_a_constant_left_operand_is_the_transposed_products_packed_right(addend, monkeypatch):
    """A constant times a product's result (a convolution's weight times an image laid
    channels first) is computed as y^T W^T, W^T's panels packed once, written into the rows
    of W y (row-major, as any product's result); with a writeable weight too where y has
    fewer columns than the micro-kernel has rows (a matrix times a vector); an addend is
    added transposed with it."""
    calls = []
    real = native_matmul.product()
    monkeypatch.setattr(native_matmul, "product", lambda: lambda *args: calls.append(args) or
                        real(*args))
    w, y = rand(150, 90, seed=1), rand(90, 70, seed=2)
    c = None if addend is None else rand(*addend, seed=3)
    got = native_matmul.matmul(constant(w), y, 2, c, 0.5)
    want = 0.5 * (w.astype(np.float64) @ y.astype(np.float64)) + (0 if c is None else c)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert got.flags.c_contiguous
    _, a, _, _, _, panels, _ = calls[-1]
    assert a.shape == (70, 90) and np.shares_memory(a, y) and panels is not None
    native_matmul.matmul(w, y, 2, c, 0.5)  # (writeable: packed each call, not swapped)
    assert calls[-1][1] is w and calls[-1][5] is None
    vector = native_matmul.matmul(w, y[:, :1], 2)
    close_to_float64(vector, w, y[:, :1])
    assert calls[-1][1].shape == (1, 90)
    got, = native_matmul.matmuls((constant(w), y, c, 0.5), threads=2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert got.flags.c_contiguous


@pytest.mark.parametrize("m", [1, 5, 7, 61])
@pytest.mark.parametrize("n", [1, 15, 64, 65])
@pytest.mark.parametrize("k", [0, 9, 1100])
def test_a_products_result_may_have_its_columns_apart(m, n, k):
    """out's columns need not be contiguous (a product computed transposed writes into the
    rows of the one asked for): every kernel, thin ones and a contraction past a block and
    an empty one, with an addend and a scale, stores an element at a time."""
    x, y, c = rand(m, k, seed=m), rand(k, n, seed=n), rand(1, n, seed=k)
    out = np.full((n, m), np.nan, np.float32).T
    assert native_matmul.product()(out, x, y, c, 0.5, None, 2) == 0
    want = c.astype(np.float64) + 0.5 * (x.astype(np.float64) @ y.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("inner", ["contiguous", "strided"])
def test_a_window_product_reads_taps_and_positions_of_several_dimensions(inner):
    """A depthwise 2-D convolution's window (channels in two dimensions, a 3 x 3 tap, a 7 x 9
    image padded by 1): out[c, i, j] = sum over (s, t) of w[c, s, t] x[c, i + s, j + t], the
    window a view whose rows and taps step along the same dimension; a weight broadcast
    along a tap, positions more than a vector long and strided, against float64; numpy's
    einsum where the arrays are not float32."""
    x = np.pad(rand(3, 5, 7, 9, seed=4), ((0, 0), (0, 0), (1, 1), (1, 1)))
    if inner == "strided":
        x = np.repeat(x, 2, axis=-1)[..., ::2]
    s = x.strides
    window = np.lib.stride_tricks.as_strided(x, (3, 5, 3, 3, 7, 9), s[:2] + s[2:] * 2,
                                             writeable=False)
    w = rand(3, 5, 3, 3, seed=5)
    for weight in (w[:, :, :1], w):
        got = native_matmul.window_product(weight, window, 2, 2)
        want = np.einsum("abst,abstij->abij", np.broadcast_to(weight, w.shape).astype(np.float64),
                         window.astype(np.float64))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    flat = np.lib.stride_tricks.as_strided(x, (15, 3, 3, 7, 9), s[1:2] + s[2:] * 2,
                                           writeable=False)  # (one batch dimension, one thread)
    np.testing.assert_allclose(native_matmul.window_product(w.reshape(15, 3, 3), flat, 1, 1),
                               want.reshape(15, 7, 9), rtol=1e-5, atol=1e-5)
    doubled = native_matmul.window_product(w.astype(np.float64), window, 2, 2)
    np.testing.assert_allclose(doubled, native_matmul.window_product(w, window, 2, 2),
                               rtol=1e-5, atol=1e-5)


def test_a_window_products_rows_are_summed_in_groups_of_any_size():
    """Rows of a window summed a few at once (`window_rows`), in groups as even as can be:
    1, 2, 5, 6 (3 and 3), 11 (4, 4 and 3) and 16 (four of 4) rows of 20 positions (a whole
    vector and a masked remainder), against float64."""
    for rows in (1, 2, 5, 6, 11, 16):
        x = np.pad(rand(4, rows, 20, seed=rows), ((0, 0), (1, 1), (1, 1)))
        s = x.strides
        window = np.lib.stride_tricks.as_strided(x, (4, 3, 3, rows, 20), s[:1] + s[1:] * 2,
                                                 writeable=False)
        w = rand(4, 3, 3, seed=rows + 1)
        want = np.einsum("cst,cstij->cij", w.astype(np.float64), window.astype(np.float64))
        np.testing.assert_allclose(native_matmul.window_product(w, window, 1, 2), want,
                                   rtol=1e-5, atol=1e-5, err_msg=f"{rows} rows")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_copy_between_views_of_any_strides_is_numpys_assignment(threads):
    """`copy_into`: rows shorter than a vector, longer, strided and transposed, dimensions of
    one element between others, zeros where no values are given, each against numpy's
    assignment, nothing written outside the view; arrays that are not float32 go to numpy."""
    rng = np.random.default_rng(21)
    cases = [((40, 10, 10), (slice(None), slice(None), slice(1, 11)), (40, 10, 12)),
             ((6, 1, 37), (slice(None), slice(None), slice(2, 39)), (6, 1, 41)),
             ((9, 13), (slice(None, None, 2), slice(None)), (18, 13)),
             ((5, 7, 3), (slice(1, 6), slice(None), slice(None, None, -1)), (7, 7, 3))]
    for shape, where, memory_shape in cases:
        values = rng.standard_normal(shape).astype(np.float32)
        for given in (values, np.ascontiguousarray(values.T).T, None):  # (C, F order)
            memory = np.full(memory_shape, 7.0, np.float32)
            want = memory.copy()
            want[where] = 0 if given is None else given
            native_matmul.copy_into(memory[where], given, threads)
            np.testing.assert_array_equal(memory, want)
    doubled = np.zeros((4, 3))
    native_matmul.copy_into(doubled[:, 1:], np.ones((4, 2)), threads)
    assert doubled.sum() == 8


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_any_number_of_threads(threads):
    check(rand(300, 257, seed=8), rand(257, 190, seed=9), threads)


def test_what_it_cannot_take_goes_to_numpy():
    x64, y64 = rand(20, 30).astype(np.float64), rand(30, 10).astype(np.float64)
    got = native_matmul.matmul(x64, y64, 2)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, np.matmul(x64, y64))
    v = rand(30)
    np.testing.assert_allclose(native_matmul.matmul(rand(20, 30), v, 2),
                               np.matmul(rand(20, 30), v), rtol=1e-6)
    with pytest.raises(ValueError):
        native_matmul.matmul(rand(20, 30), rand(31, 10), 2)
    assert native_matmul.matmul(rand(0, 30), rand(30, 10), 2).shape == (0, 10)
    np.testing.assert_array_equal(native_matmul.matmul(rand(20, 0), rand(0, 10), 2),
                                  np.zeros((20, 10), np.float32))


def test_products_run_together_as_one_job():
    """`matmuls`: each result as `matmul`'s, whatever mix of products one call is given (of
    other widths, batched, broadcast, too small for `matmul.c`, of another dtype, more than
    one job takes), and numpy's error for operands that do not match."""
    pairs = [(rand(128, 256, seed=1), rand(256, 130, seed=2)),
             (rand(128, 256, seed=1), rand(300, 256, seed=3).T),
             (rand(2, 1, 40, 30, seed=4), rand(1, 3, 30, 70, seed=5)),
             (rand(8, 32, seed=6), rand(32, 16, seed=7))]
    pairs += [(rand(64, 100, seed=s), rand(100, 90, seed=s + 1)) for s in range(10, 30, 2)]
    got = native_matmul.matmuls(*pairs, threads=2)
    assert len(got) == len(pairs) > native_matmul.MAX_PRODUCTS
    for (x, y), g in zip(pairs, got):
        close_to_float64(g, x, y)
    x64 = rand(20, 30).astype(np.float64)
    wide, other = native_matmul.matmuls((x64, x64.T), (rand(128, 256), rand(256, 64)))
    assert wide.dtype == np.float64 and other.shape == (128, 64)
    with pytest.raises(ValueError):
        native_matmul.matmuls((rand(128, 256), rand(256, 64)), (rand(128, 256), rand(255, 64)))


MLP = ("dim r = 256 / 128\ndim c = 512 / 128\ndim k = 256 / 256\ndim e = 128 / 128\n"
       "input X[r, k], W1[k, c], W3[k, c], W2[c, e] : f32\n"
       "H[r, c] = sum[k] X[r, k] * W1[k, c] * sigmoid(sum[k] X[r, k] * W1[k, c]) * "
       "sum[k] X[r, k] * W3[k, c]\n"
       "Y[r, e] = sum[c] (sum[k] X[r, k] * W1[k, c]) * W2[c, e]\n"
       "output H, Y\n")


def test_a_kernels_products_of_one_operand_are_one_call():
    """A SwiGLU's gate and up, both of X, are one `matmuls` call; a product of another's
    result (Y's, of X W1) stays after it, a call of its own.  Both against the interpreter."""
    p = lower(parse_program(MLP))
    source = numpy_gen.generate_module(p, threads=2, split=False, native=True).source
    kernel_h, kernel_y = (source.split(f"def kernel_{t}(")[1].split("\ndef ")[0] for t in "HY")
    assert re.search(r"= matmuls\(\((t\d+_)?X.*\((t\d+_)?X.*, threads=2\)", kernel_h), kernel_h
    assert "matmul(" not in kernel_h
    assert "matmuls(" not in kernel_y and kernel_y.count("matmul(") == 2, kernel_y
    inputs = random_inputs(parse_program(MLP), seed=13)
    want = interp.run(p, inputs)
    got = numpy_gen.module_from_source(source).run(**inputs)
    for name in ("H", "Y"):
        assert_close(got[name], want[name], f"{name}: native products vs interpreter")


# Four kernels that are each one product, and one between them that is not: K reads what Q
# reads, V what S stores after Q, R what Q stores.
PRODUCT_KERNELS = (
    "# bbrules block program\ndim t = 128 / 128\ndim d = 256 / 256\ndim n = 256 / 256\n"
    "dim m = 128 / 128\ninput X[t, d] : f32\ninput WQ[d, n] : f32\ninput WK[d, m] : f32\n"
    "input WV[n, m] : f32\ninput WR[n, m] : f32\noutput Q[t, n] : f32\noutput S[t, n] : f32\n"
    "output K[t, m] : f32\noutput V[t, m] : f32\noutput R[t, m] : f32\n\n"
    "kernel [t]:\n  Q[t, n] = reduce(d, sum, dot(d, load(X[t, d]), load(WQ[d, n])))\n\n"
    "kernel [t, n]:\n  S[t, n] = load(Q[t, n]) * 2.0\n\n"
    "kernel [t]:\n  K[t, m] = reduce(d, sum, dot(d, load(X[t, d]), load(WK[d, m])))\n\n"
    "kernel [t]:\n  V[t, m] = reduce(n, sum, dot(n, load(S[t, n]), load(WV[n, m])))\n\n"
    "kernel [t]:\n  R[t, m] = reduce(n, sum, dot(n, load(Q[t, n]), load(WR[n, m])))\n")


def test_kernels_that_are_each_one_product_run_as_one_call(monkeypatch):
    """Q's kernel and K's, each one product of X, run as one `matmuls` call where Q's ran; V's,
    which reads S, stored since, cannot join them, and R's, which reads Q, joins V's.  Against
    the interpreter; `profile` times each call once, one row for the kernels it runs."""
    p = parse_block_program(PRODUCT_KERNELS).program
    source = numpy_gen.generate_module(p, threads=2, split=False, native=True).source
    run = source.split("def _execute(")[1]
    calls = re.findall(r"^ +(.*) = (kernel_\w+)\(", run, re.MULTILINE)
    assert [stored for stored, _ in calls] == ["Q, K", "S", "V, R"], run
    for _, fn in calls[::2]:
        kernel = source.split(f"def {fn}(")[1].split("\ndef ")[0]
        assert kernel.count("matmuls(") == 1 and "matmul(" not in kernel, kernel
    inputs = random_inputs(p, seed=15)
    want = interp.run(p, inputs)
    got = numpy_gen.module_from_source(source).run(**inputs)
    for name in "QSKVR":
        assert_close(got[name], want[name], f"{name}: products as one call vs interpreter")
    ticks = itertools.count()
    monkeypatch.setattr(numpy_timing, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    rows = numpy_timing.profile(p, inputs, runs=2, threads=2, native=True).kernels
    assert [(r.tensors, r.kernels, r.seconds) for r in rows] == [
        (("Q", "K"), (0, 2), 1), (("S",), (1,), 1), (("V", "R"), (3, 4), 1)]


def test_a_store_between_products_follows_their_call(monkeypatch):
    """Q, K and V projections of different widths in one kernel, Q's contraction over an
    axis of its own (as LLaMA's import names them), so Q's loop comes first and its store (a
    whole tile) between Q's product and K's: the store moves after the one `matmuls` call of
    all three.  Against the interpreter; with the weights constants (read-only), each packed
    into panels on the first call alone, the same numbers."""
    p = parse_block_program(
        "# bbrules block program\ndim t = 256 / 128\ndim d = 256 / 256\ndim e = 256 / 256\n"
        "dim n = 256 / 256\ndim m = 128 / 128\ninput X[t, d] : f32\ninput WQ[d, n] : f32\n"
        "input WK[d, m] : f32\ninput WV[d, m] : f32\noutput Q[t, n] : f32\n"
        "output K[t, m] : f32\noutput V[t, m] : f32\n\nkernel [t]:\n"
        "  Q[t, n] = reduce(e, sum, dot(e, load(X[t, e]), load(WQ[e, n])))\n"
        "  K[t, m] = reduce(d, sum, dot(d, load(X[t, d]), load(WK[d, m])))\n"
        "  V[t, m] = reduce(d, sum, dot(d, load(X[t, d]), load(WV[d, m])))\n").program
    source = numpy_gen.generate_module(p, threads=2, split=False, native=True).source
    kernel = source.split("def kernel_Q_K_V(")[1].split("\ndef ")[0]
    assert "matmul(" not in kernel and re.search(r"= matmuls\((\((t\d+_)?X.*){3}", kernel), kernel
    assert kernel.index("matmuls(") < kernel.index("\n    Q = "), kernel
    inputs = random_inputs(p, seed=14)
    want = interp.run(p, inputs)
    module = numpy_gen.module_from_source(source)
    got = module.run(**inputs)
    for name in "QKV":
        assert_close(got[name], want[name], f"{name}: native products vs interpreter")
    packed = []
    real = native_matmul.panels
    monkeypatch.setattr(native_matmul, "panels", lambda b: packed.append(b.shape) or real(b))
    weights = {name: constant(a) if name != "X" else a for name, a in inputs.items()}
    for run in range(2):
        again = module.run(**weights)
        assert sorted(packed) == [(256, 128), (256, 128), (256, 256)], run
        for name in "QKV":
            np.testing.assert_array_equal(again[name], got[name])


def test_concurrent_callers_share_the_threads():
    """Callers on several Python threads at once (a kernel's parts): one has the workers, the
    others compute alone; every result is right."""
    pairs = [(rand(96, 200, seed=s), rand(200, 130, seed=s + 50)) for s in range(16)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda xy: native_matmul.matmul(*xy, 2), pairs))
    for (x, y), g in zip(pairs, got):
        np.testing.assert_allclose(g, x @ y, rtol=1e-4, atol=1e-4)


def test_products_between_which_the_workers_sleep():
    """Workers asleep (idle for longer than they spin) are woken by the next product and join
    it, or a later one, whenever they get there: every result is right whoever computed it,
    and no product waits forever (it runs on a thread the test gives up on after a minute)."""
    x, y = rand(96, 300, seed=20), rand(300, 200, seed=21)
    want = x @ y
    errors: list[float] = []

    def products() -> None:
        for i in range(12):
            if i % 3 == 0:
                time.sleep(0.005)  # past the workers' 1 ms of spinning
            errors.append(float(np.abs(native_matmul.matmul(x, y, 3) - want).max()))
    runner = threading.Thread(target=products, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "a product waited on its workers for a minute"
    assert len(errors) == 12 and max(errors) < 1e-3


def _product_in_child(queue) -> None:
    x, y = rand(64, 100, seed=10), rand(100, 80, seed=11)
    queue.put(float(np.abs(native_matmul.matmul(x, y, 2) - x @ y).max()))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_starts_its_own_threads():
    """The workers do not survive fork(): the child's first product starts new ones instead
    of waiting on threads it does not have."""
    native_matmul.matmul(rand(64, 100), rand(100, 80), 2)  # the parent's workers exist
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_product_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the child hung in its product"
    assert queue.get(timeout=5) < 1e-3


PRODUCT = ("dim r = 256 / 128\ndim c = 512 / 128\ndim k = 256 / 256\ninput X[r, k] : f32\n"
           "input W[k, c] : f32\nY[r, c] = sum[k] X[r, k] * W[k, c]\noutput Y\n")


def test_a_kernel_run_whole_threads_its_product_and_a_part_does_not(monkeypatch):
    p = lower(parse_program(PRODUCT))
    whole = numpy_gen.generate_module(p, threads=2, split=False, native=True).source
    assert re.search(r"= matmul\(.*, 2\)", whole), whole
    monkeypatch.setattr(numpy_plan, "parts_pay", lambda *_: True)
    parts = numpy_gen.generate_module(p, threads=2, split=True, native=True)
    assert max(parts.parts) > 1
    assert re.search(r"= matmul\(.*, 1\)", parts.source) and \
        not re.search(r"= matmul\(.*, 2\)", parts.source), parts.source
    inputs = random_inputs(parse_program(PRODUCT), seed=12)
    want = interp.run(p, inputs)["Y"]
    for source in (whole, parts.source):
        assert_close(numpy_gen.module_from_source(source).run(**inputs)["Y"], want,
                     "native product vs interpreter")


def test_small_products_are_numpys_unless_its_blas_would_thread_them(monkeypatch):
    """Below `MIN_ROWS` rows or `MIN_MACS` multiply-adds numpy's call costs less, except where
    numpy's OpenBLAS would run the product on its own threads (from 2^18 multiply-adds; by a
    vector, from 9,216 matrix elements), which then spin on the native threads' cores: those
    products are native, on one thread below `MIN_MACS`.  An operand whose rows overlap (a
    convolution's window) is copied for numpy first."""
    called = []
    real = native_matmul.product()

    def spy(out, x, y, add, scale, panels, threads):
        called.append((x.shape, y.shape, threads))
        return real(out, x, y, add, scale, panels, threads)
    monkeypatch.setattr(native_matmul, "product", lambda: spy)
    for x, y in [(rand(8, 32), rand(32, 256)), (rand(64, 64), rand(64, 64)),
                 (rand(1, 64), rand(64, 128))]:
        np.testing.assert_array_equal(native_matmul.matmul(x, y, 2), np.matmul(x, y))
    assert called == []
    for x, y, threads in [(rand(128, 64), rand(64, 128), 2), (rand(8, 256), rand(256, 256), 2),
                          (rand(1, 128), rand(128, 128), 1), (rand(1, 1024), rand(1024, 1024), 2),
                          (rand(3, 512), rand(300, 512).T, 1)]:
        got = native_matmul.matmul(x, y, 2)
        assert called[-1] == (x.shape, y.shape, threads)
        close_to_float64(got, x, y)
    rows = rand(40, 8)
    window = np.lib.stride_tricks.as_strided(rows, (36, 40), (32, 4))  # 5 taps x 8 channels
    assert not np.shares_memory(native_matmul._blas_ready(window), rows)
    np.testing.assert_allclose(native_matmul.matmul(window, rand(40, 3), 2),
                               np.ascontiguousarray(window) @ rand(40, 3), rtol=1e-6)


@pytest.mark.parametrize("channels", [(2, 24), (1, 64), (3, 16)], ids=["ragged", "64", "16"])
@pytest.mark.parametrize("taps", [3, 15])
def test_a_depthwise_window_over_channels_laid_innermost_runs_across_them(
        monkeypatch, channels, taps):
    """A product of one row a channel whose window has the channels innermost (a depthwise
    convolution after a transposed product): native, lanes of channels at a time (`across`:
    a last run of fewer lanes than a vector's where the channels are not a multiple), with an
    addend and a scale; never numpy's product, which copies the window and runs a product a
    channel."""
    monkeypatch.setattr(native_matmul, "_numpy_product", None)
    positions = 200
    rows = rand(positions + taps - 1, *channels, seed=taps)  # positions by channels
    steps = rows.strides
    window = np.lib.stride_tricks.as_strided(  # [channels..., taps, positions]
        rows, (*channels, taps, positions), (*steps[1:], steps[0], steps[0]), writeable=False)
    weights = rand(*channels, 1, taps, seed=1)
    addend = rand(*channels, 1, positions, seed=2)
    got = native_matmul.matmul(weights, window, 2, addend, 0.5)
    want = addend + 0.5 * np.matmul(weights.astype(np.float64), window.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


CONVOLUTION = ("dim o = 60 / 30\ndim s = 5 / 1\ndim j = 64\ndim c = 256 / 64\n"
               "dim m = 128\ninput X[j, c], W[m, c, s] : f32\n"
               "Y[o, m] = sum[s, c] W[m, c, s] * sum[j] where(j == o + s, 1, 0) * X[j, c]\n"
               "output Y\n")


def test_a_product_is_computed_in_the_order_its_result_is_laid_out():
    """W M stored as Y[t, c] (a pointwise convolution's result read back by tokens): the
    layout holds M's free axis outside W's, so the product is computed as M^T W^T, its
    result in the layout's order, not computed as W M and transposed after (the residual
    added to it then walked it element by element)."""
    ast = parse_program("dim t = 48\ndim c = 64\ndim k = 96\ninput W[c, k] : f32\n"
                        "input M[k, t] : f32\ninput R[t, c] : f32\n"
                        "Y[t, c] = (sum[k] W[c, k] * M[k, t]) + R[t, c]\noutput Y\n")
    p = lower(ast)
    source = numpy_gen.generate_module(p, threads=2, split=False, native=True).source
    product = next(line.split(" = ", 1)[1] for line in source.splitlines()
                   if " = matmul(" in line)
    assert product.startswith("matmul(M") and ".T" not in product.split(", 2", 1)[1], product
    inputs = random_inputs(ast, seed=3)
    got = numpy_gen.module_from_source(source).run(**inputs)["Y"]
    want = inputs["W"].astype(np.float64) @ inputs["M"] + inputs["R"].T
    np.testing.assert_allclose(got, want.T, rtol=1e-5, atol=1e-5)


def test_a_convolutions_window_is_read_in_place():
    """In native modules a gather by positions that step evenly is a view of its values: the
    product reads the convolution's window from X itself (numpy code gathers it)."""
    ast = parse_program(CONVOLUTION)
    p = lower(ast)
    source = numpy_gen.generate(p, threads=2, native=True)
    assert "window=True" in source
    assert "window=True" not in numpy_gen.generate(p)
    lookup = parse_program("dim t = 64 / 16\ndim v = 100\ndim e = 32\ninput IDS[t] : f32\n"
                           "input E[v, e] : f32\n"
                           "Y[t, e] = sum[v] where(v == IDS[t], 1, 0) * E[v, e]\noutput Y\n")
    ids = numpy_gen.generate(lower(lookup), threads=2, native=True)
    assert "gather_one_hot(" in ids and "window=True" not in ids  # ids are data
    module = numpy_gen.module_from_source(source)
    inputs = random_inputs(ast, seed=14)
    gathered = []

    def gather(*args, **kw):
        gathered.append(real(*args, **kw))
        return gathered[-1]
    real, module.gather_one_hot = module.gather_one_hot, gather
    got = module.run(**inputs)["Y"]
    assert gathered and all(np.shares_memory(g, inputs["X"]) for g in gathered)
    x, w = inputs["X"].astype(np.float64), inputs["W"].astype(np.float64)
    want = np.einsum("osc,mcs->om", np.stack([x[o:o + 5] for o in range(60)]), w)
    assert_close(got, want, "vs numpy")
    assert_close(got, interp.run(p, inputs)["Y"], "vs interpreter")


ADDED = """dim t = 96 / 32
dim u = 96 / 32
dim e = 64
dim f = 80
dim h = 3
input X[t, e], W[e, f], R[t, f], B[f], Q[h, t, e], K[h, u, e], M[t, u] : f32
Y[t, f] = R[t, f] + sum[e] X[t, e] * W[e, f]
Z[t, f] = sum[e] X[t, e] * W[e, f] + B[f]
S[h, t, u] = sum[e] Q[h, t, e] * K[h, u, e] + M[t, u]
V[t, f] = (sum[e] X[t, e] * W[e, f]) * (sum[e] X[t, e] * W[e, f] + R[t, f])
D[t, f] = R[t, f] - sum[e] X[t, e] * W[e, f]
C[h, t, u] = sum[e] Q[h, t, e] * K[h, u, e] - where(u <= t, 0, inf)
output Y, Z, S, V, D, C
"""


def products(source: str) -> list[tuple[str, str | None, bool]]:
    """Each native product `source` calls, as (x, the addend or None, whether it scales the
    product by -1): `matmul(x, y, T, add, scale=s)` calls and the `(x, y, add, s)` operands of
    `matmuls` calls."""
    found = []
    for call in ast.walk(ast.parse(source)):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            if call.func.id == "matmul":
                found.append((call.args[0], call.args[3:], [k.value for k in call.keywords]))
            elif call.func.id == "matmuls":
                found += [(t.elts[0], t.elts[2:3], t.elts[3:]) for t in call.args]
    return [(ast.unparse(x), ast.unparse(add[0]) if add else None,
             any(ast.unparse(s) == "f32(-1.0)" for s in scale)) for x, add, scale in found]


DEPTHWISE = ("dim c = 64 / 32\ndim i = 10\ndim j = 12\ndim h = 10\ndim w = 12\n"
             "dim s = 3\ndim t = 3\ninput X[c, h, w], W[c, s, t] : f32\n"
             "Y[c, i, j] = sum[s, t] W[c, s, t] * sum[h] where(h == i + s - 1, 1, 0) * "
             "sum[w] where(w == j + t - 1, 1, 0) * X[c, h, w]\noutput Y\n")


def test_a_depthwise_2d_convolution_is_a_window_product():
    """A depthwise 3 x 3 convolution, padded by 1, as a native module: its window (rows and
    taps stepping along one dimension of the padded image) is read in place by
    `window_product`, never copied to merge its taps and positions; what it computes is
    the interpreter's and a float64 reference's."""
    ast = parse_program(DEPTHWISE)
    p = lower(ast)
    source = numpy_gen.generate_module(p, threads=2, split=False, native=True).source
    assert "window_product(" in source and "= matmul(" not in source
    module = numpy_gen.module_from_source(source)
    inputs = random_inputs(ast, seed=15)
    got = module.run(**inputs)["Y"]
    x = np.pad(inputs["X"].astype(np.float64), ((0, 0), (1, 1), (1, 1)))
    want = sum(inputs["W"][:, s, t, None, None] * x[:, s:s + 10, t:t + 12]
               for s in range(3) for t in range(3))
    assert_close(got, want, "vs numpy")
    assert_close(got, interp.run(p, inputs)["Y"], "vs interpreter")


def test_a_tile_added_to_a_product_is_its_addend():
    """A residual, a bias (one row, loaded after the product) and a mask the heads share,
    added to products, are the native product's addend: no numpy pass adds them.  So are a
    residual less a product (the product scaled by -1) and a product less a mask computed on
    loading (the mask negated on loading).  A product read twice is not (V's is read by its
    sum with R and by their product).  The results are the interpreter's."""
    program = parse_program(ADDED)
    p = lower(program)
    source = numpy_gen.generate(p, threads=2, native=True)
    added = [(re.sub(r"^t\d+_|_\d+$", "", add.split(".")[0]), negated)
             for _, add, negated in products(source) if add is not None]
    assert sorted(added) == [
        ("B", False), ("M", False), ("R", False), ("R", True), ("known", False)]
    assert re.search(r"\nknown_\d+ = constant\(np\.negative\(known_\d+\)\)\n", source)
    assert "np.add(" not in source and "np.subtract(" not in source
    inputs = random_inputs(program, seed=21)
    got = numpy_gen.module_from_source(source).run(**inputs)
    want = interp.run(p, inputs)
    for name in "YZSVDC":
        assert_close(got[name], want[name], name)


@pytest.mark.parametrize("op", ["+", "-"])
def test_a_product_added_to_itself_is_not_its_own_addend(op):
    """The sum (or difference) of a product and itself, as the rules leave `(A + A) * A`
    summed over one block: the product's array had been its own addend, named before it was
    computed.  Against the interpreter."""
    program = parse_program("dim r = 8\ndim c = 8\ndim k = 16\ninput X[r, k], W[k, c] : f32\n"
                            f"Y[r, c] = sum[k] X[r, k] * W[k, c] {op} sum[k] X[r, k] * W[k, c]\n"
                            "output Y\n")
    p = lower(program)
    inputs = random_inputs(program, seed=22)
    got = numpy_gen.run(p, inputs, threads=2, native=True)["Y"]
    assert_close(got, interp.run(p, inputs)["Y"], f"product {op} itself")


GROUPED_QUERIES = """dim h = 2
dim g = 3
dim t = 64 / 32
dim u = 64 / 32
dim e = 32
input Q[h, g, t, e], K[h, u, e], V[h, u, e] : f32
S[h, g, t, u] = sum[e] Q[h, g, t, e] * (K[h, u, e] * 0.125 + 0 * g)
O[h, g, t, e] = sum[u] S[h, g, t, u] * (V[h, u, e] + 0 * g)
output O
"""


def test_a_product_reads_a_repeated_and_scaled_operand_as_it_was_computed():
    """Grouped-query attention's keys and values, shared by g query heads (`+ 0 * g`), and
    the keys scaled by a number: the native product reads K and V themselves, the query
    heads of a group rows of one product (a batch of h, not of h x g), and scales the scores
    as it stores them; numpy code broadcasts and scales in passes of their own."""
    ast = parse_program(GROUPED_QUERIES)
    p = lower(ast)
    source = numpy_gen.generate(p, threads=2, native=True)
    assert "broadcast_to" not in source and "* f32(0.125)" not in source
    assert re.search(r"matmul\((t\d+_)?Q\.reshape\(2, 192, 32\), .*, scale=f32\(0\.125\)\)",
                     source)
    assert "broadcast_to" in numpy_gen.generate(p)
    inputs = random_inputs(ast, seed=22)
    got = numpy_gen.module_from_source(source).run(**inputs)
    want = interp.run(p, inputs)
    for name in "SO":
        assert_close(got[name], want[name], name)


MASKED_GROUPS = """dim h = 2
dim g = 3
dim t = 64 / 32
dim u = 64 / 32
dim e = 32
input Q[h, g, t, e], K[h, u, e], M[t, u] : f32
S[h, g, t, u] = sum[e] Q[h, g, t, e] * (K[h, u, e] + 0 * g) + M[t, u]
C[h, g, t, u] = sum[e] Q[h, g, t, e] * (K[h, u, e] + 0 * g) - where(u <= t, 0, inf)
B[h, g, t, u] = sum[e] Q[h, g, t, e] * (K[h, u, e] + 0 * g) + M[t, u] * (g + 1)
output S, C, B
"""


def test_a_mask_the_query_heads_of_a_group_share_is_the_addend_of_their_rows():
    """The query heads of a group are rows of one product (g x t of them); a mask over [t, u]
    is its addend, whose rows those of each head repeat (S's input mask, C's causal mask);
    one that differs by head (B's) is computed for every row, an addend of the product's
    shape.  Results are the interpreter's."""
    ast = parse_program(MASKED_GROUPS)
    p = lower(ast)
    source = numpy_gen.generate(p, threads=2, native=True)
    found = products(source)
    repeated = [x for x, add, _ in found
                if add and re.fullmatch(r"\w+\.reshape\(1, 64, 64\)", add)]
    assert len(repeated) == 2 and all(re.fullmatch(r"(t\d+_)?Q\.reshape\(2, 192, 32\)", x)
                                      for x in repeated), found
    assert any(add and add.endswith(".reshape(1, 192, 64)") for _, add, _ in found), found
    assert "np.add(" not in source and "np.subtract(" not in source
    inputs = random_inputs(ast, seed=23)
    got = numpy_gen.module_from_source(source).run(**inputs)
    want = interp.run(p, inputs)
    for name in "SCB":
        assert_close(got[name], want[name], name)


def test_without_a_compiler_products_are_numpys(monkeypatch):
    p = lower(parse_program(PRODUCT))
    inputs = random_inputs(parse_program(PRODUCT), seed=13)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native_matmul.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="without native"):
            module = numpy_gen.load(p, threads=2, native=True)
        assert not hasattr(module, "matmul")
        assert_close(module.run(**inputs)["Y"], interp.run(p, inputs)["Y"], "numpy fallback")
    finally:
        native_matmul.library.cache_clear()


def test_a_convolution_in_parts_gathers_at_positions_no_group_hides(monkeypatch):
    """In a part the window's positions (o + s, offset by the part's start) are computed, not
    a tile known when the module loads: they stay a step of their own, which the gather reads,
    not a member of a native group with the one-hot comparison that the gather replaces
    (magika's convolution in parts failed to generate so)."""
    monkeypatch.setattr(numpy_plan, "parts_pay", lambda *_: True)
    ast = parse_program(CONVOLUTION.replace("dim o = 60 / 30", "dim o = 240 / 60")
                        .replace("dim j = 64", "dim j = 244"))
    p = lower(ast)
    parts = numpy_gen.generate_module(p, threads=2, split=True, native=True)
    assert max(parts.parts) > 1 and "gather_one_hot(" in parts.source
    inputs = random_inputs(ast, seed=15)
    assert_close(numpy_gen.module_from_source(parts.source).run(**inputs)["Y"],
                 interp.run(p, inputs)["Y"], "native parts vs interpreter")
