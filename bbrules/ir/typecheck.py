"""Types of nodes, computed from the kinds' type rules and cached on the nodes themselves.

A node is immutable and holds everything its type depends on (a reduction holds its monoid),
so its type is a property of the node: cached in it, never in a table that needs clearing.
Both functions walk the DAG with an explicit stack, so the depth of a term is unbounded.
"""

from __future__ import annotations

from typing import Any, Callable

from .kinds import children, is_node, kind_of
from .types import AxisSet, IRError, TileType, Type


def _cached(slot: str, n: Any, compute: Callable[[Any, tuple[Any, ...]], Any]) -> Any:
    """`compute(node, child_results)` for `n`, bottom-up, memoised in each node's `slot`."""
    hit = n.__dict__.get(slot)
    if hit is not None:
        return hit
    stack = [(n, False)]
    while stack:
        m, expanded = stack.pop()
        if slot in m.__dict__:
            continue
        kids = [c for c in children(m) if is_node(c)]
        if expanded:
            object.__setattr__(m, slot, compute(m, tuple(c.__dict__[slot] for c in kids)))
            continue
        stack.append((m, True))
        stack.extend((c, False) for c in kids if slot not in c.__dict__)
    return n.__dict__[slot]


def type_of(n: Any) -> Type:
    """Shape and dependencies of a node (per component for tuples), checking well-formedness.

    Load types need no program context: a load's tile spans and depends on its axes.
    """
    hit = getattr(n, "__dict__", {}).get("_type")  # cached: n is a node already typed
    if hit is not None:
        return hit
    if not is_node(n) or not hasattr(type(n), "kind"):
        raise IRError(f"not an IR node: {n!r}")
    return _cached("_type", n, lambda m, kids: m.infer(kids))


def tile_type(n: Any) -> TileType:
    t = type_of(n)
    if not isinstance(t, TileType):
        from .show import show_node
        raise IRError(f"expected a tile, found a tuple: {show_node(n)}")
    return t


def shape(n: Any) -> AxisSet:
    return tile_type(n).shape


def deps(n: Any) -> AxisSet:
    return tile_type(n).deps


def _own_sched_deps(n: Any, kids: tuple[AxisSet, ...]) -> AxisSet:
    kind = kind_of(n)
    out: AxisSet = frozenset().union(*kids)
    if not kind.child_fields:  # a leaf (a load, a position) depends on the blocks it types
        out |= tile_type(n).deps
    if kind.loop:
        out -= {n.axis}
    return out


def sched_deps(n: Any) -> AxisSet:
    """The axes a node's computation needs: like deps, but a tuple needs all its components.

    This is what scheduling uses: a reduction that carries several accumulators runs where all
    of them can be computed, even if one result alone would depend on fewer axes.
    """
    hit = n.__dict__.get("_sched_deps")  # the usual case, answered without a further call
    return hit if hit is not None else _cached("_sched_deps", n, _own_sched_deps)


def _own_loops(n: Any, kids: tuple[frozenset[Any], ...]) -> frozenset[Any]:
    out: frozenset[Any] = frozenset().union(*kids)
    return out | {n} if kind_of(n).loop else out


def loops_under(n: Any) -> frozenset[Any]:
    """Every sequential reduction in the DAG under `n` (itself included).

    Cached in each node like `sched_deps`, so scheduling many kernels that share subterms
    visits each subterm once, not once per kernel.
    """
    return _cached("_loops", n, _own_loops)
