"""Native groups: a chain of elementwise operators, and the reduction within the tile that
reads it, as one C loop, for the numpy backend.

Why: numpy runs each operator as a pass of its own over memory, allocating its result.  A
GELU is eight passes over its tile; magika's bias, GELU, padding mask and max over 508
positions took 0.5 ms as numpy calls, and 0.2 ms as one C loop (2 cores with AVX-512).  On
small models numpy's passes are what is left after the products.

What a group is: operators of one tile's dimensions (or of one value a row of it, as a norm's
scale), each read only by others of the group (`numpy_gen` decides that from the kernel's
schedule), perhaps ending in a sum, max or min along the tile's innermost dimension
(returning the values too where another step reads them: a softmax's exponentials); its
*leaves* are the tiles it reads (arrays of its dimensions or broadcast along some of them:
size 1 in the kernel's layout) and numbers, baked into the C as exact hexadecimal literals.
Each group is one C function over the dimensions known while generating and the arrays'
strides read at run time through the buffer protocol (views of inputs, transposed products):
adjacent dimensions every array walks in step are merged (`bb_merge`), and the innermost
loop runs vectorised where every array it walks is contiguous there, else strided
(`function`).

Numerics: each operator's C follows `bbrules.ops`' numpy definition (the same formula, the
same order of float32 roundings, no contraction into fused multiply-adds), with glibc's
float functions and their vector variants (libmvec, declared SIMD so the loops vectorise)
in place of numpy's.  Those differ from numpy's by a few units in the last place (exp,
tanh, log, erf; numpy's erf is a 1.5e-7 approximation), exp flushes results below float's
smallest normal to zero (`bb_expf`), and a sum adds `LANES` interleaved partial sums, not
numpy's pairwise ones; so a native module agrees with the numpy one to float rounding, not
bit for bit.  Max and min propagate NaN as numpy's do.

The C is compiled once per source and machine (`-march=native`) into a cache folder
(`$BBRULES_CACHE`, else `$XDG_CACHE_HOME/bbrules`, else `~/.cache/bbrules`), against
Python's headers; where no C compiler is found or compiling fails, the numpy backend writes
numpy code instead (`numpy_gen.load`).  A group's function releases the GIL while it loops,
so the parts of a kernel run it on every core at once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from contextlib import suppress
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from bbrules.ir import Node, children, operator
from bbrules.ops import ELEMENTWISE

# Each operator as a C expression over float operands {x} (, {y}, {z}): the CUDA backend's
# template, except where numpy's definition differs from it (the CUDA templates use CUDA's
# own functions, NaN-dropping fmaxf, and exp-based sigmoids).
C_OPS: dict[str, str] = {name: info.cuda for name, info in ELEMENTWISE.items()} | {
    # np.maximum / np.minimum propagate a NaN operand; fmaxf / fminf drop it
    "max": "((({x}) >= ({y}) || ({x}) != ({x})) ? ({x}) : ({y}))",
    "min": "((({x}) <= ({y}) || ({x}) != ({x})) ? ({x}) : ({y}))",
    "relu": "((({x}) >= 0.0f || ({x}) != ({x})) ? ({x}) : 0.0f)",
    "rsqrt": "(1.0f / sqrtf({x}))",  # glibc has no rsqrtf; numpy computes 1 / sqrt(x)
    "exp": "bb_expf({x})",
    # bbrules.ops' sigmoid is 0.5 (1 + tanh(x / 2)), silu x times it
    "sigmoid": "(0.5f * (1.0f + tanhf(({x}) * 0.5f)))",
    "silu": "(({x}) * (0.5f * (1.0f + tanhf(({x}) * 0.5f))))",
    "gelu": "(0.5f * ({x}) * (1.0f + tanhf(0.7978845608028654f * "
            "(({x}) + 0.044715f * ({x}) * ({x}) * ({x})))))",
}

# glibc's float functions that have vector variants in libmvec (glibc 2.35 and later):
# declared SIMD, a loop calling them vectorises.
VECTOR_MATH = ("expf", "logf", "sinf", "cosf", "tanhf", "erff", "exp2f", "expm1f", "log1pf",
               "powf")
_DECLARED = "".join(f'__attribute__((simd("notinbranch"))) float {f}(float'
                    f'{", float" if f == "powf" else ""});\n' for f in VECTOR_MATH)

# -mprefer-vector-width=512: gcc's default on AVX-512 Intel cores is 256-bit vectors (a
# GELU over 131,072 floats: 62 µs at 512 bits; numpy's passes took 155)
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC",
         "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")

_F32 = np.dtype(np.float32)  # (a dtype compares with a dtype faster than with a type)

_PRELUDE = """\
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

static void bb_release(int count, Py_buffer *views) {
    for (int k = 0; k < count; k++)
        PyBuffer_Release(&views[k]);
}

/* The bytes from the lowest to past the highest element of `v`. */
static void bb_span(const Py_buffer *v, const char **lo, const char **hi) {
    *lo = *hi = v->buf;
    for (int d = 0; d < v->ndim; d++) {
        const Py_ssize_t reach = v->strides[d] * (v->shape[d] - 1);
        *(reach < 0 ? lo : hi) += reach;
    }
    *hi += v->itemsize;
}

/* Does the array written first share memory with a leaf (an array after the `written`)
   other than one laid out as it is, whose elements each are read before they are written?
   The span test numpy's `may_share_memory` makes: here, since a Python call of it for each
   leaf cost 1.2% of LLaMA's layer at 128 tokens (a Python call costs several times its warm
   time in a run whose products stream their weights through the caches). */
