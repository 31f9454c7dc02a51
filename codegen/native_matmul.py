"""Native products: the numpy backend's matrix products in C (`matmul.c`) where native code is
on, in place of numpy's BLAS.

Why: the products of a transformer layer at a few hundred tokens are small (128 x 256 by
256 x 512), and OpenBLAS threads them poorly: on 2 cores of an AVX-512 Xeon it reached 227
GFLOP/s on that one, onnxruntime's MLAS 347, and `matmul.c` 340 (medians of 300 calls; a
transposed right operand, a weight read as W^T, 310).  On large products the three are level.

`matmul(x, y, threads)` computes `np.matmul(x, y)` for float32 operands of two or more
dimensions (the batch broadcast as numpy's is) on `threads` threads (`matmul.c`'s own): a kernel run whole
asks for every core, a kernel's part for one (the parts already take every core).  Anything
else (another dtype, a vector operand) goes to numpy.  Rounding differs from BLAS's: fused
multiply-adds, accumulated along k in blocks.  The library is compiled once per machine, as
native groups are (`codegen.native`); `compiled_matmul()` raises `NativeUnavailable` where it
cannot be.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from bbrules.codegen.native import NativeUnavailable, build

# -ffp-contract=fast (gcc's default, named): the micro-kernel's `acc += x * row` are fused
# multiply-adds
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC", "-pthread",
         "-ffp-contract=fast")

_SOURCE = Path(__file__).with_name("matmul.c")


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """`matmul.c` compiled for this machine, its `bb_matmul` typed."""
    try:
        text = _SOURCE.read_text()
    except OSError as e:
        raise NativeUnavailable(f"reading {_SOURCE} failed: {e}") from e
    lib = build(text, [], FLAGS)
    lib.bb_matmul.restype = ctypes.c_int
    lib.bb_matmul.argtypes = [ctypes.py_object] * 3 + [ctypes.c_int]
    return lib


def compiled_matmul() -> Callable[[np.ndarray, np.ndarray, int], np.ndarray]:
    """`matmul`, its library compiled (a native module calls this when it loads, so that a
    library that cannot be built leaves numpy code: `numpy_gen.loaded`)."""
    library()
    return matmul


def matmul(x: np.ndarray, y: np.ndarray, threads: int = 1) -> np.ndarray:
    """`np.matmul(x, y)` through `matmul.c` on `threads` threads where both are float32 arrays
    of two or more dimensions, else through numpy."""
    if x.ndim < 2 or y.ndim < 2 or x.dtype != np.float32 or y.dtype != np.float32:
        return np.matmul(x, y)
    if x.ndim != 2 or y.ndim != 2:
        batch = np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
        x = np.broadcast_to(x, batch + x.shape[-2:])
        y = np.broadcast_to(y, batch + y.shape[-2:])
    out = np.empty(x.shape[:-1] + y.shape[-1:], np.float32)
    if library().bb_matmul(out, x, y, threads):  # shapes that do not match: numpy's error
        return np.matmul(x, y)
    return out
