"""Extraction: the cheapest program in a saturated e-graph, by the exact cost model.

egglog's extractors add up a cost per e-node.  Data movement is not additive: a load costs once
per iteration of the loops around the place the scheduler puts it, sibling loops share their
loads, and a kernel that does not fit local memory is illegal.  So every candidate here is a
whole block program, built from one choice per e-class and priced by `cost.cost_program`'s
kernels (cached per kernel, since candidates share most of them).

The choices.  A *use* choice picks the e-node of each e-class a candidate reaches.  Choosing a
load of an intermediate tensor T means "materialise T": T gets a kernel whose value is its own
*definition* choice, an e-node of the class T's original kernel stored.  Definitions are
separate choices because after forwarding `load(T)` and T's value share an e-class, so "one
node per e-class" alone could not say "store T, and load it here".  Commuted twins
(`x * y` next to `y * x`, `dot(a, x, y)` next to `dot(a, y, x)`) cost the same and are
dropped.

Launches.  A candidate is a set of stores; which of them share a kernel, and over which grid,
is decided for each candidate by `grouping` with the same cost key, and the candidate is priced
as launched.  The local search below descends from each seed twice: on the launched key, and on
the key of one kernel per store (grouping can make a local optimum of a candidate that is cheap
only because two of its stores share a launch); every candidate is ranked as launched either way.

The search.  Candidates are checked by rebuilding them as IR and recomputing every kernel's
types from the chosen nodes (`ir.type_of`, `ir.sched_deps`; `ir.validate` on the result), not
from the e-class analysis, so an ill-scoped choice is rejected.  When the space reachable from
the outputs has at most `Options.exhaustive_limit` candidates it is enumerated.  Otherwise a local
search runs from two seeds: the input program itself, and a forward-everything program picked
by a tree cost that multiplies a loop body by its trip count (so nested loop-invariant
reductions, which the scheduler would run as separate passes, look expensive).  It takes the
first move that lowers the cost, and when none does, tries each move together with one change
below it (see `Extractor.local_search`).  A move is a single change of one choice, or a change
of several choices that only pay off together (see `Extractor.moves`): every load of an
intermediate tensor forwarded, or every one materialised, at once (a tensor read through
renamed references has a load class per reference); and the users of a shared value switching
away from it at once (the RMSNorm sum of squares leaves its own pass only when both the gate
and the up projection sink it into their loop).  The search is bounded by a count of built
candidates, not by a clock, so the result does not depend on the machine's speed, unless the
fusion's time or memory budget (`options.Meter`) runs out first: every search is anytime, and
stops with the best candidate found so far (`ExtractStats.stop` says which budget stopped it).

The result is the first of every candidate priced (the search keeps them all, by their
kernels) in the cost key's order (`ProgramCost.key`: for time, modeled times within the
target's resolution tie and less global traffic wins), with the time bands anchored at the
best time priced, so each candidate within the resolution of the best competes; equal keys
break on the program text, so the result never depends on hash order.  The input program is
always a candidate: the result is never worse than it in that order.  The runner-up, the
first candidate that stores other tensors than the result (other kernels, not the same kernels
computed another way, which mostly cost the same), comes with it (`ExtractStats`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from itertools import product, repeat
from typing import Callable, Iterable, Iterator, Mapping, TypeAlias

from .cost import KernelCost, ProgramCost, cost_kernel
from .engine import ClassGraph, ENode
from .grouping import fitting, group_kernels
from .splitting import Splitter
from .ir import (BlockProgram, IRError, Kernel, Load, Node, Store, TensorDecl,
                 TileType, postorder, sched_deps, show_program, type_of, validate)
from .options import Meter, Options
from .targets import Target

_COMMUTATIVE = {"add", "mul", "max", "min"}
PROGRESS_EVERY = 0.5  # seconds between two progress reports of one extraction

Slot: TypeAlias = int | str  # an e-class's use choice, or a stored tensor's definition choice
Move: TypeAlias = tuple[tuple[Slot, int], ...]  # new option indices for some slots


@dataclass(frozen=True)
class ExtractStats:
    """How extraction went: `candidates` whole programs built and priced."""

    method: str  # "exhaustive" or "local search"
    candidates: int
    rejected: int  # ill-formed or over the kernel limit
    seconds: float
    stop: str = "complete"  # or the budget that ended the search: "time limit", "memory limit"
    anchor: float = 1.0  # seconds: the time the ranking's bands are counted from
    runner_up: ProgramCost | None = None  # the best legal candidate storing other tensors
    # The result's stores as the e-graph defines them, before `grouping` launched them (a
    # split fold's kernels store states no e-class holds): what explanations derive.
    chosen: tuple[Store, ...] = ()

    def to_json(self) -> dict:
        return {"method": self.method, "candidates": self.candidates, "rejected": self.rejected,
                "seconds": self.seconds, "stop": self.stop}


class NoCandidate(Exception):
    """No program in the e-graph satisfies the constraints (e.g. too few kernels allowed)."""


class _Invalid(Exception):
    """A choice that does not give a valid program (a cycle, or an ill-scoped term)."""


@dataclass
class Choice:
    """One candidate: a node index per reached e-class, a definition per stored tensor."""

    use: dict[int, int] = field(default_factory=dict)
    define: dict[str, int] = field(default_factory=dict)

    def with_use(self, c: int, i: int) -> Choice:
        return Choice({**self.use, c: i}, self.define)

    def with_define(self, t: str, i: int) -> Choice:
        return Choice(self.use, {**self.define, t: i})

    def changed(self, move: Move) -> Choice:
        use, define = dict(self.use), dict(self.define)
        for slot, i in move:
            if isinstance(slot, str):
                define[slot] = i
            else:
                use[slot] = i
        return Choice(use, define)


@dataclass(frozen=True)
class Built:
    program: BlockProgram
    reached: tuple[int, ...]  # e-classes whose use choice the program depends on
    defined: tuple[str, ...]  # tensors it stores


class Extractor:
    """Builds and prices candidates from one saturated e-graph."""

    def __init__(self, graph: ClassGraph, source: BlockProgram, target: Target,
                 objective: str = "time", max_kernels: int | None = None,
                 knobs: Options = Options(), meter: Meter | None = None,
                 progress: Callable[[str], None] | None = None):
        self.graph = graph
        self.meter = meter
        self.stop = "complete"
        self.knobs = knobs
        self.source = source
        self.target = target
        self.objective = objective
        self.max_kernels = max_kernels
        self.stored = tuple(k.tensor for k in source.stores)
        self.options = {c: _prune(ns, c) for c, ns in graph.classes.items()}
        self.load_option = {c: {self.read(n): i for i, n in enumerate(ns) if self.is_stored_load(n)}
                            for c, ns in self.options.items()}
        self.definitions = {t: [i for i, n in enumerate(self.options[graph.named[t]])
                                if not self.is_stored_load(n)]
                            for t in self.stored}
        self.compulsory = sum(_tensor_bytes(source, t) for t in source.tensors.values()
                              if t.role == "input" or t.name in source.outputs)
        # Every term node built, once: equal terms of different candidates are then the same
        # object, so comparing them (cache lookups) stops at the first shared child instead of
        # walking both DAGs, which takes time exponential in the depth of their sharing.
        # The input program's own stores and kernels are the ones kept: the cost model's
        # cache met them first (pricing the input), and a lookup with an equal copy would
        # compare the two terms on every hit.
        self.interned: dict[Node, Node] = {n: n for s in source.stores
                                           for n in postorder(s.value)}
        # And by what it is built from: the e-node and its children (interned, so by
        # identity), which spares building and hashing a node to find it interned.  Both
        # live as long as this search, so their ids stay theirs.
        self.made: dict[tuple[int, ...], Node] = {}
        self.interned_stores: dict[Store, Store] = {s: s for s in source.stores}
        self.interned_kernels: dict[Kernel, Kernel] = {k: k for k in source.kernels}
        self.launches: dict[tuple, tuple[tuple[Store, ...], Kernel]] = {}
        self.kernel_costs: dict[Kernel, KernelCost] = {}
        self.splitter = Splitter(target, self.kernel) if knobs.split_folds else None
        self.built = 0
        self.priced = 0
        self.rejected = 0
        # Per candidate (its stores): its program launched as `grouping` decides, that
        # program's cost, and the key of its stores launched one kernel each.
        self.cache: dict[tuple[Store, ...], tuple[BlockProgram, ProgramCost, tuple] | None] = {}
        self.written: dict[tuple[Store, ...], BlockProgram] = {}  # and as built, to relaunch
        self.grouped = True  # which key the search descends on (see `extract`)
        self.kernel_checks: dict[Store, bool] = {}
        self.shortlist: dict[int, list[int]] = {}
        self.tree: dict[int, tuple[int, float]] | None = None
        self.progress = progress
        self.reported = time.perf_counter()

    def is_stored_load(self, n: ENode) -> bool:
        return n.kind == "Load" and self.read(n) in self.stored

    def read(self, load: ENode) -> str:
        """The tensor whose memory a load reads: its own, or a view's base."""
        return self.source.tensors[load.attrs[0]].storage

    # -- building

    def build(self, choice: Choice) -> Built:
        """The program a choice describes; raises _Invalid if it is not a valid program.

        Terms are built children first and a kernel after the kernels its loads read, so the
        kernels come out in a valid order.  The walk keeps its pending work on a stack of
        frames rather than recursing: a term may be as deep as the program is long.
          ("term", c)           build e-class c's chosen e-node (and below), unless built
          ("node", c, enode)    every child of c is built: build c itself
          ("define", t)         build the kernel that stores intermediate t, unless built
          ("store", t, enode)   every child of t's defining e-node is built: t's kernel
        """
        memo: dict[int, Node] = {}
        on_path: set[int] = set()
        kernels: dict[str, Store] = {}
        defining: set[str] = set()

        def make(node: ENode) -> Node:
            kids = tuple(memo[k] for k in node.children)
            key = (id(node), *map(id, kids))
            built = self.made.get(key)
            if built is None:
                built = node.build(kids)
                built = self.made[key] = self.interned.setdefault(built, built)
            return built

        def load(node: ENode) -> Node:
            built = Load(node.attrs[0], node.attrs[1])
            return self.interned.setdefault(built, built)

        frames: list[tuple] = [("define", out) for out in reversed(self.source.outputs)]
        while frames:
            match frames.pop():
                case ("term", c) if c in memo:
                    pass
                case ("term", c):
                    if c in on_path:
                        raise _Invalid("cycle")
                    on_path.add(c)
                    node = self.options[c][choice.use[c]]
                    frames.append(("node", c, node))
                    if self.is_stored_load(node):
                        frames.append(("define", self.read(node)))
                    else:
                        frames += [("term", k) for k in reversed(node.children)]
                case ("node", c, node):
                    on_path.discard(c)
                    memo[c] = load(node) if self.is_stored_load(node) else make(node)
                case ("define", t) if t in kernels:
                    pass
                case ("define", t):
                    if t in defining:
                        raise _Invalid(f"{t} is defined through itself")
                    defining.add(t)
                    node = self.options[self.graph.named[t]][self.definitions[t][choice.define[t]]]
                    frames.append(("store", t, node))
                    frames += [("term", k) for k in reversed(node.children)]
                case ("store", t, node):
                    store = Store(t, self.source.tensors[t].axes, make(node))
                    store = self.interned_stores.setdefault(store, store)
                    if not self.kernel_ok(store):
                        raise _Invalid(f"kernel {t} is ill-formed")
                    kernels[t] = store
        return Built(self.program(tuple(kernels.values())), tuple(memo),
                     tuple(kernels))

    def kernel_ok(self, store: Store) -> bool:
        """Is one kernel well formed, its types recomputed from its own nodes (cached)."""
        if store not in self.kernel_checks:
            try:
                t = type_of(store.value)
                axes = frozenset(store.axes)
                self.kernel_checks[store] = (isinstance(t, TileType) and t.shape == axes
                                             and t.deps == axes
                                             and sched_deps(store.value) <= axes)
            except IRError:
                self.kernel_checks[store] = False
        return self.kernel_checks[store]

    def program(self, stores: tuple[Store, ...]) -> BlockProgram:
        """The program of `stores`, one kernel each (`grouping` decides the launches)."""
        stored = {k.tensor for k in stores}
        tensors = {n: t for n, t in self.source.tensors.items()
                   if t.role == "input" or n in stored or t.storage in stored or
                   self.source.tensors[t.storage].role == "input"}
        kernels = tuple(self.kernel(s.axes, (s,)) for s in stores)
        return BlockProgram(self.source.dims, tensors, kernels, self.source.outputs)

    def kernel(self, grid: tuple[str, ...], stores: tuple[Store, ...],
               blocks: tuple[tuple[str, int], ...] = ()) -> Kernel:
        """The launch of `stores` over `grid`, one object per value: the cost model's cache
        then finds it by identity instead of comparing terms."""
        # Looked up by its stores' identities first; the entry keeps those stores, so their
        # ids cannot be reused while it exists.
        key = (grid, tuple(map(id, stores)), blocks)
        hit = self.launches.get(key)
        if hit is None:
            k = Kernel(grid, stores, blocks)
            hit = self.launches[key] = (stores, self.interned_kernels.setdefault(k, k))
        return hit[1]

    # -- pricing

    def price(self, program: BlockProgram) -> tuple | None:
        """The search's sort key of a candidate (time bands counted from 1 s), or None if it
        has too many kernels even launched as `grouping` decides.  The key is the grouped
        program's, or with `self.grouped` false the key of one kernel per store."""
        stores = program.stores
        if stores not in self.cache:
            self.priced += 1
            # Out of time, a candidate is launched as written besides sharing launches.
            fresh = not self.spent()
            grouped = group_kernels(program, self.launched_cost, self.objective, self.kernel,
                                    self.splitter if fresh else None,
                                    self.target if fresh and self.knobs.reblock else None)
            cost = self.cost(grouped)
            if self.max_kernels is not None and len(grouped.kernels) > self.max_kernels:
                self.rejected += 1
                self.cache[stores] = None
            else:
                plain = self.cost(program) if grouped is not program else cost
                self.cache[stores] = (grouped, cost, plain.key(self.objective))
                self.written[stores] = program
        entry = self.cache[stores]
        if entry is None:
            return None
        return entry[1].key(self.objective) if self.grouped else entry[2]

    def retile(self, order: Callable[[ProgramCost], tuple], n: int) -> None:
        """Launch the `n` best candidates in `order` again, now also trying grid axes in
        coarser blocks where that reads less and loop axes in coarser blocks where that is
        faster (`group_kernels`' `coarser`).

        Coarser blocks are where a matmul's operands stop being re-read for every block of
        output rows, but each candidate would price a handful of new kernels for them (the
        whole search took 1.6x as long on `rmsnorm_qkv.bbp`).  So the search ranks
        candidates by their launches at the program's blocks and finer, and only its best
        few are tiled coarser too; their order may change (a normalisation stored apart lets
        the matmul after it take tiles that the fused kernel cannot fit)."""
        entries = sorted(((order(e[1]), stores) for stores, e in self.cache.items()
                          if e is not None), key=lambda ks: ks[0])
        for _, stores in entries[:n]:
            if self.spent():
                return
            grouped = group_kernels(self.written[stores], self.launched_cost, self.objective,
                                    self.kernel, self.splitter, self.target, coarser=True)
            self.cache[stores] = (grouped, self.cost(grouped), self.cache[stores][2])

    def legalize(self, order: Callable[[ProgramCost], tuple], n: int) -> None:
        """Where no candidate priced fits local memory: the `n` best in `order` again, each
        kernel that does not fit in blocks halved until it does (`grouping.fitting`).  The
        search offers finer blocks only where they read no more, and the program's own
        blocks may be too coarse for the target: the interleaved RoPE of an imported Mistral
        block, contracted a pair at a time, needed 536 KiB at the blocks its import chose,
        where the cpu target has 512."""
        entries = sorted(((order(e[1]), stores) for stores, e in self.cache.items()
                          if e is not None), key=lambda ks: ks[0])
        for _, stores in entries[:n]:
            launched, cost, key = self.cache[stores]
            kernels = list(launched.kernels)
            for i, kc in enumerate(cost.kernels):
                if not kc.legal and (fit := fitting(launched, kernels[i], self.kernel,
                                                    self.target)) is not None:
                    kernels[i] = fit
            legal = replace(launched, kernels=tuple(kernels))
            self.cache[stores] = (legal, self.cost(legal), key)

    def launched_cost(self, program: BlockProgram) -> ProgramCost | None:
        """A launched program's cost, None if it has more kernels than allowed."""
        if self.max_kernels is not None and len(program.kernels) > self.max_kernels:
            return None
        return self.cost(program)

    def near(self, a: Built, b: Built) -> bool:
        """Is candidate `a` as legal as `b` and within `Options.followup_slack` times its
        objective, so that one more change below it may make it cheaper?"""
        ea, eb = self.cache[a.program.stores], self.cache[b.program.stores]
        ca, cb = ea and ea[1], eb and eb[1]
        return (ca is not None and cb is not None and ca.legal == cb.legal
                and ca.value(self.objective) <= cb.value(self.objective)
                * self.knobs.followup_slack)

    def ranked(self) -> tuple[float, Callable[[ProgramCost], tuple]]:
        """The final order of every candidate priced: the anchor of its time bands (the best
        legal time priced) and the key under it."""
        anchor = min((e[1].time for e in self.cache.values() if e is not None and e[1].legal),
                     default=1.0)
        return anchor, lambda c: c.key(self.objective, anchor)

    def first(self, order: Callable[[ProgramCost], tuple], other_than: frozenset[str] | None = None
              ) -> tuple[BlockProgram, ProgramCost, tuple[Store, ...]] | None:
        """The first priced candidate in `order` that, as launched, does not store exactly
        the tensors `other_than`: its launched program, cost and stores as chosen in the
        e-graph; equal keys broken by the program text."""
        priced = [(order(e[1]), (*e[:2], stores)) for stores, e in self.cache.items()
                  if e is not None and frozenset(k.tensor for k in e[0].stores) != other_than]
        if not priced:
            return None
        key = min(k for k, _ in priced)
        return min((e for k, e in priced if k == key), key=lambda e: show_program(e[0]))

    def cost(self, program: BlockProgram) -> ProgramCost:
        return ProgramCost(tuple(map(self.kernel_cost, program.kernels, repeat(program))),
                           self.target, self.compulsory)

    def kernel_cost(self, kernel: Kernel, program: BlockProgram) -> KernelCost:
        """`cost_kernel`, remembered per kernel: within one extraction every axis and tensor
        name means one thing, so a kernel costs the same in every candidate."""
        cost = self.kernel_costs.get(kernel)
        if cost is None:
            cost = self.kernel_costs[kernel] = cost_kernel(program, kernel, self.target)
        return cost

    def spent(self) -> bool:
        """Has the fusion's time or memory budget run out (noted in `stop`)?"""
        if self.stop == "complete" and self.meter is not None:
            self.stop = self.meter.over() or "complete"
        return self.stop != "complete"

    def evaluate(self, choice: Choice) -> tuple[tuple, Built] | None:
        """The key and program of a candidate, or None if it is invalid or rejected."""
        self.built += 1
        if self.progress and time.perf_counter() - self.reported >= PROGRESS_EVERY:
            self.reported = time.perf_counter()
            self.progress(f"extraction: {self.built} candidates built, {self.priced} priced")
        try:
            built = self.build(choice)
        except _Invalid:
            self.rejected += 1
            return None
        key = self.price(built.program)
        return None if key is None else (key, built)

    # -- seeds

    def seed_from(self, program: BlockProgram) -> Choice:
        """The choice that rebuilds `program` (a program whose terms are in the e-graph)."""
        choice = self.default_choice()
        for k in program.stores:
            root = self.graph.named[k.tensor]
            for n in postorder(k.value):
                c = self.graph.lookup(n)
                if c is not None:
                    choice.use[c] = _index_of(self.options[c], n, self.graph)
            top = _index_of(self.options[root], k.value, self.graph)
            if top in self.definitions[k.tensor]:
                choice.define[k.tensor] = self.definitions[k.tensor].index(top)
        return choice

    def default_choice(self) -> Choice:
        """Forward everything, choosing in each class by a loop-aware tree cost."""
        best = self.tree_cost_table()
        use = {c: best.get(c, (0, 0.0))[0] for c in self.options}
        define = {}
        for t, defs in self.definitions.items():
            root = self.graph.named[t]
            costs = [self.node_tree_cost(self.options[root][i], best) for i in defs]
            define[t] = min(range(len(defs)), key=lambda j: costs[j]) if defs else 0
        return Choice(use, define)

    def tree_costs(self) -> dict[int, tuple[int, float]]:
        """Per class, (option index, cost) minimising a tree cost; loads of stored tensors
        cost infinity, so classes that can be forwarded are."""
        best: dict[int, tuple[int, float]] = {}
        changed = True
        while changed and not self.spent():
            changed = False
            for c, nodes in self.options.items():
                for i, n in enumerate(nodes):
                    cost = self.node_tree_cost(n, best)
                    if cost < best.get(c, (0, math.inf))[1]:
                        best[c] = (i, cost)
                        changed = True
        for c, nodes in self.options.items():
            best.setdefault(c, (0, math.inf))
        return best

    def node_tree_cost(self, n: ENode, best: Mapping[int, tuple[int, float]]) -> float:
        if self.is_stored_load(n):
            return math.inf
        if n.kind in ("Load", "Const"):
            return 1.0
        kids = sum(best.get(c, (0, math.inf))[1] for c in n.children)
        if n.kind == "Reduce":
            return self.source.blocks(n.attrs[0]) * (kids + 1.0) if n.attrs[0] in \
                self.source.dims else math.inf
        return kids + 1.0

    # -- search

    def space(self, limit: int) -> Iterator[Choice]:
        """Every distinct candidate reachable from the outputs, stopping after `limit + 1`
        (so the caller can tell the space is larger).  A depth-first walk that decides, in a
        fixed order, what a partial candidate reaches: classes (ints, use choices) and stored
        tensors (names, definition choices)."""
        start: tuple[Choice, tuple[int | str, ...], frozenset[int | str]] = (
            Choice(), tuple(self.source.outputs), frozenset())
        stack = [start]
        count = 0
        while stack and not self.spent():
            choice, todo, seen = stack.pop()
            while todo and todo[0] in seen:
                todo = todo[1:]
            if not todo:
                count += 1
                yield choice
                if count > limit:
                    return
                continue
            item, rest = todo[0], todo[1:]
            seen = seen | {item}
            branches = []
            if isinstance(item, str):
                root = self.options[self.graph.named[item]]
                for j, i in enumerate(self.definitions[item]):
                    branches.append((choice.with_define(item, j), root[i].children + rest, seen))
            else:
                for i, node in enumerate(self.options[item]):
                    nxt = (self.read(node),) if self.is_stored_load(node) else node.children
                    branches.append((choice.with_use(item, i), nxt + rest, seen))
            stack.extend(reversed(branches))

    def alternatives(self, c: int) -> list[int]:
        """The options of class c a local search step tries: all of them, or in a class
        swollen by associativity the `Options.moves_per_class` lowest by tree cost."""
        if c not in self.shortlist:
            costs = self.tree_cost_table()
            ranked = sorted(range(len(self.options[c])),
                            key=lambda i: (self.node_tree_cost(self.options[c][i], costs), i))
            self.shortlist[c] = ranked[:self.knobs.moves_per_class]
        return self.shortlist[c]

    def tree_cost_table(self) -> dict[int, tuple[int, float]]:
        if self.tree is None:
            self.tree = self.tree_costs()
        return self.tree

    def local_search(self, start: Choice, budget: int) -> tuple[tuple, Built] | None:
        """First-improvement descent on the cost key from `start`, building at most up to
        `budget` candidates in all (`self.built`).

        The moves (see `moves`) are scanned in a fixed order that resumes after the last
        accepted move.  When a whole scan finds nothing better, one more scan also tries each
        move together with each single change of the classes it newly reaches: those start
        from default choices, and a good change is often held back by one bad default below
        it.  Only a strictly lower key is progress, so the walk is deterministic and ends.
        """
        current = self.evaluate(start)
        if current is None:
            return None
        choice = start
        resume = 0
        deep = False
        while self.built < budget and not self.spent():
            moves = self.moves(choice, current[1])
            step = self.scan(choice, moves, resume, current, budget, deep)
            if step is None:
                if deep:
                    break
                deep = True
                continue
            n, current, choice = step
            resume = n % len(moves)
            deep = False
        return current

    def scan(self, choice: Choice, moves: list[Move], resume: int, current: tuple[tuple, Built],
             budget: int, deep: bool) -> tuple[int, tuple[tuple, Built], Choice] | None:
        """The first move (from position `resume`, cyclically) that lowers the key, with its
        position, result and choice; with `deep`, moves combined with one follow-up change
        count."""
        key, built = current
        for n in range(resume, resume + len(moves)):
            if self.built >= budget or self.spent():
                return None
            move = moves[n % len(moves)]
            moved = choice.changed(move)
            found = self.evaluate(moved)
            if found is not None and found[0] < key:
                return n, found, moved
            if deep and (found is None or self.near(found[1], built)):
                for extra in self.followups(moved, None if found is None else found[1], built):
                    if self.built >= budget or self.spent():
                        return None
                    further = moved.changed(extra)
                    found = self.evaluate(further)
                    if found is not None and found[0] < key:
                        return n, found, further
        return None

    # -- moves

    def moves(self, choice: Choice, built: Built) -> list[Move]:
        """Every single change of a class or definition `built` depends on, then the coupled
        changes (`tensor_moves`, `release_moves`) that are not single changes already."""
        out = self.single_moves(choice, built.reached, built.defined)
        seen = set(out)
        for move in (*self.tensor_moves(choice, built), *self.release_moves(choice, built)):
            if move and move not in seen:
                seen.add(move)
                out.append(move)
        return out

    def single_moves(self, choice: Choice, classes: Iterable[int],
                     tensors: Iterable[str]) -> list[Move]:
        out: list[Move] = [((c, i),) for c in classes for i in self.alternatives(c)
                           if i != choice.use[c]]
        out += [((t, j),) for t in tensors for j in range(len(self.definitions[t]))
                if j != choice.define[t]]
        return out

    def tensor_moves(self, choice: Choice, built: Built) -> list[Move]:
        """Per intermediate tensor, decide all its loads at once: materialise it everywhere
        the candidate could load it, or forward every load of it.

        A tensor read through several references (renamed axes: `S[q, k]` and `S[q, t]`)
        has a load class per reference, and it leaves global memory only when every one of
        them is forwarded: one at a time, each step keeps the kernel and looks no better.
        The choices a move forces come with it: forwarded uses of a tensor under its own axes
        take its kernel's definition, and a materialised kernel defines what the uses
        computed.
        """
        out: list[Move] = []
        for t in self.stored:
            loads = [c for c in built.reached if t in self.load_option[c]]
            if not loads:
                continue
            root = self.graph.named[t]
            stored = [c for c in loads if choice.use[c] == self.load_option[c][t]]
            materialise: list[tuple[Slot, int]] = [(c, self.load_option[c][t]) for c in loads
                                                   if c not in stored]
            if root in loads and root not in stored and choice.use[root] in self.definitions[t]:
                materialise.append((t, self.definitions[t].index(choice.use[root])))
            forward = [(c, i) for c in stored
                       if (i := self.forwarded(choice, c, t)) != choice.use[c]]
            out += [tuple(materialise), tuple(forward)]
        return out

    def forwarded(self, choice: Choice, c: int, t: str) -> int:
        """The option replacing a load of `t` in class `c` when `t` is forwarded."""
        if c == self.graph.named[t] and self.definitions[t]:
            return self.definitions[t][choice.define[t]]
        values = [i for i in self.alternatives(c) if not self.is_stored_load(self.options[c][i])]
        return values[0] if values else choice.use[c]

    def release_moves(self, choice: Choice, built: Built) -> list[Move]:
        """For each class that several chosen nodes use, those nodes switch away from it
        together.

        A value that sibling terms share costs until its last user stops needing it: the
        sum of squares that RMSNorm's gate and up projections both scale by disappears from
        its own pass over the row only when both switch to the form that sinks it into their
        loop, and each switch alone costs more.  With up to `Options.release_users` users,
        each user's `release_ways` best options (by tree cost) that do not use the class are
        combined, fewest rank points first, `release_moves` combinations per class.
        """
        users: dict[int, list[Slot]] = {}
        for slot in (*built.reached, *built.defined):
            node = self.chosen(choice, slot)
            if isinstance(slot, int) and self.is_stored_load(node):
                continue
            for k in dict.fromkeys(node.children):
                users.setdefault(k, []).append(slot)
        out: list[Move] = []
        for shared, slots in users.items():
            if not 2 <= len(slots) <= self.knobs.release_users:
                continue
            ways = [self.without(choice, s, shared)[:self.knobs.release_ways] for s in slots]
            if not all(ways):
                continue
            combos = sorted(product(*(range(len(w)) for w in ways)),
                            key=sum)[:self.knobs.release_moves]
            out += [tuple((s, w[r]) for s, w, r in zip(slots, ways, ranks)) for ranks in combos]
        return out

    def without(self, choice: Choice, slot: Slot, shared: int) -> list[int]:
        """The options of `slot`, best first, other than its current one, that neither use
        class `shared` nor load a stored tensor."""
        return [i for i in self.slot_options(slot)
                if i != self.current(choice, slot)
                and shared not in self.slot_node(slot, i).children
                and not self.is_stored_load(self.slot_node(slot, i))]

    def followups(self, moved: Choice, after: Built | None, before: Built) -> list[Move]:
        """Single changes of the classes and definitions `moved` (built as `after`, unless
        None) reaches that `before` did not."""
        if after is None:
            try:
                after = self.build(moved)
            except _Invalid:
                return []
        reached = set(before.reached)
        defined = set(before.defined)
        return self.single_moves(moved, [c for c in after.reached if c not in reached],
                                 [t for t in after.defined if t not in defined])

    # -- slots: a class's use choice (int) or a stored tensor's definition choice (str)

    def slot_options(self, slot: Slot) -> list[int]:
        if isinstance(slot, str):
            return list(range(len(self.definitions[slot])))
        return self.alternatives(slot)

    def slot_node(self, slot: Slot, i: int) -> ENode:
        if isinstance(slot, str):
            return self.options[self.graph.named[slot]][self.definitions[slot][i]]
        return self.options[slot][i]

    @staticmethod
    def current(choice: Choice, slot: Slot) -> int:
        return choice.define[slot] if isinstance(slot, str) else choice.use[slot]

    def chosen(self, choice: Choice, slot: Slot) -> ENode:
        return self.slot_node(slot, self.current(choice, slot))


