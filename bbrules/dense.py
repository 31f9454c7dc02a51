"""The dense evaluator: runs a program's statements on whole arrays.

It is the independent reference for everything downstream of the frontend: it reads the
checked `Program` (not the block IR), knows nothing of blocks, tiles or loops, and computes each
statement with numpy broadcasting by axis name, sums of products with `einsum`.  When a lowered
or fused block program agrees with it, the lowering and the rewrites are right.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ir import Axis, Dim
from .ops import BINARY, TERNARY, TILE_REDUCE, UNARY
from .program import (Apply, Expr, Number, Position, Program, Reduction, Ref, factors, fold,
                      sum_factors)


MAX_EINSUM = 16  # operands of one einsum (numpy allows at most 32)


@dataclass(frozen=True)
class _Named:
    """An array with one axis name per dimension."""

    axes: tuple[Axis, ...]
    data: np.ndarray

    def along(self, axes: tuple[Axis, ...]) -> np.ndarray:
        """The data laid out along `axes` (a superset of ours), size 1 where we do not span."""
        order = [a for a in axes if a in self.axes]
        data = np.transpose(self.data, [self.axes.index(a) for a in order])
        return data.reshape([data.shape[order.index(a)] if a in order else 1 for a in axes])


def evaluate(program: Program, inputs: dict[str, np.ndarray],
             dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Every tensor the statements define, axes in declared order, computed in `dtype`."""
    env = {name: np.asarray(inputs[name], dtype=dtype) for name in program.inputs}
    views = {t.name: (t.base, tuple(program.dims[a].extent for a in t.axes))
             for t in program.tensors.values() if t.role == "view"}
    evaluator = _Evaluator(env, program.dims, views, dtype)
    with np.errstate(all="ignore"):
        for s in program.statements:
            env[s.target] = evaluator.eval(s.expr).along(s.axes)
    return {s.target: env[s.target] for s in program.statements}


@dataclass
class _Evaluator:
    """Evaluates expressions over the tensors in `env` (inputs and statements so far)."""

    env: dict[str, np.ndarray]
    dims: dict[str, Dim]
    views: dict[str, tuple[str, tuple[int, ...]]]  # view -> (the tensor it reads, its shape)
    dtype: type

    def eval(self, e: Expr) -> _Named:
        """`e`'s value; a sum from its body's factors, never the whole product."""
        return fold(e, self.value, sum_factors)

    def value(self, e: Expr, parts: list[_Named]) -> _Named:
        match e:
            case Number(v):
                return _Named((), np.asarray(v, dtype=self.dtype))
            case Ref(tensor, axes) if tensor in self.views:
                base, shape = self.views[tensor]
                return _Named(axes, self.env[base].reshape(shape))
            case Ref(tensor, axes):
                return _Named(axes, self.env[tensor])
            case Apply(op, (_,)):
                v = parts[0]
                return _Named(v.axes, UNARY[op].numpy(v.data).astype(self.dtype))
            case Position(axis):
                return _Named((axis,), np.arange(self.dims[axis].extent, dtype=self.dtype))
            case Apply(op, (_, _)):
                return self.binary(op, *parts)
            case Apply("where", (_, _, _)):
                axes = tuple(dict.fromkeys(a for v in parts for a in v.axes))
                out = TERNARY["where"].numpy(*(v.along(axes) for v in parts))
                return _Named(axes, np.asarray(out, dtype=self.dtype))
            case Reduction("sum", axis, body):
                return self.sum(axis, [(v, divides) for v, (_, divides)
                                       in zip(parts, factors(body))])
            case Reduction(op, axis):
                v = parts[0]
                return _Named(tuple(a for a in v.axes if a != axis),
                              TILE_REDUCE[op].numpy(v.data, axis=v.axes.index(axis)))
        raise TypeError(f"not a program expression: {e!r}")

    def binary(self, op: str, vx: _Named, vy: _Named) -> _Named:
        axes = tuple(dict.fromkeys(vx.axes + vy.axes))
        out = BINARY[op].numpy(vx.along(axes), vy.along(axes))
        return _Named(axes, np.asarray(out, dtype=self.dtype))

    def sum(self, axis: Axis, factor_values: list[tuple[_Named, bool]]) -> _Named:
        """A sum of a product as one einsum over its factors (divisors as reciprocals); a
        product of more than `MAX_EINSUM` factors is multiplied out down to that many first."""
        operands = [_Named(v.axes, np.reciprocal(v.data) if divides else v.data)
                    for v, divides in factor_values]
        while len(operands) > MAX_EINSUM:
            operands = [self.binary("mul", *operands[i:i + 2]) if i + 1 < len(operands)
                        else operands[i] for i in range(0, len(operands), 2)]
        labels = {a: i for i, a in enumerate(dict.fromkeys(a for v in operands for a in v.axes))}
        out = tuple(a for a in labels if a != axis)
        args: list = []
        for v in operands:
            args += [v.data, [labels[a] for a in v.axes]]
        data = np.einsum(*args, [labels[a] for a in out], optimize=True)
        return _Named(out, np.asarray(data, dtype=self.dtype))
