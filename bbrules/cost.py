"""The exact cost of a block program on a target: traffic, flops, local footprint, time.

Fusion is judged by this model, so it prices exactly the loops the code generators emit: it
walks `schedule.schedule_kernel`, never a loop structure of its own.  Per kernel:

Executions.  A kernel's grid is its store axes; `grid_points` is the product of their block
counts.  A step inside loops L1..Ln executes grid_points x trips(L1) x ... x trips(Ln) times.

Traffic.  Each `Load` step reads its tile (product of the block sizes of its axes x the
tensor's itemsize) every time it executes; the kernel writes its stored tensor once, whole.

Resident inputs.  A load of a program input that sits inside a loop over an axis it does not
depend on would be re-read on every iteration of that loop.  Instead, its *slab* -- the tile
extended over all its non-grid axes, i.e. everything one grid point ever reads of it -- may
stay in local memory for the whole kernel: it is then read once per grid point (slab bytes x
grid_points) and the slab counts in the footprint.  Candidates are admitted in execution order
while the slabs admitted so far total at most `RESIDENT_SHARE` of local capacity, so resident
data can never crowd out the tiles the kernel computes with.  Temporaries are never resident:
fusion, not residency, is what should remove their traffic.

Flops per execution.  Unary/binary: elements of the result tile x the operator's flops
(`bbrules.ops`); in-tile reduction: elements of its input; dot: 2 x elements of the result x
the contracted block.  A loop pays each reduction's monoid `combine` once per iteration and its
`finalize` once per completion, both evaluated on the state tiles (distinct subexpressions
once).  Recomputation inside fused kernels is therefore counted as it happens.

Footprint, by liveness.  The schedule, in execution order, is a sequence of program points:
one per computed node; for a loop, one where its accumulators are initialised, its body's, one
where every iteration ends by combining, and one where its results are finalized; the store
last.  Local tiles are 4-byte floats, except loaded tiles, which keep their tensor's itemsize.
- A tile is live from the point that computes it to its last read.  A read inside a loop the
  tile was computed outside of keeps it live to that loop's end: every iteration reads it.
- A loop's accumulators (one state tile per monoid component) are live for the whole loop.
  Its finalized results are computed from them where they are read, so a reduction's
  accumulators stay live until the last read of any of its results -- unless a result whose
  finalize is more than a component is materialised (below): then it is a tile of its own,
  from the loop's end to its last read, and reads the accumulators once, at the loop's end.
- Elementwise chains are not materialised.  A unary or binary node (or finalized result) whose
  single reader evaluates it in one pass over the same tile in the same loop body -- another
  unary or binary node, an in-tile reduction, or the kernel's store -- is computed inside that
  pass, as a code generator fuses it: it counts 0 bytes, and its operands are read where the
  reader runs.  These are exactly the conditions under which fusing it recomputes nothing, so
  the flop count stands.  Anything else -- read by several steps, broadcast to a larger tile,
  read in a deeper loop, an operand of a dot, a loop's contribution -- is materialised, and so
  is every loaded tile.
- Constants, tuples and `get`s of components are references (no storage).  A dot only ever
  folded into an additive monoid component (combine `a.c + b.c`) adds into its accumulator in
  place and has no tile of its own; a dot computed before a loop of one trip (the lowering's
  `reduce(d, sum, dot(d, ...))` over a single block) *is* the accumulator (identity 0), from
  the dot on.
The footprint is the resident slabs plus the local memory these tiles need when each is placed,
in the order they are computed, at the lowest offset clear of every tile still live, every
tile taking a whole number of `TILE_ALIGN`-byte units (first fit, as `codegen.cuda_gen` places
shared memory).  That is at least the bytes live at any one point, and more where a freed gap
is too small for the next tile: a model that promised only the live bytes would call kernels
legal that the generator must refuse.  A kernel whose footprint exceeds the target's local
capacity is illegal.

Time.  share = min(1, grid_points / processors): a grid smaller than the chip uses only that
fraction of bandwidth and flops.  time = max(bytes / (bandwidth x share), compute / share) +
launch_cost, where compute = dot flops on two loaded 16-bit tiles / peak_flops_f16 + all other
flops / peak_flops (tensor cores take half-precision operands; everything else runs in f32).

Everything is computed in one walk of the schedule.  Extraction prices thousands of candidate
programs that share most of their kernels, so per-kernel results are cached on (kernel, the
dims and tensors it uses, target), and the work of a monoid's combine and finalize on (monoid,
state shapes).
"""

