"""The CUDA backend: a block program becomes CUDA C for CuPy, one `__global__` per kernel.

Why it looks the way it does:

- *One thread block per grid point.*  `blockIdx.x` linearises the block indices of the kernel's
  grid (its store axes); every loop of the schedule runs sequentially inside the thread block.
- *Loops come from `bbrules.schedule`*, the schedule the cost model prices: merged sibling
  reductions share one loop carrying several accumulators, and every node is computed in the
  loop body the schedule places it in.
- *Every tile operation is cooperative*: the threads stride over the tile's elements, and
  `__syncthreads()` separates a step that writes shared memory from the steps that read it (and
  a read from a later overwrite of the same storage).  Nothing relies on warps executing in
  lockstep, so the same source also runs in the test emulator (`tests/cuda_emu`), which only
  has a barrier.  In-tile reductions and contractions split the reduced axis over the threads
  that have no output element of their own, so they are correct for any block size and any
  number of threads.
- *Elementwise chains are not materialised.*  A node evaluated in exactly one step, over exactly
  its own shape, in the loop body it is placed in, is emitted inline into that step (a chain
  like `exp(S - M) / L` becomes one strided loop).  Anything else -- an operand of a
  contraction, a value read by several steps, broadcast to a larger tile, or read inside a
  deeper loop -- is materialised once: in shared memory, or in a register if it is a scalar.
  Shared memory is assigned by liveness, so a kernel needs no more than the cost model's
  footprint (`bbrules.cost`) plus a little scratch.
- *Monoids are data.*  Identity, combine and finalize are emitted from the monoid's expressions,
  never special-cased by name: online softmax and Welford need no code of their own.  A combine
  must read the *old* state of every component, so components are updated in groups of equal
  shape (one thread updates every component of one element) ordered so that a group reading
  another group's old state runs first; if no such order exists, through temporaries.  A
  contraction or in-tile reduction folded only into an accumulator of the same operator
  (`a.c + b.c` for a dot) is accumulated in place, as the cost model assumes.
- *Values are f32 in registers and shared memory*; f16/bf16 tensors are converted on load and
  store with portable bit arithmetic (no CUDA headers), and 16-bit tiles stay 16-bit in shared
  memory, as the cost model counts them.
"""

from __future__ import annotations

import inspect
import math
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bbrules.errors import UsageError
from bbrules.ir import (Binary, BlockProgram, BlockReduce, Const, Dot, Get, IRError, Load, Monoid,
                        Node, Reduce, Store, Tuple, Unary, Var, postorder, shape,
                        validate)
from bbrules.ops import BINARY, TILE_REDUCE, UNARY
from bbrules.schedule import Compute, Loop, Step, schedule_kernel
from bbrules.targets import Target, get_target

MAX_THREADS = 256  # threads per block: the launch bound every kernel is compiled for
_ALIGN = 16  # bytes: alignment of every shared-memory buffer


# --------------------------------------------------------------------------------------------
# Storage formats of global tensors


@dataclass(frozen=True)
class _Format:
    ctype: str  # element type of the global array
    to_float: str  # C expression template reading one element as float
    from_float: str  # C expression template converting a float to the element type
    itemsize: int


FORMATS: dict[str, _Format] = {
    "f32": _Format("float", "{}", "{}", 4),
    "f16": _Format("unsigned short", "bb_h2f({})", "bb_f2h({})", 2),
    "bf16": _Format("unsigned short", "bb_b2f({})", "bb_f2b({})", 2),
}

_HALF_HELPERS = {
    "f16": """\
__device__ __forceinline__ float bb_h2f(unsigned short h) {
    unsigned int u = ((unsigned int)h & 0x7fffu) << 13;
    const unsigned int e = u & 0x0f800000u;
    u += 0x38000000u;
    float f;
    if (e == 0x0f800000u) {
        f = __uint_as_float(u + 0x38000000u);
    } else if (e == 0u) {
        f = __uint_as_float(u + 0x00800000u) - __uint_as_float(0x38800000u);
    } else {
        f = __uint_as_float(u);
    }
    return __uint_as_float(__float_as_uint(f) | (((unsigned int)h & 0x8000u) << 16));
}

__device__ __forceinline__ unsigned short bb_f2h(float x) {
    unsigned int u = __float_as_uint(x);
    const unsigned int sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    unsigned int h;
    if (u >= 0x47800000u) {
        h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) {
        h = __float_as_uint(__uint_as_float(u) + __uint_as_float(0x3f000000u)) - 0x3f000000u;
    } else {
        h = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
    }
    return (unsigned short)(h | sign);
}
""",
    "bf16": """\
__device__ __forceinline__ float bb_b2f(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ unsigned short bb_f2b(float x) {
    const unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
""",
}


def to_storage(x, dtype: str, xp=np):
    """An array as the kernels store a tensor of `dtype`: f32, f16, or bf16 bits in uint16.

    `xp` is numpy or cupy; bf16 rounds to nearest even, as the kernels' `bb_f2b` does.
    """
    if dtype == "f32":
        return xp.ascontiguousarray(xp.asarray(x, dtype=xp.float32))
    if dtype == "f16":
        return xp.ascontiguousarray(xp.asarray(x, dtype=xp.float16))
    u = xp.ascontiguousarray(xp.asarray(x, dtype=xp.float32)).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16
    quiet_nan = (u >> 16) | xp.uint32(0x40)
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    return xp.where(nan, quiet_nan, rounded).astype(xp.uint16)


def from_storage(x, dtype: str, xp=np):
    """The float32 values of an array stored as `dtype` (the inverse of `to_storage`)."""
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(xp.float32)
    return (x.astype(xp.uint32) << 16).view(xp.float32)


# --------------------------------------------------------------------------------------------
# The result


@dataclass(frozen=True)
class KernelInfo:
    """One `__global__` function and how to launch it."""

    name: str
    tensor: str  # the tensor it stores
    grid: int  # thread blocks: one per grid point
    threads: int  # threads per block (any count up to MAX_THREADS is correct)
    shared_bytes: int  # dynamic shared memory per block
    params: tuple[str, ...]  # tensors passed, in argument order (the stored one first)
    signature: tuple[str, ...]  # the C type of each parameter


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    role: str