static int bb_overlaps(int count, int written, const Py_buffer *views, int nd) {
    const char *lo, *hi, *leaf_lo, *leaf_hi;
    bb_span(&views[0], &lo, &hi);
    for (int k = written; k < count; k++) {
        int same = views[k].buf == views[0].buf;
        for (int d = 0; same && d < nd; d++)
            same = views[k].shape[d] == views[0].shape[d] &&
                   (views[k].shape[d] == 1 || views[k].strides[d] == views[0].strides[d]);
        bb_span(&views[k], &leaf_lo, &leaf_hi);
        if (!same && leaf_lo < hi && lo < leaf_hi)
            return 1;
    }
    return 0;
}

/* Marks a library whose `bb_buffers` makes that test (`Library`). */
const int bb_checks_overlap = 1;

/* The buffers of `count` arrays (the first `written` written), each a float32 array of shape
   `shapes[k]` of `nd` dimensions, and their strides in elements along the `walked`
   dimensions `kept` (0 where an array's extent is 1: it is broadcast).  0 when every array
   is such; else, nothing held and no Python error set, 2 where the first array overlaps a
   leaf (`bb_overlaps`: the caller writes into a new one) and 1 otherwise (the caller
   converts its arrays). */
static int bb_buffers(int count, int written, PyObject **arrays, Py_buffer *views, int nd,
                      const long *shapes, int walked, const int *kept, long *strides) {
    for (int k = 0; k < count; k++) {
        int flags = PyBUF_STRIDES | PyBUF_FORMAT | (k < written ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(arrays[k], &views[k], flags) != 0) {
            PyErr_Clear();
            bb_release(k, views);
            return 1;
        }
        const Py_buffer *v = &views[k];
        int fits = v->ndim == nd && v->itemsize == 4 && v->format != NULL &&
                   strcmp(v->format, "f") == 0;
        for (int d = 0; fits && d < nd; d++)
            fits = v->shape[d] == shapes[k * nd + d] && v->strides[d] % 4 == 0;
        if (!fits) {
            bb_release(k + 1, views);
            return 1;
        }
        for (int j = 0; j < walked; j++)
            strides[k * walked + j] = shapes[k * nd + kept[j]] == 1 ? 0
                                      : (long)(v->strides[kept[j]] / 4);
    }
    if (bb_overlaps(count, written, views, nd)) {
        bb_release(count, views);
        return 2;
    }
    return 0;
}

/* expf, its results below float's smallest normal (x < -87.33) flushed to zero.  libmvec's
   vector expf computes such lanes, and infinities, one by one through the scalar function:
   a causal softmax's masked scores (-inf) made exp 7x slower than numpy's.  Those lanes are
   clamped by their bits (gcc folds a float comparison the result's selection repeats) and
   their result selected afterwards; a NaN stays a NaN. */
static inline float bb_expf(float x) {
    union { float f; unsigned u; } v = {x};
    v.u = v.u > 0xc2aea8f6u ? 0xc2aea8f6u : v.u;  /* max(x, -87.33) for x < 0 */
    const float y = expf(v.f);
    return x < -87.33f ? 0.0f : (x != x ? x : y);
}

typedef void (*bb_work)(const void *ctx, long item, void *scratch);

/* The native product's threads (`bb_parallel_for` in matmul.c), set when the module loads;
   NULL where that library is not there: every group then runs on the calling thread. */
static void (*bb_parallel)(bb_work, const void *, long, int);

void bb_set_parallel(void *fn) {
    bb_parallel = (void (*)(bb_work, const void *, long, int))fn;
}

/* Every row of a group (`work`, over the merged dimensions `n`: rows of n[nd - 1] elements),
   in runs (`*run` rows) of at least BB_PARALLEL_ELEMENTS elements, about four a thread,
   on `threads` threads where there are two runs or more; `columns`: `work` walks them by
   columns. */
static void bb_rows(bb_work work, void *ctx, long *run, const long *n, int nd, int threads,
                    int columns) {
    long rows = 1;
    for (int d = 0; d < nd - 1; d++)
        rows *= n[d];
    const long length = n[nd - 1] > 1 ? n[nd - 1] : 1;
    const long least = (BB_PARALLEL_ELEMENTS + length - 1) / length;
    const long share = (rows + 4L * threads - 1) / (4L * threads);
    *run = share > least ? share : least;
    /* A walk by columns takes whole columns of the last two dimensions a run: a run of some
       columns reads and writes a piece of every row (MBConv's transposed scaling, 100 x
       3072, in runs of 13 of its 100 columns: 150-230 µs on 2 threads, 55 on one). */
    if (columns && nd > 1)
        *run = (*run + n[nd - 2] - 1) / n[nd - 2] * n[nd - 2];
    if (threads > 1 && bb_parallel != NULL && rows > *run) {
        bb_parallel(work, ctx, (rows + *run - 1) / *run, threads);
    } else {
        *run = rows > 1 ? rows : 1;
        work(ctx, 0, NULL);
    }
}

/* A group without a reduction that merging made one long row (the dimension before it left at
   1): cut into rows of whole pieces, as many as give `threads` threads about four each and
   each BB_PARALLEL_ELEMENTS elements at least, for `bb_rows` to share. */
static void bb_split(int nd, int arrays, long *n, long *s, int threads) {
    if (nd < 2 || n[nd - 2] != 1 || threads < 2)
        return;
    const long m = n[nd - 1];
    long pieces = 4L * threads;
    while (pieces > 1 && (m % pieces != 0 || m / pieces < BB_PARALLEL_ELEMENTS))
        pieces--;
    if (pieces < 2)
        return;
    n[nd - 2] = pieces;
    n[nd - 1] = m / pieces;
    for (int k = 0; k < arrays; k++)
        s[k * nd + nd - 2] = s[k * nd + nd - 1] * (m / pieces);
}

