"""Running a pack's check cases, each in an e-graph of its own."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import show_node
from ..rule import Check, RulePack, Stage
from .compile import CompiledPack, compile_pack
from ..options import Options
from .saturate import Saturator


@dataclass(frozen=True)
class CheckFailure:
    """A check case of a pack that did not hold."""

    check: Check
    message: str

    def __str__(self) -> str:
        where = f"{self.check.span}: " if self.check.span else ""
        return f"{where}check {self.check.rule}: {self.message}"


def run_checks(pack: RulePack, options: Options = Options()) -> list[CheckFailure]:
    """Run every `check` case of `pack`; the failures, in declaration order.

    A check runs only the rule (or ruleset) it names, from a fresh e-graph holding just its
    term, until saturation or `options.check_budget`.  `term => expect` holds when the
    expected term is then in the term's e-class, `term !=> expect` when it is not (so the
    direction of a one-way rule is checked), and a bare `term` when the rules never match it.
    A `load(store(v))` of a check term is a load of the intermediate tensor `check.stored`
    names, written as `fuse` writes a program's: carrying the value stored, renamed to the
    load's axes.
    """
    failures = []
    compiled: dict[str, CompiledPack] = {}
    for check in pack.checks:
        target = check.rule
        if target not in compiled:
            chosen = [r for r in pack.rules if target in (r.name, r.ruleset)]
            compiled[target] = compile_pack(pack, chosen)
        cp = compiled[target]
        sat = Saturator(cp, check.dims, options)
        sat.add_terms({"term": check.term}, check.stored)
        stats = sat.run(options.check_budget, stages=[Stage("check", tuple(cp.rulesets))])
        graph = sat.freeze()
        same = check.expect is not None and graph.lookup(check.expect) == graph.named["term"]
        shown = show_node(check.term)
        if check.expect is None:
            if stats[0].matches:
                failures.append(CheckFailure(check, f"{shown} must not rewrite, but "
                                                    f"{', '.join(stats[0].matches)} matched it"))
        elif check.negated and same:
            failures.append(CheckFailure(check, f"{shown} must not rewrite to "
                                                f"{show_node(check.expect)}, but does"))
        elif not check.negated and not same:
            why = f" (saturation stopped: {stats[0].stop})" if stats[0].stop != "saturated" \
                else ""
            failures.append(CheckFailure(check, f"{shown} does not rewrite to "
                                                f"{show_node(check.expect)}{why}"))
    return failures
