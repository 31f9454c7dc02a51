"""`fuse`: a block program in, the cheapest equivalent block program the rules reach out.

The pipeline: every kernel's stored value goes into one e-graph (loads of intermediates carry
the value they read, so forwarding is a rule), the pack's stages saturate it within a budget,
and extraction picks the cheapest program by the exact cost model.  The result records what
happened: costs before and after, saturation statistics per stage (and which budget stopped
it), extraction statistics, and the chain of rules that built the output.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from .cost import ProgramCost, cost_program
from .engine import Budget, Progress, Saturator, StageStats, compile_pack
from .extract import ExtractStats, extract
from .ir import (KINDS, Binary, BlockProgram, BlockReduce, Const, Dim, Dot, Get, Load, Node,
                 Reduce, Tuple, Unary, children, postorder, rebuild, rename_axes, show_node,
                 validate)
from .ops import BINARY, UNARY
from .rule import AxisSize, CExpr, Pattern, PConst, PVar, Rule, RulePack, Stored, pattern_var
from .targets import Target

EXPLAIN_LIMIT = 2000  # terms examined when explaining (commutativity can feed itself)
_NODE_TYPES = tuple(KINDS)


@dataclass(frozen=True)
class Step:
    """One rule in the chain: where it first fired and one output subterm it built."""

    rule: str
    iteration: int
    example: str
    doc: str

    def __str__(self) -> str:
        head = f"{self.rule} (iteration {self.iteration})"
        return f"{head}: {self.doc}\n    {self.example}" if self.doc else \
            f"{head}\n    {self.example}"


@dataclass
class FuseResult:
    """The fused program and the report of how it was found."""

    program: BlockProgram
    before: ProgramCost
    after: ProgramCost
    stats: list[StageStats]
    extraction: ExtractStats
    chain: list[Step] = field(default_factory=list)
    objective: str = "time"

    @property
    def stop(self) -> str:
        """What ended saturation: the first budget hit, or "saturated"."""
        for s in self.stats:
            if s.stop not in ("saturated", "skipped"):
                return s.stop
        return "saturated"

    def explain(self) -> list[str]:
        """The rules that built the output, in the order they first fired.

        Exactly: a rule that fired during saturation is listed when its result side (either
        side of a two-way rule) matches a term that is new in the output, or new in what a
        listed rule was applied to: starting from the output's subterms that the input does
        not contain (even with its intermediates forwarded), each match's other side,
        instantiated with the match, gives terms that are explained in turn.  Guards are not
        re-checked, so a rule whose pattern fits is listed even if it was some other rule that
        built the term.  A `load(store(...))` rule is listed when an intermediate of the input
        is no longer stored.  Each entry gives the iteration the rule first fired in, its
        documentation and one term it explains.
        """
        return [str(s) for s in self.chain]

    def to_json(self) -> dict:
        return {
            "objective": self.objective,
            "before": self.before.to_json(),
            "after": self.after.to_json(),
            "saturation": [s.to_json() for s in self.stats],
            "stop": self.stop,
            "extraction": self.extraction.to_json(),
            "explain": [{"rule": s.rule, "iteration": s.iteration, "example": s.example}
                        for s in self.chain],
        }


def fuse(p: BlockProgram, pack: RulePack, target: Target, objective: str = "time",
         max_kernels: int | None = None, budget: Budget = Budget(),
         progress: Progress | None = None) -> FuseResult:
    """Fuse `p` with the rules of `pack`, minimising `objective` ("time" or "traffic") on
    `target`, with at most `max_kernels` kernels if given.

    Raises `extract.NoCandidate` when no legal program satisfies `max_kernels`.
    """
    validate(p)
    before = cost_program(p, target)
    before.key(objective)  # rejects an unknown objective before any work
    sat = Saturator(compile_pack(pack), {n: (d.extent, d.block) for n, d in p.dims.items()})
    sat.add_terms({k.tensor: k.value for k in p.kernels},
                  {k.tensor: (k.axes, k.value) for k in p.kernels})
    stats = sat.run(budget, progress)
    if progress:
        progress("extracting")
    program, after, xstats = extract(sat.freeze(), p, target, objective, max_kernels, progress)
    chain = _chain(p, program, pack.rules, sat.fired)
    return FuseResult(program, before, after, stats, xstats, chain, objective)


# --------------------------------------------------------------------------------------------
# Explaining


def _chain(source: BlockProgram, result: BlockProgram, rules: list[Rule],
           fired: list[tuple[int, str, int]]) -> list[Step]:
    """The explanation `FuseResult.explain` describes, found backwards from the output."""
    first: dict[str, int] = {}
    for iteration, rule, _ in fired:
        first.setdefault(rule, iteration)
    active = [r for r in rules if r.name in first]
    old = {n for k in source.kernels for n in postorder(k.value)}
    old |= {n for v in _forwarded(source).values() for n in postorder(v)}
    found: dict[str, str] = {}
    kept = {k.tensor for k in result.kernels}
    dropped = [k.tensor for k in source.kernels if k.tensor not in kept]
    todo = deque(n for k in result.kernels for n in postorder(k.value) if n not in old)
    seen: set[Node] = set()
    while todo and len(seen) < EXPLAIN_LIMIT:
        term = todo.popleft()
        if term in seen:
            continue
        seen.add(term)
        for rule in active:
            sides = [(rule.rhs, rule.lhs)] + ([(rule.lhs, rule.rhs)] if rule.bidirectional else [])
            for made, source_side in sides:
                env: dict[str, object] = {}
                if isinstance(made, PVar) or not _matches(made, term, env, source.dims):
                    continue
                if rule.name not in found:  # a term prints as a tree: print one per rule
                    found[rule.name] = show_node(term)
                before = _instantiate(source_side, env, source.dims)
                if before is not None:
                    todo.extend(n for n in postorder(before) if n not in old and n not in seen)
    for rule in active:
        if isinstance(rule.lhs, Stored) and dropped:
            found.setdefault(rule.name, "no longer stored: " + ", ".join(dropped))
    by_name = {r.name: r for r in rules}
    steps = [Step(name, first[name], _short(example),
                  by_name[name].doc.splitlines()[0] if by_name[name].doc else "")
             for name, example in found.items()]
    return sorted(steps, key=lambda s: (s.iteration, s.rule))


def _forwarded(p: BlockProgram) -> dict[str, Node]:
    """Every kernel's value with the loads of intermediates replaced by what they load."""
    values: dict[str, Node] = {}
    for k in p.kernels:
        memo: dict[Node, Node] = {}
        for n in postorder(k.value):
            if isinstance(n, Load) and n.tensor in values:
                decl = p.tensors[n.tensor].axes
                memo[n] = rename_axes(values[n.tensor], dict(zip(decl, n.axes))) or n
            else:
                memo[n] = rebuild(n, tuple(memo[c] for c in children(n)))
        values[k.tensor] = memo[k.value]
    return values