/* Merge adjacent dimensions that every array walks in step (a stride is its inner
   neighbour's times that neighbour's extent): the innermost loop then runs as long as
   memory allows.  A merged dimension is left with extent 1, outermost. */
static void bb_merge(int nd, int arrays, long *n, long *s) {
    int inner = nd - 1;
    for (int d = nd - 2; d >= 0; d--) {
        int merges = 1;
        for (int k = 0; k < arrays && merges; k++)
            merges = s[k * nd + d] == s[k * nd + inner] * n[inner];
        if (merges) {
            n[inner] *= n[d];
            n[d] = 1;
        } else {
            inner = d;
        }
    }
    /* The dimensions left with extent 1 moved outermost, the others in their order: the last
       two, walked as rows and columns, are then the innermost that have elements to walk (a
       GLU's halves, channels by tokens of a transposed product, had merged into 384 x 1 x
       256, walked by strided rows of 256 tokens: 660 µs, against 30 by contiguous columns).
       A dimension takes the columns' place only where every array walks it as it walks the
       columns (the C is written for the leaves that span the columns' own dimension). */
    for (int d = nd - 1, to = nd - 1; d >= 0; d--) {
        if (n[d] == 1)
            continue;
        if (d != to) {
            int alike = 1;
            for (int k = 0; k < arrays && to == nd - 2 && alike; k++)
                alike = (s[k * nd + d] != 0) == (s[k * nd + to] != 0);
            if (!alike)
                break;
            n[to] = n[d];
            n[d] = 1;
            for (int k = 0; k < arrays; k++)
                s[k * nd + to] = s[k * nd + d];
        }
        to--;
    }
}
"""


class NativeUnavailable(RuntimeError):
    """No C compiler, or compiling (loading) the source failed."""


def literal(v: float) -> str:
    """`v` rounded to float32, as an exact C literal."""
    f = float(np.float32(v))
    if f != f:
        return "NAN"
    if f in (float("inf"), float("-inf")):
        return "INFINITY" if f > 0 else "(-INFINITY)"
    return f"{f.hex()}f"


# In-tile reductions a group may end in: identity and combine (NaN-propagating, as numpy's).
REDUCTIONS: dict[str, tuple[str, str]] = {
    "sum": ("0.0f", "(({x}) + ({y}))"),
    "max": ("(-INFINITY)", C_OPS["max"]),
    "min": ("INFINITY", C_OPS["min"]),
}

# Partial results a reduction keeps per row, combined at its end: one vector register of
# floats, so the loop over a row vectorises (and a sum adds 16 interleaved sums, not one).
LANES = 16

# A run of rows that one thread takes (`bb_rows`) has at least this many elements: 5-15 µs
# of work at 0.3-1 ns an element, several times what handing it to a spinning worker costs.
# (Chosen, not swept; magika's groups, of 65,536-262,144 elements, gained 3.40 -> 3.17 ms.)
PARALLEL_ELEMENTS = 1 << 14


@dataclass(frozen=True)
class Group:
    """One group as the numpy backend hands it over: its function's name, the dimensions its
    loops walk, each array leaf's dimensions (1 where it is broadcast), the C statements
    computing the float `out` from the leaves read as `l0`, `l1`, ..., and the reduction it
    ends in, if any: (sum, max or min, the dimension), always the innermost one it walks;
    `keeps`: a reduction's group writes the values it reduces too (another step reads them:
    a softmax's exponentials, which its product with V reads beside their sum)."""

    name: str
    dims: tuple[int, ...]
    leaves: tuple[tuple[int, ...], ...]
    body: tuple[str, ...]
    reduce: tuple[str, int] | None = None
    keeps: bool = False

    def outputs(self) -> tuple[tuple[int, ...], ...]:
        """The dimensions of the arrays it writes: the values, the reduction, or both."""
        if self.reduce is None:
            return (self.dims,)
        return ((self.dims,) if self.keeps else ()) + (self.result(),)

    def result(self) -> tuple[int, ...]:
        """The result's dimensions: those walked, but one along a reduced dimension."""
        if self.reduce is None:
            return self.dims
        return tuple(1 if d == self.reduce[1] else n for d, n in enumerate(self.dims))

    def kept(self) -> tuple[int, ...]:
        """The dimensions the loops walk: those of more than one element."""
        return tuple(d for d, n in enumerate(self.dims) if n > 1) or (len(self.dims) - 1,)

    def spans(self, leaf: int) -> tuple[int, ...]:
        """The walked dimensions leaf `leaf` spans (its stride is read at run time)."""
        return tuple(d for d in self.kept() if self.leaves[leaf][d] > 1)


def statements(root: Node, group: set[Node], leaf: Callable[[Node], str],
               operand: Callable[[Node], Node] = lambda c: c) -> tuple[str, ...]:
    """C statements computing `root` into `out` from the operators in `group` (root
    included), reading every other operand through `leaf` (an `l<i>` or a literal); each
    operand is `operand(c)` (what a selection by a known condition is)."""
    names: dict[Node, str] = {}
    lines: list[str] = []
    stack = [root]
    while stack:  # operands first, without recursion (groups may be deep)
        n = stack[-1]
        pending = [c for c in map(operand, children(n)) if c in group and c not in names]
        if pending:
            stack += pending
            continue
        stack.pop()
        if n in names:
            continue
        args = [names[c] if c in group else leaf(c) for c in map(operand, children(n))]
        text = C_OPS[operator(n).name].format(**dict(zip("xyz", args)))
        names[n] = f"v{len(names)}"
        lines.append(f"const float {names[n]} = {text};")
    return (*lines, f"out = {names[root]};")


