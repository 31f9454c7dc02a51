"""Limits and tuning knobs of fusion, passed explicitly (nothing here is process-global state).

`Budget` bounds one fusion and `Meter` measures one against it; `Options` holds the knobs of
the engine's back-off, of check cases, of extraction's search and of explanations.  Budgets
and options are frozen: a caller that wants other values makes its own
(`dataclasses.replace(Options(), exhaustive_limit=0)`).
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Budget:
    """Limits on one fusion.  Hitting one is not an error: the best program found so far is
    the result (the input program at worst).

    `nodes` caps the e-nodes of the graph, `iterations` the iterations of each stage (a stage
    may declare a lower cap), `seconds` the wall time of the whole fusion (saturation, reading
    the e-graph back, extraction) and `memory` the process's resident memory in MiB.
    Saturation may use `Options.saturation_share` of the time; each stage gets its own share of
    the nodes and time left (`engine.saturate`).  The defaults keep the paper's examples far
    inside a 2-core, 24 GiB machine (a few thousand e-nodes).
    """

    nodes: int = 40_000
    iterations: int = 16
    seconds: float = 20.0
    memory: int = 4096


def resident_mib() -> float:
    """The process's resident memory now, in MiB (its peak where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


SPENT = ("time limit", "memory limit")  # what `Meter.over` says when a budget is spent


@dataclass
class Meter:
    """The clock and memory gauge of one fusion under `budget`, started when made.

    `over(until)` names the budget that is spent: "time limit" past `until` (the fusion's
    deadline by default), "memory limit" over `budget.memory`, else None.  Reading the memory
    costs a system call, so it is read at most every 20 ms.
    """

    budget: Budget = Budget()
    start: float = field(default_factory=time.perf_counter)
    _memory_at: float = field(default=-1.0, init=False, repr=False)
    _memory_over: bool = field(default=False, init=False, repr=False)

    @property
    def deadline(self) -> float:
        return self.start + self.budget.seconds

    def over(self, until: float | None = None) -> str | None:
        now = time.perf_counter()
        if now > (self.deadline if until is None else until):
            return "time limit"
        if now - self._memory_at > 0.02:
            self._memory_at = now
            self._memory_over = resident_mib() > self.budget.memory
        return "memory limit" if self._memory_over else None


@dataclass(frozen=True)
class Options:
    """Tuning knobs.  The defaults are what every example and test is tuned with."""

    # Saturation: egg's back-off defaults, the initial match limit and ban length.
    match_limit: int = 1000
    ban_length: int = 5
    # Saturation may use this share of a fusion's time budget; reading back and extraction
    # have the rest.
    saturation_share: float = 0.6
    # Each check case saturates within this.
    check_budget: Budget = field(default=Budget(nodes=5_000, iterations=8, seconds=5.0))
    # Extraction: enumerate when the space has at most this many candidates (at about half a
    # millisecond each, at most half a second); otherwise local search.
    exhaustive_limit: int = 1000
    max_evaluations: int = 2_000  # local search builds at most this many candidates
    moves_per_class: int = 12  # options of one class a local search step tries
    release_users: int = 4  # a shared class is released only from at most this many users
    release_ways: int = 3  # options per user a release move combines
    release_moves: int = 4  # release moves per shared class
    followup_slack: float = 2.0  # a move is combined with follow-ups only if at most this
    #                              much costlier
    split_folds: bool = True  # launches may split a fold over chunks (`bbrules.splitting`)
    reblock: bool = True  # launches may tile a grid axis finer than its dim (`grouping`)
    #                       and the best candidates coarser (`Extractor.retile`)
    retiled: int = 8  # how many of the best candidates are launched again with coarser blocks
    # Explanations: how deep rewrites below rewrites may nest before the search gives up.
    explain_depth: int = 64
