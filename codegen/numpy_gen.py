"""The numpy backend: a block program becomes a readable Python module, one function per kernel.

This module writes the code.  What is decided about a kernel before its code is written (the
rewrites numpy gains from, the blocks its loops walk, the parts it runs in) is `numpy_plan`'s;
what the generated modules call while they run (gathers, relayouts, the parts' threads) is
`numpy_runtime`'s.

Why it looks the way it does:

- *Loops come from the kernel's plan* (`bbrules.plan`), the plan the cost model prices, so the
  code runs the loops that were costed: merged sibling reductions share one Python loop
  carrying several accumulators, and every node is computed in the loop body the plan puts it in.
  One liberty: a loop that skips no blocks (a reduction, or a map loop that does not select by
  its position) walks its axis in blocks as large as the tiles allow (`coarsened`).  Its
  blocks are sized for a GPU's local memory, which a numpy call does not have; larger ones
  make each call do more (one matmul over the whole contraction, not 64-wide slices, and no
  partial sums added in passes of their own; every head in one call, not one call a head).
- *The grid is vectorised.*  Running one Python call per grid point would make the interpreter
  overhead, not data movement, the cost.  Instead every tile of a kernel is one array holding the
  tile of *all* grid points at once, in a fixed layout: a (blocks, block) pair of dimensions per
  grid axis, then one (block) dimension per other axis of the kernel, with size 1 wherever the tile
  does not depend on / span that axis; map axes that every store puts before its grid axes
  come first (`_leading`).  Broadcasting by axis name is then plain numpy broadcasting,
  and a contraction over all query blocks is one large `np.matmul`.  Inside a loop over an axis the
  tiles hold the loop's current block of it (size 1 in the blocks dimension).
- *A kernel makes several stores* and returns every tensor it stores.  A store's axes that are
  not grid axes are *map loops*: a Python loop over the axis' blocks (on its own, or merged with
  sibling reductions over the same axis, as the plan's `Loop` says) whose body assigns the
  current block of the store into its output array, allocated before the kernel's first step.
  What does not depend on a map loop's axis is computed once, before the loop, and shared by
  every store; map loops nest.  A store outside every loop is the whole vectorised tile,
  returned as it is when it is a fresh array, else copied into a new one.
- *Peak memory follows the program's tiles*: loads are views of the global arrays, temporaries
  are deleted after their last use, and nothing allocates more than the tiles the schedule holds
  (coarsened up to `COARSE_TILE` elements) and the tensors the kernels store (a fused attention
  never allocates N x N; an unfused one materialises what its stores store).
- *Steps that numpy does better another way*: a contraction with a one-hot operand (an
  embedding lookup, a convolution's shift, as ONNX models import them) is a gather
  (`gather_one_hot`); a contraction summed over a second axis both operands span is one
  matmul over both; an online softmax rescales its output in the dying contribution's buffer;
  a skipping loop's blocks where the predicate holds everywhere run without the mask; a short
  loop over chunks of one element that selects by its position (a slice's, a concatenation's,
  RoPE's halves) is written once per chunk, its selections folded away (a grid axis of such
  chunks is walked by that loop, not vectorised: `ungridded`); a product whose columns are
  the block of a loop that folds across them (attention's scores) is computed column-major
  and viewed transposed, so the fold's row maxima and sums read contiguous memory;
  a contraction runs in the order its larger operand holds the contracted axes in memory (a
  loaded one's, or a gather's: a convolution's window), the smaller copied; a computed
  operand that must be copied into a matmul's order is copied keeping its outer
  dimensions outer and handed to BLAS transposed where that order is the transposed one; a
  selection of a tile and a number by a box of known positions (a padded axis' mask) sets
  slices (`fill`), and a window plus a selection on a few such boxes (a KV cache grown by a
  token) adds it on them in the window's own padded copy (`box_add`); a tile of known
  positions alone (a causal mask) is a module global, computed once when the module loads
  (`known_tile`); a read-only input (a model's weights) is copied into another layout (a
  matmul's order, padding) once, not on every call (`relaid`); a store that only regroups
  dimensions (`bbrules.regroup`: an image's rows in pieces of 5 x 2 read as 2 x 5) is a
  reshape, of a loaded tensor (`_regrouping`) or of values a kernel of their own stores
  first (`_values_regrouped`).
  Statements whose results no one reads (the one-hot a gather replaced) are dropped.
- *Monoids are data.*  Identity, combine and finalize are emitted from the monoid's expressions,
  never special-cased by name, so online softmax and Welford need no code of their own.  A
  fold's first combine is its contribution, by the identity law (`fold_once`, `take_once`).
- Static shapes are known while generating, so reshapes and transposes around `np.matmul` are
  written out as constants: the generated code is plain numpy a reader can follow.
- *Every core.*  A vectorised tile runs numpy's elementwise work (exp, max, where, ...) on one
  core; only matmul uses BLAS threads.  Where some kernel has elementwise work enough to gain
  from sharing it (`numpy_plan.parts_pay`; a program of products alone runs whole, BLAS threading
  them), a kernel with enough work (`MIN_CALL_FLOPS` per numpy call of a part, by the cost
  model's count, a one-hot contraction counted as the gather it is here) is split along its
  grid axis of the most blocks into *parts*, `PARTS_PER_THREAD` per thread: a part is a
  function for a contiguous run of that axis' blocks, the same code at a smaller grid,
  reading its inputs and writing its stores at the run's offset (`q_start`), into arrays
  allocated before the parts start.  `run_parts` runs them `threads` at a time (numpy
  releases the GIL in ufuncs and matmul), with numpy's OpenBLAS limited to one thread
  meanwhile (parts each calling a BLAS that runs a thread per core oversubscribe the cores
  and run slower than the whole kernel) and, where they take every core, each of its threads
  bound to a core of its own (threads the scheduler wakes after a pause may share one core
  for a whole kernel: `_cores_to_bind`).  Two parts per thread hold half the grid's tiles at
  once, so peak memory stays under the whole kernel's even with the stores allocated first.
  A part computes what the whole kernel computes for its grid blocks, but BLAS may block a
  smaller matmul differently, so results agree to float rounding, not bit for bit.  The
  number of threads is `threads=` (`load`, `run`), else `$BBRULES_THREADS`, else the cores
  this process may run on where numpy's BLAS thread count can be set (`default_threads`);
  `generate` defaults to one thread, so the text it writes does not depend on the machine.
- *Native groups* (`native=True`, `codegen.native`): numpy makes a pass over memory per
  operator, so a chain of elementwise operators over one tile's dimensions, each read only
  by others of the chain, is one C loop instead, and so is a chain that a reduction within
  the tile reads along the tile's innermost dimension (magika's bias, GELU, padding mask and
  max over positions: one call; a softmax's exponentials, which its product with V reads
  too: one call returning them and their sum).  The module carries the C and compiles it when
  it loads (once per machine).  `load` and `run` use them where a C compiler is found
  (`default_native`; `$BBRULES_NATIVE=0` turns them off) and write numpy code alone where
  compiling fails; `generate` writes numpy code alone unless asked (`bbrules codegen
  --native`).  Results agree with the numpy code's to float rounding (glibc's functions,
  not numpy's), not bit for bit.
- *Native products* (with native groups, `codegen.native_matmul`): every matmul is
  `matmul(x, y, T)`, a C product on its own threads in place of numpy's BLAS, which threads
  small products poorly (LLaMA's layer at 128 tokens: 1.75 -> 1.16 ms on 2 cores), numpy's
  below a size where its call costs less.  T is the module's threads in a kernel run whole,
  1 in a part.  A gather by positions that step evenly (a convolution's window) is then a
  view of its values, which the product reads in place (`gather_one_hot`'s `window`).  A
  body's products that can run at once (K and V of one input, an MLP's gate and up) are one
  call, `matmuls`, one job for the threads (`_together`), and so are kernels that are each
  one product, where the later reads nothing stored since the earlier (`_jointly`: a decode
  step's Q, K and V projections).
"""

from __future__ import annotations

import ast
import builtins
import keyword
import linecache
import os
import re
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from math import prod
from typing import AbstractSet, Callable, Iterable, Mapping, Sequence, Union

import numpy as np

from bbrules.ir import (ELEMENTWISE_KINDS, SCALAR, WHOLE_DTYPES, Axis, Binary, BlockProgram,
                        BlockReduce, Const, Dim, Dot, Get, IRError, Kernel, KindTable, Load, Node,
                        Pos, Reduce, Store, TensorDecl, TileType, Tuple, Unary, Var, Where,
                        children, is_elementwise, operator, postorder, show_kernel, tile_type,
                        type_of, validate)
from bbrules.ops import ELEMENTWISE, TILE_REDUCE, OpInfo
from bbrules.masking import skip_predicate
from bbrules.onehot import Pick, one_hot
from bbrules.plan import loop_predicate, plan_for
from bbrules.regroup import Regroup, regroup
from bbrules.schedule import Compute, Loop, Step, Write, walk_steps
from bbrules.targets import Target, get_target
from bbrules.codegen import native as native_c
from bbrules.codegen import numpy_plan, numpy_runtime

_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
# Names generated code uses besides its own locals: the module's globals, the operator aliases
# (`_Functions.ref`) and Python's builtins (loops call `range`).  A tensor named like one of
# them is renamed.
_RESERVED = {"np", "f32", "run", "outputs", "_execute", "every", "inputs", "_input",
             "run_parts", "gather_one_hot", "lookup", "relaid",
             "check_whole", "compiled", "NATIVE", "compiled_matmul", "matmul", "matmuls",
             "ELEMENTWISE",
             "TILE_REDUCE",
             *(f"elementwise_{op}" for op in ELEMENTWISE),
             *(f"tile_reduce_{op}" for op in TILE_REDUCE),
             *dir(builtins)}

# A value in generated code: an expression (a name or a literal), or one per tuple component.
Code = Union[str, tuple[str, ...]]


def _identifier(name: str, taken: AbstractSet[str]) -> str:
    """`name` made into a Python identifier that collides with nothing in `taken`."""
    base = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "x"
    if base[0].isdigit():
        base = "_" + base
    out = base
    while keyword.iskeyword(out) or out in _RESERVED or out in taken:
        out += "_"
    return out


def _product_dims(xs: Sequence[int], ys: Sequence[int], cs: Sequence[int]
                  ) -> tuple[list[int], list[int], list[int]]:
    """The layout dimensions of a product of tiles of dimensions `xs` and `ys` contracted
    over dimensions `cs`: its batch (both operands span them), rows (x alone), columns (y
    alone)."""
    batch = [i for i in range(len(xs)) if i not in cs and xs[i] > 1 and ys[i] > 1]
    rows = [i for i in range(len(xs)) if i not in cs and xs[i] > 1 and ys[i] == 1]
    cols = [i for i in range(len(ys)) if i not in cs and ys[i] > 1 and xs[i] == 1]
    return batch, rows, cols


def _counted_from_both_ends(picks: Sequence[Pick], size: int) -> bool:
    """Are the picks one position and the same position plus `size`, no guards: a lookup
    by ids in which a negative id counts from the end (ONNX's Gather), numpy's indexing?"""
    if len(picks) != 2 or any(p.guards for p in picks) or picks[0].at != picks[1].at:
        return False
    return sorted(p.offset for p in picks) == [-float(size), 0.0]


def _literal(v: float) -> str:
    if np.isnan(v):
        return 'f32("nan")'
    if np.isinf(v):
        return 'f32("inf")' if v > 0 else 'f32("-inf")'
    return f"f32({float(v)!r})"


@dataclass
class _Functions:
    """How generated code names the operator table's numpy functions.

    A function numpy exports under its own name is written `np.<name>`; anything else (the
    table's own definitions of rsqrt, silu, gelu, ...) is bound once at module level from the
    table, so the generated code computes exactly what the interpreter computes.
    """

    aliases: dict[str, str] = field(default_factory=dict)
    runtime: set[str] = field(default_factory=set)  # helpers of this module the code calls
    taken: set[str] = field(default_factory=set)  # the module's global names
    known: dict[str, str] = field(default_factory=dict)  # code -> name, computed on loading
    native: bool = False  # whether elementwise groups and products are native C
    groups: dict[tuple, native_c.Group] = field(default_factory=dict)  # by what they compute
    threads: int = 1  # the threads native products and groups run on in a kernel run whole
    products: bool = False  # whether the code calls the native product (`matmul`)

    def native_group(self, dims: tuple[int, ...], leaves: tuple[tuple[int, ...], ...],
                     body: tuple[str, ...], reduce: tuple[str, int] | None, keeps: bool
                     ) -> str:
        """The name of the module's native function computing `body` (and reducing it,
        keeping the values or not), one per distinct group."""
        key = (dims, leaves, body, reduce, keeps)
        if key not in self.groups:
            name = _identifier(f"native_{len(self.groups) + 1}", self.taken)
            self.taken.add(name)
            self.groups[key] = native_c.Group(name, dims, leaves, body, reduce, keeps)
        return self.groups[key].name

    def computed_on_loading(self, code: str) -> str:
        """The name of a module global holding `code`'s value (`_KernelWriter.known_tile`),
        one per distinct code."""
        if code not in self.known:
            self.known[code] = _identifier(f"known_{len(self.known) + 1}", self.taken)
            self.taken.add(self.known[code])
        return self.known[code]

    def ref(self, info: OpInfo, table: str = "ELEMENTWISE") -> str:
        """The name generated code calls `info`'s numpy function by (`table` in bbrules.ops)."""
        fn = info.numpy
        if getattr(np, getattr(fn, "__name__", ""), None) is fn:
            return f"np.{fn.__name__}"
        name = f"{table.lower()}_{info.name}"
        self.aliases[name] = f'{table}["{info.name}"].numpy'
        return name

    def call(self, node: Node, args: Sequence[tuple[str, bool]]) -> str:
        """Code for one elementwise operator over operand codes, each (text, is infix)."""
        if not is_elementwise(node):
            raise IRError(f"not an elementwise operator: {node!r}")
        if isinstance(node, Binary) and node.op in _INFIX:
            x, y = (f"({text})" if infix else text for text, infix in args)
            return f"{x} {_INFIX[node.op]} {y}"
        return f"{self.ref(operator(node))}({', '.join(text for text, _ in args)})"

    @staticmethod
    def ufunc(node: Node) -> str | None:
        """`np.<name>` when the operator is a numpy ufunc (which can write into an operand)."""
        fn = operator(node).numpy
        return f"np.{fn.__name__}" if isinstance(fn, np.ufunc) else None


# Deepest nesting of calls in one generated expression: Python's parser refuses more than 200
# nested parentheses, so a deeper subexpression is given a name of its own.
MAX_NESTING = 50

# A native group (`_KernelWriter.native_groups`) computes a tile of at least this many elements:
# a multiply-add over 4,096 broadcast floats took 3.1 µs as one call and as numpy's two, over
# 1,024 2.8 against 1.7 µs, over 16,384 4.4 against 9.6 µs (the Xeon of the README).
NATIVE_ELEMENTS = 1 << 12

# ... or is a chain of at least this many operators, whatever its size: each numpy call costs a
# microsecond or more, several once a product has streamed its weights through the caches,
# where the group's one call costs about three.  A decode step's RoPE on 12 x 64 values, a chain
# of four per half, took 39.6 µs in a run of the step as numpy calls and 16.7 as two native
# calls; the whole step (LLaMA, width 768, a cache of 127 or 1023 tokens) ran 1-5% faster
# (`benchmarks/paired.py`), the 128-token blocks and magika as fast as before.
NATIVE_CHAIN = 4

# One operator alone is a native group from this many elements, on every core where numpy's
# call runs on one: GPT-2's causal mask over 12 x 128 x 128 scores by `np.where` took 353 µs in
# a run of its block (768 wide, 128 tokens), its Q, K and V bias sums 100 µs each; the block
# ran about 4% faster with them native (`benchmarks/paired.py`).
NATIVE_ALONE_ELEMENTS = 1 << 15

# A native group has at most this many operators (a deeper expression is left to numpy): the C
# compiler's time grows with a function's size, and a program's expressions are not its to
# bound.
NATIVE_OPERATORS = 256


def _expressions(roots: Sequence[Node], env: Mapping[str, str], fns: _Functions,
                 fresh: Callable[[str], str]) -> tuple[list[str], list[str]]:
    """Code for elementwise expressions over `Var`s (a monoid's identity/combine/finalize).

    Returns assignment lines for subexpressions the roots share (computed once) and one code
    string per root.
    """
    uses: Counter[Node] = Counter()  # references to each node from its parents and the roots
    stack = list(reversed(roots))
    while stack:
        e = stack.pop()
        uses[e] += 1
        if uses[e] == 1:
            stack += reversed(children(e))
    lines: list[str] = []
    named: dict[Node, str] = {}
    inline: dict[Node, tuple[str, bool]] = {}  # code of unshared nodes, and if it is infix
    nesting: Counter[Node] = Counter()  # how deeply an inline node's code nests calls

    def code(e: Node) -> tuple[str, bool]:
        return (named[e], False) if e in named else inline[e]

    for e in (n for r in roots for n in postorder(r)):  # operands first: no recursion
        if e in named or e in inline:
            continue
        match e:
            case Var(name):
                inline[e] = env[name], False
            case Const(v):
                inline[e] = _literal(v), False
            case _ if is_elementwise(e):
                text = fns.call(e, [code(c) for c in children(e)])
                nesting[e] = 1 + max((nesting[c] for c in children(e)), default=0)
                if uses[e] > 1 or nesting[e] >= MAX_NESTING:
                    nesting[e] = 0
                    named[e] = fresh("c")
                    lines.append(f"{named[e]} = {text}")
                else:
                    inline[e] = text, isinstance(e, Binary) and e.op in _INFIX
            case _:
                raise IRError(f"monoid expressions must be elementwise, found {e!r}")
    return lines, [code(r)[0] for r in roots]


