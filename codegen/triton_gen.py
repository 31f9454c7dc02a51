"""The Triton backend: a block program becomes a Python module of `@triton.jit` kernels.

Why it looks the way it does:

- *Tiles are register tensors, not buffers.*  Triton decides registers, shared memory and
  pipelining itself, so of the kernel plan (`bbrules.plan`) this backend takes the schedule --
  which loops exist, which sibling reductions share a loop, in which loop body every node is
  computed, where every write sits -- and none of the buffer placement.  Every value of the
  plan is one SSA variable, a tensor over the value's axes in program order; operands of a
  different shape are broadcast by indexing with `None` where they lack an axis.
- *One program instance per grid point*, the grid linearised as in the CUDA backend; every
  loop of the schedule is a `range` loop inside it, carrying each reduction's state (one tensor
  per monoid component) from iteration to iteration.
- *Contractions run on tensor cores.*  A `dot` whose operands have one row and one column
  group of at least 16 elements becomes `tl.dot` (batched when both operands share an axis of
  several elements), its operands permuted and reshaped into place.  f32 operands use the
  precision the caller states: `tf32` (the default: one TF32 product, the rate the GPU
  targets price f32 contractions at, `peak_flops_dot_f32`), `tf32x3` (three TF32 products,
  about f32 accuracy, a third of that rate) or `ieee` (the CUDA cores).  A contraction
  reading a 16-bit tensor runs in that format, accumulating in f32.  The smallest `tl.dot`
  side, 16, is the targets' `block_granularity`.  A contraction too small for the matrix unit
  is a broadcast product and `tl.sum`.
- *Blocks are padded to powers of two* (`tl.arange` needs them).  Padding lanes are masked on
  load and store, and filled with the consumer's identity before an in-tile reduction or a
  contraction folds them, so they never change a result.  Ragged extents need nothing here:
  global tensors are allocated in whole blocks (zeros past the extent) and the program's own
  predicates mask what the last block holds past it, as in every backend.
- *Block skipping* is the plan's: a loop whose skip predicate cannot hold on the current block
  (`masking.may_hold`, evaluated on the block's position range) does nothing that iteration.
  Where the visited blocks form one run, the loop runs over its bounds, split into the blocks
  the predicate holds on everywhere (emitted with the predicate known true: no mask) and the
  blocks it cuts, as FlashAttention splits causal attention's key loop at the diagonal.
- *Warps and pipeline stages* are the module's `KERNELS` table; its `tune` picks them per
  kernel by timing on the GPU at hand.
- *Monoids are data.*  Identity, combine and finalize are emitted from the monoid's
  expressions, so online softmax and Welford need no code of their own.
- *Values are f32*; 16-bit tensors are loaded as they are stored, converted where an
  elementwise operator reads them, and converted back on store.

`compile_offline` compiles the kernels for sm_90a without a GPU (Triton's own ptxas) and reads
their SASS; `run_interpreted` runs them on numpy arrays in Triton's interpreter.  The module's
own `run` needs torch and a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import linecache
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from bbrules.codegen.cuda_gen import TensorInfo
from bbrules.errors import UsageError
from bbrules.ir import (ELEMENTWISE_KINDS, Binary, BlockProgram, BlockReduce, Const, Dot, Get,
                        IRError, KindTable, Load, Node, Pos, Reduce, Tuple, Unary, Var, Where,
                        children, is_elementwise, operator, postorder, validate,
                        whole_inputs_as_f32)
from bbrules.masking import Algebra, NumpyAlgebra, may_hold
from bbrules.plan import Accumulation, BlockIndex, KernelPlan, LoopPlan, Op, Value, WritePlan, \
    plan_for
from bbrules.targets import Target, get_target

__all__ = ["CompiledKernel", "Precision", "TritonKernel", "TritonModule", "compile_offline",
           "generate", "run_interpreted"]

Precision = Literal["tf32", "tf32x3", "ieee"]
PRECISIONS: tuple[Precision, ...] = ("tf32", "tf32x3", "ieee")
LOG2E = math.log2(math.e)
DOT_MIN = 16  # tl.dot needs at least 16 rows, columns and reduced elements
_TL_DTYPE = {"f32": "tl.float32", "f16": "tl.float16", "bf16": "tl.bfloat16"}
_POINTER = {"f32": "*fp32", "f16": "*fp16", "bf16": "*bf16"}
_REDUCE = {"sum": ("tl.sum", "0.0"), "max": ("tl.max", "-float('inf')"),
           "min": ("tl.min", "float('inf')")}


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _name(text: str) -> str:
    return re.sub(r"\W", "_", text)


def _literal(v: float) -> str:
    v32 = float(np.float32(v))
    if math.isnan(v32):
        return "float('nan')"
    if math.isinf(v32):
        return "float('inf')" if v32 > 0 else "(-float('inf'))"
    return repr(v32) if v32 >= 0 else f"({v32!r})"


# --------------------------------------------------------------------------------------------
# Elementwise operators, as Triton expressions over f32 operands {x}, {y}, {z}.  Helpers that
# are functions of their own (`_bb_*`) are emitted once at the top of every module.

TRITON_OPS: dict[str, str] = {
    "exp": "tl.exp({x})", "log": "tl.log({x})", "sqrt": "tl.sqrt({x})",
    "rsqrt": "tl.rsqrt({x})", "recip": "(1.0 / ({x}))", "abs": "tl.abs({x})",
    "neg": "(-({x}))", "square": "(({x}) * ({x}))", "relu": "tl.maximum({x}, 0.0)",
    "sigmoid": "tl.sigmoid({x})", "silu": "(({x}) * tl.sigmoid({x}))",
    "gelu": "_bb_gelu({x})", "tanh": "_bb_tanh({x})", "erf": "tl.erf({x})",
    "cos": "tl.cos({x})", "sin": "tl.sin({x})", "exp2": "tl.exp2({x})",
    "softplus": "_bb_softplus({x})", "elu": "tl.where(({x}) > 0.0, {x}, tl.exp({x}) - 1.0)",
    "not": "tl.where(({x}) == 0.0, 1.0, 0.0)",
    "add": "(({x}) + ({y}))", "sub": "(({x}) - ({y}))", "mul": "(({x}) * ({y}))",
    "div": "(({x}) / ({y}))", "max": "tl.maximum({x}, {y})", "min": "tl.minimum({x}, {y})",
    "pow": "_bb_pow({x}, {y})",
    **{name: f"tl.where(({{x}}) {c} ({{y}}), 1.0, 0.0)" for name, c in (
        ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="), ("eq", "=="), ("ne", "!="))},
    "and": "tl.where((({x}) != 0.0) & (({y}) != 0.0), 1.0, 0.0)",
    "or": "tl.where((({x}) != 0.0) | (({y}) != 0.0), 1.0, 0.0)",
    "where": "tl.where(({x}) != 0.0, {y}, {z})",
}

_HELPERS = '''\
@triton.jit
def _bb_tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _bb_gelu(x):
    return 0.5 * x * (1.0 + _bb_tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


@triton.jit
def _bb_softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _bb_pow(x, y):
    """x ** y with C's powf semantics: a negative base needs an integer exponent."""
    magnitude = tl.exp2(y * tl.log2(tl.abs(x)))
    whole = y == tl.floor(y)
    odd = whole & (y - 2.0 * tl.floor(0.5 * y) == 1.0)
    signed = tl.where(odd, -magnitude, magnitude)
    negative = tl.where(whole, signed, float("nan"))
    return tl.where(y == 0.0, 1.0, tl.where(x < 0.0, negative, magnitude))
