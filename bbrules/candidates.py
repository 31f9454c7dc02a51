"""Candidate selection: the paper's first algorithm, which makes fusion scale to whole models.

One e-graph over a long program runs into the global e-node budget long before its stages
saturate (a 60-statement chain is left three iterations), so a large program is cut into
*candidates*: contiguous runs of at most N kernels, each fused by its own e-graph with its own
budget, then stitched back into one program.

Where to cut.  Cutting between two kernels forces every tensor produced before the cut and read
after it to go through global memory: written, then read back.  That round trip is the benefit
fusion across the cut could have had, so the partition (`select_candidates`) minimises the
bytes of the tensors it makes cross cuts, by dynamic programming over cut positions; a tensor
read after a cut through a view (a reshape) counts before any byte, so a view's reader stays
with the view's producer where a partition allows it.

Repeated layers.  Candidates that are the same kernels up to the names of their tensors (layer
i and layer j of a model) are fused once: each candidate is renamed to a canonical form
(tensors named by first use), and candidates with the same canonical text share one fusion,
whose result is renamed back for each.

Distinct candidates are fused in a process pool (one worker per core, at most one per
candidate).  Nothing holding IR nodes crosses a process boundary: a node caches its hash, which
hashes strings, whose hashes differ between processes, so an unpickled node would be filed
under the wrong hash (and unpickling a term already fails on it).  Workers therefore load the
rule packs themselves from their directories (0.7 s, once per worker), and candidates travel as
block-program text (`show_program`, read back by `parse_block_program`).
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Callable

from .cost import ProgramCost, cost_program
from .blockfile import parse_block_program
from .engine import Budget
from .extract import NoCandidate
from .forward import forwarded
from .fuse import fuse
from .ir import (BlockProgram, IRError, Kernel, Load, Node, Sort, Store, TensorDecl, axes_named,
                 map_attrs, postorder, show_program, transform, validate)
from .options import SPENT, Meter, Options
from .packs import load_packs
from .rule import RulePack
from .targets import Target
from .workers import run_all

# Above this many kernels `apply` selects candidates by default, in candidates of at most this
# many.  Measured with `apply` on the chains of benchmarks/bench_apply.py (h100, 2 busy cores):
# one attention block (6 kernels) saturates; from two blocks (12 kernels) on, the whole-program
# e-graph stops at its iteration limit and the wall time grows to the 20 s deadline (12: 8 s,
# 18: 17 s, 30: 22 s, 60: 23 s) while candidates of 12 give the same modeled time (60 kernels:
# 516 us either way) in 7 s; the 19-kernel decoder layer example fused in two candidates models
# 153 us against 158 us whole.
DEFAULT_THRESHOLD = 12


@dataclass(frozen=True)
class Candidate:
    """Kernels `start`..`stop - 1` of the program, as a standalone block program: what they
    load and do not store is its inputs; what they store that later kernels or the program's
    outputs need is its outputs."""

    index: int
    start: int
    stop: int
    program: BlockProgram

    @property
    def stored(self) -> tuple[str, ...]:
        return tuple(s.tensor for s in self.program.stores)


def select_candidates(p: BlockProgram, max_kernels_per_candidate: int) -> list[Candidate]:
    """Partition `p`'s kernels into contiguous candidates of at most `max_kernels_per_candidate`
    kernels, cutting where the round trips through global memory cost least (see the module
    docstring).  Bytes, not modeled time: every target orders round trips the same way.

    A program that repeats itself from its start (the layers of a model) is cut the same way
    in every repetition, so that the repetitions' candidates are identical and fused once."""
    if max_kernels_per_candidate < 1:
        raise ValueError("a candidate holds at least one kernel")
    n = len(p.kernels)
    loads = [_loads(k) for k in p.kernels]
    last_read = _last_reads(p, loads)
    cuts = _cut_costs(p, loads)
    weights = [1 if names else 0 for names in loads]
    period, repeats = _repetition(p, max_kernels_per_candidate, last_read)
    bounds, tail = [], 0
    if repeats > 1:
        inner = _partition(cuts, weights, 0, period, max_kernels_per_candidate)
        bounds = [(start + k * period, stop + k * period) for k in range(repeats)
                  for start, stop in inner]
        tail = repeats * period
    bounds += _partition(cuts, weights, tail, n, max_kernels_per_candidate)
    return [Candidate(i, start, stop, _standalone(p, start, stop, last_read))
            for i, (start, stop) in enumerate(bounds)]


