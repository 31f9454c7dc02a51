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
from typing import Callable, Iterable, Mapping, NoReturn

from ..errors import SourceError, Span
from ..ir import MONOIDS, Const, Load, Monoid, Var, postorder, register_monoid
from ..rule import (AxisEq, AxisIn, AxisSize, CExpr, ConstCmp, Guard, Pattern, PConst, PVar,
                    Rule, RulePack, Stage, Stored, TripsEq)
from .terms import MAX_TUPLE, MIN_TUPLE, TERM_DATATYPE, _axis, _f64, _q, node_text

ANALYSIS = "__analysis"


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
                return f"(a{kind} {_axis(axis)})"
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
                self.facts.append(f"({op} {s} {_axis(axis)})")
            case AxisEq(left, right, negated):
                self.facts.append(f"({'!=' if negated else '='} {_axis(left)} {_axis(right)})")
            case TripsEq(left, right):
                self.facts.append(f"(= (atrips {_axis(left)}) (atrips {_axis(right)}))")
            case ConstCmp(var, op, value):
                self.facts.append(f"({_CMP[op]} {self.const_expr(PConst(var))} "
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
    """Rules computing shape and deps of every constructor from its children's."""
    def rule(query: str, kids: Iterable[str], shape: str, deps: str) -> str:
        binds = " ".join(f"(= ?s{k} (shape ?{k})) (= ?d{k} (deps ?{k}))" for k in kids)
        return (f"(rule ((= ?e {query}) {binds}) ((set (shape ?e) {shape}) "
                f"(set (deps ?e) {deps})) :ruleset {ANALYSIS})")

    def union(sets: list[str]) -> str:
        out = sets[0] if sets else "(set-empty)"
        for s in sets[1:]:
            out = f"(set-union {out} {s})"
        return out

    out = [
        rule("(Cst ?c)", [], "(set-empty)", "(set-empty)"),
        rule("(Un ?f ?x)", ["x"], "?sx", "?dx"),
        rule("(BRed ?f ?a ?x)", ["x"], "(set-remove ?sx ?a)", "?dx"),
        rule("(Bin ?f ?x ?y)", ["x", "y"], "(set-union ?sx ?sy)", "(set-union ?dx ?dy)"),
        rule("(Dot ?a ?x ?y)", ["x", "y"], "(set-remove (set-union ?sx ?sy) ?a)",
             "(set-union ?dx ?dy)"),
    ]
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


def compile_pack(pack: RulePack, rules: Iterable[Rule] | None = None) -> CompiledPack:
    """The egglog program of `pack` (or of just `rules` of it, for check cases)."""
    for m in pack.monoids:
        register_monoid(m)
    chosen = list(pack.rules if rules is None else rules)
    lines = [_PRELUDE, *_analysis_rules(MONOIDS.values())]
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
                        tuple(dict.fromkeys(loads)))


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
