"""Loop structure of a kernel: where every node is computed, and which loops run together.

The cost model prices exactly these loops and the code generators emit exactly these loops, so
both call `schedule_kernel`; nothing else decides loop structure.

Map loops.  A kernel's grid may leave out some of a store's axes: the store then walks their
blocks in *map loops* (`MapLoop`, one per such axis, outermost first), storing one block per
iteration (`Write`).  For placement and merging a map loop is a loop like a reduction's, over
its axis, with the store's value as its body; it carries no accumulator.

Placement.  Every node is hoisted to just inside the innermost enclosing loop whose axis it
depends on (`ir.sched_deps`), or to the kernel body if it depends on no enclosing loop.  An axis
with a single block is not a loop for this purpose: its block index is always 0, so a node that
depends on it is invariant (this keeps a Q tile of attention, whose `d` axis is one block, out of
the loop over keys).  The same holds for map loops: a softmax store over a row's blocks computes
the row's statistics, which do not depend on the column block, once before its map loop.

Sibling loops.  Loops over the same axis placed in the same loop body share one loop when that
makes no loop need its own result (loop r2 needs r1 when r1 occurs in r2's body, and a shared
loop needs what its members need); the shared loop's body computes every shared node once.  So
a map loop and a reduction over the same axis that do not need each other (`c = a + b` stored
block by block beside `d = rowsum(b)`) load `b` once.  Merging is done top-down, so reductions
nested inside merged loops merge in turn.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Mapping, Union

from .ir import Kernel, Node, Reduce, Store, children, loops_under, sched_deps


@dataclass(frozen=True)
class Write:
    """Store the tile of `store.value` at the current block of every axis of `store`."""

    store: Store


@dataclass(frozen=True)
class MapLoop:
    """The map loop of `store` over `axes[level]` (level 0 outermost), with the next map loop
    (or the store's `Write`) as its body."""

    store: Store
    axes: tuple[str, ...]  # the store's map loops' axes, outermost first
    level: int

    @property
    def axis(self) -> str:
        return self.axes[self.level]

    @property
    def x(self) -> Node:
        """The value the loop's body computes (what it may need of sibling loops)."""
        return self.store.value

    @property
    def body(self) -> MapLoop | Write:
        if self.level + 1 < len(self.axes):
            return MapLoop(self.store, self.axes, self.level + 1)
        return Write(self.store)


@dataclass(frozen=True)
class Compute:
    """Compute `node` once per execution of the enclosing block (a Reduce never appears here)."""

    node: Node


@dataclass(frozen=True)
class Loop:
    """One sequential loop over the blocks of `axis` carrying the accumulators of `reduces`.

    Each iteration computes `body`, then combines every reduction's contribution into its
    state; after the last iteration each reduction's finalized value is available.  A loop
    that carries map loops has `Write` steps in its body.
    """

    axis: str
    reduces: tuple[Reduce, ...]
    body: tuple[Step, ...]


Step = Union[Compute, Loop, Write]
Looper = Union[Reduce, MapLoop]  # what opens a loop


@dataclass(frozen=True)
class KernelSchedule:
    kernel: Kernel
    grid: tuple[str, ...]
    body: tuple[Step, ...]


Path = tuple[Looper, ...]  # the loops that enclose a point before merging, outermost first
LoopPath = tuple[tuple[str, int], ...]  # the same point after merging: (axis, level) per loop


class _Scheduler:
    def __init__(self, trips: Mapping[str, int]):
        self.trips = trips
        self.placed: dict[Path, list[Node | MapLoop | Write]] = defaultdict(list)
        self.seen: set[tuple[Path, Node | MapLoop | Write]] = set()

    def place(self, n: Node | MapLoop | Write, ctx: Path) -> Path:
        """The longest prefix of ctx whose innermost loop `n` depends on (all of it for a map
        loop or a write: they run where their store's loops put them)."""
        if isinstance(n, (MapLoop, Write)):
            return ctx
        need = sched_deps(n)
        for i in range(len(ctx), 0, -1):
            axis = ctx[i - 1].axis
            if axis in need and self.trips[axis] > 1:
                return ctx[:i]
        return ()

    def walk(self, root: Node | MapLoop | Write, ctx: Path) -> None:
        """Place every node under `root`, each once per path, parents before children."""
        stack = [(root, ctx)]
        while stack:
            n, ctx = stack.pop()
            p = self.place(n, ctx)
            seen = len(self.seen)
            self.seen.add((p, n))  # one hash of the pair: it was new if the set grew
            if len(self.seen) == seen:
                continue
            self.placed[p].append(n)
            if isinstance(n, Reduce):
                stack.append((n.x, p + (n,)))
            elif isinstance(n, MapLoop):
                stack.append((n.body, p + (n,)))
            elif isinstance(n, Write):
                stack.append((n.store.value, p))
            else:
                stack.extend((c, p) for c in reversed(children(n)))

    def merge_loops(self) -> dict[Path, LoopPath]:
        """Map every path of reductions to the path of merged loops it runs in."""
        loop_path: dict[Path, LoopPath] = {(): ()}
        for depth in range(max(map(len, self.placed), default=0) + 1):
            siblings: dict[LoopPath, dict[tuple[Path, Looper], None]] = defaultdict(dict)
            for p, nodes in self.placed.items():
                if len(p) == depth:
                    for r in nodes:
                        if isinstance(r, (Reduce, MapLoop)):
                            siblings[loop_path[p]][(p, r)] = None
            for lp, members in siblings.items():
                loops = _share_loops(list(dict.fromkeys(r for _, r in members)))
                for p, r in members:
                    loop_path[p + (r,)] = lp + ((r.axis, loops[r]),)
        return loop_path


def _share_loops(reduces: list[Looper]) -> dict[Looper, int]:
    """Assign loops (reductions and map loops) placed in one loop body to shared loops,
    numbered from 0.

    Loop r needs reduction s when s occurs in r's body, and a shared loop needs every loop that
    one of its members needs (nothing needs a map loop: a kernel never reads what it stores).
    Taking loops in dependency order (walk order among equals), each joins the first shared
    loop over its axis that it does not itself need, directly or through other loops: so no
    loop ever needs its own result, whatever the axes of the loops between.
    """
    members = set(reduces)
    needs = {r: [s for s in loops_under(r.x) if s in members and s != r] for r in reduces}
    depth: dict[Looper, int] = {}  # the longest chain of needs below each loop
    for top in reduces:
        stack = [top]
        while stack:
            r = stack[-1]
            pending = [s for s in needs[r] if s not in depth]
            if pending:
                stack += pending
            else:
                depth[r] = 1 + max((depth[s] for s in needs[r]), default=-1)
                stack.pop()

    loop_of: dict[Looper, int] = {}
    axes: list[str] = []
    upstream: list[set[int]] = []  # the loops each loop needs, transitively
    for r in sorted(reduces, key=depth.__getitem__):
        need = set().union(*({loop_of[s]} | upstream[loop_of[s]] for s in needs[r]))
        i = next((i for i, a in enumerate(axes) if a == r.axis and i not in need), len(axes))
        if i == len(axes):
            axes.append(r.axis)
            upstream.append(set())
        loop_of[r] = i
        for loop in upstream:
            if loop is upstream[i] or i in loop:
                loop |= need
    return loop_of


def _root(kernel: Kernel, store: Store, trips: Mapping[str, int]) -> MapLoop | Write:
    """Where a store's schedule starts: its outermost map loop, or its write (an axis of one
    block needs no loop: its block index is always 0)."""
    axes = tuple(a for a in kernel.map_axes(store) if trips[a] > 1)
    return MapLoop(store, axes, 0) if axes else Write(store)


def schedule_kernel(kernel: Kernel, trips: Mapping[str, int]) -> KernelSchedule:
    """The loops of one kernel.  `trips` gives the number of blocks of every axis."""
    s = _Scheduler(trips)
    roots = [_root(kernel, store, trips) for store in kernel.stores]
    for root in roots:
        s.walk(root, ())
    loop_path = s.merge_loops()

    group: dict[LoopPath, list[tuple[Path, Looper]]] = defaultdict(list)
    for p, nodes in s.placed.items():
        for r in nodes:
            if isinstance(r, (Reduce, MapLoop)):
                group[loop_path[p + (r,)]].append((p, r))

    blocks: dict[LoopPath, list[Step | LoopPath]] = defaultdict(list)
    done: set[tuple[LoopPath, Node | MapLoop | Write]] = set()

    def emit(root: MapLoop | Write) -> None:
        """Append each node's step to its loop body after the steps it needs (post-order).

        The stack holds nodes still to visit (`(node, path)`) and steps ready to append
        (`(None, loop path, step)`, pushed below the visits of what they need).
        """
        visits: list[tuple[Node | MapLoop | Write, Path] | tuple[None, LoopPath, Step | LoopPath]]
        visits = [(root, ())]
        while visits:
            top = visits.pop()
            if top[0] is None:
                _, lp, step = top
                blocks[lp].append(step)
                continue
            n, ctx = top
            p = s.place(n, ctx)
            lp = loop_path[p]
            if (lp, n) in done:
                continue
            if isinstance(n, (Reduce, MapLoop)):
                inner = loop_path[p + (n,)]
                members = group[inner]
                for _, r in members:
                    done.add((lp, r))
                visits.append((None, lp, inner))
                visits.extend((r.x if isinstance(r, Reduce) else r.body, mp + (r,))
                              for mp, r in reversed(members))
                continue
            done.add((lp, n))
            if isinstance(n, Write):
                visits += [(None, lp, n), (n.store.value, p)]
                continue
            visits.append((None, lp, Compute(n)))
            visits.extend((c, p) for c in reversed(children(n)))

    def build(lp: LoopPath) -> tuple[Step, ...]:
        steps: list[Step] = []
        for item in blocks[lp]:
            if isinstance(item, (Compute, Write)):
                steps.append(item)
            else:
                reduces = tuple(dict.fromkeys(r for _, r in group[item] if isinstance(r, Reduce)))
                steps.append(Loop(item[-1][0], reduces, build(item)))
        return tuple(steps)

    for root in roots:
        emit(root)
    return KernelSchedule(kernel, kernel.grid, build(()))


def walk_steps(steps: tuple[Step, ...], loops: tuple[Loop, ...] = ()
               ) -> Iterator[tuple[Step, tuple[Loop, ...]]]:
    """Every step with the loops enclosing it, outermost first, in execution order."""
    for step in steps:
        yield step, loops
        if isinstance(step, Loop):
            yield from walk_steps(step.body, loops + (step,))
