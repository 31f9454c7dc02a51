"""Contractions by a one-hot: where one operand of `dot(k, x, y)` is 1 at positions of k that
a condition pins (`ids == pos(k)`, a convolution's `pos(k) == pos(t) + 2`) and 0 elsewhere,
the sum over k picks the other operand's elements there: an embedding lookup or a
convolution's shifted rows.  The numpy backend computes them as gathers, and a target whose
backend does (`Target.gathers`) prices them as such, not as the product they are written as;
so too a sum of a selection that pins the summed position (`selection_as_contraction`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Axis, Binary, BlockReduce, Const, Dot, Node, Pos, TileType, Where
from .ir.typecheck import type_of


@dataclass(frozen=True)
class Pick:
    """Where a one-hot operand is 1: at position `at - offset` of the contracted axis
    (`at` an expression of other positions or of loaded values), where every guard holds."""

    at: Node
    offset: float
    guards: tuple[Node, ...] = ()


def one_hot(n: Dot) -> tuple[Node, tuple[Pick, ...]] | None:
    """(the other operand, the picks) when one operand of the contraction `n` is 1 where `c`
    holds and 0 elsewhere (`indicator`) and `c` pins the contracted position: an equality
    `pos(k) + b == e`, with `and` of conditions free of k, and `or` of such.  Then
    `sum_k [k = e] Y[k]` is `Y[e]`: an embedding lookup (Gather) or a convolution's shift,
    which a matmul by a matrix of zeros computes at the cost of a contraction."""
    for hot, values in ((n.x, n.y), (n.y, n.x)):
        if isinstance(hot, Where) and hot.y == Const(0.0) and isinstance(values, Where) \
                and values.c == hot.c and values.y == Const(0.0):
            hot = hot.x  # a mask both operands share (a ragged axis'): the values carry it
        if (c := indicator(hot)) is not None and (picks := _picks(c, n.axis)):
            return values, picks
    return None


def selection_as_contraction(n: BlockReduce, block: int) -> Dot | None:
    """The contraction by a one-hot that `n` is, where `n` sums, over a block of `block` > 1
    elements, a selection that pins the summed position: `bsum(k, where(c, x, 0))` is
    `dot(k, where(c, 1, 0), x)` when `c` is `pos(k) == e` and x spans k (a piece of a
    concatenation, read in blocks of several of its chunks).  Over blocks of one element the
    selection is no larger than its result: None, as for any other `n`."""
    if n.op != "sum" or block <= 1 or not isinstance(n.x, Where) or n.x.y != Const(0.0):
        return None
    t = type_of(n.x.x)
    if not isinstance(t, TileType) or n.axis not in t.shape:
        return None
    dot = Dot(n.axis, Where(n.x.c, Const(1.0), Const(0.0)), n.x.x)
    return dot if one_hot(dot) is not None else None


def indicator(n: Node) -> Node | None:
    """The condition under which `n` is 1, where it is 0 elsewhere: `where(c, 1, 0)`, or a
    comparison or logical operator, whose values are 1 and 0."""
    if isinstance(n, Where) and n.x == Const(1.0) and n.y == Const(0.0):
        return n.c
    return n if isinstance(n, Binary) and n.op in ("eq", "and", "or") else None


def _picks(c: Node, axis: Axis) -> tuple[Pick, ...] | None:
    if not isinstance(c, Binary):
        return None
    if c.op == "or":
        left, right = _picks(c.x, axis), _picks(c.y, axis)
        return left + right if left and right else None
    if c.op == "and":
        for pinned, guard in ((c.x, c.y), (c.y, c.x)):
            picks = _picks(pinned, axis)
            if picks and not mentions(guard, axis):
                return tuple(Pick(p.at, p.offset, (*p.guards, guard)) for p in picks)
        return None
    if c.op == "eq":
        for side, other in ((c.x, c.y), (c.y, c.x)):
            offset = _shifted_position(side, axis)
            if offset is not None and not mentions(other, axis):
                return (Pick(other, offset),)
    return None


def _shifted_position(n: Node, axis: Axis) -> float | None:
    """b where `n` is `pos(axis) + b` (or `- b`, or `b + pos(axis)`)."""
    if isinstance(n, Pos):
        return 0.0 if n.axis == axis else None
    if isinstance(n, Binary) and n.op in ("add", "sub"):
        if isinstance(n.x, Pos) and n.x.axis == axis and isinstance(n.y, Const):
            return n.y.value if n.op == "add" else -n.y.value
        if n.op == "add" and isinstance(n.y, Pos) and n.y.axis == axis and isinstance(n.x, Const):
            return n.x.value
    return None


def mentions(n: Node, axis: Axis) -> bool:
    """Does `n` vary along `axis`: in its tile's shape, or through a position it depends on?"""
    t = type_of(n)
    return isinstance(t, TileType) and axis in t.shape | t.deps
