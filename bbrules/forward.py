"""Kernels that only map one tensor, computed where they are read: a step after stitching
fused candidates.

Candidates are fused apart (`candidates`), so a kernel at the end of one that only repeats or
scales a tensor stays a kernel whose result the next candidate loads, where one fusion of the
two would have computed it in the reader: grouped-query attention's keys and values repeated
for each query head (`x + 0 * pos(g)`), attention's scale (`x * c`).  Such a kernel reads one
tensor and reduces nothing, so its value, its axes renamed to each load's, can stand for each
load of what it stores: the readers do a few elementwise operations on their tiles, and the
program saves a pass over memory, a write and a kernel.  A load through a view of the stored
tensor (a split of its axes) takes the operand through the same split of the operand's memory,
where the kernel reads its operand in its own axes' order and uses no position.  A kernel is
forwarded only where the program's cost does not grow by the fusion's objective: a tile
recomputed in every iteration of a reader's loop may cost more than the pass it saves.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from .cost import ProgramCost, cost_kernel, cost_program
from .ir import (BlockProgram, Const, IRError, Kernel, Load, Node, Pos, TensorDecl,
                 is_elementwise, postorder, rebuild, rename_axes, transform, validate)
from .targets import Target


def forwarded(p: BlockProgram, target: Target, objective: str = "time") -> BlockProgram:
    """`p` with each kernel that maps one tensor into a temporary forwarded into the loads of
    that temporary (module docstring), and removed, where that does not make the program
    worse on `target` by `objective` (`ProgramCost.key`, anchored at the time before: within
    the model's resolution less traffic wins); `p` itself where there is none."""
    out, cost, i = p, cost_program(p, target), 0
    while i < len(out.kernels):
        shorter = _forward(out, out.kernels[i])
        fewer = None if shorter is None else _recosted(out, cost, shorter, target)
        if fewer is not None and fewer.key(objective, cost.time) <= cost.key(objective, cost.time):
            out, cost = shorter, fewer
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


def _forward(p: BlockProgram, k: Kernel) -> BlockProgram | None:
    """`p` without kernel `k`, its value standing for every load of what it stores, if `k`
    maps one tensor into a temporary and every such load can take it."""
    if len(k.stores) != 1 or k.blocks:
        return None
    s = k.stores[0]
    if p.tensors[s.tensor].role != "temp" or s.axes != p.tensors[s.tensor].axes:
        return None
    nodes = list(postorder(s.value))
    operands = [n for n in nodes if isinstance(n, Load)]
    if len(operands) != 1 or not all(is_elementwise(n) or isinstance(n, (Load, Const, Pos))
                                      for n in nodes):
        return None
    operand = operands[0]
    views = {name for name, t in p.tensors.items() if t.base == s.tensor}
    tensors = dict(p.tensors)

    def value_for(load: Load) -> Node | None:
        """What `load` reads, computed from the operand; None where it cannot be."""
        if load.tensor == s.tensor:
            return rename_axes(s.value, dict(zip(s.axes, load.axes)))
        if operand.axes != s.axes or any(isinstance(n, Pos) for n in nodes):
            return None
        view = p.tensors[load.tensor]
        storage = p.tensors[operand.tensor].storage
        name = f"{storage}__{'_'.join(view.axes)}"
        decl = tensors.setdefault(name, TensorDecl(name, view.axes, tensors[storage].dtype,
                                                   "view", storage))
        if decl.base != storage or decl.axes != view.axes:
            return None  # (a tensor of that name that is not this view)
        split = transform(s.value, lambda n, kids: Load(name, view.axes) if n == operand
                          else rebuild(n, kids))
        return rename_axes(split, dict(zip(view.axes, load.axes)))

    read = {s.tensor, *views}
    kernels = []
    for other in p.kernels:
        if other is k:
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


@lru_cache(maxsize=4096)
def _loads(k: Kernel) -> frozenset[str]:
    """The tensors `k` loads."""
    return frozenset(n.tensor for s in k.stores for n in postorder(s.value)
                     if isinstance(n, Load))