@dataclass(frozen=True)
class _Part:
    """A part of a kernel split along grid axis `axis`: `blocks` consecutive blocks of it, from
    the element offset the generated function takes as its parameter `start`, one of
    `offsets` (the parts of this length)."""

    axis: Axis
    blocks: int
    start: str
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class _Layout:
    """The array layout shared by every tile of one kernel (see the module docstring): the
    `leading` axes, a (blocks, block) pair per grid axis, then the `others`."""

    grid: tuple[Axis, ...]
    others: tuple[Axis, ...]
    dims: Mapping[Axis, Dim]
    part: _Part | None = None
    leading: tuple[Axis, ...] = ()

    def grid_blocks(self, axis: Axis) -> int:
        """How many blocks of grid axis `axis` a tile holds: the part's along the split axis."""
        if self.part is not None and axis == self.part.axis:
            return self.part.blocks
        return self.dims[axis].blocks

    def element_dim(self, axis: Axis) -> int:
        if axis in self.leading:
            return self.leading.index(axis)
        if axis in self.grid:
            return self.block_dim(axis) + 1
        return len(self.leading) + 2 * len(self.grid) + self.others.index(axis)

    def block_dim(self, axis: Axis) -> int:
        return len(self.leading) + 2 * self.grid.index(axis)

    def shape(self, t: TileType, looped: AbstractSet[Axis]) -> tuple[int, ...]:
        """Static array shape of a tile of type `t` inside loops over `looped`."""
        out = [self.dims[a].block if a in t.shape else 1 for a in self.leading]
        for a in self.grid:
            out.append(self.grid_blocks(a) if a in t.deps and a not in looped else 1)
            out.append(self.dims[a].block if a in t.shape else 1)
        out.extend(self.dims[a].block if a in t.shape else 1 for a in self.others)
        return tuple(out)


def _leading(k: Kernel) -> tuple[Axis, ...]:
    """The map axes that lead the layout of `k`'s tiles: those that come before every grid
    axis in each store that has them (heads stored as [h, t, d] by a kernel over t), so that
    a map loop walked as one block (`coarsened`) stores its tile as it is, not transposed."""
    def leads(a: Axis) -> bool:
        return all(s.axes.index(a) < min((s.axes.index(g) for g in k.grid if g in s.axes),
                                         default=len(s.axes))
                   for s in k.stores if a in s.axes)
    return tuple(dict.fromkeys(a for s in k.stores for a in k.map_axes(s) if leads(a)))


def _reshape(code: str, have: Sequence[int], want: Sequence[int]) -> str:
    if tuple(have) == tuple(want):
        return code
    return f"{code}.reshape{_shape_text(want)}" if want else f"{code}.reshape(())"


def _transpose(code: str, perm: Sequence[int]) -> str:
    if list(perm) == sorted(perm):
        return code
    return f"{code}.T" if len(perm) == 2 else f"{code}.transpose{_shape_text(perm)}"


def _to_layout(code: str, parts: Sequence[Sequence[tuple[int, int]]],
               target: Sequence[int]) -> str:
    """An array into the kernel layout.

    Dimension i of the array covers the layout dimensions `parts[i]`, a row-major list of
    (layout position, size).  When those groups do not interleave in the layout, the array is
    transposed as it is and reshaped once; otherwise it is split into single dimensions first.
    Every step is a view for arrays numpy can view that way.
    """
    parts = [[(p, s) for p, s in g if s > 1] for g in parts]
    have = [prod(s for _, s in g) for g in parts]
    dims = [i for i, g in enumerate(parts) if g]
    flat = [p for i in dims for p, _ in parts[i]]
    order = sorted(dims, key=lambda i: parts[i][0][0])
    if [p for i in order for p, _ in parts[i]] == sorted(flat):
        out = _reshape(code, have, [have[i] for i in dims]) if order != dims else code
        out = _transpose(out, [dims.index(i) for i in order])
        cur = have if order == dims else [have[i] for i in order]
    else:
        singles = [s for i in dims for _, s in parts[i]]
        perm = sorted(range(len(flat)), key=flat.__getitem__)
        out = _transpose(_reshape(code, have, singles), perm)
        cur = [singles[j] for j in perm]
    return _reshape(out, cur, target)


def _from_layout(code: str, have: Sequence[int], groups: Sequence[Sequence[int]]) -> str:
    """An array in the kernel layout regrouped: dimension i merges layout dimensions groups[i].

    Layout dimensions in no group must have size 1.  Groups that are consecutive in the layout
    are merged by one reshape before transposing, which numpy does without copying.
    """
    groups = [[p for p in g if have[p] > 1] for g in groups]
    target = [prod(have[p] for p in g) for g in groups]
    kept = sorted(p for g in groups for p in g)
    full = [g for g in groups if g]
    order = sorted(full, key=lambda g: g[0])
    if order == full and [p for g in full for p in g] == kept:
        return _reshape(code, have, target)
    if _consecutive(have, full):
        merged = [prod(have[p] for p in g) for g in order]
        out = _transpose(_reshape(code, have, merged), [order.index(g) for g in full])
        cur = [prod(have[p] for p in g) for g in full]
    else:
        wanted = [p for g in full for p in g]
        out = _transpose(_reshape(code, have, [have[p] for p in kept]),
                         [kept.index(p) for p in wanted])
        cur = [have[p] for p in wanted]
    return _reshape(out, cur, target)


def _operand(code: str, have: Sequence[int], batch: Sequence[int], rows: Sequence[int],
             cols: Sequence[int], computed: bool) -> str:
    """A matmul operand from its tile in the kernel layout: dimensions `batch`, then `rows`,
    then `cols`, as layout positions.

    Where a computed tile's layout puts every column dimension before every row dimension and
    the regrouping copies (groups that interleave, as a gathered window's taps and channels
    do), it copies into columns by rows and passes the transposed view, which BLAS reads as it
    is: that copy keeps the outer dimensions outer, where a copy into rows by columns reads
    across the whole tile for every row (a convolution's 1280 x 512 window operand took 3.9
    ms that way).  A loaded tile is a view of its global array, whose own order the
    contraction already follows (`dot`)."""
    batched = [[i] for i in batch]
    rows_, cols_ = [p for p in rows if have[p] > 1], [p for p in cols if have[p] > 1]
    if computed and rows_ and cols_ and max(cols_) < min(rows_) and \
            not _consecutive(have, batched + [list(rows), list(cols)]):
        return f"{_from_layout(code, have, batched + [list(cols), list(rows)])}.swapaxes(-1, -2)"
    return _from_layout(code, have, batched + [list(rows), list(cols)])


# The most elements a tile computed once, when its module loads, may have (`known_tile`):
# 1 MiB of f32, held as long as the module.
KNOWN_ELEMENTS = 1 << 18
# A fill of more slices than this is left to `np.where`.
MOST_FILLS = 4


def _boxes(fill: np.ndarray) -> list[tuple[slice, ...]] | None:
    """Boxes of slices whose union is where `fill` is true: one box, or the complement of
    one (a slice before and after it along each dimension); None for any other shape, or
    more than `MOST_FILLS` boxes."""
    if not fill.any():
        return []
    for inside in (True, False):
        held = fill if inside else ~fill
        spans = [np.flatnonzero(held.any(axis=tuple(j for j in range(held.ndim) if j != i)))
                 for i in range(held.ndim)]
        if not held.any() or any(s[-1] - s[0] + 1 != len(s) for s in spans):
            continue
        box = tuple(slice(s[0], s[-1] + 1) for s in spans)
        if not held[box].all() or held.sum() != held[box].size:
            continue
        if inside:
            boxes = [box]
        else:  # each keeps the earlier dimensions inside the held box: they are disjoint
            boxes = [box[:i] + (part,) + tuple(slice(0, m) for m in fill.shape[i + 1:])
                     for i, (s, n) in enumerate(zip(box, fill.shape))
                     for part in (slice(0, s.start), slice(s.stop, n)) if part.stop > part.start]
        return boxes if len(boxes) <= MOST_FILLS else None
    return None


def _is_array(n: Node) -> bool:
    """Is `n`'s tile an array (else it may be a number, which has no elements to index)?"""
    t = tile_type(n)
    return bool(t.deps or t.shape)


def _index_text(box: tuple[slice, ...], shape: Sequence[int]) -> str:
    """`box` as an index: `:` for a whole dimension, trailing ones left out."""
    texts = [":" if (s.start, s.stop) == (0, n) else f"{s.start or ''}:{s.stop}"
             for s, n in zip(box, shape)]
    while len(texts) > 1 and texts[-1] == ":":
        texts.pop()
    return ", ".join(texts)


def _consecutive(have: Sequence[int], groups: Sequence[Sequence[int]]) -> bool:
    """Does each group cover layout dimensions in order, next to each other (those of size 1
    aside), so that `_from_layout` regroups them by a view?"""
    full = [g for g in ([p for p in g if have[p] > 1] for g in groups) if g]
    return [p for g in sorted(full, key=lambda g: g[0]) for p in g] == \
        sorted(p for g in full for p in g)


def _shape_text(s: Sequence[int]) -> str:
    return f"({s[0]},)" if len(s) == 1 else f"({', '.join(map(str, s))})"


@dataclass
class _Stmt:
    """Generated lines for one schedule step, with the names it defines and reads.

    Liveness over these lets the generator delete each temporary after its last use and let an
    elementwise step overwrite an operand that dies there (`in_place`: operand name -> lines),
    which is what a person writing the loop by hand does.  `owned` names the defined arrays
    that are fresh (not views of global memory, not numpy scalars), so they may be overwritten;
    `escapes` names arrays an accumulator may alias, which must never be overwritten.
    """

    lines: list[str]
    defs: tuple[str, ...] = ()
    uses: frozenset[str] = frozenset()
    owned: frozenset[str] = frozenset()
    in_place: dict[str, list[str]] = field(default_factory=dict)
    escapes: frozenset[str] = frozenset()
    product: _Product | None = None  # the native product its one line calls (`_together`)
    assigns: bool = False  # a store naming a whole tile as its tensor: nothing else reads it


@dataclass(frozen=True)
class _Product:
    """A native product call in a statement's line: `call` is `matmul(x, y, threads)`, with
    an addend and a scale where it has them (`_KernelWriter.added_to_product`, `factors`)."""

    call: str
    x: str
    y: str
    threads: int
    add: str | None = None
    scale: float = 1.0

    def operands(self) -> str:
        """Its operands as `matmuls` takes them: (x, y), with the addend and the scale."""
        extra = [] if self.add is None and self.scale == 1.0 else [self.add or "None"]
        extra += [] if self.scale == 1.0 else [_literal(self.scale)]
        return f"({', '.join([self.x, self.y, *extra])})"


# One schedule step as generated code, per node kind: the statement, or None for a value that
# is only a reference (a constant, a tuple, a tuple's component).
STEP = KindTable("numpy step", exempt={
    Reduce: "a reduction is a loop of the plan (_KernelWriter.loop), not a step",
    Var: "monoid variables occur only in monoid expressions (_expressions)"})


@STEP.on(Const)
def _(n: Const, w: _KernelWriter) -> None:
    w.scopes[-1][n] = _literal(n.value)


@STEP.on(Tuple)
def _(n: Tuple, w: _KernelWriter) -> None:
    w.scopes[-1][n] = tuple(w.lookup(i) for i in n.items)


@STEP.on(Get)
def _(n: Get, w: _KernelWriter) -> None:
    value = w.lookup(n.x)
    assert isinstance(value, tuple), "validated programs get from tuples only"
    w.scopes[-1][n] = value[n.index]


@STEP.on(Load)
def _(n: Load, w: _KernelWriter) -> _Stmt:
    return w.array(n, w.fresh(n.tensor), w.load(n))


@STEP.on(Pos)
def _(n: Pos, w: _KernelWriter) -> _Stmt | None:
    if n in w.known:
        return w.alias(n, None, _literal(w.known[n]))
    return w.array(n, w.fresh(f"pos_{n.axis}"), w.position(n))


@STEP.on(BlockReduce)
def _(n: BlockReduce, w: _KernelWriter) -> _Stmt | None:
    c = w.layout.element_dim(n.axis)
    if w.dims(n.x)[c] == 1:  # a block of one: the element itself
        w.scopes[-1][n] = w.lookup(n.x)
        return None
    if n in w.groups:
        return w.native(n, w.groups[n], w.fresh(f"b{n.op}"))
    if (summed := _summed_contraction(n, w)) is not None:
        # a contraction summed over axes both operands span: one matmul over all of them (the
        # steps in between are then read by no one, and dropped), then divided where the sum
        # was of quotients
        dot, also, divisor = summed
        stmt = w.contraction(n, dot, also)
        if divisor is None:
            return stmt
        name = stmt.defs[0]
        w.products_written.pop(name, None)  # (no addend joins a product divided after it)
        quotient = f"{name} = {name} / {w.tile(divisor)}"
        return replace(stmt, lines=[*stmt.lines, quotient], uses=stmt.uses | w.reads,
                       product=None)
    if (chain := _sums_within(n, w)) is not None:
        # sums over several dimensions of a tile (a norm's over an image's positions and a
        # group's channels): one numpy call over all of them (the steps in between are then
        # read by no one, and dropped)
        x, dims = chain
        fn = w.fns.ref(TILE_REDUCE["sum"], "TILE_REDUCE")
        return w.array(n, w.fresh("bsum"), f"{fn}({w.tile(x)}, axis={dims}, keepdims=True)")
    return w.array(n, w.fresh(f"b{n.op}"), w.block_reduce(n))


def _sums_within(n: BlockReduce, w: _KernelWriter) -> tuple[Node, tuple[int, ...]] | None:
    """`n`, a sum within blocks of a chain of others (through sums over one block of an
    axis, each its block's own sum), as (the tile summed, the layout dimensions summed),
    where the chain has a sum besides n's: one numpy call in place of one per dimension
    (Stable Diffusion's group norm summed 8 groups of 96 channels over 10 x 10 positions in
    three, 200 µs).  The chain stops at a sum that a native group computes, that is stored
    or that another node reads."""
    if n.op != "sum":
        return None
    dims, x = [], n
    while True:
        if isinstance(x, BlockReduce) and x.op == "sum":
            dims.append(w.layout.element_dim(x.axis))
        elif not (isinstance(x, Reduce) and x.monoid.name == "sum" and w.p.blocks(x.axis) == 1):
            break
        below = x.x
        if below in w.groups or below in w.stored or len(w.users.get(below, ())) > 1:
            x = below
            break
        x = below
    return (x, tuple(sorted(dims))) if len(dims) > 1 else None


def _summed_contraction(n: BlockReduce, w: _KernelWriter
                        ) -> tuple[Dot, tuple[Axis, ...], Node | None] | None:
    """`n` as a contraction, the axes it is summed over besides its own and a tile it is
    divided by (or None), where `n` sums a contraction within blocks, through sums over one
    block of an axis (each its block's own sum): `bsum(h, reduce(e, sum, bsum(e, dot(d, x,
    y))))` with e in one block is the contraction of x and y over (h, e, d), provided both x
    and y span h and e.  Through a quotient by a tile that spans none of the summed axes too:
    `bsum(h, reduce(e, sum, dot(e, x, y)) / b)` is the contraction over (h, e), divided by b
    (a softmax's weights times values over keys laid as two image dimensions, normalised
    inside the sum over the first: Stable Diffusion's attention ran 120 products of 10 keys
    and a sum, 390 µs)."""
    axes, x = numpy_plan.summed_chain(n, w.p)
    divisor = None
    if isinstance(x, Binary) and x.op == "div":
        more, below = numpy_plan.summed_chain(x.x, w.p)
        if all(w.dims(x.y)[w.layout.element_dim(a)] == 1 for a in (*axes, *more)):
            axes, divisor, x = axes + more, x.y, below
    if not isinstance(x, Dot) or one_hot(x) is not None:
        return None
    xs, ys = w.dims(x.x), w.dims(x.y)
    spans = {a: (xs[c], ys[c]) for a in axes for c in [w.layout.element_dim(a)]}
    if any(nx != ny for nx, ny in spans.values()):
        return None
    return x, tuple(a for a in axes if a != x.axis and spans[a][0] > 1), divisor


def _adds_to_product(n: Node, p: BlockProgram) -> bool:
    """Is `n` a sum or difference of a contraction (through sums over its blocks) and another
    tile: one the product may take as its addend (`_KernelWriter.added_to_product`), which
    costs no pass at all, where a native group would cost one."""
    return isinstance(n, Binary) and n.op in ("add", "sub") and \
        any(numpy_plan.contraction_below(x, p) for x in (n.x, n.y))


@STEP.on(*ELEMENTWISE_KINDS)
def _(n: Node, w: _KernelWriter) -> _Stmt | None:
    if (alias := w.aliased(n)) is not None:
        return alias()
    if n in w.groups:
        return w.native(n, w.groups[n], w.fresh(operator(n).name))
    if w.added_to_product(n):
        return None
    if n in w.box_adds:
        return w.add_on_boxes(n, *w.box_adds[n])
    if isinstance(n, Where) and (fill := w.fill_boxes(n)) is not None:
        keep, number, boxes = fill
        if not boxes:  # the condition keeps the tile everywhere
            return w.alias(n, keep, w.lookup(keep))
        return w.fill(n, w.fresh("where"), keep, number, boxes)
    return w.elementwise(n, w.fresh(operator(n).name))


def _neutral_operand(n: Node, known: Mapping[Node, float], picks: bool = False
                     ) -> Node | None:
    """The operand `n` equals where its other operand is a neutral element (`x + 0`, `1 * x`:
    a selection folded in an unrolled loop leaves them; `x + 0 * pos(h)`, the repeat along h
    that an import writes for an ONNX Expand or grouped-query attention's shared heads), else
    None.  With `picks`, the other operand may also be a selection by a known condition of such
    an element where this one is a tensor's tile as it is (`_read_through`): an interleaved
    RoPE's pair, `where(p == 0, even, 0) + where(p == 1, odd, 0)`, is on each block the half
    it picks.  A contraction then reads that half where it lies (`_KernelWriter.same_as`);
    elementwise readers keep the sum, which a native group reads through in C."""
    if not isinstance(n, Binary):
        return None

    def value(c: Node) -> float | None:
        if isinstance(c, Const):
            return c.value
        return 0.0 if _zero_positions(c) else known.get(c)
    if (n.op, value(n.y)) in _RIGHT_NEUTRAL:
        return n.x
    if (n.op, value(n.x)) in _LEFT_NEUTRAL:
        return n.y
    if not picks:
        return None
    x, y = _read_through(n.x, known), _read_through(n.y, known)
    if isinstance(x, Load) and (n.op, value(y)) in _RIGHT_NEUTRAL:
        return n.x
    if isinstance(y, Load) and (n.op, value(x)) in _LEFT_NEUTRAL:
        return n.y
    return None


def _read_through(n: Node, known: Mapping[Node, float]) -> Node:
    """What `n` is on these blocks through selections by known conditions and operations with
    neutral operands (`_neutral_operand` with `picks`)."""
    while True:
        if isinstance(n, Where) and n.c in known:
            n = n.x if known[n.c] else n.y
        elif (same := _neutral_operand(n, known, picks=True)) is not None:
            n = same
        else:
            return n