@dataclass(frozen=True)
class CudaModule:
    """CUDA C source, a CuPy launcher for it (Python source), and what the launcher knows."""

    source: str
    launcher: str
    kernels: tuple[KernelInfo, ...]
    tensors: dict[str, TensorInfo]
    outputs: tuple[str, ...]

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(n for n, t in self.tensors.items() if t.role == "input")

    def runner(self) -> Callable[..., dict]:
        """The launcher's `run(**inputs)` (needs CuPy and a GPU)."""
        namespace: dict = {}
        exec(compile(self.launcher, "<bbrules cuda launcher>", "exec"), namespace)
        return namespace["run"]


def generate(p: BlockProgram, target: Target | str | None = None) -> CudaModule:
    """CUDA C for every kernel of `p`, refusing kernels whose tiles exceed `target`'s shared
    memory (default: the H100's 227 KiB)."""
    validate(p)
    if target is None or isinstance(target, str):
        target = get_target(target or "h100")
    kernels, bodies, helpers = [], [], set()
    for i, store in enumerate(p.kernels):
        gen = _KernelGen(p, store, f"k{i}_{_c_name(store.tensor)}")
        info, body = gen.emit()
        if info.shared_bytes > target.local_capacity:
            raise UsageError(
                f"kernel {store.tensor}: its tiles need {info.shared_bytes} bytes of shared "
                f"memory, more than the {target.local_capacity} a thread block has on "
                f"{target.name}; choose smaller blocks or a less fused program")
        kernels.append(info)
        bodies.append(body)
        helpers |= gen.formats
    prelude = [f"// Generated by bbrules: {len(kernels)} kernel(s), launched in order.",
               "#define BB_INF __int_as_float(0x7f800000)",
               "#define BB_NAN __int_as_float(0x7fffffff)", ""]
    prelude += [_HALF_HELPERS[f] for f in ("f16", "bf16") if f in helpers]
    source = "\n".join(prelude + bodies)
    tensors = {t.name: TensorInfo(tuple(p.extent(a) for a in t.axes), t.dtype, t.role)
               for t in p.tensors.values()}
    kernels_t = tuple(kernels)
    return CudaModule(source, _launcher(source, kernels_t, tensors, p.outputs), kernels_t,
                      tensors, p.outputs)


