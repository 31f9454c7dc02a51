"""The reference interpreter: executes a block program literally, tile by tile, loop by loop.

It is the oracle every fused program and every rule is checked against, so it follows the IR
semantics (`bbrules.ir`) as directly as possible and knows nothing about fusion, scheduling or
any particular monoid:

- global memory is a dict of full arrays: the inputs, plus one array per stored tensor that
  starts filled with NaN, so a read before the write shows up in the result;
- kernels run in order; each runs its value once per block of its store axes (the grid);
- a `Reduce` is a Python loop over the blocks of its axis that folds the body with the monoid's
  own identity / combine / finalize expressions.

Tiles are named arrays and elementwise operators broadcast by axis name.  Everything is
computed in float32: f16/bf16 inputs are widened on entry and every global tensor is held in
float32, because the interpreter checks the algebra of a program, not the rounding of a storage
format (rounding stores would make a fused program differ from the unfused one by design).
Overflow and NaN propagate as they would on hardware, without numpy warnings.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .ir import (Axis, Binary, BlockProgram, BlockReduce, Const, Dot, Get, IRError, Load, Node,
                 Monoid, Reduce, Store, Tuple, Unary, Var, postorder, sched_deps, validate)
from .ops import BINARY, TILE_REDUCE, UNARY

F32 = np.float32


@dataclass(frozen=True)
class Tile:
    """A named array: `data` has one dimension per axis of `axes`, in that order."""

    axes: tuple[Axis, ...]
    data: np.ndarray

    def aligned(self, axes: tuple[Axis, ...]) -> np.ndarray:
        """The data laid out along `axes` (a superset of ours), size 1 where we do not span."""
        order = [a for a in axes if a in self.axes]
        data = np.transpose(self.data, [self.axes.index(a) for a in order])
        return data.reshape([data.shape[order.index(a)] if a in order else 1 for a in axes])


Value = Tile | tuple[Tile, ...]


def _tile(axes: tuple[Axis, ...], data: np.ndarray | float) -> Tile:
    return Tile(axes, np.asarray(data, dtype=F32))


def _union(*tiles: Tile) -> tuple[Axis, ...]:
    return tuple(dict.fromkeys(a for t in tiles for a in t.axes))


def _elementwise(fn: Callable[..., np.ndarray], *tiles: Tile) -> Tile:
    axes = _union(*tiles)
    return _tile(axes, fn(*(t.aligned(axes) for t in tiles)))


def _dot(axis: Axis, x: Tile, y: Tile) -> Tile:
    axes = _union(x, y)
    out = tuple(a for a in axes if a != axis)
    letter = {a: chr(ord("a") + i) for i, a in enumerate(axes)}
    spec = "".join(letter[a] for a in x.axes) + "," + "".join(letter[a] for a in y.axes)
    spec += "->" + "".join(letter[a] for a in out)
    return _tile(out, np.einsum(spec, x.data, y.data, optimize=True))


def _scalar_expr(e: Node, bound: dict[str, Tile]) -> Tile:
    """Evaluate a monoid expression (elementwise over `Var`s) with the variables in `bound`."""
    match e:
        case Var(name):
            return bound[name]
        case Const(v):
            return _tile((), v)
        case Unary(op, x):
            return _elementwise(UNARY[op].numpy, _scalar_expr(x, bound))
        case Binary(op, x, y):
            return _elementwise(BINARY[op].numpy, _scalar_expr(x, bound), _scalar_expr(y, bound))
    raise IRError(f"monoid expressions must be elementwise, found {e!r}")


class _KernelRun:
    """The evaluation of one kernel's value under an environment {axis: block index}.

    Each node's last value is kept with the block indices of its `sched_deps` it was computed
    for, and reused while those are unchanged.  That is sound (a node's value is a function of
    those indices alone) and is exactly loop-invariant hoisting, so memory stays one tile per
    node; every loop still runs all of its iterations, in order.
    """

    def __init__(self, program: BlockProgram, memory: dict[str, np.ndarray], kernel: Store):
        self.program = program
        self.memory = memory
        self.kernel = kernel
        self.env: dict[Axis, int] = {}
        self.keys = {n: tuple(sorted(sched_deps(n))) for n in postorder(kernel.value)}
        self.cache: dict[Node, tuple[tuple[int, ...], Value]] = {}

    def value(self, n: Node) -> Value:
        key = tuple(self.env[a] for a in self.keys[n])
        hit = self.cache.get(n)
        if hit is not None and hit[0] == key:
            return hit[1]
        v = self._compute(n)
        self.cache[n] = (key, v)
        return v

    def tile(self, n: Node) -> Tile:
        v = self.value(n)
        assert isinstance(v, Tile), "validate() admits only tiles here"
        return v

    def block_slice(self, axis: Axis) -> slice:
        b = self.program.block(axis)
        return slice(self.env[axis] * b, (self.env[axis] + 1) * b)

    def _compute(self, n: Node) -> Value:
        match n:
            case Load(name, axes):
                return _tile(axes, self.memory[name][tuple(self.block_slice(a) for a in axes)])
            case Const(v):
                return _tile((), v)
            case Unary(op, x):
                return _elementwise(UNARY[op].numpy, self.tile(x))
            case Binary(op, x, y):
                return _elementwise(BINARY[op].numpy, self.tile(x), self.tile(y))
            case BlockReduce(op, a, x):
                t = self.tile(x)
                data = TILE_REDUCE[op].numpy(t.data, axis=t.axes.index(a))
                return _tile(tuple(b for b in t.axes if b != a), data)
            case Dot(a, x, y):
                return _dot(a, self.tile(x), self.tile(y))
            case Reduce(a, m, x):
                return self._reduce(a, m, x)
            case Tuple(items):
                return tuple(self.tile(i) for i in items)
            case Get(i, x):
                return self.value(x)[i]
        raise IRError(f"cannot evaluate {n!r} inside a kernel")

    def _reduce(self, axis: Axis, m: Monoid, body: Node) -> Value:
        state = [_scalar_expr(e, {}) for e in m.identity]
        outer = self.env.get(axis)
        for i in range(self.program.blocks(axis)):
            self.env[axis] = i
            contribution = self.value(body)
            parts = contribution if isinstance(contribution, tuple) else (contribution,)
            bound = {f"a.{c}": s for c, s in zip(m.state, state)}
            bound |= {f"b.{c}": p for c, p in zip(m.state, parts)}
            state = [_scalar_expr(e, bound) for e in m.combine]
        if outer is None:
            del self.env[axis]
        else:
            self.env[axis] = outer
        final = dict(zip(m.state, state))
        out = tuple(_scalar_expr(e, final) for e in m.finalize)
        return out[0] if len(out) == 1 else out

    def run(self) -> None:
        """Evaluate the kernel's value for every block of its grid and store each tile."""
        axes = self.kernel.axes
        target = self.memory[self.kernel.tensor]
        for index in itertools.product(*(range(self.program.blocks(a)) for a in axes)):
            self.env = dict(zip(axes, index))
            target[tuple(self.block_slice(a) for a in axes)] = \
                self.tile(self.kernel.value).aligned(axes)


def _check_inputs(program: BlockProgram, inputs: dict[str, np.ndarray]) -> None:
    for name in program.inputs:
        if name not in inputs:
            raise ValueError(f"missing input '{name}'")
        want = tuple(program.extent(a) for a in program.tensors[name].axes)
        if np.shape(inputs[name]) != want:
            raise ValueError(f"input '{name}' has shape {np.shape(inputs[name])}, "
                             f"the program declares {want}")


def run(program: BlockProgram, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute `program` on `inputs`; return every stored tensor (axes in declared order).

    The program is validated first.
    """
    validate(program)
    _check_inputs(program, inputs)
    memory = {name: np.array(inputs[name], dtype=F32) for name in program.inputs}
    for k in program.kernels:
        shape = tuple(program.extent(a) for a in program.tensors[k.tensor].axes)
        memory.setdefault(k.tensor, np.full(shape, np.nan, dtype=F32))
    with np.errstate(all="ignore"):
        for k in program.kernels:
            _KernelRun(program, memory, k).run()
    return {k.tensor: memory[k.tensor] for k in program.kernels}
