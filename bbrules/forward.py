"""Maps computed where they are read: a step after stitching fused candidates.

Candidates are fused apart (`candidates`), so a kernel at the end of one that only maps
tensors elementwise stays a kernel whose result the next candidate loads, where one fusion of
the two would have computed it in the reader: grouped-query attention's keys and values
repeated for each query head (`x + 0 * pos(g)`), attention's scale (`x * c`), rotary
embedding's `x * cos` read through a view that splits each head in halves.  Such a store
reduces nothing, so its value, its axes renamed to each load's, can stand for each load of
what it stores: the readers do a few elementwise operations on their tiles, and the program
saves a pass over memory, a write and, when it was its kernel's only store, a kernel.  A load
through a view of the stored tensor (a split of its axes) takes each operand through the same
split of the operand's memory.  A store is forwarded only where the program's cost does not
grow by the fusion's objective: a tile recomputed in every iteration of a reader's loop may
cost more than the pass it saves.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from .cost import ProgramCost, cost_kernel, cost_program
from .ir import (Axis, BlockProgram, Const, IRError, Kernel, Load, Node, Pos, Store,
                 TensorDecl, check_view, is_elementwise, postorder, rebuild, rename_axes,
                 transform, validate)
from .targets import Target


def forwarded(p: BlockProgram, target: Target, objective: str = "time") -> BlockProgram:
    """`p` with each store of an elementwise map into a temporary forwarded into the loads of
    that temporary (module docstring) and taken out of its kernel, where that does not make
    the program worse on `target` by `objective` (`ProgramCost.key`, anchored at the time
    before: within the model's resolution less traffic wins); `p` itself where there is
    none."""
    out, cost, i = p, cost_program(p, target), 0
    while i < len(out.kernels):
        for store in out.kernels[i].stores:
            shorter = _forward(out, out.kernels[i], store)
            fewer = None if shorter is None else _recosted(out, cost, shorter, target)
            if fewer is not None and \
                    fewer.key(objective, cost.time) <= cost.key(objective, cost.time):
                out, cost = shorter, fewer
                break
        else:
            i += 1
    try:  # (a forwarded value keeps the tile type of the load it stands for)
        validate(out)
    except IRError:
        return p
    return out


def _recosted(p: BlockProgram, cost: ProgramCost, q: BlockProgram, target: Target
              ) -> ProgramCost:
    """`q`'s cost, where `q` is `p` (of cost `cost`) with some kernels rewritten: those are
    costed, the others' costs kept (costing a model's 32 layers whole for each kernel
    forwarded, and checking them, took 23 s)."""
    kept = dict(zip(p.kernels, cost.kernels))
    return replace(cost, kernels=tuple(kept[k] if k in kept else cost_kernel(q, k, target)
                                       for k in q.kernels))


def _forward(p: BlockProgram, k: Kernel, s: Store) -> BlockProgram | None:
    """`p` without store `s` of kernel `k` (nor `k`, where that was its only store), its value
    standing for every load of what it stores, if `s` maps tensors into a temporary and every
    such load can take it."""
    if p.tensors[s.tensor].role != "temp" or s.axes != p.tensors[s.tensor].axes:
        return None
    nodes = list(postorder(s.value))
    if not all(is_elementwise(n) or isinstance(n, (Load, Const, Pos)) for n in nodes) or \
            not all(set(_axes(n)) <= set(s.axes) for n in nodes if isinstance(n, (Load, Pos))):
        return None
    views = {name for name, t in p.tensors.items() if t.base == s.tensor}
    tensors = dict(p.tensors)

    def value_for(load: Load) -> Node | None:
        """What `load` reads, computed from the operands; None where it cannot be."""
        if load.tensor == s.tensor:
            return rename_axes(s.value, dict(zip(s.axes, load.axes)))
        view = p.tensors[load.tensor]
        parts = _parts(p, s.axes, view.axes)
        if parts is None:
            return None
        failed = False

        def split(n: Node, kids: tuple) -> Node:
            """`n` in the view's axes: each operand read through the same split."""
            nonlocal failed
            if isinstance(n, Pos):
                failed |= len(parts[n.axis]) != 1  # (a position along an axis split)
                return Pos(parts[n.axis][0])
            if not isinstance(n, Load):
                return rebuild(n, kids)
            axes = tuple(b for a in n.axes for b in parts[a])
            if len(axes) == len(n.axes):
                return Load(n.tensor, axes)
            storage = p.tensors[n.tensor].storage
            name = f"{storage}__{'_'.join(axes)}"
            decl = tensors.setdefault(name, TensorDecl(name, axes, tensors[storage].dtype,
                                                       "view", storage))
            failed |= decl.base != storage or decl.axes != axes  # (a name taken)
            try:
                check_view(p.dims, tensors, decl)
            except IRError:
                failed = True
            return Load(name, axes)
        value = transform(s.value, split)
        return None if failed else rename_axes(value, dict(zip(view.axes, load.axes)))

    read = {s.tensor, *views}
    kernels = []
    for other in p.kernels:
        if other is k:
            if len(k.stores) > 1:
                kernels.append(replace(k, stores=tuple(t for t in k.stores if t is not s)))
            continue
        if not _loads(other) & read:
            kernels.append(other)  # (the same kernel: `_recosted` knows its cost)
            continue
        stores = []
        for store in other.stores:
            failed = False

            def forward(n: Node, kids: tuple) -> Node:
                nonlocal failed
                if isinstance(n, Load) and n.tensor in read:
                    value = value_for(n)
                    if value is None:
                        failed = True
                        return n
                    return value
                return rebuild(n, kids)
            value = transform(store.value, forward)
            if failed:
                return None
            stores.append(replace(store, value=value))
        kernels.append(replace(other, stores=tuple(stores)))
    for name in read:
        del tensors[name]
    return BlockProgram(p.dims, tensors, tuple(kernels), p.outputs)


def _axes(n: Load | Pos) -> tuple[Axis, ...]:
    return n.axes if isinstance(n, Load) else (n.axis,)


def _parts(p: BlockProgram, axes: tuple[Axis, ...], view: tuple[Axis, ...]
           ) -> dict[Axis, tuple[Axis, ...]] | None:
    """The axes of `view` that each of `axes` (a tensor's, in order) is split into, where the
    view only splits them (row-major, as numpy's reshape); None where it merges any."""
    parts, i = {}, 0
    for a in axes:
        part: list[Axis] = []
        while i < len(view) and (not part or math.prod(map(p.extent, part)) < p.extent(a)):
            part.append(view[i])
            i += 1
        if math.prod(map(p.extent, part)) != p.extent(a):
            return None
        parts[a] = tuple(part)
    return parts if i == len(view) else None


@lru_cache(maxsize=4096)
def _loads(k: Kernel) -> frozenset[str]:
    """The tensors `k` loads."""
    return frozenset(n.tensor for s in k.stores for n in postorder(s.value)
                     if isinstance(n, Load))