def function(g: Group) -> str:
    """The C function of one group: `int name(PyObject *out, ..., PyObject *leaf0, ...,
    int threads)` (its `outputs`, then its leaves), 0 once it has written its outputs, 1
    where some array is not a float32 array of its dimensions.

    Adjacent dimensions are merged at run time (`bb_merge`; never a reduced one with another,
    since the reduction's result does not walk it).  The last two dimensions left are walked
    by rows where every array's rows are contiguous, vectorised along them (a reduction folds
    each row into `LANES` partial results, combined at its end); else by columns where the
    columns are (a transposed view: a reduction folds a whole column of results at once), or
    where the outputs' are, the leaves read at their strides; else element by element,
    strided.

    The rows (every row of the last two dimensions, under every index of the others; a map
    merged into one row is first cut into pieces, `bb_split`) are cut into runs of at least
    `PARALLEL_ELEMENTS` elements that `threads` threads take one at a time (`bb_parallel`,
    the native product's threads).  A row is never split, nor, where the rows are walked by
    columns, the columns (`<name>_by_columns`)."""
    kept = g.kept()
    nd, k = len(kept), len(g.leaves)
    values, reduced = g.reduce is None or g.keeps, g.reduce is not None
    outs = len(g.outputs())
    arrays = outs + k
    v_at, a_at = 0, outs - 1  # the arrays of the values and of the reduction's result
    shapes = ", ".join(str(n) for dims in (*g.outputs(), *g.leaves) for n in dims)
    outer = max(nd - 2, 0)  # dimensions above the block's last two, walked by the runs
    ctx = f"{g.name}_ctx"
    header = ["typedef struct {",
              *(["    float *ov;"] if values else []),
              *(["    float *oa;"] if reduced else []),
              *([f"    const float *a[{k}];"] if k else []),
              f"    long n[{nd}], s[{arrays}][{nd}], run;",
              f"}} {ctx};",
              "",
              f"/* Rows [item * run, (item + 1) * run) of {g.name}. */",
              f"static void {g.name}_rows(const void *cx, long item, void *scratch) {{",
              f"    const {ctx} *x = cx;",
              "    (void)scratch;",
              "    const long *n = x->n;",
              f"    const long (*s)[{nd}] = x->s;",
              *(["    float *ov = x->ov;"] if values else []),
              *(["    float *oa = x->oa;"] if reduced else []),
              *(f"    const float *a{i} = x->a[{i}];" for i in range(k)),
              f"    const long w = {f'n[{nd - 2}]' if nd > 1 else '1'};",
              f"    const long total = w{''.join(f' * n[{j}]' for j in range(outer))};",
              "    const long last = (item + 1) * x->run < total ? (item + 1) * x->run : total;",
              "    for (long f = item * x->run; f < last;) {",
              "        const long o = f / w, j0 = f % w;",
              "        const long j1 = last - o * w < w ? last - o * w : w;",
              *(["        long rest = o;"] if outer else []),
              *(line for j in reversed(range(outer)) for line in (
                  f"        const long i{j} = rest % n[{j}];", f"        rest /= n[{j}];")),
              *(["        (void)j0, (void)j1;"] if nd == 1 else [])]
    indent = "        "

    def offset(array: int) -> str:
        return "".join(f" + i{j} * s[{array}][{j}]" for j in range(outer))
    block = [*([f"float *pv = ov{offset(v_at)};"] if values else []),
             *([f"float *pa = oa{offset(a_at)};"] if reduced else []),
             *(f"const float *p{i} = a{i}{offset(outs + i)};" for i in range(k)),
             f"const long m = n[{nd - 1}];",
             *([f"const long t = s[{v_at}][{nd - 1}];"] if values else []),
             *(f"const long t{i} = s[{outs + i}][{nd - 1}];" for i in range(k))]
    inner = [i for i in range(k) if kept[-1] in g.spans(i)]  # leaves walking the last loop
    rows = " && ".join([*(["t == 1"] if values else []),  # (a reduction's result: one a row)
                        *(f"t{i} == 1" for i in inner)]) or "1"
    row = _row if reduced else _map_loop
    walk: list[str] = []  # `<name>_by_columns`, where there are columns
    if nd == 1:
        block += _branches([(rows, row(g, inner, True, "pv", "pa", "p")),
                            ("", row(g, inner, False, "pv", "pa", "p"))])
    else:
        across = [i for i in range(k) if kept[-2] in g.spans(i)]  # leaves walking columns
        block += [*([f"const long c = s[{v_at}][{nd - 2}];"] if values else []),
                  *([f"const long ca = s[{a_at}][{nd - 2}];"] if reduced else []),
                  *(f"const long c{i} = s[{outs + i}][{nd - 2}];" for i in range(k))]

        def by_row(contiguous: bool) -> list[str]:
            return ["for (long j = j0; j < j1; j++) {",
                    *(["    float *qv = pv + j * c;"] if values else []),
                    *(["    float *qa = pa + j * ca;"] if reduced else []),
                    *(f"    const float *q{i} = p{i} + j * c{i};" for i in range(k)),
                    *(f"    {s}" for s in row(g, inner, contiguous, "qv", "qa", "q")), "}"]
        outputs = [*(["c == 1"] if values else []), *(["ca == 1"] if reduced else [])]
        contiguous = " && ".join([*outputs, *(f"c{i} == 1" for i in across)])
        mixed = [(" && ".join(outputs), _columns(g, inner, across, strided=True))] \
            if across else []
        block += _branches([(rows, by_row(True)),
                            (contiguous, _columns(g, inner, across, strided=False)),
                            *mixed, ("", by_row(False))])
        strides = [line for line in block if line.startswith("const long t") or
                   line.startswith("const long c")]
        columns = f"!({rows}) && ({contiguous}{f' || {mixed[0][0]}' if mixed else ''})"
        walk = [f"/* Whether {g.name}_rows walks rows of strides `s` by columns. */",
                f"static int {g.name}_by_columns(const long (*s)[{nd}]) {{",
                *(f"    {line}" for line in strides),
                *(f"    (void){line.split()[2]};" for line in strides),
                f"    return {columns};",
                "}",
                ""]
    header += [indent + "{", *(f"{indent}    {s}" for s in block), indent + "}",
               "        f = o * w + j1;",
               "    }",
               "}",
               ""]
    lines = [*header, *walk,
             f"int {g.name}({', '.join(f'PyObject *x{i}' for i in range(arrays))}, "
             "int threads) {",
             f"    PyObject *arrays[{arrays}] = {{{', '.join(f'x{i}' for i in range(arrays))}}};",
             f"    static const long shapes[] = {{{shapes}}};",
             f"    static const int kept[] = {{{', '.join(map(str, kept))}}};",
             f"    {ctx} x = {{.n = {{{', '.join(str(g.dims[d]) for d in kept)}}}}};",
             f"    Py_buffer v[{arrays}];",
             f"    const int got = bb_buffers({arrays}, {outs}, arrays, v, {len(g.dims)}, shapes, "
             f"{nd}, kept, &x.s[0][0]);",
             "    if (got)",
             "        return got;",
             *([f"    x.ov = v[{v_at}].buf;"] if values else []),
             *([f"    x.oa = v[{a_at}].buf;"] if reduced else []),
             *(f"    x.a[{i}] = v[{outs + i}].buf;" for i in range(k)),
             "    Py_BEGIN_ALLOW_THREADS",
             f"    bb_merge({nd}, {arrays}, x.n, &x.s[0][0]);",
             *([f"    bb_split({nd}, {arrays}, x.n, &x.s[0][0], threads);"]
               if not reduced else []),
             f"    bb_rows({g.name}_rows, &x, &x.run, x.n, {nd}, threads, "
             f"{f'{g.name}_by_columns(x.s)' if nd > 1 else '0'});",
             "    Py_END_ALLOW_THREADS",
             f"    bb_release({arrays}, v);",
             "    return 0;",
             "}"]
    return "\n".join(lines)


