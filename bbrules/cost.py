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

Footprint.  Local tiles are 4-byte floats, except loaded tiles, which keep their tensor's
itemsize.  A loop's accumulators (one state tile per monoid component) live from the loop's
start to the end of the body that contains it; its finalized results reuse that storage.  The
footprint is the resident slabs plus the maximum, over every loop body B (and the kernel body),
of the tiles computed in B and in the bodies enclosing it plus the accumulators of the loops in
those bodies.  Tuples and `get`s are references (no storage); a dot that is only ever folded
into an additive monoid component (combine `a.c + b.c`) is accumulated in place and counted once,
as its accumulator.  A kernel whose footprint exceeds the target's local capacity is illegal.

Time.  share = min(1, grid_points / processors): a grid smaller than the chip uses only that
fraction of bandwidth and flops.  time = max(bytes / (bandwidth x share), compute / share) +
launch_cost, where compute = dot flops on two loaded 16-bit tiles / peak_flops_f16 + all other
flops / peak_flops (tensor cores take half-precision operands; everything else runs in f32).

Per-kernel results are cached on (kernel, the dims and tensors it uses, target): the extractor
prices thousands of candidate programs that share most of their kernels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Mapping

from .ir import (MONOIDS, Binary, BlockProgram, BlockReduce, Dim, Dot, Get, Load, Node, Reduce,
                 Store, TensorDecl, Tuple, Unary, Var, children, monoid, postorder,
                 register_monoid, shape)
from .ops import BINARY, UNARY
from .schedule import Compute, Loop, Step, schedule_kernel, walk_steps
from .targets import Target

LOCAL_ITEMSIZE = 4  # intermediates and accumulators are f32 in local memory
RESIDENT_SHARE = 0.25  # at most this fraction of local capacity holds resident input slabs


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
    """Cost every kernel of `p` on `target`; registers the monoids `p` carries."""
    for m in p.monoids.values():
        if MONOIDS.get(m.name) != m:
            register_monoid(m)
    compulsory = sum(_tensor_bytes(p, t) for t in p.tensors.values()
                     if t.role == "input" or t.name in p.outputs)
    return ProgramCost(tuple(cost_kernel(p, k, target) for k in p.kernels), target, compulsory)


def cost_kernel(p: BlockProgram, store: Store, target: Target) -> KernelCost:
    """Cost one kernel of `p` (its monoids must be registered, as `cost_program` does)."""
    axes, tensors = _uses(store)
    dims = tuple(p.dims[a] for a in sorted(axes))
    decls = tuple(p.tensors[t] for t in sorted(tensors))
    return _cost_kernel(store, dims, decls, target)


def clear_cache() -> None:
    """Forget every cached kernel cost (for cold-start benchmarks, or to bound memory)."""
    _uses.cache_clear()
    _cost_kernel.cache_clear()


def _tensor_bytes(p: BlockProgram, t: TensorDecl) -> int:
    return math.prod(p.extent(a) for a in t.axes) * t.itemsize


@lru_cache(maxsize=1 << 14)
def _uses(store: Store) -> tuple[frozenset[str], frozenset[str]]:
    """The axes and tensors a kernel mentions: what its cost depends on besides the target."""
    axes: set[str] = set(store.axes)
    tensors: set[str] = {store.tensor}
    for n in postorder(store.value):
        match n:
            case Load(t, a):
                tensors.add(t)
                axes.update(a)
            case Reduce(a, _, _) | Dot(a, _, _) | BlockReduce(_, a, _):
                axes.add(a)
    return frozenset(axes), frozenset(tensors)


@lru_cache(maxsize=1 << 14)
def _cost_kernel(store: Store, dims: tuple[Dim, ...], decls: tuple[TensorDecl, ...],
                 target: Target) -> KernelCost:
    return _KernelCoster(store, {d.name: d for d in dims}, {t.name: t for t in decls},
                         target).cost()


