"""Split reductions: a reduction that leaves processors idle runs in chunks on more of them.

A kernel of `g` grid points uses `g / processors` of the chip.  When one of its stores folds
`reduce(a, m, x)` over many blocks of `a` (decode-time attention: one query row per head, a
long KV cache), the fold can be cut into `s` chunks of `a`'s blocks:

    kernel 1, grid + [a_c]:  P_c[..., a_c] = reduce(a_i, m.partial(), x[a -> (a_c, a_i)])
    kernel 2, grid:          Y = ... reduce(a_c, m, tuple(P_c[..., a_c])) ...

Kernel 1 runs `s` times as many grid points, each folding one chunk of `a_i` blocks and
storing the *unfinalized* state (`Monoid.partial`, f32 like every intermediate).  Kernel 2
folds the `s` states with `m`'s own combine and finalizes.  Folds are associative, so this is
sound for every monoid: it is Flash-Decoding for the online softmax, split-K for a sum, and
the same for any monoid a pack defines; no rule per monoid.

The chunks are addressed without copying: the axis `a` of every tensor the fold reads along it
is reshaped into (`a_c`, `a_i`) by a view (`TensorDecl` role `view`), and the fold runs over
`a_i`.  One chunk of `a`'s blocks is a block of `a_c`, a one-element block, so kernel 2 takes
each loaded state through a one-element in-tile fold before folding over `a_c`.

A state component must span exactly the axes it depends on (a store's value does), so a fold
whose components' axes differ along a blocked axis (an attention output of several head-dim
blocks with one row maximum) is not split.  Which fold and how many chunks is a launch decision
(`grouping`), priced with the exact cost: the parallelism share in the time is what a split
buys, the partial states' traffic and the second launch are what it costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from .ir import (BlockProgram, BlockReduce, Binary, Const, Dim, Get, IRError, Kernel, Load, Node,
                 Pos, Reduce, Store, TensorDecl, TileType, Tuple, postorder, rebuild, rename_axes,
                 sched_deps, transform, type_of)
from .cost import KernelCost, ProgramCost
from .plan import kernel_uses
from .targets import Target

Make = Callable[[tuple[str, ...], tuple[Store, ...]], Kernel]

@dataclass(frozen=True)
class Split:
    """One fold of one kernel cut into chunks: what the program gains (dims, views, state
    tensors) and the two kernels that replace the kernel."""

    dims: tuple[Dim, ...]
    tensors: tuple[TensorDecl, ...]
    kernels: tuple[Kernel, Kernel]

    def fits(self, p: BlockProgram) -> bool:
        """Do its names mean the same in `p` (absent, or declared alike)?"""
        return all(p.dims.get(d.name, d) == d for d in self.dims) and \
            all(p.tensors.get(t.name, t) == t for t in self.tensors)


class Splitter:
    """The split launches on a target.  Candidates of one extraction share most kernels, so
    each kernel's splits are worked out once (`make` interns the kernels)."""

    def __init__(self, target: Target, make: Make = Kernel):
        self.target = target
        self.make = make
        self.splits: dict[tuple, tuple[Split, ...]] = {}
        self.states: set[str] = set()  # the tensors splits store their chunks' states in

    def moves(self, p: BlockProgram, cost: ProgramCost) -> Iterator[BlockProgram]:
        """Every program that splits one outermost fold of a one-store kernel whose grid
        leaves processors idle, into each useful number of chunks; `cost` is `p`'s, by which
        kernels that no split could speed up enough are passed over.  The two kernels of a
        split (they store or read states) are not split again."""
        for i, (kernel, kc) in enumerate(zip(p.kernels, cost.kernels)):
            if len(kernel.stores) != 1 or not self.may_pay(kc, cost.time) or \
                    kernel_uses(kernel)[1] & self.states:
                continue
            for split in self.of(p, kernel):
                if split.fits(p):
                    yield replace(p, dims={**p.dims, **{d.name: d for d in split.dims}},
                                  tensors={**p.tensors, **{t.name: t for t in split.tensors}},
                                  kernels=p.kernels[:i] + split.kernels + p.kernels[i + 1:])

    def may_pay(self, kernel: KernelCost, total: float) -> bool:
        """Could splitting `kernel` make a program of modeled time `total` faster by more than
        the target's resolution?  At best the split fills the chip with the same work and
        bytes, and adds one launch; its states only add traffic, which loses every tie."""
        return may_pay(kernel, 1.0, self.target.launch_cost, total, self.target, True)

    def of(self, p: BlockProgram, kernel: Kernel) -> tuple[Split, ...]:
        """The splits of `kernel` worth pricing, given the dims and tensors it reads in `p`."""
        axes, tensors = kernel_uses(kernel)
        key = (kernel, tuple(p.dims[a] for a in sorted(axes)),
               tuple(p.tensors[t] for t in sorted(tensors)))
        if key not in self.splits:
            self.splits[key] = tuple(self._splits(p, kernel))
            self.states.update(t.name for s in self.splits[key] for t in s.tensors
                               if t.role == "temp")
        return self.splits[key]

    def _splits(self, p: BlockProgram, kernel: Kernel) -> Iterator[Split]:
        p = p.in_kernel(kernel)
        grid_points = math.prod(p.blocks(a) for a in kernel.grid)
        if grid_points >= self.target.processors:
            return
        # The cost model's share of the chip grows until the grid fills it, and every chunk
        # adds a state to store: so the fewest chunks that fill the chip (or as many as the
        # fold has blocks), and half as many in case the states cost more than idle processors.
        fill = 1 << max(0, math.ceil(math.log2(self.target.processors / grid_points)))
        folds: dict[str, list[Reduce]] = {}
        for fold in _outermost_folds(kernel.stores[0].value):
            folds.setdefault(fold.axis, []).append(fold)
        for axis, siblings in folds.items():
            blocks = p.blocks(axis)
            most = min(fill, blocks & -blocks)  # a power of two dividing the blocks
            for chunks in dict.fromkeys((most // 2, most)):
                if chunks >= 2:
                    split = _split(p, kernel, axis, siblings, chunks, self.make)
                    if split is not None:
                        yield split


def may_pay(kernel: KernelCost, share: float, launches: float, total: float,
            target: Target, more_traffic: bool) -> bool:
    """Could `kernel`, relaunched with `share` of the chip at best and the same work and
    bytes, plus `launches` seconds of launch cost, make a program of modeled time `total`
    faster?  A move that surely adds traffic (`more_traffic`) must be faster by more than the
    target's resolution: closer, less traffic wins."""
    before = min(1.0, kernel.grid_points / target.processors)
    gain = (kernel.time - target.launch_cost) * (1 - before / share) - launches
    if not more_traffic:
        return gain > 0
    return gain > 0 and gain * (1 + target.resolution) > target.resolution * total


def _outermost_folds(value: Node) -> list[Reduce]:
    """The reductions of `value` that no other reduction encloses (their loops are the
    kernel's outermost), in postorder."""
    inner = {m for n in postorder(value) if isinstance(n, Reduce)
             for m in postorder(n.x) if isinstance(m, Reduce)}
    return [n for n in postorder(value) if isinstance(n, Reduce) and n not in inner]


def _split(p: BlockProgram, kernel: Kernel, a: str, folds: list[Reduce], chunks: int,
           make: Make) -> Split | None:
    """The `folds` over `a` of `kernel` (siblings that share its loop) cut into `chunks`
    together; None when a state cannot be stored (see the module docstring)."""
    (store,) = kernel.stores
    if any(isinstance(n, Reduce) and n.axis == a for f in folds for n in postorder(f.x)):
        return None  # a fold over all of `a` inside would see only the chunk
    d = p.dims[a]
    if d.ragged:
        return None  # chunks of whole blocks only
    chunk, inner = f"{a}_c{chunks}", f"{a}_i{chunks}"
    new_dims = {chunk: Dim(chunk, chunks, 1), inner: Dim(inner, d.extent // chunks, d.block)}
    dims = {**p.dims, **new_dims}
    new_tensors: dict[str, TensorDecl] = {}

    def chunked(n: Node, kids: tuple) -> Node:
        """A load along `a` (renamed `inner`) reads the view of its tensor with `a` cut into
        chunks; a position along `a` is the chunk's start plus the position in the chunk."""
        if n == Pos(inner):
            return Binary("add", Binary("mul", Pos(chunk), Const(float(d.extent // chunks))), n)
        if not (isinstance(n, Load) and inner in n.axes):
            return rebuild(n, kids)
        decl = p.tensors[n.tensor]
        if any(p.dims[x].ragged for x in decl.axes):
            raise IRError(f"'{decl.name}' has a ragged axis: no view of it")
        j = n.axes.index(inner)
        view = f"{decl.storage}_{a}{chunks}"
        axes = decl.axes[:j] + (chunk, inner) + decl.axes[j + 1:]
        if new_tensors.setdefault(view, TensorDecl(view, axes, decl.dtype, "view", decl.storage)
                                  ).axes != axes:
            raise IRError(f"'{view}' is already a view under other axes")
        return Load(view, n.axes[:j] + (chunk, inner) + n.axes[j + 1:])

    parts: list[Store] = []
    combined: dict[Reduce, Reduce] = {}
    try:
        for fold in folds:
            renamed = rename_axes(fold.x, {a: inner})
            if renamed is None:
                return None
            partial = Reduce(inner, fold.monoid.partial(), transform(renamed, chunked))
            types = type_of(partial)
            types = (types,) if isinstance(types, TileType) else types
            contributions = []
            for c, (name, t) in enumerate(zip(fold.monoid.state, types)):
                value = partial if len(types) == 1 else Get(c, partial)
                axes = tuple(x for x in dims if x in t.shape)
                if t.shape != t.deps or any(dims[x].blocks > 1
                                            for x in sched_deps(value) - t.shape):
                    return None
                tensor = _fresh(f"{store.tensor}_{name}{chunks}", new_tensors)
                new_tensors[tensor] = TensorDecl(tensor, axes)
                parts.append(Store(tensor, axes, value))
                contributions.append(BlockReduce("max", chunk, Load(tensor, axes)))
            combined[fold] = Reduce(chunk, fold.monoid, contributions[0] if len(contributions) == 1
                                    else Tuple(tuple(contributions)))
    except IRError:
        return None
    grid = tuple(x for x in dims if all(x in s.axes for s in parts))
    value = transform(store.value, lambda n, kids: combined.get(n) or rebuild(n, kids))
    finish = Store(store.tensor, store.axes, value)
    return Split(tuple(new_dims.values()), tuple(new_tensors.values()),
                 (make(grid, tuple(parts), kernel.blocks),
                  make(kernel.grid, (finish,), kernel.blocks)))


def _fresh(name: str, taken: dict) -> str:
    out, n = name, 1
    while out in taken:
        n += 1
        out = f"{name}_{n}"
    return out
