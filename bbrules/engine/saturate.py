"""Saturation in budgeted stages.

`Saturator.run` goes stage by stage and iteration by iteration.  Every stage uses egg's
back-off: a rule that matched more than its limit in one iteration is banned for a while and
its limit doubles, which keeps commutativity and associativity from crowding out everything
else.

Budgets.  Each stage gets its own share of the e-nodes and of the saturation time still left
when it starts, in proportion to its iteration cap among the stages still to run (the stages
of the standard pack declare 3 iterations of algebra, 10 of fusion and 1 of sinking, so fusion
gets 10/11 of what algebra left).  A stage that spends its share stops with "node limit" or
"time limit" and the later stages still run with theirs; only when the whole budget is spent
are they "skipped".  So an explosive early stage cannot starve fusion.

Within an iteration.  egglog applies an iteration's matches at once, before Python sees their
number.  The recording run before each iteration (below) finds the same matches, so their
number per rule is known first: when every rule's matches times the e-nodes its right side
can add fit in the stage's share, the iteration runs as one egglog run; otherwise its rules
run one at a time, fewest matches first, each recorded again on the graph the rules before
it changed (egglog matches semi-naively per ruleset, and a ruleset of one rule finds its
matches anew, so the larger count is the estimate), and a rule whose matches could overflow
what is left waits and the stage stops with "node limit" (its recorded matches are then
firings never applied, which explanations skip since their right side is not in the graph).
The node budget then holds unless egglog's apply finds more matches than the recording did
(measured by benchmarks/bench_budgets.py and tests/test_budgets.py: the graph stays within
the budget where one iteration used to overshoot it 4-10x).

Before each iteration the active rules' recording copies write the matches it is about to
apply into the e-graph, stamped with the iteration (`compile.Provenance`), and the time and
matches egglog reports per rule are summed (`RuleStats`).

The saturated e-graph is read back through `EGraph.freeze()` (rows of every constructor) into
a `ClassGraph` for extraction; nothing is parsed from printed text.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable, Mapping

from egglog.bindings import EGraph

from ..ir import Node, postorder
from ..options import Budget, Meter, Options
from ..rule import PVar, Stage
from .compile import ANALYSIS, ITERATION, STAMP, CompiledPack, rule_of, size_facts
from .graph import ClassGraph, graph_size, read_back
from .terms import TERM_CONSTRUCTORS, TermWriter


Progress = Callable[[str], None]

_RECORDER = re.compile(r":ruleset record_(\S+)")  # in the name egglog gives a recording rule


@dataclass(frozen=True)
class StageStats:
    """What one stage did.  `stop` is "saturated", "iteration limit", "node limit",
    "time limit", "memory limit" (the stage's share of a budget spent), or "skipped (...)"
    naming the budget earlier stages spent entirely."""

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


@dataclass(frozen=True)
class _Share:
    """What one stage may use: the e-nodes the graph may reach, and a deadline."""

    nodes: int
    until: float
    meter: Meter


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
        self._last: dict[str, int] = {}  # matches per ruleset in the last iteration
        self._growth: dict[str, int] = {}
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

    def _record(self, active: list[str], iteration: int) -> dict[str, int]:
        """Record the matches the active rules are about to apply, stamped `iteration`; the
        number of them per ruleset."""
        record = self._ruleset_for([self.compiled.provenance[rs].recorder for rs in active])
        report = self._exec(f"(run-schedule (run {record}))\n(set ({ITERATION}) {iteration})\n"
                            f"(run-schedule (run {STAMP}))")[0].report
        found: dict[str, int] = {}
        for name, n in report.num_matches_per_rule.items():
            recorder = _RECORDER.search(name)
            if recorder:
                found[recorder.group(1)] = found.get(recorder.group(1), 0) + n
        return found

    def run(self, budget: Budget = Budget(), progress: Progress | None = None,
            stages: Iterable[Stage] | None = None, meter: Meter | None = None
            ) -> list[StageStats]:
        """Run the stages in order within `budget`; one StageStats per stage.

        `meter` is the clock of the whole fusion this saturation is part of (a new one by
        default): saturation may use `Options.saturation_share` of its time.  Each stage gets
        a share of what is left (see the module docstring).
        """
        meter = meter or Meter(budget)
        until = meter.start + budget.seconds * self.options.saturation_share
        todo = list(self.compiled.stages if stages is None else stages)
        caps = [self._cap(stage, budget) for stage in todo]
        stats: list[StageStats] = []
        for n, stage in enumerate(todo):
            weight = caps[n] / max(sum(caps[n:]), 1)
            enodes = self.enodes()
            now = time.perf_counter()
            spent = (meter.over(until) if enodes < budget.nodes else "node limit")
            if stats and spent is not None:
                stats.append(self._stage_stats(stage, 0, 0.0, f"skipped ({spent})", {}))
                continue
            share = _Share(enodes + max(1, int((budget.nodes - enodes) * weight)),
                           now + (until - now) * weight, meter)
            stats.append(self._run_stage(stage, caps[n], share, progress))
        return stats

    def _cap(self, stage: Stage, budget: Budget) -> int:
        return min(budget.iterations, stage.iterations or budget.iterations)

    def _run_stage(self, stage: Stage, cap: int, share: _Share,
                   progress: Progress | None) -> StageStats:
        start = time.perf_counter()
        rulesets = [rs for name in stage.rulesets for rs in self.compiled.rulesets.get(name, [])]
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
            found = self._record(active, self.iteration + 1) if active else {}
            updated, held = self._apply(active, found, share) if active else (False, False)
            done += 1
            self.iteration += 1
            for rs in active:
                n = self._last.get(rs, 0)
                rule = rule_of(self.compiled.egg_rules[rs])
                if n:
                    matches[rule] = matches.get(rule, 0) + n
                b = backoff[rs]
                if n > b.limit << b.times_banned:
                    b.banned_until = done + (self.options.ban_length << b.times_banned)
                    b.times_banned += 1
            if progress:
                progress(f"stage {stage.name}: iteration {done}")
            if not updated and not held:
                banned = [b for b in backoff.values() if b.banned_until >= done]
                if not banned:
                    break
                for b in banned:  # nothing else changes: lift the bans early, as egg does
                    b.banned_until = -1
            if held or self.enodes() > share.nodes:
                stop = "node limit"
                break
            if (spent := share.meter.over(share.until)) is not None:
                stop = spent
                break
        self._exec(f"(run-schedule (saturate (run {ANALYSIS})))")
        return self._stage_stats(stage, done, time.perf_counter() - start, stop, matches)

    def _apply(self, active: list[str], found: Mapping[str, int], share: _Share
               ) -> tuple[bool, bool]:
        """Apply one iteration of the `active` rulesets, which the recording run found
        `found` matches of; returns (whether the e-graph changed, whether a rule was held
        back because its matches could overflow the stage's node share).

        All at once when the predicted growth fits the share, as egglog runs an iteration;
        else one ruleset at a time, fewest matches first, measuring the graph between them."""
        self._last = {}
        room = share.nodes - self.enodes()
        growth = {rs: found.get(rs, 0) * self.growth_per_match(rs) for rs in active}
        if sum(growth.values()) <= room:
            return self._run_rules(active), False
        updated = held = False
        for rs in sorted(active, key=lambda r: (growth[r], r)):
            if share.meter.over(share.until) is not None:  # the rest wait, not even recorded
                return updated, True
            if updated:  # on the graph the rules applied before it changed
                fresh = self._record([rs], self.iteration + 1).get(rs, 0)
                growth[rs] = max(growth[rs], fresh * self.growth_per_match(rs))
            if growth[rs] > room:
                held = True
                continue
            updated |= self._run_rules([rs])
            room = share.nodes - self.enodes()
        return updated, held

    def _run_rules(self, rulesets: list[str]) -> bool:
        """One egglog run of `rulesets` together; sums its statistics, returns whether the
        e-graph changed."""
        report = self._exec(f"(run-schedule (run {self._ruleset_for(rulesets)}))")[0].report
        for rs in rulesets:
            egg_name = self.compiled.egg_rules[rs]
            n = report.num_matches_per_rule.get(egg_name, 0)
            rule = rule_of(egg_name)
            spent = report.search_and_apply_time_per_rule.get(egg_name)
            self.rules[rule].seconds += spent.total_seconds() if spent else 0.0
            if n:
                self._last[rs] = n
                self.rules[rule].matches += n
                self.fired.append((self.iteration + 1, rule, n))
        return report.updated

    def growth_per_match(self, rs: str) -> int:
        """At most how many e-nodes one match of ruleset `rs` adds: its right side's nodes."""
        if rs not in self._growth:
            rhs = self.compiled.provenance[rs].rhs
            self._growth[rs] = max(1, sum(1 for n in postorder(rhs)
                                          if not isinstance(n, PVar)))
        return self._growth[rs]

    def _stage_stats(self, stage: Stage, iterations: int, seconds: float, stop: str,
                     matches: dict[str, int]) -> StageStats:
        enodes, eclasses = graph_size(self.egraph)
        return StageStats(stage.name, iterations, enodes, eclasses, seconds, stop, matches)

    def freeze(self, provenance: bool = False) -> ClassGraph:
        """The current e-graph as e-classes of e-nodes, with the class of every root, and with
        `provenance` the firings every rule recorded (decoded when asked for: see
        `graph.Recorded`)."""
        return read_back(self.egraph, self.roots, self.compiled, provenance)

    def rule_stats(self, graph: ClassGraph) -> list[RuleStats]:
        """Per-rule statistics, applications counted in `graph` (frozen with provenance)."""
        applied: dict[str, int] = {}
        if graph.recorded is not None:
            for ruleset, n in graph.recorded.applications().items():
                rule = rule_of(self.compiled.egg_rules[ruleset])
                applied[rule] = applied.get(rule, 0) + n
        return [RuleStats(s.rule, s.matches, applied.get(s.rule, 0), s.seconds)
                for s in self.rules.values()]

