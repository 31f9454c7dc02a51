"""Block skipping, derived from predicates over positions.

A fold over the blocks of an axis may skip a block whose contribution is its monoid's
identity.  Nothing here knows causal attention: a reduction is skippable when its body selects
with some predicate `P` over positions (`where(P, x, y)`, P built from `pos(a)`, constants,
arithmetic, comparisons and `and`/`or`/`not`), and the body with every such selection taking
its `y` branch evaluates to the monoid's identity.  Then a block on which `P` is false for
every element contributes the identity, and is not visited.

Two analyses:

- `skip_predicate(reduce)` finds `P` by evaluating the body over a small lattice of known
  constants, values known finite, and unknowns (`_Masked`).  Loads are taken to be finite, as
  every attention kernel does (0 * v = 0 in a masked block's `dot`); a masked score is the
  constant `-inf`, and the softmax rules keep `exp(-inf - m)` at 0 where the whole block is
  masked (see `rules/softmax.bbr`).
- `may_hold(P, ...)` evaluates `P` over intervals, the positions a block covers: for each
  node a lower and upper bound, and for each predicate whether it may be true and whether it
  may be false.  Exact for affine predicates in which each position occurs once (`k <= q`,
  `q - k < 256`, `abs(q - k) <= w`); otherwise an over-approximation, which only visits
  more blocks.  The same bounds evaluate numpy arrays (the cost model counts visited blocks
  over every block combination at once) and C expressions (the CUDA backend tests each block
  before visiting it), through an `Algebra`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Generic, Mapping, TypeVar

import numpy as np

from .ir import (BlockReduce, Binary, Const, Dot, Get, Load, Node, Pos, Reduce, Tuple, Unary,
                 Where, children, operator, postorder)

T = TypeVar("T")  # a bound or a truth value, in some algebra

# The operators a predicate over positions may use: arithmetic, comparisons, logic.
_ARITHMETIC = frozenset({"add", "sub", "mul", "neg", "abs", "max", "min"})
_COMPARISON = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})
_LOGIC = frozenset({"and", "or", "not"})


def is_position_predicate(p: Node) -> bool:
    """Is `p` computed from positions and constants alone, by operators `may_hold` bounds?"""
    for n in postorder(p):
        match n:
            case Pos() | Const():
                continue
            case Unary(op) | Binary(op) if op in _ARITHMETIC | _COMPARISON | _LOGIC:
                continue
        return False
    return any(isinstance(n, Pos) for n in postorder(p))


# --------------------------------------------------------------------------------------------
# Which predicate makes a fold's contribution its identity


class _Finite:
    """A value not known, but finite (loads, positions, and arithmetic on finite values)."""

    def __repr__(self) -> str:
        return "finite"


FINITE = _Finite()
UNKNOWN = None  # a value of the lattice: a float, FINITE, UNKNOWN, or a tuple of them

# Elementwise operators taken to map finite operands to finite results.  Sums and products of
# scores and values do not overflow in practice; exp and division are left out, because an
# exponent or a divisor of ordinary inputs does (exp(100), x / 0).
_FINITE_OPS = _ARITHMETIC | _COMPARISON | _LOGIC | {"square", "relu"}


def _finite(v: object) -> bool:
    return v is FINITE or (isinstance(v, float) and math.isfinite(v))


@lru_cache(maxsize=1 << 12)
def skip_predicate(r: Reduce) -> Node | None:
    """A predicate over positions outside of which `r`'s contribution is its identity, or
    None.  The candidates are the conditions of the body's selections, in post-order."""
    conditions = [n.c for n in _outside_loops(r.x)
                  if isinstance(n, Where) and is_position_predicate(n.c)]
    identity = tuple(c.value if isinstance(c, Const) else UNKNOWN for c in r.monoid.identity)
    for p in dict.fromkeys(conditions):
        value = _Masked(p).value(r.x)
        parts = value if isinstance(value, tuple) else (value,)
        if len(parts) == len(identity) and all(
                isinstance(v, float) and isinstance(i, float) and v == i
                for v, i in zip(parts, identity)):
            return p
    return None


def _outside_loops(root: Node) -> list[Node]:
    """The nodes under `root` that one iteration of its fold computes (not a nested fold's)."""
    out, seen, stack = [], set(), [root]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        out.append(n)
        if not isinstance(n, Reduce):
            stack.extend(children(n))
    return out


