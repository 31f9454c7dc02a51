"""The e-graph engine: rules compiled to egglog, saturated in budgeted stages.

A rule pack becomes one egglog program (`compile_pack`):

- one datatype `Term` with a constructor per IR node.  Axes, monoids and operator names are
  Strings, constants f64.  A load of a program input is `(Ld tensor "a,b")`; a load of a stored
  intermediate is `(LdS tensor "a,b" value)`, carrying the value its kernel stores (renamed to
  the load's axes), so store-to-load forwarding is an ordinary rule `load(store(?v)) => ?v`.
  Tuples are `Tup2`..`TupN` (egglog constructors have a fixed arity).
- the analyses `shape` and `deps` as functions from Term to a set of axes, merged by
  intersection and computed by the `analysis` ruleset, which runs to saturation before every
  iteration.  Every rule preserves shape and deps (the rule checker rejects one that does not),
  so structurally computed sets agree within an e-class: the intersection is exact and both
  `in` and `not in` guards are sound.  egglog cannot read a function inside a rule's actions,
  so guards bind the analyses in the query.
- axis sizes (`block`, `extent`, `trips`) as f64 functions set per program; constant arithmetic
  of a right-hand side (`const(?c * ?d)`) is computed in the query, so a failing primitive
  (division by zero) simply does not match.
- one egglog ruleset per rule, so the Python scheduler can ban a single rule (back-off).

Saturation (`Saturator.run`) goes stage by stage and iteration by iteration: after each
iteration it checks the e-node count and the clock, and stops on the first budget hit.  Every
stage uses egg's back-off: a rule that matched more than its limit in one iteration is banned
for a while and its limit doubles, which keeps commutativity and associativity from crowding
out everything else.  egglog applies an iteration's matches before Python sees their number,
so a ban starts with the next iteration; the node budget bounds what one iteration can add.

The saturated e-graph is read back through `EGraph.freeze()` (rows of every constructor) into
a `ClassGraph` for extraction; nothing is parsed from printed text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, NoReturn

from egglog.bindings import EGraph

from .errors import SourceError, Span
from .ir import (BUILTIN_MONOIDS, KINDS, Const, Get, Kind, Load, Monoid, Node, Sort, Var, attrs,
                 build, children, postorder, rename_axes, show_node)
from .rule import (AxisEq, AxisIn, AxisSize, Check, CExpr, ConstCmp, Guard, PAxis, Pattern,
                   PConst, PMonoid, PVar, Rule, RulePack, Stage, Stored, TripsEq)

ANALYSIS = "__analysis"
MIN_TUPLE = 2
MAX_TUPLE = 8
MATCH_LIMIT = 1000  # egg's back-off defaults: initial match limit and ban length
BAN_LENGTH = 5

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Budget:
    """Limits on saturation.  Hitting one is not an error: extraction uses what was found.

    `nodes` caps the e-nodes of the graph, `iterations` the iterations of each stage (a stage
    may declare a lower cap), `seconds` the wall time of all stages together.  The defaults
    keep the paper's examples far inside a 2-core, 24 GiB machine (a few thousand e-nodes).
    """

    nodes: int = 40_000
    iterations: int = 16
    seconds: float = 20.0


@dataclass(frozen=True)
class StageStats:
    """What one stage did.  `stop` is "saturated", "iteration limit", "node limit",
    "time limit", or "skipped" when an earlier stage exhausted a global budget."""

    stage: str
    iterations: int
    enodes: int
    eclasses: int
    seconds: float
    stop: str
    matches: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"stage": self.stage, "iterations": self.iterations, "enodes": self.enodes,
                "eclasses": self.eclasses, "seconds": self.seconds, "stop": self.stop,
                "matches": dict(self.matches)}


# --------------------------------------------------------------------------------------------
# The e-graph as the extractor sees it


@dataclass(frozen=True)
class ENode:
    """One e-node: an IR node whose children are e-class ids.

    `kind` is the IR class name (`Load`, `Const`, `Unary`, ...).  `attrs` are its attribute
    fields in declaration order (`ir.attrs`), a reduction's monoid as the `Monoid` itself.  A
    load of a stored intermediate has its carried value's class as its only child.
    """

    kind: str
    attrs: tuple
    children: tuple[int, ...]

    def build(self, kids: tuple[Node, ...]) -> Node:
        """The IR node with the given child terms (a stored load ignores its carried value)."""
        return build(KIND_BY_NAME[self.kind], self.attrs, kids)


def enode_key(n: Node) -> tuple[str, tuple]:
    """(kind, attrs) of an IR node, as its e-node has them."""
    return type(n).__name__, attrs(n)


@dataclass
class ClassGraph:
    """A frozen e-graph: e-classes (ids from 0, in a deterministic order) and their e-nodes."""

    classes: dict[int, tuple[ENode, ...]]
    named: dict[str, int]  # e-class of every term added by name (roots, check terms)
    index: dict[tuple, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # An e-node (kind, attrs, child classes) lives in exactly one e-class.  A load is
        # identified by tensor and axes alone: the value it carries follows from them.
        self.index = {}
        for c, nodes in self.classes.items():
            for n in nodes:
                kids = () if n.kind == "Load" else n.children
                self.index[(n.kind, n.attrs, kids)] = c

    @property
    def n_nodes(self) -> int:
        return sum(len(ns) for ns in self.classes.values())

    def enode_of(self, n: Node) -> ENode | None:
        """The e-node representing IR node `n`, if its whole term is in the graph."""
        kind, attrs = enode_key(n)
        kids = tuple(self.lookup(c) for c in children(n))
        if any(k is None for k in kids):
            return None
        key = (kind, attrs, () if kind == "Load" else kids)
        c = self.index.get(key)
        if c is None:
            return None
        return next(e for e in self.classes[c] if (e.kind, e.attrs) == (kind, attrs)
                    and (kind == "Load" or e.children == kids))

    def lookup(self, n: Node) -> int | None:
        """The e-class of IR term `n`, or None if the term is not represented."""
        kind, attrs = enode_key(n)
        kids = tuple(self.lookup(c) for c in children(n))
        if any(k is None for k in kids):
            return None
        return self.index.get((kind, attrs, () if kind == "Load" else kids))


# --------------------------------------------------------------------------------------------
# Compiling a pack


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _f64(v: float) -> str:
    return repr(float(v))


def _axis(a: str | PAxis) -> str:
    return a.name if isinstance(a, PAxis) else _q(a)


def _attr_text(value: object, sort: Sort) -> str:
    """An attribute as an egglog literal (or a pattern variable), by what its field holds."""
    match value:
        case PAxis(name) | PMonoid(name):
            return name
    match sort:
        case Sort.AXES:
            return _q(",".join(value))  # type: ignore[arg-type]
        case Sort.NUMBER:
            return _f64(value)  # type: ignore[arg-type]
        case Sort.INDEX:
            return str(int(value))  # type: ignore[call-overload]
        case Sort.MONOID:
            return _q(value.name)  # type: ignore[attr-defined]
    return _q(str(value))


def _set(axes: Iterable[str]) -> str:
    items = sorted(set(axes))
    return f"(set-of {' '.join(map(_q, items))})" if items else "(set-empty)"


_CONST_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "max": "max", "min": "min"}
_CONST_UNARY = {"neg": "(neg {x})", "exp": "(exp {x})", "log": "(log {x})",
                "sqrt": "(sqrt {x})", "rsqrt": "(/ 1.0 (sqrt {x}))", "recip": "(/ 1.0 {x})",
                "abs": "(abs {x})", "square": "(* {x} {x})"}
_CMP = {"==": "=", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}


class _RuleCompiler:
    """One direction of one rule as an egglog `rule`: a query (lhs + guards) and a union."""

    def __init__(self, rule: Rule, lhs: Pattern, rhs: Pattern, egg_name: str, ruleset: str):
        self.rule = rule
        self.facts: list[str] = []
        self.fresh = 0
        self.term_vars: set[str] = set()
        self.const_vars: set[str] = set()
        self.ground_loads: list[Load] = []
        if isinstance(lhs, PVar):
            self.error("a left-hand side must be a node, not a bare variable")
        root = self.lhs(lhs)
        self.facts.insert(0, f"(= ?__root {root})")
        for g in rule.guards:
            self.guard(g)
        out = self.rhs(rhs)
        self.text = (f"(rule ({' '.join(self.facts)}) ((union ?__root {out})) "
                     f":ruleset {ruleset} :name {_q(egg_name)})")

    def error(self, message: str) -> NoReturn:
        span = self.rule.span or Span("<rules>", 1, 1)
        raise SourceError(span, f"rule '{self.rule.name}': {message}")

    def var(self, prefix: str) -> str:
        self.fresh += 1
        return f"?__{prefix}{self.fresh}"

    # -- patterns

    def lhs(self, p: Pattern) -> str:
        match p:
            case PVar(name):
                self.term_vars.add(name)
                return name
            case PConst(name):
                self.const_vars.add(name)
                return f"(Cst {name})"
            case Stored(v):
                return f"(LdS {self.var('t')} {self.var('ax')} {self.lhs(v)})"
            case CExpr() | AxisSize():
                self.error("constant arithmetic belongs on the right-hand side")
        return self.node(p, self.lhs)

    def rhs(self, p: Pattern) -> str:
        match p:
            case PVar(name):
                if name not in self.term_vars:
                    self.error(f"'{name}' is not bound by the left-hand side")
                return name
            case PConst(name):
                if name not in self.const_vars:
                    self.error(f"'{name}' is not bound by the left-hand side")
                return f"(Cst {name})"
            case CExpr() | AxisSize():
                k = self.var("k")
                self.facts.append(f"(= {k} {self.const_expr(p)})")
                return f"(Cst {k})"
            case Stored():
                self.error("load(store(...)) can only be matched, not built")
        return self.node(p, self.rhs)

    def node(self, p: Pattern, sub: Callable[[Pattern], str]) -> str:
        if isinstance(p, Load):
            self.ground_loads.append(p)
        try:
            return node_text(p, sub)
        except ValueError as err:
            self.error(str(err))

    # -- constants and guards

    def const_expr(self, e: object) -> str:
        match e:
            case PConst(name):
                if name not in self.const_vars:
                    self.error(f"'{name}' is not bound by the left-hand side")
                return name
            case Const(v):
                return _f64(v)
            case AxisSize(kind, axis):
                return f"(a{kind} {axis})"
            case CExpr(op, (x,)) if op in _CONST_UNARY:
                return _CONST_UNARY[op].format(x=self.const_expr(x))
            case CExpr(op, (x, y)) if op in _CONST_BINARY:
                return f"({_CONST_BINARY[op]} {self.const_expr(x)} {self.const_expr(y)})"
            case CExpr(op, _):
                self.error(f"cannot fold '{op}' of constants")
        self.error(f"not a constant expression: {e!r}")

    def analysis_of(self, var: str, analysis: str) -> str:
        if var in self.const_vars:
            return "(set-empty)"
        if var not in self.term_vars:
            self.error(f"guard on '{var}', which the left-hand side does not bind")
        s = self.var("s")
        self.facts.append(f"(= {s} ({analysis} {var}))")
        return s

    def guard(self, g: Guard) -> None:
        match g:
            case AxisIn(axis, analysis, var, negated):
                s = self.analysis_of(var, analysis)
                op = "set-not-contains" if negated else "set-contains"
                self.facts.append(f"({op} {s} {axis})")
            case AxisEq(left, right, negated):
                self.facts.append(f"({'!=' if negated else '='} {left} {right})")
            case TripsEq(left, right):
                self.facts.append(f"(= (atrips {left}) (atrips {right}))")
            case ConstCmp(var, op, value):
                self.facts.append(f"({_CMP[op]} {self.const_expr(PConst(var))} "
                                  f"{self.const_expr(value)})")


def node_text(p: Pattern, sub: Callable[[Pattern], str]) -> str:
    """One constructor application in egglog syntax, its children written by `sub`."""
    kind = getattr(type(p), "kind", None)
    if kind is None or kind.egg is None:
        raise ValueError(f"not a term node: {p!r}")
    args = [_attr_text(getattr(p, f), kind.sort_of(f)) for f in kind.attr_fields]
    kids = [sub(c) for c in children(p)]
    egg = kind.egg
    if any(s is Sort.CHILDREN for _, s in kind.fields):
        if not MIN_TUPLE <= len(kids) <= MAX_TUPLE:
            raise ValueError(f"tuples have {MIN_TUPLE} to {MAX_TUPLE} components")
        egg += str(len(kids))
    return f"({' '.join([egg, *args, *kids])})"


def _egg_rules(rule: Rule) -> list[tuple[str, Pattern, Pattern]]:
    """(egglog rule name, lhs, rhs) for each direction of a rule."""
    out = [(rule.name, rule.lhs, rule.rhs)]
    if rule.bidirectional:
        out.append((rule.name + " (reverse)", rule.rhs, rule.lhs))
    return out


def rule_of(egg_name: str) -> str:
    """The pack rule an egglog rule name belongs to."""
    return egg_name.removesuffix(" (reverse)")


def _analysis_rules(monoids: Iterable[Monoid]) -> list[str]:
    """Rules computing shape and deps of every constructor from its children's.

    Derived from the kind declarations: a node spans and depends on what its children do,
    less the axis it works along from its shape (an in-tile reduction, a contraction).  A load
    gets its sets as facts when it is added; tuples are typed per component through `Get`;
    a reduction's results are typed per monoid.
    """
    def rule(query: str, kids: Iterable[str], shape: str, deps: str) -> str:
        binds = " ".join(f"(= ?s{k} (shape ?{k})) (= ?d{k} (deps ?{k}))" for k in kids)
        return (f"(rule ((= ?e {query}) {binds}) ((set (shape ?e) {shape}) "
                f"(set (deps ?e) {deps})) :ruleset {ANALYSIS})")

    def union(sets: list[str]) -> str:
        out = sets[0] if sets else "(set-empty)"
        for s in sets[1:]:
            out = f"(set-union {out} {s})"
        return out

    out = []
    for cls in KINDS:
        kind = cls.kind
        if kind.egg is None or kind.loop or cls in (Load, Get) \
                or any(s is Sort.CHILDREN for _, s in kind.fields):
            continue
        names = [f"?{f}" for f in kind.attr_fields]
        kids = [f for f, _ in kind.child_fields]
        shape = union([f"?s{k}" for k in kids])
        axis = next((f for f in kind.attr_fields if kind.sort_of(f) is Sort.AXIS), None)
        if axis is not None:
            shape = f"(set-remove {shape} ?{axis})"
        query = f"({' '.join([kind.egg, *names, *('?' + k for k in kids)])})"
        out.append(rule(query, kids, shape, union([f"?d{k}" for k in kids])))
    for n in range(MIN_TUPLE, MAX_TUPLE + 1):
        names = [f"x{i}" for i in range(n)]
        tup = f"(Tup{n} {' '.join('?' + x for x in names)})"
        out += [rule(f"(Get {i} {tup})", names, f"?sx{i}", f"?dx{i}") for i in range(n)]
    for m in monoids:
        # A reduction's result i has the type of the state components finalize[i] reads,
        # without the reduced axis among its dependencies.
        names = [f"x{i}" for i in range(m.arity)]
        arg = "?x0" if m.arity == 1 else f"(Tup{m.arity} {' '.join('?' + x for x in names)})"
        for j, f in enumerate(m.finalize):
            used = sorted({m.state.index(v.name) for v in postorder(f) if isinstance(v, Var)})
            query = f"(Red ?a {_q(m.name)} {arg})"
            if len(m.finalize) > 1:
                query = f"(Get {j} {query})"
            out.append(rule(query, names, union([f"?sx{i}" for i in used]),
                            f"(set-remove {union([f'?dx{i}' for i in used])} ?a)"))
    return out


_EGG_SORT = {Sort.NUMBER: "f64", Sort.INDEX: "i64", Sort.CHILD: "Term"}


def _constructors() -> dict[str, tuple[Kind, tuple[str, ...]]]:
    """Every Term constructor: its kind and its argument sorts.  A tuple has one constructor
    per arity (egglog constructors have a fixed arity); a load of a stored intermediate
    (`LdS`) carries the value it reads as one more argument."""
    out = {}
    for cls in KINDS:
        kind = cls.kind
        if kind.egg is None:
            continue
        sorts = tuple(_EGG_SORT.get(s, "String") for f, s in kind.fields if not s.is_child)
        kids = tuple("Term" for _, s in kind.child_fields if s is Sort.CHILD)
        if any(s is Sort.CHILDREN for _, s in kind.fields):
            for n in range(MIN_TUPLE, MAX_TUPLE + 1):
                out[f"{kind.egg}{n}"] = (kind, sorts + ("Term",) * n)
        else:
            out[kind.egg] = (kind, sorts + kids)
        if cls is Load:
            out["LdS"] = (kind, sorts + ("Term",))
    return out


CONSTRUCTORS = _constructors()
TERM_CONSTRUCTORS = tuple(CONSTRUCTORS)
KIND_BY_NAME = {cls.__name__: cls.kind for cls in KINDS}

_PRELUDE = f"""
(sort AxSet (Set String))
(datatype Term
  {' '.join(f"({' '.join((name, *sorts))})" for name, (_, sorts) in CONSTRUCTORS.items())})
