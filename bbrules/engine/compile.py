"""Compiling a rule pack to one egglog program.

- the `Term` datatype (`terms`), and the analyses `shape` and `deps` as functions from Term
  to a set of axes, merged by intersection and computed by the `analysis` ruleset, which runs
  to saturation before every iteration.  Every rule preserves shape and deps (the rule
  checker rejects one that does not), so structurally computed sets agree within an e-class:
  the intersection is exact and both `in` and `not in` guards are sound.  egglog cannot read a
  function inside a rule's actions, so guards bind the analyses in the query.
- axis sizes (`block`, `extent`, `trips`) as f64 functions set per program; constant
  arithmetic of a right-hand side (`const(?c * ?d)`) is computed in the query, so a failing
  primitive (division by zero) simply does not match.
- one egglog ruleset per rule, so the Python scheduler can ban a single rule (back-off).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Iterator, Mapping, NoReturn

from ..errors import SourceError, Span
from ..instantiate import variables
from ..ir import (BUILTIN_MONOIDS, KINDS, Const, Get, Load, Monoid, Sort, Var, children,
                  postorder)
from ..ops import BINARY, COMPARE, UNARY
from ..program import fold
from ..rule import (AxisEq, AxisIn, AxisSize, CExpr, ConstCmp, Guard, Pattern, PConst, PVar,
                    Rule, RulePack, Stage, Stored, TripsEq, pattern_var)
from .terms import MAX_TUPLE, MIN_TUPLE, TERM_DATATYPE, _f64, _q, enode_key, node_text

ANALYSIS = "__analysis"


ITERATION = "iteration"  # a 0-ary function Python sets to the iteration about to run
STAMP = "__stamp"  # the ruleset stamping new records with it


SORTS = ("Term", "String", "f64")  # the sorts of a recorded variable, in row order
_PADDING = {"Term": "?__root", "String": '""', "f64": "0.0"}


@dataclass(frozen=True)
class Provenance:
    """How one direction of a rule records where it applies.

    A copy of the rule's query in ruleset `record_<rs>`, run just before every iteration the
    rule runs in (so on the graph that iteration matches), inserts a row into the relation
    `fired` for each new match: the rule's `index`, the e-class of the matched left side and
    the values of the left side's variables (`columns`: name and egglog sort, in the order the
    left side binds them; `stored` names the tensor and axes variables of each
    `load(store(...))` in it, in pre-order).  One relation serves every rule: its row has as
    many slots of each sort as the widest rule needs (`widths`), unused ones padded.  The
    `__stamp` rule then moves new rows into the function `when`, whose value is the iteration
    they were first applied in.  The rule itself is left alone: an action of its own would
    make a rewrite that adds nothing count as a change, and egglog cannot read the iteration
    in a rule's actions (binding it in the query would make every old match new again
    whenever it changes).
    """

    index: int
    ruleset: str
    rule: Rule
    lhs: Pattern
    rhs: Pattern
    columns: tuple[tuple[str, str], ...]
    stored: tuple[tuple[str, str], ...]

    @cached_property
    def monoid_vars(self) -> tuple[str, ...]:
        """The left side's monoid variables (recorded as names, read back as monoids): read
        for every recorded firing, so worked out once."""
        return tuple(v for v, kind in variables(self.lhs).items() if kind == "monoid")

    @property
    def recorder(self) -> str:
        """The ruleset of the recording copy of the rule."""
        return f"record_{self.ruleset}"

    def row(self, widths: Mapping[str, int]) -> str:
        """The recorded row, in egglog syntax over the query's variables."""
        out = [str(self.index), "?__root"]
        for sort in SORTS:
            names = [name for name, s in self.columns if s == sort]
            out += names + [_PADDING[sort]] * (widths[sort] - len(names))
        return " ".join(out)

    def slots(self, widths: Mapping[str, int]) -> tuple[tuple[str, str, int], ...]:
        """(variable, sort, column) of each recorded variable in a row of `when` (after its
        index and root)."""
        out: list[tuple[str, str, int]] = []
        at = 2
        for sort in SORTS:
            names = [name for name, s in self.columns if s == sort]
            out += [(name, sort, at + i) for i, name in enumerate(names)]
            at += widths[sort]
        return tuple(out)


def _provenance_text(provenance: Iterable[Provenance], queries: Iterable[str],
                     widths: Mapping[str, int]) -> str:
    """The `fired` relation, the `when` function, the stamp rule and every recording rule."""
    sorts = " ".join(["i64", "Term", *(sort for sort in SORTS for _ in range(widths[sort]))])
    row = " ".join(["?__r", "?__root", *(f"?__v{i}" for i in range(sum(widths.values())))])
    lines = [f"(relation fired ({sorts}))",
             f"(function when ({sorts}) i64 :merge (min old new))",
             f"(ruleset {STAMP})",
             f"(rule ((fired {row}) (= ?__it ({ITERATION}))) ((set (when {row}) ?__it) "
             f"(delete (fired {row}))) :ruleset {STAMP})"]
    for prov, query in zip(provenance, queries):
        lines.append(f"(ruleset {prov.recorder})")
        lines.append(f"(rule ({query}) ((fired {prov.row(widths)})) :ruleset {prov.recorder})")

    return "\n".join(lines)


