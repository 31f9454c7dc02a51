"""`fuse`: a block program in, the cheapest equivalent block program the rules reach out.

The pipeline: every kernel's stored value goes into one e-graph (loads of intermediates carry
the value they read, so forwarding is a rule), the pack's stages saturate it within a budget,
and extraction picks the cheapest program by the exact cost model.  The result records what
happened: costs before and after, saturation statistics per stage (and which budget stopped
it) and per rule, extraction statistics (and which budget stopped it), and the e-graph's provenance, from which the chain of
rule applications that built the output is found when asked for (`bbrules.explain`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .cost import ProgramCost, cost_program
from .engine import (Budget, ClassGraph, CompiledPack, Progress, RuleStats, Saturator,
                     StageStats, compile_pack)
from .explain import ExplainError, Step, explain
from .extract import ExtractStats, extract
from .ir import BlockProgram, Kernel, validate
from .options import Meter, Options
from .rule import RulePack
from .targets import Target


@dataclass
class FuseResult:
    """The fused program and the report of how it was found."""

    program: BlockProgram
    before: ProgramCost
    after: ProgramCost
    stats: list[StageStats]
    extraction: ExtractStats
    rules: list[RuleStats]
    source: BlockProgram
    graph: ClassGraph = field(repr=False)
    compiled: CompiledPack = field(repr=False)
    objective: str = "time"
    options: Options = Options()
    meter: Meter | None = field(default=None, repr=False)  # the budget explanations share
    _chain: list[Step] | None = field(default=None, init=False, repr=False)

    @property
    def chain(self) -> list[Step]:
        """The rule applications from the input to the output (found on first use, within
        what is left of the fusion's budget).

        Raises `ExplainError` if the recorded firings do not connect them (a bug), or if the
        budget runs out first."""
        if self._chain is None:
            chosen = replace(self.program, kernels=tuple(map(Kernel.of,
                                                             self.extraction.chosen)))
            self._chain = explain(self.source, chosen, self.graph, self.compiled,
                                  self.options, self.meter)
        return self._chain

    @property
    def stop(self) -> str:
        """What ended saturation: the first budget hit, or "saturated"."""
        for s in self.stats:
            if s.stop.startswith("skipped ("):
                return s.stop[len("skipped ("):-1]
            if s.stop != "saturated":
                return s.stop
        return "saturated"

    def budgets(self) -> dict[str, str]:
        """Which budget stopped which phase: per stage its stop, then extraction ("complete"
        when it ran to the end), and the reading of the firings ("not read" until an
        explanation asks for them)."""
        out = {f"saturation {s.stage}": s.stop for s in self.stats}
        out["extraction"] = self.extraction.stop
        out["read-back of firings"] = self.graph.stop
        return out

    def _chain_json(self) -> list[dict] | str:
        try:
            return [s.to_json() for s in self.chain]
        except ExplainError as e:
            if self.graph.stop == "complete":
                return f"no replayable chain was found: {e}"
            return f"no replayable chain: the {self.graph.stop} cut the firings short ({e})"

    def explain(self) -> list[str]:
        """The chain, one entry per rule application in replay order: the rule's file:line,
        the kernel, the iteration the e-graph recorded it in, and the subterm it rewrote,
        before and after."""
        try:
            return [str(s) for s in self.chain]
        except ExplainError as e:
            return [f"no replayable chain was found: {e}"]

    @property
    def runner_up(self) -> ProgramCost | None:
        """The best legal candidate that stores other tensors than the result (None if
        none)."""
        return self.extraction.runner_up

    def margin(self) -> tuple[float, float] | None:
        """How the runner-up compares: its modeled time over the result's, minus 1 (+0.012 is
        1.2% slower), and its traffic over the result's."""
        r = self.runner_up
        if r is None:
            return None
        return r.time / self.after.time - 1, r.traffic / max(self.after.traffic, 1)

    def to_json(self) -> dict:
        runner_up = None
        if (margin := self.margin()) is not None:
            runner_up = {**self.runner_up.to_json(), "time_margin": margin[0],
                         "traffic_ratio": margin[1]}
        explain = self._chain_json()  # first: it reads the firings `budgets` reports on
        return {
            "objective": self.objective,
            "before": self.before.to_json(),
            "after": self.after.to_json(),
            "runner_up": runner_up,
            "saturation": [s.to_json() for s in self.stats],
            "stop": self.stop,
            "budgets": self.budgets(),
            "extraction": self.extraction.to_json(),
            "rules": [r.to_json() for r in self.rules],
            "explain": explain,
        }


def fuse(p: BlockProgram, pack: RulePack, target: Target, objective: str = "time",
         max_kernels: int | None = None, budget: Budget = Budget(),
         progress: Progress | None = None, options: Options = Options(),
         meter: Meter | None = None) -> FuseResult:
    """Fuse `p` with the rules of `pack`, minimising `objective` ("time" or "traffic") on
    `target`, with at most `max_kernels` kernels if given, within `budget` (its time and
    memory bound saturation, read-back and extraction together; the best program found in
    time is the result, `p` itself at worst).

    `meter`: the clock of `budget` when it started before this call (a command's, which
    counts loading the packs too); a new one by default.

    Raises `extract.NoCandidate` when no legal program satisfies `max_kernels`.
    """
    validate(p)
    before = cost_program(p, target)
    before.key(objective)  # rejects an unknown objective before any work
    meter = meter or Meter(budget)
    compiled = compile_pack(pack)
    sat = Saturator(compiled, {n: (d.extent, d.block) for n, d in p.dims.items()}, options)
    sat.add_terms({k.tensor: k.value for k in p.stores},
                  {k.tensor: (k.axes, k.value) for k in p.stores})
    stats = sat.run(budget, progress, meter=meter)
    if progress:
        progress("extracting")
    graph = sat.freeze(provenance=True)
    program, after, xstats = extract(graph, p, target, objective, max_kernels, options, meter,
                                     progress)
    return FuseResult(program, before, after, stats, xstats, sat.rule_stats(graph), p, graph,
                      compiled, objective, options, meter)