def _partition(cuts: list[tuple[int, int]], weights: list[int], lo: int, hi: int,
               most: int) -> list[tuple[int, int]]:
    """The cheapest cut of kernels [lo, hi) into runs of at most `most`, by dynamic
    programming over cut positions; `cuts[c]` is the cost of cutting before kernel c.

    A kernel that loads nothing (a mask computed from positions) weighs nothing: it is a
    leaf its readers inline, and counting it would cut them from what they read."""
    # best[j]: the cheapest partition of [lo, lo + j) as (views cut, bytes cut, candidates)
    best: list[tuple[float, float, float]] = [(0, 0, 0)] + [(math.inf,) * 3] * (hi - lo)
    back = [0] * (hi - lo + 1)
    for j in range(1, hi - lo + 1):
        first, held = j, 0
        while first > 0 and held + weights[lo + first - 1] <= most:
            first -= 1
            held += weights[lo + first]
        for i in range(first, j):
            views, size, count = best[i]
            cost = cuts[lo + i] if i else (0, 0)
            key = (views + cost[0], size + cost[1], count + 1)
            if key < best[j]:
                best[j], back[j] = key, i
    bounds = []
    j = hi - lo
    while j > 0:
        bounds.append((lo + back[j], lo + j))
        j = back[j]
    return bounds[::-1]


_LONGEST_PERIOD = 512  # kernels: longer layers than this are not looked for


