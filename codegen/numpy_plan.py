"""What the numpy backend decides about a kernel before `numpy_gen` writes its code: the
rewrites that make it cheaper in numpy (an additive mask as an offset, in-block sums moved
inside the loop they commute with, short selecting grid axes walked as unrolled loops), the
blocks its loops walk (`coarsened`: larger than a GPU's local memory allows, where the loop
means the same at any block size) and the parts it runs in on several threads
(`split_kernel`, `parts_pay`; `balanced`: finer grid blocks where whole ones would leave a
thread idle).  Each is a function of the kernel and the program alone; the writer and
`bbrules.memory` (which bounds a coarsened tile) read them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Iterator, Mapping, Sequence

import numpy as np

from bbrules.cost import cost_kernel
from bbrules.ir import (Axis, Binary, BlockProgram, BlockReduce, Const, Dot, Kernel, Load, Node,
                        Pos, Reduce, Store, TileType, Where, children, is_elementwise,
                        is_node, operator, postorder, rebuild, transform, type_of)
from bbrules.masking import NumpyAlgebra, may_hold
from bbrules.onehot import mentions, one_hot, selection_as_contraction
from bbrules.plan import block_bound_axes, loop_predicate, plan_for
from bbrules.schedule import Compute, Loop, Write, walk_steps
from bbrules.targets import Target


# A loop over at most this many blocks of one element, whose body selects by the position, is
# written once per block with the position known (`_KernelWriter.unrolled`).
UNROLLED_BLOCKS = 8


def summed_chain(x: Node, p: BlockProgram) -> tuple[list[Axis], Node]:
    """The axes of the in-block sums from `x` down, through sums over one block of an axis
    (each its block's own sum), and the first node below that is neither."""
    axes = []
    while True:
        if isinstance(x, BlockReduce) and x.op == "sum":
            axes.append(x.axis)
        elif not (isinstance(x, Reduce) and x.monoid.name == "sum" and p.blocks(x.axis) == 1):
            return axes, x
        x = x.x


def contraction_below(x: Node, p: BlockProgram) -> bool:
    """Is `x` a contraction under a chain of sums (what `_summed_contraction` makes one
    matmul)?"""
    bottom = summed_chain(x, p)[1]
    return isinstance(bottom, Dot) and one_hot(bottom) is None


def summed_inward(p: BlockProgram, k: Kernel) -> Kernel:
    """`k` with each in-block sum of a summing loop over a contraction moved into the loop:
    `bsum(a, reduce(b, sum, x))` is `reduce(b, sum, bsum(a, x))`, sums commute.  Inside, the
    in-block sum meets the contraction, and both are one matmul (`_summed_contraction`): a
    convolution's sum over its taps joins the sum over channels, where it was a matmul per
    tap summed after the loop."""
    kp = p.in_kernel(k)

    def inward(n: Node, kids: tuple[Node, ...]) -> Node:
        n = rebuild(n, kids)
        if isinstance(n, BlockReduce) and n.op == "sum" and isinstance(n.x, Reduce) and \
                n.x.monoid.name == "sum" and contraction_below(n.x.x, kp):
            return Reduce(n.x.axis, n.x.monoid, BlockReduce("sum", n.axis, n.x.x))
        return n

    stores = tuple(Store(s.tensor, s.axes, transform(s.value, inward)) for s in k.stores)
    return k if stores == k.stores else Kernel(k.grid, stores, k.blocks)


def masks_as_offsets(k: Kernel) -> Kernel:
    """`k` with each selection between a value and the value plus a constant, `where(c, x,
    x + a)` (an additive mask distributed over the sum, as ONNX's causal attention imports),
    written `x - where(c, 0, -a)`.  The selection then spans only the condition's axes (a
    block of query and key positions, not every head's scores), and numpy makes one pass over
    the scores instead of two (the sum, then `np.where` broadcasting the condition): LLaMA's
    causal scores kernel at 128 tokens, 4 x 128 x 128, took 165 µs against 203.  Every value
    is kept exactly, a zero's sign included (-0 - 0 is -0, where -0 + 0 would be +0)."""
    def offset(n: Node, kids: tuple[Node, ...]) -> Node:
        n = rebuild(n, kids)
        if not isinstance(n, Where):
            return n
        for shifted, kept, other in ((n.y, n.x, False), (n.x, n.y, True)):
            if isinstance(shifted, Binary) and shifted.op == "add":
                a = _constant_addend(shifted, kept)
                if a is not None:
                    mask = (Where(n.c, Const(-a), Const(0.0)) if other
                            else Where(n.c, Const(0.0), Const(-a)))
                    return Binary("sub", kept, mask)
        return n

    stores = tuple(Store(s.tensor, s.axes, transform(s.value, offset)) for s in k.stores)
    return k if stores == k.stores else Kernel(k.grid, stores, k.blocks)


def selections_as_gathers(p: BlockProgram, k: Kernel) -> Kernel:
    """`k` with each in-block sum of a selection that pins the summed position, over blocks of
    several elements (a concatenation whose pieces share no chunk longer than one element,
    cut in the blocks of its axis: a KV cache of 1023 tokens and the new one), written as the
    contraction by a one-hot it is (`selection_as_contraction`): a gather (`one_hot`), and a
    loop free to take the whole axis (`_gathers`).  As a selection, numpy built each block's
    tile of `x` against every position it might land at: 262 ms for the cache's keys, 0.4 ms
    gathered.  Over blocks of one element, unrolled (`unrollable`), a selection is a slice:
    those stay selections."""
    kp = p.in_kernel(k)

    def gathered(n: Node, kids: tuple[Node, ...]) -> Node:
        n = rebuild(n, kids)
        if isinstance(n, BlockReduce):
            return selection_as_contraction(n, kp.block(n.axis)) or n
        return n

    stores = tuple(Store(s.tensor, s.axes, transform(s.value, gathered)) for s in k.stores)
    return k if stores == k.stores else Kernel(k.grid, stores, k.blocks)


def _constant_addend(total: Binary, x: Node) -> float | None:
    """`a` where `total` is `x + a` or `a + x` for a constant `a` (`-inf` is `neg(inf)`),
    else None."""
    for c, rest in ((total.x, total.y), (total.y, total.x)):
        if rest == x and (a := constant_value(c)) is not None:
            return a
    return None


def constant_value(n: Node, values: dict[Node, float | None] | None = None) -> float | None:
    """The value of `n` where it is elementwise operators over constants (in f32, as the
    generated code computes it), else None.  `values` keeps what is found, for the next call
    (a writer asks of every node, and a chain thousands of terms deep is walked once, without
    recursion)."""
    values = {} if values is None else values
    stack = [n]
    while stack:
        m = stack[-1]
        if m in values:
            stack.pop()
        elif isinstance(m, Const) or not is_elementwise(m) or not children(m):
            values[m] = m.value if isinstance(m, Const) else None
            stack.pop()
        elif pending := [c for c in children(m) if c not in values]:
            stack += pending
        else:
            args = [values[c] for c in children(m)]
            values[m] = None if None in args else folded(m, args)
            stack.pop()
    return values[n]


def folded(n: Node, args: Sequence[float]) -> float:
    """Elementwise `n` of the constants `args`, in f32 as the generated code computes it."""
    with np.errstate(all="ignore"):
        return float(np.float32(operator(n).numpy(*map(np.float32, args))))


# Work each numpy call of a part must have for the part to be worth a thread (flops, by the
# cost model's count; at least 1).  A part runs every step of the kernel's code, on a share of
# the grid, and Python holds the GIL between numpy calls: parts whose calls take little longer
# than the interpreter's few microseconds around them would wait on each other, not compute.
# On the 2-core Xeon, a chain of seven elementwise operations (one a tanh) run in four parts
# on two threads took 1.44 times as long as whole where each part's calls had 65,536
# elements, and 0.57 times where they had 131,072 (`run_parts`, medians of 30 runs); at 2^16
# flops magika's GELU + max split in two, taking the whole model into parts: 4.8-5.1 ms,
# against 3.7 whole.
MIN_CALL_FLOPS = 1 << 17
# Parts per thread: with more parts than threads, fewer grid blocks' tiles are held at once,
# so the parts' peak memory stays under the whole kernel's although the kernel's stores are
# allocated before its parts start.
PARTS_PER_THREAD = 2
# ... times this where a loop skips blocks by a predicate over the split axis: each part visits
# only what its own blocks reach, so causal attention's parts visit 1/2 + 1/(2 parts) of the
# key blocks (62% with 4 parts, 56% with 8).
SKIPPING_PARTS = 2


def split_kernel(p: BlockProgram, k: Kernel, threads: int, target: Target
                 ) -> tuple[Axis, list[tuple[int, int]]] | None:
    """The parts a kernel runs in on `threads` threads: a grid axis (`_split_axis`) and one
    (first block, blocks) run of it per part, or None to run whole.

    `PARTS_PER_THREAD` parts per thread (`SKIPPING_PARTS` times as many where a loop skips
    blocks by the split axis' positions), but no more than the axis has blocks or than leave
    each numpy call of a part `MIN_CALL_FLOPS`: a kernel of one grid block, of little work or
    of many small steps runs whole, in the calling thread.  Runs differ in length by one block
    at most.
    """
    if threads < 2 or not k.grid:
        return None
    kp = p.in_kernel(k)
    axis = _split_axis(kp, k)
    schedule = plan_for(kp, k, target.local_capacity).schedule
    calls = sum(prod(kp.blocks(loop.axis) for loop in loops)
                for _, loops in walk_steps(schedule.body))
    # fractional where a mask skips blocks; a contraction by a one-hot is a gather here, its
    # result's elements copied, however `target` prices it
    flops = cost_kernel(p, k, replace(target, gathers=True)).flops
    skips = any(isinstance(n, Pos) and n.axis == axis
                for _, loops in walk_steps(schedule.body) for loop in loops
                if (pred := loop_predicate(loop)) is not None for n in postorder(pred))
    n = min(threads * PARTS_PER_THREAD * (SKIPPING_PARTS if skips else 1), kp.blocks(axis),
            int(flops // (max(1, calls) * MIN_CALL_FLOPS)))
    if n < 2:
        return None
    size, extra = divmod(kp.blocks(axis), n)
    runs, first = [], 0
    for i in range(n):
        runs.append((first, size + (i < extra)))
        first += runs[-1][1]
    return axis, runs


def _makespan(runs: Sequence[tuple[int, int]], threads: int) -> int:
    """Blocks the busiest thread computes when `run_parts` hands `runs` out in order, each to
    the first thread free."""
    ends = [0] * threads
    for _, blocks in runs:
        ends[ends.index(min(ends))] += blocks
    return max(ends)


# The factors by which `balanced` may tile a split axis finer, and the fewest elements a
# finer block keeps (a product's part narrower than this runs its columns slower than whole).
BALANCING_FACTORS = (2, 3, 4)
MIN_BALANCED_BLOCK = 32


def balanced(p: BlockProgram, k: Kernel, threads: int, target: Target) -> Kernel:
    """`k` with the grid axis it is split along (`split_kernel`) in finer blocks where its
    parts, whole blocks each, would leave a thread idle while another finishes: three blocks
    on two threads take as long as four, and Falcon's output projection and second MLP
    product (768 columns in blocks of 256) ran a third of their time on one core.  The
    factor (of `BALANCING_FACTORS`) whose parts keep the busiest thread's share of the axis
    least; none where no factor lessens it.  A grid axis the kernel also folds, or whose
    blocks a fold's state holds, keeps its blocks, as do ragged axes."""
    split = split_kernel(p, k, threads, target)
    if split is None:
        return k
    axis, runs = split
    kp = p.in_kernel(k)
    folded = {n.axis for s in k.stores for n in postorder(s.value) if isinstance(n, Reduce)}
    if axis in folded or axis in block_bound_axes(kp, k) or kp.dims[axis].ragged:
        return k
    best, share = k, _makespan(runs, threads) / kp.blocks(axis)
    for f in BALANCING_FACTORS:
        block = kp.block(axis) // f
        if kp.block(axis) % f or block < max(MIN_BALANCED_BLOCK, target.block_granularity):
            continue
        finer = Kernel(k.grid, k.stores, tuple((dict(k.blocks) | {axis: block}).items()))
        split = split_kernel(p, finer, threads, target)
        if split is not None and split[0] == axis and \
                (finer_share := _makespan(split[1], threads) / (kp.blocks(axis) * f)) < share:
            best, share = finer, finer_share
    return best


@dataclass(frozen=True)
class _NodeWork:
    """A node a kernel computes: the axes its elements span or depend on (a contraction's
    include the axis it contracts), how many numpy computes (multiply-adds for a product,
    which BLAS computes), and whether it is a special function (exp, tanh, ...)."""

    axes: frozenset[Axis]
    elements: int
    product: bool
    special: bool


def _kernel_work(kp: BlockProgram, k: Kernel) -> list[_NodeWork]:
    """Every node the kernel's numpy code computes, once each; not a one-hot operand that a
    gather replaces, nor loads, constants and positions."""
    nodes = {id(n): n for s in k.stores for n in postorder(s.value)}
    for n in list(nodes.values()):
        if isinstance(n, Dot) and (hot := one_hot(n)) is not None:
            for m in postorder(n.y if hot[0] is n.x else n.x):
                if mentions(m, n.axis):
                    nodes.pop(id(m), None)
    work = []
    for n in nodes.values():
        t = type_of(n)
        if isinstance(n, (Load, Const, Pos)) or not isinstance(t, TileType):
            continue
        axes = t.deps | t.shape
        elements = prod(kp.padded(a) for a in axes)
        product = isinstance(n, Dot) and one_hot(n) is None
        if isinstance(n, BlockReduce) and contraction_below(n, kp):
            elements = 0  # summed within the matmul
        elif isinstance(n, (Reduce, Dot)) and not product:  # a fold, a gather: per block
            elements = elements // kp.padded(n.axis) * kp.blocks(n.axis)
        special = is_elementwise(n) and operator(n).special > 0
        work.append(_NodeWork(axes, elements, product, special))
    return work


# What decides whether a kernel's parts beat the whole kernel, measured on a 2-core AMD EPYC
# (AVX2; `benchmarks/bench_cpu.py`, the imported LLaMA layers at 128 and 2048 tokens, magika):
# numpy's elementwise work runs on one core at about 4 elements a nanosecond (a special
# function, exp or tanh, costs about 8 of those); BLAS threads a whole kernel's products over
# every core itself, at about 45 multiply-adds a nanosecond each, and products split into
# parts of one BLAS thread each run about 10% slower; starting parts on the pool's threads and
# waiting for them took 95 microseconds for parts that do nothing, and parts that compute also
# trade the GIL between their numpy calls: 150 is the figure taken.  On a 2-core Xeon with
# AVX-512, where `exp` costs about what a multiply does, BLAS runs twice as fast and empty
# parts took 107 microseconds, the same programs split alike; only the RMSNorm + FFN alone
# would run faster whole there (29.9 against 34.5 ms).
NUMPY_ELEMENTS_PER_NS = 4
SPECIAL_ELEMENTS = 8
BLAS_MACS_PER_NS = 45
PARTS_BLAS_SLOWDOWN = 0.1
PARTS_START_NS = 150_000


def parts_pay(kp: BlockProgram, k: Kernel) -> bool:
    """Do parts on two or more threads save more numpy time (half of the elementwise work, at
    least) than they cost (starting them; products run by parts, not by BLAS's own threads)?

    A program none of whose kernels this holds for (of those with work enough to split:
    `split_kernel`) runs every kernel whole, with BLAS on its own threads: at 128 tokens every
    kernel of a LLaMA layer ran 1.3 to 2 times slower in parts.  One that has such a kernel
    splits every kernel with enough work, products included: a BLAS that ran on several
    threads keeps them spinning for a while after, on the cores the next kernel's parts need
    (a LLaMA layer at 2048 tokens whose projections ran whole: 283 ms, against 210 ms all in
    parts)."""
    work = _kernel_work(kp, k)
    elementwise = sum(w.elements * (SPECIAL_ELEMENTS if w.special else 1)
                      for w in work if not w.product) / NUMPY_ELEMENTS_PER_NS
    products = sum(w.elements for w in work if w.product) / BLAS_MACS_PER_NS
    return elementwise / 2 > PARTS_START_NS + PARTS_BLAS_SLOWDOWN * products / 2


def _split_axis(kp: BlockProgram, k: Kernel) -> Axis:
    """The grid axis to split a kernel along: the one on which the least of its work does not
    depend (each part repeats that work: attention fused with the projection after it, split
    by the projection's columns, would compute the attention once per part), then the one of
    the most blocks (the first of equals).  A node's work is what `_kernel_work` counts: its
    elements over every axis it spans or depends on, the contracted axis included for a
    matmul."""
    work = [(w.axes, w.elements) for w in _kernel_work(kp, k)]

    def repeated(axis: Axis) -> int:
        return sum(size for axes, size in work if axis not in axes)
    splittable = [a for a in k.grid if kp.blocks(a) > 1] or list(k.grid)
    return min(splittable, key=lambda a: (repeated(a), -kp.blocks(a)))


# The most elements a tile that a coarsened kernel computes may hold, all grid blocks at once
# (16 MiB of f32; a part holds its share of the grid).
COARSE_TILE = 1 << 22


def _gathers(r: Reduce) -> bool:
    """Is `r` a sum of a one-hot contraction over its own axis (a gather per block)?  Its
    loop need not skip blocks: a larger block gathers as much in fewer calls."""
    return (r.monoid.name == "sum" and isinstance(r.x, Dot) and r.x.axis == r.axis
            and one_hot(r.x) is not None)


# Folds over an axis that mean the same at any block size, provided the reductions inside a
# block are the fold's own (`reduce(k, sum, bsum(k, x))`; not the chunk combine of a split,
# `reduce(c, sum, bmax(c, x))` over blocks of one).  An online softmax is left alone: its
# score tile would grow with the block.  A loop that skips blocks keeps them, unless it only
# gathers (`one_hot`).
_SAME_IN_BLOCKS = {"sum", "max", "min"}

# ... but any fold (an online softmax, one that skips blocks) takes its whole axis in one block
# where no tile of the kernel then holds more than this many elements (1 MiB of f32, all grid
# blocks at once): over one block a fold is its contribution, with no combine
# (`numpy_gen.fold_once`), and its loop's numpy calls are made once.  Attention at 128 tokens
# (12 heads; 4 x 3 x 128 x 128 scores), paired against two key blocks of 64: LLaMA's block
# 0.987-0.995, Mistral's 0.975-0.979, GPT-NeoX's 0.962-0.967.  Its blocks are left to folds
# whose state holds their block (`block_bound_axes`), and to a split's chunks (blocks of one).
WHOLE_FOLD_TILE = 1 << 18


def starts_where(p: BlockProgram, axis: Axis, pred: Node,
                 ranges: Mapping[Axis, tuple[int, int]]) -> list[int]:
    """The starts of `axis`' blocks on which `pred` may hold, for positions of the other axes
    anywhere in `ranges` (default: the whole axis)."""
    d = p.dims[axis]
    axes = {n.axis for n in postorder(pred) if isinstance(n, Pos)}
    starts = np.arange(d.blocks, dtype=np.float64) * d.block
    bounds = {a: tuple(np.float64(x) for x in ranges.get(a, (0, p.padded(a) - 1)))
              for a in axes}
    bounds[axis] = (starts, starts + (d.block - 1))
    hold = np.broadcast_to(may_hold(pred, bounds, NumpyAlgebra()), starts.shape)
    return [int(s) for s, h in zip(starts, hold) if h]


def _skips(p: BlockProgram, loop: Loop) -> bool:
    """May the loop skip blocks by its predicate (`loop_predicate`)?  Not where the predicate
    reads only the loop's own position and holds somewhere in every block: a ragged axis'
    mask, which larger blocks visit just as well."""
    pred = loop_predicate(loop)
    if pred is None:
        return False
    if any(isinstance(n, Pos) and n.axis != loop.axis for n in postorder(pred)):
        return True
    return len(starts_where(p, loop.axis, pred, {})) < p.dims[loop.axis].blocks


def body_nodes(loop: Loop) -> Iterator[Node]:
    """Every node the loop's body computes, and the nodes they read, operands first."""
    for step, _ in walk_steps(loop.body):
        if isinstance(step, Compute):
            yield from postorder(step.node)


def unrollable(p: BlockProgram, loop: Loop) -> bool:
    """Is `loop` over at most `UNROLLED_BLOCKS` blocks of one element, with a body that selects
    by its position (other than in the one-hot operand of a contraction, which is a gather
    whatever the blocks: a convolution's taps are better contracted at once), and skipping (if
    at all) by its own position only?"""
    d = p.dims[loop.axis]
    if d.block != 1 or d.blocks > UNROLLED_BLOCKS:
        return False
    if loop.axis not in selected_by_position(list(body_nodes(loop))):
        return False
    skip = loop_predicate(loop)
    return skip is None or all(n.axis == loop.axis for n in postorder(skip)
                               if isinstance(n, Pos))


def selected_by_position(nodes: Sequence[Node]) -> set[Axis]:
    """The axes whose positions select among `nodes` (a `where` on a condition of positions and
    numbers alone: RoPE's halves, a concatenation's chunks), the one-hot operands of
    contractions left out (`one_hot_operands`).  Not a condition on data that happens to read
    a position: a softmax's guard `bmax(scores) == -inf`, whose scores repeat a key head for
    each query head it serves (`k + 0 * pos(g)`), does not select by g."""
    gathered = one_hot_operands(nodes)
    return {m.axis for n in nodes if isinstance(n, Where) and n not in gathered
            and not any(isinstance(c, Load) for c in postorder(n.c))
            for m in postorder(n.c) if isinstance(m, Pos)}


def one_hot_operands(nodes: Sequence[Node]) -> set[Node]:
    """The nodes of the one-hot operands of the contractions among `nodes`: a gather's picks,
    computed by no numpy step of their own."""
    return {m for n in nodes if isinstance(n, Dot) and (hot := one_hot(n)) is not None
            for m in postorder(n.y if hot[0] is n.x else n.x)}


def _in_matmul(n: BlockReduce, p: BlockProgram) -> list[Node]:
    """The nodes below `n` that the matmul of `_summed_contraction` computes without holding
    them (the contraction and the sums down to it), where `n` sums a contraction over axes both
    its operands span; else none.  Their tiles span the summed axes, the matmul's result not:
    counted, a head-grouped projection's sum over the group kept blocks of one."""
    axes, bottom = summed_chain(n, p)
    if not isinstance(bottom, Dot) or one_hot(bottom) is not None:
        return []
    x, y = type_of(bottom.x), type_of(bottom.y)
    if not isinstance(x, TileType) or not isinstance(y, TileType) or \
            any(a not in x.shape or a not in y.shape for a in axes if a != bottom.axis):
        return []
    inside, m = [], n.x
    while m is not bottom:
        inside.append(m)
        m = m.x
    return [*inside, bottom]


def ungridded(p: BlockProgram, k: Kernel) -> Kernel:
    """`k` with each grid axis of at most `UNROLLED_BLOCKS` blocks of one element whose
    position a selection reads (RoPE's pair of halves, a concatenation's chunks), and which
    every store spans, walked by a map loop instead: `_KernelWriter.unrolled` writes that loop
    once per block with the position known, its selections folded away, where over the
    vectorised grid each selection is a `where` over whole tiles."""
    kp = p.in_kernel(k)
    selected = selected_by_position([n for s in k.stores for n in postorder(s.value)])
    walked = [a for a in k.grid if a in selected and kp.dims[a].block == 1
              and kp.blocks(a) <= UNROLLED_BLOCKS and all(a in s.axes for s in k.stores)]
    if not walked:
        return k
    return Kernel(tuple(a for a in k.grid if a not in walked), k.stores, k.blocks)


def _keeps_blocks(p: BlockProgram, loop: Loop) -> bool:
    """Must `loop` walk the blocks its plan gives it?  A loop to unroll must.  A loop that
    only maps stores as much in larger blocks, unless its body selects by its position (it
    skips, or it tells pieces of a concatenation apart per block: larger blocks would make
    every piece's selection a one-hot product over the whole axis).  A fold must where it
    skips blocks (unless it gathers) or stores inside."""
    if unrollable(p, loop):
        return True
    if not loop.reduces:
        return loop_predicate(loop) is not None or Pos(loop.axis) in set(body_nodes(loop))
    return _skips(p, loop) and not all(map(_gathers, loop.reduces)) or _stores_inside(loop)


def _stores_inside(loop: Loop) -> bool:
    return any(isinstance(step, Write) for step, _ in walk_steps(loop.body))


def _in_block(fold: Reduce) -> set[str]:
    """The reductions within a block along `fold`'s axis that its contribution makes, not
    those of a fold nested in it (a softmax's sums read the maximum, a fold of its own,
    reduced by its own blocks)."""
    found: set[str] = set()
    seen: set[Node] = set()
    stack = [fold.x]
    while stack:
        n = stack.pop()
        if n in seen or isinstance(n, Reduce):
            continue
        seen.add(n)
        if isinstance(n, (BlockReduce, Dot)) and n.axis == fold.axis:
            found.add(n.op if isinstance(n, BlockReduce) else "sum")
        stack.extend(c for c in children(n) if is_node(c))
    return found


def coarsened(p: BlockProgram, k: Kernel, capacity: int) -> Kernel:
    """`k` with each axis that its plan walks only in loops free to take larger blocks
    (`_keeps_blocks`), and in folds only of `_SAME_IN_BLOCKS` monoids, given the largest
    block, its own times a divisor of its block count, at which no tile the kernel computes
    holds more than `COARSE_TILE` elements (a loaded tile is a view of its tensor: Phi-3's
    768 x 6144 gate-and-up weight had kept its product in two passes of 384 and an
    addition); and each other fold's axis the whole axis, where no tile then holds more than
    `WHOLE_FOLD_TILE`.  Block sizes are a kernel's own (global tensors are the same whatever a
    kernel's tiles), so this changes its loops only: sums are added in another order, which
    changes results to float rounding."""
    kp = p.in_kernel(k)
    loops = [loop for _, enclosing in walk_steps(plan_for(kp, k, capacity).schedule.body)
             for loop in enclosing]
    fixed = {loop.axis for loop in loops if _keeps_blocks(kp, loop)}
    nodes = [n for s in k.stores for n in postorder(s.value)]
    for n in nodes:  # a fold whose in-block reduction is not its own monoid's depends on blocks
        if isinstance(n, Reduce) and n.monoid.name not in _SAME_IN_BLOCKS:
            fixed.add(n.axis)
        elif isinstance(n, Reduce) and _in_block(n) - {n.monoid.name}:
            fixed.add(n.axis)
    free = [a for a in dict.fromkeys(loop.axis for loop in loops) if a not in fixed]
    unmade = {id(m) for n in nodes if isinstance(n, Dot) and (hot := one_hot(n)) is not None
              for m in postorder(n.y if hot[0] is n.x else n.x) if mentions(m, n.axis)}
    unmade |= {id(m) for n in nodes if isinstance(n, BlockReduce) for m in _in_matmul(n, kp)}
    types = [t for n in nodes if isinstance(t := type_of(n), TileType) and id(n) not in unmade
             and not isinstance(n, Load)]
    blocks = {a: kp.block(a) for a in free}

    def largest_tile() -> int:
        def extent(a: Axis, t: TileType) -> int:
            if a in k.grid:
                return (kp.blocks(a) if a in t.deps else 1) * (kp.block(a) if a in t.shape else 1)
            return blocks.get(a, kp.block(a)) if a in t.shape else 1
        return max((prod(extent(a, t) for a in t.deps | t.shape) for t in types), default=0)

    for axis in free:
        own, n = blocks[axis], kp.blocks(axis)
        for f in (f for f in range(n, 1, -1) if n % f == 0):
            blocks[axis] = own * f
            if largest_tile() <= COARSE_TILE:
                break
            blocks[axis] = own
    bound = block_bound_axes(kp, k)
    for loop in loops:  # the other folds' axes: the whole axis, or their blocks
        axis = loop.axis
        if axis in blocks or axis in bound or kp.block(axis) == 1 or kp.dims[axis].ragged or \
                unrollable(kp, loop) or not loop.reduces or _stores_inside(loop):
            continue
        blocks[axis] = kp.extent(axis)
        if largest_tile() > WHOLE_FOLD_TILE:
            del blocks[axis]
    changed = {a: b for a, b in blocks.items() if b != kp.block(a)}
    return Kernel(k.grid, k.stores, tuple((dict(k.blocks) | changed).items())) if changed else k


def rewritten(p: BlockProgram, k: Kernel, capacity: int) -> Kernel:
    """`k` as the numpy backend writes it: masks as offsets, selections that pin a position
    as gathers, sums moved inward, short selecting grid axes walked by loops, and its loops'
    blocks coarsened (for local memory `capacity`)."""
    k = selections_as_gathers(p, masks_as_offsets(k))
    return coarsened(p, ungridded(p, summed_inward(p, k)), capacity)