@dataclass
class _Masked:
    """The body's value where `predicate` is false everywhere, over the constant lattice."""

    predicate: Node

    def __post_init__(self) -> None:
        self.memo: dict[Node, object] = {}

    def value(self, root: Node) -> object:
        for n in postorder(root):
            if n not in self.memo:
                self.memo[n] = self._eval(n)
        return self.memo[root]

    def _eval(self, n: Node) -> object:
        v = self.memo.get
        match n:
            case Const(c):
                return float(c)
            case Load() | Pos():
                return FINITE
            case Where(c, x, y):
                if c == self.predicate:
                    return v(y)
                cond = v(c)
                if isinstance(cond, float):
                    return v(x) if cond != 0 else v(y)
                return v(x) if v(x) == v(y) else (FINITE if _finite(v(x)) and _finite(v(y))
                                                  else UNKNOWN)
            case Unary(op, x) | Binary(op, x, _) if _all_known(args := _args(n, v)):
                with np.errstate(all="ignore"):
                    return float(_apply(n, args))
            case Binary("add", x, y) if _shifts_infinity(v(x), v(y)):
                return v(x) if _finite(v(y)) else v(y)  # -inf + s = -inf for a finite s
            case Binary("sub", x, y) if _shifts_infinity(v(x), v(y)):
                return v(x) if _finite(v(y)) else -v(y)
            case Binary("mul", x, y) if 0.0 in (v(x), v(y)) and _finite(v(x)) and _finite(v(y)):
                return 0.0
            case Unary(op) | Binary(op) if op in _FINITE_OPS and all(map(_finite, _args(n, v))):
                return FINITE
            case BlockReduce(op, _, x):
                known = v(x)
                if isinstance(known, float) and (op != "sum" or known == 0.0):
                    return known  # the max or min of a constant tile, a sum of zeros
                return FINITE if _finite(known) else UNKNOWN
            case Dot(_, x, y):
                if 0.0 in (v(x), v(y)) and _finite(v(x)) and _finite(v(y)):
                    return 0.0
                return FINITE if _finite(v(x)) and _finite(v(y)) else UNKNOWN
            case Reduce(_, monoid, x) if monoid.name in ("sum", "max", "min") and _finite(v(x)):
                return FINITE  # a nested fold of finite values (a score's sum over d)
            case Tuple(items):
                return tuple(v(i) for i in items)
            case Get(i, x):
                parts = v(x)
                return parts[i] if isinstance(parts, tuple) else UNKNOWN
        return UNKNOWN  # a nested fold, or an operator not tracked


def _shifts_infinity(x: object, y: object) -> bool:
    """Is one of `x`, `y` an infinity and the other finite (their sum is that infinity)?"""
    def infinite(a: object) -> bool:
        return isinstance(a, float) and math.isinf(a)
    return (infinite(x) and _finite(y)) or (_finite(x) and infinite(y))


def _args(n: Node, v: Callable[[Node], object]) -> list[object]:
    return [v(c) for c in children(n)]


def _all_known(args: list[object]) -> bool:
    return all(isinstance(a, float) for a in args)


def _apply(n: Node, args: list[object]) -> float:
    return np.asarray(operator(n).numpy(*(np.float64(a) for a in args))).item()


# --------------------------------------------------------------------------------------------
# Where a predicate may hold, over the positions of a block


class Algebra(Generic[T]):
    """Arithmetic on bounds and logic on truth values, in numpy or in C."""

    def const(self, c: float) -> T: ...
    def add(self, x: T, y: T) -> T: ...
    def sub(self, x: T, y: T) -> T: ...
    def mul(self, x: T, y: T) -> T: ...
    def neg(self, x: T) -> T: ...
    def max(self, x: T, y: T) -> T: ...
    def min(self, x: T, y: T) -> T: ...
    def lt(self, x: T, y: T) -> T: ...
    def le(self, x: T, y: T) -> T: ...
    def eq(self, x: T, y: T) -> T: ...
    def and_(self, p: T, q: T) -> T: ...
    def or_(self, p: T, q: T) -> T: ...
    def not_(self, p: T) -> T: ...


def may_hold(p: Node, bounds: Mapping[str, tuple[T, T]], alg: Algebra[T]) -> T:
    """Whether `p` may be true anywhere on the positions `bounds` gives for each axis (lowest,
    highest), by interval arithmetic in `alg`."""
    return _Bounds(bounds, alg).truth(p)[0]