'''

# The Triton expression of one node's operation on its operands' code: a value computed
# inline, or one step of a monoid's identity, combine or finalize.
EXPR = KindTable("triton expression", exempt={
    **{k: "a value of the plan, emitted by _KernelGen.value; never inside a monoid expression"
       for k in (Load, Pos, Get, Reduce, BlockReduce, Dot, Tuple)},
    Var: "a monoid's state or contribution, read from its tile by _KernelGen.monoid_expr"})


@EXPR.on(Const)
def _(n: Const, kids: list[str]) -> str:
    return _literal(n.value)


@EXPR.on(*ELEMENTWISE_KINDS)
def _(n: Node, kids: list[str]) -> str:
    return TRITON_OPS[operator(n).name].format(**dict(zip("xyz", kids)))


class TritonAlgebra(Algebra[str]):
    """Bounds and truth values of a skip predicate as Triton scalar expressions."""

    def const(self, c): return _literal(c)
    def add(self, x, y): return f"({x} + {y})"
    def sub(self, x, y): return f"({x} - {y})"
    def mul(self, x, y): return f"({x} * {y})"
    def neg(self, x): return f"(-{x})"
    def max(self, x, y): return f"tl.maximum({x}, {y})"
    def min(self, x, y): return f"tl.minimum({x}, {y})"
    def lt(self, x, y): return f"({x} < {y})"
    def le(self, x, y): return f"({x} <= {y})"
    def eq(self, x, y): return f"({x} == {y})"
    def and_(self, p, q): return f"({p} & {q})"
    def or_(self, p, q): return f"({p} | {q})"
    def not_(self, p): return f"({p} == 0)"


# --------------------------------------------------------------------------------------------
# The result


@dataclass(frozen=True)
class TritonKernel:
    """One `@triton.jit` function and how to launch it."""

    name: str
    tensors: tuple[str, ...]  # the tensors it stores, in store order
    params: tuple[str, ...]  # tensors passed, in argument order (the stored ones first)
    dtypes: tuple[str, ...]  # each parameter's element type (f32, f16, bf16)
    grid: int  # program instances: one per grid point
    num_warps: int
    num_stages: int
    dots: int  # contractions on the matrix unit (tl.dot)


@dataclass(frozen=True)
class TritonModule:
    """The module text (kernels and a torch launcher) and what the launcher knows."""

    source: str
    kernels: tuple[TritonKernel, ...]
    tensors: dict[str, TensorInfo]
    outputs: tuple[str, ...]
    precision: Precision

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(n for n, t in self.tensors.items() if t.role == "input")

    def namespace(self) -> dict:
        """The module executed (needs triton)."""
        return _exec_module(self.source)


def generate(p: BlockProgram, target: Target | str | None = None,
             precision: Precision = "tf32", upcast_dots: bool = False) -> TritonModule:
    """Triton kernels for every kernel of `p`, from the plans the cost model priced on
    `target` (default h100).  `upcast_dots` gives every contraction f32 operands (Triton's
    interpreter multiplies 16-bit dot operands wrongly)."""
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision '{precision}': choose one of "
                         f"{', '.join(PRECISIONS)}")
    validate(p)
    p = whole_inputs_as_f32(p)
    if target is None or isinstance(target, str):
        target = get_target(target or "h100")
    kernels, bodies = [], []
    for i, kernel in enumerate(p.kernels):
        plan = plan_for(p, kernel, target.local_capacity)
        gen = _KernelGen(p.in_kernel(kernel), plan, f"k{i}_{_name(kernel.name)}", precision,
                         upcast_dots)
        info, body = gen.emit()
        kernels.append(info)
        bodies.append(body)
    tensors = {t.name: TensorInfo(tuple(p.padded(a) for a in t.axes), t.dtype, t.role,
                                  tuple(p.extent(a) for a in t.axes))
               for t in p.tensors.values() if t.role != "view"}  # a view is its base's memory
    source = _module_text(bodies, tuple(kernels), tensors, p.outputs, precision)
    return TritonModule(source, tuple(kernels), tensors, p.outputs, precision)


# --------------------------------------------------------------------------------------------
# One kernel


class _Writer:
    """Indented Python text."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 1

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    @contextlib.contextmanager
    def block(self, head: str) -> Iterator[None]:
        self(head + ":")
        self.depth += 1
        yield
        self.depth -= 1


@dataclass
class _Tile:
    """A value in the generated code: its text and its axes in program order."""

    code: str
    order: tuple[str, ...]
    dtype: str = "f32"  # a loaded 16-bit tile keeps its tensor's dtype until read


@dataclass
class _KernelGen:
    """The text of one kernel from its plan."""

    p: BlockProgram
    plan: KernelPlan
    name: str
    precision: Precision
    upcast_dots: bool
    tiles: dict[Value, _Tile] = field(default_factory=dict)
    states: dict[int, list[_Tile]] = field(default_factory=dict)  # by id(Accumulation)
    counter: itertools.count = field(default_factory=itertools.count)
    # predicates that hold on every element of the blocks being emitted (whole blocks)
    known: dict[Node, float] = field(default_factory=dict)
    dots: int = 0

    def __post_init__(self) -> None:
        self.rank = {a: i for i, a in enumerate(self.p.dims)}
        self.grid_vars = {a: f"g_{_name(a)}" for a in self.plan.grid}

    # -- shapes

    def order(self, axes) -> tuple[str, ...]:
        """The dimensions of a tile over `axes`: in program order, without the axes of one
        element (a head axis in blocks of 1), along which a tile is a scalar."""
        return tuple(sorted((a for a in axes if self.size(a) > 1), key=self.rank.__getitem__))

    def size(self, a: str) -> int:
        return _pow2(self.p.block(a))

    def shape(self, order: tuple[str, ...]) -> str:
        return "[" + ", ".join(str(self.size(a)) for a in order) + "]"

    def padded(self, a: str) -> bool:
        return self.size(a) != self.p.block(a)

    def expand(self, t: _Tile, order: tuple[str, ...]) -> str:
        """`t` indexed so that it broadcasts against a tile over `order` (a superset)."""
        if t.order == order or not t.order:
            return t.code
        missing = set(t.order) - set(order)
        if missing:
            raise IRError(f"a tile over {t.order} read where only {order} exist")
        return f"{t.code}[{', '.join(':' if a in t.order else 'None' for a in order)}]"

    def f32(self, t: _Tile) -> _Tile:
        if t.dtype == "f32":
            return t
        return _Tile(f"{t.code}.to(tl.float32)", t.order)

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"

    def bind(self, w: _Writer, prefix: str, code: str, order: tuple[str, ...],
             dtype: str = "f32") -> _Tile:
        name = self.fresh(prefix)
        w(f"{name} = {code}")
        return _Tile(name, order, dtype)

    def block_var(self, b: BlockIndex, a: str) -> str:
        """The block index of axis `a`: the grid's, a loop's, or 0 where there is one block
        (so an index is never a Python int that tensor methods cannot be called on)."""
        if b is None or (b == "grid" and self.p.blocks(a) == 1) \
                or (b != "grid" and self.plan.loops[b].trips == 1):
            return "0"
        return self.grid_vars[a] if b == "grid" else f"b{b}"

    def lanes(self, a: str, order: tuple[str, ...]) -> str:
        """The lane index along `a` (0 .. padded block), broadcast over `order`."""
        if self.size(a) == 1:
            return "0"
        return self.expand(_Tile(f"tl.arange(0, {self.size(a)})", (a,)), order)

    def position(self, a: str, b: BlockIndex, order: tuple[str, ...]) -> str:
        block, lanes = self.block_var(b, a), self.lanes(a, order)
        if block == "0" or lanes == "0":
            return block if lanes == "0" else lanes
        return f"({block} * {self.p.block(a)} + {lanes})"

    def lane_mask(self, order: tuple[str, ...], axes=None) -> str | None:
        """The lanes inside the block along every padded axis of `axes` (default: all)."""
        terms = [f"({self.lanes(a, order)} < {self.p.block(a)})"
                 for a in (order if axes is None else axes) if self.padded(a)]
        return " & ".join(terms) or None

    def offsets(self, tensor: str, axes: tuple[str, ...], blocks: Mapping[str, BlockIndex],
                order: tuple[str, ...]) -> str:
        """Element offsets in `tensor` (read under the names `axes`) of a tile over `order`."""
        decl = self.p.tensors[tensor]
        extents = [self.p.padded(a) for a in decl.axes]
        wide = math.prod(extents) >= 2 ** 31
        terms = []
        for j, a in enumerate(axes):
            stride = math.prod(extents[j + 1:])
            pos = self.position(a, blocks[a], order)
            if wide and pos != "0":
                pos = f"({pos}).to(tl.int64)"
            terms.append(pos if stride == 1 else f"{pos} * {stride}")
        return " + ".join(terms) or "0"

    # -- text

    def emit(self) -> tuple[TritonKernel, str]:
        stored = self.plan.kernel.tensors
        params = list(stored) + list(dict.fromkeys(
            self.p.tensors[x.node.tensor].storage for x in self.plan.values
            if x.kind == "load"))
        w = _Writer()
        self.decode_grid(w)
        self.ops(w, self.plan.body)
        args = ", ".join(f"g_{_name(t)}" for t in params)
        text = "\n".join(["@triton.jit", f"def {self.name}({args}):", *w.lines, "", ""])
        grid = math.prod(self.p.blocks(a) for a in self.plan.grid)
        largest = max((math.prod(self.size(a) for a in self.order(v.shape))
                       for v in self.plan.values if v.kind == "dot"), default=0)
        info = TritonKernel(self.name, stored, tuple(params),
                            tuple(self.p.tensors[t].dtype for t in params), grid,
                            num_warps=8 if largest >= 128 * 128 else 4, num_stages=2,
                            dots=self.dots)
        return info, text

    def decode_grid(self, w: _Writer) -> None:
        axes = tuple(a for a in self.plan.grid if self.p.blocks(a) > 1)
        if axes:
            w("pid = tl.program_id(0)")
        for i, a in enumerate(reversed(axes)):
            if i == len(axes) - 1:
                w(f"{self.grid_vars[a]} = pid")
            else:
                w(f"{self.grid_vars[a]} = pid % {self.p.blocks(a)}")
                w(f"pid = pid // {self.p.blocks(a)}")

    def ops(self, w: _Writer, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, LoopPlan):
                self.loop(w, op)
            elif isinstance(op, WritePlan):
                self.write(w, op)
            else:
                self.value(w, op)

    def value(self, w: _Writer, x: Value) -> None:
        order = self.order(x.shape)
        if x.kind in ("const", "tuple") or x.mode == "tuple":  # a tuple is read through gets
            return
        match x.kind:
            case "load":
                load = x.node
                storage = self.p.tensors[load.tensor].storage
                offs = self.offsets(load.tensor, load.axes, x.blocks, order)
                mask = self.lane_mask(order)
                masked = f", mask={mask}, other=0.0" if mask else ""
                self.tiles[x] = self.bind(w, "x", f"tl.load(g_{_name(storage)} + {offs}{masked})",
                                          order, self.p.tensors[load.tensor].dtype)
            case "pos":
                a = x.node.axis
                pos = self.position(a, x.blocks[a], order)
                # a scalar position may be a Python int (an axis of one block)
                code = f"({pos}).to(tl.float32)" if order else f"({pos} + 0.0)"
                self.tiles[x] = self.bind(w, "i", code, order)
            case "elementwise" if x.node in self.known:
                self.tiles[x] = _Tile(_literal(self.known[x.node]), ())
            case "elementwise" if isinstance(x.node, Where) and x.node.c in self.known:
                branch = x.args[1] if self.known[x.node.c] else x.args[2]
                code = self.operand(branch, order)
                if branch.kind == "const" or self.order(branch.shape) != order:
                    code = f"tl.broadcast_to({code}, {self.shape(order)})" if order else code
                self.tiles[x] = self.bind(w, "v", code, order)
            case "elementwise" if self.shifted_exp(x):
                self.tiles[x] = self.bind(w, "v", self.exp_of_difference(w, x, order), order)
            case "elementwise":
                kids = [self.operand(a, order) for a in x.args]
                self.tiles[x] = self.bind(w, "v", EXPR(x.node, kids), order)
            case "breduce":
                self.tiles[x] = self.tile_reduce(w, x, order)
            case "dot":
                self.tiles[x] = self.contract(w, x, order)
            case "result" | "get":
                i = x.node.index if x.kind == "get" else 0
                self.tiles[x] = self.bind(w, "r", self.finalize(w, x.acc, i, order), order)
            case _:
                raise IRError(f"the Triton backend cannot emit a value of kind {x.kind}")

    def shifted_exp(self, x: Value) -> bool:
        """Is `x` `exp(a - b)` with `b` over fewer axes than `a` (softmax's `exp(s - max)`)?"""
        if not (isinstance(x.node, Unary) and x.node.op == "exp"):
            return False
        d = x.args[0]
        return d.kind == "elementwise" and isinstance(d.node, Binary) and d.node.op == "sub" \
            and set(self.order(d.args[1].shape)) < set(self.order(d.args[0].shape))

    def exp_of_difference(self, w: _Writer, x: Value, order: tuple[str, ...]) -> str:
        """`exp(a - b)` as `exp2(a * log2(e) - b * log2(e))`, the second product once per
        row: one fused multiply-add per element where the subtraction and exp's own scaling
        by log2(e) take two (FlashAttention's form)."""
        a, b = x.args[0].args
        rows = self.order(b.shape)
        scaled = self.bind(w, "v", f"{self.operand(b, rows)} * {LOG2E!r}", rows)
        return f"tl.exp2({self.operand(a, order)} * {LOG2E!r} - {self.expand(scaled, order)})"

    def operand(self, x: Value, order: tuple[str, ...]) -> str:
        """`x` as an f32 operand of a tile over `order`."""
        if x.kind == "const":
            return _literal(x.node.value)
        return self.expand(self.f32(self.tiles[x]), order)

    def tile_reduce(self, w: _Writer, x: Value, order: tuple[str, ...]) -> _Tile:
        axis, (fn, identity) = x.node.axis, _REDUCE[x.node.op]
        src = x.args[0]
        if src.kind == "const" or axis not in self.order(src.shape):  # one value along it
            value = self.operand(src, order)
            code = f"{value} * {float(self.p.block(axis))!r}" if x.node.op == "sum" else value
            return self.bind(w, "v", code, order)
        inner = self.order(src.shape)
        code = self.f32(self.tiles[src]).code
        if self.padded(axis):
            code = f"tl.where({self.lane_mask(inner, (axis,))}, {code}, {identity})"
        reduced = self.bind(w, "v", f"{fn}({code}, axis={inner.index(axis)})",
                            tuple(a for a in inner if a != axis))
        return reduced if reduced.order == order else \
            self.bind(w, "v", self.expand(reduced, order), order)

    def contract(self, w: _Writer, x: Value, order: tuple[str, ...]) -> _Tile:
        """`dot(k, a, b)`: on the matrix unit where its row, column and reduced groups are
        large enough, else a broadcast product summed over k."""
        k = x.node.axis
        a, b = x.args
        if a.kind == "const" or b.kind == "const" or k not in self.order(a.shape) \
                or k not in self.order(b.shape):
            return self.product_sum(w, a, b, k, order)
        ao, bo = self.order(a.shape), self.order(b.shape)
        batch = [ax for ax in order if ax in ao and ax in bo]
        rows = [ax for ax in order if ax in ao and ax not in bo]
        cols = [ax for ax in order if ax in bo and ax not in ao]
        n_batch, n_rows, n_cols = (math.prod(self.size(ax) for ax in g)
                                   for g in (batch, rows, cols))
        if min(n_rows, n_cols, self.size(k)) < DOT_MIN:
            return self.product_sum(w, a, b, k, order)
        self.dots += 1
        narrow = self.operand_dtype(a, b)
        lead = [n_batch] if n_batch > 1 else []
        lhs = self.dot_operand(a, k, batch + rows + [k], lead + [n_rows, self.size(k)], narrow)
        rhs = self.dot_operand(b, k, batch + [k] + cols, lead + [self.size(k), n_cols], narrow)
        precision = "" if narrow != "f32" else f', input_precision="{self.precision}"'
        r = self.bind(w, "d", f"tl.dot({lhs}, {rhs}{precision}, out_dtype=tl.float32)", ())
        natural = tuple(batch + rows + cols)
        code = r.code
        if lead or len(rows) > 1 or len(cols) > 1:
            code = f"tl.reshape({code}, {self.shape(natural)})"
        if natural != order:
            code = f"tl.permute({code}, {[natural.index(ax) for ax in order]})"
        return self.bind(w, "v", code, order)

    def operand_dtype(self, a: Value, b: Value) -> str:
        """The dtype both operands of a contraction are given.  A contraction reading a 16-bit
        tensor runs on the matrix unit in that format, its other operand rounded to it as
        FlashAttention rounds P before P @ V; the products accumulate in f32.  A program of f32
        tensors (or one mixing f16 with bf16) uses f32 at the chosen precision."""
        narrow = {self.tiles[v].dtype for v in (a, b)} - {"f32"}
        return narrow.pop() if len(narrow) == 1 and not self.upcast_dots else "f32"

    def dot_operand(self, v: Value, k: str, want: list[str], shape: list[int],
                    dtype: str) -> str:
        """Operand `v` of a contraction over `k`, in `dtype`: its padding lanes along `k`
        zeroed (a loaded tile's already are), permuted into `want`'s order and reshaped to the
        matrix `shape`."""
        t = self.tiles[v]
        code = t.code if t.dtype == dtype else self.f32(t).code
        if self.padded(k) and v.kind != "load":
            code = f"tl.where({self.lane_mask(t.order, (k,))}, {code}, 0.0)"
        if t.dtype != dtype and dtype != "f32":
            code = f"({code}).to({_TL_DTYPE[dtype]})"
        if list(t.order) != want:
            code = f"tl.permute({code}, {[t.order.index(ax) for ax in want]})"
        if [self.size(ax) for ax in want] != shape:
            code = f"tl.reshape({code}, {shape})"
        return code

    def product_sum(self, w: _Writer, a: Value, b: Value, k: str,
                    order: tuple[str, ...]) -> _Tile:
        """A contraction too small for the matrix unit: the product over (order, k), summed."""
        if k not in self.order(set(a.shape) | set(b.shape)):  # one value along k
            code = f"{self.operand(a, order)} * {self.operand(b, order)}"
            return self.bind(w, "v", f"({code}) * {float(self.p.block(k))!r}", order)
        whole = self.order(set(order) | {k})
        code = f"{self.operand(a, whole)} * {self.operand(b, whole)}"
        if self.padded(k):
            code = f"tl.where({self.lane_mask(whole, (k,))}, {code}, 0.0)"
        return self.bind(w, "v", f"tl.sum({code}, axis={whole.index(k)})", order)

    # -- reductions across blocks

    def loop(self, w: _Writer, op: LoopPlan) -> None:
        if op.trips == 1 and op.skip is None:
            self.single_trip(w, op)
            return
        for red in op.accs:
            self.states[id(red)] = []
            for c, ident in enumerate(red.monoid.identity):
                order = self.order(red.shapes[c])
                value = self.monoid_expr(ident, {}, order, broadcast=False)
                self.states[id(red)].append(self.bind(
                    w, "s", f"tl.full({self.shape(order)}, {value}, tl.float32)", order))
        if op.skip is not None and self.one_run(op, self.block_holds(op, op.skip)):
            lo, hi = self.visited_bounds(w, op)
            if not (op.masks_cut_blocks_only
                    and self.one_run(op, ~self.block_holds(op, Unary("not", op.skip)))):
                with w.block(f"for b{op.id} in range({lo}, {hi})"):
                    self.loop_body(w, op)
                return
            # Blocks on which the predicate holds everywhere need no mask: FlashAttention's
            # split of the key loop into whole blocks and the blocks the diagonal cuts.
            flo, fhi = self.whole_bounds(w, op, lo, hi)
            outer = self.known
            for start, stop, whole in ((lo, flo, False), (flo, fhi, True), (fhi, hi, False)):
                self.known = {**outer, op.skip: 1.0} if whole else outer
                with w.block(f"for b{op.id} in range({start}, {stop})"):
                    self.loop_body(w, op)
            self.known = outer
            return
        with w.block(f"for b{op.id} in range(0, {op.trips})"):
            if op.skip is None:
                self.loop_body(w, op)
                return
            with w.block(f"if {self.may_hold(op, op.skip, f'b{op.id}')}"):
                self.loop_body(w, op)

    def block_holds(self, op: LoopPlan, p: Node) -> np.ndarray:
        """May `p` hold anywhere on a block, for every combination of blocks of the axes the
        loop's skip predicate reads (a boolean array, one dimension per axis)."""
        index = np.meshgrid(*(np.arange(self.p.blocks(a) if b is not None else 1,
                                        dtype=np.float64) for a, b in op.skip_blocks.items()),
                            indexing="ij")
        bounds = {a: (i * self.p.block(a), i * self.p.block(a) + (self.p.block(a) - 1))
                  for a, i in zip(op.skip_blocks, index)}
        return np.broadcast_to(may_hold(p, bounds, NumpyAlgebra()), index[0].shape)

    def one_run(self, op: LoopPlan, chosen: np.ndarray) -> bool:
        """Do the blocks `chosen` (see `block_holds`) form at most one run of consecutive
        blocks along the loop's axis, wherever the loop runs (every block of every other axis
        the predicate reads)?  Then a plain loop over that run's bounds visits them: a loop
        whose loads Triton can pipeline, where an `if` around the body would stop it."""
        axes = list(op.skip_blocks)
        if op.axis not in axes:
            return False
        along = np.moveaxis(chosen, axes.index(op.axis), -1)
        starts = along[..., :1].astype(int) + np.sum(along[..., 1:] & ~along[..., :-1], axis=-1,
                                                      keepdims=True)
        return bool(np.all(starts <= 1))

    def visited_bounds(self, w: _Writer, op: LoopPlan) -> tuple[str, str]:
        """The first and one past the last block the loop visits, found by scalar scans."""
        lo, hi, trips = f"lo{op.id}", f"hi{op.id}", op.trips
        w(f"{lo} = tl.full([], 0, tl.int32)")
        with w.block(f"while ({lo} < {trips}) & ({self.may_hold(op, op.skip, lo)} == 0)"):
            w(f"{lo} += 1")
        w(f"{hi} = tl.full([], {trips}, tl.int32)")
        with w.block(f"while ({hi} > {lo}) & "
                     f"({self.may_hold(op, op.skip, f'({hi} - 1)')} == 0)"):
            w(f"{hi} -= 1")
        return lo, hi

    def whole_bounds(self, w: _Writer, op: LoopPlan, lo: str, hi: str) -> tuple[str, str]:
        """The run of visited blocks on which the skip predicate holds everywhere."""
        flo, fhi = f"wlo{op.id}", f"whi{op.id}"
        cut = Unary("not", op.skip)
        w(f"{flo} = {lo}")
        with w.block(f"while ({flo} < {hi}) & ({self.may_hold(op, cut, flo)} != 0)"):
            w(f"{flo} += 1")
        w(f"{fhi} = {flo}")
        with w.block(f"while ({fhi} < {hi}) & ({self.may_hold(op, cut, fhi)} == 0)"):
            w(f"{fhi} += 1")
        return flo, fhi

    def single_trip(self, w: _Writer, op: LoopPlan) -> None:
        """A loop of one block: its body once, and each state is the contribution itself
        (combining with the identity changes nothing, by the monoid's laws)."""
        self.ops(w, op.body)
        for red in op.accs:
            states = []
            for c, contrib in enumerate(red.contribs):
                order = self.order(red.shapes[c])
                code = self.operand(contrib, order)
                if contrib.kind == "const" or self.order(contrib.shape) != order:
                    code = f"tl.broadcast_to({code}, {self.shape(order)})" if order else code
                states.append(self.bind(w, "s", code, order))
            self.states[id(red)] = states

    def loop_body(self, w: _Writer, op: LoopPlan) -> None:
        before = len(w.lines)
        self.ops(w, op.body)
        for red in op.accs:
            self.combine(w, red)
        if len(w.lines) == before:  # a body whose values are all constants
            w("pass")

    def may_hold(self, op: LoopPlan, p: Node, block: str) -> str:
        """May `p` (over the positions the skip predicate reads) hold anywhere on the loop's
        block number `block`?"""
        bounds = {}
        for a, b in op.skip_blocks.items():
            var = block if b == op.id else self.block_var(b, a)
            start = f"({var} * {self.p.block(a)} + 0.0)"
            bounds[a] = (start, f"({start} + {float(self.p.block(a) - 1)!r})")
        return may_hold(p, bounds, TritonAlgebra())

    def combine(self, w: _Writer, red: Accumulation) -> None:
        """Fold one iteration's contributions into the state.  Every new component is computed
        from the old state before any is replaced, as the monoid's combine reads it."""
        m, states = red.monoid, self.states[id(red)]
        env: dict[str, _Tile] = {}
        for c, (name, contrib) in enumerate(zip(m.state, red.contribs)):
            env[f"a.{name}"] = states[c]
            env[f"b.{name}"] = self.f32(self.tiles[contrib]) if contrib.kind != "const" \
                else _Tile(_literal(contrib.node.value), ())
        named: dict[str, _Tile] = {}
        news = [self.monoid_expr(m.combine[c], env, state.order, w, named)
                for c, state in enumerate(states)]
        for state, new in zip(states, news):
            w(f"{state.code} = {new}")

    def finalize(self, w: _Writer, red: Accumulation, i: int, order: tuple[str, ...]) -> str:
        env = {name: t for name, t in zip(red.monoid.state, self.states[id(red)])}
        return self.monoid_expr(red.monoid.finalize[i], env, order, w, {})

    def monoid_expr(self, root: Node, env: Mapping[str, _Tile], order: tuple[str, ...],
                    w: _Writer | None = None, named: dict[str, _Tile] | None = None,
                    broadcast: bool = True) -> str:
        """A monoid expression (elementwise over Vars) as a tile over `order`, `broadcast` to
        all of it.  Every operation runs over the axes of its own operands only, so a
        rescale factor `exp(a.m - m)` is computed once per row, not once per element of the
        accumulator it scales.  With a writer, each operation is a variable of its own, shared
        through `named` with every expression emitted alongside (the combine's components
        read the same new maximum)."""
        tiles: dict[Node, _Tile] = {}
        for n in postorder(root):
            if isinstance(n, Var):
                tiles[n] = env[n.name]
                continue
            if not (isinstance(n, Const) or is_elementwise(n)):
                raise IRError(f"monoid expressions must be elementwise, found {n!r}")
            kids = [tiles[c] for c in children(n)]
            inner = self.order({a for t in kids for a in t.order})
            code = EXPR(n, [self.expand(t, inner) for t in kids])
            if w is None or isinstance(n, Const):
                tiles[n] = _Tile(code, inner)
            else:
                if code not in named:
                    named[code] = self.bind(w, "m", code, inner)
                tiles[n] = named[code]
        result = tiles[root]
        code = self.expand(result, order)
        if broadcast and order and set(result.order) != set(order):
            code = f"tl.broadcast_to({code}, {self.shape(order)})"
        return code

    # -- stores

    def write(self, w: _Writer, op: WritePlan) -> None:
        s = op.store
        order = self.order(s.axes)
        value = op.result
        code = self.operand(value, order)
        if value.kind == "const" or self.order(value.shape) != order:
            code = f"tl.broadcast_to({code}, {self.shape(order)})" if order else code
        dtype = self.p.tensors[s.tensor].dtype
        if dtype != "f32":
            code = f"({code}).to({_TL_DTYPE[dtype]})"
        offs = self.offsets(s.tensor, s.axes, op.blocks, order)
        mask = self.lane_mask(order)
        w(f"tl.store(g_{_name(s.tensor)} + {offs}, {code}{f', mask={mask}' if mask else ''})")


# --------------------------------------------------------------------------------------------
# The module: kernels, tables and a torch launcher


_LAUNCHER = '''