class _RuleCompiler:
    """One direction of one rule as an egglog `rule`: a query (lhs + guards) and a union; and
    the rule recording its matches."""

    def __init__(self, rule: Rule, lhs: Pattern, rhs: Pattern, egg_name: str, ruleset: str,
                 index: int):
        self.rule = rule
        self.facts: list[str] = []
        self.fresh = 0
        self.term_vars: set[str] = set()
        self.const_vars: set[str] = set()
        self.columns: dict[str, str] = {}
        self.stored: list[tuple[str, str]] = []
        self.ground_loads: list[Load] = []
        if isinstance(lhs, PVar):
            self.error("a left-hand side must be a node, not a bare variable")
        root = self.lhs(lhs)
        self.facts.insert(0, f"(= ?__root {root})")
        for g in rule.guards:
            self.guard(g)
        out = self.rhs(rhs)
        self.provenance = Provenance(index, ruleset, rule, lhs, rhs,
                                     tuple(self.columns.items()), tuple(self.stored))
        self.query = " ".join(self.facts)
        self.text = (f"(rule ({self.query}) ((union ?__root {out})) "
                     f":ruleset {ruleset} :name {_q(egg_name)})")

    def error(self, message: str) -> NoReturn:
        span = self.rule.span or Span("<rules>", 1, 1)
        raise SourceError(span, f"rule '{self.rule.name}': {message}")

    def var(self, prefix: str) -> str:
        self.fresh += 1
        return f"?__{prefix}{self.fresh}"

    # -- patterns

    def lhs(self, root: Pattern) -> str:
        """The left side as an egglog query term, built bottom-up (patterns of any depth)."""
        stored: dict[int, tuple[str, str]] = {}

        def parts(p: Pattern) -> tuple[Pattern, ...]:
            match p:
                case Stored(v):
                    stored[id(p)] = tensor, axes = self.var("t"), self.var("ax")
                    self.stored.append((tensor, axes))
                    self.columns.update({tensor: "String", axes: "String"})
                    return (v,)
                case CExpr() | AxisSize():
                    self.error("constant arithmetic belongs on the right-hand side")
            return children(p)

        def text(p: Pattern, kids: list[str]) -> str:
            match p:
                case PVar(name):
                    self.term_vars.add(name)
                    self.columns.setdefault(name, "Term")
                    return name
                case PConst(name):
                    self.const_vars.add(name)
                    self.columns.setdefault(name, "f64")
                    return f"(Cst {name})"
                case Stored():
                    return f"(LdS {' '.join(stored[id(p)])} {kids[0]})"
            out = self.node(p, iter(kids))
            for a in enode_key(p)[1]:
                name = pattern_var(a)
                if name is not None:
                    self.columns.setdefault(name, "String")
            return out

        return fold(root, text, parts)

    def rhs(self, root: Pattern) -> str:
        """The right side as an egglog action term, built bottom-up."""
        def parts(p: Pattern) -> tuple[Pattern, ...]:
            if isinstance(p, Stored):
                self.error("load(store(...)) can only be matched, not built")
            return children(p)

        def text(p: Pattern, kids: list[str]) -> str:
            match p:
                case PVar(name):
                    return self.bound(name, self.term_vars)
                case PConst(name):
                    return f"(Cst {self.bound(name, self.const_vars)})"
                case CExpr() | AxisSize():
                    k = self.var("k")
                    self.facts.append(f"(= {k} {self.const_expr(p)})")
                    return f"(Cst {k})"
            return self.node(p, iter(kids))

        return fold(root, text, parts)

    def bound(self, name: str, names: set[str]) -> str:
        """`name`, which the left-hand side must bind (it is among `names`)."""
        if name not in names:
            self.error(f"'{name}' is not bound by the left-hand side")
        return name

    def node(self, p: Pattern, kids: Iterator[str]) -> str:
        """One constructor application whose children's texts come from `kids`, in order."""
        if isinstance(p, Load):
            self.ground_loads.append(p)
        try:
            return node_text(p, lambda _: next(kids))
        except ValueError as err:
            self.error(str(err))

    # -- constants and guards

    def const_expr(self, root: object) -> str:
        """Constant arithmetic as an egglog f64 expression, built bottom-up."""
        def text(e: object, args: list[str]) -> str:
            match e:
                case PConst(name):
                    return self.bound(name, self.const_vars)
                case Const(v):
                    return _f64(v)
                case AxisSize(kind, axis):
                    return f"(a{kind} {axis})"
                case CExpr(op):
                    table = UNARY if len(args) == 1 else BINARY
                    if op not in table or not table[op].f64 or len(args) > 2:
                        self.error(f"cannot fold '{op}' of constants")
                    return table[op].f64.format(**dict(zip("xy", args)))
            self.error(f"not a constant expression: {e!r}")

        return fold(root, text, lambda e: e.args if isinstance(e, CExpr) else ())

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
                self.facts.append(f"({COMPARE[op][1]} {self.const_expr(PConst(var))} "
                                  f"{self.const_expr(value)})")


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
    less the axis it works along from its shape (an in-tile reduction, a contraction); a
    position spans and depends on its own axis (it had neither: a depthwise convolution's
    output, which depends on its positions only through the one-hot that picks its window,
    then merged with its load lost them, and `hoist_mul` took the image's gate out of a sum
    over the image).  A load gets its sets as facts when it is added; tuples are typed per
    component through `Get`; a reduction's results are typed per monoid.
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
        shape, deps = union([f"?s{k}" for k in kids]), union([f"?d{k}" for k in kids])
        axis = next((f for f in kind.attr_fields if kind.sort_of(f) is Sort.AXIS), None)
        if axis is not None and not kids:  # a position: a tile over its axis
            shape = deps = f"(set-of ?{axis})"
        elif axis is not None:
            shape = f"(set-remove {shape} ?{axis})"
        query = f"({' '.join([kind.egg, *names, *('?' + k for k in kids)])})"
        out.append(rule(query, kids, shape, deps))
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


