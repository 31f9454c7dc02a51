"""The exact cost of a block program on a target: traffic, flops, local footprint, time.

Fusion is judged by this model, so it prices exactly what the code generators emit: it walks
the kernel's plan (`plan.plan_once`: loops, buffers, residency), never a structure of its
own.  Per kernel:

Executions.  `grid_points` is the product of the block counts of the kernel's grid axes.  A
step inside loops L1..Ln (reductions' loops and map loops) executes grid_points x trips(L1) x
... x trips(Ln) times.

Traffic.  Each `Load` step reads its tile (product of the block sizes of its axes x the
tensor's itemsize) every time it executes; the kernel writes each stored tensor once, whole.

Resident inputs.  A load the plan keeps resident (a program input re-read by a loop it does not
depend on, whose *slab* -- everything one grid point reads of it -- fits) is read once per grid
point: slab bytes x grid_points.  Temporaries are never resident: fusion, not residency, is
what should remove their traffic.

Work per execution, by the unit that does it (`Work`).  Unary/binary: elements of the result
tile x the operator's flops (`bbrules.ops`), of which its special functions (exp, log, rsqrt,
...) are special-function work and the rest vector work; in-tile reduction: elements of its
input, vector work; dot: 2 x elements of the result x the contracted block, matrix work at the
rate for its operands: 16-bit when an operand is a load of a 16-bit tensor (the other, if
computed, rounded to that format, as FlashAttention rounds P and as the Triton backend does),
f32 when both are computed or the two formats differ.  On a target that `gathers`, a dot by a
one-hot (`bbrules.onehot`) is instead one copy per pick of each element of its result, vector
work, and so is an in-tile sum of a selection that pins the summed position.  A loop pays
each reduction's monoid `combine` once per iteration and its `finalize` once per completion,
both evaluated on the state tiles (distinct subexpressions once), split by operator like any
elementwise work.
Recomputation inside fused kernels is therefore counted as it happens.  `flops` is the total
of all units (a special function counts one).

Footprint and legality are the kernel's plan's (`bbrules.plan`): the local memory its buffers
take at their offsets, exactly what a generated kernel allocates.  A kernel whose footprint
exceeds the target's local capacity is illegal.

Time.  share = min(1, grid_points / processors): a grid smaller than the chip uses only that
fraction of bandwidth and of every unit.  time = max(bytes / (bandwidth x share),
compute / share) + step_ops x step_cost + launch_cost, where compute sums each unit's work
over its rate: matrix flops on 16-bit operands / peak_flops_f16, on f32 operands /
peak_flops_dot_f32, special functions / special_rate, vector flops / peak_flops.  (Units do
overlap on real hardware; the sum is the conservative choice, and the one that charges a
fused kernel for the exponentials it recomputes.)  `step_ops` counts the operations inside
the kernel's loops (loads, elementwise steps, block reductions, contractions, writes, each
monoid combine's elementwise terms) once per step, not per grid point: what the numpy
backend issues, one numpy call over the whole grid each, for as many steps as the loops
take.  A target whose backend pays nothing per step (every GPU target) gives `step_cost` 0.

Everything is computed in one walk of the plan.  Extraction prices thousands of candidate
programs that share most of their kernels, so per-kernel results are cached on (kernel, the
dims and tensors it uses, target), and the work of a monoid's combine and finalize on (monoid,
state shapes).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Mapping

from .ir import (ELEMENTWISE_KINDS, BlockProgram, BlockReduce, Const, Dim, Dot, Get, Kernel,
                 KindTable, Load, Monoid, Node, Pos, Reduce, TensorDecl, Tuple, Var,
                 is_elementwise, operator, postorder)
from .masking import visited_share
from .onehot import one_hot, selection_as_contraction
from .plan import LoopPlan, Op, Value, WritePlan, kernel_uses, plan_once
from .plan import clear_cache as _clear_plans
from .targets import Target


@dataclass(frozen=True)
class Work:
    """Operations, by the unit that executes them."""

    vector: int = 0  # f32 flops on the vector units (CUDA cores)
    special: int = 0  # special-function evaluations (exp, log, rsqrt, tanh, ...)
    matrix_f16: int = 0  # block-matmul flops on 16-bit operands
    matrix_f32: int = 0  # block-matmul flops on f32 operands

    def __add__(self, o: Work) -> Work:
        return Work(self.vector + o.vector, self.special + o.special,
                    self.matrix_f16 + o.matrix_f16, self.matrix_f32 + o.matrix_f32)

    def __mul__(self, n: int) -> Work:
        return Work(self.vector * n, self.special * n, self.matrix_f16 * n, self.matrix_f32 * n)

    @property
    def total(self) -> int:
        return self.vector + self.special + self.matrix_f16 + self.matrix_f32

    def seconds(self, t: Target) -> float:
        """The time of this work on the whole of `t`, each unit at its rate, one after
        another."""
        return (self.vector / t.peak_flops + self.special / t.special_rate
                + self.matrix_f16 / t.peak_flops_f16 + self.matrix_f32 / t.peak_flops_dot_f32)

    def to_json(self) -> dict:
        return {**asdict(self), "matrix": self.matrix_f16 + self.matrix_f32}


NO_WORK = Work()


@dataclass(frozen=True)
class KernelCost:
    """The cost of one kernel.  `time` is infinite when the kernel is illegal."""

    tensors: tuple[str, ...]  # what it stores
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
    work: Work = NO_WORK  # `flops`, by unit
    blocks: tuple[tuple[str, int], ...] = ()  # the block size of each axis it uses
    step_ops: float = 0.0  # operations in loop steps, counted once per step for the grid

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
    def work(self) -> Work:
        return sum((k.work for k in self.kernels), NO_WORK)

    @property
    def time(self) -> float:
        return sum(k.time for k in self.kernels)

    @property
    def legal(self) -> bool:
        return all(k.legal for k in self.kernels)

    @property
    def n_kernels(self) -> int:
        return len(self.kernels)

    def why_illegal(self) -> str:
        """Each kernel whose local footprint exceeds the target's capacity, with both sizes."""
        capacity = fmt_bytes(self.target.local_capacity)
        return "; ".join(f"kernel {','.join(k.tensors)} needs {fmt_bytes(k.footprint)} of local "
                         f"memory (its tiles at these block sizes), {self.target.name} has {capacity}"
                         for k in self.kernels if not k.legal)

    @property
    def footprint(self) -> int:
        return max((k.footprint for k in self.kernels), default=0)

    def value(self, objective: str = "time") -> float:
        """The objective's figure: modeled seconds, or bytes of global traffic."""
        return self.time if _objective(objective) == "time" else float(self.traffic)

    def key(self, objective: str = "time", anchor: float = 1.0) -> tuple:
        """Sort key, smaller is better: legal first, then the objective, then the rest.

        "traffic": (illegal, traffic, flops, kernels).

        "time": (illegal, band, traffic, kernels, time, flops), where band quantises the
        time on a log scale whose step is the target's resolution r:
        floor(log(time / anchor) / log(1 + r)), or the time itself when r = 0.  The model
        cannot tell apart times closer than r, so within a band less global traffic wins,
        then fewer kernels, then less work: the exact time, which with traffic and kernels
        equal differs by the work priced per unit (a count of flops would weigh an exp like
        an add), then the flops.  Bands, not a tolerance:
        "within r of each other" is not transitive (a ~ b and b ~ c, yet a !~ c), so it
        ranks nothing consistently, while bands are a total order, which keeps the search
        deterministic and its result never worse than the input program, itself a
        candidate.  Two times more than r apart are never in one band; closer ones are
        unless a band edge falls between them, so extraction anchors the bands at the best
        time it found (`extract.extract`): every candidate within r of the best ties with it.
        """
        legal = 0 if self.legal else 1
        if _objective(objective) == "traffic":
            return (legal, float(self.traffic), self.flops, self.n_kernels)
        return (legal, self.band(anchor), self.traffic, self.n_kernels, self.time, self.flops)

    def band(self, anchor: float = 1.0) -> float:
        """The time's band, counted in steps of the resolution from `anchor` seconds (see
        `key`); an illegal program's is infinite."""
        r = self.target.resolution
        if r == 0 or not math.isfinite(self.time):
            return self.time
        return math.floor(math.log(self.time / anchor) / math.log1p(r))

    def table(self) -> str:
        """A human-readable report: one row per kernel, totals, and the lower bound."""
        head = ("kernel", "grid", "points", "loops", "read", "written", "flops", "footprint",
                "time", "")
        rows = [head]
        for k in self.kernels:
            note = "ILLEGAL" if not k.legal else (
                "resident " + ",".join(k.resident) if k.resident else "")
            rows.append((",".join(k.tensors), "[" + ", ".join(k.grid) + "]", str(k.grid_points),
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
            d.update(tensors=list(k.tensors), grid=list(k.grid), resident=list(k.resident),
                     time=finite(k.time), traffic=k.traffic, work=k.work.to_json(),
                     blocks=dict(k.blocks))
            kernels.append(d)
        return {
            "target": self.target.name,
            "kernels": kernels,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "traffic": self.traffic,
            "compulsory": self.compulsory,
            "flops": self.flops,
            "work": self.work.to_json(),
            "footprint": self.footprint,
            "time": finite(self.time),
            "legal": self.legal,
            "n_kernels": self.n_kernels,
        }


def _objective(name: str) -> str:
    if name not in ("time", "traffic"):
        raise ValueError(f"unknown objective '{name}' (time or traffic)")
    return name


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


def cost_kernel(p: BlockProgram, kernel: Kernel, target: Target) -> KernelCost:
    """Cost one kernel of `p` (at its own block sizes)."""
    p = p.in_kernel(kernel)
    axes, tensors = _uses(kernel)
    return _cost_kernel(kernel, tuple(d for a, d in p.dims.items() if a in axes),
                        tuple(p.tensors[t] for t in tensors), target)


def clear_cache() -> None:
    """Forget every cached kernel cost and plan (for cold-start benchmarks, or to bound
    memory)."""
    _uses.cache_clear()
    _cost_kernel.cache_clear()
    _monoid_flops.cache_clear()
    _clear_plans()


def _tensor_bytes(p: BlockProgram, t: TensorDecl) -> int:
    return math.prod(p.extent(a) for a in t.axes) * t.itemsize


@lru_cache(maxsize=1 << 14)
def _uses(kernel: Kernel) -> tuple[frozenset[str], tuple[str, ...]]:
    """The axes and tensors (sorted) a kernel mentions: what its cost depends on besides the
    target.  Its dims are passed in program order, which orders the axes of its tiles."""
    axes, tensors = kernel_uses(kernel)
    return axes, tuple(sorted(tensors))


@lru_cache(maxsize=1 << 14)
def _cost_kernel(kernel: Kernel, dims: tuple[Dim, ...], decls: tuple[TensorDecl, ...],
                 target: Target) -> KernelCost:
    return _KernelCoster(kernel, {d.name: d for d in dims}, {t.name: t for t in decls},
                         target).cost()


WorkTerms = tuple[tuple[frozenset[str], Work], ...]  # (axes of a subexpression, work/element)


def _elementwise_work(n: Node) -> Work:
    """The work of an elementwise node per element of its result."""
    op = operator(n)
    return Work(vector=op.flops - op.special, special=op.special)


@lru_cache(maxsize=1 << 10)
def _monoid_flops(m: Monoid, shapes: tuple[frozenset[str], ...]) -> tuple[WorkTerms, WorkTerms]:
    """The elementwise work of one combine and of one finalize of `m` on state tiles of
    `shapes`: each distinct subexpression once, over the union of the tiles it reads."""
    var_shapes = dict(zip(m.state, shapes))
    var_shapes.update({f"{side}.{c}": s for c, s in zip(m.state, shapes) for side in "ab"})

    def terms(exprs: tuple[Node, ...]) -> WorkTerms:
        out: list[tuple[frozenset[str], Work]] = []
        seen: set[Node] = set()
        for e in exprs:
            for n in postorder(e):
                if n in seen or not is_elementwise(n):
                    continue
                seen.add(n)
                axes = frozenset().union(*(var_shapes[v.name] for v in postorder(n)
                                           if isinstance(v, Var)))
                out.append((axes, _elementwise_work(n)))
        return tuple(out)

    return terms(m.combine), terms(m.finalize)



# --------------------------------------------------------------------------------------------
# One kernel, from its plan


def _load_bytes(c: _KernelCoster, n: Load) -> int:
    return c.elements(frozenset(n.axes)) * c.tensors[n.tensor].itemsize


# Work of one execution of a node's step (a `plan.Value`); loads also add their traffic.
FLOPS = KindTable("flops", exempt={
    Var: "monoid variables are priced with their monoid (_monoid_flops)"})


@FLOPS.on(Const, Pos, Tuple, Get, Reduce)
def _(n: Node, c: _KernelCoster, v: Value, runs: int) -> Work:
    return NO_WORK  # references, positions (index arithmetic), and results whose finalize
    # the loop pays for


@FLOPS.on(Load)
def _(n: Load, c: _KernelCoster, v: Value, runs: int) -> Work:
    if v.mode != "resident":
        c.read += _load_bytes(c, n) * runs
    return NO_WORK


@FLOPS.on(*ELEMENTWISE_KINDS)
def _(n: Node, c: _KernelCoster, v: Value, runs: int) -> Work:
    return _elementwise_work(n) * c.elements(v.shape)


@FLOPS.on(BlockReduce)
def _(n: BlockReduce, c: _KernelCoster, v: Value, runs: int) -> Work:
    if c.target.gathers and \
            (dot := selection_as_contraction(n, c.dims[n.axis].block)) is not None:
        return Work(vector=c.elements(v.shape) * len(one_hot(dot)[1]))  # as the dot's
    return Work(vector=c.elements(v.args[0].shape))


@FLOPS.on(Dot)
def _(n: Dot, c: _KernelCoster, v: Value, runs: int) -> Work:
    if c.target.gathers and (hot := one_hot(n)) is not None:
        return Work(vector=c.elements(v.shape) * len(hot[1]))  # one copy per pick
    f = 2 * c.elements(v.shape) * c.dims[n.axis].block
    narrow = {c.tensors[x.tensor].dtype for x in (n.x, n.y)
              if isinstance(x, Load) and c.tensors[x.tensor].itemsize == 2}
    return Work(matrix_f16=f) if len(narrow) == 1 else Work(matrix_f32=f)


# The plan steps that are operations of their own (a numpy call each), not references.
STEP_OPS = frozenset({"load", "elementwise", "breduce", "dot"})


class _KernelCoster:
    """One kernel's plan, walked once for traffic and flops; footprint and legality are the
    plan's."""

    def __init__(self, kernel: Kernel, dims: Mapping[str, Dim],
                 tensors: Mapping[str, TensorDecl], target: Target):
        self.kernel = kernel
        self.dims = dims
        self.tensors = tensors
        self.target = target
        self.plan = plan_once(kernel, dims, tensors, target.local_capacity)
        self.grid = frozenset(kernel.grid)
        self.grid_points = math.prod(dims[a].blocks for a in kernel.grid)
        self.sizes: dict[frozenset[str], int] = {}
        self.read = 0
        self.imbalance = 1.0  # the makespan over the average grid point's time (`visited`)
        self.work = NO_WORK
        self.step_ops = 0.0

    def elements(self, axes: frozenset[str]) -> int:
        n = self.sizes.get(axes)
        if n is None:
            n = self.sizes[axes] = math.prod(self.dims[a].block for a in axes)
        return n

    def slab_bytes(self, n: Load) -> int:
        """Everything one grid point reads of a load: its tile over all non-grid axes."""
        return math.prod(self.dims[a].extent if a not in self.grid else self.dims[a].block
                         for a in n.axes) * self.tensors[n.tensor].itemsize

    def cost(self) -> KernelCost:
        plan = self.plan
        self.walk(plan.body, self.grid_points)
        self.read += sum(self.slab_bytes(n) for n in plan.resident) * self.grid_points
        self.read = round(self.read)  # loops that skip blocks visit a share of them
        written = sum(math.prod(self.dims[a].extent for a in t.axes) * t.itemsize
                      for t in map(self.tensors.__getitem__, self.kernel.tensors))
        time = self.time(self.read + written) if plan.fits else math.inf
        return KernelCost(self.kernel.tensors, self.kernel.grid, self.grid_points, self.read,
                          written, self.work.total, plan.footprint, plan.fits, time,
                          len(plan.loops), tuple(dict.fromkeys(n.tensor for n in plan.resident)),
                          self.work, tuple((a, d.block) for a, d in self.dims.items()),
                          self.step_ops)

    def walk(self, ops: list[Op], runs: int, steps: float = 0) -> None:
        """Traffic, work and step operations of `ops`, which execute `runs` times: `steps`
        times for the whole grid inside loops, 0 outside them."""
        for op in ops:
            if isinstance(op, WritePlan):
                self.step_ops += steps  # the written tensors' bytes are counted whole
            elif isinstance(op, LoopPlan):
                trips = op.trips * self.visited(op)
                self.walk(op.body, runs * trips, max(steps, 1) * trips)
                for acc in op.accs:
                    combine, finalize = _monoid_flops(acc.monoid, acc.shapes)
                    self.step_ops += len(combine) * max(steps, 1) * trips + len(finalize) * steps
                    for terms, times in ((combine, runs * trips), (finalize, runs)):
                        for shape, work in terms:
                            self.work += work * (self.elements(shape) * times)
            else:
                self.work += FLOPS(op.node, self, op, runs) * runs
                if op.kind in STEP_OPS:
                    self.step_ops += steps

    def visited(self, op: LoopPlan) -> float | int:
        """The share of its blocks a loop visits: all, or those its skip predicate may hold
        on (averaged over the blocks of the axes it reads).  Grid points that visit more
        blocks than the average stretch the kernel (`imbalance`)."""
        if op.skip is None:
            return 1
        visits = visited_share(op.skip, {a: (self.dims[a].block, self.dims[a].blocks)
                                         for a in op.skip_blocks}, self.grid)
        waves = self.grid_points / self.target.processors
        if visits.mean > 0:
            self.imbalance = max(self.imbalance, max(visits.mean * waves, visits.heaviest)
                                 / (visits.mean * max(1.0, waves)))
        return visits.mean

    def time(self, traffic: int) -> float:
        """The kernel's time at its share of the chip; where a loop skips blocks unevenly,
        the makespan of its grid points, at least the heaviest one's (with one wave of 64
        grid points, causal attention waits for the last query block, which visits every
        key block)."""
        t = self.target
        share = min(1.0, self.grid_points / t.processors)
        memory = traffic / (t.global_bandwidth * share)
        return (max(memory, self.work.seconds(t) / share) * self.imbalance
                + self.step_ops * t.step_cost + t.launch_cost)
