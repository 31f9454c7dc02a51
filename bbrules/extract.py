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

The search.  Candidates are checked by rebuilding them as IR and recomputing every kernel's
types from the chosen nodes (`ir.type_of`, `ir.sched_deps`; `ir.validate` on the result), not
from the e-class analysis, so an ill-scoped choice is rejected.  When the space reachable from
the outputs has at most `EXHAUSTIVE_LIMIT` candidates it is enumerated.  Otherwise a local
search runs from two seeds: the input program itself, and a forward-everything program picked
by a tree cost that multiplies a loop body by its trip count (so nested loop-invariant
reductions, which the scheduler would run as separate passes, look expensive).  It takes the
first single change of the current candidate that lowers the cost, and when none does, tries
each change together with one change below it (see `Extractor.local_search`).  That suffices
on the paper's programs because every step towards the fused form (forward a load, move a
factor out of a loop, switch to an online monoid) is cheaper by itself once what it exposes
is chosen well.  The search is bounded by a count of priced candidates, not by a clock, so the
result does not depend on the machine's speed.

Ties break on the cost key (objective, flops, kernels), then on the program text, so the result
never depends on hash order.  The input program is always a candidate: the result is never
costlier than it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from .cost import ProgramCost, cost_kernel, cost_program
from .engine import ClassGraph, ENode
from .ir import (BUILTIN_MONOIDS, MONOIDS, BlockProgram, IRError, Load, Node, Store, TensorDecl,
                 TileType, postorder, sched_deps, show_program, type_of, validate)
from .targets import Target

EXHAUSTIVE_LIMIT = 1000  # candidates: at about half a millisecond each, at most half a second
MAX_EVALUATIONS = 2_000  # local search prices at most this many candidates per extraction
MOVES_PER_CLASS = 12  # options of one class a local search step tries
FOLLOWUP_SLACK = 2.0  # a move is combined with follow-ups only if at most this much costlier
_COMMUTATIVE = {"add", "mul", "max", "min"}


@dataclass(frozen=True)
class ExtractStats:
    """How extraction went: `candidates` whole programs built and priced."""

    method: str  # "exhaustive" or "local search"
    candidates: int
    rejected: int  # ill-formed or over the kernel limit
    seconds: float

    def to_json(self) -> dict:
        return {"method": self.method, "candidates": self.candidates, "rejected": self.rejected,
                "seconds": self.seconds}


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


@dataclass(frozen=True)
class Built:
    program: BlockProgram
    reached: tuple[int, ...]  # e-classes whose use choice the program depends on
    defined: tuple[str, ...]  # tensors it stores