def _branches(cases: list[tuple[str, list[str]]]) -> list[str]:
    """`if (c0) {...} else if (c1) {...} else {...}`; the last case's condition is empty."""
    out: list[str] = []
    for n, (condition, body) in enumerate(cases):
        head = "} else {" if not condition else f"{'} else ' if n else ''}if ({condition}) {{"
        out += [head, *(f"    {s}" for s in body)]
    return [*out, "}"]


def _element(g: Group, reads: Sequence[str | None], done: Sequence[str]) -> list[str]:
    """One element: its leaves read (those read None are read before its loop: `_row_leaves`),
    the group's statements, and `done` with `out`."""
    return ["{", *(f"    {s}" for s in [*(f"const float l{i} = {r};" for i, r in
                                           enumerate(reads) if r is not None),
                                         "float out;", *g.body, *done]),
            "}"]


def _row_leaves(g: Group, inner: Sequence[int], p: str) -> list[str]:
    """The leaves a row reads one element of, read once before its loop: what only they
    decide (a norm's rsqrt(mean + eps)) is then computed once a row, not once an element,
    which the compiler could not hoist past the loop's stores while the leaf was read in it."""
    return [f"const float l{i} = {p}{i}[0];" for i in range(len(g.leaves)) if i not in inner]


def _map_loop(g: Group, inner: Sequence[int], contiguous: bool, values: str, _: str, p: str
              ) -> list[str]:
    """A row of a group without a reduction (the innermost loop) into `values`, its leaves
    at `p<i>`.  A row of a group that calls vector math is vectorised even where it is
    strided (gathers and scatters, not glibc's scalar functions at tens of nanoseconds an
    element), its remainder past whole vectors one vector of its own (`_tail`)."""
    def at(q: str, t: str, i: str = "i") -> str:
        return f"{q}[{i}]" if contiguous else f"{q}[({i}) * {t}]"
    reads = [at(f"{p}{i}", f"t{i}") if i in inner else None for i in range(len(g.leaves))]
    if not _calls_vector_math(g):
        return [*_row_leaves(g, inner, p), *(["#pragma omp simd"] if contiguous else []),
                "for (long i = 0; i < m; i++)",
                *_element(g, reads, [f"{at(values, 't')} = out;"])]
    short = [*(["#pragma omp simd"] if contiguous else []), "for (long i = h; i < m; i++)",
             *_element(g, reads, [f"{at(values, 't')} = out;"])]
    return [*_row_leaves(g, inner, p), "#pragma omp simd",
            f"for (long i = 0; i < m - m % {LANES}; i++)",
            *_element(g, reads, [f"{at(values, 't')} = out;"]),
            *_tail(g, inner, p, f"m - m % {LANES}", [f"{at(values, 't', 'h + l')} = tail[l];"],
                   lambda q, t: at(q, t, "h + l"), short)]


