"""The reference interpreter: executes a block program literally, tile by tile, loop by loop.

It is the oracle every fused program and every rule is checked against, so it follows the IR
semantics (`bbrules.ir`) as directly as possible and knows nothing about fusion, scheduling or
any particular monoid:

- global memory is a dict of full arrays: the inputs, plus one array per stored tensor that
  starts filled with NaN, so a read before the write shows up in the result;
- kernels run in order, and a kernel's stores one after another (they never read one
  another's tensors, so how a kernel shares work between them, and which of a store's axes are
  its grid and which its map loops, cannot change a value); each store runs its value once per
  block of its axes;
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

from .ir import (ELEMENTWISE_KINDS, WHOLE_DTYPES, Axis, BlockProgram, BlockReduce, Const, Dot,
                 Get, IRError, KindTable, Load, Monoid, Node, Pos, Reduce, Store, Tuple, Var,
                 check_whole, children, is_elementwise, operator, postorder, sched_deps,
                 validate)
from .ops import TILE_REDUCE

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


# The semantics of each node kind.  An implementation gets the node and the evaluation it is
# part of (`tile(child)` / `value(child)` give its children's values; `var(name)` a monoid
# expression's operand), so one table serves kernels and monoid expressions alike.
EVAL = KindTable("interpreter")


@EVAL.on(Load)
def _load(n: Load, run: _KernelRun) -> Value:
    return _tile(n.axes, run.memory[n.tensor][tuple(run.block_slice(a) for a in n.axes)])


@EVAL.on(Pos)
def _pos(n: Pos, run: _KernelRun) -> Value:
    where = run.block_slice(n.axis)
    return _tile((n.axis,), np.arange(where.start, where.stop))


@EVAL.on(Const)
def _const(n: Const, run: _Evaluation) -> Value:
    return _tile((), n.value)


@EVAL.on(Var)
def _var(n: Var, run: _Evaluation) -> Value:
    return run.var(n.name)


@EVAL.on(*ELEMENTWISE_KINDS)
def _apply(n: Node, run: _Evaluation) -> Value:
    return _elementwise(operator(n).numpy, *(run.tile(c) for c in children(n)))


@EVAL.on(BlockReduce)
def _block_reduce(n: BlockReduce, run: _Evaluation) -> Value:
    t = run.tile(n.x)
    data = TILE_REDUCE[n.op].numpy(t.data, axis=t.axes.index(n.axis))
    return _tile(tuple(b for b in t.axes if b != n.axis), data)


@EVAL.on(Dot)
def _dot_node(n: Dot, run: _Evaluation) -> Value:
    return _dot(n.axis, run.tile(n.x), run.tile(n.y))


@EVAL.on(Reduce)
def _reduce(n: Reduce, run: _KernelRun) -> Value:
    return run.fold(n.axis, n.monoid, n.x)


@EVAL.on(Tuple)
def _tuple(n: Tuple, run: _Evaluation) -> Value:
    return tuple(run.tile(i) for i in n.items)


@EVAL.on(Get)
def _get(n: Get, run: _Evaluation) -> Value:
    return run.value(n.x)[n.index]


class _Evaluation:
    """What node implementations read their children's values from."""

    def value(self, n: Node) -> Value:
        raise NotImplementedError

    def tile(self, n: Node) -> Tile:
        v = self.value(n)
        assert isinstance(v, Tile), "validate() admits only tiles here"
        return v

    def var(self, name: str) -> Value:
        raise IRError(f"free variable '{name}'")


class _MonoidExpr(_Evaluation):
    """A monoid's identity, combine or finalize expression over the bound state tiles."""

    def __init__(self, bound: dict[str, Tile]):
        self.bound = bound
        self.values: dict[Node, Value] = {}

    def value(self, n: Node) -> Value:
        """`n`'s value, its operands evaluated first (in post-order, not by recursion)."""
        if n not in self.values:
            for m in postorder(n):
                if m not in self.values:
                    if not (is_elementwise(m) or isinstance(m, (Const, Var))):
                        raise IRError(f"monoid expressions must be elementwise, found {m!r}")
                    self.values[m] = EVAL(m, self)
        return self.values[n]

    def var(self, name: str) -> Value:
        return self.bound[name]


