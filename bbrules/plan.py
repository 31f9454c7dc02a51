"""The plan of one kernel: its loops, its buffers, and where each buffer lives.

The cost model prices a kernel's local footprint and the code generators allocate its local
memory; both read this plan, so the footprint the model calls legal is exactly what a generated
kernel allocates, and nothing else decides loops, buffers or placement.

What the plan decides, in order:

- *Loops*: `bbrules.schedule` places every node and merges sibling loops.  Every `Compute` step
  becomes a `Value`, every `Loop` (a reduction's or a map loop) a `LoopPlan` and every `Write`
  a `WritePlan`, numbered in execution order (`seq`) with the loops enclosing them (`path`);
  each value records who reads it (`uses`).
- *Skipping*: a reduction loop whose reductions all contribute their identity outside one
  predicate over positions (`masking.skip_predicate`) records it (`LoopPlan.skip`) with the
  block index of each axis it reads; the cost model counts only the blocks it may hold on and
  the CUDA backend does not visit the others.
- *Residency*: a load of a program input inside a loop over an axis it does not depend on would
  be re-read every iteration.  Its slab (the tile over all non-grid axes: everything one grid
  point reads of it) is instead loaded once and kept for the whole kernel, admitted in
  execution order while the slabs total at most `RESIDENT_SHARE` of local capacity, so resident
  data never crowds out the tiles the kernel computes with.  Temporaries are never resident.
- *In-place accumulation*: a contraction or in-tile reduction folded only into an accumulator
  of the same operator (`a.c + b.c` for a dot) adds straight into it and has no tile of its
  own; one computed before a loop of one trip (the lowering's `reduce(d, sum, dot(d, ...))`
  over a single block) *is* the accumulator.
- *Inlining*: a value evaluated by exactly one step, over exactly its own tile, in the loop
  body it is placed in, has no buffer: its expression is computed inside that step (a chain
  like `exp(S - M) / L` is one pass).  Anything else -- an operand of a contraction, a value
  read by several steps, broadcast to a larger tile, read inside a deeper loop -- is
  materialised once, in local memory, or in a register if it is a scalar.  Every loaded tile
  is materialised (a copy in local memory, 16-bit tiles staying 16-bit), and so is every
  contraction and in-tile reduction.  A reduction result that is one accumulator as it stands
  is read from the accumulator.
- *Buffers and live ranges*: each materialised tile, accumulator, resident slab, combine
  temporary and contraction scratch is a `Buffer`, live from the point that defines it to its
  last read; a read inside a loop nested in the buffer's own body keeps it live to that loop's
  end (every iteration reads it).  Rows whose length is a multiple of 32 elements are padded
  by one, so threads walking down a column hit different banks.
- *Threads and scratch*: the launch width (`threads`) is enough threads for the largest
  iteration space, in whole warps, at most `MAX_THREADS`.  A contraction with fewer outputs
  than threads splits its reduced axis over the spare threads, whose partial results need
  scratch (as many elements as there are threads); one with enough outputs gives each thread
  a register micro-tile of up to 4 x 4 outputs (`micro_tile`).
- *Placement*: offsets by liveness, first fit in definition order, every buffer taking a whole
  number of `ALIGN`-byte units.  `footprint` is the top of that placement: at least the bytes
  live at any one point, more where a freed gap is too small for the next buffer.
"""

from __future__ import annotations

import math
from bisect import insort
from dataclasses import dataclass, field
from functools import lru_cache
from operator import itemgetter
from typing import Literal, Mapping

from .ir import (Binary, BlockProgram, BlockReduce, Const, Dim, Dot, Get, IRError, Kernel, Load,
                 Monoid, Node, Pos, Reduce, Store, TensorDecl, Tuple, Var, children,
                 is_elementwise, postorder, rebuild, shape, transform)
from .masking import skip_predicate
from .schedule import Compute, KernelSchedule, Loop, Step, Write, schedule_kernel, walk_steps

MAX_THREADS = 256  # threads per block: the launch bound every kernel is compiled for
ALIGN = 16  # bytes: every buffer starts at this alignment (one vector load)
RESIDENT_SHARE = 0.25  # at most this fraction of local capacity holds resident input slabs
LOCAL_DTYPE = "f32"  # computed values and accumulators; loaded tiles keep their tensor's dtype

Role = Literal["tile", "accumulator", "slab", "temporary", "scratch"]
# How readers get a value: its expression computed where it is read (inline), a buffer in
# local memory (local), a register (register: a scalar), added into an accumulator as it is
# computed (accumulate), the resident slab of its tensor (resident), or never read as a tile
# (tuple: the components are read through `get`s).
Mode = Literal["inline", "local", "register", "accumulate", "resident", "tuple"]
BlockIndex = int | Literal["grid"] | None  # a loop id, the kernel's grid, or the only block


