"""Native products: the numpy backend's matrix products in C (`matmul.c`) where native code is
on, in place of numpy's BLAS.

Why: the products of a transformer layer at a few hundred tokens are small (128 x 256 by
256 x 512), and OpenBLAS threads them poorly: on 2 cores of an AVX-512 Xeon it reached 227
GFLOP/s on that one, onnxruntime's MLAS 347, and `matmul.c` 340 (medians of 300 calls; a
transposed right operand, a weight read as W^T, 310).  On large products it is 5-15% ahead
of OpenBLAS (magika's convolution, 512 x 1280 by 1280 x 512: 1.7-1.9 against 2.0-2.2 ms).

`matmul(x, y, threads)` computes `np.matmul(x, y)` for float32 operands of two or more
dimensions (the batch broadcast as numpy's is) on `threads` threads (`matmul.c`'s own): a
kernel run whole asks for every core, a kernel's part for one (the parts already take every
core).  Anything else (another dtype, a 1-D operand, a product too small to gain that numpy's
OpenBLAS keeps on one thread) goes to numpy: OpenBLAS's own threads, once woken, spin on the
cores the native threads need.  Rounding differs from BLAS's: fused multiply-adds,
accumulated along k in blocks.  The library is compiled once per machine, as
native groups are (`codegen.native`); `compiled_matmul()` raises `NativeUnavailable` where it
cannot be.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from bbrules.codegen.native import NativeUnavailable, build, builtin_functions, exported

# -ffp-contract=fast (gcc's default, named): the micro-kernel's `acc += x * row` are fused
# multiply-adds
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC", "-pthread",
         "-ffp-contract=fast")

_SOURCE = Path(__file__).with_name("matmul.c")


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """`matmul.c` compiled for this machine, with `bb_matmul` as a builtin (`product`)."""
    try:
        text = _SOURCE.read_text()
    except OSError as e:
        raise NativeUnavailable(f"reading {_SOURCE} failed: {e}") from e
    return build(text + exported([("bb_matmul", 3)]), [], FLAGS)


@lru_cache(maxsize=None)
def product() -> Callable[[np.ndarray, np.ndarray, np.ndarray, int], int]:
    """`bb_matmul(out, a, b, threads)`: 0 once out = a @ b, 1 where the arrays do not fit."""
    return builtin_functions(library())["bb_matmul"]


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

# But not where numpy's OpenBLAS would run the product on its own threads (its defaults: from
# 2^18 multiply-adds a matrix, a product by a vector from 9,216 matrix elements): those spin
# after it, on the cores the native product and groups need.  LayerNorm + matmul's 2048 x 1024
# by 1024 x 1024 product took 16.2 ms right after its bias' 1 x 1024 by 1024 x 1024 through
# numpy, 10.8 alone.
BLAS_THREADS_MACS = 1 << 18
BLAS_THREADS_VECTOR = 9216


def matmul(x: np.ndarray, y: np.ndarray, threads: int = 1) -> np.ndarray:
    """`np.matmul(x, y)` through `matmul.c` where both are float32 arrays of two or more
    dimensions, on `threads` threads where the product is large enough; through numpy (given
    operands BLAS can read: a window whose rows overlap is copied) where numpy's call costs
    less and its BLAS stays on one thread."""
    if x.ndim < 2 or y.ndim < 2 or x.dtype != np.float32 or y.dtype != np.float32:
        return np.matmul(_blas_ready(x), _blas_ready(y))
    (m, k), n = x.shape[-2:], y.shape[-1]
    macs = x.size * n
    vector = m == 1 or n == 1
    if (m < MIN_ROWS or macs < MIN_MACS) and \
            m * k * n < (BLAS_THREADS_VECTOR if vector else BLAS_THREADS_MACS + 1):
        return np.matmul(_blas_ready(x), _blas_ready(y))
    if macs < MIN_MACS:
        threads = 1
    if x.shape[:-2] != y.shape[:-2]:  # (numpy's helpers cost 6 µs a call: not when equal)
        batch = np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
        x = np.broadcast_to(x, batch + x.shape[-2:])
        y = np.broadcast_to(y, batch + y.shape[-2:])
    out = np.empty(x.shape[:-1] + y.shape[-1:], np.float32)
    if product()(out, x, y, threads):  # shapes that do not match: numpy's error
        return np.matmul(_blas_ready(x), _blas_ready(y))
    return out


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
