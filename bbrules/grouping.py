"""Which stores share a kernel, and over which grid: a scheduling decision, priced exactly.

The e-graph decides what each stored tensor's value is; this module decides how the stores are
launched.  It starts from one kernel per store over the store's own axes and takes, while one
is cheaper by the program's cost key (`ProgramCost.key` with its time bands anchored at the
faster of the two programs, so a move faster by less than the target's resolution must also
move less data), the first of two kinds of move:

- *Narrow a grid*: a store whose value reduces over one of its own axes (a softmax whose row
  statistics were forwarded into the normalisation) recomputes that reduction for every block
  of the axis.  With the axis taken out of the grid it becomes a map loop, and the reduction,
  which does not depend on the map loop's axis, runs once per grid point before it.
- *Merge two kernels*: kernels that load a common tensor may share a launch over the axes
  their grids have in common; the scheduler then shares the loads and loops they have in
  common (Q, K and V projections reading one normalised row; `c = a + b` beside
  `d = rowsum(b)`).  The later kernel moves up to the earlier one, so it must read nothing that
  the earlier one, or a kernel between them, stores.

Asked to (`coarser`, which extraction does for its best few candidates), kernels then take
the cheapest of:

- *Coarser blocks*: one grid axis in blocks twice as large, where the kernel then reads less.
  A matmul whose output rows come in blocks of 64 reads the other operand once per 64 rows;
  in blocks of 256, a quarter as often, for as long as the tiles fit local memory.
- *Coarser steps*: one loop axis in blocks twice as large, where the kernel then takes less
  time for no more traffic.  A loop pays its combines (an online softmax rescales its output
  tile) and, on a target with a `step_cost`, its operations once per step: half the steps
  pay half of that, for as long as the tiles fit.

Then, where a kernel's grid leaves processors idle, the cheapest of two more kinds, until
none is cheaper:

- *Split a fold* (`splitting`): the kernel folds one reduction in chunks on more grid points
  and a second kernel combines their states.
- *Finer blocks*: one grid axis in blocks half as large, where the kernel reads no more for
  it (a softmax over 4096 rows in blocks of 16 fills the chip; in blocks of 64 it does not).

And where no candidate fits local memory at all, extraction tiles each kernel that does not
fit finer, whatever it then re-reads, until it does (`fitting`): a program may declare blocks
too coarse for the target.

Block moves are recorded in the kernel (`Kernel.blocks`): tensors live whole in global
memory, so each kernel may tile them its own way.  Coarser blocks may leave processors idle
that the parallel moves would rather have filled another way, so the launches with and
without them each descend through the parallel moves, and the cheaper end is kept.

Every candidate is priced whole, and kernel costs are cached, so a move costs one new kernel's
plan at most.  The moves are tried in program order, so the result does not depend on hashing.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache
from typing import Callable, Iterable, Iterator

from .cost import KernelCost, ProgramCost, cost_kernel
from .ir import BlockProgram, Kernel, Load, Reduce, Store, postorder
from .plan import block_bound_axes, kernel_uses
from .refold import refolded
from .splitting import Splitter, may_pay
from .targets import Target

Price = Callable[[BlockProgram], "ProgramCost | None"]  # None: rejected (too many kernels)
# Builds (or interns) a kernel from its grid, stores and own block sizes.
Make = Callable[[tuple[str, ...], tuple[Store, ...], tuple[tuple[str, int], ...]], Kernel]


def group_kernels(p: BlockProgram, price: Price, objective: str = "time", make: Make = Kernel,
                  splitter: Splitter | None = None, target: Target | None = None,
                  coarser: bool = False) -> BlockProgram:
    """`p` with its stores launched as cheaply as the moves above find, by `price` under
    `objective`.  `make` builds each new launch (extraction interns them, so its caches find
    them by identity).  Then, with `coarser` (and a `target`), grid axes in blocks twice as
    large where that reads less.  Then, for a kernel that leaves processors idle, the
    cheapest of: a fold split (with a `splitter`), or a grid axis in blocks half as large
    (with a `target`, down to its block granularity), until none is cheaper."""
    best = price(p)
    if best is None:
        return p
    routes = [_descend(p, best, price, objective, first=True,
                       moves=lambda q, _: (replace(q, kernels=k) for k in _moves(q, make)))]
    if coarser and target is not None:
        seen: dict[Kernel, tuple[Kernel, ...]] = {}  # a kernel's coarser tilings, once each
        tiled = _descend(*routes[0], price, objective, first=False,
                         moves=lambda q, _: _coarser(q, make, target, seen))
        if tiled[0] is not routes[0][0]:
            routes.append(tiled)
    if objective != "time":
        return routes[-1][0]  # splits and finer blocks only add traffic: never cheaper by it

    finer: dict[Kernel, tuple[Kernel, ...]] = {}  # a kernel's finer tilings, once each

    def parallel(q: BlockProgram, cost: ProgramCost) -> Iterator[BlockProgram]:
        if splitter is not None:
            yield from splitter.moves(q, cost)
        if target is not None:
            yield from _finer(q, cost, make, target, finer)

    # Coarser blocks read less but fill fewer processors, which the parallel moves may then
    # recover: each route ends in its own local optimum, and the cheaper one is kept.
    p, best = _descend(*routes[0], price, objective, first=False, moves=parallel)
    for q, cost in routes[1:]:
        q, cost = _descend(q, cost, price, objective, first=False, moves=parallel)
        if _cheaper(cost, best, objective):
            p, best = q, cost
    return p


def _finer(p: BlockProgram, cost: ProgramCost, make: Make, target: Target,
           seen: dict[Kernel, tuple[Kernel, ...]]) -> Iterator[BlockProgram]:
    """`p` with one kernel that leaves processors idle tiled finer (`_tilings`; `seen`
    remembers each kernel's, since most candidates share most kernels)."""
    ks = p.kernels
    for i, (k, kc) in enumerate(zip(ks, cost.kernels)):
        if not may_pay(kc, min(1.0, 2 * kc.grid_points / target.processors), 0.0, cost.time,
                       target, more_traffic=False):
            continue
        if k not in seen:
            seen[k] = tuple(_tilings(p, k, kc, make, target, coarser=False))
        for finer in seen[k]:
            yield replace(p, kernels=ks[:i] + (finer,) + ks[i + 1:])


def _coarser(p: BlockProgram, make: Make, target: Target,
             seen: dict[Kernel, tuple[Kernel, ...]]) -> Iterator[BlockProgram]:
    """`p` with one kernel tiled coarser where that reads less (`_tilings`)."""
    ks = p.kernels
    for i, k in enumerate(ks):
        if k not in seen:
            seen[k] = tuple(_tilings(p, k, cost_kernel(p, k, target), make, target,
                                     coarser=True))
        for coarser in seen[k]:
            yield replace(p, kernels=ks[:i] + (coarser,) + ks[i + 1:])


def _tilings(p: BlockProgram, k: Kernel, kc: KernelCost, make: Make, target: Target,
             coarser: bool) -> Iterator[Kernel]:
    """`k` with one grid axis in blocks twice as large (`coarser`) or half as large (not
    below the target's granularity), blocks that still divide the axis; and, `coarser`,
    one loop axis in blocks twice as large.

    Coarser grid blocks are offered only where the kernel then reads less: a matmul's output
    block twice as tall reads the other operand half as often, at the price of half the
    grid points and tiles twice as large (illegal, so infinitely slow, once they no longer
    fit local memory).  Coarser loop blocks are offered only where the kernel is then
    faster and reads no more (fewer steps, each with its combines).  A loop axis the program
    itself blocks by one element (a split's chunk axis) keeps its blocks: a fold over it may
    rely on them (`reduce(c, sum, bmax(c, x))` combines each chunk's maximum).  A fold whose
    state holds its block (`block_bound_axes`: a Welford fold's count and mean are a block's
    of 64) is written again for the new block by the rule that wrote it (`refolded`), or
    keeps its blocks; it is also offered the whole axis in one step, which doubling does not
    reach where the axis is not a power of two blocks (768 features in blocks of 64), and
    which the numpy backend, free to walk other loops in larger blocks than the kernel's
    (`numpy_plan.coarsened`), cannot take for it.  Finer blocks are offered only where they
    read nothing more: finer blocks that re-read operands (a matmul's, the keys of
    attention) are a trade of traffic for parallelism that these moves leave alone."""
    own = p.in_kernel(k)
    folded = frozenset().union(*map(_reduced, k.stores))
    grid = [(a, own.block(a) * 2 if coarser else own.block(a) // 2)
            for a in k.grid if a not in folded]  # else each block folds all of it again
    loops: list[tuple[str, int]] = []
    bound: frozenset[str] = frozenset()
    if coarser:
        if kc.bytes_read <= _once(p, k):
            grid = []  # it reads each tensor once already
        bound = block_bound_axes(p, k)
        for a in _loop_axes(k):
            wider = {own.block(a) * 2, own.extent(a) if a in bound else 0}
            loops += [(a, b) for b in sorted(wider) if b > own.block(a) and p.block(a) > 1]
    for a, block in grid + loops:
        if (block < target.block_granularity or block > own.extent(a)
                or own.extent(a) % block or own.dims[a].ragged):
            continue
        if a in bound:
            if (written := refolded(p, k, a, block)) is None:
                continue
            tiled = make(written.grid, written.stores, written.blocks)
        else:
            tiled = _with_block(p, k, a, block, make)
        tc = cost_kernel(p, tiled, target)
        if (a, block) in loops:
            if tc.traffic <= kc.traffic and tc.time < kc.time:
                yield tiled
        elif tc.traffic < kc.traffic if coarser else tc.traffic <= kc.traffic:
            yield tiled


def _with_block(p: BlockProgram, k: Kernel, axis: str, block: int, make: Make) -> Kernel:
    """`k` with `axis` in blocks of `block` (its own blocks recorded only where they differ
    from the program's)."""
    blocks = {**dict(k.blocks), axis: block}
    return make(k.grid, k.stores, tuple((x, blocks[x]) for x in p.dims
                                        if x in blocks and blocks[x] != p.block(x)))


def fitting(p: BlockProgram, k: Kernel, make: Make, target: Target) -> Kernel | None:
    """`k` with its blocks halved until its tiles fit the target's local memory, or None where
    they cannot be halved far enough (blocks that still divide the axis).  Each step halves
    the axis that shrinks the tiles most (of equals, the first grid axis, then loop axis): a
    grid axis re-reads the operands it does not span, a loop axis takes more steps, but a
    kernel that does not fit cannot run at all.  Blocks go below the target's granularity
    only where no axis can be halved above it: a token axis imported as a 16 x 16 image's
    two dimensions, each whole in a block of 16, holds 256 tokens a tile however the
    granularity bounds each.  Only where no candidate fits as the search left it
    (`Extractor.legalize`): a kernel the program itself blocks too coarsely for the target.
    As in `_tilings`, a grid axis the kernel also folds, and a loop axis whose blocks a fold
    relies on, keep their blocks."""
    folded, bound = frozenset().union(*map(_reduced, k.stores)), block_bound_axes(p, k)
    axes = [a for a in k.grid if a not in folded] + [
        a for a in _loop_axes(k) if a not in bound and p.block(a) > 1]
    cost = cost_kernel(p, k, target)
    while not cost.legal:
        own = p.in_kernel(k)
        halved = [(a, own.block(a) // 2) for a in axes]
        halved = [(a, block) for a, block in halved
                  if block >= 1 and not own.extent(a) % block and not own.dims[a].ragged]
        coarse = [(a, block) for a, block in halved if block >= target.block_granularity]
        tiled = [(cost_kernel(p, t, target), t)
                 for t in (_with_block(p, k, a, block, make) for a, block in coarse or halved)]
        if not tiled:
            return None
        cost, k = min(tiled, key=lambda ct: ct[0].footprint)
    return k


def _loop_axes(k: Kernel) -> list[str]:
    """The axes `k` loops over: every axis it uses outside its grid, in a fixed order."""
    axes, _ = kernel_uses(k)
    return sorted(axes - frozenset(k.grid))


def _once(p: BlockProgram, k: Kernel) -> int:
    """The bytes `k` reads if it reads each tensor it loads once: coarser blocks cannot read
    less than that."""
    storage = {p.tensors[t].storage for t in _loaded(k)}
    return sum(math.prod(p.extent(a) for a in p.tensors[t].axes) * p.tensors[t].itemsize
               for t in storage)


def _descend(p: BlockProgram, best: ProgramCost, price: Price, objective: str, first: bool,
             moves: Callable[[BlockProgram, ProgramCost], Iterable[BlockProgram]]
             ) -> tuple[BlockProgram, ProgramCost]:
    """Take the `first` of `moves` that is cheaper, or the cheapest (the split factors of one
    fold compete), until none is."""
    while True:
        step = None
        for q in moves(p, best):
            cost = price(q)
            if cost is not None and _cheaper(cost, best, objective):
                step, best = q, cost
                if first:
                    break
        if step is None:
            return p, best
        p = step


def _cheaper(a: ProgramCost, b: ProgramCost, objective: str) -> bool:
    """Is `a` cheaper than `b`, their time bands anchored at the faster of the two?  So a
    launch that is faster by less than the target's resolution must also move less data."""
    times = [t for t in (a.time, b.time) if math.isfinite(t)]
    anchor = min(times, default=1.0)
    return a.key(objective, anchor) < b.key(objective, anchor)


def _moves(p: BlockProgram, make: Make):
    """Every program one move away from `p`, lazily, in program order."""
    ks = p.kernels
    for i, k in enumerate(ks):
        narrow = _narrowed(k, p, make)
        if narrow is not None:
            yield ks[:i] + (narrow,) + ks[i + 1:]
    for i, j in _mergeable(p):
        k = ks[i]
        grid = tuple(a for a in k.grid if a in ks[j].grid)
        merged = make(grid, k.stores + ks[j].stores, k.blocks)
        yield ks[:i] + (merged,) + ks[i + 1:j] + ks[j + 1:]


def _mergeable(p: BlockProgram) -> list[tuple[int, int]]:
    """The pairs i < j of kernels that one launch may run, in program order: they read some
    tensor in common (else they share nothing but a launch), j reads nothing that kernels i
    .. j - 1 store (else it cannot move up to i), and they have one tiling.

    Found from j's side: j may join only kernels after the last one that stores what it
    reads, so a chain of 3,000 kernels has no pair to look at (looking at every pair cost
    `apply` about 8 s there)."""
    ks = p.kernels
    # by storage: a kernel that reads a view of a tensor reads that tensor
    loads = [frozenset(p.tensors[t].storage for t in _loaded(k)) for k in ks]
    stored_at: dict[str, list[int]] = {}
    for m, k in enumerate(ks):
        for t in k.tensors:
            stored_at.setdefault(t, []).append(m)
    pairs = []
    for j, k in enumerate(ks):
        latest = max((m for t in loads[j] for m in stored_at.get(t, ()) if m < j), default=-1)
        pairs += [(i, j) for i in range(latest + 1, j)
                  if loads[i] & loads[j] and ks[i].blocks == k.blocks]
    return sorted(pairs)


def _narrowed(k: Kernel, p: BlockProgram, make: Make) -> Kernel | None:
    """`k` without the grid axes that one of its stores reduces over inside its value."""
    reduced = frozenset().union(*map(_reduced, k.stores))
    p = p.in_kernel(k)
    grid = tuple(a for a in k.grid if a not in reduced or p.blocks(a) == 1)
    return make(grid, k.stores, k.blocks) if grid != k.grid else None


def _loaded(k: Kernel) -> frozenset[str]:
    return frozenset().union(*map(_loads, k.stores))


# Candidates share most of their stores: what each store reduces over and loads is asked once.

@lru_cache(maxsize=1 << 14)
def _reduced(s: Store) -> frozenset[str]:
    return frozenset(n.axis for n in postorder(s.value) if isinstance(n, Reduce))


@lru_cache(maxsize=1 << 14)
def _loads(s: Store) -> frozenset[str]:
    return frozenset(n.tensor for n in postorder(s.value) if isinstance(n, Load))