(function shape (Term) AxSet :merge (set-intersect old new))
(function deps (Term) AxSet :merge (set-intersect old new))
(function ablock (String) f64 :merge old)
(function aextent (String) f64 :merge old)
(function atrips (String) f64 :merge old)
(ruleset {ANALYSIS})
"""


@dataclass(frozen=True)
class CompiledPack:
    """egglog text for a pack: declarations, analysis, one ruleset per rule direction."""

    text: str
    rulesets: dict[str, list[str]]  # pack ruleset -> egglog rulesets of its rules
    egg_rules: dict[str, str]  # egglog ruleset -> egglog rule name
    stages: tuple[Stage, ...]
    ground_loads: tuple[Load, ...]
    monoids: dict[str, Monoid]  # what the monoid names in the e-graph mean


def compile_pack(pack: RulePack, rules: Iterable[Rule] | None = None) -> CompiledPack:
    """The egglog program of `pack` (or of just `rules` of it, for check cases)."""
    chosen = list(pack.rules if rules is None else rules)
    lines = [_PRELUDE, *_analysis_rules(pack_monoids(pack).values())]
    rulesets: dict[str, list[str]] = {}
    egg_rules: dict[str, str] = {}
    loads: list[Load] = []
    for i, rule in enumerate(chosen):
        for j, (name, lhs, rhs) in enumerate(_egg_rules(rule)):
            rs = f"r{i}_{j}"
            compiled = _RuleCompiler(rule, lhs, rhs, name, rs)
            lines.append(f"(ruleset {rs})")
            lines.append(compiled.text)
            loads.extend(compiled.ground_loads)
            rulesets.setdefault(rule.ruleset, []).append(rs)
            egg_rules[rs] = name
    return CompiledPack("\n".join(lines), rulesets, egg_rules, _stages(pack, rulesets),
                        tuple(dict.fromkeys(loads)), pack_monoids(pack))


def pack_monoids(pack: RulePack) -> dict[str, Monoid]:
    """What each monoid name means in the e-graph of `pack`: the builtins and its own."""
    return {**BUILTIN_MONOIDS, **{m.name: m for m in pack.monoids}}


def _stages(pack: RulePack, rulesets: Mapping[str, list[str]]) -> tuple[Stage, ...]:
    """The pack's stages, plus a final `default` stage for rulesets no stage names."""
    named = {rs for s in pack.stages for rs in s.rulesets}
    rest = tuple(rs for rs in rulesets if rs not in named)
    return tuple(pack.stages) + ((Stage("default", rest),) if rest else ())