# name -> (shape in whole blocks, dtype, role, extent)
TENSORS = {tensors!r}
OUTPUTS = {outputs!r}
# (function, program instances, tensor arguments, stored tensors, num_warps, num_stages)
KERNELS = {kernels!r}
PRECISION = {precision!r}
FP_FUSION = True  # multiply-adds contracted to FMA, stated rather than left to Triton's default
DEVICE = "cuda"  # where `run` allocates: "cpu" only under Triton's interpreter
CONFIGS = [(4, 2), (4, 3), (8, 2), (8, 3)]  # the (num_warps, num_stages) `tune` tries


def run(**inputs):
    """Run the program on a GPU: `inputs` are arrays (numpy or torch) by tensor name; returns
    every stored tensor as a torch tensor on the GPU, cut to its extent."""
    memory = _memory(inputs)
    _launch(memory)
    return _stored(memory)


def graphed(**inputs):
    """The program captured once in a CUDA graph, for calls that repeat on the same buffers:
    returns `replay`, which reruns every kernel with one launch from the host and returns what
    `run` returns.  Launching a Triton kernel from Python costs tens of microseconds, more than
    a small program's GPU time; the graph pays it once.  `replay` reads the input tensors
    given here where they are already on the GPU, contiguous and in the program's dtype (copy
    new data into them); other inputs are copied once, at capture."""
    import torch
    memory = _memory(inputs)
    _launch(memory)  # compiles: a kernel's first launch cannot be captured
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(memory)
    stored = _stored(memory)

    def replay():
        graph.replay()
        return stored

    replay.memory = memory  # the graph writes into these buffers: they live as long as it
    return replay