def _instantiate(p: Pattern, env: Mapping[str, object], sizes: Mapping[str, Dim]
                 ) -> Node | None:
    """A pattern with its variables replaced by `env`'s bindings, or None if one is unbound."""
    def axis(a: object) -> object | None:
        name = pattern_var(a)
        return a if name is None else env.get(name)

    def sub(q: Pattern) -> Node | None:
        return _instantiate(q, env, sizes)

    match p:
        case PVar(v):
            value = env.get(v)
            return value if isinstance(value, _NODE_TYPES) else None
        case PConst() | CExpr() | AxisSize():
            value = _const_value(p, env, sizes)
            return None if value is None else Const(value)
        case Stored():
            return None
    kids = [sub(c) for c in children(p)]
    if any(k is None for k in kids):
        return None
    match p:
        case BlockReduce(op, a, _):
            ax = axis(a)
            return None if ax is None else BlockReduce(op, ax, kids[0])
        case Dot(a, _, _):
            ax = axis(a)
            return None if ax is None else Dot(ax, kids[0], kids[1])
        case Reduce(a, m, _):
            ax, mono = axis(a), axis(m)
            return None if ax is None or mono is None else Reduce(ax, mono, kids[0])
    return rebuild(p, tuple(k for k in kids if k is not None))


def _short(text: str, width: int = 120) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _matches(p: Pattern, n: Node, env: dict[str, object], sizes: Mapping[str, Dim]) -> bool:
    """Does pattern `p` match IR node `n`, extending `env` (guards are not checked)?"""
    def bind(var: str, value: object) -> bool:
        if var in env:
            return env[var] == value
        env[var] = value
        return True

    def name(field_value: object, value: object) -> bool:
        var = pattern_var(field_value)
        return bind(var, value) if var is not None else field_value == value

    match p:
        case PVar(v):
            return bind(v, n)
        case PConst(v):
            return isinstance(n, Const) and bind(v, n.value)
        case CExpr() | AxisSize():
            value = _const_value(p, env, sizes)
            return isinstance(n, Const) and value is not None and math.isclose(
                value, n.value, rel_tol=1e-12, abs_tol=0.0)
        case Stored():
            return False
        case Load():
            return p == n
        case Const(v):
            return isinstance(n, Const) and n.value == v
        case Unary(op, x):
            return isinstance(n, Unary) and n.op == op and _matches(x, n.x, env, sizes)
        case Binary(op, x, y):
            return (isinstance(n, Binary) and n.op == op and _matches(x, n.x, env, sizes)
                    and _matches(y, n.y, env, sizes))
        case BlockReduce(op, a, x):
            return (isinstance(n, BlockReduce) and n.op == op and name(a, n.axis)
                    and _matches(x, n.x, env, sizes))
        case Dot(a, x, y):
            return (isinstance(n, Dot) and name(a, n.axis) and _matches(x, n.x, env, sizes)
                    and _matches(y, n.y, env, sizes))
        case Reduce(a, m, x):
            return (isinstance(n, Reduce) and name(a, n.axis) and name(m, n.monoid)
                    and _matches(x, n.x, env, sizes))
        case Tuple(items):
            return (isinstance(n, Tuple) and len(items) == len(n.items)
                    and all(_matches(i, j, env, sizes) for i, j in zip(items, n.items)))
        case Get(i, x):
            return isinstance(n, Get) and n.index == i and _matches(x, n.x, env, sizes)
    return False


def _const_value(e: object, env: Mapping[str, object], sizes: Mapping[str, Dim]
                 ) -> float | None:
    """The value of constant arithmetic under `env`, or None if a variable is unbound."""
    match e:
        case Const(v):
            return v
        case PConst(v):
            value = env.get(v)
            return value if isinstance(value, float) else None
        case AxisSize(kind, axis):
            bound = env.get(axis, axis)
            dim = sizes.get(bound) if isinstance(bound, str) else None
            if dim is None:
                return None
            return float({"block": dim.block, "extent": dim.extent, "trips": dim.blocks}[kind])
        case CExpr(op, args):
            values = [_const_value(a, env, sizes) for a in args]
            if any(v is None for v in values):
                return None
            table = UNARY if len(values) == 1 else BINARY
            with np.errstate(all="ignore"):
                return float(table[op].numpy(*values))
    return None
