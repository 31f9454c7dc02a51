"""Loop structure of a kernel: where every node is computed, and which loops run together.

The cost model prices exactly these loops and the code generators emit exactly these loops, so
both call `schedule_kernel`; nothing else decides loop structure.

Placement.  Every node is hoisted to just inside the innermost enclosing loop whose axis it
depends on (`ir.sched_deps`), or to the kernel body if it depends on no enclosing loop.  An axis
with a single block is not a loop for this purpose: its block index is always 0, so a node that
depends on it is invariant (this keeps a Q tile of attention, whose `d` axis is one block, out of
the loop over keys).

Sibling loops.  Reductions over the same axis placed in the same loop body share one loop when
that makes no loop need its own result (reduction r2 needs r1 when r1 occurs in r2's body, and
a loop needs what its reductions need); the shared loop's body computes every shared node once.
Merging is done top-down, so reductions nested inside merged loops merge in turn.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Mapping, Union

from .ir import Node, Reduce, Store, children, loops_under, sched_deps


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

    def walk(self, root: Node, ctx: Path) -> None:
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
            else:
                stack.extend((c, p) for c in reversed(children(n)))

    def merge_loops(self) -> dict[Path, LoopPath]:
        """Map every path of reductions to the path of merged loops it runs in."""
        loop_path: dict[Path, LoopPath] = {(): ()}
        for depth in range(max(map(len, self.placed), default=0) + 1):
            siblings: dict[LoopPath, dict[tuple[Path, Reduce], None]] = defaultdict(dict)
            for p, nodes in self.placed.items():
                if len(p) == depth:
                    for r in nodes:
                        if isinstance(r, Reduce):
                            siblings[loop_path[p]][(p, r)] = None
            for lp, members in siblings.items():
                loops = _share_loops(list(dict.fromkeys(r for _, r in members)))
                for p, r in members:
                    loop_path[p + (r,)] = lp + ((r.axis, loops[r]),)
        return loop_path


def _share_loops(reduces: list[Reduce]) -> dict[Reduce, int]:
    """Assign reductions placed in one loop body to loops, numbered from 0.

    Reduction r needs s when s occurs in r's body, and a loop needs every loop that one of its
    reductions needs.  Taking reductions in dependency order (walk order among equals), each
    joins the first loop over its axis that it does not itself need, directly or through other
    loops: so no loop ever needs its own result, whatever the axes of the loops between.
    """
    members = set(reduces)
    needs = {r: [s for s in loops_under(r.x) if s in members and s != r] for r in reduces}
    depth: dict[Reduce, int] = {}  # the longest chain of needs below each reduction
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

    loop_of: dict[Reduce, int] = {}
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

    def emit(root: Node) -> None:
        """Append each node's step to its loop body after the steps it needs (post-order).

        The stack holds nodes still to visit (`(node, path)`) and steps ready to append
        (`(None, loop path, step)`, pushed below the visits of what they need).
        """
        visits: list[tuple[Node, Path] | tuple[None, LoopPath, Step | LoopPath]] = [(root, ())]
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
            if isinstance(n, Reduce):
                inner = loop_path[p + (n,)]
                members = group[inner]
                for _, r in members:
                    done.add((lp, r))
                visits.append((None, lp, inner))
                visits.extend((r.x, mp + (r,)) for mp, r in reversed(members))
                continue
            done.add((lp, n))
            visits.append((None, lp, Compute(n)))
            visits.extend((c, p) for c in reversed(children(n)))

    def build(lp: LoopPath) -> tuple[Step, ...]:
        steps: list[Step] = []
        for item in blocks[lp]:
            if isinstance(item, Compute):
                steps.append(item)
            else:
                reduces = tuple(dict.fromkeys(r for _, r in group[item]))
                steps.append(Loop(item[-1][0], reduces, build(item)))
        return tuple(steps)

    emit(store.value)
    return KernelSchedule(store, store.axes, build(()))


def walk_steps(steps: tuple[Step, ...], loops: tuple[Loop, ...] = ()
               ) -> Iterator[tuple[Step, tuple[Loop, ...]]]:
    """Every step with the loops enclosing it, outermost first, in execution order."""
    for step in steps:
        yield step, loops
        if isinstance(step, Loop):
            yield from walk_steps(step.body, loops + (step,))