class _KernelCoster:
    """One kernel's schedule, walked once for traffic, flops and footprint."""

    def __init__(self, store: Store, dims: Mapping[str, Dim], tensors: Mapping[str, TensorDecl],
                 target: Target):
        self.store = store
        self.dims = dims
        self.tensors = tensors
        self.target = target
        self.trips = {a: d.blocks for a, d in dims.items()}
        self.schedule = schedule_kernel(store, self.trips)
        self.grid_points = math.prod(self.trips[a] for a in store.axes)
        self.parents = _parents(store.value)

    # -- sizes

    def elements(self, axes: frozenset[str] | tuple[str, ...]) -> int:
        return math.prod(self.dims[a].block for a in axes)

    def load_bytes(self, n: Load) -> int:
        return self.elements(n.axes) * self.tensors[n.tensor].itemsize

    def slab_bytes(self, n: Load) -> int:
        """Everything one grid point reads of a load: its tile over all non-grid axes."""
        return math.prod(self.dims[a].extent if a not in self.store.axes else self.dims[a].block
                         for a in n.axes) * self.tensors[n.tensor].itemsize

    def executions(self, loops: tuple[Loop, ...]) -> int:
        return self.grid_points * math.prod(self.trips[l.axis] for l in loops)

    # -- the walk

    def cost(self) -> KernelCost:
        steps = list(walk_steps(self.schedule.body))
        resident = self.resident_loads(steps)
        read = sum(self.slab_bytes(n) for n in resident) * self.grid_points
        flops = f16_flops = 0
        for step, loops in steps:
            runs = self.executions(loops)
            if isinstance(step, Loop):
                flops += self.loop_flops(step) * runs
                continue
            n = step.node
            if isinstance(n, Load):
                if n not in resident:
                    read += self.load_bytes(n) * runs
                continue
            f = self.node_flops(n) * runs
            flops += f
            if isinstance(n, Dot) and self.half_precision_operands(n):
                f16_flops += f
        stored = self.tensors[self.store.tensor]
        written = math.prod(self.dims[a].extent for a in stored.axes) * stored.itemsize
        in_place = {d for s, _ in steps if isinstance(s, Loop) for d in self.in_place_dots(s)}
        footprint = (sum(self.slab_bytes(n) for n in resident)
                     + self.body_footprint(self.schedule.body, set(resident) | in_place))
        legal = footprint <= self.target.local_capacity
        time = self.time(read + written, flops - f16_flops, f16_flops) if legal else math.inf
        return KernelCost(self.store.tensor, self.store.axes, self.grid_points, read, written,
                          flops, footprint, legal, time,
                          sum(isinstance(s, Loop) for s, _ in steps),
                          tuple(dict.fromkeys(n.tensor for n in resident)))

    def resident_loads(self, steps: list[tuple[Step, tuple[Loop, ...]]]) -> tuple[Load, ...]:
        """Input loads re-read by a loop they do not depend on, admitted while slabs fit."""
        budget = self.target.local_capacity * RESIDENT_SHARE
        chosen: dict[Load, None] = {}
        used = 0
        for step, loops in steps:
            n = step.node if isinstance(step, Compute) else None
            if (not isinstance(n, Load) or n in chosen
                    or self.tensors[n.tensor].role != "input"
                    or not any(self.trips[l.axis] > 1 and l.axis not in n.axes for l in loops)):
                continue
            slab = self.slab_bytes(n)
            if used + slab <= budget:
                chosen[n] = None
                used += slab
        return tuple(chosen)

    def time(self, traffic: int, f32_flops: int, f16_flops: int) -> float:
        t = self.target
        share = min(1.0, self.grid_points / t.processors)
        memory = traffic / (t.global_bandwidth * share)
        compute = (f32_flops / t.peak_flops + f16_flops / t.peak_flops_f16) / share
        return max(memory, compute) + t.launch_cost

    # -- flops

    def node_flops(self, n: Node) -> int:
        match n:
            case Unary(op, _):
                return self.elements(shape(n)) * UNARY[op].flops
            case Binary(op, _, _):
                return self.elements(shape(n)) * BINARY[op].flops
            case BlockReduce(_, _, x):
                return self.elements(shape(x))
            case Dot(a, _, _):
                return 2 * self.elements(shape(n)) * self.dims[a].block
        return 0

    def half_precision_operands(self, n: Dot) -> bool:
        return all(isinstance(x, Load) and self.tensors[x.tensor].itemsize == 2
                   for x in (n.x, n.y))

    def loop_flops(self, loop: Loop) -> int:
        """Flops of one complete loop: combines every iteration, finalize at the end."""
        total = 0
        for r in loop.reduces:
            m = monoid(r.monoid)
            shapes = dict(zip(m.state, map(shape, _components(r))))
            total += self.trips[loop.axis] * self.expr_flops(
                m.combine, {f"{side}.{c}": s for c, s in shapes.items() for side in "ab"})
            total += self.expr_flops(m.finalize, shapes)
        return total

    def expr_flops(self, exprs: tuple[Node, ...], var_shapes: Mapping[str, frozenset[str]]
                   ) -> int:
        """Flops of elementwise monoid expressions, each distinct subexpression once."""
        total = 0
        seen: set[Node] = set()
        for e in exprs:
            for n in postorder(e):
                if n in seen or not isinstance(n, (Unary, Binary)):
                    continue
                seen.add(n)
                axes = frozenset().union(*(var_shapes[v.name] for v in postorder(n)
                                           if isinstance(v, Var)))
                table = UNARY if isinstance(n, Unary) else BINARY
                total += self.elements(axes) * table[n.op].flops
        return total

    # -- footprint

    def tile_bytes(self, n: Node) -> int:
        match n:
            case Load():
                return self.load_bytes(n)
            case Tuple() | Get():
                return 0
        return self.elements(shape(n)) * LOCAL_ITEMSIZE

    def accumulator_bytes(self, loop: Loop) -> int:
        return sum(self.elements(shape(c)) * LOCAL_ITEMSIZE
                   for r in loop.reduces for c in _components(r))

    def body_footprint(self, body: tuple[Step, ...], stored_elsewhere: set[Node],
                       outer: int = 0) -> int:
        """Largest live local memory inside `body`, given `outer` bytes live around it.

        `stored_elsewhere` are nodes whose tiles take no space of their own: resident loads
        (their slab is counted once) and dots accumulated in place.
        """
        here = outer
        for s in body:
            if isinstance(s, Loop):
                here += self.accumulator_bytes(s)
            elif s.node not in stored_elsewhere:
                here += self.tile_bytes(s.node)
        return max([here] + [self.body_footprint(s.body, stored_elsewhere, here)
                             for s in body if isinstance(s, Loop)])

    def in_place_dots(self, loop: Loop) -> set[Dot]:
        """Dots in `loop`'s body used only as an additive contribution to its accumulator."""
        found: set[Dot] = set()
        for r in loop.reduces:
            m = monoid(r.monoid)
            for c, x, combine in zip(m.state, _components(r), m.combine):
                holder = r.x if isinstance(r.x, Tuple) else r
                if (isinstance(x, Dot) and _is_additive(combine, c)
                        and self.parents[x] == {holder}
                        and (holder is r or self.parents[holder] == {r})):
                    found.add(x)
        return found


def _components(r: Reduce) -> tuple[Node, ...]:
    return r.x.items if isinstance(r.x, Tuple) else (r.x,)


def _is_additive(combine: Node, c: str) -> bool:
    """Is the combine for component `c` plain `a.c + b.c` (so contributions can add in place)?"""
    return (isinstance(combine, Binary) and combine.op == "add"
            and {combine.x, combine.y} == {Var(f"a.{c}"), Var(f"b.{c}")})


def _parents(root: Node) -> dict[Node, set[Node]]:
    """The distinct nodes of the DAG under `root` that use each node."""
    parents: dict[Node, set[Node]] = {root: set()}
    for n in postorder(root):
        for c in children(n):
            parents.setdefault(c, set()).add(n)
    return parents