from __future__ import annotations

import math
from bisect import insort
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Mapping

from .ir import (Binary, BlockProgram, BlockReduce, Const, Dim, Dot, Get, IRError, Load,
                 Monoid, Node, Reduce, Store, TensorDecl, Tuple, Unary, Var, postorder, shape,
                 show_node)
from .ops import BINARY, UNARY
from .schedule import Loop, Step, schedule_kernel
from .targets import Target

LOCAL_ITEMSIZE = 4  # intermediates and accumulators are f32 in local memory
RESIDENT_SHARE = 0.25  # at most this fraction of local capacity holds resident input slabs
TILE_ALIGN = 16  # bytes: local tiles start at this alignment (one vector load)


@dataclass(frozen=True)
class KernelCost:
    """The cost of one kernel (one store).  `time` is infinite when the kernel is illegal."""

    tensor: str
    grid: tuple[str, ...]
    grid_points: int
    bytes_read: int
    bytes_written: int
    flops: int
    footprint: int
    legal: bool
    time: float
    loops: int
    resident: tuple[str, ...]  # input tensors kept in local memory for the whole kernel

    @property
    def traffic(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class ProgramCost:
    """Per-kernel costs, their totals, and the compulsory-traffic lower bound."""

    kernels: tuple[KernelCost, ...]
    target: Target
    compulsory: int  # bytes: every input read once, every output written once

    @property
    def bytes_read(self) -> int:
        return sum(k.bytes_read for k in self.kernels)

    @property
    def bytes_written(self) -> int:
        return sum(k.bytes_written for k in self.kernels)

    @property
    def traffic(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    @property
    def time(self) -> float:
        return sum(k.time for k in self.kernels)

    @property
    def legal(self) -> bool:
        return all(k.legal for k in self.kernels)

    @property
    def n_kernels(self) -> int:
        return len(self.kernels)

    @property
    def footprint(self) -> int:
        return max((k.footprint for k in self.kernels), default=0)

    def key(self, objective: str = "time") -> tuple[int, float, int, int]:
        """Sort key, smaller is better: legal first, then the objective, flops, kernels."""
        if objective not in ("time", "traffic"):
            raise ValueError(f"unknown objective '{objective}' (time or traffic)")
        value = self.time if objective == "time" else float(self.traffic)
        return (0 if self.legal else 1, value, self.flops, self.n_kernels)

    def table(self) -> str:
        """A human-readable report: one row per kernel, totals, and the lower bound."""
        head = ("kernel", "grid", "points", "loops", "read", "written", "flops", "footprint",
                "time", "")
        rows = [head]
        for k in self.kernels:
            note = "ILLEGAL" if not k.legal else (
                "resident " + ",".join(k.resident) if k.resident else "")
            rows.append((k.tensor, "[" + ", ".join(k.grid) + "]", str(k.grid_points),
                         str(k.loops), fmt_bytes(k.bytes_read), fmt_bytes(k.bytes_written),
                         fmt_flops(k.flops), fmt_bytes(k.footprint), fmt_time(k.time), note))
        rows.append(("total", "", "", str(sum(k.loops for k in self.kernels)),
                     fmt_bytes(self.bytes_read), fmt_bytes(self.bytes_written),
                     fmt_flops(self.flops), fmt_bytes(self.footprint), fmt_time(self.time),
                     "" if self.legal else "ILLEGAL"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i in (0, 1, 9) else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(-1, "-" * len(lines[0]))
        ratio = self.traffic / self.compulsory if self.compulsory else float("inf")
        lines.append(f"target {self.target.name}: traffic {fmt_bytes(self.traffic)}, "
                     f"compulsory {fmt_bytes(self.compulsory)} "
                     f"({ratio:.2f}x the lower bound)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """Plain data for `--json`; an illegal kernel's infinite time is `null`."""
        def finite(t: float) -> float | None:
            return t if math.isfinite(t) else None

        kernels = []
        for k in self.kernels:
            d = asdict(k)
            d.update(grid=list(k.grid), resident=list(k.resident), time=finite(k.time),
                     traffic=k.traffic)
            kernels.append(d)
        return {
            "target": self.target.name,
            "kernels": kernels,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "traffic": self.traffic,
            "compulsory": self.compulsory,
            "flops": self.flops,
            "footprint": self.footprint,
            "time": finite(self.time),
            "legal": self.legal,
            "n_kernels": self.n_kernels,
        }


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_time(t: float) -> str:
    if not math.isfinite(t):
        return "inf"
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.2f} µs"


def fmt_flops(f: float) -> str:
    return f"{f / 1e9:.4g} GFLOP"


# --------------------------------------------------------------------------------------------


def cost_program(p: BlockProgram, target: Target) -> ProgramCost:
    """Cost every kernel of `p` on `target`."""
    compulsory = sum(_tensor_bytes(p, t) for t in p.tensors.values()
                     if t.role == "input" or t.name in p.outputs)
    return ProgramCost(tuple(cost_kernel(p, k, target) for k in p.kernels), target, compulsory)


def cost_kernel(p: BlockProgram, store: Store, target: Target) -> KernelCost:
    """Cost one kernel of `p`."""
    axes, tensors = _uses(store)
    return _cost_kernel(store, tuple(p.dims[a] for a in axes),
                        tuple(p.tensors[t] for t in tensors), target)


def clear_cache() -> None:
    """Forget every cached kernel cost (for cold-start benchmarks, or to bound memory)."""
    _uses.cache_clear()
    _cost_kernel.cache_clear()
    _monoid_flops.cache_clear()
    _additive.cache_clear()


def _tensor_bytes(p: BlockProgram, t: TensorDecl) -> int:
    return math.prod(p.extent(a) for a in t.axes) * t.itemsize


@lru_cache(maxsize=1 << 14)
def _uses(store: Store) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The axes and tensors a kernel mentions (sorted): what its cost depends on besides the
    target."""
    axes: set[str] = set(store.axes)
    tensors: set[str] = {store.tensor}
    for n in postorder(store.value):
        match n:
            case Load(t, a):
                tensors.add(t)
                axes.update(a)
            case Reduce(a, _, _) | Dot(a, _, _) | BlockReduce(_, a, _):
                axes.add(a)
    return tuple(sorted(axes)), tuple(sorted(tensors))


@lru_cache(maxsize=1 << 14)
def _cost_kernel(store: Store, dims: tuple[Dim, ...], decls: tuple[TensorDecl, ...],
                 target: Target) -> KernelCost:
    return _KernelCoster(store, {d.name: d for d in dims}, {t.name: t for t in decls},
                         target).cost()


FlopTerms = tuple[tuple[frozenset[str], int], ...]  # (axes of a subexpression, flops/element)


@lru_cache(maxsize=1 << 10)
def _monoid_flops(m: Monoid, shapes: tuple[frozenset[str], ...]) -> tuple[FlopTerms, FlopTerms]:
    """The elementwise work of one combine and of one finalize of `m` on state tiles of
    `shapes`: each distinct subexpression once, over the union of the tiles it reads."""
    var_shapes = dict(zip(m.state, shapes))
    var_shapes.update({f"{side}.{c}": s for c, s in zip(m.state, shapes) for side in "ab"})

    def terms(exprs: tuple[Node, ...]) -> FlopTerms:
        out: list[tuple[frozenset[str], int]] = []
        seen: set[Node] = set()
        for e in exprs:
            for n in postorder(e):
                if n in seen or not isinstance(n, (Unary, Binary)):
                    continue
                seen.add(n)
                axes = frozenset().union(*(var_shapes[v.name] for v in postorder(n)
                                           if isinstance(v, Var)))
                table = UNARY if isinstance(n, Unary) else BINARY
                out.append((axes, table[n.op].flops))
        return tuple(out)

    return terms(m.combine), terms(m.finalize)


@lru_cache(maxsize=1 << 10)
def _additive(m: Monoid) -> frozenset[int]:
    """Components whose combine is plain `a.c + b.c`, so contributions can add in place."""
    return frozenset(i for i, (c, e) in enumerate(zip(m.state, m.combine))
                     if isinstance(e, Binary) and e.op == "add"
                     and {e.x, e.y} == {Var(f"a.{c}"), Var(f"b.{c}")})


# --------------------------------------------------------------------------------------------
# Liveness and placement: the footprint


@dataclass(eq=False)
class _Value:
    """One computation as liveness sees it: a scheduled node, an accumulator, or the
    finalized result of a reduction.

    A materialised value occupies `nbytes` from the point that computes it (`first`) to its
    last read (`last`), and reads its `args` at `first`.  An inline value has no storage: it
    is computed wherever it is read, so reading it reads its `args` there.  References (tuples,
    constants, a result that is its accumulator) are inline from the start; an elementwise
    value (`fusible`) becomes inline when it has a single reader that streams over its tile.
    """

    nbytes: int
    first: int
    path: tuple[int, ...]  # the loops enclosing `first`, outermost first
    args: tuple[_Value, ...] = ()
    inline: bool = False
    fusible: bool = False
    streams: bool = False  # computes its tile in one elementwise pass over `space`
    space: frozenset[str] | None = None  # the tile it iterates over (a reader's view)
    readers: list[_Value] = field(default_factory=list)
    last: int = -1


class _Scope:
    """The values visible in a loop body: its own, then those of the bodies enclosing it."""

    def __init__(self, parent: _Scope | None = None):
        self.parent = parent
        self.bound: dict[Node, _Value] = {}

    def __getitem__(self, n: Node) -> _Value:
        scope: _Scope | None = self
        while scope is not None:
            v = scope.bound.get(n)
            if v is not None:
                return v
            scope = scope.parent
        raise RuntimeError(f"the schedule reads {show_node(n)} before computing it")


class _KernelCoster:
    """One kernel's schedule, walked once for traffic, flops and the values liveness needs."""

    def __init__(self, store: Store, dims: Mapping[str, Dim], tensors: Mapping[str, TensorDecl],
                 target: Target):
        self.store = store
        self.dims = dims
        self.tensors = tensors
        self.target = target
        self.trips = {a: d.blocks for a, d in dims.items()}
        self.grid = frozenset(store.axes)
        self.grid_points = math.prod(self.trips[a] for a in store.axes)
        self.sizes: dict[frozenset[str], int] = {}
        self.shapes: dict[int, frozenset[str]] = {}  # by id: the kernel holds its nodes
        self.points = 0
        self.loop_end: list[int] = []  # by loop id
        self.values: list[_Value] = []  # every value that is not a reference, and every site
        self.loads: list[tuple[Load, int, bool, _Value]] = []  # (load, runs, re-read, value)
        self.loops = 0
        self.flops = 0
        self.f16_flops = 0

    # -- sizes

    def elements(self, axes: frozenset[str]) -> int:
        n = self.sizes.get(axes)
        if n is None:
            n = self.sizes[axes] = math.prod(self.dims[a].block for a in axes)
        return n

    def shape(self, n: Node) -> frozenset[str]:
        s = self.shapes.get(id(n))
        if s is None:
            s = self.shapes[id(n)] = shape(n)
        return s

    def tile_bytes(self, n: Node) -> int:
        return self.elements(self.shape(n)) * LOCAL_ITEMSIZE

    def load_bytes(self, n: Load) -> int:
        return self.elements(frozenset(n.axes)) * self.tensors[n.tensor].itemsize

    def slab_bytes(self, n: Load) -> int:
        """Everything one grid point reads of a load: its tile over all non-grid axes."""
        return math.prod(self.dims[a].extent if a not in self.grid else self.dims[a].block
                         for a in n.axes) * self.tensors[n.tensor].itemsize

    # -- the walk

    def cost(self) -> KernelCost:
        top = _Scope()
        self.walk(schedule_kernel(self.store, self.trips).body, top, (), self.grid_points, ())
        self.site(self.point(), (), (top[self.store.value],), self.grid)
        resident = self.resident_loads()
        read = sum(self.slab_bytes(n) for n in resident) * self.grid_points
        for n, runs, _, v in self.loads:
            if n not in resident:
                v.nbytes = self.load_bytes(n)
                read += v.nbytes * runs
        stored = self.tensors[self.store.tensor]
        written = math.prod(self.dims[a].extent for a in stored.axes) * stored.itemsize
        footprint = sum(self.slab_bytes(n) for n in resident) + self.local_bytes()
        legal = footprint <= self.target.local_capacity
        time = self.time(read + written) if legal else math.inf
        return KernelCost(self.store.tensor, self.store.axes, self.grid_points, read, written,
                          self.flops, footprint, legal, time, self.loops,
                          tuple(dict.fromkeys(n.tensor for n in resident)))

    def point(self) -> int:
        self.points += 1
        return self.points

    def value(self, nbytes: int, first: int, path: tuple[int, ...],
              args: tuple[_Value, ...] = (), **kw) -> _Value:
        v = _Value(nbytes, first, path, args, **kw)
        for a in args:
            if not a.readers or a.readers[-1] is not v:  # x * x reads x once
                a.readers.append(v)
        if not v.inline:
            self.values.append(v)
        return v

    def site(self, point: int, path: tuple[int, ...], args: tuple[_Value, ...],
             space: frozenset[str] | None) -> _Value:
        """A read that computes no value: a loop's combine, or (streaming over `space`) the
        kernel's store."""
        return self.value(0, point, path, args, streams=space is not None, space=space)

    def walk(self, steps: tuple[Step, ...], scope: _Scope, path: tuple[int, ...], runs: int,
             axes: tuple[str, ...]) -> None:
        """Values, traffic and flops of `steps`, which execute `runs` times inside loops over
        `axes`."""
        for step in steps:
            if isinstance(step, Loop):
                self.loop(step, scope, path, runs, axes)
            else:
                n = step.node
                scope.bound[n] = self.compute(n, scope, path, runs, axes)

    def compute(self, n: Node, scope: _Scope, path: tuple[int, ...], runs: int,
                axes: tuple[str, ...]) -> _Value:
        at = self.point()
        match n:
            case Load(tensor, _):
                v = self.value(0, at, path)
                rereads = self.tensors[tensor].role == "input" and any(
                    self.trips[a] > 1 and a not in n.axes for a in axes)
                self.loads.append((n, runs, rereads, v))
                return v
            case Const():
                return self.value(0, at, path, inline=True)
            case Tuple(items):
                return self.value(0, at, path, tuple(scope[i] for i in items), inline=True)
            case Get(i, Tuple(items)):
                return scope[items[i]]
            case Get(i, Reduce() as r):
                trivial = isinstance(r.monoid.finalize[i], Var)
                sh = self.shape(n)
                return self.value(0 if trivial else self.tile_bytes(n), at, path, (scope[r],),
                                  inline=trivial, fusible=not trivial, space=sh)
            case Unary(op, x):
                sh = self.shape(n)
                size = self.elements(sh)
                self.flops += size * UNARY[op].flops * runs
                return self.value(size * LOCAL_ITEMSIZE, at, path, (scope[x],), fusible=True,
                                  streams=True, space=sh)
            case Binary(op, x, y):
                sh = self.shape(n)
                size = self.elements(sh)
                self.flops += size * BINARY[op].flops * runs
                return self.value(size * LOCAL_ITEMSIZE, at, path, (scope[x], scope[y]),
                                  fusible=True, streams=True, space=sh)
            case BlockReduce(_, _, x):
                sx = self.shape(x)
                self.flops += self.elements(sx) * runs
                return self.value(self.tile_bytes(n), at, path, (scope[x],), streams=True,
                                  space=sx)
            case Dot(a, x, y):
                size = self.elements(self.shape(n))
                f = 2 * size * self.dims[a].block * runs
                self.flops += f
                if self.half_precision_operands(n):
                    self.f16_flops += f
                return self.value(size * LOCAL_ITEMSIZE, at, path, (scope[x], scope[y]))
        raise IRError(f"internal: no cost for {n!r}")

    def loop(self, loop: Loop, scope: _Scope, path: tuple[int, ...], runs: int,
             axes: tuple[str, ...]) -> None:
        """The loop's body, its combines and accumulators, and its finalized results."""
        self.loops += 1
        start = self.point()
        ident = len(self.loop_end)
        self.loop_end.append(0)
        inner = _Scope(scope)
        body = path + (ident,)
        trips = self.trips[loop.axis]
        self.walk(loop.body, inner, body, runs * trips, axes + (loop.axis,))
        end = self.loop_end[ident] = self.point()
        combines = []
        for r in loop.reduces:
            m = r.monoid
            parts = _components(r)
            shapes = tuple(self.shape(c) for c in parts)
            combine, finalize = _monoid_flops(m, shapes)
            self.flops += runs * (trips * sum(self.elements(s) * f for s, f in combine)
                                  + sum(self.elements(s) * f for s, f in finalize))
            states = tuple(self.value(self.elements(s) * LOCAL_ITEMSIZE, start, path)
                           for s in shapes)
            combines.append((r, m, states, self.site(end, body, (inner[r.x], *states), None)))
        for r, m, states, site in combines:
            self.accumulate_in_place(r, m, inner, site, states, body, trips)
        results = self.point()
        for r, m, states, _ in combines:
            if len(m.finalize) > 1 or isinstance(m.finalize[0], Var):
                # results read through `get`s, or the one result is an accumulator as it is
                scope.bound[r] = self.value(0, results, path, states, inline=True)
            else:
                sh = self.shape(r)
                scope.bound[r] = self.value(self.tile_bytes(r), results, path, states,
                                            fusible=True, space=sh)

    def accumulate_in_place(self, r: Reduce, m: Monoid, inner: _Scope, site: _Value,
                            states: tuple[_Value, ...], body: tuple[int, ...], trips: int
                            ) -> None:
        """A dot whose only use is an additive contribution to this reduction adds straight
        into its accumulator: it needs no tile of its own.  Computed in the loop's body, it
        adds to the accumulator every iteration; computed before a loop of one trip (a dot
        invariant in its only iteration), its tile *is* the accumulator, which then lives from
        the dot on."""
        holder = inner[r.x]
        if holder.readers != [site]:
            return
        for c in _additive(m):
            x = _components(r)[c]
            v = inner[x]
            if not isinstance(x, Dot) or (v is not holder and v.readers != [holder]):
                continue
            if v.path == body:
                v.nbytes = 0
            elif trips == 1 and m.identity[c] == Const(0.0):
                v.nbytes = 0
                states[c].first, states[c].path = v.first, v.path

    def half_precision_operands(self, n: Dot) -> bool:
        return all(isinstance(x, Load) and self.tensors[x.tensor].itemsize == 2
                   for x in (n.x, n.y))

    def resident_loads(self) -> tuple[Load, ...]:
        """Input loads re-read by a loop they do not depend on, admitted in execution order
        while their slabs fit."""
        budget = self.target.local_capacity * RESIDENT_SHARE
        chosen: dict[Load, None] = {}
        used = 0
        for n, _, rereads, _ in self.loads:
            if rereads and n not in chosen:
                slab = self.slab_bytes(n)
                if used + slab <= budget:
                    chosen[n] = None
                    used += slab
        return tuple(chosen)

    def time(self, traffic: int) -> float:
        t = self.target
        share = min(1.0, self.grid_points / t.processors)
        memory = traffic / (t.global_bandwidth * share)
        compute = ((self.flops - self.f16_flops) / t.peak_flops
                   + self.f16_flops / t.peak_flops_f16) / share
        return max(memory, compute) + t.launch_cost

    # -- liveness and placement

    def local_bytes(self) -> int:
        """Local memory for every tile over its live range, placed first fit in the order the
        tiles are computed (resident slabs aside)."""
        for v in self.values:
            if v.fusible and len(v.readers) == 1:
                reader = v.readers[0]
                v.inline = (reader.streams and reader.path == v.path
                            and reader.space == v.space)
        for v in self.values:
            if not v.inline:
                if v.last < v.first:
                    v.last = v.first
                self.read(v.args, v.first, v.path)
        born: list[list[_Value]] = [[] for _ in range(self.points + 1)]
        dying: list[list[_Value]] = [[] for _ in range(self.points + 1)]
        for v in self.values:
            if not v.inline and v.nbytes:
                born[v.first].append(v)
                dying[v.last].append(v)
        live: list[tuple[int, int, int]] = []  # (offset, end, index), by offset
        placed: dict[int, tuple[int, int, int]] = {}
        top = 0
        for point in range(self.points + 1):
            for v in born[point]:
                size = -(-v.nbytes // TILE_ALIGN) * TILE_ALIGN
                offset = 0
                for start, end, _ in live:
                    if offset + size <= start:
                        break
                    if end > offset:
                        offset = end
                placed[id(v)] = slot = (offset, offset + size, len(placed))
                insort(live, slot)
                if offset + size > top:
                    top = offset + size
            for v in dying[point]:
                live.remove(placed[id(v)])
        return top

    def read(self, args: tuple[_Value, ...], at: int, path: tuple[int, ...]) -> None:
        """`args` are read at point `at` inside the loops `path`: keep them live that long,
        or to the end of the whole loop for a value defined outside it."""
        stack = list(args)
        while stack:
            v = stack.pop()
            if v.inline:
                stack.extend(v.args)
                continue
            last = at if len(path) <= len(v.path) else self.loop_end[path[len(v.path)]]
            if last > v.last:
                v.last = last


def _components(r: Reduce) -> tuple[Node, ...]:
    return r.x.items if isinstance(r.x, Tuple) else (r.x,)

