"""Renaming the axes of an IR term (a tensor read under other index names)."""

from __future__ import annotations

from typing import Mapping

from .ir import (Binary, BlockReduce, Dot, Get, Load, Node, Reduce, Tuple, Unary, children,
                 postorder)


def rename_axes(n: Node, mapping: Mapping[str, str]) -> Node | None:
    """`n` with every axis renamed by `mapping` simultaneously, or None if that would capture
    an axis (a target name already used in `n` by an axis that is not renamed away)."""
    moved = {a: b for a, b in mapping.items() if a != b}
    if not moved:
        return n
    used = set()
    for m in postorder(n):
        match m:
            case Load(_, axes):
                used.update(axes)
            case Reduce(a, _, _) | Dot(a, _, _) | BlockReduce(_, a, _):
                used.add(a)
    if any(b in used and b not in moved for b in moved.values()):
        return None
    memo: dict[Node, Node] = {}

    def ren(a: str) -> str:
        return moved.get(a, a)

    for m in postorder(n):
        kids = tuple(memo[c] for c in children(m))
        match m:
            case Load(t, axes):
                memo[m] = Load(t, tuple(map(ren, axes)))
            case Reduce(a, mono, _):
                memo[m] = Reduce(ren(a), mono, kids[0])
            case Dot(a, _, _):
                memo[m] = Dot(ren(a), *kids)
            case BlockReduce(op, a, _):
                memo[m] = BlockReduce(op, ren(a), kids[0])
            case Unary(op, _):
                memo[m] = Unary(op, kids[0])
            case Binary(op, _, _):
                memo[m] = Binary(op, *kids)
            case Tuple():
                memo[m] = Tuple(kids)
            case Get(i, _):
                memo[m] = Get(i, kids[0])
            case _:
                memo[m] = m
    return memo[n]