class Extractor:
    """Builds and prices candidates from one saturated e-graph."""

    def __init__(self, graph: ClassGraph, source: BlockProgram, target: Target,
                 objective: str = "time", max_kernels: int | None = None):
        self.graph = graph
        self.source = source
        self.target = target
        self.objective = objective
        self.max_kernels = max_kernels
        self.stored = {k.tensor for k in source.kernels}
        self.options = {c: _prune(ns) for c, ns in graph.classes.items()}
        self.definitions = {t: [i for i, n in enumerate(self.options[graph.named[t]])
                                if not self.is_stored_load(n)]
                            for t in self.stored}
        self.compulsory = sum(_tensor_bytes(source, t) for t in source.tensors.values()
                              if t.role == "input" or t.name in source.outputs)
        self.priced = 0
        self.rejected = 0
        self.cache: dict[tuple, tuple | None] = {}
        self.kernel_checks: dict[Store, bool] = {}
        self.shortlist: dict[int, list[int]] = {}
        self.tree: dict[int, tuple[int, float]] | None = None

    def is_stored_load(self, n: ENode) -> bool:
        return n.kind == "Load" and n.attrs[0] in self.stored

    # -- building

    def build(self, choice: Choice) -> Built:
        """The program a choice describes; raises _Invalid if it is not a valid program."""
        memo: dict[int, Node] = {}
        on_path: set[int] = set()
        kernels: dict[str, Store] = {}
        defining: set[str] = set()
        monoids: set[str] = set()

        def make(node: ENode) -> Node:
            if node.kind == "Reduce":
                monoids.add(node.attrs[1])
            return node.build(tuple(term(k) for k in node.children))

        def term(c: int) -> Node:
            if c in memo:
                return memo[c]
            if c in on_path:
                raise _Invalid("cycle")
            node = self.options[c][choice.use[c]]
            on_path.add(c)
            if self.is_stored_load(node):
                require(node.attrs[0])
                out: Node = Load(node.attrs[0], node.attrs[1])
            else:
                out = make(node)
            on_path.discard(c)
            memo[c] = out
            return out

        def require(t: str) -> None:
            if t in kernels:
                return
            if t in defining:
                raise _Invalid(f"{t} is defined through itself")
            defining.add(t)
            root = self.graph.named[t]
            store = Store(t, self.source.tensors[t].axes,
                          make(self.options[root][self.definitions[t][choice.define[t]]]))
            if not self.kernel_ok(store):
                raise _Invalid(f"kernel {t} is ill-formed")
            kernels[t] = store

        for out in self.source.outputs:
            require(out)
        return Built(self.program(tuple(kernels.values()), monoids), tuple(memo),
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

    def program(self, kernels: tuple[Store, ...], monoids: set[str]) -> BlockProgram:
        stored = {k.tensor for k in kernels}
        tensors = {n: t for n, t in self.source.tensors.items()
                   if t.role == "input" or n in stored}
        return BlockProgram(self.source.dims, tensors, kernels, self.source.outputs,
                            {m: MONOIDS[m] for m in sorted(monoids) if m not in BUILTIN_MONOIDS})

    # -- pricing

    def price(self, program: BlockProgram) -> tuple | None:
        """The sort key of a program, or None if it is invalid or has too many kernels."""
        key = tuple(program.kernels)
        if key in self.cache:
            return self.cache[key]
        self.priced += 1
        result: tuple | None = None
        if self.max_kernels is None or len(program.kernels) <= self.max_kernels:
            result = self.cost(program).key(self.objective)
        if result is None:
            self.rejected += 1
        self.cache[key] = result
        return result

    def cost(self, program: BlockProgram) -> ProgramCost:
        return ProgramCost(tuple(cost_kernel(program, k, self.target) for k in program.kernels),
                           self.target, self.compulsory)

    def evaluate(self, choice: Choice) -> tuple[tuple, Built] | None:
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
        for k in program.kernels:
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
        while changed:
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
        while stack:
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
                    nxt = (node.attrs[0],) if self.is_stored_load(node) else node.children
                    branches.append((choice.with_use(item, i), nxt + rest, seen))
            stack.extend(reversed(branches))

    def alternatives(self, c: int) -> list[int]:
        """The options of class c a local search step tries: all of them, or in a class
        swollen by associativity the `MOVES_PER_CLASS` lowest by tree cost."""
        if c not in self.shortlist:
            costs = self.tree_cost_table()
            ranked = sorted(range(len(self.options[c])),
                            key=lambda i: (self.node_tree_cost(self.options[c][i], costs), i))
            self.shortlist[c] = ranked[:MOVES_PER_CLASS]
        return self.shortlist[c]

    def tree_cost_table(self) -> dict[int, tuple[int, float]]:
        if self.tree is None:
            self.tree = self.tree_costs()
        return self.tree

    def local_search(self, start: Choice, budget: int) -> tuple[tuple, Built] | None:
        """First-improvement descent on the cost key from `start`, pricing at most up to
        `budget` candidates in all.

        The moves are every single change of a reached class or of a stored tensor's
        definition, scanned in a fixed order that resumes after the last accepted move.  When
        a whole scan finds nothing better, one more scan also tries each move together with
        each single change of the classes it newly reaches: those start from default choices,
        and a good change is often held back by one bad default below it.  Only a strictly
        lower key is progress, so the walk is deterministic and ends.
        """
        current = self.evaluate(start)
        if current is None:
            return None
        choice = start
        resume = 0
        deep = False
        while self.priced < budget:
            moves = self.moves(choice, current[1])
            step = self.scan(moves, resume, current, budget, deep)
            if step is None:
                if deep:
                    break
                deep = True
                continue
            n, current, choice = step
            resume = n % len(moves)
            deep = False
        return current

    def scan(self, moves: list[Choice], resume: int, current: tuple[tuple, Built], budget: int,
             deep: bool) -> tuple[int, tuple[tuple, Built], Choice] | None:
        """The first move (from position `resume`, cyclically) that lowers the key, with its
        position and result; with `deep`, moves combined with one follow-up change count."""
        key, built = current
        for n in range(resume, resume + len(moves)):
            if self.priced >= budget:
                return None
            move = moves[n % len(moves)]
            found = self.evaluate(move)
            if found is not None and found[0] < key:
                return n, found, move
            if deep and (found is None or _near(found[0], key)):
                for m in self.followups(move, built):
                    found = self.evaluate(m)
                    if found is not None and found[0] < key:
                        return n, found, m
        return None

    def moves(self, choice: Choice, built: Built) -> list[Choice]:
        """Every single change of a class or definition `built` depends on."""
        out = [choice.with_use(c, i) for c in built.reached
               for i in self.alternatives(c) if i != choice.use[c]]
        out += [choice.with_define(t, j) for t in built.defined
                for j in range(len(self.definitions[t])) if j != choice.define[t]]
        return out

    def followups(self, move: Choice, before: Built) -> list[Choice]:
        """Single changes of the classes and definitions `move` reaches that `before` did not."""
        try:
            after = self.build(move)
        except _Invalid:
            return []
        reached = set(before.reached)
        defined = set(before.defined)
        fresh = Built(after.program, tuple(c for c in after.reached if c not in reached),
                      tuple(t for t in after.defined if t not in defined))
        return self.moves(move, fresh)


def extract(graph: ClassGraph, source: BlockProgram, target: Target, objective: str = "time",
            max_kernels: int | None = None) -> tuple[BlockProgram, ProgramCost, ExtractStats]:
    """The cheapest valid program in `graph` equivalent to `source` (never costlier)."""
    start = time.perf_counter()
    ex = Extractor(graph, source, target, objective, max_kernels)
    candidates = list(ex.space(EXHAUSTIVE_LIMIT))
    found: list[tuple[tuple, Built]] = []
    if len(candidates) <= EXHAUSTIVE_LIMIT:
        method = "exhaustive"
        found = [r for r in map(ex.evaluate, candidates) if r is not None]
    else:
        method = "local search"
        for seed in (ex.seed_from(source), ex.default_choice()):
            r = ex.local_search(seed, MAX_EVALUATIONS)
            if r is not None:
                found.append(r)
    original = ex.price(source)
    if original is not None:
        found.append((original, Built(source, (), ())))
    if not found:
        raise NoCandidate(f"no program with at most {max_kernels} kernels was found")
    key = min(f[0] for f in found)
    if key[0] and cost_program(source, target).legal:
        raise NoCandidate(f"no legal program with at most {max_kernels} kernels was found")
    # Equal keys: the smallest program text, so the result never depends on search order.
    program = min((f[1].program for f in found if f[0] == key), key=show_program)
    validate(program)
    stats = ExtractStats(method, ex.priced, ex.rejected, time.perf_counter() - start)
    return program, ex.cost(program), stats


# --------------------------------------------------------------------------------------------


def _near(key: tuple, current: tuple) -> bool:
    """Is a candidate within `FOLLOWUP_SLACK` of the current one, so that one more change
    below it may make it cheaper?  (A move that is invalid as built also qualifies: its
    defaults may be what breaks it.)"""
    return key[0] == current[0] and key[1] <= current[1] * FOLLOWUP_SLACK


def _prune(nodes: tuple[ENode, ...]) -> tuple[ENode, ...]:
    """Drop e-nodes that cost exactly what a kept one costs: commuted twins."""
    kept: list[ENode] = []
    keys: set[tuple] = set()
    for n in nodes:
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

