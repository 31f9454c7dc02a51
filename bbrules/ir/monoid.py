"""Monoids are data: the interpreter, cost model and code generators read these definitions.

A `Reduce` node holds its monoid, so the definition travels with every program that uses it
and there is no registry: two rule packs may define monoids of the same name differently in
one process, and what a name means is decided where it is read (a pack, a block file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .kinds import postorder
from .nodes import Binary, Const, Node, Var
from .types import SCALAR, TileType, union


@dataclass(frozen=True, eq=False)
class Monoid:
    """A fold over blocks.

    `state` names the components.  `identity` gives one expression per component (constants).
    `combine` gives the new state from two states, whose components are `Var("a.<c>")` (the
    accumulator) and `Var("b.<c>")` (the contribution of one block).  `finalize` gives the
    reduction's results from the final state, over `Var("<c>")`.  All three are elementwise.
    """

    name: str
    state: tuple[str, ...]
    identity: tuple[Node, ...]
    combine: tuple[Node, ...]
    finalize: tuple[Node, ...]
    doc: str = field(default="", compare=False)

    def __repr__(self) -> str:
        return f"Monoid({self.name!r})"

    def _key(self) -> tuple:
        return (self.name, self.state, self.identity, self.combine, self.finalize)

    def __eq__(self, other: object) -> bool:
        # Every reduction holds its monoid, so node comparisons compare monoids all the time:
        # the same object (the usual case) answers at once.
        return self is other or (isinstance(other, Monoid) and self._key() == other._key())

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self._key())
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def arity(self) -> int:
        return len(self.state)

    def partial(self) -> Monoid:
        """The same fold without its finalize: its results are the state components.

        A split reduction's chunks store these states, and a second fold over the chunks
        combines them with this monoid's `combine` and finalizes: sound for every monoid,
        since folds are associative.  One object per monoid, so caches find it by identity."""
        raw = tuple(Var(c) for c in self.state)
        if self.finalize == raw:
            return self
        cached = self.__dict__.get("_partial")
        if cached is None:
            cached = Monoid(f"{self.name}_state", self.state, self.identity, self.combine, raw,
                            f"{self.name}'s state, unfinalized")
            object.__setattr__(self, "_partial", cached)
        return cached

    def coupled_state_types(self, state: tuple[TileType, ...]) -> tuple[TileType, ...]:
        """Widen each state component by the components its combine reads, to a fixed point.

        A rescaled monoid couples its accumulators to the running max (`l` is multiplied by
        `exp(a.m - max(a.m, b.m))`), so `l` spans and depends on whatever `m` does.
        """
        reads = [{v.split(".", 1)[-1] for v in var_names(c)} for c in self.combine]
        types = dict(zip(self.state, state))
        changed = True
        while changed:
            changed = False
            for name, used in zip(self.state, reads):
                widened = union(types[name], *(types[u] for u in used))
                if widened != types[name]:
                    types[name], changed = widened, True
        return tuple(types[name] for name in self.state)

    def finalize_types(self, state: tuple[TileType, ...]) -> tuple[TileType, ...]:
        """Types of the results given the state types: elementwise, so unions."""
        env = dict(zip(self.state, state))
        return tuple(union(SCALAR, *(env[v] for v in var_names(f))) for f in self.finalize)

    def result_types(self, contributions: tuple[TileType, ...]) -> tuple[TileType, ...]:
        """Types of the reduction's results, given its contributions' types (loop axis
        already removed from their dependencies)."""
        return _result_types(self, contributions)


@lru_cache(maxsize=1 << 12)
def _result_types(m: Monoid, contributions: tuple[TileType, ...]) -> tuple[TileType, ...]:
    # Typing a candidate program types each new reduction: few distinct monoids and
    # contribution types occur, so each pair is worked out once.
    return m.finalize_types(m.coupled_state_types(contributions))


def var_names(e: Node) -> set[str]:
    return {n.name for n in postorder(e) if isinstance(n, Var)}


def _simple(name: str, op: str, identity: float, doc: str) -> Monoid:
    return Monoid(name, ("s",), (Const(identity),), (Binary(op, Var("a.s"), Var("b.s")),),
                  (Var("s"),), doc)


SUM = _simple("sum", "add", 0.0, "addition")
MAX = _simple("max", "max", float("-inf"), "maximum")
MIN = _simple("min", "min", float("inf"), "minimum")

BUILTIN_MONOIDS: dict[str, Monoid] = {m.name: m for m in (SUM, MAX, MIN)}


def monoids_used(roots: object) -> dict[str, Monoid]:
    """The non-builtin monoids the reductions under `roots` (nodes or stores) fold with, by
    name, in first-use order."""
    from .nodes import Reduce
    from .types import IRError
    out: dict[str, Monoid] = {}
    for root in roots:  # type: ignore[attr-defined]
        for n in postorder(getattr(root, "value", root)):
            if isinstance(n, Reduce) and isinstance(n.monoid, Monoid) \
                    and BUILTIN_MONOIDS.get(n.monoid.name) != n.monoid:
                if out.setdefault(n.monoid.name, n.monoid) != n.monoid:
                    raise IRError(f"two different monoids named '{n.monoid.name}' in one "
                                  f"program")
    return out