def _c_name(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _literal(v: float) -> str:
    v32 = float(np.float32(v))
    if math.isnan(v32):
        return "BB_NAN"
    if math.isinf(v32):
        return "BB_INF" if v32 > 0 else "(-BB_INF)"
    s = repr(v32)
    if "." not in s and "e" not in s:
        s += ".0"
    return f"({s}f)" if v32 < 0 else f"{s}f"


# --------------------------------------------------------------------------------------------
# One kernel: first a model of its steps (what is computed where, what is read where), then
# decisions (inline or materialise, in-place accumulation, shared-memory offsets), then text.


@dataclass(eq=False)
class _Buf:
    """A region of shared memory holding one tile (or scratch), live over [first, last].

    Rows whose length is a multiple of 32 elements are padded by one, so that threads walking
    down a column (a contraction reading K[k, d] for consecutive k) hit different banks.
    """

    elements: int
    order: tuple[str, ...]  # axes of the tile, outermost first
    strides: tuple[int, ...]  # elements between neighbours along each axis of `order`
    first: int
    path: tuple[int, ...]  # the loops enclosing its definition
    half: bool = False  # a 16-bit copy of a 16-bit tensor's tile
    last: int = -1
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.elements * (2 if self.half else 4)


@dataclass(eq=False)
class _Site:
    """A step that evaluates expressions over one iteration space (`shape`)."""

    seq: int
    path: tuple[int, ...]
    shape: frozenset[str]


@dataclass(eq=False)
class _Inst:
    """One computation of a node: a `Compute` step, or a reduction's results after its loop.

    `kind` is load, const, unary, binary, breduce, dot, tuple, get or result.  `mode` says how
    consumers read it: inline (its expression is emitted where it is used), shared, reg,
    accumulate (folded straight into an accumulator), or tuple (never read as a tile).
    """

    kind: str
    node: Node
    args: tuple[_Inst, ...]
    shape: frozenset[str]
    order: tuple[str, ...]
    path: tuple[int, ...]
    seq: int
    uses: list[_Inst | _Site] = field(default_factory=list)
    mode: str = "inline"
    buf: _Buf | None = None
    reg: str = ""
    blocks: dict[str, str] = field(default_factory=dict)  # load: block index per axis
    red: _Red | None = None  # result / get: the reduction whose state it finalizes
    into: tuple[_Red, int] | None = None  # accumulate: the state component it folds into

    @property
    def is_step(self) -> bool:
        return self.mode in ("shared", "reg", "accumulate")

    def site(self) -> _Site:
        space = self.args[0].shape if self.kind == "breduce" else self.shape
        return _Site(self.seq, self.path, space)


@dataclass(eq=False)
class _Red:
    """One reduction of a loop: its contributions, accumulators and combine phases."""

    reduce: Reduce
    monoid: Monoid
    contribs: tuple[_Inst, ...]
    states: tuple[_Buf, ...]
    shapes: tuple[frozenset[str], ...]
    groups: tuple[tuple[int, ...], ...]  # components updated together, in phase order
    via_tmp: bool  # no order works: every component goes through a temporary
    sites: tuple[_Site, ...]  # one per group
    in_place: set[int] = field(default_factory=set)  # components no combine step updates
    aliases: dict[int, _Inst] = field(default_factory=dict)  # components held in these tiles
    tmps: tuple[_Buf, ...] = ()


@dataclass(eq=False)
class _LoopOp:
    loop: Loop
    id: int
    path: tuple[int, ...]  # loops enclosing the loop itself
    start: int
    end: int = -1
    body: list[_Op] = field(default_factory=list)
    reds: tuple[_Red, ...] = ()

    @property
    def var(self) -> str:
        return f"bb_b{self.id}"


_Op = _Inst | _LoopOp


class _Scope:
    """Which instance of a node is visible: loop bodies nest, and a body may recompute a node."""

    def __init__(self, parent: _Scope | None):
        self.parent = parent
        self.bound: dict[Node, _Inst] = {}

    def lookup(self, n: Node) -> _Inst:
        scope: _Scope | None = self
        while scope is not None:
            if n in scope.bound:
                return scope.bound[n]
            scope = scope.parent
        raise IRError(f"internal: no value for {n!r} in scope")


class _Writer:
    """Indented C text."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 1

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    @contextmanager
    def block(self, head: str, brace: bool = True) -> Iterator[None]:
        self(head + " {" if brace else head)
        self.depth += 1
        yield
        self.depth -= 1
        self("}")


@dataclass
class _Elem:
    """The body of a loop over tile elements: coordinate variables and computed temporaries."""

    w: _Writer
    coords: dict[str, str]
    memo: dict[_Inst, str] = field(default_factory=dict)


def _var_names(e: Node) -> set[str]:
    return {n.name for n in postorder(e) if isinstance(n, Var)}


def _same_op(combine: Node, c: str) -> str | None:
    """The operator of a combine `a.c (op) b.c`, if that is what it is."""
    if (isinstance(combine, Binary) and combine.op in ("add", "max", "min")
            and {combine.x, combine.y} == {Var(f"a.{c}"), Var(f"b.{c}")}):
        return combine.op
    return None


_FOLD = {"sum": "add", "max": "max", "min": "min"}
_IDENTITY = {"sum": "0.0f", "max": "(-BB_INF)", "min": "BB_INF"}
_FOLD_IDENTITY = {"add": 0.0, "max": float("-inf"), "min": float("inf")}


class _KernelGen:
    """One kernel: the model of its schedule is built in __init__, `emit` writes the text.

    Every `Compute` step becomes an `_Inst` and every `Loop` a `_LoopOp`, numbered in execution
    order (`seq`) with the loops enclosing them (`path`); uses are recorded as they are
    resolved.  From those the generator decides what to materialise (`_decide`) and where each
    tile lives in shared memory (`_allocate`), before a line of C is written.
    """

    def __init__(self, p: BlockProgram, store: Store, name: str):
        self.p = p
        self.store = store
        self.name = name
        self.trips = {a: d.blocks for a, d in p.dims.items()}
        self.dim_order = list(p.dims)
        self.seq = 0
        self.insts: list[_Inst] = []
        self.loops: list[_LoopOp] = []
        self.bufs: list[_Buf] = []
        self.temps: dict[_Inst, _Buf] = {}  # scratch of one contraction step
        self.formats: set[str] = set()  # 16-bit storage formats whose converters it needs
        self.counter = 0  # for fresh C names
        self.dirty = False  # while emitting: has a register step read shared memory since
        # the last barrier?
        self.blocks = {a: f"bb_g_{_c_name(a)}" for a in store.axes}
        schedule = schedule_kernel(store, self.trips)
        top = _Scope(None)
        self.ops = self._build(schedule.body, top, ())
        self.value = top.lookup(store.value)
        self.store_site = _Site(self._next(), (), frozenset(store.axes))
        self.value.uses.append(self.store_site)
        self._decide()
        self.threads = self._threads()
        self._allocate()

    # -- the model

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _order(self, axes: frozenset[str]) -> tuple[str, ...]:
        return tuple(a for a in self.dim_order if a in axes)

    def _build(self, steps: tuple[Step, ...], scope: _Scope, path: tuple[int, ...]) -> list[_Op]:
        ops: list[_Op] = []
        for step in steps:
            if isinstance(step, Compute):
                made = len(self.insts)
                inst = self._inst(step.node, scope, path)
                scope.bound[step.node] = inst
                if len(self.insts) > made:
                    ops.append(inst)
            else:
                ops.append(self._loop(step, scope, path))
                for red in ops[-1].reds:
                    result = self._result(red, path)
                    scope.bound[red.reduce] = result
                    ops.append(result)
        return ops

    def _new(self, kind: str, n: Node, args: tuple[_Inst, ...], sh: frozenset[str],
             path: tuple[int, ...], **kw) -> _Inst:
        inst = _Inst(kind, n, args, sh, self._order(sh), path, self._next(), **kw)
        for a in args:
            a.uses.append(inst)
        self.insts.append(inst)
        return inst

    def _inst(self, n: Node, scope: _Scope, path: tuple[int, ...]) -> _Inst:
        match n:
            case Load(_, axes):
                blocks = {a: self.blocks.get(a, "0") for a in axes}
                for a, b in blocks.items():
                    if b == "0" and self.trips[a] != 1:
                        raise IRError(f"internal: load {n!r} outside every loop over '{a}'")
                inst = self._new("load", n, (), frozenset(axes), path, blocks=blocks)
                inst.order = axes
                return inst
            case Const():
                return _Inst("const", n, (), frozenset(), (), path, 0)
            case Get(i, x):
                base = scope.lookup(x)
                if base.kind == "tuple":
                    return base.args[i]
                return self._new("get", n, (base,), shape(n), path, red=base.red)
            case Tuple(items):
                return _Inst("tuple", n, tuple(scope.lookup(i) for i in items), frozenset(), (),
                             path, 0, mode="tuple")
        kind = {Unary: "unary", Binary: "binary", BlockReduce: "breduce", Dot: "dot"}[type(n)]
        args = tuple(scope.lookup(c) for c in ((n.x,) if isinstance(n, (Unary, BlockReduce))
                                               else (n.x, n.y)))
        return self._new(kind, n, args, shape(n), path)

    def _loop(self, loop: Loop, scope: _Scope, path: tuple[int, ...]) -> _LoopOp:
        op = _LoopOp(loop, len(self.loops), path, self._next())
        self.loops.append(op)
        inner = _Scope(scope)
        saved = self.blocks.get(loop.axis)
        self.blocks[loop.axis] = op.var
        op.body = self._build(loop.body, inner, path + (op.id,))
        if saved is None:
            del self.blocks[loop.axis]
        else:
            self.blocks[loop.axis] = saved
        op.end = self._next()
        op.reds = tuple(self._red(r, inner, op) for r in loop.reduces)
        for red in op.reds:
            self._accumulate_in_place(red, op)
        return op

    def _red(self, r: Reduce, scope: _Scope, op: _LoopOp) -> _Red:
        m = r.monoid
        body = scope.lookup(r.x)
        contribs = body.args if body.kind == "tuple" else (body,)
        shapes = tuple(c.shape for c in contribs)
        states = tuple(self._buf(s, op.start, op.path) for s in shapes)
        groups, via_tmp = self._phases(m, shapes)
        body_path = op.path + (op.id,)
        sites = tuple(_Site(op.end, body_path, shapes[g[0]]) for g in groups)
        for g, site in zip(groups, sites):
            for c in g:
                for v in sorted(_var_names(m.combine[c])):
                    side, comp = v.split(".", 1)
                    j = m.state.index(comp)
                    if not shapes[j] <= shapes[c]:
                        raise IRError(f"monoid {m.name}: the combine of '{m.state[c]}' reads "
                                      f"'{v}', whose tile is larger")
                    if side == "b":
                        contribs[j].uses.append(site)
        red = _Red(r, m, contribs, states, shapes, groups, via_tmp, sites)
        if via_tmp:
            red.tmps = tuple(self._buf(s, op.end, body_path) for s in shapes)
        return red

    def _phases(self, m: Monoid, shapes: tuple[frozenset[str], ...]
                ) -> tuple[tuple[tuple[int, ...], ...], bool]:
        """Groups of components that may be updated in place, in an order that lets every
        group read the old state it needs; (one group per component, True) if none exists."""
        groups: dict[frozenset[str], list[int]] = {}
        for c, s in enumerate(shapes):
            groups.setdefault(s, []).append(c)
        keys = list(groups)
        reads = {k: {shapes[m.state.index(v[2:])] for c in groups[k]
                     for v in _var_names(m.combine[c]) if v.startswith("a.")} - {k}
                 for k in keys}
        ordered: list[frozenset[str]] = []
        while len(ordered) < len(keys):
            # a group may run once no group still to run needs its old state
            ready = [k for k in keys if k not in ordered
                     and not any(k in reads[o] for o in keys if o not in ordered and o != k)]
            if not ready:
                return tuple((c,) for c in range(len(shapes))), True
            ordered.append(ready[0])
        return tuple(tuple(groups[k]) for k in ordered), False

    def _accumulate_in_place(self, red: _Red, op: _LoopOp) -> None:
        """Fold a dot / in-tile reduction straight into its accumulator where that is exact.

        In the loop body it accumulates in place.  Before a loop of one trip (the lowering's
        `reduce(d, sum, dot(d, ...))` over a single block), the state after the loop is the
        contribution itself, so the contribution's tile becomes the accumulator.
        """
        m = red.monoid
        for c, x in enumerate(red.contribs):
            fold = _same_op(m.combine[c], m.state[c])
            if (red.via_tmp or fold is None or len(x.uses) != 1
                    or x.kind not in ("dot", "breduce")
                    or fold != ("add" if x.kind == "dot" else _FOLD[x.node.op])
                    or any(f"a.{m.state[c]}" in _var_names(e)
                           for j, e in enumerate(m.combine) if j != c)):
                continue
            if x.path == op.path + (op.id,):
                x.mode = "accumulate"
                x.into = (red, c)
                red.in_place.add(c)
            elif (self.trips[op.loop.axis] == 1
                  and m.identity[c] == Const(_FOLD_IDENTITY[fold])):
                red.in_place.add(c)
                red.aliases[c] = x

    def _result(self, red: _Red, path: tuple[int, ...]) -> _Inst:
        """The reduction's value after its loop: one tile, or a tuple read through `get`."""
        if len(red.monoid.finalize) == 1:
            return self._new("result", red.reduce, (), shape(red.reduce), path, red=red)
        return self._new("result", red.reduce, (), frozenset(), path, red=red, mode="tuple")

    def _buf(self, sh: frozenset[str], first: int, path: tuple[int, ...],
             order: tuple[str, ...] | None = None, half: bool = False) -> _Buf:
        order = self._order(sh) if order is None else order
        sizes = [self.p.block(a) for a in order]
        strides = [1] * len(order)
        for j in range(len(order) - 2, -1, -1):
            row = strides[j + 1] * sizes[j + 1]
            strides[j] = row + 1 if j == len(order) - 2 and row % 32 == 0 else row
        elements = strides[0] * sizes[0] if order else 1
        buf = _Buf(elements, order, tuple(strides), first, path, half)
        self.bufs.append(buf)
        return buf

    # -- decisions

    def _trivial(self, x: _Inst) -> bool:
        """A reduction result that is one accumulator as it stands: reading it is a load."""
        if x.kind not in ("result", "get") or x.red is None:
            return False
        i = x.node.index if x.kind == "get" else 0
        return isinstance(x.red.monoid.finalize[i], Var)

    def _sites(self, x: _Inst) -> list[_Site]:
        """The steps that evaluate `x`'s expression if it is inline."""
        out: list[_Site] = []
        for u in x.uses:
            if isinstance(u, _Site):
                sites = [u]
            elif u.is_step or u.kind in ("breduce", "dot"):
                sites = [u.site()]
            else:
                sites = self._sites(u)
            out += [s for s in sites if all(s is not o for o in out)]
        return out

    def _decide(self) -> None:
        for x in reversed(self.insts):
            if x.mode in ("tuple", "accumulate"):
                continue
            if x.kind in ("breduce", "dot"):
                x.mode = "shared"
                continue
            if self._trivial(x):
                continue
            sites = self._sites(x)
            inline = (not any(isinstance(u, _Inst) and u.kind == "dot" for u in x.uses)
                      and len(sites) <= 1
                      and all(s.shape == x.shape and s.path == x.path for s in sites))
            if not inline:
                x.mode = "shared" if x.shape else "reg"

    # -- shared memory

    def _underlying(self, x: _Inst) -> list[_Buf]:
        """The buffers read when `x` is read."""
        if x.mode == "shared":
            return [x.buf]
        if x.mode in ("reg", "accumulate") or x.kind == "const":
            return []
        if x.kind in ("result", "get"):
            return list(x.red.states)
        return [b for a in x.args for b in self._underlying(a)]

    def _touch(self, bufs: list[_Buf], seq: int, path: tuple[int, ...]) -> None:
        for b in bufs:
            at = seq
            if len(path) > len(b.path):  # read inside a loop nested in b's body: live to its end
                at = self.loops[path[len(b.path)]].end
            b.last = max(b.last, at)

    def _allocate(self) -> None:
        for x in self.insts:
            if x.mode == "shared":
                half = x.kind == "load" and self.p.tensors[x.node.tensor].itemsize == 2
                x.buf = self._buf(x.shape, x.seq, x.path, x.order, half)
        for op in self.loops:
            for red in op.reds:
                for c, x in red.aliases.items():
                    self.bufs.remove(red.states[c])
                red.states = tuple(red.aliases[c].buf if c in red.aliases else b
                                   for c, b in enumerate(red.states))
        for x in self.insts:
            if x.mode in ("shared", "reg", "accumulate"):
                reads = list(x.red.states) if x.kind == "result" else \
                    [b for a in x.args for b in self._underlying(a)]
                if x.into is not None:
                    reads.append(x.into[0].states[x.into[1]])
                self._touch(reads, x.seq, x.path)
            if x.mode in ("shared", "accumulate") and x.kind in ("breduce", "dot"):
                # partial results of threads sharing an output element: as many as the launch
                # has threads (a larger launch splits less, see _contract)
                out = math.prod(self.p.block(a) for a in x.shape)
                space = out * self.p.block(x.node.axis)
                if out < self.threads and space > out:
                    scratch = _Buf(min(self.threads, space), (), (), x.seq, x.path,
                                   last=x.seq)
                    self.bufs.append(scratch)
                    self.temps[x] = scratch
        for op in self.loops:
            for red in op.reds:
                for g, site in zip(red.groups, red.sites):
                    comps = [c for c in g if c not in red.in_place]
                    state = red.monoid.state
                    reads = [b for c in comps for v in _var_names(red.monoid.combine[c])
                             if v.startswith("b.")
                             for b in self._underlying(red.contribs[state.index(v[2:])])]
                    self._touch(reads + list(red.states), site.seq, site.path)
                for t in red.tmps:
                    t.last = t.first
        self._touch(self._underlying(self.value), self.store_site.seq, ())
        self.shared_bytes = _assign_offsets(self.bufs)

    # -- text

    def emit(self) -> tuple[KernelInfo, str]:
        params = [self.store.tensor] + list(dict.fromkeys(
            x.node.tensor for x in self.insts if x.kind == "load"
            and x.node.tensor != self.store.tensor))
        signature = []
        for t in params:
            fmt = FORMATS[self.p.tensors[t].dtype]
            if fmt is not FORMATS["f32"]:
                self.formats.add(self.p.tensors[t].dtype)
            signature.append(fmt.ctype + "*" if t == self.store.tensor
                             else f"const {fmt.ctype}*")
        w = _Writer()
        w("const int bb_tid = threadIdx.x;")
        w("const int bb_nthr = blockDim.x;")
        if self.shared_bytes:
            w("extern __shared__ float bb_smem[];")
        if any(b.half for b in self.bufs):
            w("unsigned short* bb_smem16 = reinterpret_cast<unsigned short*>(bb_smem);")
        self._decode_grid(w)
        self._ops(w, self.ops)
        self._store(w)
        args = ", ".join(f"{ct} __restrict__ g_{_c_name(t)}" for t, ct in zip(params, signature))
        text = "\n".join([f'extern "C" __global__ void __launch_bounds__({MAX_THREADS}) '
                          f"{self.name}({args}) {{", *w.lines, "}", ""])
        grid = math.prod(self.trips[a] for a in self.store.axes)
        info = KernelInfo(self.name, self.store.tensor, grid, self.threads,
                          self.shared_bytes, tuple(params), tuple(signature))
        return info, text

    def _threads(self) -> int:
        """Enough threads for the largest iteration space, in whole warps, at most MAX_THREADS."""
        spaces = [math.prod(self.p.block(a) for a in self.store.axes)]
        for x in self.insts:
            spaces.append(math.prod(self.p.block(a) for a in x.shape))
            if x.kind in ("breduce", "dot"):
                spaces[-1] *= self.p.block(x.node.axis)
        return max(32, min(MAX_THREADS, -(-max(spaces) // 32) * 32))

    def _decode_grid(self, w: _Writer) -> None:
        axes = tuple(a for a in self.store.axes if self.trips[a] > 1)
        for a in self.store.axes:
            if self.trips[a] == 1:
                w(f"const int {self.blocks[a]} = 0;")
        if len(axes) == 1:
            w(f"const int {self.blocks[axes[0]]} = blockIdx.x;")
            return
        if axes:
            w("int bb_rest = blockIdx.x;")
        for i, a in enumerate(reversed(axes)):
            if i == len(axes) - 1:
                w(f"const int {self.blocks[a]} = bb_rest;")
            else:
                w(f"const int {self.blocks[a]} = bb_rest % {self.trips[a]};")
                w(f"bb_rest /= {self.trips[a]};")

    def _fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def _barrier(self, w: _Writer) -> None:
        w("__syncthreads();")
        self.dirty = False

    def _before_write(self, w: _Writer) -> None:
        """A register step may still be reading storage this write reuses: wait for it."""
        if self.dirty:
            self._barrier(w)

    def _ops(self, w: _Writer, ops: list[_Op]) -> None:
        for op in ops:
            if isinstance(op, _LoopOp):
                self._loop_text(w, op)
            elif op.mode == "reg":
                op.reg = self._fresh("r")
                e = _Elem(w, {})
                w(f"const float {op.reg} = {self._compute(op, e)};")
                self.dirty = True
            elif op.kind in ("breduce", "dot"):
                self._contract(w, op)
            elif op.mode == "shared":
                self._before_write(w)
                self._each(w, op.buf.order, lambda e, x=op: self._materialise(x, e))
                self._barrier(w)

    def _materialise(self, x: _Inst, e: _Elem) -> None:
        if x.buf.half:
            e.w(f"{self._at(x.buf, e.coords)} = {self._global(x, e.coords)};")
        else:
            e.w(f"{self._at(x.buf, e.coords)} = {self._compute(x, e)};")

    def _each(self, w: _Writer, order: tuple[str, ...], body: Callable[[_Elem], None]) -> None:
        """A strided loop of the threads over the elements of a tile with axes `order`."""
        size = math.prod(self.p.block(a) for a in order)
        with w.block(f"for (int bb_i = bb_tid; bb_i < {size}; bb_i += bb_nthr)"):
            body(_Elem(w, self._decode(w, order, "bb_i")))

    def _decode(self, w: _Writer, order: tuple[str, ...], var: str) -> dict[str, str]:
        coords = {}
        sizes = [self.p.block(a) for a in order]
        for j, a in enumerate(order):
            inner = math.prod(sizes[j + 1:])
            expr = var if inner == 1 else f"{var} / {inner}"
            if sizes[j] == 1:
                expr = "0"
            elif j > 0:
                expr = f"({expr}) % {sizes[j]}"
            name = f"e_{_c_name(a)}"
            w(f"const int {name} = {expr};")
            coords[a] = name
        return coords

    def _at(self, buf: _Buf, coords: dict[str, str]) -> str:
        index = " + ".join(coords[a] if stride == 1 else f"{coords[a]} * {stride}"
                           for a, stride in zip(buf.order, buf.strides)) or "0"
        if buf.half:
            return f"bb_smem16[{buf.offset // 2} + {index}]"
        return f"bb_smem[{buf.offset // 4} + {index}]"

    def _global_offset(self, tensor: str, axes: tuple[str, ...], blocks: dict[str, str],
                       coords: dict[str, str]) -> str:
        decl = self.p.tensors[tensor]
        extents = [self.p.extent(a) for a in decl.axes]
        wide = "(long long)" if math.prod(extents) >= 2**31 else ""  # offsets past int range
        terms = []
        for j, a in enumerate(axes):
            stride = math.prod(extents[j + 1:])
            pos = coords[a] if blocks[a] == "0" else \
                f"{blocks[a]} * {self.p.block(a)} + {coords[a]}"
            terms.append(pos if stride == 1 else f"{wide}({pos}) * {stride}")
        return " + ".join(terms) or "0"

    def _global(self, x: _Inst, coords: dict[str, str]) -> str:
        load = x.node
        offset = self._global_offset(load.tensor, load.axes, x.blocks, coords)
        return f"g_{_c_name(load.tensor)}[{offset}]"

    def _val(self, x: _Inst, e: _Elem) -> str:
        """An expression for element `e.coords` of `x`, emitting temporaries into `e`."""
        if x.kind == "const":
            return _literal(x.node.value)
        if x.mode == "shared":
            if x.buf.half:
                return FORMATS[self.p.tensors[x.node.tensor].dtype].to_float.format(
                    self._at(x.buf, e.coords))
            return self._at(x.buf, e.coords)
        if x.mode == "reg":
            return x.reg
        if x not in e.memo:
            name = self._fresh("v")
            e.w(f"const float {name} = {self._compute(x, e)};")
            e.memo[x] = name
        return e.memo[x]

    def _compute(self, x: _Inst, e: _Elem) -> str:
        """The expression of `x`'s own operation on its (possibly materialised) operands."""
        match x.kind:
            case "load":
                dtype = self.p.tensors[x.node.tensor].dtype
                return FORMATS[dtype].to_float.format(self._global(x, e.coords))
            case "unary":
                return UNARY[x.node.op].cuda.format(x=self._val(x.args[0], e))
            case "binary":
                return BINARY[x.node.op].cuda.format(x=self._val(x.args[0], e),
                                                     y=self._val(x.args[1], e))
            case "result" | "get":
                red = x.red
                i = x.node.index if x.kind == "get" else 0
                env = {c: (lambda b=b: self._at(b, e.coords))
                       for c, b in zip(red.monoid.state, red.states)}
                return self._expr(red.monoid.finalize[i], env)
        raise IRError(f"internal: cannot compute {x.kind} inline")

    def _expr(self, n: Node, env: dict[str, Callable[[], str]]) -> str:
        """A monoid expression (elementwise over Vars) as C."""
        match n:
            case Var(name):
                return env[name]()
            case Const(v):
                return _literal(v)
            case Unary(op, x):
                return UNARY[op].cuda.format(x=self._expr(x, env))
            case Binary(op, x, y):
                return BINARY[op].cuda.format(x=self._expr(x, env), y=self._expr(y, env))
        raise IRError(f"monoid expressions must be elementwise, found {n!r}")

    def _contract(self, w: _Writer, x: _Inst) -> None:
        """An in-tile reduction or a contraction, the reduced axis split over spare threads.

        With more threads than output elements, `bb_p` threads share each output element: each
        folds every `bb_p`-th element of the reduced axis, and one of them folds the partial
        results.  The split is capped by the scratch space, so any thread count is correct.
        """
        axis = x.node.axis
        k = self.p.block(axis)
        n_out = math.prod(self.p.block(a) for a in x.shape)
        kvar = f"e_{_c_name(axis)}"
        if x.kind == "dot":
            fold, ident = BINARY["add"].cuda, "0.0f"
        else:
            fold, ident = TILE_REDUCE[x.node.op].cuda, _IDENTITY[x.node.op]
        out = x.buf if x.into is None else x.into[0].states[x.into[1]]

        def write(coords: dict[str, str]) -> None:
            target = self._at(out, coords)
            w(f"{target} = {fold.format(x=target, y='bb_acc') if x.into else 'bb_acc'};")

        def partial(part: str, parts: str) -> dict[str, str]:
            """Fold one share of the reduced axis into bb_acc; the output coordinates."""
            coords = self._decode(w, x.order, "bb_o")
            w(f"float bb_acc = {ident};")
            with w.block(f"for (int {kvar} = {part}; {kvar} < {k}; {kvar} += {parts})"):
                e = _Elem(w, {**coords, axis: kvar})
                term = self._val(x.args[0], e)
                if x.kind == "dot":
                    term = f"{term} * {self._val(x.args[1], e)}"
                w(f"bb_acc = {fold.format(x='bb_acc', y=term)};")
            return coords

        self._before_write(w)
        scratch = self.temps.get(x)
        micro = self._micro_tile(x) if x.kind == "dot" and scratch is None else None
        if micro is not None:
            self._dot_tiled(w, x, out, micro)
            self._barrier(w)
            return
        if scratch is None:
            with w.block(f"for (int bb_o = bb_tid; bb_o < {n_out}; bb_o += bb_nthr)"):
                write(partial("0", "1"))
            self._barrier(w)
            return
        cap, base = scratch.elements // n_out, scratch.offset // 4
        with w.block("{", brace=False):
            w(f"int bb_p = bb_nthr / {n_out};")
            w(f"bb_p = bb_p < {min(k, cap)} ? bb_p : {min(k, cap)};")
            w("bb_p = bb_p > 0 ? bb_p : 1;")
            with w.block(f"for (int bb_i = bb_tid; bb_i < {n_out} * bb_p; bb_i += bb_nthr)"):
                if n_out > 1:
                    w("const int bb_o = bb_i / bb_p;")
                coords = partial("bb_i % bb_p", "bb_p")
                with w.block("if (bb_p == 1)"):
                    write(coords)
                with w.block("else"):
                    w(f"bb_smem[{base} + bb_i] = bb_acc;")
            with w.block("if (bb_p > 1)"):
                w("__syncthreads();")
                with w.block(f"for (int bb_o = bb_tid; bb_o < {n_out}; bb_o += bb_nthr)"):
                    w(f"float bb_acc = bb_smem[{base} + bb_o * bb_p];")
                    with w.block("for (int bb_j = 1; bb_j < bb_p; ++bb_j)"):
                        part = f"bb_smem[{base} + bb_o * bb_p + bb_j]"
                        w(f"bb_acc = {fold.format(x='bb_acc', y=part)};")
                    write(self._decode(w, x.order, "bb_o"))
        self._barrier(w)

    def _micro_tile(self, x: _Inst) -> tuple[int, int] | None:
        """Outputs per thread along the first and last axes of a dot's tile, or None.

        A thread computing ri x rj outputs loads ri + rj operand elements per step of the
        contraction instead of 2 x ri x rj.  The largest micro-tile that divides the tile and
        still gives every thread of the launch one is chosen.
        """
        order = x.order
        first, last = (self.p.block(order[0]), self.p.block(order[-1])) if len(order) > 1 \
            else (1, self.p.block(order[0]) if order else 1)
        n_out = math.prod(self.p.block(a) for a in order)
        options = [(ri, rj) for ri in (4, 2, 1) for rj in (4, 2, 1)
                   if first % ri == 0 and last % rj == 0 and ri * rj > 1
                   and n_out // (ri * rj) >= self.threads]
        return max(options, key=lambda r: (r[0] * r[1], r[1]), default=None)

    def _dot_tiled(self, w: _Writer, x: _Inst, out: _Buf, micro: tuple[int, int]) -> None:
        """A dot in which every thread accumulates a ri x rj micro-tile in registers.

        A thread's outputs are interleaved (i + r * blocks/ri), so neighbouring threads still
        read neighbouring elements.
        """
        ri, rj = micro
        order, axis = x.order, x.node.axis
        i_ax, j_ax = (order[0], order[-1]) if len(order) > 1 else (None, order[0])
        steps = {a: self.p.block(a) // (ri if a == i_ax else rj if a == j_ax else 1)
                 for a in order}
        n_tiles = math.prod(steps.values())
        kvar = f"e_{_c_name(axis)}"
        with w.block(f"for (int bb_t = bb_tid; bb_t < {n_tiles}; bb_t += bb_nthr)"):
            base: dict[str, str] = {}
            for j, a in enumerate(order):
                inner = math.prod(steps[b] for b in order[j + 1:])
                expr = "bb_t" if inner == 1 else f"bb_t / {inner}"
                if j > 0:
                    expr = f"({expr}) % {steps[a]}"
                base[a] = "0" if steps[a] == 1 else expr
            for a in order:
                if a not in (i_ax, j_ax):
                    w(f"const int e_{_c_name(a)} = {base[a]};")
            cells = [(p, q) for p in range(ri) for q in range(rj)]

            def coords(p: int, q: int) -> dict[str, str]:
                c = {a: f"e_{_c_name(a)}" for a in order if a not in (i_ax, j_ax)}
                if i_ax is not None:
                    c[i_ax] = f"e_{_c_name(i_ax)}_{p}"
                c[j_ax] = f"e_{_c_name(j_ax)}_{q}"
                return c

            for r in range(ri if i_ax is not None else 0):
                w(f"const int e_{_c_name(i_ax)}_{r} = {base[i_ax]} + {r * steps[i_ax]};")
            for r in range(rj):
                w(f"const int e_{_c_name(j_ax)}_{r} = {base[j_ax]} + {r * steps[j_ax]};")
            for p, q in cells:
                w(f"float bb_acc_{p}_{q} = 0.0f;")
            with w.block(f"for (int {kvar} = 0; {kvar} < {self.p.block(axis)}; ++{kvar})"):
                for p, q in cells:
                    e = _Elem(w, {**coords(p, q), axis: kvar})
                    product = f"{self._val(x.args[0], e)} * {self._val(x.args[1], e)}"
                    w(f"bb_acc_{p}_{q} += {product};")
            for p, q in cells:
                target = self._at(out, coords(p, q))
                value = f"{target} + bb_acc_{p}_{q}" if x.into else f"bb_acc_{p}_{q}"
                w(f"{target} = {value};")

    def _loop_text(self, w: _Writer, op: _LoopOp) -> None:
        inits = [(ident, buf) for red in op.reds
                 for c, (ident, buf) in enumerate(zip(red.monoid.identity, red.states))
                 if c not in red.aliases]
        if inits:
            self._before_write(w)
            for ident, buf in inits:
                self._each(w, buf.order,
                           lambda e, b=buf, i=ident: e.w(f"{self._at(b, e.coords)} = "
                                                         f"{self._expr(i, {})};"))
            self._barrier(w)
        if not self._has_work(op):
            return
        with w.block(f"for (int {op.var} = 0; {op.var} < {self.trips[op.loop.axis]}; "
                     f"++{op.var})"):
            self._ops(w, op.body)
            for red in op.reds:
                self._combine(w, red)
            if self.dirty:
                self._barrier(w)

    def _has_work(self, op: _LoopOp) -> bool:
        """Does the loop's body do anything (a one-trip loop over aliased tiles does not)?"""
        return any(len(red.in_place) < red.monoid.arity for red in op.reds) or any(
            isinstance(o, _LoopOp) or o.mode in ("shared", "reg", "accumulate")
            for o in op.body)

    def _combine(self, w: _Writer, red: _Red) -> None:
        """Fold one iteration's contributions into a reduction's state, group by group (see
        `_phases`), or through temporaries when the groups cannot be ordered."""
        m = red.monoid
        targets = red.tmps if red.via_tmp else red.states
        for g in red.groups:
            comps = [c for c in g if c not in red.in_place]
            if not comps:
                continue
            self._before_write(w)

            def update(e: _Elem, comps: list[int] = comps) -> None:
                env: dict[str, Callable[[], str]] = {}
                for j, (c, buf) in enumerate(zip(m.state, red.states)):
                    env[f"a.{c}"] = lambda b=buf: self._at(b, e.coords)
                    env[f"b.{c}"] = lambda x=red.contribs[j]: self._val(x, e)
                news = []
                for c in comps:
                    news.append(self._fresh("bb_n"))
                    e.w(f"const float {news[-1]} = {self._expr(m.combine[c], env)};")
                for c, new in zip(comps, news):
                    e.w(f"{self._at(targets[c], e.coords)} = {new};")

            self._each(w, red.states[comps[0]].order, update)
            self._barrier(w)
        if red.via_tmp:
            for tmp, state in zip(red.tmps, red.states):
                self._each(w, state.order, lambda e, t=tmp, s=state:
                           e.w(f"{self._at(s, e.coords)} = {self._at(t, e.coords)};"))
            self._barrier(w)

    def _store(self, w: _Writer) -> None:
        s = self.store
        fmt = FORMATS[self.p.tensors[s.tensor].dtype]
        blocks = {a: self.blocks[a] for a in s.axes}

        def write(e: _Elem) -> None:
            offset = self._global_offset(s.tensor, s.axes, blocks, e.coords)
            target = f"g_{_c_name(s.tensor)}[{offset}]"
            e.w(f"{target} = {fmt.from_float.format(self._val(self.value, e))};")

        self._each(w, s.axes, write)


def _assign_offsets(bufs: list[_Buf]) -> int:
    """Shared-memory offsets by liveness (first fit, in definition order); the bytes needed."""
    events: dict[int, tuple[list[_Buf], list[_Buf]]] = {}
    for b in bufs:
        b.last = max(b.last, b.first)
        events.setdefault(b.first, ([], []))[0].append(b)
        events.setdefault(b.last, ([], []))[1].append(b)
    live: list[_Buf] = []
    peak = 0
    for seq in sorted(events):
        born, dying = events[seq]
        for b in born:
            size = -(-b.nbytes // _ALIGN) * _ALIGN
            offset = 0
            for other in sorted(live, key=lambda o: o.offset):
                if offset + size <= other.offset:
                    break
                offset = max(offset, other.offset + -(-other.nbytes // _ALIGN) * _ALIGN)
            b.offset = offset
            live.append(b)
            peak = max(peak, offset + size)
        for b in dying:
            live.remove(b)
    return peak


# --------------------------------------------------------------------------------------------
# The CuPy launcher


_LAUNCHER = '''\
"""CuPy launcher for a bbrules program (generated): compiles the kernels once, allocates every
stored tensor, and launches the kernels in order."""

import cupy as cp

SOURCE = {source!r}

# name -> (shape, dtype, role)
TENSORS = {tensors!r}
OUTPUTS = {outputs!r}
# (function, grid, threads per block, dynamic shared memory bytes, tensor arguments)
KERNELS = {kernels!r}

_functions = {{}}


{to_storage}

{from_storage}

def _function(name, shared_bytes):
    if name not in _functions:
        if not _functions:
            _functions["__module__"] = cp.RawModule(code=SOURCE)
        fn = _functions["__module__"].get_function(name)
        if shared_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = shared_bytes
        _functions[name] = fn
    return _functions[name]


def run(**inputs):
    """Run the program on `inputs` (arrays by tensor name); every stored tensor, as float32
    (float16 for f16 tensors)."""
    memory = {{}}
    for name, (shape, dtype, role) in TENSORS.items():
        if role == "input":
            if name not in inputs:
                raise ValueError(f"missing input '{{name}}'")
            x = to_storage(inputs[name], dtype, cp)
            if x.shape != shape:
                raise ValueError(f"input '{{name}}' has shape {{x.shape}}, expected {{shape}}")
            memory[name] = x
    for name, grid, threads, shared_bytes, params in KERNELS:
        for t in params:
            if t not in memory:
                shape, dtype, _ = TENSORS[t]
                memory[t] = cp.empty(shape, dtype=cp.float32 if dtype == "f32" else
                                     cp.float16 if dtype == "f16" else cp.uint16)
        _function(name, shared_bytes)((grid,), (threads,), tuple(memory[t] for t in params),
                                      shared_mem=shared_bytes)
    stored = dict.fromkeys(k[4][0] for k in KERNELS)
    return {{t: memory[t] if TENSORS[t][1] == "f16" else from_storage(memory[t], TENSORS[t][1], cp)
            for t in stored}}
'''


def _launcher(source: str, kernels: tuple[KernelInfo, ...], tensors: dict[str, TensorInfo],
              outputs: tuple[str, ...]) -> str:
    return _LAUNCHER.format(
        source=source,
        tensors={n: (t.shape, t.dtype, t.role) for n, t in tensors.items()},
        outputs=outputs,
        kernels=[(k.name, k.grid, k.threads, k.shared_bytes, k.params) for k in kernels],
        to_storage=inspect.getsource(to_storage).replace("xp=np", "xp=cp"),
        from_storage=inspect.getsource(from_storage).replace("xp=np", "xp=cp"))


# --------------------------------------------------------------------------------------------
# nvcc


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel.  Tiles live in dynamic shared memory, which ptxas
    cannot see: their size is `KernelInfo.shared_bytes`."""

    registers: int
    static_shared_bytes: int
    stack_bytes: int
    spill_bytes: int


class CompileError(Exception):
    """nvcc rejected the source (or warned: generated code must compile cleanly)."""


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_check(source: str, arch: str = "sm_90") -> dict[str, KernelResources]:
    """Compile `source` to a cubin with nvcc, treating warnings as errors; ptxas's resource
    usage per kernel.  Raises `UsageError` without nvcc, `CompileError` with nvcc's message."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise UsageError("nvcc is not on PATH: cannot compile CUDA source")
    with tempfile.TemporaryDirectory(prefix="bbrules-nvcc-") as tmp:
        cu = Path(tmp) / "kernels.cu"
        cu.write_text(source)
        proc = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "--resource-usage",
                               "-Werror", "all-warnings", "-o", str(Path(tmp) / "kernels.cubin"),
                               str(cu)], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed:\n{log.strip()}")
    out: dict[str, KernelResources] = {}
    name = None
    frame = (0, 0, 0)
    for line in log.splitlines():
        if (m := _ENTRY.search(line)) is not None:
            name = m.group(1)
        elif (m := _FRAME.search(line)) is not None:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) is not None and name is not None:
            smem = _SMEM.search(line)
            out[name] = KernelResources(int(m.group(1)), int(smem.group(1)) if smem else 0,
                                        frame[0], frame[1] + frame[2])
            name, frame = None, (0, 0, 0)
    return out
