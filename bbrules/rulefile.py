"""Rule files (.bbr): the rule language, parsed and validated into a `bbrules.rule.RulePack`.

A file is a sequence of declarations, each starting with a keyword (see `docs/rules.md`):
`ruleset`, `rule`, `stage` (declaring a stage, or `stage NAME += ...` joining one), `monoid`,
`tolerance` and `check`.  A pack is a directory of such files read together, so a check in one
file may name a rule of another, and a join a stage of another.

Everything is validated before anything runs, because a wrong rule silently produces wrong
programs: syntax, unknown functions and arities, unknown monoids, right-hand-side variables
the left side does not bind, guards on unbound variables, sides of different shape or
dependencies (found by instantiating the rule on fresh tiles), duplicate names, and checks or
stages naming things that do not exist.  Every mistake is a `SourceError` at its token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Mapping

from lark import Token

from .errors import SourceError, Span, read_source
from .exprsyntax import (Call, Expr, ExprTransformer, Indexed, MonoidDecl, Name, Num, PatVar,
                         Resolver, Scope, Size, article, parse, resolve_monoid)
from .instantiate import Instance, flipped, instances, value_variables
from .ir import (BUILTIN_MONOIDS, IRError, Load, Monoid, Node, Store, TileType, Type,
                 postorder, show_node, type_of)
from .patterns import NotInstantiable, checked_type
from .rule import AxisEq, AxisIn, Check, ConstCmp, Guard, PConst, Rule, RulePack, Stage, TripsEq

MAX_ITERATIONS = 10 ** 6  # a stage's iteration cap: far beyond any saturation, finite

# Declarations as parsed, before resolution ---------------------------------------------------


@dataclass(frozen=True)
class _Arrow:
    text: str
    span: Span


@dataclass(frozen=True)
class _Ruleset:
    name: Name


@dataclass(frozen=True)
class _Rule:
    name: Name
    lhs: Expr
    arrow: _Arrow
    rhs: Expr
    guards: tuple[object, ...]


@dataclass(frozen=True)
class _AxisIn:
    axis: PatVar
    analysis: Name
    var: PatVar
    negated: bool


@dataclass(frozen=True)
class _Compare:
    left: Expr
    op: str
    right: Expr
    span: Span


@dataclass(frozen=True)
class _Stage:
    name: Name
    rulesets: tuple[Name, ...]
    iterations: Num | None


@dataclass(frozen=True)
class _StageJoin:
    name: Name
    rulesets: tuple[Name, ...]


@dataclass(frozen=True)
class _Tolerance:
    name: Name
    value: Num


@dataclass(frozen=True)
class _Check:
    rule: Name
    term: Expr
    arrow: _Arrow | None
    expect: Expr | None
    sizes: tuple[Size, ...]


class _RuleTransformer(ExprTransformer):
    """One method per rule of bbr.lark."""

    def _pvar(self, tok: Token) -> PatVar:
        return PatVar(str(tok), self.span(tok))

    def start(self, children: list) -> list:
        return children

    def ruleset(self, children: list) -> _Ruleset:
        return _Ruleset(self._name(children[0]))

    def rule(self, children: list) -> _Rule:
        name, lhs, arrow, rhs, *guards = children
        return _Rule(self._name(name), lhs, _Arrow(str(arrow), self.span(arrow)), rhs,
                     tuple(g for g in guards if g is not None))

    def axis_in(self, children: list) -> _AxisIn:
        axis, analysis, var = children
        return _AxisIn(self._pvar(axis), self._name(analysis), self._pvar(var), False)

    def axis_not_in(self, children: list) -> _AxisIn:
        axis, analysis, var = children
        return _AxisIn(self._pvar(axis), self._name(analysis), self._pvar(var), True)

    def compare(self, children: list) -> _Compare:
        left, op, right = children
        return _Compare(left, str(op), right, self.span(op))

    def stage(self, children: list) -> _Stage:
        name, *rulesets, iterations = children
        return _Stage(self._name(name), tuple(self._name(r) for r in rulesets),
                      None if iterations is None else self._num(iterations))

    def stage_join(self, children: list) -> _StageJoin:
        name, *rulesets = children
        return _StageJoin(self._name(name), tuple(self._name(r) for r in rulesets))

    def tolerance(self, children: list) -> _Tolerance:
        name, value = children
        return _Tolerance(self._name(name), self._num(value))

    def check(self, children: list) -> _Check:
        name, term, arrow, expect, *sizes = children
        return _Check(self._name(name), term,
                      None if arrow is None else _Arrow(str(arrow), self.span(arrow)),
                      expect, tuple(s for s in sizes if s is not None))


@dataclass(frozen=True)
class _File:
    path: str
    text: str
    decls: list

    def doc(self, span: Span) -> str:
        """The comment block directly above line `span.line`, without the `#` marks."""
        lines = self.text.splitlines()
        doc: list[str] = []
        for line in reversed(lines[:span.line - 1]):
            if not line.lstrip().startswith("#"):
                break
            doc.append(line.lstrip()[1:].strip())
        return "\n".join(reversed(doc))


def _read(text: str, path: str) -> _File:
    return _File(path, text, parse("bbr.lark", text, path, _RuleTransformer(path)))


# Resolution -------------------------------------------------------------------------------


class _CheckResolver(Resolver):
    """Resolves the terms of one check, where `load(store(v))` reads back a stored block.

    Each distinct stored value becomes an intermediate tensor named `store1`, `store2`, ...
    over the value's axes (in the order its loads name them), and the load becomes a load of
    it, so the engine meets exactly what a program gives it: a load of an intermediate that
    carries the value its kernel stores.  `load(store(v), rename(k, t))` reads the block under
    renamed axes, as a program reads `S[q, k]` as `S[q, t]`.
    """

    def __init__(self, scope: Scope):
        super().__init__(scope)
        self.stored: dict[str, tuple[tuple[str, ...], Node]] = {}
        self.plain: dict[str, Span] = {}  # tensors loaded by name, where first

    @staticmethod
    def _reads_stored(e: Expr) -> bool:
        """`e` is `store(...)` or `load(store(...), ...)`: resolved here, not as a kind."""
        return isinstance(e, Call) and (e.func == "store" or e.func == "load" and bool(e.args)
                                        and isinstance(e.args[0], Call)
                                        and e.args[0].func == "store")

    def _operands(self, e: Expr) -> tuple[Expr, ...]:
        return () if self._reads_stored(e) else super()._operands(e)

    def call(self, e: Call, kids: list[Node]) -> Node:
        if e.func == "store":
            raise self.error(e.span, "store(...) appears only inside load(store(...))")
        if self._reads_stored(e):
            return self.stored_load(e.args[0], e.args[1:])
        return super().call(e, kids)

    def load(self, e: Expr) -> Node:
        if isinstance(e, Indexed):
            self.plain.setdefault(e.tensor, e.span)
        return super().load(e)

    def stored_load(self, store: Call, renames: tuple[Expr, ...]) -> Load:
        if len(store.args) != 1:
            raise self.error(store.span, f"store takes 1 argument (x), got {len(store.args)}")
        value = self.value(store.args[0])
        try:
            t = type_of(value)
        except IRError as err:
            raise self.error(store.args[0].span, f"ill-formed check term: {err}") from None
        if not isinstance(t, TileType) or t.shape != t.deps:
            raise self.error(store.args[0].span, f"only a tile whose shape equals its "
                                                 f"dependencies can be stored; this one has "
                                                 f"{_show_type(t)}")
        seen = dict.fromkeys(a for n in postorder(value) if isinstance(n, Load) for a in n.axes)
        axes = tuple(a for a in seen if a in t.shape)  # in the order the value's loads name them
        name = next((n for n, sv in self.stored.items() if sv == (axes, value)),
                    f"store{len(self.stored) + 1}")
        self.stored[name] = (axes, value)
        mapping: dict[str, str] = {}
        for r in renames:
            if not (isinstance(r, Call) and r.func == "rename" and len(r.args) == 2 and
                    all(isinstance(a, Name) for a in r.args)):
                raise self.error(r.span, "expected rename(axis, new name) after load(store(...))")
            old, new = r.args
            if old.name not in axes:
                raise self.error(old.span, f"'{old.name}' is not an axis of the stored block "
                                           f"(its axes: {', '.join(axes) or 'none'})")
            if old.name in mapping:
                raise self.error(old.span, f"'{old.name}' is renamed twice")
            mapping[old.name] = new.name
        renamed = tuple(mapping.get(a, a) for a in axes)
        if len(set(renamed)) != len(renamed):
            raise self.error(renames[-1].span, f"the renaming gives the block two axes of the "
                                               f"same name ({', '.join(renamed)})")
        return Load(name, renamed)


def _error(f: _File, span: Span, message: str) -> SourceError:
    return SourceError(span, message, f.text)


class _PackBuilder:
    """Resolves the declarations of a pack's files together, on top of earlier packs (`base`)."""

    def __init__(self, name: str, base: RulePack):
        self.base = base
        self.pack = RulePack(name)
        self.rulesets = {r.ruleset for r in base.rules}

    @property
    def monoids(self) -> dict[str, Monoid]:
        """The monoids a rule of this pack may name: builtins, earlier packs', its own."""
        return {**BUILTIN_MONOIDS, **{m.name: m for m in self.base.monoids + self.pack.monoids}}

    def build(self, files: list[_File]) -> RulePack:
        for f in files:
            for d in f.decls:
                if isinstance(d, MonoidDecl):
                    self.monoid(f, d)
        for f in files:
            ruleset = Path(f.path).stem
            for d in f.decls:
                if isinstance(d, _Ruleset):
                    ruleset = d.name.name
                    self.rulesets.add(ruleset)
                elif isinstance(d, _Rule):
                    self.rule(f, d, ruleset)
        for f in files:  # every stage first, so that a join may name one of a later file
            for d in f.decls:
                if isinstance(d, _Stage):
                    self.stage(f, d)
        for f in files:
            for d in f.decls:
                match d:
                    case _StageJoin():
                        self.join(f, d)
                    case _Tolerance():
                        self.tolerance(f, d)
                    case _Check():
                        self.check(f, d)
        return self.pack

    # monoids, stages, tolerances ------------------------------------------------------

    def monoid(self, f: _File, d: MonoidDecl) -> None:
        name = d.name.name
        if name in BUILTIN_MONOIDS:
            raise _error(f, d.name.span, f"'{name}' is a built-in monoid")
        if name in {m.name for m in self.pack.monoids}:
            raise _error(f, d.name.span, f"monoid '{name}' is declared twice in this pack")
        m = resolve_monoid(d, f.text, f.doc(d.span))
        earlier = self.monoids.get(name)
        if earlier is not None and earlier != m:
            raise _error(f, d.name.span, f"monoid '{name}' is already defined differently by "
                                         f"an earlier pack")
        if m not in self.base.monoids:  # an earlier pack's identical monoid is not repeated
            self.pack.monoids.append(m)

    def stage(self, f: _File, d: _Stage) -> None:
        name = d.name.name
        if any(s.name == name for s in self.pack.stages):
            raise _error(f, d.name.span, f"stage '{name}' is declared twice in this pack")
        if any(s.name == name for s in self.base.stages):
            raise _error(f, d.name.span, f"stage '{name}' is declared by an earlier pack; "
                                         f"'stage {name} += RULESET' adds rulesets to it")
        self.known_rulesets(f, d)
        iterations = None
        if d.iterations is not None:
            v = d.iterations.value
            if not 1 <= v <= MAX_ITERATIONS or v != int(v):
                raise _error(f, d.iterations.span, f"iterations must be an integer from 1 to {MAX_ITERATIONS}")
            iterations = int(v)
        self.pack.stages.append(Stage(d.name.name, tuple(r.name for r in d.rulesets),
                                      iterations))

    def join(self, f: _File, d: _StageJoin) -> None:
        """`stage NAME += RULESET, ...`: into a stage of this pack directly, into one of an
        earlier pack through `RulePack.joins` (applied when the packs are merged)."""
        name = d.name.name
        mine = next((i for i, s in enumerate(self.pack.stages) if s.name == name), None)
        earlier = next((s for s in self.base.stages if s.name == name), None)
        if mine is None and earlier is None:
            known = ", ".join(s.name for s in self.base.stages + self.pack.stages) or "none"
            raise _error(f, d.name.span, f"'stage {name} +=' names unknown stage '{name}' "
                                         f"(known: {known})")
        self.known_rulesets(f, d)
        present = list(self.pack.stages[mine].rulesets if mine is not None else
                       earlier.rulesets + self.pack.joins.get(name, ()))
        for r in d.rulesets:
            if r.name in present:
                raise _error(f, r.span, f"ruleset '{r.name}' is already in stage '{name}'")
            present.append(r.name)
        added = tuple(r.name for r in d.rulesets)
        if mine is not None:
            self.pack.stages[mine] = self.pack.stages[mine].joined(added)
        else:
            self.pack.joins[name] = self.pack.joins.get(name, ()) + added

    def known_rulesets(self, f: _File, d: _Stage | _StageJoin) -> None:
        for r in d.rulesets:
            if r.name not in self.rulesets:
                known = ", ".join(sorted(self.rulesets)) or "none"
                raise _error(f, r.span, f"stage '{d.name.name}' names unknown ruleset "
                                        f"'{r.name}' (known: {known})")

    def tolerance(self, f: _File, d: _Tolerance) -> None:
        if d.name.name not in self.rule_names:
            raise _error(f, d.name.span, f"tolerance for unknown rule '{d.name.name}'")
        if not 0 < d.value.value < 1:
            raise _error(f, d.value.span, "a relative tolerance is between 0 and 1")
        self.pack.tolerances[d.name.name] = d.value.value

    @property
    def rule_names(self) -> set[str]:
        return {r.name for r in self.base.rules + self.pack.rules}

    # rules ----------------------------------------------------------------------------

    def rule(self, f: _File, d: _Rule, ruleset: str) -> None:
        if d.name.name in self.rule_names:
            raise _error(f, d.name.span, f"rule '{d.name.name}' is declared twice")
        if d.arrow.text not in ("=>", "<=>"):
            raise _error(f, d.arrow.span, "a rule rewrites with '=>' or '<=>'")
        two_way = d.arrow.text == "<=>"
        lhs_scope = Scope(f.text, monoids=self.monoids, patterns=True)
        lhs = Resolver(lhs_scope).value(d.lhs)
        rhs_scope = Scope(f.text, monoids=self.monoids, patterns=True, rhs=not two_way)
        rhs = Resolver(rhs_scope).value(d.rhs)
        self.bound(f, rhs_scope.kinds, lhs_scope.kinds, "left")
        if two_way:
            self.bound(f, lhs_scope.kinds, rhs_scope.kinds, "right")
        guards = tuple(self.guard(f, g, lhs_scope) for g in d.guards)
        rule = Rule(d.name.name, lhs, rhs, guards, two_way, ruleset, f.doc(d.name.span),
                    d.name.span)
        for direction in (rule, flipped(rule)) if two_way else (rule,):
            mismatch = _type_mismatch(direction, self.monoids)
            if mismatch:
                raise _error(f, d.arrow.span, mismatch)
        self.pack.rules.append(rule)
        self.rulesets.add(ruleset)

    @staticmethod
    def bound(f: _File, used: dict[str, tuple[str, Span]], binding: dict[str, tuple[str, Span]],
              side: str) -> None:
        for var, (kind, span) in used.items():
            if var not in binding:
                raise _error(f, span, f"{var} is not bound by the {side}-hand side")
            if binding[var][0] != kind:
                raise _error(f, span, f"{var} is {article(kind)} here but "
                                      f"{article(binding[var][0])} in the {side}-hand side")

    def guard(self, f: _File, g: _AxisIn | _Compare, lhs: Scope) -> Guard:
        def bound(var: PatVar, kind: str) -> str:
            seen = lhs.kinds.get(var.name)
            if seen is None:
                raise _error(f, var.span, f"guard on {var.name}, which the left-hand side "
                                          f"does not bind")
            if seen[0] != kind:
                raise _error(f, var.span, f"{var.name} is {article(seen[0])} in the "
                                          f"left-hand side, not {article(kind)}")
            return var.name

        if isinstance(g, _AxisIn):
            if g.analysis.name not in ("shape", "deps"):
                raise _error(f, g.analysis.span, f"expected shape(...) or deps(...), not "
                                                 f"{g.analysis.name}(...)")
            return AxisIn(bound(g.axis, "axis"), g.analysis.name, bound(g.var, "value"),
                          g.negated)
        left, right = g.left, g.right
        if isinstance(left, Call) and isinstance(right, Call) and \
                left.func == right.func == "trips" and \
                all(len(c.args) == 1 and isinstance(c.args[0], PatVar) for c in (left, right)):
            if g.op != "==":
                raise _error(f, g.span, "trip counts compare only with ==")
            return TripsEq(bound(left.args[0], "axis"), bound(right.args[0], "axis"))
        if not isinstance(left, PatVar):
            raise _error(f, left.span, "expected a guard: ?a [not] in shape|deps(?x), ?a == ?b, "
                                       "?a != ?b, trips(?a) == trips(?b) or ?c <op> <constant>")
        if isinstance(right, PatVar) and lhs.kinds.get(left.name, ("",))[0] == "axis":
            if g.op not in ("==", "!="):
                raise _error(f, g.span, "axes compare only with == or !=")
            return AxisEq(bound(left, "axis"), bound(right, "axis"), g.op == "!=")
        var = bound(left, "constant")
        scope = replace(lhs, kinds=dict(lhs.kinds))
        value = Resolver(scope).cexpr(right)
        for v, (_, span) in scope.kinds.items():
            if v not in lhs.kinds:
                raise _error(f, span, f"guard on {v}, which the left-hand side does not bind")
        if isinstance(value, PConst):
            raise _error(f, right.span, "compare a constant variable with a number or constant "
                                        "arithmetic, not with another variable alone")
        return ConstCmp(var, g.op, value)

    # checks ---------------------------------------------------------------------------

    def check(self, f: _File, d: _Check) -> None:
        target = d.rule.name
        if target not in self.rule_names and target not in self.rulesets:
            raise _error(f, d.rule.span, f"check names unknown rule or ruleset '{target}'")
        if d.arrow is not None and d.arrow.text == "<=>":
            raise _error(f, d.arrow.span, "a check expects '=>' (rewrites to) or '!=>' (does "
                                          "not rewrite to)")
        resolver = _CheckResolver(Scope(f.text, monoids=self.monoids))
        term = self.ground(f, resolver, d.term)
        expect = None if d.expect is None else self.ground(f, resolver, d.expect)
        for tensor, span in resolver.plain.items():
            if tensor in resolver.stored:
                raise _error(f, span, f"'{tensor}' names a stored block in this check; load "
                                      f"another tensor")
        dims: dict[str, tuple[int, int]] = {}
        for s in d.sizes:
            if s.name.name in dims:
                raise _error(f, s.name.span, f"size of '{s.name.name}' given twice")
            dim = s.dim(f.text)
            dims[s.name.name] = (dim.extent, dim.block)
        self.pack.checks.append(Check(target, term, expect,
                                      d.arrow is None or d.arrow.text == "!=>", dims, d.rule.span,
                                      resolver.stored))

    @staticmethod
    def ground(f: _File, resolver: Resolver, e: Expr) -> Node:
        term = resolver.value(e)
        try:
            type_of(term)
        except IRError as err:
            raise _error(f, e.span, f"ill-formed check term: {err}") from None
        return term


