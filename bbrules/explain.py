"""Explanations from provenance: the rule applications that turn the input into the output.

Every compiled rule records its firings in the e-graph (`engine.compile.Provenance`): the
e-class its left side matched, its variables' values and the iteration.  From a firing the
left side and the right side are rebuilt as e-nodes of that class (the variables' classes
below them), so each firing is an edge from one e-node of the class to another; a
store-to-load forwarding firing is an edge from the load to the e-node of the value it carries.

The chain is found top-down, kernel by kernel, from the input kernel's value to the extracted
one (both in the kernel's root class).  At a subterm whose top e-node differs from the
target's, the fewest firings of its class that lead from one to the other are replayed (each
first reshaping the subterm's children into the firing's left side, recursively); then the
children are explained the same way.  Every step is replayed as it is found, with the pattern
matcher and guard evaluator of `bbrules.patterns`, so a chain that does not replay is never
reported: the search raises `ExplainError` instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable, Generator, Mapping

from .engine import ClassGraph, CompiledPack, ENode, Firing, Provenance, enode_key
from .errors import Span
from .ir import (BlockProgram, Dim, Load, Monoid, Node, children, postorder, rename_axes,
                 show_node)
from .options import Meter, Options
from .patterns import Binding
from .program import fold
from .rule import AxisSize, CExpr, Pattern, PConst, PVar, Rule, Stored, pattern_var

Key = tuple  # an e-node: (kind, attrs, child classes); a load's child classes are ()


class ExplainError(Exception):
    """The recorded firings do not connect the input to the output (a bug to report)."""


@dataclass(frozen=True)
class Step:
    """One rule application: in kernel `kernel`, the subterm at `path` (child indices from the
    kernel's value) was `before` and became `after`."""

    kernel: str
    path: tuple[int, ...]
    rule: str
    reverse: bool  # the right-to-left direction of a two-way rule
    iteration: int  # when the e-graph first recorded this application
    span: Span | None = field(compare=False)
    before: Node
    after: Node

    def __str__(self) -> str:
        where = f"{_relative(self.span.path)}:{self.span.line}: " if self.span else ""
        name = self.rule + (" (reverse)" if self.reverse else "")
        return (f"{where}{name} in {self.kernel}, iteration {self.iteration}\n"
                f"    {_short(show_node(self.before))}\n"
                f" -> {_short(show_node(self.after))}")

    def to_json(self) -> dict:
        return {"rule": self.rule, "reverse": self.reverse, "iteration": self.iteration,
                "at": str(self.span) if self.span else None, "kernel": self.kernel,
                "path": list(self.path), "before": show_node(self.before),
                "after": show_node(self.after)}


def _relative(path: str) -> str:
    """`path` from the working directory, when it lies below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _short(text: str, width: int = 150) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


@dataclass(frozen=True, eq=False)
class _Goal:
    """What a subterm must become: a term of class `cls` whose top e-node is `key` and whose
    children satisfy `kids`; with `key` None, any term of the class.  Goals are compared by
    identity (they are memo keys): a structural hash would walk the whole goal tree."""

    cls: int
    key: Key | None = None
    kids: tuple[_Goal, ...] = ()


@dataclass(frozen=True)
class _Op:
    """One distinct subpattern of a rule side, as `Explainer.compiled` lists them (children
    first): a variable (`kind` its name), a constant, a `load(store(...))` (`attrs` the
    ordinal of its tensor and axes variables) or any other node (`attrs` each attribute, with
    whether it is a variable's name).  `kids` index the ops before it."""

    form: str
    kind: str
    attrs: tuple
    kids: tuple[int, ...]
    pattern: Pattern


@dataclass(frozen=True)
class _Edge:
    """A firing as a rewrite of its class's e-node `source` into `target`.  A rule whose right
    side is one of its left side's variables (`?x * 1.0 => ?x`) has no target e-node of its
    own (`target` None): it turns the term into that variable's subterm, which then goes on
    from whatever e-node that subterm is."""

    firing: Firing
    provenance: Provenance
    lhs: _Goal
    target: Key | None


def stored_values(p: BlockProgram) -> dict[str, tuple[tuple[str, ...], Node]]:
    """What a load of each intermediate carries in the e-graph: its axes and stored value."""
    return {k.tensor: (k.axes, k.value) for k in p.stores}


class Explainer:
    """Finds the chain for one fusion: its input program, the saturated e-graph (frozen with
    provenance) and the compiled pack that recorded it."""

    def __init__(self, source: BlockProgram, graph: ClassGraph, compiled: CompiledPack,
                 options: Options = Options(), meter: Meter | None = None):
        self.meter = meter
        self.source = source
        self.graph = graph
        self.dims: Mapping[str, Dim] = source.dims
        self.stored = stored_values(source)
        self.depth = options.explain_depth
        self.edges: dict[tuple[int, Key], list[_Edge]] = {}
        self.collapses: dict[tuple[int, Key], list[_Edge]] = {}
        self.memo: dict[tuple[Node, _Goal], tuple[Node, tuple[Step, ...]]] = {}
        # Each rule side's ops, by the pattern's id (kept with it, so the id stays its own).
        self.patterns: dict[int, tuple[tuple[_Op, ...], Pattern]] = {}
        self.check_budget()
        firings = sorted(graph.firings(meter), key=lambda f: (f.iteration, f.ruleset))
        for i, f in enumerate(firings):
            if i % 1024 == 0:
                self.check_budget()
            edge = self.edge(f, compiled.provenance[f.ruleset])
            if edge is not None:
                table = self.edges if edge.target is not None else self.collapses
                table.setdefault((f.root, edge.lhs.key), []).append(edge)

    def check_budget(self) -> None:
        spent = self.meter.over() if self.meter is not None else None
        if spent is not None:
            raise ExplainError(f"the fusion's {spent} ran out first")

    def carried(self, load: Load) -> Node | None:
        """The value a load of an intermediate carries (renamed to the load's axes)."""
        if load.tensor not in self.stored:
            return None
        axes, value = self.stored[load.tensor]
        return rename_axes(value, dict(zip(axes, load.axes)))

    def key(self, t: Node) -> Key | None:
        kind, attrs = enode_key(t)
        if kind == "Load":
            return kind, attrs, ()
        kids = tuple(self.graph.lookup(c) for c in children(t))
        return None if None in kids else (kind, attrs, kids)

    # -- firings as edges

    def edge(self, f: Firing, prov: Provenance) -> _Edge | None:
        """The firing as an edge, or None if it rewrote nothing (its two sides are one e-node)."""
        binding = Binding(self.dims,
                          axes={v: x for v, x in f.values.items() if isinstance(x, str)},
                          monoids={v: x for v, x in f.values.items() if isinstance(x, Monoid)},
                          consts={v: x for v, x in f.values.items() if isinstance(x, float)})
        lhs = self.goal(prov.lhs, f, binding, prov.stored)
        if lhs is None or lhs.cls != f.root or lhs.key is None:
            return None
        match prov.lhs, prov.rhs:
            case Stored(PVar(v)), PVar(w) if v == w:
                value = self.carried(ENode(*lhs.key).build(()))
                target = None if value is None else self.key(value)
            case _, PVar(w):
                return _Edge(f, prov, lhs, None) if f.values.get(w) == f.root else None
            case _:
                rhs = self.goal(prov.rhs, f, binding, ())
                target = None if rhs is None or rhs.cls != f.root else rhs.key
        if target is None or target == lhs.key:
            return None
        return _Edge(f, prov, lhs, target)

    def goal(self, root: Pattern, f: Firing, binding: Binding,
             stored: tuple[tuple[str, str], ...]) -> _Goal | None:
        """Pattern `root` under a firing's values, as a goal over the e-graph's classes (built
        bottom-up; `stored` gives each `load(store(...))` its tensor and axes variables, in
        pre-order), None where some part of it is not in the graph."""
        goals: list[_Goal] = []
        for op in self.compiled(root):
            kids = tuple(map(goals.__getitem__, op.kids))
            match op.form:
                case "var":
                    goal: _Goal | None = _Goal(f.values[op.kind])
                case "const":
                    goal = self.node_goal("Const", (binding.constant(op.pattern),), ())
                case "stored":
                    tensor, axes = stored[op.attrs[0]]
                    axes_text = f.values[axes]
                    goal = self.node_goal("Load", (f.values[tensor], tuple(
                        axes_text.split(",")) if axes_text else ()), kids)
                case _:
                    goal = self.node_goal(op.kind, tuple(
                        f.values[a[1]] if a[0] else a[1] for a in op.attrs), kids)
            if goal is None:
                return None
            goals.append(goal)
        return goals[-1]

    def compiled(self, root: Pattern) -> tuple[_Op, ...]:
        """Pattern `root` as its distinct subpatterns, children first (`_Op`): worked out once
        per pattern, where a firing of it is turned into a goal (GPT-2's MLP block records
        98,000 firings)."""
        ops = self.patterns.get(id(root))
        if ops is None:
            index: dict[int, int] = {}
            loads = 0

            def parts(p: Pattern) -> tuple[Pattern, ...]:
                nonlocal loads
                match p:
                    case Stored(v):
                        index[id(p)] = loads  # (asked parents first, left to right)
                        loads += 1
                        return (v,)
                    case PVar() | PConst() | CExpr() | AxisSize():
                        return ()
                return children(p)

            built: list[_Op] = []

            def make(p: Pattern, kids: list[int]) -> int:
                match p:
                    case PVar(v):
                        op = _Op("var", v, (), (), p)
                    case PConst() | CExpr() | AxisSize():
                        op = _Op("const", "Const", (), (), p)
                    case Stored():
                        op = _Op("stored", "Load", (index[id(p)],), tuple(kids), p)
                    case _:
                        kind, attrs = enode_key(p)
                        op = _Op("node", kind, tuple(
                            (True, pattern_var(a)) if pattern_var(a) is not None else (False, a)
                            for a in attrs), tuple(kids), p)
                built.append(op)
                return len(built) - 1

            fold(root, make, parts)
            ops = self.patterns[id(root)] = (tuple(built), root)
        return ops[0]

    def node_goal(self, kind: str, attrs: tuple, kids: tuple[_Goal, ...]) -> _Goal | None:
        key = (kind, attrs, () if kind == "Load" else tuple(k.cls for k in kids))
        cls = self.graph.index.get(key)
        return None if cls is None else _Goal(cls, key, kids)

    # -- the search

    def route(self, cls: int, start: Key, goal: Key, collapse: bool = False
              ) -> list[_Edge] | None:
        """The fewest firings in class `cls` that lead from e-node `start` to `goal`.  With
        `collapse`, a firing that turns a term into one of its variables' subterms counts as
        reaching the goal: what that subterm is shows only when it is applied, and the search
        goes on from there."""
        back: dict[Key, _Edge | None] = {start: None}
        frontier = [start]
        while frontier and goal not in back:
            nxt = []
            for k in frontier:
                for e in self.collapses.get((cls, k), ())[:1] if collapse else ():
                    back.setdefault(goal, replace(e, target=goal))
                for e in self.edges.get((cls, k), ()):
                    if e.target not in back:
                        back[e.target] = e
                        nxt.append(e.target)
            frontier = nxt
        if goal not in back:
            return None
        path: list[_Edge] = []
        k = goal
        while (e := back[k]) is not None:
            path.append(e)
            k = e.lhs.key
        return path[::-1]

    def derive(self, t: Node, goal: _Goal) -> tuple[Node, tuple[Step, ...]]:
        """`t` rewritten until it meets `goal`, and the steps (paths relative to `t`)."""
        return _trampoline(self._derive(t, goal, 0), self.check_budget)

    def _derive(self, t: Node, goal: _Goal, depth: int) -> Derivation:
        """`derive` as a generator that yields the derivations it needs (see `_trampoline`).

        `depth` counts rewrites nested below rewrites, which the options bound; descending
        into children is bounded by the term itself."""
        if goal.key is None:
            return t, ()
        memo = self.memo.get((t, goal))
        if memo is not None:
            return memo
        if depth > self.depth:
            raise ExplainError(f"rewrites nest deeper than {self.depth} at {show_node(t)}")
        start = t
        steps: list[Step] = []
        seen = set()
        while (key := self.key(t)) != goal.key:
            route = None if key is None else (self.route(goal.cls, key, goal.key)
                                              or self.route(goal.cls, key, goal.key, True))
            if not route or key in seen:
                raise ExplainError(f"no recorded rewrite turns {_short(show_node(t))} into "
                                   f"the output's {goal.key[0]} node")
            seen.add(key)
            t, done = yield self._apply(t, route[0], depth)
            steps += done
        if goal.kids and goal.key[0] != "Load":
            kids = []
            for i, (c, g) in enumerate(zip(children(t), goal.kids)):
                new, done = yield self._derive(c, g, depth)
                kids.append(new)
                steps += [replace(s, path=(i, *s.path)) for s in done]
            t = ENode(*goal.key).build(tuple(kids))
        self.memo[(start, goal)] = result = (t, tuple(steps))
        return result

    def _apply(self, t: Node, edge: _Edge, depth: int) -> Derivation:
        """Reshape `t` into the edge's left side, then apply its rule there."""
        t, steps = yield self._derive(t, edge.lhs, depth + 1)
        prov = edge.provenance
        after = apply_rule(prov.rule, prov.lhs, prov.rhs, t, self.dims, self.carried)
        if after is None:
            raise ExplainError(f"rule {prov.rule.name} does not apply to {show_node(t)}")
        step = Step("", (), prov.rule.name, prov.lhs is not prov.rule.lhs,
                    edge.firing.iteration, prov.rule.span, t, after)
        return after, (*steps, step)

    def chain(self, result: BlockProgram) -> list[Step]:
        """The steps that turn each kernel of the input into the same kernel of `result`."""
        source = {k.tensor: k.value for k in self.source.stores}
        out: list[Step] = []
        for k in result.stores:
            root = self.graph.named[k.tensor]
            target = self.target_goal(k.value, root)
            got, steps = self.derive(source[k.tensor], target)
            if got != k.value:
                raise ExplainError(f"kernel {k.tensor}: the chain ends in {show_node(got)}")
            out += [replace(s, kernel=k.tensor) for s in steps]
        return out

    def target_goal(self, root: Node, cls: int | None = None) -> _Goal:
        """The goal of being exactly term `root` (in class `cls`, if given), built bottom-up."""
        goals: dict[Node, _Goal] = {}
        for n in postorder(root):
            kids = tuple(goals[c] for c in children(n)) if not isinstance(n, Load) else ()
            key = self.key(n)
            c = self.graph.lookup(n) if cls is None or n is not root else cls
            if key is None or c is None:
                raise ExplainError(f"the output term {_short(show_node(n))} is not in the "
                                   f"e-graph")
            goals[n] = _Goal(c, key, kids)
        return goals[root]


Derivation = Generator["Generator", tuple[Node, tuple[Step, ...]],
                       tuple[Node, tuple[Step, ...]]]


def _trampoline(top: Derivation, check: Callable[[], None]) -> tuple[Node, tuple[Step, ...]]:
    """Run a derivation whose sub-derivations are yielded to here, not called: the chain of
    pending derivations lives on this list, so terms of any depth are explained.  `check` is
    called every so many steps (it raises when the budget is spent)."""
    stack, value, steps = [top], None, 0
    while stack:
        steps += 1
        if steps % 256 == 0:
            check()
        try:
            stack.append(stack[-1].send(value))
            value = None
        except StopIteration as done:
            stack.pop()
            value = done.value
    return value


def apply_rule(rule: Rule, lhs: Pattern, rhs: Pattern, t: Node, dims: Mapping[str, Dim],
               carried) -> Node | None:
    """One direction of `rule` applied at the root of `t`: the built right side, or None when
    the left side does not match or a guard fails.  `carried(load)` gives the value a load of
    an intermediate reads, for `load(store(...))`."""
    b = Binding(dims)
    if not b.match(lhs, t, carried) or not all(b.holds(g) for g in rule.guards):
        return None
    return b.build(rhs)


def explain(source: BlockProgram, result: BlockProgram, graph: ClassGraph,
            compiled: CompiledPack, options: Options = Options(),
            meter: Meter | None = None) -> list[Step]:
    """The chain of rule applications from `source` to `result` (see the module docstring),
    given up with `ExplainError` when `meter` says the budget is spent."""
    return Explainer(source, graph, compiled, options, meter).chain(result)


def replay(source: BlockProgram, steps: list[Step], rules: Mapping[str, Rule]
           ) -> dict[str, Node]:
    """Apply `steps` to `source`'s kernels, each at its path, checking that each rule matches
    there, its guards hold and it builds the step's `after`; the kernels' values at the end.

    Raises `ExplainError` at the first step that does not replay.
    """
    values = {k.tensor: k.value for k in source.stores}
    stored = stored_values(source)

    def carried(load: Load) -> Node | None:
        if load.tensor not in stored:
            return None
        axes, value = stored[load.tensor]
        return rename_axes(value, dict(zip(axes, load.axes)))

    for s in steps:
        rule = rules[s.rule]
        lhs, rhs = (rule.rhs, rule.lhs) if s.reverse else (rule.lhs, rule.rhs)
        at = _subterm(values[s.kernel], s.path)
        after = apply_rule(rule, lhs, rhs, at, source.dims, carried)
        if after is None or after != s.after or at == after:
            raise ExplainError(f"step {s.rule} in {s.kernel} at {s.path} does not replay")
        values[s.kernel] = _replace_at(values[s.kernel], s.path, after)
    return values


def _subterm(t: Node, path: tuple[int, ...]) -> Node:
    for i in path:
        t = children(t)[i]
    return t


def _replace_at(t: Node, path: tuple[int, ...], new: Node) -> Node:
    """`t` with the subterm at `path` replaced by `new`."""
    spine = [t]
    for i in path:
        spine.append(children(spine[-1])[i])
    for node, i in zip(reversed(spine[:-1]), reversed(path)):
        kids = list(children(node))
        kids[i] = new
        new = ENode(*enode_key(node), ()).build(tuple(kids))
    return new
