"""Saturation in budgeted stages.

`Saturator.run` goes stage by stage and iteration by iteration: after each iteration it checks
the e-node count and the clock, and stops on the first budget hit.  Every stage uses egg's
back-off: a rule that matched more than its limit in one iteration is banned for a while and
its limit doubles, which keeps commutativity and associativity from crowding out everything
else.  egglog applies an iteration's matches before Python sees their number, so a ban starts
with the next iteration; the node budget bounds what one iteration can add.

Before each iteration the active rules' recording copies write the matches it is about to
apply into the e-graph, stamped with the iteration (`compile.Provenance`), and the time and
matches egglog reports per rule are summed (`RuleStats`).

The saturated e-graph is read back through `EGraph.freeze()` (rows of every constructor) into
a `ClassGraph` for extraction; nothing is parsed from printed text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable, Mapping

from egglog.bindings import EGraph

from ..ir import Node
from ..options import Budget, Options
from ..rule import Stage
from .compile import ANALYSIS, ITERATION, STAMP, CompiledPack, rule_of, size_facts
from .graph import ClassGraph, read_back
from .terms import TERM_CONSTRUCTORS, TermWriter


Progress = Callable[[str], None]


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
class RuleStats:
    """What one rule did over all stages: egglog's matches (a match found again in a later
    iteration counts again), distinct applications recorded in the e-graph (set by
    `Saturator.rule_stats`), and egglog's search-and-apply time."""

    rule: str
    matches: int = 0
    applications: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"rule": self.rule, "matches": self.matches, "applications": self.applications,
                "seconds": self.seconds}


@dataclass
class _BackOff:
    """egg's back-off state of one rule: over `limit << times_banned` matches bans it."""

    limit: int
    times_banned: int = 0
    banned_until: int = -1


@lru_cache(maxsize=16)
def _installed(text: str) -> tuple:
    """A compiled pack's program, parsed once: every e-graph made for the pack runs it."""
    return tuple(EGraph().parse_program(text))


class Saturator:
    """An egglog e-graph holding one compiled pack and the terms added to it."""

    def __init__(self, compiled: CompiledPack, dims: Mapping[str, tuple[int, int]],
                 options: Options = Options()):
        self.compiled = compiled
        self.options = options
        self.egraph = EGraph()
        self.writer = TermWriter()
        self.roots: dict[str, str] = {}
        self.combined: dict[frozenset[str], str] = {}
        self.fired: list[tuple[int, str, int]] = []  # (global iteration, rule, matches)
        self.iteration = 0
        self.rules = {rule_of(name): RuleStats(rule_of(name))
                      for name in compiled.egg_rules.values()}
        ground = TermWriter(prefix="g")
        for load in compiled.ground_loads:
            ground.name(load)
        self.egraph.run_program(*_installed(compiled.text))
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

    def _record(self, active: list[str], iteration: int) -> None:
        """Record the matches the active rules are about to apply, stamped `iteration`."""
        record = self._ruleset_for([self.compiled.provenance[rs].recorder for rs in active])
        self._exec(f"(run-schedule (run {record}))\n(set ({ITERATION}) {iteration})\n"
                   f"(run-schedule (run {STAMP}))")

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
        backoff = {rs: _BackOff(self.options.match_limit) for rs in rulesets}
        matches: dict[str, int] = {}
        done = 0
        stop = "saturated"
        while rulesets:
            if done >= cap:
                stop = "iteration limit"
                break
            active = [rs for rs in rulesets if backoff[rs].banned_until < done]
            self._exec(f"(run-schedule (saturate (run {ANALYSIS})))")
            if active:
                self._record(active, self.iteration + 1)
            report = self._exec(f"(run-schedule (run {self._ruleset_for(active)}))")[0].report \
                if active else None
            done += 1
            self.iteration += 1
            for rs in active:
                egg_name = self.compiled.egg_rules[rs]
                n = report.num_matches_per_rule.get(egg_name, 0)
                rule = rule_of(egg_name)
                spent = report.search_and_apply_time_per_rule.get(egg_name)
                self.rules[rule].seconds += spent.total_seconds() if spent else 0.0
                if n:
                    matches[rule] = matches.get(rule, 0) + n
                    self.rules[rule].matches += n
                    self.fired.append((self.iteration, rule, n))
                b = backoff[rs]
                if n > b.limit << b.times_banned:
                    b.banned_until = done + (self.options.ban_length << b.times_banned)
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

    def freeze(self, provenance: bool = False) -> ClassGraph:
        """The current e-graph as e-classes of e-nodes, with the class of every root, and with
        `provenance` the recorded firings of every rule."""
        return read_back(self.egraph, self.roots, self.compiled, provenance)

    def rule_stats(self, graph: ClassGraph) -> list[RuleStats]:
        """Per-rule statistics, applications counted in `graph` (frozen with provenance)."""
        applied: dict[str, int] = {}
        for f in graph.firings:
            rule = rule_of(self.compiled.egg_rules[f.ruleset])
            applied[rule] = applied.get(rule, 0) + 1
        return [RuleStats(s.rule, s.matches, applied.get(s.rule, 0), s.seconds)
                for s in self.rules.values()]