def _row(g: Group, inner: Sequence[int], contiguous: bool, values: str, result: str, p: str
         ) -> list[str]:
    """A reduction of one row (the innermost loop) into `result[0]`, its leaves at `p<i>`;
    the values it reduces written into `values` too where the group `keeps` them."""
    identity, combine = REDUCTIONS[g.reduce[0]]

    def at(q: str, index: str, t: str) -> str:
        return f"{q}[{index}]" if contiguous else f"{q}[({index}) * {t}]"

    def reads(index: str) -> list[str | None]:
        return [at(f"{p}{i}", index, f"t{i}") if i in inner else None
                for i in range(len(g.leaves))]

    def fold(index: str, into: str) -> list[str]:
        return [*([f"{at(values, index, 't')} = out;"] if g.keeps else []),
                f"{into} = {combine.format(x=into, y='out')};"]
    lines = [*_row_leaves(g, inner, p), f"float acc = {identity};"]
    if contiguous:
        lines += [f"float part[{LANES}];",
                  f"for (int l = 0; l < {LANES}; l++) part[l] = {identity};",
                  "long i = 0;",
                  f"for (; i + {LANES} <= m; i += {LANES}) {{",
                  "    #pragma omp simd",
                  f"    for (int l = 0; l < {LANES}; l++)",
                  *(f"    {s}" for s in _element(g, reads("i + l"), fold("i + l", "part[l]"))),
                  "}",
                  f"for (int l = 0; l < {LANES}; l++) "
                  f"acc = {combine.format(x='acc', y='part[l]')};"]
        if _calls_vector_math(g):
            kept = [f"{values}[h + l] = tail[l];"] if g.keeps else []
            lines += _tail(g, inner, p, "i",
                           [*kept, f"acc = {combine.format(x='acc', y='tail[l]')};"],
                           lambda q, _: f"{q}[h + l]",
                           ["for (long i = h; i < m; i++)",
                            *_element(g, reads("i"), fold("i", "acc"))])
        else:
            lines += ["for (; i < m; i++)", *_element(g, reads("i"), fold("i", "acc"))]
    else:
        lines += ["for (long i = 0; i < m; i++)", *_element(g, reads("i"), fold("i", "acc"))]
    return [*lines, f"{result}[0] = acc;"]


def _calls_vector_math(g: Group) -> bool:
    """Does `g` call a libmvec function (`VECTOR_MATH`, `bb_expf`), whose scalar variant in a
    row's remainder costs tens of nanoseconds an element?  Elsewhere a scalar remainder is
    cheaper than filling a vector's lanes (a sum over rows of 10 took 4x as long)."""
    return any(re.search(rf"\b({'|'.join(VECTOR_MATH)}|bb_expf)\(", line) for line in g.body)


def _tail(g: Group, inner: Sequence[int], p: str, start: str, done: Sequence[str],
          at: Callable[[str, str], str], short: Sequence[str]) -> list[str]:
    """The last `m - h` < `LANES` elements of a row (from h = `start`; leaf i's element l
    `at(p<i>, t<i>)`) as one vector: the leaves' elements copied into `LANES` lanes (ones
    past the row: no lane is a special case, as log(0) is, that libmvec computes through the
    scalar function), the group's statements over every lane, and `done` (of `tail[l]`, lane
    l's result) for the lanes in the row.  A scalar remainder calls glibc's scalar functions:
    MBConv's SiLU over rows of 100 positions spent more time on the 4 elements past 96 than
    on the 96.  A row shorter than a vector runs `short` (its elements from h, one at a time,
    as the compiler vectorises them): copying each row into lanes made a softmax's exp and
    sum over rows of 10 take twice as long."""
    return ["{",
            f"    const long h = {start}, rest = m - h;",
            "    if (h == 0) {",
            *(f"        {s}" for s in short),
            "    } else if (rest > 0) {",
            *(f"        float b{i}[{LANES}];" for i in inner),
            f"        float tail[{LANES}];",
            f"        for (int l = 0; l < {LANES}; l++) {{",
            *(f"            b{i}[l] = l < rest ? {at(f'{p}{i}', f't{i}')} : 1.0f;"
              for i in inner),
            "        }",
            "        #pragma omp simd",
            f"        for (int l = 0; l < {LANES}; l++)",
            *(f"        {s}" for s in _element(g, [f"b{i}[l]" if i in inner else None
                                                   for i in range(len(g.leaves))],
                                               ["tail[l] = out;"])),
            "        for (long l = 0; l < rest; l++) {",
            *(f"            {s}" for s in done),
            "        }",
            "    }",
            "}"]


def _columns(g: Group, inner: Sequence[int], across: Sequence[int], strided: bool
             ) -> list[str]:
    """Strided rows whose next dimension is contiguous, walked a column at a time: every
    element of a column at once, vectorised (a reduction folds a column of results, one row
    element at a time).  `strided`: the outputs' columns are contiguous, some leaf's are not
    (a causal mask laid out by rows, beside scores a product left column-major), read at its
    strides."""
    column = "j * c{}" if strided else "j"
    reads = [f"p{i}[{' + '.join(([] if i not in across else [column.format(i)])
                                 + ([] if i not in inner else ['r * t' + str(i)])) or '0'}]"
             for i in range(len(g.leaves))]
    init: list[str] = []
    done = ["pv[j + r * t] = out;"] if g.reduce is None or g.keeps else []
    if g.reduce is not None:
        identity, combine = REDUCTIONS[g.reduce[0]]
        init = [f"for (long j = j0; j < j1; j++) pa[j] = {identity};"]
        done.append(f"pa[j] = {combine.format(x='pa[j]', y='out')};")
    return [*init,
            "for (long r = 0; r < m; r++) {",
            "    #pragma omp simd",
            "    for (long j = j0; j < j1; j++)",
            *(f"    {s}" for s in _element(g, reads, done)),
            "}"]