def _type_mismatch(rule: Rule, monoids: Mapping[str, Monoid], tries: int = 150,
                   samples: int = 4, tuple_tries: int = 5) -> str | None:
    """Why the sides of `rule` differ in shape or deps, if some instantiation shows it.

    The left side is instantiated on fresh tiles under every layout that matters: no value
    variable a tuple (`samples` instances out of `tries`), then each one alone a tuple (one
    instance out of `tuple_tries`: most left sides reject a tuple at once, and
    `?x => ?x * 1.0` is ill-formed exactly when `?x` is one).  The random choices are seeded
    by the layout, never by the rule's name, so a rule's verdict does not depend on what it is
    called.  A rule whose left side no random choice makes well formed is not judged here.
    """
    layouts = [(frozenset(), tries, samples)]
    layouts += [(frozenset({v}), tuple_tries, 1) for v in value_variables(rule)]
    for layout, attempts, wanted in layouts:
        rng = random.Random(",".join(sorted(layout)))
        for inst in islice(instances(rule, rng, attempts, monoids, layout), wanted):
            problem = _instance_mismatch(rule, inst)
            if problem:
                return problem
    return None


def _instance_mismatch(rule: Rule, inst: Instance) -> str | None:
    stored: dict[Node, Store] = {}
    lhs, rhs = inst.build(rule.lhs, stored), inst.build(rule.rhs, stored)
    try:
        right = checked_type(rhs)
    except NotInstantiable as e:
        return (f"the right-hand side is ill-formed where the left is not "
                f"({inst.describe()}): {e}")
    left = type_of(lhs)
    if left != right:
        return (f"the two sides differ in shape or dependencies: with {inst.describe()}, "
                f"{show_node(lhs)} has {_show_type(left)} but {show_node(rhs)} has "
                f"{_show_type(right)}")
    return None


def _show_type(t: Type) -> str:
    parts = t if isinstance(t, tuple) else (t,)
    return "; ".join(f"shape {sorted(p.shape)}, deps {sorted(p.deps)}" for p in parts)


# Public API -------------------------------------------------------------------------------


def parse_rules(text: str, path: str = "<string>", base: RulePack | None = None) -> RulePack:
    """Parse and validate one rule file as a pack of its own (named after the file).

    `base`: packs loaded before this one, whose rules, rulesets and monoids it may name.
    """
    return _PackBuilder(Path(path).stem, base or RulePack("base")).build([_read(text, path)])


def load_pack(directory: str | Path, base: RulePack | None = None,
              name: str | None = None) -> RulePack:
    """All `*.bbr` files of `directory`, in sorted order, as one pack (named after the
    directory unless `name` is given)."""
    directory = Path(directory)
    files = [_read(read_source(p, "rule file"), str(p)) for p in sorted(directory.glob("*.bbr"))]
    return _PackBuilder(name or directory.name, base or RulePack("base")).build(files)