def _zero_positions(n: Node) -> bool:
    """Is `n` zero times a position (`0 * pos(h)`): zero everywhere, positions being finite,
    so that added to a value it only gives the value the position's axis?"""
    return isinstance(n, Binary) and n.op == "mul" and any(
        isinstance(a, Const) and a.value == 0.0 and isinstance(b, Pos)
        for a, b in ((n.x, n.y), (n.y, n.x)))


@STEP.on(Dot)
def _(n: Dot, w: _KernelWriter) -> _Stmt:
    return w.contraction(n, n)


class _KernelWriter:
    """Writes the function for one kernel, or for one part of its grid, by walking its schedule.

    A part (`split`: the axis, how many of its blocks, and the element offsets of the parts
    this function runs) takes the arrays of the kernel's stores as parameters after its inputs,
    then the element offset of its first block, and writes its blocks of every store into them.
    """

    def __init__(self, p: BlockProgram, kernel: Kernel, fn_name: str, params: Mapping[str, str],
                 outputs: Mapping[str, str], fns: _Functions, capacity: int,
                 split: tuple[Axis, int, tuple[int, ...]] | None = None):
        self.p = p
        self.kernel = kernel
        self.fn_name = fn_name
        self.params = params
        self.outputs = outputs  # stored tensor -> the name of its array
        self.fns = fns
        self.schedule = plan_for(p, kernel, capacity).schedule
        used = {a for k in kernel.stores for n in postorder(k.value) for a in _axes_of(n)}
        used.update(a for k in kernel.stores for a in k.axes)
        self.taken = {*params.values(), *outputs.values()}
        self.part = None
        if split is not None:
            axis, blocks, offsets = split
            self.part = _Part(axis, blocks, _identifier(f"{axis}_start", self.taken), offsets)
            self.taken.add(self.part.start)
        leading = _leading(kernel)
        self.layout = _Layout(kernel.grid, tuple(a for a in p.dims if a in used and a not in
                                                 (*kernel.grid, *leading)),
                              p.dims, self.part, leading)
        self.counter = 0
        # the function's one statement where it is a native product of its parameters, which
        # may run as one call with other kernels' (`_jointly`)
        self.lone: _Stmt | None = None
        self.scopes: list[dict[Node, Code]] = [{}]
        self.loop_vars: dict[Axis, str] = {}
        self.reads: set[str] = set()
        self.owned: set[str] = set()
        self.returned: set[str] = set()  # arrays a store returns as they are
        # values known on every element of the blocks being written: predicates that hold on
        # whole blocks, positions and what is computed from them in unrolled loops
        self.known: dict[Node, float] = {}
        self.copies = 1  # of the body being written: the runs of the unrolled loops around it
        self.folding: set[Axis] = set()  # axes of the enclosing loops that only fold
        # by part offset: the blocks visited by the loops whose visits depend on the part
        self.part_visits: Counter[int] = Counter()
        # `numpy_plan.constant_value`'s, of every node
        self.constants: dict[Node, float | None] = {}
        # native groups (`native_groups`) of the body being written: root -> its operators
        # in the order the body computes them, and the operators a root's call computes
        self.groups: dict[Node, list[Node]] = {}
        self.also: dict[Node, BlockReduce] = {}  # a root -> the reduction its call computes too
        self.absorbed: set[Node] = set()
        self.via: dict[Node, Node] = {}  # a selection or neutral operation -> the operand it is
        self.windows: set[Dot] = set()  # gathers that may be views of their values (`_window`)
        # sums adding a selection on a few boxes (`box_add`), and the windows they add into
        self.box_adds: dict[Node, tuple[Node, Node, list[tuple[slice, ...]]]] = {}
        self.owning: set[Dot] = set()
        # a native group's root -> its call's statement, which a store may redirect (`into`)
        self.calls: dict[Node, tuple[_Stmt, str]] = {}
        self.product: _Product | None = None  # the last native product written (`steps`)
        # a native product's array -> the node it computes, its contraction, `dot`'s `also`
        self.products_written: dict[str, tuple[Node, Dot, tuple[Axis, ...]]] = {}
        self.emitted: list[_Stmt] = []  # the steps written so far of the body being written
        # folds of one chunk that take a view of a written tensor as it is (`written_view`)
        self.taken_views: set[Reduce] = set()
        self.users: dict[Node, set[Node]] = {}  # the distinct nodes reading each node
        for s in kernel.stores if fns.native else ():
            for m in postorder(s.value):
                for c in children(m):
                    self.users.setdefault(c, set()).add(m)
        self.stored = {s.value for s in kernel.stores}
        # the positions gathers pick at (`known_tile`)
        self.picked = {pick.at for s in kernel.stores for n in postorder(s.value)
                       if isinstance(n, Dot) and (hot := one_hot(n)) is not None
                       for pick in hot[1]}

    # ---------------------------------------------------------------- names and lookup

    def fresh(self, hint: str) -> str:
        self.counter += 1
        name = _identifier(f"t{self.counter}_{hint}", self.taken)
        self.taken.add(name)
        return name

    def named(self, n: Node) -> Code | None:
        """The code in scope for `n`, or None (not counted as read: `lookup`)."""
        return next((scope[n] for scope in reversed(self.scopes) if n in scope), None)

    def lookup(self, n: Node) -> Code:
        if (code := self.named(n)) is not None:
            self.reads.update(code if isinstance(code, tuple) else (code,))
            return code
        if isinstance(n, Const):
            return _literal(n.value)
        raise IRError(f"numpy backend: {n!r} used before the schedule computes it")

    def tile(self, n: Node) -> str:
        code = self.lookup(n)
        assert isinstance(code, str), "validated programs use tuples only through get"
        return code

    def dims(self, n: Node) -> tuple[int, ...]:
        return self.layout.shape(tile_type(n), self.loop_vars.keys())

    # ---------------------------------------------------------------- steps

    def write(self) -> list[str]:
        """The function: its outputs stored block by block allocated first, then every step.

        A part allocates nothing it stores (its caller passes the whole arrays) and returns
        nothing."""
        k, part = self.kernel, self.part
        grid = ", ".join(f"{a}: {self.layout.grid_blocks(a)} x {self.p.block(a)}" for a in k.grid)
        stored = ", ".join(f"{s.tensor}[{', '.join(s.axes)}]" for s in k.stores)
        if part is None:
            params = list(self.params.values())
            doc = f"Kernel {stored}, all grid blocks at once ({grid or 'no grid axes'})."
        else:
            params = [*self.params.values(), *self.outputs.values(), part.start]
            doc = (f"Kernel {stored}, the part of its grid from element {part.start} of "
                   f"{part.axis} ({grid}).")
        head = [f"def {self.fn_name}({', '.join(params)}):", f'    """{doc}"""']
        looped = {step.store.tensor for step, loops in walk_steps(self.schedule.body)
                  if isinstance(step, Write) and loops}
        for s in k.stores:
            if s.tensor in looped and part is None:
                extents = tuple(self.p.padded(a) for a in s.axes)
                head.append(f"    {self.outputs[s.tensor]} = np.empty({_shape_text(extents)}, f32)")
        stmts = _reshaped_once(_together(_live(self.steps(self.schedule.body)), self.fresh),
                               set(params) | set(self.outputs.values()))
        computing = [s for s in stmts if _computes(s)]
        if part is None and len(head) == 2 and len(k.stores) == 1 and len(computing) == 1 and \
                computing[0].product is not None and len(computing[0].lines) == 1 and \
                computing[0].lines[0].startswith(f"{self.outputs[k.stores[0].tensor]} = "):
            self.lone = computing[0]
        if part is None:
            stmts.append(_Stmt([f"return {', '.join(self.outputs[t] for t in k.tensors)}"]))
        else:
            stmts.append(_Stmt([]))  # the end of the function: no temporary to delete after
        return head + _assemble(stmts, "    ", final_is_return=True)

    def part_slice(self, axis: Axis) -> str | None:
        """The index of the part's blocks of `axis` in a global array, when the part is split
        along `axis` (and the code is not inside a loop over it)."""
        part = self.part
        if part is None or axis != part.axis or axis in self.loop_vars:
            return None
        return f"{part.start}:{part.start} + {part.blocks * self.p.block(axis)}"

    def steps(self, steps: Sequence[Step]) -> list[_Stmt]:
        if self.fns.native:
            self.native_groups([s.node for s in steps if isinstance(s, Compute)])
        out: list[_Stmt] = []
        outer, self.emitted = self.emitted, out
        for step in steps:
            self.reads = set()
            self.product = None
            if isinstance(step, Loop):
                out += self.loop(step)
            elif isinstance(step, Write):
                out.append(self.store(step.store))
            elif (stmt := self.compute(step.node)) is not None:
                self.owned |= stmt.owned
                call = self.product and self.product.call
                if call and len(stmt.lines) == 1 and stmt.lines[0].count(call) == 1 and \
                        not stmt.in_place:
                    stmt.product = self.product
                out.append(stmt)
        self.emitted = outer
        return out

    def compute(self, n: Node) -> _Stmt | None:
        if n in self.absorbed:
            return None  # its group's root computes it
        if (name := self.known_tile(n)) is not None:
            self.scopes[-1][n] = name  # a global no step owns: never written, never deleted
            return None
        return STEP(n, self)

    def known_tile(self, n: Node) -> str | None:
        """The module global that holds `n`'s tile, computed once when the module loads, where
        `n` is an operator over positions and numbers known while generating (`static_code`)
        and its tile has at most `KNOWN_ELEMENTS` elements: a causal mask, recomputed on
        every call, took 53 µs of LLaMA's 1.7 ms at 128 tokens.  A bare position is one only
        where a gather picks at it: `gather_one_hot` then finds once that it steps evenly
        (`_geometry` keeps what it found of a read-only array), where a fresh `np.arange` was
        checked on every call (a KV cache's concatenation: 270 -> 141 µs)."""
        if isinstance(n, Pos):
            if n not in self.picked or not self.positions_known(n.axis) or \
                    not 1 < prod(self.dims(n)) <= KNOWN_ELEMENTS:
                return None
            return self.fns.computed_on_loading(self.position(n))
        codes = [self.static_code(c) for c in children(n)]
        if not self.of_positions(n, [code is not None for code in codes]):
            return None
        # each code is a call, a name or a literal: none needs parentheses
        return self.fns.computed_on_loading(self.fns.call(n, [(c, False) for c in codes]))

    def of_positions(self, n: Node, static: Sequence[bool]) -> bool:
        """Is `n` a tile `known_tile` computes on loading, given which of its operands need
        nothing computed at run time?"""
        return not isinstance(n, (Const, Pos)) and is_elementwise(n) and \
            n not in self.known and 1 < prod(self.dims(n)) <= KNOWN_ELEMENTS and all(static)

    def static_code(self, n: Node) -> str | None:
        """Code for `n`'s tile that needs nothing computed at run time (a position of an axis
        neither looped nor split into parts, a number, a tile computed on loading), else
        None."""
        if n in self.known:
            return _literal(self.known[n])
        if (value := numpy_plan.constant_value(n, self.constants)) is not None:
            return _literal(value)
        if isinstance(n, Pos):
            return self.position(n) if self.positions_known(n.axis) else None
        code = next((scope[n] for scope in reversed(self.scopes) if n in scope), None)
        if code in self.fns.known.values():
            self.reads.add(code)
            return code
        return None

    def array(self, n: Node, name: str, text: str, fresh: bool = True) -> _Stmt:
        """A step defining array `name` as `text` (`fresh`: a new array, never a view)."""
        self.scopes[-1][n] = name
        owned = frozenset((name,)) if fresh and not isinstance(n, Load) else frozenset()
        return _Stmt([f"{name} = {text}"], (name,), frozenset(self.reads), owned=owned)

    def alias(self, n: Node, same: Node | None, code: Code) -> _Stmt | None:
        """`n` is the value of node `same` (None: of the number `code`): the same array where
        their tiles have the same dimensions, else that value broadcast to `n`'s (a view no
        step writes into), so that steps that reshape `n` (a contraction) find its shape."""
        dims = self.dims(n)
        if (self.dims(same) if same is not None else (1,) * len(dims)) == dims:
            self.scopes[-1][n] = code
            return None
        name = self.fresh("broadcast")
        self.scopes[-1][n] = name
        return _Stmt([f"{name} = np.broadcast_to({code}, {dims!r})"], (name,),
                     frozenset(self.reads))

    def aliased(self, n: Node) -> Callable[[], _Stmt | None] | None:
        """How elementwise `n` is written where it is another value (`alias`): a number known
        on these blocks, a selection by a known condition, an operation with a neutral
        operand; else None."""
        if n in self.known:
            return lambda: self.alias(n, None, _literal(self.known[n]))
        if (same := self.same_as(n)) is not None:
            return lambda: self.alias(n, same, self.lookup(same))
        return None

    def same_as(self, n: Node) -> Node | None:
        """The operand that elementwise `n` is on these blocks, maybe broadcast (a selection by
        a known condition, an operation with a neutral operand: `_neutral_operand`, reading
        through selections where only contractions read `n`), else None."""
        if isinstance(n, Where) and n.c in self.known:
            return n.x if self.known[n.c] else n.y
        readers = self.users.get(n)
        picks = bool(readers) and n not in self.stored and all(isinstance(u, Dot)
                                                               for u in readers)
        return _neutral_operand(n, self.known, picks)

    def passes(self, n: Node) -> Node | None:
        """The operand of its tile's dimensions that `n` is on these blocks (`same_as`), else
        None."""
        if n in self.known or not is_elementwise(n):
            return None
        same = self.same_as(n)
        return same if same is not None and (isinstance(same, Const) or
                                             self.dims(same) == self.dims(n)) else None

    def written_view(self, n: Node) -> bool:
        """Is `n`'s tile a view of a tensor that a kernel wrote (`same_as`, through views and
        broadcasts)?  That memory is never written again, so a store may return the view:
        grouped-query attention's key and value heads repeated for each query head (`x + 0 *
        pos(h)`) then cost nothing to store, and a product reads them with a batch stride of 0
        (LLaMA's layer at 128 tokens: two copies of 10-13 µs); so do RoPE's halves, a fold
        that takes one chunk of such a view as it is (`take_once`: `taken_views`).  An
        input's memory is the caller's, and a store copies it."""
        if n in self.taken_views:
            return True
        while not isinstance(n, Load):
            if isinstance(n, BlockReduce) and \
                    self.dims(n.x)[self.layout.element_dim(n.axis)] == 1:
                n = n.x  # a block of one: the element itself
            elif n in self.known or not is_elementwise(n) or (n := self.same_as(n)) is None:
                return False
        tensors = self.p.tensors
        return tensors[tensors[n.tensor].storage].role != "input"

    def through(self, n: Node) -> Node:
        """What `n` is, through the selections and neutral operations that are an operand."""
        while n in self.via:
            n = self.via[n]
        return n

    def native_groups(self, body: Sequence[Node]) -> None:
        """The native groups among the nodes one body computes (`codegen.native`): an
        operator joins the group of the operators reading it where they all are in one group,
        have its dimensions (or it is a value a row of theirs: `per_row`) and it is not
        stored.  A group is at least two operators, or one over at least
        `NATIVE_ALONE_ELEMENTS` (not a sum a product may take as its addend:
        `_adds_to_product`), or one a reduction within the tile reads (the C reduces it, and
        returns the values too where other steps read them: `also`), or one that reads a value
        a row of its own (`by_rows`), or none: a reduction of a tile no operator computes (a
        softmax's max over loaded scores, but not a sum of products, which is one matmul); it
        covers at least `NATIVE_ELEMENTS` elements or chains at least `NATIVE_CHAIN`
        operators, and has at most `NATIVE_OPERATORS`.  Only operators that compute
        (not `aliased`, not a `known_tile`, not in a gather's one-hot) join; a selection by
        known positions joins (the C selects by a tile of them) where it would otherwise set
        slices (`fill`)."""
        for n in body:  # a loop's body is written once per segment, each with its own knowns
            self.groups.pop(n, None)
            self.also.pop(n, None)
            self.absorbed.discard(n)
            self.box_adds.pop(n, None)
        for n in body:
            if (adding := self.box_add(n)) is not None:
                self.box_adds[n] = adding
                selection = next(w for w in children(n) if w is not adding[0])
                self.absorbed.add(selection)
                condition = set(postorder(selection.c))
                for m in reversed(body):  # (nothing computes what only the selection reads)
                    if m in condition and m not in self.stored and \
                            self.users.get(m, set()) <= self.absorbed:
                        self.absorbed.add(m)
                self.owning.add(self.gather_below(adding[0]))
        static: set[Node] = set()  # the tiles `known_tile` will compute on loading
        for n in body:
            if is_elementwise(n) and self.of_positions(
                    n, [c in static or self.static_code(c) is not None for c in children(n)]):
                static.add(n)
        for n in body:
            self.via.pop(n, None)
            if (same := self.passes(n)) is not None:
                self.via[n] = same

        def readers(x: Node) -> set[Node]:
            """The nodes reading `x`, through the selections that are it (a stored one reads
            it for the store)."""
            found: set[Node] = set()
            for u in self.users.get(x, set()):
                found |= readers(u) | ({u} & self.stored) if self.via.get(u) is x else {u}
            return found
        # a gather's one-hot is computed by no step, but the gather reads its picks' positions
        # (a convolution's o + s in a part, where they are not a tile known on loading)
        hot = numpy_plan.one_hot_operands(body)
        root_of: dict[Node, Node] = {}
        for n in reversed(body):  # readers first
            if n in static or not self.plain(n) or n in self.via or n in hot or \
                    n in self.box_adds or n in self.absorbed:
                continue
            users = readers(n)
            roots = {root_of.get(u) for u in users}
            joins = len(roots) == 1 and None not in roots and n not in self.stored and \
                all(self.dims(u) == self.dims(n) or self.per_row(n, u) for u in users)
            root_of[n] = roots.pop() if joins else n
        members: dict[Node, list[Node]] = {}
        for n in body:
            if n in root_of:
                members.setdefault(root_of[n], []).append(n)
        also: dict[Node, BlockReduce] = {}  # a group's root -> a reduction its call computes
        for n in body:  # a group a reduction within the tile reads: the reduction's, or both
            x = n.x if isinstance(n, BlockReduce) else None
            if x not in members or n.op not in native_c.REDUCTIONS or \
                    not self.innermost(x, n.axis) or _summed_contraction(n, self) is not None:
                continue
            if self.users.get(x) == {n} and x not in self.stored:
                members[n] = members.pop(x)
            elif x not in also:
                also[x] = n
        for n in body:
            if isinstance(n, BlockReduce) and n not in members and n.x not in root_of and \
                    not isinstance(self.through(n.x), Const) and \
                    n.op in native_c.REDUCTIONS and self.innermost(n.x, n.axis) and \
                    _summed_contraction(n, self) is None:
                members[n] = []
        for root, group in members.items():
            reduces = isinstance(root, BlockReduce) or root in also
            elements = prod(self.dims(group[-1] if group else root.x))
            alone = elements >= NATIVE_ALONE_ELEMENTS and not _adds_to_product(root, self.p)
            if (reduces or len(group) > 1 or self.by_rows(root) or alone) and \
                    len(group) <= NATIVE_OPERATORS and \
                    (elements >= NATIVE_ELEMENTS or len(group) >= NATIVE_CHAIN):
                self.groups[root] = group
                self.absorbed.update(m for m in group if m is not root)
                if root in also:
                    self.also[root] = also[root]
                    self.absorbed.add(also[root])
        grouped = {m for root, group in self.groups.items() for m in (root, *group)}
        for n in reversed(body):  # a selection only groups read: their C reads what it is
            if n in self.via and n not in self.stored and \
                    self.users.get(n, set()) <= grouped | self.absorbed:
                self.absorbed.add(n)

    def box_add(self, n: Node) -> tuple[Node, Node, list[tuple[slice, ...]]] | None:
        """(the tile, the selected values, the boxes) where `n` adds to a windowed gather
        (`gather_below`) of its own dimensions a selection of values or zero,
        `where(c, x, 0)`, that nothing else reads, by a condition known while generating that
        holds on a few boxes of at most half the tile (`_boxes`): written as the gather's own
        array (`owning`) with x added on the boxes (`add_on_boxes`), where a native group
        would read the window and write a new array.  A KV cache grown by a token is such a
        sum, the cache's window (zero at the new position) plus the new token where the
        position is the last: the window is the cache's padded copy, and the token is added
        into its pad.  A 1023-token cache (768 KB), both with the window's layout kept
        (`numpy_runtime._geometry`): 89-119 -> 31 µs; 127 tokens, 21 -> 13 µs.  Native code
        only (the window is native code's)."""
        if not (isinstance(n, Binary) and n.op == "add") or not self.plain(n):
            return None
        for tile, w in ((n.x, n.y), (n.y, n.x)):
            if not isinstance(w, Where) or self.users.get(w) != {n} or w in self.stored or \
                    self.dims(tile) != self.dims(n) or self.gather_below(tile) is None:
                continue
            for keep, other, kept in ((w.x, w.y, True), (w.y, w.x, False)):
                if numpy_plan.constant_value(other, self.constants) != 0.0 or \
                        not _is_array(keep) or (held := self.static_values(w.c)) is None:
                    continue
                dims = self.dims(n)
                on = (held != 0) == kept
                on = on.reshape((1,) * (len(dims) - on.ndim) + on.shape)
                if 2 * np.count_nonzero(np.broadcast_to(on, dims)) <= prod(dims) and \
                        (boxes := _boxes(on)):
                    return tile, keep, [tuple(slice(0, d) if f == 1 else b
                                              for b, f, d in zip(box, on.shape, dims))
                                        for box in boxes]
        return None

    def gather_below(self, n: Node) -> Dot | None:
        """The windowed gather whose array `n` is, itself or as a fold over one block of it,
        read by nothing else; else None."""
        while isinstance(n, Reduce) and self.p.dims[n.axis].blocks == 1 and \
                self.users.get(n.x) == {n} and n.x not in self.stored:
            n = n.x
        return n if isinstance(n, Dot) and one_hot(n) is not None else None

    def per_row(self, n: Node, u: Node) -> bool:
        """Is `n`'s tile `u`'s broadcast along u's innermost dimension (and perhaps others): a
        value a row of u, such as a norm's scale rsqrt(mean + eps)?  Joining u's group, it is
        computed where the C reads it, once a row (the compiler hoists it out of the row's
        loop; a group walked by columns computes it once an element), and saves a numpy call
        of its own."""
        have, want = self.dims(n), self.dims(u)
        walked = [d for d, k in enumerate(want) if k > 1]
        return len(have) == len(want) and bool(walked) and have[walked[-1]] == 1 and \
            all(h in (1, w) for h, w in zip(have, want))

    def by_rows(self, n: Node) -> bool:
        """Does `n` read a value a row of its own tile (`per_row`), not a scalar?  numpy walks
        such a broadcast a row at a time, slowly even for one operator: dividing 4 x 128 x 64
        attention outputs by their rows' sums took 15 µs alone, against 8 µs with a divisor
        an element; in LLaMA's layer 16.5 µs, and 9.9 as a native group on two threads."""
        return any(any(k > 1 for k in self.dims(c)) and self.per_row(c, n) for c in children(n))

    def innermost(self, x: Node, axis: Axis) -> bool:
        """Is `axis` the innermost dimension of more than one element of `x`'s tile (a
        group's C reduces only along its innermost loop)?"""
        dims = self.dims(x)
        walked = [d for d, n in enumerate(dims) if n > 1]
        return bool(walked) and walked[-1] == self.layout.element_dim(axis)

    def plain(self, n: Node) -> bool:
        """Is `n` an operator computing an array tile (given it is not computed on
        loading)?"""
        if not is_elementwise(n):
            return False
        t = tile_type(n)
        return bool(t.deps or t.shape) and operator(n).name in native_c.C_OPS and \
            self.aliased(n) is None

    def native(self, n: Node, group: list[Node], name: str) -> _Stmt:
        """A group's one call (`native_groups`), `n` its root (the call computing the reduction
        that reads it too, where it has one: `also`) or the reduction within the tile that
        alone reads its root; also the variant writing into a dying leaf of `n`'s dimensions."""
        members = set(group)
        top, reduce = n, None
        if isinstance(n, BlockReduce):
            top, reduce = n.x, (n.op, self.layout.element_dim(n.axis))
        also = self.also.get(n)
        if also is not None:
            reduce = (also.op, self.layout.element_dim(also.axis))
        leaves: dict[Node, int] = {}
        codes: list[str] = []
        dims: list[tuple[int, ...]] = []
        numbers: dict[Node, float] = {}
        operands = [self.through(c) for m in group for c in children(m)] if group else \
            [self.through(top)]
        for c in (c for c in operands if c not in members):
            if c in leaves or c in numbers:
                continue
            value = (self.known[c] if c in self.known
                     else numpy_plan.constant_value(c, self.constants))
            if value is not None:
                numbers[c] = value
                continue
            code = self.tile(c)
            if code not in codes:
                codes.append(code)
                dims.append(self.dims(c))
            leaves[c] = codes.index(code)
        read = native_c.leaf_reader(leaves, numbers)
        body = native_c.statements(top, members, read, self.through) if group else \
            (f"out = {read(self.through(top))};",)
        fn = self.fns.native_group(self.dims(top), tuple(dims), body, reduce, also is not None)
        args = ", ".join(codes)
        if self.part is None and self.fns.threads > 1:  # (a part's rows stay on its thread)
            args += f", threads={self.fns.threads}"
        names = (name,) if also is None else (name, self.fresh(f"b{also.op}"))
        defined = ", ".join(names)
        stmt = _Stmt([f"{defined} = {fn}(None, {args})"], names, frozenset(self.reads),
                     owned=frozenset(names))
        if also is None and reduce is None:
            self.calls[n] = (stmt, f"{fn}({{}}, {args})")
        # a dying leaf of the values' dimensions may hold them; never a reduction's result,
        # which holds partial results while the leaves are read
        for code, d in zip(codes, dims):
            if d == self.dims(n) and not isinstance(n, BlockReduce):
                stmt.in_place.setdefault(code, [f"{defined} = {fn}({code}, {args})"])
        self.scopes[-1][n] = name
        if also is not None:
            self.scopes[-1][also] = names[1]
        return stmt

    def elementwise(self, n: Node, name: str) -> _Stmt:
        """One operator; where it is a ufunc, also the variant writing into a dying operand."""
        args = [self.lookup(c) for c in children(n)]
        t = tile_type(n)
        array = bool(t.deps or t.shape)  # else possibly a numpy scalar, which has no buffer
        stmt = _Stmt([f"{name} = {self.fns.call(n, [(a, False) for a in args])}"], (name,),
                     frozenset(self.reads), owned=frozenset((name,) if array else ()))
        ufunc = self.fns.ufunc(n)
        if ufunc and array:
            for c, a in zip(children(n), args):
                if isinstance(a, str) and self.dims(c) == self.dims(n) and a not in stmt.in_place:
                    stmt.in_place[a] = [f"{name} = {ufunc}({', '.join(args)}, out={a})"]
        self.scopes[-1][n] = name
        return stmt

    def fill_boxes(self, n: Where) -> tuple[Node, float, list[tuple[slice, ...]]] | None:
        """(the tile, the number, the boxes to set to it) where `n` selects between an array
        tile of its own dimensions and a number by a condition known while generating, which
        holds on a box of the tile or off one (a padded axis' `pos < extent`); else None."""
        for keep, other, kept in ((n.x, n.y, True), (n.y, n.x, False)):
            t = tile_type(keep)
            number = numpy_plan.constant_value(other, self.constants)
            if number is None or not (t.deps or t.shape) or self.dims(keep) != self.dims(n):
                continue  # (a tile of neither deps nor shape may be a numpy scalar)
            held = self.static_values(n.c)
            if held is None:
                return None
            dims = self.dims(n)
            fill = (held != 0) != kept  # over the condition's own dimensions (1 elsewhere)
            fill = fill.reshape((1,) * (len(dims) - fill.ndim) + fill.shape)
            boxes = _boxes(fill)
            if boxes is None:
                return None
            return keep, number, [tuple(slice(0, d) if f == 1 else b
                                        for b, f, d in zip(box, fill.shape, dims))
                                  for box in boxes]
        return None

    def fill(self, n: Where, name: str, keep: Node, number: float,
             boxes: list[tuple[slice, ...]]) -> _Stmt:
        """The tile `keep` with `boxes` set to `number`, slice by slice (`fill_boxes`): in
        place where the tile dies here, else in a copy laid out in memory as the tile is (a
        table read transposed stays in rows for the gather that reads it).  Magika's GELU
        before its max over 508 positions padded to 512: 2 µs, where `np.where` took 118."""
        tile, dims = self.tile(keep), self.dims(n)

        def set_in(a: str) -> list[str]:
            return [f"{a}[{_index_text(box, dims)}] = {_literal(number)}" for box in boxes]
        stmt = _Stmt([f"{name} = {tile}.copy(order='K')", *set_in(name)], (name,),
                     frozenset(self.reads), owned=frozenset((name,)))
        stmt.in_place[tile] = [*set_in(tile), f"{name} = {tile}"]
        self.scopes[-1][n] = name
        return stmt

    def add_on_boxes(self, n: Node, tile: Node, values: Node,
                     boxes: list[tuple[slice, ...]]) -> _Stmt:
        """`tile` with `values` added on `boxes` (`box_add`): in place where the tile dies
        here, else in a copy laid out in memory as the tile is."""
        name, code, dims = self.fresh("add"), self.tile(tile), self.dims(n)
        added, have = self.tile(values), self.dims(values)
        added = added if added.isidentifier() else f"({added})"

        def add_in(a: str) -> list[str]:
            return [f"{a}[{_index_text(box, dims)}] += {added}[{_index_text(part, have)}]"
                    for box in boxes
                    for part in [tuple(b if k > 1 else slice(0, 1) for b, k in zip(box, have))]]
        stmt = _Stmt([f"{name} = {code}.copy(order='K')", *add_in(name)], (name,),
                     frozenset(self.reads), owned=frozenset((name,)))
        stmt.in_place[code] = [*add_in(code), f"{name} = {code}"]
        self.scopes[-1][n] = name
        return stmt

    def positions_known(self, axis: Axis) -> bool:
        """Are the tile's positions along `axis` known while generating: every block of it,
        neither a loop's block nor a part's share?"""
        return axis not in self.loop_vars and self.part_slice(axis) is None

    def static_values(self, n: Node) -> np.ndarray | None:
        """`n`'s tile where it is computed from positions and numbers known while generating:
        not those of a looped axis or of a part's axis (unless `known`)."""
        values: dict[Node, np.ndarray] = {}
        for m in postorder(n):
            if m in self.known:
                values[m] = np.full(self.dims(m), self.known[m], np.float32)
            elif isinstance(m, Const):
                values[m] = np.float32(m.value)
            elif isinstance(m, Pos):
                if not self.positions_known(m.axis):
                    return None
                extent = self.p.padded(m.axis) if m.axis in self.layout.grid else \
                    self.p.block(m.axis)
                values[m] = np.arange(extent, dtype=np.float32).reshape(self.dims(m))
            elif is_elementwise(m):
                with np.errstate(all="ignore"):
                    values[m] = np.asarray(operator(m).numpy(*(values[c] for c in children(m))),
                                           np.float32)
            else:
                return None
        return values[n]

    def block_reduce(self, n: BlockReduce) -> str:
        fn = self.fns.ref(TILE_REDUCE[n.op], "TILE_REDUCE")
        return f"{fn}({self.tile(n.x)}, axis={self.layout.element_dim(n.axis)}, keepdims=True)"

    def load(self, n: Load) -> str:
        """A view of the global array: the loop's block of looped axes, all blocks of grid axes."""
        return self.view(self.params[n.tensor], n.axes, self.dims(n))

    def view(self, array: str, axes: Sequence[Axis], dims: Sequence[int]) -> str:
        """`array`, a global array over `axes`, at the blocks being written, in the kernel layout
        of `dims`."""
        lay = self.layout
        index: list[str] = []
        parts: list[list[tuple[int, int]]] = []
        for a in axes:
            d = self.p.dims[a]
            if a in self.loop_vars:
                v = self.loop_vars[a]
                index.append(f"{v}:{v} + {d.block}")
                parts.append([(lay.element_dim(a), d.block)])
            elif a in lay.grid:
                index.append(self.part_slice(a) or ":")
                parts.append([(lay.block_dim(a), lay.grid_blocks(a)),
                              (lay.element_dim(a), d.block)])
            else:
                index.append(":")
                parts.append([(lay.element_dim(a), d.block)])
        while index and index[-1] == ":":
            index.pop()
        code = array + (f"[{', '.join(index)}]" if index else "")
        return _to_layout(code, parts, dims)

    def position(self, n: Pos) -> str:
        """The positions along the axis: the loop's block, or every block of a grid axis."""
        d, lay = self.p.dims[n.axis], self.layout
        element = (lay.element_dim(n.axis), d.block)
        if n.axis in self.loop_vars:
            v = self.loop_vars[n.axis]
            code, parts = f"np.arange({v}, {v} + {d.block}, dtype=f32)", [[element]]
        elif n.axis in lay.grid:
            if self.part_slice(n.axis) is not None:
                start = self.part.start
                code = f"np.arange({start}, {start} + {self.part.blocks * d.block}, dtype=f32)"
            else:
                code = f"np.arange({d.padded}, dtype=f32)"
            parts = [[(lay.block_dim(n.axis), lay.grid_blocks(n.axis)), element]]
        else:
            code, parts = f"np.arange({d.block}, dtype=f32)", [[element]]
        return _to_layout(code, parts, self.dims(n))

    def dot(self, n: Dot, also: tuple[Axis, ...] = (),
            add: tuple[str, tuple[int, ...]] | None = None, negated: bool = False) -> str:
        """A contraction as one (batched) matmul: x-only axes become rows, y-only columns;
        over a one-hot operand, a gather (`gather`).  `also`: axes both operands span that
        the matmul contracts too (the contraction summed over them within the block at once).
        `add`: the code and dimensions of a tile the native product adds, `negated`: the
        product subtracted from it (`added_to_product`)."""
        if not also and (hot := one_hot(n)) is not None and \
                (code := self.gather(n, *hot)) is not None:
            return code
        xn, yn, scale = self.factors(n, also)
        xs, ys = self.dims(xn), self.dims(yn)
        contracted = (*also, n.axis)
        # contracted in the order the larger operand holds them in memory (a view of it, the
        # other copied into that order), a gathered one's of equal sizes (`held_order`)
        held = [(prod(self.dims(o)), not isinstance(o, Load), order) for o in (xn, yn)
                if (order := self.held_order(o)) is not None and set(contracted) <= set(order)]
        if held:
            order = max(held, key=lambda h: h[:2])[2]
            contracted = sorted(contracted, key=order.index)
        cs = [self.layout.element_dim(a) for a in contracted]
        batch, xfree, yfree = _product_dims(xs, ys, cs)
        parts = [[(i, xs[i])] for i in batch]
        parts += [[(i, xs[i]) for i in xfree], [(i, ys[i]) for i in yfree]]
        summed = {self.layout.element_dim(a) for a in also}
        dims = tuple(1 if i in summed else d for i, d in enumerate(self.dims(n)))
        if add is None and scale == 1.0 and \
                (code := self.window_product(xn, yn, batch, xfree, yfree, cs, dims)) is not None:
            return code
        if xfree and len(yfree) == 1 and not self.fns.native and \
                any(self.layout.element_dim(a) == yfree[0] for a in self.folding):
            # columns over the block of a folding loop, which the fold reduces across: the
            # product computed column-major (y^T x^T, then viewed transposed), so that numpy's
            # maxima and sums over a row run across contiguous columns, two to three times
            # faster.  Native groups reduce rows fastest where they are contiguous: attention's
            # exp and sum over 4 x 1024 x 256 scores took 830 µs column-major, 290 by rows.
            x = _from_layout(self.tile(xn), xs, [[i] for i in batch] + [cs, xfree])
            y = _from_layout(self.tile(yn), ys, [[i] for i in batch] + [yfree, cs])
            return _to_layout(f"{self.matmul(y, x)}.swapaxes(-1, -2)", parts, dims)
        rows, cols = ([p for p in free if dims[p] > 1] for free in (xfree, yfree))
        if self.fns.native and rows and cols and min(cols) < min(rows):
            # the layout holds y's free dimensions outside x's: computed as y^T x^T, the
            # result in the layout's order (the native product reads any operand's strides),
            # not transposed after it: Conformer's pointwise convolution, W x^T, left its
            # result column-major, and the residual added to it walked it element by element
            xn, yn, xs, ys, xfree, yfree = yn, xn, ys, xs, yfree, xfree
            parts = [*parts[:-2], parts[-1], parts[-2]]
        x = self.operand(xn, xs, batch, xfree, cs)
        y = self.operand(yn, ys, batch, cs, yfree)
        addend = None if add is None else _from_layout(
            *add, [[i] for i in batch] + [xfree, yfree])
        return _to_layout(self.matmul(x, y, addend, -scale if negated else scale), parts, dims)

    def window_product(self, x: Node, y: Node, batch: Sequence[int], rows: Sequence[int],
                       cols: Sequence[int], cs: Sequence[int], dims: tuple[int, ...]
                       ) -> str | None:
        """In native modules, a contraction of one row per batch entry by a windowed gather
        (`gather`) of several tap or position dimensions, which no view merges into a
        product's rows and columns (a window's rows and taps step along one dimension of its
        values), or of many batch entries (products of one row, which the native product
        leaves to numpy: Conformer's 15 taps over 768 channels took 450 µs so), as
        `window_product` (`native_matmul`), which reads the window where it lies: a
        depthwise convolution over two spatial dimensions (a copy that merged them took
        MBConv's 3 x 3 window over 3072 channels of a 10 x 10 image 4.6 ms, the window
        product 0.3).  None for any other contraction."""
        if not self.fns.native:
            return None
        for window, other, free, others in ((y, x, cols, rows), (x, y, rows, cols)):
            if others or not free:  # (the other operand one row a batch entry)
                continue
            code = self.tile(window)  # (gathers it: `windows` then holds its gather)
            have = self.dims(window)
            if self.gather_below(window) not in self.windows or \
                    max(sum(have[i] > 1 for i in cs), sum(have[i] > 1 for i in free)) < 2 and \
                    prod(dims[i] for i in batch) == 1:
                return None
            taps = [[i] for i in batch] + [[c] for c in cs]
            self.fns.products = True
            threads = 1 if self.part is not None else self.fns.threads
            call = (f"window_product({_from_layout(self.tile(other), self.dims(other), taps)}, "
                    f"{_from_layout(code, have, taps + [[c] for c in free])}, "
                    f"{len(batch)}, {threads})")
            parts = [[(i, dims[i])] for i in batch] + [[(c, dims[c])] for c in free]
            return _to_layout(call, parts, dims)
        return None

    def factors(self, n: Dot, also: tuple[Axis, ...] = ()) -> tuple[Node, Node, float]:
        """The operands of contraction `n` (summed over `also` too) as the product reads them,
        and a number it scales the product by: in native modules, each operand seen through
        what repeats another tile (`same_as`: grouped-query attention's key and value heads
        shared by query heads, which then are rows of one product, not a batch of broadcast
        ones) and through a product by a number (attention's scale), where the tile seen is
        computed and the product still spans what the contraction does.  LLaMA's layer at 128
        tokens broadcast K and V and scaled K in numpy passes of their own."""
        operands, scale = [n.x, n.y], 1.0
        if not self.fns.native:
            return n.x, n.y, scale
        cs = [self.layout.element_dim(a) for a in (*also, n.axis)]
        spans = [max(a, b) for a, b in zip(self.dims(n.x), self.dims(n.y))]
        for k in range(2):
            while True:
                o, seen, factor = operands[k], None, 1.0
                if is_elementwise(o) and o not in self.known:
                    seen = self.same_as(o)
                    if isinstance(o, Binary) and o.op == "mul":
                        for a, b in ((o.x, o.y), (o.y, o.x)):
                            number = b.value if isinstance(b, Const) else self.known.get(b)
                            if number is not None and self.dims(a) == self.dims(o):
                                seen, factor = a, number
                if seen is None or isinstance(seen, Const) or seen in self.known or \
                        self.named(seen) is None:
                    break
                tried = [seen if i == k else operands[i] for i in range(2)]
                if any(max(a, b) != w for i, (a, b, w) in enumerate(zip(
                        self.dims(tried[0]), self.dims(tried[1]), spans)) if i not in cs):
                    break
                operands[k], scale = seen, scale * factor
        return operands[0], operands[1], scale

    def matmul(self, x: str, y: str, add: str | None = None, scale: float = 1.0) -> str:
        """The product of operands `x` and `y` (times `scale`, plus `add`, in native
        modules): numpy's, or in native modules the native product (`codegen.native_matmul`),
        on one thread in a kernel's part (the parts take every core) and on the module's
        threads in a kernel run whole."""
        if self.fns.native:
            self.fns.products = True
            threads = 1 if self.part is not None else self.fns.threads
            extra = ("" if add is None else f", {add}") + \
                ("" if scale == 1.0 else f", scale={_literal(scale)}")
            call = f"matmul({x}, {y}, {threads}{extra})"
            self.product = _Product(call, x, y, threads, add, scale)
            return self.product.call
        assert add is None and scale == 1.0, "only the native product adds and scales"
        return f"np.matmul({x}, {y})"

    def contraction(self, n: Node, dot: Dot, also: tuple[Axis, ...] = ()) -> _Stmt:
        """The step computing `n`, contraction `dot` summed over `also` too (`dot`)."""
        code = self.dot(dot, also)  # a windowed gather may be a view of the values it picks
        stmt = self.array(n, self.fresh("dot"), code,
                          fresh=dot not in self.windows or dot in self.owning)
        if self.product is not None:
            self.products_written[stmt.defs[0]] = (n, dot, also)
        return stmt

    def added_to_product(self, n: Node) -> bool:
        """Writes `n`, the sum of a native product's array and another tile, as that product
        with the tile as its addend (`matmul(x, y, T, add)`, added as the contraction starts:
        a residual, a bias, an attention mask; LLaMA's layer at 128 tokens ran 3-4% faster
        without its three numpy passes); the product's array then holds the sum, and its
        step moves after those written since, which may compute the addend.  Where the
        product's step is the last product written, no step after it that computes reads its
        array or defines what it reads, `n` alone reads its array (`reads_alone`), and the
        addend spans all or none of each of the product's batch, row and column groups of
        dimensions, and no other (or, of the rows, the inner ones: the query heads of a group
        as rows of one product, each adding the mask of its rows, `matmul.c` repeating the
        addend's rows).  A difference is a sum: a tile less the product scales the
        product by -1, the product less a tile computed on loading (a mask) adds that tile
        negated, computed on loading too."""
        if not isinstance(n, Binary) or n.op not in ("add", "sub"):
            return False
        at = next((i for i in reversed(range(len(self.emitted)))
                   if self.emitted[i].product is not None), None)
        stmt = self.emitted[at] if at is not None else None
        if stmt is None or stmt.product.add is not None or len(stmt.defs) != 1 or \
                stmt.defs[0] not in self.products_written:
            return False
        name = stmt.defs[0]
        top, dot, also = self.products_written[name]
        later = self.emitted[at + 1:]  # steps the product moves past, to read the addend
        if any(_computes(s) and (name in s.uses or stmt.uses.intersection(s.defs))
               for s in later):
            return False
        dims = self.dims(top)
        cs = [self.layout.element_dim(a) for a in (*also, dot.axis)]
        x, y, _ = self.factors(dot, also)
        batch, rows, cols = _product_dims(self.dims(x), self.dims(y), cs)
        groups = [[i] for i in batch] + [rows, cols]
        grouped = {i for g in groups for i in g}
        for operand, add in ((n.x, n.y), (n.y, n.x)):
            adds, code = self.dims(add), self.named(add)
            negative = n.op == "sub" and operand is n.x  # the product less the addend
            if isinstance(add, Const) or add in self.known or self.dims(n) != dims or \
                    self.named(operand) != name or not self.reads_alone(n, operand, top) or \
                    not isinstance(code, str) or code == name or \
                    negative and code not in self.fns.known.values() or \
                    any(adds[i] > 1 for i in range(len(adds)) if i not in grouped) or \
                    not all(_spans(adds, dims, g, inner=g is rows) for g in groups):
                continue
            if negative:  # a tile computed on loading, negated on loading
                code = self.fns.computed_on_loading(f"np.negative({code})")
            self.reads.add(code)
            code = self.dot(dot, also, add=(code, adds), negated=n.op == "sub" and operand is n.y)
            self.emitted[at:] = [  # (steps that only name its array, after it)
                *(s for s in later if name not in s.uses),
                replace(stmt, lines=[f"{name} = {code}"], uses=stmt.uses | self.reads,
                        product=self.product),
                *(s for s in later if name in s.uses)]
            self.scopes[-1][n] = name
            return True
        return False

    def reads_alone(self, n: Node, x: Node, top: Node) -> bool:
        """Is `x` node `top`, or a chain of one-operand nodes down to it (sums over one
        block, the product's array as it is), and does each node of the chain have a single
        reader, the one above it (`n` for `x`), and none of them stored?"""
        reader = n
        while self.users.get(x) == {reader} and x not in self.stored:
            if x is top:
                return True
            if len(operands := children(x)) != 1:
                return False
            reader, x = x, operands[0]
        return False

    def operand(self, n: Node, have: tuple[int, ...], batch: Sequence[int], rows: Sequence[int],
                cols: Sequence[int]) -> str:
        """`_operand` of `n`'s tile; a tile of an input that must be copied into that order is
        copied through `relaid`, once for every call where the array is read-only (a model's
        weights: magika's convolution weights, 0.24 ms a call; other tensors are written by
        the program, never read-only)."""
        if not isinstance(n, Load):
            return _operand(self.tile(n), have, batch, rows, cols, computed=True)
        tensors = self.p.tensors
        if tensors[tensors[n.tensor].storage].role != "input" or \
                self.regroups_by_view(n, have, [[i] for i in batch] + [list(rows), list(cols)]):
            return _operand(self.tile(n), have, batch, rows, cols, computed=False)
        self.fns.runtime.add("relaid")
        relayout = _operand("a", have, batch, rows, cols, computed=False)
        return f"relaid({self.tile(n)}, lambda a: {relayout})"

    def regroups_by_view(self, n: Load, have: Sequence[int],
                         groups: Sequence[Sequence[int]]) -> bool:
        """Does each group of layout dimensions merge dimensions of the loaded global array
        (row-major in its axes' order, a grid axis' blocks outside its elements) that lie
        next to each other in memory, outer to inner: a view, not a copy?"""
        rank: dict[int, tuple[int, int]] = {}
        for k, a in enumerate(n.axes):
            rank[self.layout.element_dim(a)] = (k, 1)
            if a in self.layout.grid:
                rank[self.layout.block_dim(a)] = (k, 0)
        spanned = sorted(r for p, r in rank.items() if have[p] > 1)
        for group in groups:
            ranks = [rank[p] for p in group if have[p] > 1]
            if ranks and spanned[spanned.index(ranks[0]):][:len(ranks)] != ranks:
                return False
        return True

    def held_order(self, n: Node) -> tuple[Axis, ...] | None:
        """The axes of `n`'s tile in the order its memory holds them, outermost first, where
        that order is known: a loaded tile's, its global array's; a gather's, the picks' axes
        then the values' others (`gather_one_hot` lays out whole rows of the values by the
        picks' positions).  The gather of a sum over one block is that sum's tile.

        Between operands of equal size the gather keeps its order: copying magika's
        convolution window (512 positions x 5 taps x 256 channels) into the weights' order,
        taps innermost, took 537 µs; the weights into the window's order, 241 µs."""
        if isinstance(n, Load):
            return n.axes
        if isinstance(n, Reduce) and n.monoid.name == "sum" and self.p.blocks(n.axis) == 1:
            n = n.x
        if not isinstance(n, Dot) or (hot := one_hot(n)) is None or \
                self.gathered_dim(n, *hot) is None:
            return None
        values, picks = hot
        axes = [a for a in (*self.layout.leading, *self.layout.grid, *self.layout.others)
                if a != n.axis]

        def spanned(m: Node) -> set[Axis]:
            return {a for a in axes if self.dims(m)[self.layout.element_dim(a)] > 1}
        picked = set().union(*(spanned(x) for pick in picks for x in (pick.at, *pick.guards)))
        if picked & spanned(values):
            return None  # positions that differ along the values' rows: numpy's general take
        return tuple(sorted(axes, key=lambda a: (a not in picked, self.layout.element_dim(a))))

    def gathered_dim(self, n: Dot, values: Node, picks: tuple[Pick, ...]) -> int | None:
        """The layout dimension `gather` gathers `n` along, or None where the result would not
        have the contraction's tile shape (then it is a matmul)."""
        c, want = self.layout.element_dim(n.axis), self.dims(n)
        have = self.dims(values)
        if have[c] != self.p.block(n.axis):
            return None
        shapes = [have[:c] + (1,) + have[c + 1:]]
        shapes += [self.dims(x) for pick in picks for x in (pick.at, *pick.guards)]
        return c if np.broadcast_shapes(*shapes) == want else None

    def gather(self, n: Dot, values: Node, picks: tuple[Pick, ...]) -> str | None:
        """`gather_one_hot` of `values` at the picks' positions within the current block of
        the contracted axis, or None where `gathered_dim` finds it is a matmul."""
        if (c := self.gathered_dim(n, values, picks)) is None:
            return None
        start = self.loop_vars.get(n.axis)
        if start is None and _counted_from_both_ends(picks, self.p.block(n.axis)) and \
                any(isinstance(m, Load) for m in postorder(picks[0].at)):  # ids: data
            self.fns.runtime.add("lookup")
            at, tensors = picks[0].at, self.p.tensors
            whole = isinstance(at, Load) and tensors[tensors[at.tensor].storage].dtype in \
                WHOLE_DTYPES  # (`_input` checked them)
            return (f"lookup({self.tile(values)}, {c}, {self.lookup(at)}"
                    f"{', whole=True' if whole else ''})")
        codes = []
        for pick in picks:
            at = self.lookup(pick.at)  # minus the block's start and the pick's offset
            if isinstance(pick.at, Const) or pick.at in self.known:  # an index array of a number
                at = f"np.full({self.dims(pick.at)!r}, {at})"
            if start is not None or pick.offset:
                at = f"({at})" + (f" - {start}" if start is not None else "") + (
                    f" {'-+'[pick.offset < 0]} {abs(pick.offset) + 0.0!r}" if pick.offset else "")
            guards = ", ".join(self.lookup(g) for g in pick.guards)
            codes.append(f"({at}, ({guards}{',' * (len(pick.guards) == 1)}))")
        self.fns.runtime.add("gather_one_hot")
        # positions (not data: token ids) may step evenly, for `matmul` to read in place
        window = self.fns.native and not any(isinstance(m, Load) for pick in picks
                                             for m in postorder(pick.at))
        if window:
            self.windows.add(n)
        own = ", own=True" if window and n in self.owning else ""
        threads = f", threads={self.fns.threads}" if window and self.part is None and \
            self.fns.threads > 1 else ""  # (a part's copies stay on its thread)
        return (f"gather_one_hot({self.tile(values)}, {c}, ({', '.join(codes)},)"
                f"{', window=True' if window else ''}{own}{threads})")

    def loop(self, loop: Loop) -> list[_Stmt]:
        """Accumulators, the loop over the axis' blocks, the finalizers.

        A loop over an axis of one block has no `for`: its statements join the enclosing body,
        so liveness (and overwriting dying temporaries) works across it.  (Only a reduction's
        loop can have one block: a map loop is never over an axis of one block.)
        """
        d = self.p.dims[loop.axis]
        looping = d.blocks > 1
        folds = ", ".join(dict.fromkeys(r.monoid.name for r in loop.reduces))
        stores = ", ".join(step.store.tensor for step, _ in walk_steps(loop.body)
                           if isinstance(step, Write))
        does = " and ".join(([f"folding {folds}"] if folds else [])
                            + ([f"storing {stores}"] if stores else []))
        init = [f"# loop over {loop.axis} ({d.blocks} x {d.block}) {does}" if looping
                else f"# {folds} over {loop.axis}: one block, no loop"]
        unrolled = self.unrolled(loop) if looping else None
        segments = unrolled or (self.segments(loop) if looping else [_Segment("", {}, True)])
        runs = self.combining_runs(loop, unrolled) if unrolled else {}
        states: list[tuple[Reduce, list[str]]] = []
        for r in loop.reduces:
            m = r.monoid
            acc = [self.fresh(c) for c in m.state] if looping else []
            if looping and r not in runs:
                shared, identity = _expressions(m.identity, {}, self.fns, self.fresh)
                init += shared + [f"{', '.join(acc)} = {', '.join(identity)}"]
            states.append((r, acc))
        saved = self.loop_vars.get(loop.axis)
        if looping:
            self.loop_vars[loop.axis] = var = _identifier(f"{loop.axis}0", self.taken)
            self.taken.add(var)
        folds_only = looping and not any(isinstance(step, Write)
                                         for step, _ in walk_steps(loop.body))
        was_folding = loop.axis in self.folding
        if folds_only:
            self.folding.add(loop.axis)
        bodies = []
        outer, copies = self.known, self.copies
        self.copies *= len(unrolled or [None])
        surely_combined: set[Reduce] = set()  # on blocks every case visits
        fresh = {r: _fresh_state(r) for r in loop.reduces}  # (a fold taken once: as taken)
        for i, segment in enumerate(segments):
            self.known = {**outer, **segment.known}
            self.scopes.append({})
            body = self.steps(loop.body)
            for r, acc in states:
                self.reads = set()
                if looping and self.known.get(skip_predicate(r), 1.0) == 0.0:
                    continue  # it contributes its identity on these blocks
                if r in runs and runs[r][0] == i:
                    stmt, fresh[r] = self.take_once(r, acc, alone=len(runs[r]) == 1)
                    body.append(stmt)
                elif looping:
                    body.append(self.combine(r, acc))
                    fresh[r] = _fresh_state(r)
                else:
                    body.append(self.fold_once(r, acc))
                if segment.always:
                    surely_combined.add(r)
            self.scopes.pop()
            body = _together(_live(body), self.fresh) if looping else body
            if not looping or any(not line.lstrip().startswith("#")
                                  for stmt in body for line in stmt.lines):
                bodies.append((segment.blocks, body))  # (not a body of comments only)
        self.known, self.copies = outer, copies
        if not was_folding:
            self.folding.discard(loop.axis)
        if saved is not None:
            self.loop_vars[loop.axis] = saved
        elif looping:
            del self.loop_vars[loop.axis]
        self.reads = set()
        if not looping:
            return [_Stmt(init), *bodies[0][1], self.finalize(states)]
        accs = tuple(a for _, acc in states for a in acc)
        owned = frozenset(a for r, acc in states if r in surely_combined
                          for a, new in zip(acc, fresh[r]) if new)
        self.owned |= owned
        lines = init
        for blocks, body in bodies:
            lines += [f"for {var} in {blocks}:"] + _assemble(body, "    ", final_is_return=False)
        every = [s for _, body in bodies for s in body]
        uses = frozenset().union(*(s.uses for s in every))
        escapes = frozenset().union(*(s.escapes for s in every))
        stmt = _Stmt(lines, accs, uses, owned, escapes=escapes)
        return [stmt, self.finalize(states, surely_combined)] if states else [stmt]

    def combining_runs(self, loop: Loop, runs: Sequence[_Segment]) -> dict[Reduce, list[int]]:
        """The runs of an unrolled loop that combine each of its reductions, where any do (on
        the others its predicate is known false: they contribute the identity).  Each run is
        one block, written once, in order, so the first of them takes its contribution
        (`take_once`), with no accumulator to fill with the identity and no pass adding the
        contribution to it: a one-hot selection of one chunk is that chunk, rotate-half's
        two halves of a contraction are one sum (Mistral's attention scores, 128 tokens: a
        pass of 4 x 384 x 64 per key block)."""
        found: dict[Reduce, list[int]] = {}
        for r in loop.reduces:
            combining = [i for i, run in enumerate(runs)
                         if {**self.known, **run.known}.get(skip_predicate(r), 1.0) != 0.0]
            if combining:
                found[r] = combining
        return found

    def segments(self, loop: Loop) -> list[_Segment]:
        """The loop's visited blocks as code, each run with what is known there (the value of
        a predicate over positions).  Where the loop skips blocks by a predicate and no loop
        inside it does, the blocks the predicate holds on everywhere are a run of their own
        whose body applies no mask: the blocks before it, those blocks, the blocks after it
        (each a table by the part's offset where parts differ, and left out where no part
        has any)."""
        p = loop_predicate(loop)
        if p is None or any(isinstance(step, Loop) and loop_predicate(step) is not None
                            for step, _ in walk_steps(loop.body)):
            return [self.visited(loop)]
        runs = self.visited_runs(loop, p)
        if runs is None or not any(whole for before, whole, after in runs.values()):
            return [self.visited(loop)]
        d = self.p.dims[loop.axis]
        key = self.skip_cases(loop, p)[0]
        self.note_visits(key, {o: [*before, *whole, *after]
                               for o, (before, whole, after) in runs.items()})
        return [_Segment.of({o: r[i] for o, r in runs.items()}, key, d, known)
                for i, known in ((0, {}), (1, {p: 1.0}), (2, {}))
                if any(r[i] for r in runs.values())]

    def unrolled(self, loop: Loop) -> list[_Segment] | None:
        """A short loop over blocks of one element whose body selects by its position (the
        chunk axis of a slice or a concatenation, the pair of rotate-half RoPE; `unrollable`),
        as one run per block in which the position, and every value computed from positions
        and constants alone, is a known number: its masks and one-hot selections fold away,
        and a reduction whose predicate is false there is not combined.  A contraction's
        operands stay arrays (it reshapes them).  None for any other loop, and where the runs
        of the unrolled loops around it would come to more than `UNROLLED_BLOCKS` copies of
        its body: inside the three query heads a key head serves, an interleaved RoPE's pair
        of feature halves, each picked by a `where` over whole tiles when walked, took two
        native calls a step (Mistral's attention 1.43 ms against LLaMA's 0.69)."""
        blocks = self.p.blocks(loop.axis)
        if (self.copies * blocks > numpy_plan.UNROLLED_BLOCKS
                or not numpy_plan.unrollable(self.p, loop)):
            return None
        nodes = dict.fromkeys(numpy_plan.body_nodes(loop))
        contracted = {c for n in nodes if isinstance(n, Dot) for c in (n.x, n.y)}
        runs = []
        for start in range(blocks):
            known: dict[Node, float] = {Pos(loop.axis): float(start)}
            for n in nodes:
                args = [known.get(c, self.known.get(c, c.value if isinstance(c, Const) else None))
                        for c in children(n)]
                if is_elementwise(n) and args and None not in args and n not in contracted:
                    known[n] = numpy_plan.folded(n, args)
            runs.append(_Segment(f"({start},)", known, True))
        return runs

    def visited_runs(self, loop: Loop, p: Node
                     ) -> dict[int | None, tuple[list[int], list[int], list[int]]] | None:
        """Per value of what the visited blocks depend on (`skip_cases`), the visited block
        starts as three runs: cut by `p`, `p` true everywhere, cut again; None where they do
        not fall so."""
        cases = self.skip_cases(loop, p)
        if cases is None:
            return None
        out = {}
        for o, r in cases[1].items():
            held = numpy_plan.starts_where(self.p, loop.axis, p, r)
            cut = set(numpy_plan.starts_where(self.p, loop.axis, Unary("not", p), r))
            whole = [s for s in held if s not in cut]
            first = held.index(whole[0]) if whole else len(held)
            last = first + len(whole)
            if held[first:last] != whole:
                return None
            out[o] = (held[:first], whole, held[last:])
        return out

    def skip_cases(self, loop: Loop, p: Node
                   ) -> tuple[str | None, dict[int | None, dict[Axis, tuple[int, int]]]] | None:
        """What the blocks `p` lets the loop skip depend on, besides the loop's own position:
        (None, {None: {}}) for nothing; (the part's start, its axis' range per part offset)
        for a part's own blocks of its split axis; (an enclosing loop's variable, its block's
        range per block start) for an enclosing loop's position (concatenated pieces, each
        read only in the blocks it fills).  None where it depends on more than one of these.
        """
        axes = {n.axis for n in postorder(p) if isinstance(n, Pos)} - {loop.axis}
        enclosing = [a for a in axes if a in self.loop_vars]
        part = self.part if self.part is not None and self.part.axis in axes else None
        if len(enclosing) + (part is not None) > 1:
            return None
        if part is not None:
            span = part.blocks * self.p.block(part.axis)
            return part.start, {o: {part.axis: (o, o + span - 1)} for o in part.offsets}
        if enclosing:
            a = enclosing[0]
            d = self.p.dims[a]
            return self.loop_vars[a], {s: {a: (s, s + d.block - 1)}
                                       for s in range(0, d.padded, d.block)}
        return None, {None: {}}

    def visited(self, loop: Loop) -> _Segment:
        """The starts of the loop's blocks, as code: all of them, or (where its reductions
        contribute their identity outside a predicate over positions, `loop_predicate`) those
        on which the predicate may hold for some block of the vectorised grid axes: a table by
        a part's offset where the predicate reads its split axis (causal attention's early
        query blocks stop early), or by an enclosing loop's block where it reads its axis."""
        d = self.p.dims[loop.axis]
        p = loop_predicate(loop)
        cases = self.skip_cases(loop, p) if p is not None else None
        if cases is None:
            return _Segment(f"range(0, {d.padded}, {d.block})", {}, True)
        key, ranges = cases
        starts = {o: numpy_plan.starts_where(self.p, loop.axis, p, r) for o, r in ranges.items()}
        self.note_visits(key, starts)
        return _Segment.of(starts, key, d, {})

    def note_visits(self, key: str | None, starts: Mapping[int | None, Sequence[int]]) -> None:
        """Count the blocks a loop visits in each part where that depends on the part's
        offset (`key` is the part's start): `generate` starts the parts that visit most first."""
        if self.part is not None and key == self.part.start:
            for offset, visited in starts.items():
                self.part_visits[offset] += len(visited)

    def combine(self, r: Reduce, acc: list[str]) -> _Stmt:
        """Fold this iteration's contribution into the accumulators (simultaneously).

        A one-component fold whose last operation is a ufunc may write into the contribution
        when this is its last use (the accumulator then takes over that buffer).
        """
        m = r.monoid
        env = {f"a.{c}": a for c, a in zip(m.state, acc)} | self.contribution_env(r)
        shared, new = _expressions(m.combine, env, self.fns, self.fresh)
        escapes = frozenset(env[e.name] for e in m.combine if isinstance(e, Var))
        stmt = _Stmt(shared + [f"{', '.join(acc)} = {', '.join(new)}"],
                     uses=frozenset(self.reads), escapes=escapes)
        root = m.combine[0]
        if (m.arity == 1 and is_elementwise(root) and self.fns.ufunc(root)
                and _fresh_state(r)[0]):
            operands = children(root)
            shared, args = _expressions(operands, env, self.fns, self.fresh)
            for e in operands:
                if isinstance(e, Var) and e.name.startswith("b."):
                    stmt.in_place[env[e.name]] = shared + [
                        f"{acc[0]} = {self.fns.ufunc(root)}({', '.join(args)}, out={env[e.name]})"]
        elif (scaled := _rescaled_sum(r)) is not None and self.fns.native and \
                (lines := self.native_rescale(r, scaled[0], env, acc)) is not None:
            stmt.in_place[env[f"b.{m.state[scaled[0]]}"]] = lines
        elif scaled is not None:
            c, factor, rest = scaled
            b = env[f"b.{m.state[c]}"]
            shared, codes = _expressions([*m.combine, factor, rest], env, self.fns, self.fresh)
            new = codes[:m.arity]
            new[c] = b
            stmt.in_place[b] = shared + [f"np.multiply({b}, {codes[-2]}, out={b})",
                                         f"np.add({b}, {codes[-1]}, out={b})",
                                         f"{', '.join(acc)} = {', '.join(new)}"]
        return stmt

    def native_rescale(self, r: Reduce, c: int, env: Mapping[str, str], acc: list[str]
                       ) -> list[str] | None:
        """The combine of `r` (`_rescaled_sum`: component c is `b.c * f + e`), component c as
        one native call writing into the contribution's dying buffer: its operators over c's
        whole tile in C, the smaller subexpressions they read (an online softmax's rescale
        factors, one per row) computed first by numpy with the other components.  numpy's
        three passes over attention's output took 220 of 1750 µs at N = 1024.  None where an
        operator has no C or a smaller operand's tile is no component's."""
        m = r.monoid
        items = r.x.items if isinstance(r.x, Tuple) else (r.x,)
        types = [tile_type(x) for x in items]
        memo: dict[Node, TileType] = {}

        def typed(e: Node) -> TileType:  # (over the components' types)
            if e not in memo:
                if isinstance(e, Var):
                    memo[e] = types[m.state.index(e.name[2:])]
                elif isinstance(e, Const):
                    memo[e] = SCALAR
                else:
                    parts = [typed(x) for x in children(e)]
                    memo[e] = TileType(frozenset().union(*(t.shape for t in parts)),
                                       frozenset().union(*(t.deps for t in parts)))
            return memo[e]
        root = m.combine[c]
        members = [e for e in dict.fromkeys(postorder(root)) if is_elementwise(e)
                   and not isinstance(e, Var) and typed(e) == types[c]]
        if root not in members or any(operator(e).name not in native_c.C_OPS for e in members):
            return None
        outside = [x for x in dict.fromkeys(x for e in members for x in children(e))
                   if x not in members and not isinstance(x, Const)]
        if any(typed(x) not in types for x in outside):
            return None
        others = [e for i, e in enumerate(m.combine) if i != c]
        shared, codes = _expressions([*others, *outside], env, self.fns, self.fresh)
        leaves = {x: i for i, x in enumerate(outside)}
        numbers = {x: x.value for e in members for x in children(e) if isinstance(x, Const)}
        body = native_c.statements(root, set(members), native_c.leaf_reader(leaves, numbers))
        dims = [self.dims(x) for x in items]
        fn = self.fns.native_group(dims[c], tuple(dims[types.index(typed(x))] for x in outside),
                                   body, None, False)
        b = env[f"b.{m.state[c]}"]
        threads = f", threads={self.fns.threads}" if self.part is None and \
            self.fns.threads > 1 else ""
        new = codes[:len(others)]
        new.insert(c, b)
        return [*shared, f"{b} = {fn}({b}, {', '.join(codes[len(others):])}{threads})",
                f"{', '.join(acc)} = {', '.join(new)}"]

    def fold_once(self, r: Reduce, acc: list[str]) -> _Stmt:
        """A fold over one block: the block's contribution itself, by the monoid's identity
        law, combine(identity, b) = b (as the Triton backend's single trip).  `acc` gets the
        names of the contribution's components, and nothing is computed or copied: a sum over
        one block is no pass adding zero, and an online softmax over one block is its block's
        maximum, sum and product, not eight passes rescaling them by exp(0) and adding the
        identity's zeros (a decode step's attention: 12 numpy calls)."""
        acc.extend(self.contribution(r))
        return _Stmt([], uses=frozenset(self.reads))

    def take_once(self, r: Reduce, acc: list[str], alone: bool
                  ) -> tuple[_Stmt, tuple[bool, ...]]:
        """The first combine of a fold by the runs of an unrolled loop (`combining_runs`; the
        only one where `alone`): its accumulators set to the contribution, as in `fold_once` (a
        one-hot selection's sum is the selected chunk, not a pass adding it to zeros), and
        which of them are arrays of their own."""
        parts = self.contribution(r)
        stmt = _Stmt([f"{', '.join(acc)} = {', '.join(parts)}"], uses=frozenset(self.reads),
                     escapes=frozenset(parts))
        if alone and len(parts) == 1 and self.written_view(r.x):
            self.taken_views.add(r)  # (decided here, where the chunk's selection is known)
        # a component that is the contribution's own new array, which no store returns, is
        # the accumulator's too: a store returns it, not a copy (GPT-2's Q, K and V, each a
        # chunk of the projection plus its bias: a 384 KB copy each)
        alone = not any(m in self.stored for m in postorder(r.x))
        return stmt, tuple(alone and part in self.owned for part in parts)

    def contribution(self, r: Reduce) -> list[str]:
        """The code of the contribution's components, in the monoid's state order."""
        env = self.contribution_env(r)
        return [env[f"b.{c}"] for c in r.monoid.state]

    def contribution_env(self, r: Reduce) -> dict[str, str]:
        """The names of the contribution's components, as a monoid's expressions read them
        (`b.<component>`)."""
        contribution = self.lookup(r.x)
        parts = contribution if isinstance(contribution, tuple) else (contribution,)
        return {f"b.{c}": b for c, b in zip(r.monoid.state, parts)}

    def finalize(self, states: list[tuple[Reduce, list[str]]],
                 combined: AbstractSet[Reduce] | None = None) -> _Stmt:
        """The reductions' results, from their final states, in the enclosing body.  A fold
        not surely `combined` (a loop whose blocks may all be skipped) may still hold its
        identity, a number: its results are broadcast to their tiles' shapes."""
        lines: list[str] = []
        defs: list[str] = []
        owned: set[str] = set()
        for r, acc in states:
            m = r.monoid
            env = dict(zip(m.state, acc))
            shared, texts = _expressions(m.finalize, env, self.fns, self.fresh)
            lines += shared
            results: list[str] = []
            t = type_of(r)
            for f, text, ft in zip(m.finalize, texts, t if isinstance(t, tuple) else (t,)):
                if isinstance(f, Var):
                    results.append(env[f.name])
                    continue
                name = self.fresh("fin")
                lines.append(f"{name} = {text}")
                defs.append(name)
                results.append(name)
                if is_elementwise(f) and ft.shape:
                    owned.add(name)
            if combined is not None and r not in combined:
                for i, ft in enumerate(t if isinstance(t, tuple) else (t,)):
                    name = self.fresh("fin")
                    dims = self.layout.shape(ft, self.loop_vars.keys())
                    lines.append(f"{name} = np.broadcast_to({results[i]}, {dims!r})")
                    defs.append(name)
                    results[i] = name
            self.reads.update(acc)
            self.scopes[-1][r] = results[0] if len(results) == 1 else tuple(results)
        self.owned |= owned
        return _Stmt(lines, tuple(defs), frozenset(self.reads), frozenset(owned))

    def store(self, k: Store) -> _Stmt:
        """Write the stored tile at the current block of every map loop around it.

        Inside map loops, the block goes into the output array allocated at the top; outside
        every loop the tile is the whole tensor: a fresh array is returned as it is (never to be
        overwritten afterwards), anything else is copied into a new one.  A part writes its
        blocks of the split axis into the array its caller passes.
        """
        value = self.tile(k.value)
        lay = self.layout
        groups = [[lay.block_dim(a), lay.element_dim(a)] if a in lay.grid else [lay.element_dim(a)]
                  for a in k.axes]
        tile = _from_layout(value, self.dims(k.value), groups)
        out = self.outputs[k.tensor]
        index = [f"{v}:{v} + {self.p.block(a)}" if (v := self.loop_vars.get(a))
                 else self.part_slice(a) or ":" for a in k.axes]
        while index and index[-1] == ":":
            index.pop()
        uses = frozenset(self.reads)
        if index and (stmt := self.into(k)) is not None:
            return stmt
        if index:
            return _Stmt([f"{out}[{', '.join(index)}] = {tile}"], uses=uses)
        if value in self.owned and value not in self.returned:
            self.returned.add(value)
            return _Stmt([f"{out} = {tile}"], uses=uses, escapes=frozenset((value,)),
                         assigns=True)
        if self.written_view(k.value):
            return _Stmt([f"{out} = {tile}"], uses=uses, assigns=True)
        extents = tuple(self.p.padded(a) for a in k.axes)
        return _Stmt([f"{out} = np.empty({_shape_text(extents)}, f32)", f"{out}[...] = {tile}"],
                     uses=uses)

    def into(self, k: Store) -> _Stmt | None:
        """A store of a native group's values computed in this body, by their call writing into
        the stored block (viewed in the kernel layout) in place of a temporary that the store
        copies: the call's statement becomes the store, and this returns a statement that does
        nothing.  RoPE's rotate-half writes each half so (LLaMA's layer at 128 tokens: 1.040
        -> 1.019 ms).  None where the values are not such a call's, do not span every stored
        axis or their block cannot be viewed so (`_writable_view`).  The call never finds its
        destination among its operands' memory (then it would write a new array): it is the
        kernel's own output, which no kernel reads (`ir.program.validate`)."""
        if k.value not in self.scopes[-1] or k.value not in self.calls:
            return None
        stmt, call = self.calls.pop(k.value)  # (a second store of the values copies them)
        dims = self.dims(k.value)
        extents = tuple(self.p.padded(a) for a in k.axes)
        block = tuple(self.p.block(a) if a in self.loop_vars
                      else self.part.blocks * self.p.block(a) if self.part_slice(a) else n
                      for a, n in zip(k.axes, extents))
        if prod(block) != prod(dims):  # (a value broadcast along a stored axis)
            return None
        dest = self.view(self.outputs[k.tensor], k.axes, dims)
        names = [*self.loop_vars.values(), *([self.part.start] if self.part else [])]
        if not _writable_view(dest, self.outputs[k.tensor], extents, names):
            return None
        name = self.scopes[-1][k.value]
        read = self.users.get(k.value) or sum(s.value == k.value for s in self.kernel.stores) > 1
        stmt.lines = [(f"{name} = " if read else "") + call.format(dest)]
        stmt.defs, stmt.owned, stmt.in_place = (), frozenset(), {}
        self.owned.discard(name)
        return _Stmt([])