# --------------------------------------------------------------------------------------------
# Terms


class TermWriter:
    """Writes IR terms into egglog text as `let` bindings, sharing equal subterms.

    `stored` maps an intermediate tensor to (its declared axes, the value its kernel stores):
    a load of it becomes `LdS` carrying that value renamed to the load's axes.
    """

    def __init__(self, prefix: str = "n",
                 stored: Mapping[str, tuple[tuple[str, ...], Node]] | None = None):
        self.prefix = prefix
        self.stored = dict(stored or {})
        self.names: dict[Node, str] = {}
        self.lines: list[str] = []

    def name(self, n: Node) -> str:
        if n in self.names:
            return self.names[n]
        match n:
            case Load(t, axes) if t in self.stored:
                decl_axes, value = self.stored[t]
                carried = rename_axes(value, dict(zip(decl_axes, axes)))
                text = (f"(LdS {_q(t)} {_q(','.join(axes))} {self.name(carried)})"
                        if carried is not None else f"(Ld {_q(t)} {_q(','.join(axes))})")
            case Load(t, axes):
                text = f"(Ld {_q(t)} {_q(','.join(axes))})"
            case Var(v):
                raise ValueError(f"free variable '{v}' in a term")
            case _:
                text = node_text(n, self.name)
        g = f"${self.prefix}{len(self.names)}"
        self.names[n] = g
        self.lines.append(f"(let {g} {text})")
        if isinstance(n, Load):
            axes = _set(n.axes)
            self.lines.append(f"(set (shape {g}) {axes})")
            self.lines.append(f"(set (deps {g}) {axes})")
        return g