def _memory(inputs):
    """Every tensor of the program on DEVICE: the inputs converted and padded to whole blocks
    (the caller's own tensors where nothing needs changing), the rest allocated."""
    import torch
    dtypes = {{"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}}
    memory = {{}}
    for name, (shape, dtype, role, extent) in TENSORS.items():
        if role != "input":
            memory[name] = torch.empty(shape, dtype=dtypes[dtype], device=DEVICE)
            continue
        if name not in inputs:
            raise ValueError(f"missing input '{{name}}'")
        x = inputs[name]
        if hasattr(x, "flags") and not x.flags.writeable:
            x = x.copy()  # a read-only array (a model's weights): torch takes writeable ones
        x = torch.as_tensor(x, device=DEVICE).to(dtypes[dtype])
        if tuple(x.shape) != extent:
            raise ValueError(f"input '{{name}}' has shape {{tuple(x.shape)}}, expected {{extent}}")
        if shape != extent:  # zeros after a ragged axis's extent
            padded = torch.zeros(shape, dtype=x.dtype, device=DEVICE)
            padded[tuple(slice(0, n) for n in extent)] = x
            x = padded
        memory[name] = x.contiguous()
    return memory


def _launch(memory):
    for name, grid, params, _, num_warps, num_stages in KERNELS:
        globals()[name][(grid,)](*(memory[t] for t in params), num_warps=num_warps,
                                 num_stages=num_stages, enable_fp_fusion=FP_FUSION)


def _stored(memory):
    stored = dict.fromkeys(t for k in KERNELS for t in k[3])
    return {{t: memory[t][tuple(slice(0, n) for n in TENSORS[t][3])] for t in stored}}


def tune(progress=None, **inputs):
    """Choose each kernel's warps and pipeline stages for this GPU and these inputs: kernel
    by kernel, time the whole program under every configuration of CONFIGS (one that does not
    compile or fit is passed over) and keep the fastest.  `run` launches with the choices
    from then on.  Returns {{kernel: {{(num_warps, num_stages): milliseconds}}}}."""
    timings = {{}}
    for i, (name, *rest) in enumerate(KERNELS):
        timings[name] = {{}}
        for warps, stages in CONFIGS:
            KERNELS[i] = (name, *rest[:3], warps, stages)
            try:
                timings[name][(warps, stages)] = _milliseconds(inputs)
            except Exception as e:  # Triton's own errors for a kernel too big for the GPU
                if type(e).__name__ not in ("OutOfResources", "PTXASError"):
                    raise
            if progress:
                ms = timings[name].get((warps, stages))
                progress(f"{{name}}: {{warps}} warps, {{stages}} stages: "
                         + (f"{{ms:.3f}} ms" if ms is not None else "does not fit"))
        if not timings[name]:
            raise RuntimeError(f"{{name}}: no configuration of {{CONFIGS}} fits this GPU")
        KERNELS[i] = (name, *rest[:3], *min(timings[name], key=timings[name].get))
    return timings


def _milliseconds(inputs):
    """Median time of the program on `inputs`: on the GPU, `triton.testing.do_bench` of its
    CUDA graph's replay (the kernels' time, not Python's launches, which would hide the
    difference between configurations of a small program); under the interpreter the wall
    clock of a few calls (where only the choosing, not the times, means anything)."""
    if DEVICE == "cuda":
        import triton.testing
        try:
            program = graphed(**inputs)
        except RuntimeError:  # no graph capture here: time calls, launches and all
            def program():
                return run(**inputs)
        return triton.testing.do_bench(program, warmup=5, rep=25, return_mode="median")
    import statistics
    import time
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run(**inputs)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
'''


def _module_text(bodies: list[str], kernels: tuple[TritonKernel, ...],
                 tensors: dict[str, TensorInfo], outputs: tuple[str, ...],
                 precision: Precision) -> str:
    head = [f'"""Triton kernels for a bbrules program (generated): {len(kernels)} kernel(s), '
            f'launched in order by `run`."""', "", "import triton",
            "import triton.language as tl", "", "", _HELPERS, ""]
    tables = _LAUNCHER.format(
        tensors={n: (t.shape, t.dtype, t.role, t.extent) for n, t in tensors.items()},
        outputs=outputs, precision=precision,
        kernels=[(k.name, k.grid, k.params, k.tensors, k.num_warps, k.num_stages)
                 for k in kernels])
    return "\n".join(head) + "\n" + "\n".join(bodies) + tables


_modules = itertools.count()


def _require_triton() -> None:
    """Fail with a clear message here, not inside a generated module or a child process."""
    if importlib.util.find_spec("triton") is None:
        raise UsageError("the triton backend needs the `triton` package "
                         "(pip install 'bbrules[triton]')")


def _exec_module(source: str) -> dict:
    """Execute a generated module.  Triton reads each kernel's source back through `inspect`,
    so the text is registered with `linecache` under a name of its own."""
    _require_triton()
    number = next(_modules)
    filename = f"<bbrules triton module {number}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {"__name__": f"bbrules_triton_{number}"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


# --------------------------------------------------------------------------------------------
# Compiling without a GPU: Triton's own toolchain for a chosen architecture, read back as SASS


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel compiled offline: what its cubin says about how it will run."""

    name: str
    registers: int
    local_bytes: int  # per-thread local memory: register spills (and stack)
    shared_bytes: int  # shared memory the launch needs
    sass: str

    def count(self, *opcodes: str) -> int:
        """How many SASS instructions start with one of `opcodes` (HGMMA, HMMA, LDL, ...)."""
        pattern = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(" +
                             "|".join(map(re.escape, opcodes)) + r")\b", re.M)
        return len(pattern.findall(self.sass))

    @property
    def tensor_core(self) -> int:
        """Matrix-unit instructions: warpgroup (HGMMA) or warp (HMMA) MMAs."""
        return self.count("HGMMA", "HMMA")


def compile_offline(module: TritonModule, capability: int = 90) -> dict[str, CompiledKernel]:
    """Compile every kernel of `module` for sm_`capability` (90: sm_90a, the H100/H200) with
    Triton's bundled ptxas, without a GPU, and disassemble it with its bundled tools."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    namespace = module.namespace()
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    out: dict[str, CompiledKernel] = {}
    with tempfile.TemporaryDirectory(prefix="bbrules-triton-") as tmp:
        for k in module.kernels:
            fn = namespace[k.name]
            signature = {arg: _POINTER[dtype] for arg, dtype in zip(fn.arg_names, k.dtypes)}
            compiled = triton.compile(
                ASTSource(fn=fn, signature=signature),
                target=GPUTarget("cuda", capability, 32),
                options={"num_warps": k.num_warps, "num_stages": k.num_stages,
                         "enable_fp_fusion": True})
            cubin = Path(tmp) / f"{k.name}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = _tool(tools / "cuobjdump", "-res-usage", cubin)
            registers = int(re.search(r"REG:(\d+)", usage).group(1))
            local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
            out[k.name] = CompiledKernel(k.name, registers, local, compiled.metadata.shared,
                                         _tool(tools / "nvdisasm", cubin))
    return out


def _tool(path: Path, *args) -> str:
    proc = subprocess.run([str(path), *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{path.name} failed: {proc.stderr.strip()}")
    return proc.stdout


# --------------------------------------------------------------------------------------------
# Running without a GPU: Triton's interpreter on numpy arrays.  Triton decides at import time
# whether `triton.jit` (its own library functions included) builds interpreted kernels, so the
# interpreter runs in a child process started with TRITON_INTERPRET=1.


class _HostTensor:
    """A numpy array dressed as the torch tensor Triton's interpreter expects: it only reads
    and writes memory through `data_ptr`, and copies nothing for a tensor already on the host.
    """

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _HostTensor:
        return self

    def cpu(self) -> _HostTensor:
        return self

    def new_empty(self, *args, **kwargs) -> _HostTensor:
        return _HostTensor(self.array)

    def set_(self, storage: _HostTensor, *args) -> _HostTensor:
        self.array = storage.array
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, other: _HostTensor) -> None:
        if other.array is not self.array:
            np.copyto(self.array, other.array)


_HOST_DTYPES = {"f32": np.float32, "f16": np.float16}


def run_interpreted(module: TritonModule, inputs: Mapping[str, np.ndarray]) -> dict:
    """Run `module` in Triton's interpreter (CPU) on numpy `inputs`; every stored tensor as
    float32, cut to its extent.  bf16 has no numpy type: such programs run on a GPU only."""
    _require_triton()
    for name, t in module.tensors.items():
        if t.dtype not in _HOST_DTYPES:
            raise UsageError(f"tensor '{name}' is {t.dtype}: Triton's interpreter runs f32 and "
                             f"f16 programs only")
    arrays = {}
    for name, t in module.tensors.items():
        if t.role != "input":
            continue
        if name not in inputs:
            raise UsageError(f"missing input '{name}'")
        x = np.asarray(inputs[name], dtype=_HOST_DTYPES[t.dtype])
        if x.shape != t.extent:
            raise UsageError(f"input '{name}' has shape {x.shape}, expected {t.extent}")
        arrays[name] = np.pad(x, [(0, p - n) for n, p in zip(t.extent, t.shape)])
    with tempfile.TemporaryDirectory(prefix="bbrules-triton-") as tmp:
        folder = Path(tmp)
        (folder / "kernels.py").write_text(module.source)
        np.savez(folder / "inputs.npz", **arrays)
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run([sys.executable, "-m", "bbrules.codegen.triton_gen", tmp],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"Triton's interpreter failed:\n{proc.stderr.strip()}")
        with np.load(folder / "outputs.npz") as f:
            stored = {name: f[name] for name in f.files}
    return {t: x[tuple(slice(0, n) for n in module.tensors[t].extent)].astype(np.float32)
            for t, x in stored.items()}


def _interpret_folder(folder: Path) -> None:
    """The child process of `run_interpreted`: run `folder`/kernels.py on inputs.npz, write
    every stored tensor to outputs.npz."""
    spec = importlib.util.spec_from_file_location("bbrules_interpreted", folder / "kernels.py")
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    with np.load(folder / "inputs.npz") as f:
        memory = {name: np.ascontiguousarray(f[name]) for name in f.files}
    for name, _, params, _, _, _ in kernels.KERNELS:
        for t in params:
            if t not in memory:
                shape, dtype, _, _ = kernels.TENSORS[t]
                memory[t] = np.zeros(shape, dtype=_HOST_DTYPES[dtype])
    for name, grid, params, _, _, _ in kernels.KERNELS:
        getattr(kernels, name)[(grid,)](*(_HostTensor(memory[t]) for t in params))
    stored = dict.fromkeys(t for k in kernels.KERNELS for t in k[3])
    np.savez(folder / "outputs.npz", **{t: memory[t] for t in stored})


if __name__ == "__main__":
    _interpret_folder(Path(sys.argv[1]))