def _writable_view(code: str, array: str, extents: Sequence[int], names: Sequence[str]) -> bool:
    """Is `code`, slices, transposes and reshapes of `array` (a C-ordered array of `extents`)
    with integers for `names`, a view of it, which a call may write through?  numpy reshapes a
    block by a copy where its strides do not allow a view; the code is run on a stand-in
    without memory whose reshapes refuse to copy (`numpy.reshape(copy=False)`, numpy 2.1
    on; before it nothing counts as a view)."""
    strides = [4 * prod(extents[d + 1:]) for d in range(len(extents))]
    probe = _Probe(np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), extents, strides))
    try:
        eval(code, {"__builtins__": {}}, {array: probe, **dict.fromkeys(names, 0)})
    except (ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class _Probe:
    """An array's shape and strides, as `_writable_view` runs a block's view code on them:
    indexing and transposing view the array; reshaping raises ValueError where numpy would
    copy.  Nothing reads the array's elements, which are not there."""

    a: np.ndarray

    def __getitem__(self, index) -> _Probe:
        return _Probe(self.a[index])

    @property
    def T(self) -> _Probe:
        return _Probe(self.a.T)

    def transpose(self, *axes: int) -> _Probe:
        return _Probe(self.a.transpose(*axes))

    def reshape(self, *shape: int) -> _Probe:
        return _Probe(np.reshape(self.a, shape, copy=False))


# (operator, constant) pairs where the constant is a neutral element on that side
_RIGHT_NEUTRAL = {("add", 0.0), ("sub", 0.0), ("mul", 1.0), ("div", 1.0),
                  ("max", float("-inf")), ("min", float("inf"))}
_LEFT_NEUTRAL = {("add", 0.0), ("mul", 1.0), ("max", float("-inf")), ("min", float("inf"))}


def _rescaled_sum(r: Reduce) -> tuple[int, Node, Node] | None:
    """(c, f, e) where component c of `r`'s monoid combines as `b.c * f + e` (in either order)
    with b.c, the contribution, an array read nowhere else: an online softmax's rescaled
    output.  Its combine can then scale and add into the contribution's dying buffer, where
    the expression allocates three arrays of the tile's size per iteration."""
    m = r.monoid
    fresh = _fresh_state(r)
    t = type_of(r.x)
    types = t if isinstance(t, tuple) else (t,)

    def fits(x: TileType, into: TileType) -> bool:
        return x.shape <= into.shape and x.deps <= into.deps
    # the largest tile first
    for c in sorted(range(m.arity), key=lambda c: (-len(types[c].shape), -len(types[c].deps))):
        e = m.combine[c]
        if not (fresh[c] and isinstance(e, Binary) and e.op == "add"):
            continue
        b = Var(f"b.{m.state[c]}")
        for scaled, rest in ((e.x, e.y), (e.y, e.x)):
            if isinstance(scaled, Binary) and scaled.op == "mul" and b in (scaled.x, scaled.y):
                factor = scaled.y if scaled.x == b else scaled.x
                others = [*(x for i, x in enumerate(m.combine) if i != c), factor, rest]
                # what is written into b.c's buffer must fit it: no operand spans more
                read = {v.name[2:] for x in (factor, rest) for v in postorder(x)
                        if isinstance(v, Var)}
                if not any(b in postorder(x) for x in others) and all(
                        fits(types[m.state.index(s)], types[c]) for s in read):
                    return c, factor, rest
    return None


def _fresh_state(r: Reduce) -> tuple[bool, ...]:
    """Per state component: whether every combine makes it a new array of its own: an
    operator (not a bare operand) over a tile that spans an axis."""
    t = type_of(r.x)
    parts = t if isinstance(t, tuple) else (t,)
    return tuple(is_elementwise(e) and bool(p.shape) for e, p in zip(r.monoid.combine, parts))


def _axes_of(n: Node) -> tuple[Axis, ...]:
    match n:
        case Load(_, axes):
            return axes
        case Reduce(a, _, _) | BlockReduce(_, a, _) | Dot(a, _, _):
            return (a,)
    return ()


@dataclass
class _Segment:
    """Blocks of a loop visited with one body: their starts as code, what is known on them
    (`_KernelWriter.known`), and whether every case visits at least one (else a fold's state
    may still be its identity after the loop, not an array of its own)."""

    blocks: str
    known: dict[Node, float]
    always: bool

    @staticmethod
    def of(starts: Mapping[int | None, Sequence[int]], key: str | None, d: Dim,
           known: dict[Node, float]) -> _Segment:
        """The block starts of each case (a part's offset, an enclosing loop's block: the
        value of `key`), as one code where they agree, else a table by `key`."""
        codes = {o: _blocks_code(s, d) for o, s in starts.items()}
        if len(set(codes.values())) == 1:
            code = next(iter(codes.values()))
        else:
            code = f"{{{', '.join(f'{o}: {c}' for o, c in codes.items())}}}[{key}]"
        return _Segment(code, known, all(starts.values()))


def _blocks_code(starts: Sequence[int], d: Dim) -> str:
    """Block starts as code: a range where they are consecutive, else a tuple."""
    if len(starts) == d.blocks:
        return f"range(0, {d.padded}, {d.block})"
    if starts and list(starts) == list(range(starts[0], starts[-1] + 1, d.block)):
        return f"range({starts[0]}, {starts[-1] + d.block}, {d.block})"
    return repr(tuple(starts))


def _live(stmts: list[_Stmt]) -> list[_Stmt]:
    """The statements whose results are used, of a whole body: a body in which a predicate is
    known drops the mask it no longer applies, and a gather the one-hot it reads instead.  A
    statement that defines nothing (a fold, a store) stays."""
    needed: set[str] = set()
    kept = []
    for s in reversed(stmts):
        if s.defs and not needed.intersection(s.defs):
            continue
        if _computes(s):  # a comment, or a fold that names its operand, computes nothing
            needed |= s.uses
        kept.append(s)
    return kept[::-1]


def _together(stmts: list[_Stmt], fresh: Callable[[str], str]) -> list[_Stmt]:
    """The body with its native products that can run at once as one call (`matmuls`: one
    job for the threads): a layer's Q, K and V projections, an MLP's gate and up.  A product
    joins a later one where it can wait for it, past every statement between (`_waits`), or
    carrying along those that read it and can follow it (`_follows`: Q's store, between Q's
    product and K's); the call comes where the last of them was, each product's statement
    then reads its result from the call's, and the carried statements come after."""
    moved: dict[int, list[_Stmt]] = {}  # the last product of a group -> the group's steps
    taken: set[int] = set()
    for i, s in enumerate(stmts):
        if s.product is None or i in taken:
            continue
        group, carried = [i], []
        for j in range(i + 1, len(stmts)):
            t = stmts[j]
            waiting = [stmts[m] for m in (*group, *carried)]
            if all(_waits(w, t) for w in waiting):
                if t.product is not None and j not in taken and \
                        t.product.threads == s.product.threads:
                    group.append(j)
            elif t.product is None and all(_follows(t, w) for w in waiting):
                carried.append(j)
            else:
                break  # (nor can they wait for any later one)
        if len(group) == 1:
            continue
        carried = [j for j in carried if j < group[-1]]
        taken.update(group, carried)
        moved[group[-1]] = [*_one_call([stmts[j] for j in group], fresh),
                            *(stmts[j] for j in carried)]
    return [r for i, s in enumerate(stmts) if i in moved or i not in taken
            for r in moved.get(i, [s])]


def _one_call(products: list[_Stmt], fresh: Callable[[str], str]) -> list[_Stmt]:
    """Statements that each call a native product of the same threads, as one `matmuls`
    call followed by the statements, each reading its product's result from the call's."""
    names = [fresh("product") for _ in products]
    pairs = ", ".join(s.product.operands() for s in products)
    threads = products[0].product.threads
    return [_Stmt([f"{', '.join(names)} = matmuls({pairs}, threads={threads})"], tuple(names),
                  frozenset().union(*(s.uses for s in products)), owned=frozenset(names)),
            *(replace(s, lines=[s.lines[0].replace(s.product.call, name)],
                      uses=s.uses | {name}, product=None) for s, name in zip(products, names))]


def _spans(adds: Sequence[int], dims: Sequence[int], group: Sequence[int], inner: bool
           ) -> bool:
    """Does a tile of dimensions `adds` span all or none of the product's dimensions `group`
    (of `dims`), or where `inner`, all of some innermost ones and none of the others?"""
    spanned = [adds[i] == dims[i] for i in group]
    if all(spanned) or all(adds[i] == 1 for i in group):
        return True
    first = spanned.index(True) if True in spanned else len(group)
    return inner and all(spanned[first:]) and all(adds[i] == 1 for i in group[:first])


def _reshaped_once(stmts: list[_Stmt], kept: AbstractSet[str]) -> list[_Stmt]:
    """The body with each temporary that a later statement only reshapes computed there:
    `t = x.reshape(a)` read as `t.reshape(b)` becomes `x.reshape(b)` (numpy's reshape is
    defined on the elements in C order, so two are one, which copies at most where either
    would), and any other `t = e` so read becomes `e.reshape(b)`.  A load's view and a
    product's operand, a product's result and its store, were each two reshapes: LLaMA's
    layer at 128 tokens called reshape 112 times a run, and ran 1.3% faster with 22 fewer
    (`benchmarks/paired.py`).

    The statement moves only past statements it may wait for (`_waits`), that run nothing (a
    fold naming its operand) or that name another tile as their tensor, never into a loop's
    body (a line of its own statement that is indented), and never for a name in `kept`
    (the function's parameters and outputs, which its caller sees)."""
    out = list(stmts)
    words = [set(_IDENTIFIER.findall("\n".join(_all_lines(s)))) for s in out]
    i = 0
    while i < len(out):
        s = out[i]
        j = _reshaping_reader(out, words, i, kept)
        if j is None:
            i += 1
            continue
        name, code = s.defs[0], _reshaped(s.lines[0].split(" = ", 1)[1])
        def rewrite(line: str) -> str:
            return re.sub(rf"\b{name}\.reshape\(", lambda _: f"{code}.reshape(", line)
        u = out[j]
        product = u.product
        if product is not None:
            product = replace(product, call=rewrite(product.call), x=rewrite(product.x),
                              y=rewrite(product.y),
                              add=None if product.add is None else rewrite(product.add))
        out[j] = replace(u, lines=[rewrite(line) for line in u.lines],
                         in_place={a: [rewrite(line) for line in lines]
                                   for a, lines in u.in_place.items()},
                         uses=(u.uses - {name}) | s.uses, product=product or s.product,
                         escapes=u.escapes - {name} | (s.uses if name in u.escapes else set()))
        words[j] = (words[j] - {name}) | (words[i] - {name})
        del out[i], words[i]
    return out


_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")


def _reshaping_reader(stmts: list[_Stmt], words: list[set[str]], i: int,
                      kept: AbstractSet[str]) -> int | None:
    """The index of the one statement after `stmts[i]` that reads what it defines (`words`:
    the identifiers in each statement), where `stmts[i]` is one line defining one temporary
    and the reader only reshapes it, once (or more often, where it is a view), outside any
    loop, and `stmts[i]` may wait until then (`_reshaped_once`)."""
    s = stmts[i]
    if len(s.defs) != 1 or len(s.lines) != 1 or s.in_place or s.escapes or s.assigns or \
            s.defs[0] in kept or not s.lines[0].startswith(f"{s.defs[0]} = "):
        return None
    name = s.defs[0]
    readers = [j for j in range(i + 1, len(stmts)) if name in words[j]]
    if len(readers) != 1:
        return None
    j = readers[0]
    word, reshape = re.compile(rf"\b{name}\b"), re.compile(rf"\b{name}\.reshape\(")
    copies = 0
    for line in _all_lines(stmts[j]):
        found = len(word.findall(line))
        if found and (found != len(reshape.findall(line)) or line[:1].isspace()):
            return None
        copies = max(copies, found)
    if copies > 1 and not _is_view(ast.parse(s.lines[0].split(" = ", 1)[1], mode="eval").body):
        return None  # (a view is cheap to take twice; anything else is computed once)
    return j if all(_waits(s, t) or not (t.defs or _computes(t)) or
                    (t.assigns and not t.in_place and name not in t.uses)
                    for t in stmts[i + 1:j]) else None


def _is_view(tree: ast.expr) -> bool:
    """Is `tree` a name's reshapes and transposes, by whole numbers?"""
    while not isinstance(tree, ast.Name):
        if isinstance(tree, ast.Attribute) and tree.attr == "T":
            tree = tree.value
        elif isinstance(tree, ast.Call) and isinstance(tree.func, ast.Attribute) and \
                tree.func.attr in ("reshape", "transpose") and not tree.keywords and \
                all(isinstance(a, ast.Constant) and type(a.value) is int for a in tree.args):
            tree = tree.func.value
        else:
            return False
    return True


def _all_lines(s: _Stmt) -> list[str]:
    """A statement's lines and those of its variants writing in place."""
    return [*s.lines, *(line for lines in s.in_place.values() for line in lines)]


def _reshaped(code: str) -> str:
    """`code`, an expression, as the receiver of a `.reshape` that replaces its own last one:
    `x.reshape(a)` -> `x`; anything else as it is, parenthesized unless it is a name, a call,
    an attribute or a subscript."""
    tree = ast.parse(code, mode="eval").body
    if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Attribute) and \
            tree.func.attr == "reshape" and not tree.keywords:
        tree = tree.func.value
        code = ast.get_source_segment(code, tree)
    return code if isinstance(tree, (ast.Name, ast.Call, ast.Attribute, ast.Subscript)) \
        else f"({code})"


