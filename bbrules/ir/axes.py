"""Renaming axes in a term: how a load of a stored intermediate under other axis names reads
the value that was stored (self-attention reads X[s, d] as X[k, d])."""

from __future__ import annotations

from typing import Mapping

from .kinds import Sort, kind_of, map_attrs, postorder, transform
from .nodes import Node


def axes_named(n: Node) -> set[str]:
    """Every axis name a term uses, in loads and in the axes nodes work along."""
    used: set[str] = set()
    for m in postorder(n):
        kind = kind_of(m)
        for f in kind.attr_fields:
            s = kind.sort_of(f)
            if s is Sort.AXIS:
                used.add(m.__dict__[f])
            elif s is Sort.AXES:
                used.update(m.__dict__[f])
    return used


def rename_axes(n: Node, mapping: Mapping[str, str]) -> Node | None:
    """`n` with every axis renamed by `mapping` simultaneously, or None if that would capture
    an axis (a target name already used in `n` by an axis that is not renamed away)."""
    moved = {a: b for a, b in mapping.items() if a != b}
    if not moved:
        return n
    used = axes_named(n)
    if any(b in used and b not in moved for b in moved.values()):
        return None
    return transform(n, lambda m, kids: map_attrs(m, Sort.AXIS, lambda a: moved.get(a, a),
                                                   kids))