def _repetition(p: BlockProgram, most: int, last_read: dict[str, int]) -> tuple[int, int]:
    """(period, repeats): the shortest run of kernels that the program's first kernels repeat
    (the same kernels up to tensor names, `canonical`), widened to hold a whole candidate of
    `most` kernels where it is shorter; (0, 0) if the program does not start with a
    repetition."""
    n = len(p.kernels)
    shapes = [(len(k.grid), *(type(node).__name__ for s in k.stores
                                         for node in postorder(s.value))) for k in p.kernels]

    def form(start: int, stop: int) -> str:
        return show_program(canonical(_standalone(p, start, stop, last_read))[0])

    for period in range(1, min(n // 2, _LONGEST_PERIOD) + 1):
        if shapes[:period] != shapes[period:2 * period]:
            continue  # a cheap test first: the kernels' node kinds differ
        first = form(0, period)
        repeats = 1
        while (repeats + 1) * period <= n and \
                form(repeats * period, (repeats + 1) * period) == first:
            repeats += 1
        if repeats > 1:
            widen = max(1, most // period)  # short periods: several per candidate
            return period * widen, repeats // widen
    return 0, 0


def _tensor_bytes(p: BlockProgram, name: str) -> int:
    t = p.tensors[name]
    return math.prod(p.extent(a) for a in t.axes) * t.itemsize


def _loads(kernel: Kernel) -> set[str]:
    """The tensors a kernel loads (views by their own name)."""
    return {n.tensor for s in kernel.stores for n in postorder(s.value) if isinstance(n, Load)}


def _last_reads(p: BlockProgram, loads: list[set[str]]) -> dict[str, int]:
    """Each tensor's last reader: the index of the last kernel that loads it or a view of it
    (absent: none does)."""
    return {p.tensors[name].storage: j for j, names in enumerate(loads) for name in names}


def _cut_costs(p: BlockProgram, loads: list[set[str]]) -> list[tuple[int, int]]:
    """For each cut c before kernel c (0 ..= kernels), (tensors read through a view, bytes of
    round trips) that it forces: a temporary produced before it and read after it is written
    and read back (twice its bytes); a program output is written anyway, so only its reading
    back counts.

    A tensor first stored by kernel i and read by kernel j crosses the cuts i < c <= j, so
    each read adds to a range of cuts: summed by differences, in one pass over the reads (cut
    by cut, a program of 3,000 kernels took seconds)."""
    n = len(p.kernels)
    made: dict[str, int] = {}
    for i, k in enumerate(p.kernels):
        for t in k.tensors:
            made.setdefault(t, i)
    views, size = [0] * (n + 2), [0] * (n + 2)
    last: dict[str, int] = {}
    for j, names in enumerate(loads):
        for name in names:
            storage = p.tensors[name].storage
            i = made.get(storage, j)
            if i < j:
                if p.tensors[name].role == "view":
                    views[i + 1] += 1
                    views[j + 1] -= 1
                last[storage] = j
    for t, j in last.items():
        bytes_ = _tensor_bytes(p, t) * (1 if t in p.outputs else 2)
        size[made[t] + 1] += bytes_
        size[j + 1] -= bytes_
    cuts, v, b = [], 0, 0
    for c in range(n + 1):
        v, b = v + views[c], b + size[c]
        cuts.append((v, b) if 0 < c < n else (0, 0))
    return cuts


def _standalone(p: BlockProgram, start: int, stop: int,
                last_read: dict[str, int]) -> BlockProgram:
    """Kernels `start`..`stop - 1` of `p` as a program of their own (`last_read`: each
    tensor's last reader in `p`, `_last_reads`)."""
    kernels = p.kernels[start:stop]
    stored = {t for k in kernels for t in k.tensors}
    later = {t for t in stored if last_read.get(t, -1) >= stop}
    loaded = [t for k in kernels for s in k.stores for t in _ordered_loads(s.value)]
    names = list(dict.fromkeys([*loaded, *(t for k in kernels for t in k.tensors)]))
    tensors: dict[str, TensorDecl] = {}
    for name in names:
        decl = p.tensors[name]
        if decl.role == "view":
            base = p.tensors[decl.base]
            tensors.setdefault(base.name, _role(base, stored, later, p.outputs))
        tensors[name] = _role(decl, stored, later, p.outputs)
    outputs = tuple(t for t in names if t in stored and tensors[t].role == "output")
    used = {a for t in tensors.values() for a in t.axes}
    used.update(a for k in kernels for s in k.stores for a in axes_named(s.value))
    dims = {a: d for a, d in p.dims.items() if a in used}
    return BlockProgram(dims, tensors, kernels, outputs)


def _role(decl: TensorDecl, stored: set[str], later: set[str],
          outputs: tuple[str, ...]) -> TensorDecl:
    """The declaration of `decl` inside a candidate storing `stored`, before kernels that read
    `later`."""
    if decl.role == "view":
        return decl
    if decl.name not in stored:
        role = "input"
    elif decl.name in later or decl.name in outputs:
        role = "output"
    else:
        role = "temp"
    return TensorDecl(decl.name, decl.axes, decl.dtype, role)


def _ordered_loads(value: Node) -> list[str]:
    return [n.tensor for n in postorder(value) if isinstance(n, Load)]


# --------------------------------------------------------------------------------------------
# Canonical forms: repeated layers are fused once


def rename_tensors(p: BlockProgram, names: dict[str, str]) -> BlockProgram:
    """`p` with its tensors renamed by `names` (every tensor of `p` must be in it)."""
    def store(s: Store) -> Store:
        value = transform(s.value, lambda n, kids: map_attrs(n, Sort.TENSOR, names.__getitem__,
                                                             kids))
        return Store(names[s.tensor], s.axes, value)

    tensors = {names[t.name]: TensorDecl(names[t.name], t.axes, t.dtype, t.role,
                                         names[t.base] if t.base else "")
               for t in p.tensors.values()}
    kernels = tuple(Kernel(k.grid, tuple(map(store, k.stores)), k.blocks) for k in p.kernels)
    return BlockProgram(dict(p.dims), tensors, kernels, tuple(names[o] for o in p.outputs))


def canonical(p: BlockProgram) -> tuple[BlockProgram, dict[str, str]]:
    """`p` with its tensors named T0, T1, ... in order of first use (loads, then the store,
    kernel by kernel; then any declared tensor left), and the map from canonical names back."""
    order = [t for k in p.kernels for s in k.stores for t in (*_ordered_loads(s.value), s.tensor)]
    order += [p.tensors[t].base for t in order if p.tensors[t].base]
    order = list(dict.fromkeys([*order, *p.tensors]))
    names = {t: f"T{i}" for i, t in enumerate(order)}
    renamed = rename_tensors(p, names)
    renamed = BlockProgram(renamed.dims, {names[t]: renamed.tensors[names[t]] for t in order},
                           renamed.kernels, renamed.outputs)
    return renamed, {v: k for k, v in names.items()}


def _back(fused: BlockProgram, back: dict[str, str], taken: set[str]) -> BlockProgram:
    """A fused canonical program renamed back to a candidate's names.  Tensors that fusion
    made (split states, chunked views: `T3_m2`) take the name of the tensor they derive from
    (`O_m2`), made unique among `taken`, which grows."""
    names: dict[str, str] = {}
    for t in fused.tensors:
        if t in back:
            names[t] = back[t]
            continue
        stem, _, rest = t.partition("_")
        name = f"{back.get(stem, stem)}_{rest}" if rest else t
        unique, i = name, 2
        while unique in taken or unique in back.values():
            unique, i = f"{name}_{i}", i + 1
        names[t] = unique
        taken.add(unique)
    return rename_tensors(fused, names)


# --------------------------------------------------------------------------------------------
# Fusing candidates and stitching the results


@dataclass(frozen=True)
class CandidateReport:
    """What became of one candidate."""

    index: int
    kernels: tuple[int, int]  # [start, stop) in the unfused program
    stored: tuple[str, ...]  # the tensors its kernels stored before fusion
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kernels_after: int
    reused_from: int | None  # the candidate whose fusion it shares, if not its own
    seconds: float  # its fusion's wall time (0 when reused)
    budget: float  # the seconds its fusion was given (`_Share`; 0 when reused)
    stop: str  # what ended its saturation
    budgets: dict[str, str]  # which budget stopped which phase (`FuseResult.budgets`)

    def to_json(self) -> dict:
        return {"index": self.index, "kernels": list(self.kernels),
                "kernels_before": self.kernels[1] - self.kernels[0],
                "kernels_after": self.kernels_after, "stored": list(self.stored),
                "inputs": list(self.inputs), "outputs": list(self.outputs),
                "reused": self.reused_from is not None, "reused_from": self.reused_from,
                "seconds": self.seconds, "budget_seconds": self.budget, "stop": self.stop,
                "budgets": dict(self.budgets)}

    def cut(self) -> list[str]:
        """The phases its time or memory budget cut short (a stage's share of them too)."""
        return [phase for phase, stop in self.budgets.items()
                if stop in SPENT]

    def line(self) -> str:
        start, stop = self.kernels
        cut = f", cut short: {', '.join(self.cut())}" if self.cut() else ""
        how = (f"same as candidate {self.reused_from}, fused once" if self.reused_from is not None
               else f"{self.seconds:.2f} of {self.budget:.2f} s, {self.stop}{cut}")
        return (f"candidate {self.index}: kernels {start}-{stop - 1} "
                f"({self.stored[0]} .. {self.stored[-1]}): {stop - start} -> "
                f"{self.kernels_after} kernels ({how}); outputs {', '.join(self.outputs)}")


@dataclass(frozen=True)
class StitchedResult:
    """The candidates' fused programs stitched into one, and how each was found."""

    program: BlockProgram
    before: ProgramCost
    after: ProgramCost
    candidates: tuple[CandidateReport, ...]
    objective: str
    workers: int
    seconds: float
    forwarded: tuple[str, ...] = ()  # what the elementwise maps forwarded stored (`forward`)

    def to_json(self) -> dict:
        return {"objective": self.objective, "before": self.before.to_json(),
                "after": self.after.to_json(),
                "candidates": [c.to_json() for c in self.candidates],
                "distinct_candidates": sum(c.reused_from is None for c in self.candidates),
                "forwarded": list(self.forwarded),
                "workers": self.workers, "seconds": self.seconds,
                "explain": "not available for a program stitched from candidates"}


@dataclass(frozen=True)
class PackSource:
    """Where a worker process loads the rule packs from (`packs.load_packs`)."""

    directories: tuple[str, ...] = ()
    include_installed: bool = True


@dataclass(frozen=True)
class _Fused:
    """One fusion's result as it crosses a process boundary (the program as text)."""

    program: str  # block-program text
    seconds: float
    budget: float
    stop: str
    budgets: dict[str, str]


_PACK: RulePack | None = None


def _load_pack(source: PackSource) -> None:
    """Pool initializer: each worker loads the packs once."""
    global _PACK
    _PACK = load_packs(list(source.directories), source.include_installed)


def _fuse_text(text: str, target: Target, objective: str, budget: Budget, share: _Share,
               options: Options) -> _Fused | NoCandidate:
    """A worker's task: fuse a block program given as text, return the result as text (or
    why no fused program was found, which the caller tells in the program's names)."""
    assert _PACK is not None, "the pool initializer loads the pack"
    return _fuse_one(parse_block_program(text).program, _PACK, target, objective, budget, share,
                     options)


@dataclass(frozen=True)
class _Share:
    """How a fusion's time is found when it starts: what is left until `deadline` (wall-clock
    seconds since the epoch, which every process reads alike), shared among the rounds of
    fusions still to start, this one included (`left` of them, `workers` at a time).  A quick
    candidate leaves its unused time to those after it, so a slow one (an MLP whose extraction
    prices a thousand groupings) is not cut short while the whole still ends in time: cut to an
    equal part, GPT-2's MLP could be, and its block came out 51 or 98 MiB as the machine ran
    fast or slow."""

    deadline: float
    left: int
    workers: int

    def seconds(self) -> float:
        return max(0.0, self.deadline - time.time()) / math.ceil(self.left / self.workers)


def _fuse_one(p: BlockProgram, pack: RulePack, target: Target, objective: str, budget: Budget,
              share: _Share, options: Options) -> _Fused | NoCandidate:
    """Fuse one candidate within its share of the time (`_Share`)."""
    start = time.perf_counter()
    budget = replace(budget, seconds=share.seconds())
    try:
        r = fuse(p, pack, target, objective, budget=budget, options=options)
    except NoCandidate as err:
        return err
    return _Fused(show_program(r.program), time.perf_counter() - start, budget.seconds, r.stop,
                  r.budgets())


def fuse_candidates(p: BlockProgram, candidates: list[Candidate], pack: RulePack,
                    target: Target, objective: str = "time", budget: Budget = Budget(),
                    options: Options = Options(), source: PackSource | None = None,
                    workers: int | None = None,
                    progress: Callable[[str], None] | None = None,
                    meter: Meter | None = None) -> StitchedResult:
    """Fuse each distinct candidate and stitch the results, all within `budget`: each fusion
    gets, when it starts, the share of the time left that keeps the whole inside it
    (`_Share`: the candidates a worker fuses one after another share that worker's time).

    With `source` (where `pack` was loaded from), distinct candidates are fused in a pool of
    `workers` processes (default: one per core, at most one per distinct candidate); without
    it, or with one distinct candidate, in this process with `pack`.  `meter`: the clock of
    `budget` when it started before this call (a command's, which counts loading the packs)."""
    start = time.perf_counter()
    meter = meter or Meter(budget)
    forms = [canonical(c.program) for c in candidates]
    first: dict[str, int] = {}
    for c, (form, _) in zip(candidates, forms):
        first.setdefault(show_program(form), c.index)
    distinct = sorted(set(first.values()))
    workers = 1 if source is None else max(1, min(workers or os.cpu_count() or 1,
                                                  len(distinct)))
    deadline = time.time() + meter.deadline - time.perf_counter()  # (in every process's clock)
    if progress:
        progress(f"{len(candidates)} candidates, {len(distinct)} distinct, fused by "
                 f"{workers} process{'es' * (workers > 1)}")
    shares = {i: _Share(deadline, len(distinct) - n, workers) for n, i in enumerate(distinct)}
    if workers == 1:
        done = {i: _fuse_one(forms[i][0], pack, target, objective, budget, shares[i], options)
                for i in distinct}
    else:
        calls = [(_fuse_text, (show_program(forms[i][0]), target, objective, budget, shares[i],
                               options)) for i in distinct]
        done = dict(zip(distinct, run_all(calls, workers, _load_pack, (source,))))
    fused: dict[int, BlockProgram] = {}
    for i, d in done.items():
        if isinstance(d, NoCandidate):
            raise _in_candidate(d, candidates[i], forms[i][1])
        fused[i] = parse_block_program(d.program).program
    taken = set(p.tensors)
    programs, reports = [], []
    for c, (form, back) in zip(candidates, forms):
        own = first[show_program(form)]
        d = done[own]
        programs.append(_back(fused[own], back, taken))
        reports.append(CandidateReport(
            c.index, (c.start, c.stop), c.stored, c.program.inputs, c.program.outputs,
            len(fused[own].kernels), None if own == c.index else own,
            *((d.seconds, d.budget) if own == c.index else (0.0, 0.0)), d.stop, d.budgets))
    whole = stitch(p, programs)
    stitched = forwarded(whole, target, objective)
    gone = tuple(t for k in whole.kernels for t in k.tensors if t not in stitched.tensors)
    return StitchedResult(stitched, cost_program(p, target), cost_program(stitched, target),
                          tuple(reports), objective, workers, time.perf_counter() - start,
                          gone)


def _in_candidate(err: NoCandidate, c: Candidate, back: dict[str, str]) -> NoCandidate:
    """A candidate's failure told with the program's tensor names (not the canonical T0, T1,
    ... it was fused under) and the kernels it covers."""
    message = re.sub(r"\bT\d+\b", lambda m: back.get(m.group(), m.group()), str(err))
    return NoCandidate(f"candidate {c.index} (kernels {c.start}-{c.stop - 1}): {message}")


def stitch(p: BlockProgram, parts: list[BlockProgram]) -> BlockProgram:
    """One program of the fused candidates' kernels in order, over all their dims and
    tensors; tensors keep their roles in `p` (a candidate's output that only later candidates
    read is a temporary again), the ones fusion made keep theirs.  Validated."""
    dims = dict(p.dims)
    for part in parts:
        for name, d in part.dims.items():
            if dims.setdefault(name, d) != d:
                raise IRError(f"candidates disagree on dimension '{name}'")
    kernels = tuple(k for part in parts for k in part.kernels)
    stored = {t for k in kernels for t in k.tensors}
    tensors = {n: t for n, t in p.tensors.items()  # what fusion kept, as `extract` keeps it
               if t.role == "input" or n in stored or t.storage in stored
               or p.tensors[t.storage].role == "input"}
    for part in parts:
        for name, decl in part.tensors.items():
            if name not in p.tensors:
                tensors[name] = decl
    program = BlockProgram(dims, tensors, kernels, p.outputs)
    validate(program)
    return program