def _follows(t: _Stmt, s: _Stmt) -> bool:
    """May statement `t`, which may read what the earlier `s` defines, move with `s` past
    the statements after it: it defines what it computes, names a whole tile as its tensor or
    computes nothing (no fold, no store into blocks), overwrites no operand, and redefines
    nothing `s` reads."""
    return (bool(t.defs) or t.assigns or not _computes(t)) and not t.in_place and \
        not s.uses.intersection(t.defs)


def _waits(s: _Stmt, t: _Stmt) -> bool:
    """May statement `s` run after the later statement `t` instead of before: `t` does not
    read what `s` defines or redefine what it reads, nor may overwrite an operand in place
    (which might be the memory of one of its operands' views), nor computes without defining
    (a fold assigns its accumulators, a store its output's blocks)."""
    return not (t.uses.intersection(s.defs) or s.uses.intersection(t.defs) or t.in_place or
                (not t.defs and _computes(t)))


def _computes(s: _Stmt) -> bool:
    """Does `s` run anything: a line that is not a comment?"""
    return any(not line.lstrip().startswith("#")
               for line in [*s.lines, *(line for lines in s.in_place.values() for line in lines)])


def _assemble(stmts: list[_Stmt], indent: str, final_is_return: bool) -> list[str]:
    """Lines of one body: temporaries it defines are deleted after their last use, and a step
    that is the last use of a fresh temporary of its own shape overwrites it instead of
    allocating.  When the last statement returns, nothing is deleted just before it."""
    last: dict[str, int] = {}
    owned: set[str] = set()
    escaped: set[str] = set()
    for i, s in enumerate(stmts):
        for name in s.defs:
            last.setdefault(name, i)
        owned |= s.owned
        escaped |= s.escapes
        for name in s.uses:
            if name in last:
                last[name] = i
    out: list[str] = []
    for i, s in enumerate(stmts):
        reusable = [a for a in s.in_place if a in owned - escaped and last[a] == i]
        lines = s.in_place[reusable[0]] if reusable else s.lines
        out += [indent + line for line in lines]
        dead = [name for name, j in last.items() if j == i]
        if dead and not (final_is_return and i >= len(stmts) - 2):
            out.append(f"{indent}del {', '.join(dead)}")
    return out


