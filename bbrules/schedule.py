"""Loop structure of a kernel: where every node is computed, and which loops run together.

The cost model prices exactly these loops and the code generators emit exactly these loops, so
both call `schedule_kernel`; nothing else decides loop structure.

Placement.  Every node is hoisted to just inside the innermost enclosing loop whose axis it
depends on (`ir.sched_deps`), or to the kernel body if it depends on no enclosing loop.  An axis
with a single block is not a loop for this purpose: its block index is always 0, so a node that
depends on it is invariant (this keeps a Q tile of attention, whose `d` axis is one block, out of
the loop over keys).

Sibling loops.  Reductions over the same axis placed in the same loop body share one loop when
neither needs the other's result: reduction r2 needs r1 when r1 occurs in r2's body.  Each
reduction gets a level (one more than the highest level of a same-axis, same-place reduction it
needs) and reductions with equal level share a loop, whose body computes every shared node once.
Merging is done top-down, so reductions nested inside merged loops merge in turn.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from typing import Iterator, Mapping, Union

from .ir import Node, Reduce, Store, children, postorder, sched_deps


@dataclass(frozen=True)
class Compute:
    """Compute `node` once per execution of the enclosing block (a Reduce never appears here)."""

    node: Node


@dataclass(frozen=True)
class Loop:
    """One sequential loop over the blocks of `axis` carrying the accumulators of `reduces`.

    Each iteration computes `body`, then combines every reduction's contribution into its
    state; after the last iteration each reduction's finalized value is available.
    """

    axis: str
    reduces: tuple[Reduce, ...]
    body: tuple[Step, ...]


Step = Union[Compute, Loop]


@dataclass(frozen=True)
class KernelSchedule:
    store: Store
    grid: tuple[str, ...]
    body: tuple[Step, ...]


Path = tuple[Reduce, ...]  # the reductions whose loops enclose a point, outermost first
LoopPath = tuple[tuple[str, int], ...]  # the same point after merging: (axis, level) per loop


@cache
def _reduces_under(n: Node) -> frozenset[Reduce]:
    return frozenset(r for r in postorder(n) if isinstance(r, Reduce))


class _Scheduler:
    def __init__(self, trips: Mapping[str, int]):
        self.trips = trips
        self.placed: dict[Path, list[Node]] = defaultdict(list)
        self.seen: set[tuple[Path, Node]] = set()

    def place(self, n: Node, ctx: Path) -> Path:
        """The longest prefix of ctx whose innermost loop `n` depends on."""
        need = sched_deps(n)
        for i in range(len(ctx), 0, -1):
            axis = ctx[i - 1].axis
            if axis in need and self.trips[axis] > 1:
                return ctx[:i]
        return ()

    def walk(self, n: Node, ctx: Path) -> None:
        p = self.place(n, ctx)
        if (p, n) in self.seen:
            return
        self.seen.add((p, n))
        self.placed[p].append(n)
        if isinstance(n, Reduce):
            self.walk(n.x, p + (n,))
        else:
            for c in children(n):
                self.walk(c, p)

    def merge_loops(self) -> dict[Path, LoopPath]:
        """Map every path of reductions to the path of merged loops it runs in."""
        loop_path: dict[Path, LoopPath] = {(): ()}
        for depth in range(max(map(len, self.placed), default=0) + 1):
            siblings: dict[LoopPath, set[tuple[Path, Reduce]]] = defaultdict(set)
            for p, nodes in self.placed.items():
                if len(p) == depth:
                    for r in nodes:
                        if isinstance(r, Reduce):
                            siblings[loop_path[p]].add((p, r))
            for lp, members in siblings.items():
                levels = _levels({r for _, r in members})
                for p, r in members:
                    loop_path[p + (r,)] = lp + ((r.axis, levels[r]),)
        return loop_path


def _levels(reduces: set[Reduce]) -> dict[Reduce, int]:
    """Level of each reduction among same-axis siblings: 1 + the highest level it needs."""
    level: dict[Reduce, int] = {}

    def visit(r: Reduce) -> int:
        if r not in level:
            needed = [s for s in _reduces_under(r.x) if s in reduces and s.axis == r.axis]
            level[r] = 1 + max((visit(s) for s in needed), default=-1)
        return level[r]

    for r in reduces:  # levels are longest chains: the visiting order does not change them
        visit(r)
    return level


def schedule_kernel(store: Store, trips: Mapping[str, int]) -> KernelSchedule:
    """The loops of one kernel.  `trips` gives the number of blocks of every axis."""
    s = _Scheduler(trips)
    s.walk(store.value, ())
    loop_path = s.merge_loops()

    group: dict[LoopPath, list[tuple[Path, Reduce]]] = defaultdict(list)
    for p, nodes in s.placed.items():
        for r in nodes:
            if isinstance(r, Reduce):
                group[loop_path[p + (r,)]].append((p, r))

    blocks: dict[LoopPath, list[Step | LoopPath]] = defaultdict(list)
    done: set[tuple[LoopPath, Node]] = set()

    def emit(n: Node, ctx: Path) -> None:
        p = s.place(n, ctx)
        lp = loop_path[p]
        if (lp, n) in done:
            return
        if isinstance(n, Reduce):
            inner = loop_path[p + (n,)]
            members = group[inner]
            for _, r in members:
                done.add((lp, r))
            for mp, r in members:
                emit(r.x, mp + (r,))
            blocks[lp].append(inner)
            return
        done.add((lp, n))
        for c in children(n):
            emit(c, p)
        blocks[lp].append(Compute(n))

    def build(lp: LoopPath) -> tuple[Step, ...]:
        steps: list[Step] = []
        for item in blocks[lp]:
            if isinstance(item, Compute):
                steps.append(item)
            else:
                reduces = tuple(dict.fromkeys(r for _, r in group[item]))
                steps.append(Loop(item[-1][0], reduces, build(item)))
        return tuple(steps)

    emit(store.value, ())
    return KernelSchedule(store, store.axes, build(()))


def walk_steps(steps: tuple[Step, ...], loops: tuple[Loop, ...] = ()
               ) -> Iterator[tuple[Step, tuple[Loop, ...]]]:
    """Every step with the loops enclosing it, outermost first, in execution order."""
    for step in steps:
        yield step, loops
        if isinstance(step, Loop):
            yield from walk_steps(step.body, loops + (step,))