def size_facts(dims: Mapping[str, tuple[int, int]]) -> list[str]:
    """egglog facts giving each axis's block, extent and trip count."""
    out = []
    for a, (extent, block) in sorted(dims.items()):
        out.append(f"(set (ablock {_q(a)}) {_f64(block)})")
        out.append(f"(set (aextent {_q(a)}) {_f64(extent)})")
        out.append(f"(set (atrips {_q(a)}) {_f64(extent // block)})")
    return out


# --------------------------------------------------------------------------------------------
# Saturation


@dataclass
class _BackOff:
    """egg's back-off state of one rule: over `limit << times_banned` matches bans it."""

    limit: int
    times_banned: int = 0
    banned_until: int = -1


class Saturator:
    """An egglog e-graph holding one compiled pack and the terms added to it."""

    def __init__(self, compiled: CompiledPack, dims: Mapping[str, tuple[int, int]]):
        self.compiled = compiled
        self.egraph = EGraph()
        self.writer = TermWriter()
        self.roots: dict[str, str] = {}
        self.combined: dict[frozenset[str], str] = {}
        self.fired: list[tuple[int, str, int]] = []  # (global iteration, rule, matches)
        self.iteration = 0
        ground = TermWriter(prefix="g")
        for load in compiled.ground_loads:
            ground.name(load)
        self._exec(compiled.text)
        self._exec("\n".join(size_facts(dims) + ground.lines))

    def _exec(self, text: str) -> list:
        return self.egraph.run_program(*self.egraph.parse_program(text))

    def add_terms(self, terms: Mapping[str, Node],
                  stored: Mapping[str, tuple[tuple[str, ...], Node]] | None = None) -> None:
        """Add named terms (roots); loads of tensors in `stored` carry their values."""
        self.writer.stored.update(stored or {})
        start = len(self.writer.lines)
        for key, n in terms.items():
            self.roots[key] = self.writer.name(n)
        self._exec("\n".join(self.writer.lines[start:]))

    def enodes(self) -> int:
        """E-nodes of the Term constructors (the analyses and let bindings not counted)."""
        sizes = self._exec("(print-size)")[0].sizes
        return sum(n for name, n in sizes if name in TERM_CONSTRUCTORS)

    def _ruleset_for(self, active: list[str]) -> str:
        key = frozenset(active)
        if key not in self.combined:
            name = f"c{len(self.combined)}"
            self._exec(f"(unstable-combined-ruleset {name} {' '.join(sorted(active))})")
            self.combined[key] = name
        return self.combined[key]

    def run(self, budget: Budget = Budget(), progress: Progress | None = None,
            stages: Iterable[Stage] | None = None) -> list[StageStats]:
        """Run the stages in order within `budget`; one StageStats per stage.

        After a node or time limit stops a stage, the later stages are skipped: the graph has
        already used what it was allowed.
        """
        stats: list[StageStats] = []
        deadline = time.perf_counter() + budget.seconds
        for stage in (self.compiled.stages if stages is None else stages):
            if stats and stats[-1].stop in ("node limit", "time limit", "skipped"):
                stats.append(self._stage_stats(stage, 0, 0.0, "skipped", {}))
            else:
                stats.append(self._run_stage(stage, budget, deadline, progress))
        return stats

    def _run_stage(self, stage: Stage, budget: Budget, deadline: float,
                   progress: Progress | None) -> StageStats:
        start = time.perf_counter()
        rulesets = [rs for name in stage.rulesets for rs in self.compiled.rulesets.get(name, [])]
        cap = min(budget.iterations, stage.iterations or budget.iterations)
        backoff = {rs: _BackOff(MATCH_LIMIT) for rs in rulesets}
        matches: dict[str, int] = {}
        done = 0
        stop = "saturated"
        while rulesets:
            if done >= cap:
                stop = "iteration limit"
                break
            active = [rs for rs in rulesets if backoff[rs].banned_until < done]
            self._exec(f"(run-schedule (saturate (run {ANALYSIS})))")
            report = self._exec(f"(run-schedule (run {self._ruleset_for(active)}))")[0].report \
                if active else None
            done += 1
            self.iteration += 1
            for rs in active:
                n = report.num_matches_per_rule.get(self.compiled.egg_rules[rs], 0)
                if n:
                    rule = rule_of(self.compiled.egg_rules[rs])
                    matches[rule] = matches.get(rule, 0) + n
                    self.fired.append((self.iteration, rule, n))
                b = backoff[rs]
                if n > b.limit << b.times_banned:
                    b.banned_until = done + (BAN_LENGTH << b.times_banned)
                    b.times_banned += 1
            if report is None or not report.updated:
                banned = [b for b in backoff.values() if b.banned_until >= done]
                if not banned:
                    break
                for b in banned:  # nothing else changes: lift the bans early, as egg does
                    b.banned_until = -1
            if progress:
                progress(f"stage {stage.name}: iteration {done}")
            if self.enodes() > budget.nodes:
                stop = "node limit"
                break
            if time.perf_counter() > deadline:
                stop = "time limit"
                break
        self._exec(f"(run-schedule (saturate (run {ANALYSIS})))")
        return self._stage_stats(stage, done, time.perf_counter() - start, stop, matches)

    def _stage_stats(self, stage: Stage, iterations: int, seconds: float, stop: str,
                     matches: dict[str, int]) -> StageStats:
        graph = self.freeze()
        return StageStats(stage.name, iterations, graph.n_nodes, len(graph.classes), seconds,
                          stop, matches)

    def freeze(self) -> ClassGraph:
        """The current e-graph as e-classes of e-nodes, with the class of every root."""
        return _read_back(self.egraph, self.roots, self.compiled.monoids)