def _kernel_params(p: BlockProgram, k: Kernel, names: Mapping[str, str]) -> dict[str, str]:
    tensors = dict.fromkeys(n.tensor for s in k.stores for n in postorder(s.value)
                            if isinstance(n, Load))
    return {t: names[t] for t in tensors}


def _jointly(p: BlockProgram, codes: list[_Code], names: Mapping[str, str], taken: set[str]
             ) -> list[_Code]:
    """The kernels as the module runs them: those that are each one native product of their
    parameters (`_Code.lone`) run as one call, `matmuls`, where the later reads nothing that
    the earlier or a kernel between them stores.  The call runs where the first kernel ran.
    A decode step's Q, K and V projections are three kernels, each a product of one token's
    row: apart, each started and joined the threads for a fraction of a megabyte of weights.
    Run as one job, the step ran 3-4% faster at 127 cached tokens, 0-3% at 1023 (paired
    runs)."""
    joined: set[int] = set()
    launches: list[_Code] = []
    for i, code in enumerate(codes):
        if i in joined:
            continue
        group, since = [i], set(code.kernel.tensors)
        for j in range(i + 1, len(codes)) if code.lone is not None else ():
            other = codes[j]
            if other.lone is not None and other.lone.product.threads == \
                    code.lone.product.threads and not since & _reads(p, other.kernel, names):
                group.append(j)
            since.update(other.kernel.tensors)
        if len(group) == 1:
            launches.append(code)
            continue
        joined.update(group)
        members = tuple(codes[j].kernel for j in group)
        kernel = Kernel((), tuple(st for k in members for st in k.stores))
        fn = _identifier("kernel_" + "_".join(k.name for k in members), taken)
        taken.add(fn)
        params = list(_kernel_params(p, kernel, names).values())
        local = {*params, *(names[t] for t in kernel.tensors)}

        def fresh(hint: str) -> str:
            name = _identifier(f"t{len(local)}_{hint}", local)
            local.add(name)
            return name

        stmts = _one_call([codes[j].lone for j in group], fresh)
        stmts.append(_Stmt([f"return {', '.join(names[t] for t in kernel.tensors)}"]))
        doc = f"Kernels {', '.join(k.name for k in members)}: their products as one call."
        lines = [f"def {fn}({', '.join(params)}):", f'    """{doc}"""',
                 *_assemble(stmts, "    ", final_is_return=True)]
        launches.append(_Code(kernel, lines, whole=fn, members=members))
    return launches


