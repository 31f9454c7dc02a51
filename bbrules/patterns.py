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

from .ir import (Binary, BlockReduce, Const, Dim, Dot, Get, IRError, Load, Node, Reduce, Tuple,
                 Type, TileType, Unary, Var, type_of)
from .ops import BINARY, COMPARE, UNARY
from .rule import (AxisEq, AxisIn, AxisSize, CExpr, ConstCmp, Guard, Pattern, PConst, PVar,
                   Stored, TripsEq, pattern_var)

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
    monoids: dict[str, str] = field(default_factory=dict)
    values: dict[str, Node] = field(default_factory=dict)
    consts: dict[str, float] = field(default_factory=dict)

    def axis(self, a: str) -> str:
        return self.axes[a] if pattern_var(a) else a

    def monoid(self, m: str) -> str:
        return self.monoids[m] if pattern_var(m) else m

    def constant(self, e: Const | PConst | AxisSize | CExpr) -> float:
        """The value of a constant pattern under this binding."""
        match e:
            case Const(v):
                return v
            case PConst(name):
                return self.consts[name]
            case AxisSize(kind, axis):
                d = self.dims[self.axis(axis)]
                return float({"block": d.block, "extent": d.extent, "trips": d.blocks}[kind])
            case CExpr(op, args):
                return fold(op, [self.constant(a) for a in args])
        raise AssertionError(e)

    def holds(self, g: Guard) -> bool:
        """Does guard `g` hold for the bound terms?"""
        match g:
            case AxisIn(axis, analysis, var, negated):
                t = checked_type(self.values[var])
                parts = (t,) if isinstance(t, TileType) else t
                axes = frozenset().union(*(getattr(p, analysis) for p in parts))
                return (self.axis(axis) in axes) != negated
            case AxisEq(left, right, negated):
                return (self.axis(left) == self.axis(right)) != negated
            case TripsEq(left, right):
                return self.dims[self.axis(left)].blocks == self.dims[self.axis(right)].blocks
            case ConstCmp(var, op, value):
                return COMPARE[op][0](self.consts[var], self.constant(value))
        raise AssertionError(g)

    def build(self, p: Pattern, stored: Callable[[Node], Node] | None = None) -> Node:
        """The IR term `p` stands for.  `load(store(v))` becomes `stored(v)`: a load of a
        tensor some kernel writes (only the soundness checker builds those)."""
        def sub(q: Pattern) -> Node:
            return self.build(q, stored)

        match p:
            case PVar(name):
                return self.values[name]
            case PConst() | CExpr() | AxisSize():
                return Const(self.constant(p))
            case Stored(v):
                if stored is None:
                    raise NotInstantiable("load(store(...)) can only be matched, not built")
                return stored(sub(v))
            case Load() | Const() | Var():
                return p
            case Unary(op, x):
                return Unary(op, sub(x))
            case Binary(op, x, y):
                return Binary(op, sub(x), sub(y))
            case BlockReduce(op, axis, x):
                return BlockReduce(op, self.axis(axis), sub(x))
            case Dot(axis, x, y):
                return Dot(self.axis(axis), sub(x), sub(y))
            case Reduce(axis, monoid, x):
                return Reduce(self.axis(axis), self.monoid(monoid), sub(x))
            case Tuple(items):
                return Tuple(tuple(sub(i) for i in items))
            case Get(i, x):
                return Get(i, sub(x))
        raise AssertionError(p)

    def match(self, p: Pattern, n: Node,
              carried: Callable[[Load], Node | None] | None = None) -> bool:
        """Does `p` match term `n`, extending this binding?  (Guards are checked separately.)

        `load(store(v))` matches a load for which `carried` gives the value its kernel stores
        (renamed to the load's axes), when `v` matches that value.
        """
        def sub(q: Pattern, m: Node) -> bool:
            return self.match(q, m, carried)

        def bind(table: dict, var: str, value: object) -> bool:
            if var in table:
                return table[var] == value
            table[var] = value
            return True

        def name(table: dict, field_value: str, value: str) -> bool:
            return (bind(table, field_value, value) if pattern_var(field_value)
                    else field_value == value)

        match p:
            case PVar(v):
                return bind(self.values, v, n)
            case PConst(v):
                return isinstance(n, Const) and bind(self.consts, v, n.value)
            case Stored(v):
                value = carried(n) if carried is not None and isinstance(n, Load) else None
                return value is not None and sub(v, value)
            case CExpr() | AxisSize():
                return False
            case Load() | Const():
                return p == n
            case Unary(op, x):
                return isinstance(n, Unary) and n.op == op and sub(x, n.x)
            case Binary(op, x, y):
                return isinstance(n, Binary) and n.op == op and sub(x, n.x) and sub(y, n.y)
            case BlockReduce(op, a, x):
                return (isinstance(n, BlockReduce) and n.op == op
                        and name(self.axes, a, n.axis) and sub(x, n.x))
            case Dot(a, x, y):
                return (isinstance(n, Dot) and name(self.axes, a, n.axis)
                        and sub(x, n.x) and sub(y, n.y))
            case Reduce(a, m, x):
                return (isinstance(n, Reduce) and name(self.axes, a, n.axis)
                        and name(self.monoids, m, n.monoid) and sub(x, n.x))
            case Tuple(items):
                return (isinstance(n, Tuple) and len(items) == len(n.items)
                        and all(sub(i, j) for i, j in zip(items, n.items)))
            case Get(i, x):
                return isinstance(n, Get) and n.index == i and sub(x, n.x)
        return False
