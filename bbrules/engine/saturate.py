"""Saturation in budgeted stages.

`Saturator.run` goes stage by stage and iteration by iteration: after each iteration it checks
the e-node count and the clock, and stops on the first budget hit.  Every stage uses egg's
back-off: a rule that matched more than its limit in one iteration is banned for a while and
its limit doubles, which keeps commutativity and associativity from crowding out everything
else.  egglog applies an iteration's matches before Python sees their number, so a ban starts
with the next iteration; the node budget bounds what one iteration can add.

The saturated e-graph is read back through `EGraph.freeze()` (rows of every constructor) into
a `ClassGraph` for extraction; nothing is parsed from printed text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from egglog.bindings import EGraph

from ..ir import Node
from ..rule import Stage
from .compile import ANALYSIS, CompiledPack, rule_of, size_facts
from .graph import ClassGraph, read_back
from .terms import TERM_CONSTRUCTORS, TermWriter

MATCH_LIMIT = 1000  # egg's back-off defaults: initial match limit and ban length
BAN_LENGTH = 5

Progress = Callable[[str], None]


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
class StageStats:
    """What one stage did.  `stop` is "saturated", "iteration limit", "node limit",
    "time limit", or "skipped" when an earlier stage exhausted a global budget."""

    stage: str
    iterations: int
    enodes: int
    eclasses: int
    seconds: float
    stop: str
    matches: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"stage": self.stage, "iterations": self.iterations, "enodes": self.enodes,
                "eclasses": self.eclasses, "seconds": self.seconds, "stop": self.stop,
                "matches": dict(self.matches)}



@dataclass
class _BackOff:
    """egg's back-off state of one rule: over `limit << times_banned` matches bans it."""

    limit: int
    times_banned: int = 0
    banned_until: int = -1


class Saturator:
    """An egglog e-graph holding one compiled pack and the terms added to it."""

    def __init__(self, compiled: CompiledPack, dims: Mapping[str, tuple[int, int]]):
        self.compiled = compiled
        self.egraph = EGraph()
        self.writer = TermWriter()
        self.roots: dict[str, str] = {}
        self.combined: dict[frozenset[str], str] = {}
        self.fired: list[tuple[int, str, int]] = []  # (global iteration, rule, matches)
        self.iteration = 0
        ground = TermWriter(prefix="g")
        for load in compiled.ground_loads:
            ground.name(load)
        self._exec(compiled.text)
        self._exec("\n".join(size_facts(dims) + ground.lines))

    def _exec(self, text: str) -> list:
        return self.egraph.run_program(*self.egraph.parse_program(text))

    def add_terms(self, terms: Mapping[str, Node],
                  stored: Mapping[str, tuple[tuple[str, ...], Node]] | None = None) -> None:
        """Add named terms (roots); loads of tensors in `stored` carry their values."""
        self.writer.stored.update(stored or {})
        start = len(self.writer.lines)
        for key, n in terms.items():
            self.roots[key] = self.writer.name(n)
        self._exec("\n".join(self.writer.lines[start:]))

    def enodes(self) -> int:
        """E-nodes of the Term constructors (the analyses and let bindings not counted)."""
        sizes = self._exec("(print-size)")[0].sizes
        return sum(n for name, n in sizes if name in TERM_CONSTRUCTORS)

    def _ruleset_for(self, active: list[str]) -> str:
        key = frozenset(active)
        if key not in self.combined:
            name = f"c{len(self.combined)}"
            self._exec(f"(unstable-combined-ruleset {name} {' '.join(sorted(active))})")
            self.combined[key] = name
        return self.combined[key]

    def run(self, budget: Budget = Budget(), progress: Progress | None = None,
            stages: Iterable[Stage] | None = None) -> list[StageStats]:
        """Run the stages in order within `budget`; one StageStats per stage.

        After a node or time limit stops a stage, the later stages are skipped: the graph has
        already used what it was allowed.
        """
        stats: list[StageStats] = []
        deadline = time.perf_counter() + budget.seconds
        for stage in (self.compiled.stages if stages is None else stages):
            if stats and stats[-1].stop in ("node limit", "time limit", "skipped"):
                stats.append(self._stage_stats(stage, 0, 0.0, "skipped", {}))
            else:
                stats.append(self._run_stage(stage, budget, deadline, progress))
        return stats

    def _run_stage(self, stage: Stage, budget: Budget, deadline: float,
                   progress: Progress | None) -> StageStats:
        start = time.perf_counter()
        rulesets = [rs for name in stage.rulesets for rs in self.compiled.rulesets.get(name, [])]
        cap = min(budget.iterations, stage.iterations or budget.iterations)
        backoff = {rs: _BackOff(MATCH_LIMIT) for rs in rulesets}
        matches: dict[str, int] = {}
        done = 0
        stop = "saturated"
        while rulesets:
            if done >= cap:
                stop = "iteration limit"
                break
            active = [rs for rs in rulesets if backoff[rs].banned_until < done]
            self._exec(f"(run-schedule (saturate (run {ANALYSIS})))")
            report = self._exec(f"(run-schedule (run {self._ruleset_for(active)}))")[0].report \
                if active else None
            done += 1
            self.iteration += 1
            for rs in active:
                n = report.num_matches_per_rule.get(self.compiled.egg_rules[rs], 0)
                if n:
                    rule = rule_of(self.compiled.egg_rules[rs])
                    matches[rule] = matches.get(rule, 0) + n
                    self.fired.append((self.iteration, rule, n))
                b = backoff[rs]
                if n > b.limit << b.times_banned:
                    b.banned_until = done + (BAN_LENGTH << b.times_banned)
                    b.times_banned += 1
            if report is None or not report.updated:
                banned = [b for b in backoff.values() if b.banned_until >= done]
                if not banned:
                    break
                for b in banned:  # nothing else changes: lift the bans early, as egg does
                    b.banned_until = -1
            if progress:
                progress(f"stage {stage.name}: iteration {done}")
            if self.enodes() > budget.nodes:
                stop = "node limit"
                break
            if time.perf_counter() > deadline:
                stop = "time limit"
                break
        self._exec(f"(run-schedule (saturate (run {ANALYSIS})))")
        return self._stage_stats(stage, done, time.perf_counter() - start, stop, matches)

    def _stage_stats(self, stage: Stage, iterations: int, seconds: float, stop: str,
                     matches: dict[str, int]) -> StageStats:
        graph = self.freeze()
        return StageStats(stage.name, iterations, graph.n_nodes, len(graph.classes), seconds,
                          stop, matches)

    def freeze(self) -> ClassGraph:
        """The current e-graph as e-classes of e-nodes, with the class of every root."""
        return read_back(self.egraph, self.roots)