def _regrouping(p: BlockProgram, k: Kernel, names: Mapping[str, str], taken: set[str]
                ) -> _Code | None:
    """`k` as transposes and reshapes, where each of its stores only regroups a loaded tensor's
    dimensions (`regroup`): a view of the tensor's memory where the merged dimensions lie in
    order next to each other there, else a copy in the store's order.  A program's input or
    output is copied: the caller's arrays share no memory with each other."""
    found = [regroup(p, s) for s in k.stores]
    if not found or not all(r is not None and isinstance(r.values, Load) for r in found):
        return None
    fn = _identifier(f"kernel_{k.name}", taken)
    taken.add(fn)
    params = _kernel_params(p, k, names)
    body, done = [], {}
    for s, r in zip(k.stores, found):
        out, output = names[s.tensor], p.tensors[s.tensor].role == "output"
        if s.value in done and not output:  # (stores of one value: one array, unless the
            body.append(f"    {out} = {done[s.value]}")  # caller gets it)
            continue
        done.setdefault(s.value, out)
        role = p.tensors[p.tensors[r.values.tensor].storage].role
        body.append(f"    {out} = " + _regrouped(p, s, r, params[r.values.tensor],
                                                 copy=output or role == "input"))
    stored = ", ".join(f"{s.tensor}[{', '.join(s.axes)}]" for s in k.stores)
    return _Code(k, [f"def {fn}({', '.join(params.values())}):",
                     f'    """Kernel {stored}: loaded dimensions regrouped."""', *body,
                     f"    return {', '.join(names[t] for t in k.tensors)}"], whole=fn)