def source(groups: Sequence[Group]) -> str:
    """The C file of a module's groups."""
    return "\n".join([f"#define BB_PARALLEL_ELEMENTS {PARALLEL_ELEMENTS}", _PRELUDE,
                      *(function(g) + "\n" for g in groups),
                      exported([(g.name, len(g.outputs()) + len(g.leaves)) for g in groups])])


def exported(functions: Sequence[tuple[str, int | None]]) -> str:
    """C that makes each `int name(PyObject *x0, ..., PyObject *x<n - 1>, int threads)` of
    `functions` (name, n) a Python builtin, called with its n objects and the threads through
    the vectorcall protocol and returning its int (or long: an address); `bb_functions()`
    returns them by name (a dict: `builtin_functions`).  A function of n None takes any number
    of objects: it is `int name(PyObject *const *objects, long count, int threads)`.

    Why not ctypes: its call took 1.0 µs where a builtin's takes 0.05 (warm, on the Xeon of
    the README), and a small model makes some twenty such calls a run, each after a product
    has streamed its operands through the caches that ctypes' longer path runs from."""
    lines: list[str] = []
    for name, n in functions:
        if n is None:
            check, wanted = "given < 1", "objects and"
            call = f"{name}(args, given - 1, (int)threads)"
        else:
            check, wanted = f"given != {n + 1}", f"{n} arrays and"
            call = f"{name}({', '.join([*(f'args[{i}]' for i in range(n)), '(int)threads'])})"
        lines += [f"static PyObject *bb_call_{name}(PyObject *self, PyObject *const *args, "
                  "Py_ssize_t given) {",
                  "    (void)self;",
                  f"    if ({check}) {{",
                  f'        PyErr_Format(PyExc_TypeError, "{name} takes {wanted} the '
                  'threads, %zd arguments given", given);',
                  "        return NULL;",
                  "    }",
                  "    const long threads = PyLong_AsLong(args[given - 1]);",
                  "    if (threads == -1 && PyErr_Occurred())",
                  "        return NULL;",
                  f"    return PyLong_FromLong({call});",
                  "}",
                  ""]
    return "\n".join([
        *lines,
        "static PyMethodDef bb_methods[] = {",
        *(f'    {{"{name}", (PyCFunction)(void (*)(void))bb_call_{name}, METH_FASTCALL, NULL}},'
          for name, _ in functions),
        "    {NULL, NULL, 0, NULL}};",
        "",
        "/* The builtins by name: a new dict (NULL, an exception set, where memory ran out). */",
        "PyObject *bb_functions(void) {",
        "    PyObject *found = PyDict_New();",
        "    for (PyMethodDef *m = bb_methods; found != NULL && m->ml_name != NULL; m++) {",
        "        PyObject *f = PyCFunction_New(m, NULL);",
        "        if (f == NULL || PyDict_SetItemString(found, m->ml_name, f) != 0)",
        "            Py_CLEAR(found);",
        "        Py_XDECREF(f);",
        "    }",
        "    return found;",
        "}",
        ""])


def builtin_functions(lib: ctypes.CDLL) -> dict[str, Callable[..., int]]:
    """The builtins `exported` made of `lib`'s functions (`bb_functions`), by name."""
    lib.bb_functions.restype = ctypes.py_object
    lib.bb_functions.argtypes = []
    return lib.bb_functions()