def _scalar_expr(e: Node, bound: dict[str, Tile]) -> Tile:
    """Evaluate a monoid expression (elementwise over `Var`s) with the variables in `bound`."""
    return _MonoidExpr(bound).tile(e)


class _KernelRun(_Evaluation):
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
        self.orders: dict[Node, list[Node]] = {}

    def value(self, n: Node) -> Value:
        """`n`'s value in the current environment.  Its subterms outside loops are computed
        first, children before parents, so evaluation never recurses deeper than the loops
        nest, however long the expression; a value already computed for the current block
        indices (every child, when a parent reads it) is returned without that walk."""
        v = self._cached(n)
        if v is None:
            for m in self._order(n):
                self._compute(m)
            v = self._compute(n)
        return v

    def _cached(self, n: Node) -> Value | None:
        """`n`'s value if it was computed for the current indices of its `sched_deps`."""
        hit = self.cache.get(n)
        if hit is not None and hit[0] == tuple(self.env[a] for a in self.keys[n]):
            return hit[1]
        return None

    def _compute(self, n: Node) -> Value:
        v = self._cached(n)
        if v is None:
            v = EVAL(n, self)
            self.cache[n] = (tuple(self.env[a] for a in self.keys[n]), v)
        return v

    def _order(self, n: Node) -> list[Node]:
        """The subterms of `n` a computation of `n` reads (not below a loop, whose body runs
        inside it), in post-order, without `n` itself."""
        order = self.orders.get(n)
        if order is None:
            inner = () if isinstance(n, Reduce) else children(n)
            order, seen, stack = [], set(), [(c, False) for c in inner]
            while stack:
                m, expanded = stack.pop()
                if expanded:
                    order.append(m)
                elif m not in seen:
                    seen.add(m)
                    stack.append((m, True))
                    if not isinstance(m, Reduce):
                        stack.extend((c, False) for c in children(m))
            self.orders[n] = order
        return order

    def block_slice(self, axis: Axis) -> slice:
        b = self.program.block(axis)
        return slice(self.env[axis] * b, (self.env[axis] + 1) * b)

    def fold(self, axis: Axis, m: Monoid, body: Node) -> Value:
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
        # An axis of one block has block index 0 everywhere, bound or not by the store (a
        # split fold's row maximum is computed beside a head-dim-wide accumulator).
        single = {a: 0 for a, d in self.program.dims.items() if d.blocks == 1}
        for index in itertools.product(*(range(self.program.blocks(a)) for a in axes)):
            self.env = {**single, **dict(zip(axes, index))}
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
        if program.tensors[name].dtype in WHOLE_DTYPES:
            check_whole(name, inputs[name])


def run(program: BlockProgram, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute `program` on `inputs`; return every stored tensor (axes in declared order).

    The program is validated first.
    """
    validate(program)
    _check_inputs(program, inputs)
    memory = {name: padded(program, name, np.asarray(inputs[name], dtype=F32))
              for name in program.inputs}
    for k in program.stores:
        shape = tuple(program.padded(a) for a in program.tensors[k.tensor].axes)
        memory.setdefault(k.tensor, np.full(shape, np.nan, dtype=F32))
    for t in program.tensors.values():
        if t.role == "view":  # numpy's reshape of a contiguous array shares its memory
            memory[t.name] = memory[t.base].reshape([program.extent(a) for a in t.axes])
    with np.errstate(all="ignore"):
        for kernel in program.kernels:
            for k in kernel.stores:
                _KernelRun(program.in_kernel(kernel), memory, k).run()
    return {k.tensor: unpadded(program, k.tensor, memory[k.tensor]) for k in program.stores}


def padded(program: BlockProgram, tensor: str, array: np.ndarray) -> np.ndarray:
    """`array` in global memory's layout: zeros after the extent of each ragged axis."""
    axes = program.tensors[tensor].axes
    pad = [(0, program.padded(a) - program.extent(a)) for a in axes]
    return np.pad(array, pad) if any(p for _, p in pad) else np.array(array, dtype=F32)


def unpadded(program: BlockProgram, tensor: str, array: np.ndarray) -> np.ndarray:
    """A tensor of global memory at its extents."""
    axes = program.tensors[tensor].axes
    return array[tuple(slice(0, program.extent(a)) for a in axes)]
