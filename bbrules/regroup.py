"""Stores that only regroup a tensor's dimensions: `R[c, ...] = sum over a, b of
where(pos(a) * B + pos(b) == pos(c), T[a, b, ...], 0)`, with B the extent of b, is T with its
dimensions a and b merged into c, outer to inner (the same elements, another shape).

The ONNX importer writes such a store where two operators cut one dimension in ways no view
reads together (`onnx_import.Importer.regrouped`: Swin's image rows in pieces of 5 x 2, rolled,
then read as windows of 2 x 5).  As a loop nest it selects every element of c from every
element of a and b; the numpy backend computes it as what it is, a transpose and a reshape of
T (a view of T's memory where the merged dimensions lie next to each other there, in order):
Swin's four regrouping kernels took about 1.0 ms of a 7.4 ms block as selections.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .ir import Axis, Binary, BlockProgram, BlockReduce, Const, Load, Node, Pos, Reduce, Store, \
    TileType, Where
from .ir.typecheck import type_of


@dataclass(frozen=True)
class Regroup:
    """A store's value as the tile `values` (a load, or any expression) over `axes`, in the
    order they merge in runs into the store's dimensions: the store's array is the values'
    array, its dimensions in that order, reshaped to the store's shape."""

    values: Node
    axes: tuple[Axis, ...]


def regroup(p: BlockProgram, s: Store) -> Regroup | None:
    """`s` as a `Regroup` where its value sums over axes a1..an (each a fold over its blocks of
    an in-block sum) a selection at `pos(c) == sum_i pos(ai) * Mi` of values that vary along
    the store's other axes and the ai alone: the Mi the row-major strides of the ai's extents
    in some order, c one of the store's axes, of their product's extent, and no axis ragged.
    Else None."""
    n, summed = s.value, []
    while isinstance(n, Reduce) and n.monoid.name == "sum" and isinstance(n.x, BlockReduce) \
            and n.x.op == "sum" and n.x.axis == n.axis:
        summed.append(n.axis)
        n = n.x.x
    if not summed or not isinstance(n, Where) or n.y != Const(0.0) or \
            not isinstance(n.c, Binary) or n.c.op != "eq":
        return None
    for side, other in ((n.c.x, n.c.y), (n.c.y, n.c.x)):
        if isinstance(side, Pos) and side.axis in s.axes and \
                (terms := _linear(other)) is not None and set(terms) == set(summed):
            merged = sorted(summed, key=lambda a: -terms[a])  # outer first
            break
    else:
        return None
    c = side.axis
    strides = [prod(p.extent(a) for a in merged[i + 1:]) for i in range(len(merged))]
    if [terms[a] for a in merged] != strides or p.extent(c) != prod(map(p.extent, merged)):
        return None
    axes = tuple(a for x in s.axes for a in (merged if x == c else [x]))
    t = type_of(n.x)
    spans = set(n.x.axes) if isinstance(n.x, Load) else \
        t.shape | t.deps if isinstance(t, TileType) else set()
    if len(set(axes)) != len(axes) or spans != set(axes) or \
            isinstance(n.x, Load) and len(n.x.axes) != len(axes) or \
            any(p.dims[a].ragged for a in (*s.axes, *axes)):
        return None
    return Regroup(n.x, axes)


def _linear(n: Node) -> dict[Axis, float] | None:
    """{axis: coefficient} where `n` is a sum of positions times numbers (no constant term)."""
    if isinstance(n, Pos):
        return {n.axis: 1.0}
    if isinstance(n, Binary) and n.op == "mul":
        for x, y in ((n.x, n.y), (n.y, n.x)):
            if isinstance(y, Const) and (terms := _linear(x)) is not None:
                return {a: m * y.value for a, m in terms.items()}
        return None
    if isinstance(n, Binary) and n.op == "add" and (left := _linear(n.x)) is not None and \
            (right := _linear(n.y)) is not None and not set(left) & set(right):
        return left | right
    return None