def extract(graph: ClassGraph, source: BlockProgram, target: Target, objective: str = "time",
            max_kernels: int | None = None, options: Options = Options(),
            meter: Meter | None = None, progress: Callable[[str], None] | None = None
            ) -> tuple[BlockProgram, ProgramCost, ExtractStats]:
    """The cheapest valid program in `graph` equivalent to `source` (never costlier), the best
    found before `meter`'s time or memory budget ran out if it did; `progress`, if given,
    hears how far the search is every `PROGRESS_EVERY` seconds."""
    start = time.perf_counter()
    ex = Extractor(graph, source, target, objective, max_kernels, options, meter, progress)
    limit = options.exhaustive_limit
    candidates = list(ex.space(limit))
    # Every candidate built is priced and kept (`Extractor.cache`); the ranking below reads
    # them all, so the searches' own results need no keeping.
    if len(candidates) <= limit and not ex.spent():
        method = "exhaustive"
        for candidate in candidates:
            if ex.spent():
                break
            ex.evaluate(candidate)
    else:
        method = "local search"
        # Each seed is searched twice: descending on the grouped key, and on the key of one
        # kernel per store, whose walk grouping can make a local optimum of (a candidate
        # that stores two projections is cheap once they share a launch).  Every candidate
        # is ranked by its grouped cost either way.
        seeds = (ex.seed_from(source), ex.default_choice()) if not ex.spent() else ()
        runs = [(seed, grouped) for grouped in (True, False) for seed in seeds]
        for n, (seed, grouped) in enumerate(runs):
            if ex.spent():
                break
            ex.grouped = grouped
            # Each run may build an equal share of what the earlier ones left.
            ex.local_search(seed, ex.built + (options.max_evaluations - ex.built)
                            // (len(runs) - n))
        ex.grouped = True
    ex.price(source)
    if options.reblock:
        ex.retile(ex.ranked()[1], options.retiled)
    anchor, order = ex.ranked()
    best = ex.first(order)
    if best is None:
        raise NoCandidate(f"no program with at most {max_kernels} kernels was found")
    if not best[1].legal:
        ex.legalize(order, options.retiled)
        anchor, order = ex.ranked()
        best = ex.first(order)
    program, cost, chosen = best
    if not cost.legal:
        bound = f" with at most {max_kernels} kernels" if max_kernels is not None else ""
        raise NoCandidate(f"no legal program{bound} was found; the best one found is illegal: "
                          f"{cost.why_illegal()}")
    validate(program)
    second = ex.first(order, frozenset(k.tensor for k in program.stores))
    runner_up = second[1] if second is not None and second[1].legal else None
    stats = ExtractStats(method, ex.priced, ex.rejected, time.perf_counter() - start, ex.stop,
                         anchor, runner_up, chosen)
    return program, cost, stats


# --------------------------------------------------------------------------------------------


def _prune(nodes: tuple[ENode, ...], c: int) -> tuple[ENode, ...]:
    """Drop e-nodes that cost exactly what a kept one costs (commuted twins) and those that
    are never part of a finite term: an operation on its own class (`x + 0.0` in the class of
    `x`, `where(0.0, 0.0, x)` in the class of `x`, as identity rules leave them).  A load keeps
    its class as its child only to say which value it reads; stored, it is a leaf."""
    kept: list[ENode] = []
    keys: set[tuple] = set()
    for n in nodes:
        if n.kind != "Load" and c in n.children:
            continue
        key = _commuted_key(n)
        if key not in keys:
            keys.add(key)
            kept.append(n)
    return tuple(kept)


def _commuted_key(n: ENode) -> tuple:
    if (n.kind == "Binary" and n.attrs[0] in _COMMUTATIVE) or n.kind == "Dot":
        return (n.kind, n.attrs, tuple(sorted(n.children)))
    return (n.kind, n.attrs, n.children)


def _index_of(options: tuple[ENode, ...], n: Node, graph: ClassGraph) -> int:
    """The option of a class that is (or is the commuted twin of) IR node `n`."""
    enode = graph.enode_of(n)
    if enode is None:
        return 0
    key = _commuted_key(enode)
    for i, o in enumerate(options):
        if _commuted_key(o) == key:
            return i
    return 0


def _tensor_bytes(p: BlockProgram, t: TensorDecl) -> int:
    return math.prod(p.extent(a) for a in t.axes) * t.itemsize

