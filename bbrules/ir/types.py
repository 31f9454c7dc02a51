"""Tile types: the axes a value's tile spans (its shape) and the axes whose block index
selects it (its dependencies).  Shape is always a subset of dependencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

Axis = str
AxisSet = frozenset[str]


class IRError(Exception):
    """An ill-formed block-IR term (a bug in whatever built it, or in a user's .bbk file)."""


@dataclass(frozen=True)
class TileType:
    shape: AxisSet
    deps: AxisSet


Type = Union[TileType, tuple[TileType, ...]]

SCALAR = TileType(frozenset(), frozenset())


def union(*types: TileType) -> TileType:
    """The type of an elementwise combination: it spans and depends on everything its
    operands do."""
    return TileType(frozenset().union(*(t.shape for t in types)),
                    frozenset().union(*(t.deps for t in types)))
