"""Native products: the numpy backend's matrix products in C (`matmul.c`) where native code is
on, in place of numpy's BLAS.

Why: the products of a transformer layer at a few hundred tokens are small (128 x 256 by
256 x 512), and OpenBLAS threads them poorly: on 2 cores of an AVX-512 Xeon it reached 227
GFLOP/s on that one, onnxruntime's MLAS 347, and `matmul.c` 340 (medians of 300 calls; a
transposed right operand, a weight read as W^T, 310).  On large products it is 5-15% ahead
of OpenBLAS (magika's convolution, 512 x 1280 by 1280 x 512: 1.7-1.9 against 2.0-2.2 ms).

`matmul(x, y, threads)` computes `np.matmul(x, y)` for float32 operands of two or more
dimensions (the batch broadcast as numpy's is) on `threads` threads (`matmul.c`'s own), and
`matmul(x, y, threads, add, scale)` `add + scale * np.matmul(x, y)`, the addend read as the
first block of the contraction starts (a residual, a bias, an attention mask) and the scale
applied as each block is stored (attention's): numpy passes less.  A kernel run whole asks
for every core, a kernel's part for one (the parts already take every core).  Anything else
(another dtype, a 1-D operand, a product too small to gain that numpy's OpenBLAS keeps on
one thread) goes to numpy: OpenBLAS's own threads, once woken, spin on the cores the native
threads need.  Rounding differs from BLAS's: fused multiply-adds, accumulated along k in
blocks.  The library is compiled once per machine, as native groups are (`codegen.native`);
`compiled_matmul()` raises `NativeUnavailable` where it cannot be.

`window_product(x, y, batch, threads)` is a product of one row per batch entry whose right
operand is a window of taps and positions that no view merges into a matrix (a depthwise 2-D
convolution's), read where it lies.

A constant right operand (a view of a read-only array, as `Imported` gives a model's weights:
`numpy_runtime.relaid`) is packed into the micro-kernel's panels once (`panels`) and the
panels kept while it lives, as onnxruntime packs its initializers when a session starts: each
product otherwise packs it again, reading the weight from memory a panel at a time (10-20% of
a 128 x 768 by 768 x 3072 product; GPT-2's block at width 768 ran 14% faster).  The panels
take the weight's memory again: with `$BBRULES_PACK_CONSTANTS=0` (or writeable weights) each
product packs it as it goes.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from bbrules.codegen.native import NativeUnavailable, build, builtin_functions, exported
from bbrules.codegen.numpy_runtime import constant_relaid, is_constant

# -ffp-contract=fast (gcc's default, named): the micro-kernel's `acc += x * row` are fused
# multiply-adds
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC", "-pthread",
         "-ffp-contract=fast")

_SOURCE = Path(__file__).with_name("matmul.c")


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """`matmul.c` compiled for this machine, with `bb_matmul`, `bb_matmuls`, `bb_pack`,
    `bb_window`, `bb_copy` and `bb_panel_width` as builtins (`product`, `products`, `panels`,
    `window_product`, `copy_into`), and `bb_address`."""
    try:
        text = _SOURCE.read_text()
    except OSError as e:
        raise NativeUnavailable(f"reading {_SOURCE} failed: {e}") from e
    return build(text + exported([("bb_matmul", 6), ("bb_matmuls", None), ("bb_pack", 2),
                                  ("bb_window", 4), ("bb_copy", 2), ("bb_address", 1),
                                  ("bb_panel_width", 0)]),
                 [], FLAGS)


@lru_cache(maxsize=None)
def product() -> Callable[..., int]:
    """`bb_matmul(out, a, b, c, scale, panels, threads)`: 0 once out = c + scale a @ b (c
    None: no addend; scale a float; panels b packed beforehand, `panels`, or None), 1 where
    the arrays do not fit."""
    return builtin_functions(library())["bb_matmul"]


@lru_cache(maxsize=None)
def products() -> Callable[..., int]:
    """`bb_matmuls(out0, a0, b0, c0, scale0, panels0, out1, ..., threads)`: 0 once every out
    = c + scale a @ b (one job on the threads), 1 where some group does not fit or there are
    more than `MAX_PRODUCTS`."""
    return builtin_functions(library())["bb_matmuls"]


@lru_cache(maxsize=None)
def _copy() -> Callable[..., int]:
    return builtin_functions(library())["bb_copy"]


def copy_into(out: np.ndarray, values: np.ndarray | None, threads: int = 1) -> None:
    """`out[...] = values` (zeros where values is None) for float32 arrays of one shape, in C
    (`bb_copy`: rows of a few floats, which numpy copies one short run at a time, a masked
    vector each), else by numpy."""
    if _copy()(out, values, threads):
        out[...] = 0 if values is None else values


@lru_cache(maxsize=None)
def address() -> Callable[[np.ndarray], int]:
    """The address of an array's first element (`bb_address`; numpy's word for it where the
    array gives no buffer)."""
    of = builtin_functions(library())["bb_address"]
    return lambda array: of(array, 1) or array.__array_interface__["data"][0]


@lru_cache(maxsize=None)
def panel_width() -> int:
    """The columns of a panel (matmul.c's NR: 64 with AVX-512, 16 with AVX2)."""
    return builtin_functions(library())["bb_panel_width"](0)


def panels(b: np.ndarray) -> np.ndarray:
    """The 2-D float32 array `b` packed into the panels `matmul.c`'s products read (`bb_pack`:
    its columns NR at a time, each panel K rows of NR floats, aligned to a cache line), which
    a product given them reads in place of packing `b` itself."""
    width = panel_width()
    k, n = b.shape
    size = -(-n // width) * k * width
    memory = np.empty(size + 16, _F32)
    start = -memory.__array_interface__["data"][0] % 64 // 4
    out = memory[start:start + size].reshape(-(-n // width), k, width)
    if builtin_functions(library())["bb_pack"](out, b, 1):
        raise ValueError(f"cannot pack a {b.dtype} array of shape {b.shape} into panels")
    return out


def _constant_panels(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """`y`'s panels where `y` is a 2-D view of a constant (`constant_relaid`), packed once and
    kept while the constant lives; None for any other operand, which the product packs
    itself, or reads in place where it has fewer rows than the micro-kernel's, and for fewer
    columns than a panel's: a loop's narrow slices of a weight (RMSNorm + FFN's blocks of 4
    hidden units) would each be padded to a panel and kept, many times the weight.  A model's
    weights are read every call: packing them took 10-20% of a 128 x 768 by 768 x 3072
    product (onnxruntime, too, packs its initializers once), and a product by one row (a
    decode step's) reads each panel as one stream where the weight's rows lie apart."""
    if y.ndim != 2 or y.shape[1] < panel_width() or not PACK_CONSTANTS:
        return None
    return constant_relaid(y, panels, "panels", address=address())


def compiled_matmul() -> Callable[[np.ndarray, np.ndarray, int], np.ndarray]:
    """`matmul`, its library compiled (a native module calls this when it loads, so that a
    library that cannot be built leaves numpy code: `numpy_gen.loaded`)."""
    library()
    return matmul


# Below this many rows or multiply-adds numpy's call costs less than `matmul.c`'s (2 cores of
# an AVX-512 Xeon, medians of 400 calls: 8 x 256 by 256 x 256, 10.0 µs native against 7.1;
# 64 x 64 by 64 x 64, 5.7 against 3.9; 32 x 128 by 128 x 128, 7.3 against 8.9; 128 x 64 by
# 64 x 128, 9.0 against 16.9), and the native product runs on one thread.
MIN_ROWS = 16
MIN_MACS = 1 << 19

# Constants are packed once unless `$BBRULES_PACK_CONSTANTS` is 0 (memory for speed: the
# panels take a model's weights' memory again).
PACK_CONSTANTS = os.environ.get("BBRULES_PACK_CONSTANTS", "1").strip() != "0"

# But not where numpy's OpenBLAS would run the product on its own threads (its defaults: from
# 2^18 multiply-adds a matrix, a product by a vector from 9,216 matrix elements): those spin
# after it, on the cores the native product and groups need.  LayerNorm + matmul's 2048 x 1024
# by 1024 x 1024 product took 16.2 ms right after its bias' 1 x 1024 by 1024 x 1024 through
# numpy, 10.8 alone.
BLAS_THREADS_MACS = 1 << 18
BLAS_THREADS_VECTOR = 9216


_F32 = np.dtype(np.float32)

# The rows of matmul.c's micro-kernel (its MR): a product of fewer is a thin one, its operand
# read in place
THIN_ROWS = 6

# Products `matmuls` runs as one job at most (matmul.c's MAX_PRODUCTS)
MAX_PRODUCTS = 8


def matmul(x: np.ndarray, y: np.ndarray, threads: int = 1, add: np.ndarray | None = None,
           scale: float = 1.0) -> np.ndarray:
    """`np.matmul(x, y)` times `scale`, plus `add` (broadcast to the product's shape, of as
    many dimensions; rows a divisor of the product's repeat) where given, through `matmul.c`
    where both are float32 arrays of two or more dimensions, on `threads` threads where the
    product is large enough; through numpy (given operands BLAS can read: a window whose rows
    overlap is copied) where numpy's call costs less and its BLAS stays on one thread."""
    swapped = _swapped(x, y, add)
    if swapped:
        x, y, add = y.T, x.T, None if add is None else add.T
    native = _native(x, y, swapped)
    if native is None:
        out = _numpy_product(x, y, add, scale)
    else:
        out, x, y, macs = native
        if product()(out, x, y, add, float(scale), _constant_panels(x, y),
                     threads if macs >= MIN_MACS else 1):
            out = _numpy_product(x, y, add, scale)  # (numpy's error, if any)
    return out.T if swapped else out


def matmuls(*operands: tuple[np.ndarray, ...], threads: int = 1) -> list[np.ndarray]:
    """`[matmul(x, y, threads, *extra) for x, y, *extra in operands]` (extra: the addend or
    None, and the scale), the products `matmul.c` takes run as one job (`bb_matmuls`; on
    `threads` threads where the job, not each product, has `MIN_MACS` multiply-adds): a
    kernel's products of one operand (K and V from the normed input, an MLP's gate and up)
    then share the threads' start and finish."""
    results: list[np.ndarray | None] = [None] * len(operands)
    native = []  # (index, (out, x, y, add, scale), multiply-adds)
    swapped = set()  # the products computed transposed (`_swapped`)
    for i, (x, y, *extra) in enumerate(operands):
        add, scale = extra[0] if extra else None, extra[1] if len(extra) > 1 else 1.0
        if _swapped(x, y, add):
            swapped.add(i)
            x, y, add = y.T, x.T, None if add is None else add.T
        if (got := _native(x, y, i in swapped)) is None:
            results[i] = _numpy_product(x, y, add, scale)
        else:
            native.append((i, (*got[:3], add, float(scale), _constant_panels(*got[1:3])),
                           got[3]))
    for start in range(0, len(native), MAX_PRODUCTS):
        job = native[start:start + MAX_PRODUCTS]
        macs = sum(m for _, _, m in job)
        if products()(*(a for _, arrays, _ in job for a in arrays),
                      threads if macs >= MIN_MACS else 1):
            for i, (_, x, y, add, scale, _), _ in job:  # numpy's error, if any
                results[i] = _numpy_product(x, y, add, scale)
        else:
            for i, arrays, _ in job:
                results[i] = arrays[0]
    return [r.T if i in swapped else r for i, r in enumerate(results)]


def window_product(x: np.ndarray, y: np.ndarray, batch: int, threads: int = 1) -> np.ndarray:
    """The product of one row per batch entry by a window (`matmul.c`'s `bb_window`): `x` of
    the batch's `batch` dimensions then the taps', `y` of the batch's, the taps' and the
    positions', each dimension of either the result's extent or 1; the result, of the batch's
    then the positions' dimensions, is x's taps times y's, summed.  A depthwise convolution
    over two spatial dimensions reads its window so without copying it (a copy merges the
    taps and the positions that a product asks for: `bb_window`).  Through numpy's einsum
    where the arrays do not fit `bb_window`."""
    taps = x.ndim - batch
    shape = tuple(max(a, b) for a, b in zip(x.shape[:batch], y.shape[:batch])) + \
        y.shape[batch + taps:]
    out = np.empty(shape, _F32)
    if x.dtype == _F32 and y.dtype == _F32 and \
            not builtin_functions(library())["bb_window"](out, x, y, batch, threads):
        return out
    letters = [chr(ord("a") + i) for i in range(y.ndim)]
    return np.einsum(f"{''.join(letters[:batch + taps])},{''.join(letters)}->"
                     f"{''.join(letters[:batch] + letters[batch + taps:])}", x, y).astype(_F32)


def _swapped(x: np.ndarray, y: np.ndarray, add: np.ndarray | None) -> bool:
    """Is x @ y better computed as (y^T @ x^T)^T, written into the rows of x @ y?  Where x
    is a constant and y is not (a convolution's weight times an image laid channels first),
    x is then packed once into panels as the right operand (`_constant_panels`), and the
    image's columns, a few hundred positions, lie along the micro-kernel's rows, MR of them,
    where as the panels' columns they were padded to NR and packed every call: 768 x 3072
    by 3072 x 100 took 2.8 ms on 2 cores of an AMD EPYC, 2.1 swapped; 512 x 512 by 512 x
    200, 0.59 and 0.46; a width of whole panels, 768 x 3072 by 3072 x 1024, 22.4 and 22.1.
    And where y has fewer columns than the micro-kernel has rows (a matrix times a vector:
    squeeze-and-excitation's pointwise convolutions), which one panel pads to NR: the
    product is then a thin one (3072 x 192 by 192 x 1, 336 µs, swapped 27).  Not for an
    addend whose rows repeat (its period would fall on the columns)."""
    if x.ndim != 2 or y.ndim != 2 or x.dtype != _F32 or x.shape[0] < panel_width() or \
            (add is not None and np.shape(add)[0] not in (1, x.shape[0])):
        return False
    return y.shape[1] < THIN_ROWS or (PACK_CONSTANTS and is_constant(x) and not is_constant(y))


def _numpy_product(x: np.ndarray, y: np.ndarray, add: np.ndarray | None, scale: float
                   ) -> np.ndarray:
    """`add + scale * x @ y` through numpy (an addend of fewer rows than the product's,
    a divisor of them, repeated along them)."""
    out = np.matmul(_blas_ready(x), _blas_ready(y))
    if scale != 1.0:
        out *= out.dtype.type(scale)
    if add is not None:
        m, period = out.shape[-2], np.shape(add)[-2]
        if period in (1, m):
            out += add
        else:
            rows = out.reshape(*out.shape[:-2], m // period, period, out.shape[-1])
            rows += np.asarray(add)[..., None, :, :]
    return out


def _native(x: np.ndarray, y: np.ndarray, transposed: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(out, x, y, multiply-adds) for `matmul.c`'s product of `x` and `y`, their batch
    broadcast and `out` allocated (`transposed`: the transposed view of a row-major array,
    for a product computed transposed, `_swapped`); None where numpy's product is the one
    to call."""
    # (each step a few hundred ns warm, several times that in a run)
    if x.dtype != _F32 or y.dtype != _F32 or x.ndim < 2 or y.ndim < 2:
        return None
    xs, ys = x.shape, y.shape
    m, k, n = xs[-2], xs[-1], ys[-1]
    macs = x.size * n
    vector = m == 1 or n == 1
    if (m < MIN_ROWS or macs < MIN_MACS) and \
            m * k * n < (BLAS_THREADS_VECTOR if vector else BLAS_THREADS_MACS + 1) and \
            not _across(y, m, k):
        return None
    if len(xs) > 2 or len(ys) > 2:
        if xs[:-2] != ys[:-2]:  # (numpy's helpers cost 6 µs a call: not when equal)
            batch = np.broadcast_shapes(xs[:-2], ys[:-2])
            x = np.broadcast_to(x, batch + xs[-2:])
            y = np.broadcast_to(y, batch + ys[-2:])
        return np.empty(x.shape[:-1] + (n,), _F32), x, y, macs
    return np.empty((n, m), _F32).T if transposed else np.empty((m, n), _F32), x, y, macs


# The longest contraction and the fewest batch entries in a row of a product `matmul.c` runs
# across its batch (its `across`: ACROSS_K, and W with AVX-512)
ACROSS_K = 64
ACROSS_LANES = 16


def _across(y: np.ndarray, m: int, k: int) -> bool:
    """Is a product of one row by `y` one that `matmul.c` runs across its batch (`across`: a
    depthwise convolution's window over channels laid innermost), y contiguous along the
    batch's innermost dimension and along neither of its own?  numpy's matmul copies such a
    window and runs a product a channel: Conformer's 15-tap convolution over 384 channels
    and 256 positions, 1.1 ms against 0.1."""
    return m == 1 and k <= ACROSS_K and y.ndim > 2 and y.shape[-3] >= ACROSS_LANES and \
        y.strides[-3] == 4 and 4 not in y.strides[-2:]


def _blas_ready(a: np.ndarray) -> np.ndarray:
    """`a`, or a copy of it where its matrices' rows or columns overlap (a convolution's
    window as `gather_one_hot` views it): numpy's matmul computes those without BLAS."""
    if a.ndim < 2 or 0 in a.shape:
        return a
    (rs, cs), (rows, cols), item = a.strides[-2:], a.shape[-2:], a.itemsize
    if (cs == item and rs >= cols * item) or (rs == item and cs >= rows * item) or \
            rows == 1 or cols == 1:
        return a
    return np.ascontiguousarray(a)
