"""Limits and tuning knobs of fusion, passed explicitly (nothing here is process-global state).

`Budget` bounds one saturation; `Options` holds the knobs of the engine's back-off, of check
cases, of extraction's search and of explanations.  Both are frozen: a caller that wants other
values makes its own (`dataclasses.replace(Options(), exhaustive_limit=0)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Budget:
    """Limits on saturation.  Hitting one is not an error: extraction uses what was found.

    `nodes` caps the e-nodes of the graph, `iterations` the iterations of each stage (a stage
    may declare a lower cap), `seconds` the wall time of all stages together.  The defaults
    keep the paper's examples far inside a 2-core, 24 GiB machine (a few thousand e-nodes).
    """

    nodes: int = 40_000
    iterations: int = 16
    seconds: float = 20.0


@dataclass(frozen=True)
class Options:
    """Tuning knobs.  The defaults are what every example and test is tuned with."""

    # Saturation: egg's back-off defaults, the initial match limit and ban length.
    match_limit: int = 1000
    ban_length: int = 5
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
    # Explanations: how deep rewrites below rewrites may nest before the search gives up.
    explain_depth: int = 64