@dataclass(eq=False)
class Buffer:
    """A region of local memory, live over program points [first, last], at `offset`.

    `order` is its axes outermost first, `sizes` their extents in it (blocks, or a resident
    slab's whole extent), `strides` the elements between neighbours along each (rows padded
    against bank conflicts); scratch has no axes.
    """

    role: Role
    order: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    elements: int
    dtype: str
    first: int
    path: tuple[int, ...]  # the loops enclosing its definition
    last: int = -1
    offset: int = 0

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "f32" else 2

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize

    @property
    def aligned_bytes(self) -> int:
        return -(-self.nbytes // ALIGN) * ALIGN


@dataclass(eq=False)
class Site:
    """A step that evaluates expressions over one iteration space (`shape`): a combine or
    one of the kernel's writes."""

    seq: int
    path: tuple[int, ...]
    shape: frozenset[str]


@dataclass(eq=False)
class Value:
    """One computation of a node: a `Compute` step, or a reduction's results after its loop.

    `kind` is load, pos, const, elementwise, breduce, dot, tuple, get or result.
    """

    kind: str
    node: Node
    args: tuple[Value, ...]
    shape: frozenset[str]
    order: tuple[str, ...]
    path: tuple[int, ...]
    seq: int
    uses: list[Value | Site] = field(default_factory=list)
    mode: Mode = "inline"
    buffer: Buffer | None = None  # local: its tile; resident: its tensor's slab
    blocks: dict[str, BlockIndex] = field(default_factory=dict)  # load, pos: block per axis
    acc: Accumulation | None = None  # result / get: the reduction whose state it finalizes
    into: tuple[Accumulation, int] | None = None  # accumulate: the component it adds into
    scratch: Buffer | None = None  # breduce / dot: partial results of a split reduced axis
    micro: MicroTile | None = None  # dot without scratch: outputs per thread, in registers

    @property
    def is_step(self) -> bool:
        return self.mode in ("local", "register", "accumulate")

    def site(self) -> Site:
        space = self.args[0].shape if self.kind == "breduce" else self.shape
        return Site(self.seq, self.path, space)


@dataclass(eq=False)
class Accumulation:
    """One reduction of a loop: its contributions, accumulators and combine phases.

    A combine must read the *old* state of every component, so components are updated in
    groups of equal shape (`groups`), ordered so that a group reading another group's old state
    runs first; if no order exists (`via_tmp`), every component goes through a temporary.
    """

    reduce: Reduce
    monoid: Monoid
    contribs: tuple[Value, ...]
    states: tuple[Buffer, ...]
    shapes: tuple[frozenset[str], ...]
    groups: tuple[tuple[int, ...], ...]
    via_tmp: bool
    sites: tuple[Site, ...]  # one per group
    in_place: set[int] = field(default_factory=set)  # components no combine step updates
    aliases: dict[int, Value] = field(default_factory=dict)  # components held in these tiles
    tmps: tuple[Buffer, ...] = ()
    # Each component's combine as a backend emits it, subexpressions over smaller components
    # read as `f.<k>` from `factors` (`rescale_factors`), computed first.
    combines: tuple[Node, ...] = ()
    factors: tuple[tuple[Node, Buffer], ...] = ()


@dataclass(eq=False)
class LoopPlan:
    loop: Loop
    id: int
    path: tuple[int, ...]  # loops enclosing the loop itself
    start: int
    trips: int
    end: int = -1
    body: list[Op] = field(default_factory=list)
    accs: tuple[Accumulation, ...] = ()
    # Blocks on which `skip` is false everywhere contribute every reduction's identity and are
    # not visited (`masking`); `skip_blocks` is the block index of each axis it reads.
    skip: Node | None = None
    skip_blocks: dict[str, BlockIndex] = field(default_factory=dict)

    @property
    def axis(self) -> str:
        return self.loop.axis

    @property
    def masks_cut_blocks_only(self) -> bool:
        """Should a backend emit this skipping loop's body twice: without the mask for the
        blocks its predicate holds on everywhere, with it for the blocks the predicate cuts?
        Only where no loop inside it does the same, so that the copies never multiply."""
        def skips_inside(ops: list[Op]) -> bool:
            return any(isinstance(o, LoopPlan) and (o.skip is not None or skips_inside(o.body))
                       for o in ops)
        return self.skip is not None and not skips_inside(self.body)


@dataclass(eq=False)
class WritePlan:
    """One store of the kernel: `result`'s tile written to `store.tensor` at `site`, at the
    block index of each store axis in `blocks` (the grid's, a map loop's, or None for an axis
    of one block)."""

    store: Store
    result: Value
    site: Site
    blocks: dict[str, BlockIndex]


Op = Value | LoopPlan | WritePlan


@dataclass(frozen=True)
class MicroTile:
    """The outputs one thread of a contraction accumulates in registers: `ri` along axis `i`
    (None for a tile of one axis) times `rj` along `j`, the tile's last axis."""

    i: str | None
    j: str
    ri: int
    rj: int


def micro_tile(order: tuple[str, ...], blocks: Mapping[str, int],
               threads: int) -> MicroTile | None:
    """The register micro-tile of a contraction whose output tile has axes `order`, or None.

    A thread computing ri x rj outputs loads ri + rj operand elements per step of the
    contraction instead of 2 x ri x rj.  `j` is the last axis, so neighbouring threads still
    read neighbouring elements; `i` is the other axis with the largest block (the first on a
    tie), so a leading axis of block 1 -- the head axis of every multi-head program -- does not
    shrink the micro-tile to 1 x rj.  The largest micro-tile (wider along `j` on a tie) that
    divides the tile and still gives every thread of the launch one is chosen.
    """
    if not order:
        return None
    j = order[-1]
    i = max(order[:-1], key=lambda a: blocks[a], default=None)
    first, last = (blocks[i] if i is not None else 1), blocks[j]
    n_out = math.prod(blocks[a] for a in order)
    options = [(ri, rj) for ri in (4, 2, 1) for rj in (4, 2, 1)
               if first % ri == 0 and last % rj == 0 and ri * rj > 1
               and n_out // (ri * rj) >= threads]
    best = max(options, key=lambda r: (r[0] * r[1], r[1]), default=None)
    return None if best is None else MicroTile(i, j, *best)


@dataclass(eq=False)
class KernelPlan:
    """Everything a backend needs to know about one kernel besides the text it writes."""

    kernel: Kernel
    schedule: KernelSchedule
    body: list[Op]  # in execution order
    values: list[Value]  # every computed value, in execution order
    loops: list[LoopPlan]  # by id
    writes: list[WritePlan]  # in execution order
    buffers: list[Buffer]  # every buffer, in definition order, placed
    resident: tuple[Load, ...]  # loads whose slabs stay for the whole kernel
    threads: int
    footprint: int  # bytes of local memory: the top of the placement
    capacity: int  # the target's local memory per processor

    @property
    def grid(self) -> tuple[str, ...]:
        return self.kernel.grid

    @property
    def fits(self) -> bool:
        return self.footprint <= self.capacity


def plan_kernel(kernel: Kernel, dims: Mapping[str, Dim], tensors: Mapping[str, TensorDecl],
                capacity: int) -> KernelPlan:
    """The plan of one kernel.  `dims` must hold the kernel's axes in program order (it orders
    the axes of every tile); `capacity` is the target's local memory per processor."""
    return _plan(kernel, tuple(dims.values()), tuple(tensors.values()), capacity)


@lru_cache(maxsize=1 << 14)
def _plan(kernel: Kernel, dims: tuple[Dim, ...], decls: tuple[TensorDecl, ...],
          capacity: int) -> KernelPlan:
    return _Planner(kernel, {d.name: d for d in dims}, {t.name: t for t in decls},
                    capacity).plan()


def plan_once(kernel: Kernel, dims: Mapping[str, Dim], tensors: Mapping[str, TensorDecl],
              capacity: int) -> KernelPlan:
    """`plan_kernel`, not cached: for a caller that keeps only what it derives from the plan.

    The cost model caches its kernel costs and prices thousands of candidate kernels; keeping
    their plans (tens of objects each) as well made every full garbage collection walk them.
    """
    return _Planner(kernel, dict(dims), dict(tensors), capacity).plan()


def kernel_uses(kernel: Kernel) -> tuple[frozenset[str], frozenset[str]]:
    """Every axis and every tensor a kernel mentions: the dims and tensors its plan depends
    on."""
    axes: set[str] = set(kernel.grid)
    tensors: set[str] = set()
    for store in kernel.stores:
        axes.update(store.axes)
        tensors.add(store.tensor)
        for n in postorder(store.value):
            match n:
                case Load(t, a):
                    tensors.add(t)
                    axes.update(a)
                case Reduce(a, _, _) | Dot(a, _, _) | BlockReduce(_, a, _):
                    axes.add(a)
    return frozenset(axes), frozenset(tensors)


def block_bound_axes(p: BlockProgram, kernel: Kernel) -> frozenset[str]:
    """The axes whose blocks a kernel's folds depend on, which it must walk in the blocks it
    was written for unless the fold is written again for others (`refold.refolded`): a fold
    whose state for one block holds that block's size, as a rule writes it
    (`const(block(?e))`, `const(1 / block(?e))`): a Welford fold's count and mean,
    `tuple(64.0, bsum(e, x) * 0.015625, ...)`, are a block of 64's."""
    kp = p.in_kernel(kernel)
    return frozenset(n.axis for store in kernel.stores for n in postorder(store.value)
                     if isinstance(n, Reduce) and holds_block(n, kp.block(n.axis)))


def holds_block(fold: Reduce, size: int) -> bool:
    """Does `fold`'s contribution hold the number `size` or its reciprocal (a block's, to
    float32's rounding: 1 / 48 may have been rounded)?"""
    return any(isinstance(c, Const) and (math.isclose(c.value, size, rel_tol=1e-6) or
                                         math.isclose(c.value, 1 / size, rel_tol=1e-6))
               for c in postorder(fold.x))


def clear_cache() -> None:
    _plan.cache_clear()
    _var_names.cache_clear()
    _phases.cache_clear()
    _in_place_folds.cache_clear()
    _combine_reads.cache_clear()
    _layout.cache_clear()


# --------------------------------------------------------------------------------------------


class _Scope:
    """Which value of a node is visible: loop bodies nest, and a body may recompute a node."""

    def __init__(self, parent: _Scope | None):
        self.parent = parent
        self.bound: dict[Node, Value] = {}

    def lookup(self, n: Node) -> Value:
        scope: _Scope | None = self
        while scope is not None:
            if n in scope.bound:
                return scope.bound[n]
            scope = scope.parent
        raise IRError(f"internal: no value for {n!r} in scope")


@lru_cache(maxsize=1 << 12)
def _var_names(e: Node) -> frozenset[str]:
    return frozenset(n.name for n in postorder(e) if isinstance(n, Var))


def same_op(combine: Node, c: str) -> str | None:
    """The operator of a combine `a.c (op) b.c`, if that is what it is."""
    if (isinstance(combine, Binary) and combine.op in ("add", "max", "min")
            and {combine.x, combine.y} == {Var(f"a.{c}"), Var(f"b.{c}")}):
        return combine.op
    return None


@lru_cache(maxsize=1 << 10)
def rescale_factors(m: Monoid, shapes: tuple[frozenset[str], ...]
                    ) -> tuple[tuple[Node, ...], tuple[tuple[Node, frozenset[str]], ...]]:
    """Each component's combine with its subexpressions over smaller components read as
    `f.<k>`, and those subexpressions with their shapes (each a component's): computed once
    per element of their shape, not once per element of the larger component.  The online
    softmax's `o` (a row's features) reads `exp(a.m - max(a.m, b.m))` of the row's maximum:
    one exponential a row, not one a feature."""
    shape_of = {f"{side}.{c}": shapes[j] for j, c in enumerate(m.state) for side in "ab"}
    factors: dict[Node, tuple[Var, frozenset[str]]] = {}
    combines = []
    for c, root in enumerate(m.combine):
        order = list(postorder(root))
        below: dict[Node, frozenset[str] | None] = {}  # the shape of a node's variables
        for n in order:
            if isinstance(n, Var):
                below[n] = shape_of[n.name] if shape_of[n.name] < shapes[c] else None
            else:
                kids = [below[k] for k in children(n)]
                below[n] = None if None in kids else frozenset().union(*kids)
        factor = {n for n in order
                  if below[n] and below[n] in shapes and not isinstance(n, (Var, Const))}
        inside: set[Node] = set()  # under a factor: part of its expression
        for n in reversed(order):  # parents first
            if n in factor or n in inside:
                inside.update(children(n))

        def hoisted(n: Node, kids: tuple[Node, ...]) -> Node:
            if n in factor and n not in inside:
                return factors.setdefault(n, (Var(f"f.{len(factors)}"), below[n]))[0]
            return rebuild(n, kids)
        combines.append(transform(root, hoisted))
    return tuple(combines), tuple((n, shape) for n, (_, shape) in factors.items())


@lru_cache(maxsize=1 << 10)
def _combine_reads(m: Monoid) -> tuple[tuple[tuple[str, str, int], ...], ...]:
    """Per component: the variables its combine reads, by name, as (name, side, component)."""
    return tuple(tuple((v, *_side_component(m, v)) for v in sorted(_var_names(e)))
                 for e in m.combine)


def _side_component(m: Monoid, v: str) -> tuple[str, int]:
    side, comp = v.split(".", 1)
    return side, m.state.index(comp)


@lru_cache(maxsize=1 << 10)
def _in_place_folds(m: Monoid) -> tuple[str | None, ...]:
    """Per component: the operator of a combine `a.c (op) b.c` whose old state no other
    component's combine reads (so a contribution may fold into it in place), else None."""
    return tuple(
        None if any(f"a.{c}" in _var_names(e) for j, e in enumerate(m.combine) if j != i)
        else same_op(m.combine[i], c)
        for i, c in enumerate(m.state))


_FOLD = {"sum": "add", "max": "max", "min": "min"}
_FOLD_IDENTITY = {"add": 0.0, "max": float("-inf"), "min": float("inf")}


class _Planner:
    def __init__(self, kernel: Kernel, dims: Mapping[str, Dim],
                 tensors: Mapping[str, TensorDecl], capacity: int):
        self.kernel = kernel
        self.dims = dims
        self.tensors = tensors
        self.capacity = capacity
        self.trips = {a: d.blocks for a, d in dims.items()}
        self.dim_order = list(dims)
        self.orders: dict[frozenset[str], tuple[str, ...]] = {}
        self.grid = frozenset(kernel.grid)
        self.seq = 0
        self.values: list[Value] = []
        self.loops: list[LoopPlan] = []
        self.buffers: list[Buffer] = []
        self.rereads: list[Value] = []  # input loads inside a loop they do not depend on
        self.writes: list[WritePlan] = []
        self.blocks: dict[str, BlockIndex] = {a: "grid" for a in kernel.grid}
        self.looped: tuple[str, ...] = ()

    def plan(self) -> KernelPlan:
        schedule = schedule_kernel(self.kernel, self.trips)
        body = self._build(schedule.body, _Scope(None), ())
        resident = self._resident(self._next())
        self._decide()
        threads = self._threads()
        self._allocate(threads)
        footprint = _assign_offsets(self.buffers)
        return KernelPlan(self.kernel, schedule, body, self.values, self.loops, self.writes,
                          self.buffers, resident, threads, footprint, self.capacity)

    # -- the model of the schedule

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _order(self, axes: frozenset[str]) -> tuple[str, ...]:
        order = self.orders.get(axes)
        if order is None:
            order = self.orders[axes] = tuple(a for a in self.dim_order if a in axes)
        return order

    def _build(self, steps: tuple[Step, ...], scope: _Scope, path: tuple[int, ...]) -> list[Op]:
        ops: list[Op] = []
        for step in steps:
            if isinstance(step, Compute):
                made = len(self.values)
                v = self._value(step.node, scope, path)
                scope.bound[step.node] = v
                if len(self.values) > made:
                    ops.append(v)
            elif isinstance(step, Write):
                ops.append(self._write(step.store, scope, path))
            else:
                op = self._loop(step, scope, path)
                ops.append(op)
                for acc in op.accs:
                    result = self._result(acc, path)
                    scope.bound[acc.reduce] = result
                    ops.append(result)
        return ops

    def _write(self, store: Store, scope: _Scope, path: tuple[int, ...]) -> WritePlan:
        result = scope.lookup(store.value)
        site = Site(self._next(), path, frozenset(store.axes))
        result.uses.append(site)
        w = WritePlan(store, result, site, {a: self.blocks.get(a) for a in store.axes})
        self.writes.append(w)
        return w

    def _new(self, kind: str, n: Node, args: tuple[Value, ...], sh: frozenset[str],
             path: tuple[int, ...], **kw) -> Value:
        v = Value(kind, n, args, sh, self._order(sh), path, self._next(), **kw)
        for a in args:
            a.uses.append(v)
        self.values.append(v)
        return v

    def _value(self, n: Node, scope: _Scope, path: tuple[int, ...]) -> Value:
        match n:
            case Load(tensor, axes):
                blocks = {a: self.blocks.get(a) for a in axes}
                for a, b in blocks.items():
                    if b is None and self.trips[a] != 1:
                        raise IRError(f"internal: load {n!r} outside every loop over '{a}'")
                v = self._new("load", n, (), frozenset(axes), path, blocks=blocks)
                v.order = axes
                # A slab spans the grid's block of each grid axis, so a load over a grid axis
                # that an inner reduction re-binds (`sum[j]` in a kernel whose grid has j)
                # is read per step instead.
                if (self.tensors[tensor].role == "input"
                        and any(self.trips[a] > 1 and a not in axes for a in self.looped)
                        and not any(a in self.grid and a in self.looped for a in axes)):
                    self.rereads.append(v)
                return v
            case Pos(axis):
                v = self._new("pos", n, (), frozenset((axis,)), path,
                              blocks={axis: self.blocks.get(axis)})
                v.order = (axis,)
                return v
            case Const():
                return Value("const", n, (), frozenset(), (), path, 0)
            case Get(i, x):
                base = scope.lookup(x)
                if base.kind == "tuple":
                    return base.args[i]
                return self._new("get", n, (base,), shape(n), path, acc=base.acc)
            case Tuple(items):
                return Value("tuple", n, tuple(scope.lookup(i) for i in items), frozenset(), (),
                             path, 0, mode="tuple")
        kind = "elementwise" if is_elementwise(n) else {BlockReduce: "breduce", Dot: "dot"}[type(n)]
        args = tuple(scope.lookup(c) for c in children(n))
        return self._new(kind, n, args, shape(n), path)

    def _loop(self, loop: Loop, scope: _Scope, path: tuple[int, ...]) -> LoopPlan:
        op = LoopPlan(loop, len(self.loops), path, self._next(), self.trips[loop.axis])
        self.loops.append(op)
        inner = _Scope(scope)
        saved, looped = self.blocks.get(loop.axis), self.looped
        self.blocks[loop.axis] = op.id
        op.skip, op.skip_blocks = self._skip(loop)
        self.looped += (loop.axis,)
        op.body = self._build(loop.body, inner, path + (op.id,))
        self.looped = looped
        if saved is None:
            del self.blocks[loop.axis]
        else:
            self.blocks[loop.axis] = saved
        op.end = self._next()
        op.accs = tuple(self._accumulation(r, inner, op) for r in loop.reduces)
        for acc in op.accs:
            self._accumulate_in_place(acc, op)
        return op

    def _skip(self, loop: Loop) -> tuple[Node | None, dict[str, BlockIndex]]:
        """`loop_predicate`, if each axis it reads has a block index at the loop."""
        p = loop_predicate(loop)
        if p is None:
            return None, {}
        blocks = {n.axis: self.blocks.get(n.axis) for n in postorder(p) if isinstance(n, Pos)}
        if any(b is None and self.trips[a] != 1 for a, b in blocks.items()):
            return None, {}
        return p, blocks

    def _accumulation(self, r: Reduce, scope: _Scope, op: LoopPlan) -> Accumulation:
        m = r.monoid
        body = scope.lookup(r.x)
        contribs = body.args if body.kind == "tuple" else (body,)
        shapes = tuple(c.shape for c in contribs)
        states = tuple(self._buffer("accumulator", s, op.start, op.path) for s in shapes)
        groups, via_tmp = _phases(m, shapes)
        body_path = op.path + (op.id,)
        sites = tuple(Site(op.end, body_path, shapes[g[0]]) for g in groups)
        reads = _combine_reads(m)
        for g, site in zip(groups, sites):
            for c in g:
                for v, side, j in reads[c]:
                    if not shapes[j] <= shapes[c]:
                        raise IRError(f"monoid {m.name}: the combine of '{m.state[c]}' reads "
                                      f"'{v}', whose tile is larger")
                    if side == "b":
                        contribs[j].uses.append(site)
        acc = Accumulation(r, m, contribs, states, shapes, groups, via_tmp, sites)
        if via_tmp:
            acc.tmps = tuple(self._buffer("temporary", s, op.end, body_path) for s in shapes)
        acc.combines, factors = rescale_factors(m, shapes)
        acc.factors = tuple((n, self._buffer("temporary", s, op.end, body_path))
                            for n, s in factors)
        return acc

    def _accumulate_in_place(self, acc: Accumulation, op: LoopPlan) -> None:
        """Fold a dot / in-tile reduction straight into its accumulator where that is exact."""
        m = acc.monoid
        folds = _in_place_folds(m)
        for c, x in enumerate(acc.contribs):
            fold = folds[c]
            if (acc.via_tmp or fold is None or len(x.uses) != 1
                    or x.kind not in ("dot", "breduce")
                    or fold != ("add" if x.kind == "dot" else _FOLD[x.node.op])):
                continue
            if x.path == op.path + (op.id,):
                x.mode = "accumulate"
                x.into = (acc, c)
                acc.in_place.add(c)
            elif op.trips == 1 and m.identity[c] == Const(_FOLD_IDENTITY[fold]):
                acc.in_place.add(c)
                acc.aliases[c] = x

    def _result(self, acc: Accumulation, path: tuple[int, ...]) -> Value:
        """The reduction's value after its loop: one tile, or a tuple read through `get`."""
        if len(acc.monoid.finalize) == 1:
            return self._new("result", acc.reduce, (), shape(acc.reduce), path, acc=acc)
        return self._new("result", acc.reduce, (), frozenset(), path, acc=acc, mode="tuple")

    def _buffer(self, role: Role, sh: frozenset[str], first: int, path: tuple[int, ...],
                order: tuple[str, ...] | None = None, dtype: str = LOCAL_DTYPE,
                sizes: tuple[int, ...] | None = None) -> Buffer:
        order = self._order(sh) if order is None else order
        sizes = tuple(self.dims[a].block for a in order) if sizes is None else sizes
        strides, elements = _layout(sizes)
        buf = Buffer(role, order, sizes, strides, elements, dtype, first, path)
        self.buffers.append(buf)
        return buf

    def _tile_dtype(self, load: Load) -> str:
        dtype = self.tensors[load.tensor].dtype
        return dtype if self.tensors[load.tensor].itemsize == 2 else LOCAL_DTYPE

    # -- residency

    def _resident(self, end: int) -> tuple[Load, ...]:
        """Re-read input loads whose slabs fit, in execution order; their values read the
        slab."""
        budget = self.capacity * RESIDENT_SHARE
        slabs: dict[Load, Buffer] = {}
        used = 0
        for v in self.rereads:
            n = v.node
            if n in slabs:
                continue
            sizes = tuple(self.dims[a].block if a in self.grid else self.dims[a].extent
                          for a in n.axes)
            nbytes = math.prod(sizes) * self.tensors[n.tensor].itemsize
            if used + nbytes <= budget:
                slabs[n] = self._buffer("slab", frozenset(n.axes), 0, (), n.axes,
                                        self._tile_dtype(n), sizes)
                slabs[n].last = end
                used += nbytes
        for v in self.values:
            if v.kind == "load" and v.node in slabs:
                v.mode = "resident"
                v.buffer = slabs[v.node]
        return tuple(slabs)

    # -- decisions

    def _trivial(self, x: Value) -> bool:
        """A reduction result that is one accumulator as it stands: reading it is a load."""
        if x.kind not in ("result", "get") or x.acc is None:
            return False
        i = x.node.index if x.kind == "get" else 0
        return isinstance(x.acc.monoid.finalize[i], Var)

    @staticmethod
    def _sites(x: Value, known: dict[Value, list[tuple[Site, bool]]]) -> list[tuple[Site, bool]]:
        """The steps that evaluate `x`'s expression if it is inline, from its uses' own lists
        in `known` (uses come later in the kernel, so they are decided first).

        Each entry says whether its site is shared: a store or combine site reached along two
        paths is one site, but a step reached along two paths evaluates `x` twice, so it counts
        twice.  Two entries are enough to refuse inlining, so no list grows longer.
        """
        out: list[tuple[Site, bool]] = []
        for u in x.uses:
            if isinstance(u, Site):
                new = [(u, True)]
            elif u.is_step or u.kind in ("breduce", "dot"):
                new = [(u.site(), False)]
            else:
                new = known[u]
            for s, shared in new:
                if not (shared and any(s is o for o, _ in out)):
                    out.append((s, shared))
            if len(out) > 1:
                return out[:2]
        return out

    def _decide(self) -> None:
        known: dict[Value, list[tuple[Site, bool]]] = {}
        for x in reversed(self.values):
            known[x] = sites = self._sites(x, known)
            if x.mode in ("tuple", "accumulate", "resident"):
                continue
            if x.kind in ("breduce", "dot"):
                x.mode = "local"
                continue
            if x.kind == "load":
                x.mode = "local" if x.shape else "register"
                continue
            if self._trivial(x):
                continue
            inline = (not any(isinstance(u, Value) and u.kind == "dot" for u in x.uses)
                      and len(sites) <= 1
                      and all(s.shape == x.shape and s.path == x.path for s, _ in sites))
            if not inline:
                x.mode = "local" if x.shape else "register"

    def _threads(self) -> int:
        """Enough threads for the largest iteration space, in whole warps, at most MAX_THREADS."""
        spaces = [math.prod(self.dims[a].block for a in w.store.axes) for w in self.writes]
        for x in self.values:
            spaces.append(math.prod(self.dims[a].block for a in x.shape))
            if x.kind in ("breduce", "dot"):
                spaces[-1] *= self.dims[x.node.axis].block
        return max(32, min(MAX_THREADS, -(-max(spaces) // 32) * 32))

    # -- buffers and live ranges

    @staticmethod
    def _underlying(x: Value) -> list[Buffer]:
        """The buffers read when `x` is read (through inline expressions, each value once)."""
        out: list[Buffer] = []
        stack, seen = [x], set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v.mode in ("local", "resident"):
                out.append(v.buffer)
            elif v.kind in ("result", "get") and v.mode not in ("register", "accumulate"):
                out += v.acc.states
            elif v.mode not in ("register", "accumulate") and v.kind != "const":
                stack += reversed(v.args)
        return out

    def _touch(self, bufs: list[Buffer], seq: int, path: tuple[int, ...]) -> None:
        for b in bufs:
            at = seq
            if len(path) > len(b.path):  # read inside a loop nested in b's body: live to its end
                at = self.loops[path[len(b.path)]].end
            b.last = max(b.last, at)

    def _allocate(self, threads: int) -> None:
        for x in self.values:
            if x.mode == "local":
                dtype = self._tile_dtype(x.node) if x.kind == "load" else LOCAL_DTYPE
                x.buffer = self._buffer("tile", x.shape, x.seq, x.path, x.order, dtype)
        for op in self.loops:
            for acc in op.accs:
                for c in acc.aliases:
                    self.buffers.remove(acc.states[c])
                acc.states = tuple(acc.aliases[c].buffer if c in acc.aliases else b
                                   for c, b in enumerate(acc.states))
        for x in self.values:
            if x.is_step:
                reads = list(x.acc.states) if x.kind == "result" else \
                    [b for a in x.args for b in self._underlying(a)]
                if x.into is not None:
                    reads.append(x.into[0].states[x.into[1]])
                self._touch(reads, x.seq, x.path)
            if x.mode in ("local", "accumulate") and x.kind in ("breduce", "dot"):
                out = math.prod(self.dims[a].block for a in x.shape)
                space = out * self.dims[x.node.axis].block
                if out < threads and space > out:
                    x.scratch = Buffer("scratch", (), (), (), min(threads, space), LOCAL_DTYPE,
                                       x.seq, x.path, last=x.seq)
                    self.buffers.append(x.scratch)
            if x.kind == "dot" and x.scratch is None:
                x.micro = micro_tile(x.order, {a: self.dims[a].block for a in x.order}, threads)
        for op in self.loops:
            for acc in op.accs:
                for g, site in zip(acc.groups, acc.sites):
                    combine_reads = _combine_reads(acc.monoid)
                    reads = [b for c in g if c not in acc.in_place
                             for _, side, j in combine_reads[c] if side == "b"
                             for b in self._underlying(acc.contribs[j])]
                    self._touch(reads + list(acc.states), site.seq, site.path)
                for t in (*acc.tmps, *(b for _, b in acc.factors)):
                    t.last = t.first
        for w in self.writes:
            self._touch(self._underlying(w.result), w.site.seq, w.site.path)


@lru_cache(maxsize=1 << 12)
def loop_predicate(loop: Loop) -> Node | None:
    """The predicate over positions outside of which every reduction of `loop` contributes
    its identity (the same for all of them), if the loop stores nothing: its blocks where
    the predicate is false everywhere need not be visited."""
    predicates = {skip_predicate(r) for r in loop.reduces}
    if len(predicates) != 1 or None in predicates or any(
            isinstance(step, Write) for step, _ in walk_steps(loop.body)):
        return None
    return next(iter(predicates))


def _layout(sizes: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """The strides of a buffer with these extents, outermost first (rows whose length is a
    multiple of 32 padded by one), and its elements."""
    strides = [1] * len(sizes)
    for j in range(len(sizes) - 2, -1, -1):
        row = strides[j + 1] * sizes[j + 1]
        strides[j] = row + 1 if j == len(sizes) - 2 and row % 32 == 0 else row
    return tuple(strides), strides[0] * sizes[0] if sizes else 1


@lru_cache(maxsize=1 << 12)
def _phases(m: Monoid, shapes: tuple[frozenset[str], ...]
            ) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """Groups of components that may be updated in place, in an order that lets every group
    read the old state it needs; (one group per component, True) if none exists."""
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


def _assign_offsets(bufs: list[Buffer]) -> int:
    """Offsets by liveness (first fit, in definition order); the bytes needed."""
    events: dict[int, tuple[list[Buffer], list[Buffer]]] = {}
    for b in bufs:
        b.last = max(b.last, b.first)
        events.setdefault(b.first, ([], []))[0].append(b)
        events.setdefault(b.last, ([], []))[1].append(b)
    live: list[tuple[int, int, Buffer]] = []  # (offset, end, buffer), kept sorted by offset
    peak = 0
    for seq in sorted(events):
        born, dying = events[seq]
        for b in born:
            size = b.aligned_bytes
            offset = 0
            for start, end, _ in live:
                if offset + size <= start:
                    break
                if end > offset:
                    offset = end
            b.offset = offset
            insort(live, (offset, offset + size, b), key=itemgetter(0))
            peak = max(peak, offset + size)
        for b in dying:
            live.pop(next(i for i, (_, _, o) in enumerate(live) if o is b))
    return peak


def plan_for(p: BlockProgram, kernel: Kernel, capacity: int) -> KernelPlan:
    """The plan of `kernel` of program `p` on a target with `capacity` bytes of local memory
    per processor (at the kernel's own block sizes)."""
    p = p.in_kernel(kernel)
    axes, tensors = kernel_uses(kernel)
    return plan_kernel(kernel, {a: d for a, d in p.dims.items() if a in axes},
                       {t: p.tensors[t] for t in sorted(tensors)}, capacity)
