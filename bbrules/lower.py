"""Lowering: a checked `Program` -> the unfused block program, one kernel per statement.

Each statement becomes a `Store` of one tile expression, over `Load`s of the tensors it reads
(renamed references keep their use names).  Reductions become sequential `Reduce` loops over
blocks with the in-tile work chosen so that the block program is the one a person would write
before fusing: a sum of a product is a block matmul (`Dot`) when two or more factors span the
reduced axis, factors that do not span it are applied once to the result (the sum is linear
in them), and `max`/`min` reduce the whole body.  The fusion rules start from this form.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations
from typing import Mapping

from .errors import SourceError
from .ir import (BUILTIN_MONOIDS, SUM, BlockProgram, BlockReduce, Binary, Const, Dim, Dot,
                 IRError, Load, Node, Pos, Reduce, Store, Unary, Where, tile_type, validate)
from .program import (Apply, Expr, Number, Position, Program, Reduction, Ref, Statement,
                      factors, fold, free_axes, operands, sum_factors)

Factor = tuple[Expr, bool, Node]  # an expression, whether it divides, its lowering

# Contractions of up to this many factors try every split into the two operands; longer
# products (thousands of factors) try the splits in source order only.
EXHAUSTIVE_SPLIT = 10


def lower(program: Program) -> BlockProgram:
    """The unfused block program of `program`, validated."""
    kernels = tuple(_kernel(program, s) for s in program.statements)
    block = BlockProgram.of_stores(dict(program.dims), dict(program.tensors), kernels,
                                   program.outputs)
    validate(block)
    return block


def _kernel(program: Program, s: Statement) -> Store:
    """The statement's kernel; a statement whose value cannot be stored as its target (only
    possible in a hand-built `Program`: the frontend checks axes) is reported at its line."""
    value = lower_expr(s.expr, program.dims)
    try:
        t = tile_type(value)
    except IRError as err:
        problem = str(err)
    else:
        want = frozenset(s.axes)
        if t.shape == t.deps == want:
            return Store(s.target, s.axes, value)
        problem = f"its value spans {sorted(t.shape)}, the target {sorted(want)}"
    raise SourceError(s.span, f"statement '{s.target}' cannot be lowered to a block program: "
                      f"{problem}", program.source)


def lower_expr(e: Expr, dims: Mapping[str, Dim] | None = None) -> Node:
    """The tile expression computing `e` for one block of its free axes.

    A sum is lowered from the factors of its body (`sum_factors`), not from the product.  A
    reduction over a ragged axis (`dims`) reads the padding of its last block as its identity
    (`_ragged`)."""
    ragged = {a: d.extent for a, d in (dims or {}).items() if d.ragged}
    if dims:
        e = _contracting_largest_block(e, {a: d.block for a, d in dims.items()})
    return fold(e, lambda x, parts: _lowered(x, parts, ragged), sum_factors)


def _contracting_largest_block(e: Expr, blocks: Mapping[str, int]) -> Expr:
    """`e` with each chain of sums (`sum[a, b] x`, which is `sum[a] sum[b] x`) ordered so that
    the innermost sums the axis of the largest block (of equals, the one written last).

    The innermost sum of a product is the contraction (`Dot`); the sums around it reduce its
    result block by block, so its tile spans their blocks.  A product over an axis pair
    written minor-last, as an interleaved RoPE's (`sum[d32, d2] q[.., d32, d2] * k[..]`, in
    blocks of 32 and 1), contracted pairs of one element into a 64 x 64 x 32 tile, 536 KiB
    where the cpu target has 512; contracting 32 at a time, the tile is 64 x 64."""
    def combine(x: Expr, parts: list[Expr]) -> Expr:
        if any(p is not q for p, q in zip(parts, operands(x))):
            x = replace(x, args=tuple(parts)) if isinstance(x, Apply) else replace(x, body=parts[0])
        if not (isinstance(x, Reduction) and x.op == "sum"):
            return x
        chain = [x]
        while isinstance(inner := chain[-1].body, Reduction) and inner.op == "sum":
            chain.append(inner)
        largest = max(range(len(chain)), key=lambda i: (blocks.get(chain[i].axis, 0), i))
        if largest == len(chain) - 1:
            return x
        body = chain[-1].body
        for r in reversed(chain[:largest] + chain[largest + 1:] + [chain[largest]]):
            body = replace(r, body=body)
        return body
    return fold(e, combine)


def _ragged(axis: str, x: Node, identity: float, ragged: Mapping[str, int]) -> Node:
    """`x`, or over a ragged axis `where(pos(axis) < extent, x, identity)`: the padding of
    the last block contributes nothing to a reduction, whatever it holds."""
    if axis not in ragged:
        return x
    return Where(Binary("lt", Pos(axis), Const(float(ragged[axis]))), x, Const(identity))


_IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def _lowered(e: Expr, parts: list[Node], ragged: Mapping[str, int]) -> Node:
    match e:
        case Number(v):
            return Const(v)
        case Ref(tensor, axes):
            return Load(tensor, axes)
        case Position(axis):
            return Pos(axis)
        case Apply(op, (_,)):
            return Unary(op, parts[0])
        case Apply(op, (_, _)):
            return Binary(op, parts[0], parts[1])
        case Apply("where", (_, _, _)):
            return Where(*parts)
        case Reduction("sum", axis, body):
            return _sum(axis, [(f, divides, node) for (f, divides), node
                               in zip(factors(body), parts)], ragged)
        case Reduction(op, axis):
            body = _ragged(axis, parts[0], _IDENTITY[op], ragged)
            return Reduce(axis, BUILTIN_MONOIDS[op], BlockReduce(op, axis, body))
    raise TypeError(f"not a program expression: {e!r}")


def _sum(axis: str, fs: list[Factor], ragged: Mapping[str, int]) -> Node:
    inside = [f for f in fs if axis in free_axes(f[0])]
    outside = [f for f in fs if axis not in free_axes(f[0])]
    if len(inside) == 1:
        body = _ragged(axis, _product(inside), 0.0, ragged)
        loop = Reduce(axis, SUM, BlockReduce("sum", axis, body))
    else:  # both operands masked: padding may hold anything, 0 * inf included
        left, right = (_ragged(axis, _product(f), 0.0, ragged) for f in _split(inside))
        loop = Reduce(axis, SUM, Dot(axis, left, right))
    result: Node = loop
    for _, divides, node in outside:
        result = Binary("div" if divides else "mul", result, node)
    return result


def _split(fs: list[Factor]) -> tuple[list[Factor], list[Factor]]:
    """Two non-empty groups of factors for the operands of a contraction.

    The operands should be the tiles of a block matmul, each spanning as few axes as it can:
    multiplying `Q[q, d] * K[k, d]` before contracting over `d` would build a [q, k, d] tile
    where two 2-axis operands suffice.  The smallest largest operand wins, then the smallest
    operands in total, then the first split in source order.
    """
    axes = [free_axes(f[0]) for f in fs]

    def cost(left: tuple[int, ...]) -> tuple[int, int]:
        l_axes = frozenset().union(*(axes[i] for i in left))
        r_axes = frozenset().union(*(a for i, a in enumerate(axes) if i not in left))
        return max(len(l_axes), len(r_axes)), len(l_axes) + len(r_axes)

    # Factor 0 always goes left, so each split is listed once.
    if len(fs) <= EXHAUSTIVE_SPLIT:
        candidates = [(0, *rest) for n in range(len(fs) - 1)
                      for rest in combinations(range(1, len(fs)), n)]
    else:
        candidates = [tuple(range(n)) for n in range(1, len(fs))]
    best = min(candidates, key=cost)
    return [fs[i] for i in best], [f for i, f in enumerate(fs) if i not in best]


def _product(fs: list[Factor]) -> Node:
    """Multiply the factors in source order, dividing by divisors; 1/x when all divide."""
    first = next((i for i, (_, divides, _) in enumerate(fs) if not divides), None)
    if first is None:
        out: Node = Unary("recip", fs[0][2])
        rest = fs[1:]
    else:
        out = fs[first][2]
        rest = fs[:first] + fs[first + 1:]
    for _, divides, node in rest:
        out = Binary("div" if divides else "mul", out, node)
    return out