# --------------------------------------------------------------------------------------------
# Compiling and loading.


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _cache_dir() -> Path:
    base = os.environ.get("BBRULES_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "bbrules")
    return Path(base) / "native"


@lru_cache(maxsize=None)
def _machine(cc: str) -> str:
    """What a compiled library depends on besides its source: the compiler's version and the
    CPU's features (`-march=native`)."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    try:
        cpu = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:  # not Linux: the compiler's version alone
        cpu = []
    return version + next((line for line in cpu if line.startswith(("flags", "Features"))), "")


def available() -> bool:
    """Whether a C compiler is found (compiling may still fail: `compiled` then raises)."""
    return _compiler() is not None


def build(text: str, libraries: Sequence[str], flags: Sequence[str] = FLAGS) -> ctypes.CDLL:
    """The library of C source `text` (compiled with `flags` against Python's headers, linked
    with `libraries`), built once per source, flags and machine into the cache folder."""
    cc = _compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler (set $CC)")
    key = hashlib.sha256("\0".join([text, *flags, *libraries, cc, _machine(cc),
                                    _python_include()]).encode())
    folder = _cache_dir()
    path = folder / f"{key.hexdigest()[:32]}.so"
    if not path.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as work:
                c_file = Path(work) / "groups.c"
                c_file.write_text(text)
                built = Path(work) / "groups.so"
                done = subprocess.run([cc, *flags, f"-I{_python_include()}", "-o", str(built),
                                       str(c_file), *libraries],
                                      capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise NativeUnavailable(f"{cc} failed: {done.stderr.strip()[-2000:]}")
                os.replace(built, path)  # atomic: another process may build it meanwhile
        except (OSError, subprocess.SubprocessError) as e:
            raise NativeUnavailable(f"compiling native code failed: {e}") from e
    try:  # (loaded with RTLD_NOW: a vector function libmvec lacks fails here)
        return ctypes.PyDLL(str(path))  # its functions hold the GIL until they release it
    except OSError as e:
        raise NativeUnavailable(f"loading {path} failed: {e}") from e


@lru_cache(maxsize=64)
def compiled(text: str) -> Library:
    """The library of a module's C source (`source`), compiled once per source and machine;
    with glibc's vector math, else (an older C library) with its scalar functions."""
    try:
        vector = text.replace("#include <math.h>\n", "#include <math.h>\n" + _DECLARED, 1)
        return Library(build(vector, ["-lmvec", "-lm"]), vector_math=True)
    except NativeUnavailable:
        return Library(build(text, ["-lm"]), vector_math=False)


@lru_cache(maxsize=None)
def _python_include() -> str:
    return sysconfig.get_paths()["include"]


class Library:
    """A compiled module's groups, each called as `fn(out, *leaves)` (`Call`)."""

    def __init__(self, lib: ctypes.CDLL, vector_math: bool):
        self.lib = lib
        self.vector_math = vector_math  # whether its loops call libmvec's vector functions
        if hasattr(lib, "bb_set_parallel"):  # (not in a module written before it was)
            lib.bb_set_parallel.argtypes = [ctypes.c_void_p]
            lib.bb_set_parallel(_parallel_for())
        self.calls = builtin_functions(lib) if hasattr(lib, "bb_functions") else {}  # (likewise)
        self.checks_overlap = hasattr(lib, "bb_checks_overlap")  # (likewise)

    def function(self, name: str, dims: tuple[int, ...], leaves: tuple[tuple[int, ...], ...],
                 reduce: tuple[str, int] | None = None, keeps: bool = False) -> Call:
        g = Group(name, dims, leaves, (), reduce, keeps)
        fn = self.calls.get(name)
        if fn is None:  # a module written before groups were builtins: through ctypes
            fn = getattr(self.lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.py_object] * (len(g.outputs()) + len(leaves)) + [ctypes.c_int]
        return Call(fn, g, self.checks_overlap)


def _parallel_for() -> ctypes.c_void_p:
    """The native product's threads (`bb_parallel_for`), which the groups' rows share
    (`bb_rows`); NULL where that library cannot be had: every group on the calling thread."""
    from bbrules.codegen.native_matmul import library  # (which builds on this module)
    try:
        return ctypes.cast(library().bb_parallel_for, ctypes.c_void_p)
    except NativeUnavailable:
        return ctypes.c_void_p(None)


class Call:
    """A group's C function called on numpy arrays: `call(out, *leaves)` writes the result
    into `out` (an array of the group's dimensions, which may be one of the leaves: each
    element is read before it is written) or, with `out` None or overlapping another leaf,
    into a new array (`new`), and returns it.  A reduction's result is always a new array:
    it holds partial results while the leaves are read; a group that `keeps` its values
    returns (values, reduction).  The function reads the arrays' memory through the buffer
    protocol and releases the GIL while it loops, its rows on `threads` threads."""

    def __init__(self, fn: Callable[..., int], g: Group, checks_overlap: bool = True):
        self.checks_overlap = checks_overlap  # (else a module written before it did: here)
        self.dims = g.outputs()[0]
        self.reduced = g.result() if g.reduce is not None else None
        self.both = len(g.outputs()) == 2
        self.leaf_dims = g.leaves
        self.alike = [i for i, dims in enumerate(g.leaves) if dims == self.dims]  # (`new`)
        self.fn = fn

    def __call__(self, out: np.ndarray | None, *leaves: np.ndarray, threads: int = 1
                 ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        if out is None or not self.checks_overlap and \
                any(a is not out and np.may_share_memory(out, a) for a in leaves):
            out = self.new(leaves)
        outs = (out, np.empty(self.reduced, _F32)) if self.both else (out,)
        status = self.fn(*outs, *leaves, threads)
        if status == 1:  # a numpy scalar, another dtype, an odd view
            with suppress(ValueError):
                leaves = tuple(_as_leaf(a, dims) for a, dims in zip(leaves, self.leaf_dims))
                status = self.fn(*outs, *leaves, threads)
        if status == 2:  # out overlaps a leaf
            outs = (self.new(leaves), *outs[1:])
            status = self.fn(*outs, *leaves, threads)
        if status:
            raise ValueError(f"native group of dimensions {self.dims}: its arrays have "
                             f"shapes {[np.shape(a) for a in (*outs, *leaves)]}")
        return outs if self.both else outs[0]

    def new(self, leaves: Sequence[np.ndarray]) -> np.ndarray:
        """A result array laid out in memory as the first leaf of its shape is (as numpy's
        ufuncs lay out theirs: a transposed product's result stays so), else C order."""
        for i in self.alike:  # (the leaves declared of its shape: a call's Python costs)
            a = leaves[i]
            if isinstance(a, np.ndarray) and a.shape == self.dims and a.dtype == _F32:
                return np.empty_like(a)
        return np.empty(self.dims, _F32)


def _as_leaf(a: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """`a` as a C-order float32 array of dimensions `dims`."""
    return np.ascontiguousarray(np.broadcast_to(np.asarray(a, np.float32), dims))


def leaf_reader(leaves: Mapping[Node, int], constants: Mapping[Node, float]
                ) -> Callable[[Node], str]:
    """How `statements` reads an operand outside the group: a number as its literal, an
    array leaf as `l<i>`."""
    def read(n: Node) -> str:
        return literal(constants[n]) if n in constants else f"l{leaves[n]}"
    return read
