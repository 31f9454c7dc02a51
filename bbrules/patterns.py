"""Rule patterns on concrete IR terms: one matcher, instantiator, constant and guard evaluator.

Everything that runs a rule outside the e-graph goes through a `Binding` of its variables:
the soundness checker and the rule parser instantiate rules on random tiles with it
(`bbrules.instantiate`), and an explanation's replay matches a step's left side at a subterm,
checks the guards and builds the right side with it (`bbrules.explain`).  Constant arithmetic
is evaluated with the operator table's numpy implementations in float64, which is what the
e-graph computes for `+ - * /` and `sqrt`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from .ir import (Const, Dim, IRError, Load, Monoid, Node, Sort, TileType, Type, attrs, children,
                 map_attrs, type_of)
from .ops import BINARY, COMPARE, UNARY
from .program import fold as bottom_up
from .rule import (AxisEq, AxisIn, AxisSize, CExpr, ConstCmp, Guard, PAxis, Pattern, PConst,
                   PMonoid, PVar, Stored, TripsEq)

class NotInstantiable(Exception):
    """The bound values do not give a well-formed term."""


def checked_type(n: Node) -> Type:
    try:
        return type_of(n)
    except IRError as e:
        raise NotInstantiable(str(e)) from None


def fold(op: str, args: list[float]) -> float:
    """Constant arithmetic: `op` of the operator table on float64 arguments."""
    fn = (UNARY[op] if len(args) == 1 else BINARY[op]).numpy
    with np.errstate(all="ignore"):
        return float(fn(*(np.float64(a) for a in args)))


@dataclass
class Binding:
    """Values of a rule's variables: axes, monoids, values (terms) and constants, over `dims`."""

    dims: Mapping[str, Dim]
    axes: dict[str, str] = field(default_factory=dict)
    monoids: dict[str, Monoid] = field(default_factory=dict)
    values: dict[str, Node] = field(default_factory=dict)
    consts: dict[str, float] = field(default_factory=dict)

    def axis(self, a: str | PAxis) -> str:
        """An axis field's value: a variable's binding, or the axis itself."""
        return self.axes[a.name] if isinstance(a, PAxis) else a

    def monoid(self, m: Monoid | PMonoid) -> Monoid:
        """A monoid field's value: a variable's binding, or the monoid itself."""
        return self.monoids[m.name] if isinstance(m, PMonoid) else m

    def constant(self, e: Const | PConst | AxisSize | CExpr) -> float:
        """The value of a constant pattern under this binding."""
        return bottom_up(e, self._constant, lambda x: x.args if isinstance(x, CExpr) else ())

    def _constant(self, e: Const | PConst | AxisSize | CExpr, args: list[float]) -> float:
        match e:
            case Const(v):
                return v
            case PConst(name):
                return self.consts[name]
            case AxisSize(kind, axis):
                d = self.dims[self.axes[axis]]
                return float({"block": d.block, "extent": d.extent, "trips": d.blocks}[kind])
            case CExpr(op):
                return fold(op, args)
        raise AssertionError(e)

    def holds(self, g: Guard) -> bool:
        """Does guard `g` hold for the bound terms?"""
        match g:
            case AxisIn(axis, analysis, var, negated):
                t = checked_type(self.values[var])
                parts = (t,) if isinstance(t, TileType) else t
                axes = frozenset().union(*(getattr(p, analysis) for p in parts))
                return (self.axes[axis] in axes) != negated
            case AxisEq(left, right, negated):
                return (self.axes[left] == self.axes[right]) != negated
            case TripsEq(left, right):
                return self.dims[self.axes[left]].blocks == self.dims[self.axes[right]].blocks
            case ConstCmp(var, op, value):
                return COMPARE[op][0](self.consts[var], self.constant(value))
        raise AssertionError(g)

    def build(self, p: Pattern, stored: Callable[[Node], Node] | None = None) -> Node:
        """The IR term `p` stands for.  `load(store(v))` becomes `stored(v)`: a load of a
        tensor some kernel writes (only the soundness checker builds those)."""
        def make(q: Pattern, kids: list[Node]) -> Node:
            match q:
                case PVar(name):
                    return self.values[name]
                case PConst() | CExpr() | AxisSize():
                    return Const(self.constant(q))
                case Stored():
                    if stored is None:
                        raise NotInstantiable("load(store(...)) can only be matched, not built")
                    return stored(kids[0])
            return map_attrs(map_attrs(q, Sort.AXIS, self.axis, tuple(kids)), Sort.MONOID,
                             self.monoid, tuple(kids))

        return bottom_up(p, make, _operands)

    def match(self, p: Pattern, n: Node,
              carried: Callable[[Load], Node | None] | None = None, sizes: bool = False) -> bool:
        """Does `p` match term `n`, extending this binding?  (Guards are checked separately.)

        `load(store(v))` matches a load for which `carried` gives the value its kernel stores
        (renamed to the load's axes), when `v` matches that value.  Other nodes match a node of
        their kind whose attributes equal theirs or bind their variables, child by child (left
        to right, from a stack of pairs still to match: patterns and terms of any depth).
        With `sizes`, a computed constant (`const(1 / block(?e))`) matches a number equal to
        its value under the binding so far, to float32's rounding: a right side as a rule
        wrote it (`bbrules.refold`); else it matches nothing.
        """
        todo = [(p, n)]
        while todo:
            p, n = todo.pop()
            match p:
                case PVar(v):
                    ok = _bind(self.values, v, n)
                case PConst(v):
                    ok = isinstance(n, Const) and _bind(self.consts, v, n.value)
                case Stored(v):
                    value = carried(n) if carried is not None and isinstance(n, Load) else None
                    ok = value is not None
                    if ok:
                        todo.append((v, value))
                case CExpr() | AxisSize():
                    ok = sizes and isinstance(n, Const) and self._sized(p, n.value)
                case _:
                    ok = type(p) is type(n) and self._attrs_match(p, n)
                    kids, others = children(p), children(n)
                    ok = ok and len(kids) == len(others)
                    if ok:
                        todo += reversed(list(zip(kids, others)))
            if not ok:
                return False
        return True

    def _sized(self, p: CExpr | AxisSize, value: float) -> bool:
        """Is `value` what `p` evaluates to (its variables bound, to float32's rounding)?"""
        try:
            want = self.constant(p)
        except KeyError:  # a variable not bound yet
            return False
        return bool(np.isclose(value, want, rtol=1e-6, atol=0.0))

    def _attrs_match(self, p: Pattern, n: Node) -> bool:
        """Do `p`'s attributes equal `n`'s, or bind their variables to them?"""
        for a, b in zip(attrs(p), attrs(n)):
            if isinstance(a, PAxis):
                ok = _bind(self.axes, a.name, b)
            elif isinstance(a, PMonoid):
                ok = _bind(self.monoids, a.name, b)
            else:
                ok = a == b
            if not ok:
                return False
        return True


def _operands(p: Pattern) -> tuple[Pattern, ...]:
    """What the term a pattern stands for is built from: a stored load's value, a node's
    children; variables and constant patterns are leaves."""
    match p:
        case Stored(v):
            return (v,)
        case PVar() | PConst() | CExpr() | AxisSize():
            return ()
    return children(p)


def _bind(table: dict, var: str, value: object) -> bool:
    if var in table:
        return table[var] == value
    table[var] = value
    return True