def _read_back(egraph: EGraph, roots: Mapping[str, str], monoids: Mapping[str, Monoid]
               ) -> ClassGraph:
    frozen = egraph.freeze()
    ids: dict[object, int] = {}

    def cid(v: object) -> int:
        return ids.setdefault(v, len(ids))

    classes: dict[int, list[ENode]] = {}
    for name in TERM_CONSTRUCTORS:
        fn = frozen.functions.get(name)
        if fn is None:
            continue
        for row in fn.rows:
            if row.subsumed:
                continue
            node = _decode(egraph, name, row.inputs, cid, monoids)
            classes.setdefault(cid(row.output), []).append(node)
    named = {}
    for key, g in roots.items():
        fn = frozen.functions[g]
        named[key] = cid(fn.rows[0].output)
    return ClassGraph({c: tuple(dict.fromkeys(ns)) for c, ns in classes.items()}, named)


def _decode(egraph: EGraph, name: str, inputs: list, cid: Callable[[object], int],
            monoids: Mapping[str, Monoid]) -> ENode:
    """One row of a Term constructor as an e-node, attributes decoded by their sorts."""
    kind = CONSTRUCTORS[name][0]
    values = []
    for f, value in zip(kind.attr_fields, inputs):
        match kind.sort_of(f):
            case Sort.NUMBER:
                values.append(egraph.value_to_f64(value))
            case Sort.INDEX:
                values.append(egraph.value_to_i64(value))
            case Sort.AXES:
                values.append(_axes(egraph.value_to_string(value)))
            case Sort.MONOID:
                values.append(monoids[egraph.value_to_string(value)])
            case _:
                values.append(egraph.value_to_string(value))
    kids = tuple(cid(v) for v in inputs[len(kind.attr_fields):])
    return ENode(kind.name, tuple(values), kids)


