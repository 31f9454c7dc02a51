"""Folds whose blocks a rule wrote into them, written again for other blocks.

A rule may write an axis' block into the fold it makes.  Welford's statistics carry each
block's count and mean, `tuple(const(block(?e)), bsum(?e, ?x) * const(1 / block(?e)), ...)`
(rules/statistics.bbr), which for a program's blocks of 64 is `tuple(64.0, bsum(e, x) *
0.015625, ...)`.  Such a fold walks the blocks it was written for (`plan.block_bound_axes`),
so a LayerNorm over 768 features took 12 loop steps where one tile holds the whole row: on
the cpu target, a dozen numpy calls where one would do.

A rule holds at every block size (its soundness is checked at several), so the instance a
fold is, written for another block, has the same value.  `refolded` finds that instance:
the right side of a standard rule matched against the fold, its computed sizes (`block(?e)`,
`1 / block(?e)`) matching the numbers they are at the kernel's block (`Binding.match`'s
`sizes`), the rule's guards holding at both blocks; and builds it again at the new block.
Where a fold is read through `get(i, ...)`, a rule's right side must be `get(i, fold)` for
each i read (`welford_mean` says what component 0 is, `welford_var` component 1).  A fold no
standard rule wrote keeps its blocks.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from .ir import BlockProgram, Dim, Get, Kernel, Node, Reduce, postorder, rebuild, transform
from .packs import standard_pack_dir
from .patterns import Binding, _operands
from .plan import holds_block
from .rule import AxisSize, CExpr, ConstCmp, Pattern, Rule
from .rulefile import load_pack


def refolded(p: BlockProgram, k: Kernel, axis: str, block: int) -> Kernel | None:
    """`k` walking `axis` in blocks of `block`, its folds over the axis that hold the axis'
    block as a number written again for the new one; None where one is no standard rule's
    instance, or a number its old block was stays after."""
    kp = p.in_kernel(k)
    old = dict(kp.dims)
    new = {**old, axis: Dim(axis, kp.extent(axis), block)}
    nodes = [n for s in k.stores for n in postorder(s.value)]
    written: dict[Node, Node] = {}
    for r in nodes:
        if isinstance(r, Reduce) and r.axis == axis and holds_block(r, kp.block(axis)):
            read = {n.index for n in nodes if isinstance(n, Get) and n.x is r}
            if (again := _written_again(r, read, old, new)) is None:
                return None
            written[r] = again
    stores = tuple(replace(s, value=transform(
        s.value, lambda n, kids: written[n] if n in written else rebuild(n, kids)))
        for s in k.stores)
    blocks = {**dict(k.blocks), axis: block}
    kernel = Kernel(k.grid, stores, tuple((a, blocks[a]) for a in p.dims
                                          if a in blocks and blocks[a] != p.block(a)))
    if any(isinstance(r, Reduce) and r.axis == axis and holds_block(r, kp.block(axis))
           for s in kernel.stores for r in postorder(s.value)):
        return None
    return kernel


def _written_again(r: Reduce, read: set[int], old: dict[str, Dim], new: dict[str, Dim]
                   ) -> Node | None:
    """Fold `r` as the rules that wrote it at the blocks `old` write it at the blocks `new`:
    one term, whatever rule says what each component read of it is (`read`, the indices of
    its `get`s; none read so: the fold's own value)."""
    again: set[Node] = set()
    for component in read or {None}:
        found = False
        for rule in _sized_rules():
            fold = _fold_of(rule.rhs, component)
            binding = None if fold is None else _binding(rule, fold, r, old, new)
            if binding is not None:
                again.add(binding.build(fold))
                found = True
        if not found:
            return None
    return again.pop() if len(again) == 1 else None


def _fold_of(rhs: Pattern, component: int | None) -> Pattern | None:
    """The fold pattern a right side is `get(component, fold)` of (or is, `component` None)."""
    if component is not None:
        if not isinstance(rhs, Get) or rhs.index != component:
            return None
        rhs = rhs.x
    return rhs if isinstance(rhs, Reduce) else None


def _binding(rule: Rule, fold: Pattern, r: Reduce, old: dict[str, Dim], new: dict[str, Dim]
             ) -> Binding | None:
    """The binding under which `fold` is `r` at the blocks `old`, moved to the blocks `new`,
    where `rule`'s guards hold at both; None where there is none.  A guard on a constant only
    the left side has (`?c == 1 / extent(?e)`) holds for the constant it sets."""
    b = Binding(old)
    if not b.match(fold, r, sizes=True):
        return None
    moved = Binding(new, b.axes, b.monoids, b.values, dict(b.consts))
    for binding in (b, moved):
        for g in rule.guards:
            if isinstance(g, ConstCmp) and g.var not in binding.consts and g.op == "==":
                try:
                    binding.consts[g.var] = binding.constant(g.value)
                except KeyError:
                    return None
            try:
                if not binding.holds(g):
                    return None
            except KeyError:  # a variable only the left side binds
                return None
    return moved


@lru_cache(maxsize=1)
def _sized_rules() -> tuple[Rule, ...]:
    """The standard pack's rules whose right sides compute an axis' block (`block(?e)`)."""
    return tuple(rule for rule in load_pack(standard_pack_dir()).rules
                 if "block" in _sizes(rule.rhs))


def _sizes(p: Pattern) -> set[str]:
    """The kinds of axis size (`block`, `extent`, `trips`) pattern `p` computes with."""
    kinds, todo = set(), [p]
    while todo:
        q = todo.pop()
        if isinstance(q, AxisSize):
            kinds.add(q.kind)
        todo += q.args if isinstance(q, CExpr) else _operands(q)
    return kinds