@dataclass
class _Bounds(Generic[T]):
    bounds: Mapping[str, tuple[T, T]]
    alg: Algebra[T]

    def interval(self, n: Node) -> tuple[T, T]:
        a = self.alg
        match n:
            case Pos(axis):
                return self.bounds[axis]
            case Const(c):
                return a.const(c), a.const(c)
            case Unary("neg", x):
                lo, hi = self.interval(x)
                return a.neg(hi), a.neg(lo)
            case Unary("abs", x):
                lo, hi = self.interval(x)
                return a.max(a.max(lo, a.neg(hi)), a.const(0.0)), a.max(a.neg(lo), hi)
            case Binary("add", x, y):
                (lx, hx), (ly, hy) = self.interval(x), self.interval(y)
                return a.add(lx, ly), a.add(hx, hy)
            case Binary("sub", x, y):
                (lx, hx), (ly, hy) = self.interval(x), self.interval(y)
                return a.sub(lx, hy), a.sub(hx, ly)
            case Binary("mul", x, y):
                (lx, hx), (ly, hy) = self.interval(x), self.interval(y)
                ends = [a.mul(u, w) for u in (lx, hx) for w in (ly, hy)]
                return (a.min(a.min(ends[0], ends[1]), a.min(ends[2], ends[3])),
                        a.max(a.max(ends[0], ends[1]), a.max(ends[2], ends[3])))
            case Binary("max" | "min" as op, x, y):
                (lx, hx), (ly, hy) = self.interval(x), self.interval(y)
                f = a.max if op == "max" else a.min
                return f(lx, ly), f(hx, hy)
        # a truth value used as a number: 0 or 1
        t, f = self.truth(n)
        return a.min(a.const(1.0), a.not_(t)), a.max(a.const(0.0), a.not_(f))

    def truth(self, n: Node) -> tuple[T, T]:
        """(may be true, may be false) over the bounds."""
        a = self.alg
        match n:
            case Binary("lt" | "le" | "gt" | "ge" as op, x, y):
                if op in ("gt", "ge"):
                    x, y = y, x
                (lx, hx), (ly, hy) = self.interval(x), self.interval(y)
                if op in ("lt", "gt"):
                    return a.lt(lx, hy), a.le(ly, hx)
                return a.le(lx, hy), a.lt(ly, hx)
            case Binary("eq" | "ne" as op, x, y):
                (lx, hx), (ly, hy) = self.interval(x), self.interval(y)
                overlap = a.and_(a.le(lx, hy), a.le(ly, hx))
                single = a.and_(a.and_(a.eq(lx, hx), a.eq(ly, hy)), a.eq(lx, ly))
                pair = (overlap, a.not_(single))
                return pair if op == "eq" else pair[::-1]
            case Binary("and", x, y):
                (tx, fx), (ty, fy) = self.truth(x), self.truth(y)
                return a.and_(tx, ty), a.or_(fx, fy)
            case Binary("or", x, y):
                (tx, fx), (ty, fy) = self.truth(x), self.truth(y)
                return a.or_(tx, ty), a.and_(fx, fy)
            case Unary("not", x):
                t, f = self.truth(x)
                return f, t
        lo, hi = self.interval(n)  # a number as a truth value: nonzero is true
        zero = a.const(0.0)
        return (a.or_(a.lt(lo, zero), a.lt(zero, hi)),
                a.and_(a.le(lo, zero), a.le(zero, hi)))


class NumpyAlgebra(Algebra[np.ndarray]):
    """Bounds as float64 arrays and truth values as boolean arrays, elementwise."""

    def const(self, c): return np.float64(c)
    def add(self, x, y): return x + y
    def sub(self, x, y): return x - y
    def mul(self, x, y): return x * y
    def neg(self, x): return -x
    def max(self, x, y): return np.maximum(x, y)
    def min(self, x, y): return np.minimum(x, y)
    def lt(self, x, y): return x < y
    def le(self, x, y): return x <= y
    def eq(self, x, y): return x == y
    def and_(self, p, q): return np.logical_and(p, q)
    def or_(self, p, q): return np.logical_or(p, q)
    def not_(self, p): return np.logical_not(p)


@dataclass(frozen=True)
class Visits:
    """The share of a fold's blocks visited: on average over all grid points, and by the
    grid point that visits the most."""

    mean: float
    heaviest: float


class CAlgebra(Algebra[str]):
    """Bounds and truth values as C expressions (floats and ints)."""

    def const(self, c): return f"{float(c)!r}f" if math.isfinite(c) else \
        ("(-INFINITY)" if c < 0 else "INFINITY")
    def add(self, x, y): return f"({x} + {y})"
    def sub(self, x, y): return f"({x} - {y})"
    def mul(self, x, y): return f"({x} * {y})"
    def neg(self, x): return f"(-{x})"
    def max(self, x, y): return f"fmaxf({x}, {y})"
    def min(self, x, y): return f"fminf({x}, {y})"
    def lt(self, x, y): return f"({x} < {y})"
    def le(self, x, y): return f"({x} <= {y})"
    def eq(self, x, y): return f"({x} == {y})"
    def and_(self, p, q): return f"({p} && {q})"
    def or_(self, p, q): return f"({p} || {q})"
    def not_(self, p): return f"(!{p})"


def visited_share(p: Node, blocks: Mapping[str, tuple[int, int]],
                  grid: frozenset[str] = frozenset()) -> Visits:
    """The share of blocks a fold skipping where `p` is false visits, over every combination
    of blocks of the axes `p` reads (`blocks`: axis -> (block size, number of blocks)), of
    which the `grid` axes tell grid points apart."""
    return _visited_share(p, tuple(sorted(blocks.items())), grid & frozenset(blocks))


@lru_cache(maxsize=1 << 10)
def _visited_share(p: Node, blocks: tuple[tuple[str, tuple[int, int]], ...],
                   grid: frozenset[str]) -> Visits:
    index = np.meshgrid(*(np.arange(n, dtype=np.float64) for _, (_, n) in blocks),
                        indexing="ij")
    bounds = {a: (i * b, i * b + (b - 1)) for (a, (b, _)), i in zip(blocks, index)}
    hold = np.broadcast_to(may_hold(p, bounds, NumpyAlgebra()), index[0].shape)
    within = tuple(i for i, (a, _) in enumerate(blocks) if a not in grid)
    per_point = hold.mean(axis=within) if within else hold.astype(np.float64)
    return Visits(float(np.mean(hold)), float(np.max(per_point)))