def _axes(text: str) -> tuple[str, ...]:
    return tuple(text.split(",")) if text else ()


# --------------------------------------------------------------------------------------------
# Check cases

CHECK_BUDGET = Budget(nodes=5_000, iterations=8, seconds=5.0)


@dataclass(frozen=True)
class CheckFailure:
    """A check case of a pack that did not hold."""

    check: Check
    message: str

    def __str__(self) -> str:
        where = f"{self.check.span}: " if self.check.span else ""
        return f"{where}check {self.check.rule}: {self.message}"


def run_checks(pack: RulePack, budget: Budget = CHECK_BUDGET) -> list[CheckFailure]:
    """Run every `check` case of `pack`; the failures, in declaration order.

    A check runs only the rule (or ruleset) it names, from a fresh e-graph holding just its
    term, until saturation or `budget`.  `term => expect` holds when the expected term is then
    in the term's e-class, `term !=> expect` when it is not (so the direction of a one-way rule
    is checked), and a bare `term` when the rules never match it.  A `load(store(v))` of a
    check term is a load of the intermediate tensor `check.stored` names, written as `fuse`
    writes a program's: carrying the value stored, renamed to the load's axes.
    """
    failures = []
    compiled: dict[str, CompiledPack] = {}
    for check in pack.checks:
        target = check.rule
        if target not in compiled:
            chosen = [r for r in pack.rules if target in (r.name, r.ruleset)]
            compiled[target] = compile_pack(pack, chosen)
        cp = compiled[target]
        sat = Saturator(cp, check.dims)
        sat.add_terms({"term": check.term}, check.stored)
        stats = sat.run(budget, stages=[Stage("check", tuple(cp.rulesets))])
        graph = sat.freeze()
        same = check.expect is not None and graph.lookup(check.expect) == graph.named["term"]
        shown = show_node(check.term)
        if check.expect is None:
            if stats[0].matches:
                failures.append(CheckFailure(check, f"{shown} must not rewrite, but "
                                                    f"{', '.join(stats[0].matches)} matched it"))
        elif check.negated and same:
            failures.append(CheckFailure(check, f"{shown} must not rewrite to "
                                                f"{show_node(check.expect)}, but does"))
        elif not check.negated and not same:
            why = f" (saturation stopped: {stats[0].stop})" if stats[0].stop != "saturated" \
                else ""
            failures.append(CheckFailure(check, f"{shown} does not rewrite to "
                                                f"{show_node(check.expect)}{why}"))
    return failures