_PRELUDE = f"""
(sort AxSet (Set String))
{TERM_DATATYPE}
(function shape (Term) AxSet :merge (set-intersect old new))
(function deps (Term) AxSet :merge (set-intersect old new))
(function ablock (String) f64 :merge old)
(function aextent (String) f64 :merge old)
(function atrips (String) f64 :merge old)
(function {ITERATION} () i64 :merge new)
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
    provenance: dict[str, Provenance]  # egglog ruleset -> how its rule records firings
    widths: dict[str, int]  # slots of each sort in a provenance row
    monoids: dict[str, Monoid]  # what the monoid names in the e-graph mean


def compile_pack(pack: RulePack, rules: Iterable[Rule] | None = None) -> CompiledPack:
    """The egglog program of `pack` (or of just `rules` of it, for check cases)."""
    chosen = list(pack.rules if rules is None else rules)
    monoids = pack_monoids(pack)
    lines = [_PRELUDE, *_analysis_rules(monoids.values())]
    rulesets: dict[str, list[str]] = {}
    egg_rules: dict[str, str] = {}
    loads: list[Load] = []
    provenance: dict[str, Provenance] = {}
    queries: list[str] = []
    for i, rule in enumerate(chosen):
        for j, (name, lhs, rhs) in enumerate(_egg_rules(rule)):
            rs = f"r{i}_{j}"
            compiled = _RuleCompiler(rule, lhs, rhs, name, rs, len(provenance))
            lines.append(f"(ruleset {rs})")
            lines.append(compiled.text)
            loads.extend(compiled.ground_loads)
            rulesets.setdefault(rule.ruleset, []).append(rs)
            egg_rules[rs] = name
            provenance[rs] = compiled.provenance
            queries.append(compiled.query)
    widths = {sort: max((sum(s == sort for _, s in p.columns) for p in provenance.values()),
                        default=0) for sort in SORTS}
    lines.append(_provenance_text(provenance.values(), queries, widths))
    return CompiledPack("\n".join(lines), rulesets, egg_rules, _stages(pack, rulesets),
                        tuple(dict.fromkeys(loads)), provenance, widths, monoids)


def pack_monoids(pack: RulePack) -> dict[str, Monoid]:
    """What each monoid name means in the e-graph of `pack`: the builtins and its own."""
    return {**BUILTIN_MONOIDS, **{m.name: m for m in pack.monoids}}


def _stages(pack: RulePack, rulesets: Mapping[str, list[str]]) -> tuple[Stage, ...]:
    """The pack's stages, plus a final `default` stage for rulesets no stage names."""
    named = {rs for s in pack.stages for rs in s.rulesets}
    rest = tuple(rs for rs in rulesets if rs not in named)
    return tuple(pack.stages) + ((Stage("default", rest),) if rest else ())


def size_facts(dims: Mapping[str, tuple[int, int]]) -> list[str]:
    """egglog facts giving each axis's block, extent and trip count."""
    out = []
    for a, (extent, block) in sorted(dims.items()):
        out.append(f"(set (ablock {_q(a)}) {_f64(block)})")
        out.append(f"(set (aextent {_q(a)}) {_f64(extent)})")
        out.append(f"(set (atrips {_q(a)}) {_f64(extent // block)})")
    return out