def _regrouped(p: BlockProgram, s: Store, r: Regroup, array: str, copy: bool) -> str:
    """Code of store `s`'s array, `array` (`r`'s values) regrouped: a view where the memory
    allows, else a copy; a copy anyway where `copy`."""
    held = r.values.axes if isinstance(r.values, Load) else r.axes
    order = tuple(held.index(a) for a in r.axes)
    if order != tuple(range(len(order))):
        array = f"{array}.transpose{order!r}.copy()" if copy else \
            f"np.ascontiguousarray({array}.transpose{order!r})"
    elif copy:
        array = f"{array}.copy()"
    return f"{array}.reshape({tuple(p.extent(a) for a in s.axes)!r})"


def _values_regrouped(p: BlockProgram, k: Kernel, names: Mapping[str, str], taken: set[str],
                      fns: _Functions, capacity: int) -> _Code | None:
    """`k`, of one store that regroups values it computes (`regroup`: a rolled image's rows,
    concatenated pieces, merged into one axis), as a kernel that stores the values over their
    own axes and a reshape of them: as one selection, Swin's concatenation of two slices and
    its regrouping ran as loops of blocks of one row, 0.8 ms, where the concatenation alone
    is a few slices."""
    if len(k.stores) != 1 or (r := regroup(p, k.stores[0])) is None or \
            isinstance(r.values, Load):
        return None
    s = k.stores[0]
    tensor = _identifier(f"{s.tensor}_values", set(p.tensors) | set(names.values()) | taken)
    taken.add(tensor)
    values = replace(p, tensors={**p.tensors, tensor: TensorDecl(tensor, r.axes)})
    inner = Kernel(r.axes, (Store(tensor, r.axes, r.values),),
                   tuple((a, b) for a, b in k.blocks if a in r.axes))
    inner = numpy_plan.rewritten(values, inner, capacity)
    fn, inner_fn = (_identifier(f"kernel_{name}", taken) for name in (k.name, tensor))
    taken.update((fn, inner_fn))
    params = _kernel_params(p, k, names)
    inner_params = _kernel_params(values, inner, names)
    writer = _KernelWriter(values.in_kernel(inner), inner, inner_fn, inner_params,
                           {tensor: tensor}, fns, capacity)
    out = names[s.tensor]  # (a view of the values' array, which nothing else holds)
    return _Code(k, [*writer.write(), "", "",
                     f"def {fn}({', '.join(params.values())}):",
                     f'    """Kernel {s.tensor}[{", ".join(s.axes)}]: values that {inner_fn} '
                     'stores, regrouped."""',
                     f"    {tensor} = {inner_fn}({', '.join(inner_params.values())})",
                     f"    {out} = {_regrouped(p, s, r, tensor, copy=False)}",
                     f"    return {out}"], whole=fn)


def _reads(p: BlockProgram, k: Kernel, names: Mapping[str, str]) -> set[str]:
    """The tensors kernel `k` reads, a view as the tensor it views."""
    return {p.tensors[t].base if p.tensors[t].role == "view" else t
            for t in _kernel_params(p, k, names)}


@dataclass
class _Code:
    """One kernel's generated functions: `whole`, or a function per length of its parts and
    the parts as (function, element offset of the first block)."""

    kernel: Kernel
    lines: list[str]
    whole: str | None = None
    parts: list[tuple[str, int]] = field(default_factory=list)
    threads: int = 1  # how many parts run at once
    lone: _Stmt | None = None  # the whole function's one statement, a native product
    # the kernels whose products `whole` runs as one call (`_jointly`); `kernel` then stores
    # what they store
    members: tuple[Kernel, ...] = ()


@dataclass(frozen=True)
class Generated:
    """A generated module's text, and for each kernel of the program, in order, the names of
    the functions it defines for it: the whole kernel's (which kernels run as one call share,
    `_jointly`), or one per length of its parts (which `run` hands to `run_parts`), with how
    many parts it runs in (1: whole)."""

    source: str
    functions: tuple[tuple[str, ...], ...]
    parts: tuple[int, ...]


def generate(p: BlockProgram, target: Target | str | None = None, threads: int = 1,
             native: bool = False) -> str:
    """The numpy module for `p`: one function per kernel and `run(**inputs) -> outputs`.

    Each kernel runs the loops of its plan on `target` (default: the H100's local memory, which
    decides only which inputs are resident, not the loops).  With `threads` > 1, where some
    kernel's parts pay (`numpy_plan.parts_pay`), kernels with enough work are split into parts
    run at once (`split_kernel`, `run_parts`).  With `native`, chains of elementwise operators are
    C loops the module compiles when it loads (`codegen.native`)."""
    return generate_module(p, target, threads, native=native).source


def generate_module(p: BlockProgram, target: Target | str | None = None, threads: int = 1,
                    split: bool | None = None, native: bool = False) -> Generated:
    """`generate`'s module, with the functions it defines for each kernel.  `split`: whether
    kernels with enough work run in parts on `threads` > 1 threads; by default, where some
    kernel's parts pay (`numpy_plan.parts_pay`)."""
    validate(p)
    if target is None or isinstance(target, str):
        target = get_target(target or "h100")
    names: dict[str, str] = {}
    for t in p.tensors:
        names[t] = _identifier(t, set(names.values()))
    taken = set(names.values())
    fns = _Functions(taken=taken, native=native, threads=threads)
    kernels: list[_Code] = []
    ks = [numpy_plan.rewritten(p, k, target.local_capacity) for k in p.kernels]
    if not (any(numpy_plan.parts_pay(p.in_kernel(k), k)
                and numpy_plan.split_kernel(p, k, threads, target) for k in ks)
            if split is None else split):
        threads = 1
    for original, k in zip(p.kernels, ks):
        if (regrouping := _regrouping(p, original, names, taken) or _values_regrouped(
                p, original, names, taken, fns, target.local_capacity)) is not None:
            kernels.append(regrouping)
            continue
        k = numpy_plan.balanced(p, k, threads, target)
        params = _kernel_params(p, k, names)
        outputs = {t: names[t] for t in k.tensors}
        kp = p.in_kernel(k)
        split = numpy_plan.split_kernel(p, k, threads, target)
        if split is None:
            fn_name = _identifier(f"kernel_{k.name}", taken)
            taken.add(fn_name)
            writer = _KernelWriter(kp, k, fn_name, params, outputs, fns, target.local_capacity)
            kernels.append(_Code(k, writer.write(), whole=fn_name, lone=writer.lone))
            continue
        axis, runs = split
        code = _Code(k, [], threads=threads)
        by_length: dict[int, str] = {}
        visits: Counter[int] = Counter()
        for first, blocks in runs:
            if blocks not in by_length:
                by_length[blocks] = fn_name = _identifier(f"kernel_{k.name}_{axis}{blocks}", taken)
                taken.add(fn_name)
                offsets = tuple(f * kp.block(axis) for f, b in runs if b == blocks)
                writer = _KernelWriter(kp, k, fn_name, params, outputs, fns,
                                       target.local_capacity, (axis, blocks, offsets))
                code.lines += writer.write()
                code.lines.append("")
                visits.update(writer.part_visits)
            code.parts.append((by_length[blocks], first * kp.block(axis)))
        code.lines.pop()
        # The parts that visit most blocks first (a stable sort: all alike where no loop skips
        # by the part): run_parts hands them out in order, and causal attention's last query
        # blocks, started last, kept one thread busy alone for most of a part's time.
        code.parts.sort(key=lambda part: -visits[part[1]])
        kernels.append(code)
    launches = _jointly(p, kernels, names, taken)

    out = [f'"""numpy code generated by bbrules: {len(p.kernels)} kernel(s).',
           "",
           "Each tile holds every grid block at once: a (blocks, block) pair of dimensions per grid",
           "axis, then one dimension per other axis of the kernel, size 1 where the tile has no such",
           "axis.  Each Python loop walks the blocks of one axis, folding reductions over it and/or",
           "storing one block per iteration of the tensors whose axes extend beyond the grid.",
           "A kernel split into parts runs them on several threads at once (run_parts); kernels",
           "that are each one product may run as one function, their products one call.\"\"\"",
           "",
           "import numpy as np",
           ""]
    tables = sorted({alias.split("[")[0] for alias in fns.aliases.values()})
    if tables:
        out[-1:] = [f"from bbrules.ops import {', '.join(tables)}", ""]
    runtime = sorted(fns.runtime | {"relaid"}  # `_input` pads through it
                     | ({"run_parts"} if any(c.parts for c in kernels) else set())
                     | ({"constant"} if fns.known else set()))
    if runtime:
        out[-1:] = [f"from bbrules.codegen.numpy_runtime import {', '.join(runtime)}", ""]
    if any(p.tensors[t].dtype in WHOLE_DTYPES for t in p.inputs):
        out[-1:] = ["from bbrules.ir import check_whole", ""]
    used = set(re.findall(r"\w+", "\n".join(line for c in launches for line in c.lines)))
    groups = [g for g in fns.groups.values() if g.name in used]
    if groups:
        out[-1:] = ["from bbrules.codegen.native import compiled", ""]
    if fns.products:
        out[-1:] = ["from bbrules.codegen.native_matmul import compiled_matmul"
                    + "".join(f", {name}" for name in ("matmuls", "window_product")
                              if name in used), ""]
    out.append("f32 = np.float32")
    out += [f"{name} = {ref}" for name, ref in sorted(fns.aliases.items())]
    if groups:
        out += ["", "# chains of elementwise operators as C loops, compiled once per machine",
                f"NATIVE = compiled(r\"\"\"\n{native_c.source(groups)}\"\"\")"]
        out += [f"{g.name} = NATIVE.function({g.name!r}, {g.dims!r}, {g.leaves!r}"
                + (f", {g.reduce!r}" if g.reduce else "") + (", keeps=True)" if g.keeps else ")")
                for g in groups]
    if fns.products:
        out += ["", "# the native product, compiled once per machine",
                "matmul = compiled_matmul()"]
    if fns.known:  # those the kernels read, and those they are computed from
        for code, name in reversed(fns.known.items()):
            if name in used:
                used |= set(re.findall(r"\w+", code))
        out += ["", "# tiles computed from positions, once"]
        out += [f"{name} = constant({code})" for code, name in fns.known.items()
                if name in used]
    for code in launches:
        out += ["", ""]
        out += ["# " + line for k in code.members or (code.kernel,)
                for line in show_kernel(k).splitlines()]
        out += code.lines
    out += ["", "", *_run_function(p, names, launches)]
    launch_of = {k: code for code in launches for k in code.members or (code.kernel,)}
    functions = tuple((c.whole,) if c.whole is not None else tuple(dict.fromkeys(
        fn for fn, _ in c.parts)) for c in (launch_of[code.kernel] for code in kernels))
    return Generated("\n".join(out) + "\n", functions,
                     tuple(len(c.parts) or 1 for c in kernels))


_INPUT_HELPER = [
    "def _input(inputs, name, shape, padded):",
    '    """Input `name` as float32, checked against the shape the program declares, and',
    '    zero-padded to whole blocks along ragged axes."""',
    "    if name not in inputs:",
    "        raise ValueError(f\"missing input '{name}'\")",
    "    array = np.asarray(inputs[name], dtype=f32)",
    "    if array.shape != shape:",
    "        raise ValueError(f\"input '{name}' has shape {array.shape}, \"",
    "                         f\"the program declares {shape}\")",
    "    if padded != shape:",
    "        widths = tuple((0, p - n) for n, p in zip(shape, padded))",
    "        array = relaid(array, lambda a: np.pad(a, widths), widths)",
    "    return array",
]


def _last_readers(p: BlockProgram, kernels: list[_Code], names: Mapping[str, str]
                  ) -> dict[str, int]:
    """Each temporary's last reader: the index of the last kernel that loads it or a view of
    it (its own kernel's where none does)."""
    last = {t: i for i, code in enumerate(kernels) for t in code.kernel.tensors
            if p.tensors[t].role == "temp"}
    for i, code in enumerate(kernels):
        for t in _kernel_params(p, code.kernel, names):
            base = p.tensors[t].base if p.tensors[t].role == "view" else t
            if base in last:
                last[base] = max(last[base], i)
    return last


def _run_function(p: BlockProgram, names: Mapping[str, str], kernels: list[_Code]) -> list[str]:
    """`run`, which returns every stored tensor (what `bbrules run` and the tests check), and
    `outputs`, which returns the program's outputs alone and drops each temporary once its
    last reader has run: numpy then reuses its memory, still in cache, for the next kernel's
    arrays (LLaMA's layer at 128 tokens ran 1-4% faster), and the run holds only the arrays
    still to be read (`_last_readers`)."""
    lines = [*_INPUT_HELPER, "", "",
             "def run(**inputs):",
             '    """Run every kernel in order; return every stored tensor by name (float32)."""',
             "    return _execute(inputs, True)", "", "",
             "def outputs(**inputs):",
             '    """Run every kernel in order; return the outputs by name (float32), each other',
             '    array freed as soon as no later kernel reads it."""',
             "    return _execute(inputs, False)", "", "",
             "def _execute(inputs, every):"]
    views = [t for t in p.tensors.values() if t.role == "view"]
    last = _last_readers(p, kernels, names)

    def bind_views(ready: set[str], indent: str) -> None:
        """Name each view of a tensor in `ready` (a reshape, which copies only when the base
        array is not contiguous)."""
        for v in views:
            if v.base in ready:
                shape = tuple(p.extent(a) for a in v.axes)
                lines.append(f"{indent}{names[v.name]} = {names[v.base]}.reshape({shape!r})")

    for t in p.inputs:
        shape = tuple(p.extent(a) for a in p.tensors[t].axes)
        padded = tuple(p.padded(a) for a in p.tensors[t].axes)
        lines.append(f"    {names[t]} = _input(inputs, {t!r}, {shape!r}, {padded!r})")
        if p.tensors[t].dtype in WHOLE_DTYPES:
            lines.append(f"    check_whole({t!r}, inputs[{t!r}])")
    bind_views(set(p.inputs), "    ")
    lines.append('    with np.errstate(all="ignore"):')
    for i, code in enumerate(kernels):
        k = code.kernel
        params = list(_kernel_params(p, k, names).values())
        stored = [names[t] for t in k.tensors]
        if code.whole is not None:
            lines.append(f"        {', '.join(stored)} = {code.whole}({', '.join(params)})")
        else:
            kp = p.in_kernel(k)
            for t in k.tensors:
                extents = tuple(kp.padded(a) for a in p.tensors[t].axes)
                lines.append(f"        {names[t]} = np.empty({_shape_text(extents)}, f32)")
            parts = ", ".join(f"({fn}, {start})" for fn, start in code.parts)
            lines.append(f"        run_parts([{parts}], {code.threads}, "
                         f"{', '.join(params + stored)})")
        bind_views(set(k.tensors), "        ")
        dead = [names[x] for t, j in last.items() if j == i
                for x in (t, *(v.name for v in views if v.base == t))]
        if dead:
            lines += ["        if not every:", f"            del {', '.join(dead)}"]

    def unpadded(t: str) -> str:
        axes = p.tensors[t].axes
        if not any(p.dims[a].ragged for a in axes):
            return names[t]
        return f"{names[t]}[{', '.join(f':{p.extent(a)}' for a in axes)}]"

    def returned(tensors: Iterable[str]) -> str:
        return f"{{{', '.join(f'{t!r}: {unpadded(t)}' for t in tensors)}}}"

    lines += ["    if every:", f"        return {returned(k.tensor for k in p.stores)}",
              f"    return {returned(p.outputs)}"]
    return lines


def load(p: BlockProgram, threads: int | None = None, native: bool | None = None
         ) -> types.ModuleType:
    """Generate the module for `p` and execute it into a fresh module object.

    `threads` defaults to `default_threads()`, `native` to `default_native()`; where the
    native groups cannot be compiled, the module is numpy code alone (with a warning).  The
    source is registered with `linecache`, so tracebacks and `inspect` show generated lines.
    """
    threads = numpy_runtime.default_threads() if threads is None else threads
    return loaded(p, threads, default_native() if native is None else native)[1]


def loaded(p: BlockProgram, threads: int, native: bool, split: bool | None = None
           ) -> tuple[Generated, types.ModuleType]:
    """`generate_module`'s module for `p` and the module object it executes into: with
    native groups where asked and they compile, else numpy code alone (with a warning)."""
    if native:
        try:
            generated = generate_module(p, threads=threads, split=split, native=True)
            return generated, module_from_source(generated.source)
        except native_c.NativeUnavailable as e:
            warnings.warn(f"bbrules: numpy code without native groups or products: {e}",
                          stacklevel=3)
    generated = generate_module(p, threads=threads, split=split)
    return generated, module_from_source(generated.source)


def default_native() -> bool:
    """Whether the modules `load` runs have native groups by default: where a C compiler is
    found, unless `$BBRULES_NATIVE` is 0."""
    return os.environ.get("BBRULES_NATIVE", "1").strip() != "0" and native_c.available()


def module_from_source(source: str) -> types.ModuleType:
    """Execute generated source into a fresh module object, its text registered with
    `linecache` under a name of its own."""
    filename = f"<bbrules-numpy-{abs(hash(source)):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType("bbrules_generated")
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def run(p: BlockProgram, inputs: Mapping[str, np.ndarray], threads: int | None = None,
        native: bool | None = None) -> dict[str, np.ndarray]:
    """Generate, load and run `p` on `inputs`: every stored tensor, axes in declared order."""
    return load(p, threads, native).run(**inputs)
