"""Explanations from provenance: the chain of rule applications replays to the output."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bbrules.cli import main
from bbrules.engine.compile import rule_of
from bbrules.explain import ExplainError, replay
from bbrules.frontend import load_program
from bbrules.fuse import fuse
from bbrules.options import Budget, Meter
from bbrules.ir import postorder, show_node
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

EXAMPLES = Path(__file__).parent.parent / "examples"
SMALL = {
    "attention.bbp": {"q": (256, 64), "k": (256, 64)},
    "layernorm_matmul.bbp": {"m": (128, 64), "n": (128, 64)},
    "rmsnorm_ffn_swiglu.bbp": {"m": (16, 8), "e": (128, 64), "f": (32, 4), "n": (128, 128)},
}


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


@pytest.fixture(scope="module")
def fused(pack):
    return {name: fuse(lower(load_program(EXAMPLES / name, dims)), pack, get_target("h100"))
            for name, dims in SMALL.items()}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_chain_replays_to_the_extracted_program(pack, fused, name):
    r = fused[name]
    rules = {rule.name: rule for rule in pack.rules}
    values = replay(r.source, r.chain, rules)
    assert r.extraction.chosen  # what the e-graph chose, before the launches split any fold
    for k in r.extraction.chosen:
        assert values[k.tensor] == k.value, k.tensor
    for s in r.chain:
        assert s.before != s.after
        assert s.span is not None and s.span.path.endswith(".bbr")
    # No step is undone by the next one at the same place.
    for a, b in zip(r.chain, r.chain[1:]):
        assert not (a.kernel == b.kernel and a.path == b.path and b.after == a.before)


def test_attention_chain_moves_the_denominator_out_of_the_contraction(fused):
    chain = fused["attention.bbp"].chain
    names = [s.rule for s in chain]
    for rule in ("forward", "dot_div", "hoist_div", "online_sum", "online_dot",
                 "softmax_merge"):
        assert rule in names
    assert "mul_comm" not in names
    dot_div = chain[names.index("dot_div")]
    assert show_node(dot_div.before) == "dot(k, load(E[q, k]) / load(L[q]), load(V[k, d]))"
    assert show_node(dot_div.after) == "dot(k, load(E[q, k]), load(V[k, d])) / load(L[q])"
    assert names.index("dot_div") < names.index("hoist_div") < names.index("softmax_merge")
    assert dot_div.iteration < chain[names.index("softmax_merge")].iteration


def test_a_chain_that_does_not_reach_the_output_is_caught(pack, fused):
    r = fused["attention.bbp"]
    rules = {rule.name: rule for rule in pack.rules}
    with pytest.raises(ExplainError):
        replay(r.source, r.chain[1:], rules)  # the first forwarding step left out
    i = next(i for i, s in enumerate(r.chain) if s.rule == "dot_div")
    wrong = replace(r.chain[i], rule="dot_mul")
    with pytest.raises(ExplainError):
        replay(r.source, [*r.chain[:i], wrong, *r.chain[i + 1:]], rules)


def test_per_rule_statistics(fused):
    r = fused["attention.bbp"]
    stats = {s.rule: s for s in r.rules}
    for s in r.chain:
        assert stats[s.rule].applications >= 1
        assert stats[s.rule].matches >= 1
    assert all(s.matches >= s.applications >= 0 and s.seconds >= 0.0 for s in r.rules)
    assert stats["softmax_merge"].applications == 1


def test_apply_json_and_stats_report_rules_and_the_chain(capsys):
    args = ["apply", str(EXAMPLES / "attention.bbp"), "--dim", "q=256/64", "--dim", "k=256/64"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_rule = {r["rule"]: r for r in report["rules"]}
    assert by_rule["online_dot"]["applications"] >= 1
    assert [s["rule"] for s in report["explain"]].count("dot_div") == 1
    assert all(s["at"].split(":")[0].endswith(".bbr") for s in report["explain"])
    assert main([*args, "--stats", "--explain"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("rule  "):].splitlines()
    softmax_merge = next(line for line in table if line.startswith("softmax_merge"))
    assert softmax_merge.split()[1:3] == ["1", "1"]
    assert "linearity.bbr:" in out and "dot_div in O" in out


def test_a_chain_through_rules_whose_result_is_one_of_their_variables(pack):
    """`2 * sum[e] X * 0.5` fuses to `sum[e] X`: the chain folds 0.5 * 2.0 to 1.0 and then
    applies `?x * 1.0 => ?x`, whose result is a subterm of its match, not an e-node of its
    own."""
    program = lower(load_program(Path(__file__).parent.parent / "benchmarks" / "programs" /
                                 "zero_ss.bbp", {"m": (128, 64), "e": (128, 64)}))
    r = fuse(program, pack, get_target("h100"))
    rules = {rule.name: rule for rule in pack.rules}
    values = replay(r.source, r.chain, rules)
    assert [values[k.tensor] for k in r.program.stores] == [k.value for k in r.program.stores]
    assert "mul_one" in [s.rule for s in r.chain]
    assert "Binary" not in {type(n).__name__ for k in r.program.stores
                            for n in postorder(k.value)}


def test_the_explanation_search_stops_when_the_fusions_budget_is_spent(pack):
    """The chain is searched within what is left of the fusion's budget: with none left, the
    explanation says so instead of running on (it once took 47 s after a 5 s fusion)."""
    r = fuse(lower(load_program(EXAMPLES / "attention.bbp", {"q": (128, 64), "k": (128, 64)})),
             pack, get_target("h100"))
    r.meter = Meter(Budget(seconds=0.0))
    (line,) = r.explain()
    assert line == "no replayable chain was found: the fusion's time limit ran out first"


def test_the_firings_are_decoded_only_when_an_explanation_asks_for_them(pack):
    """Fusing counts each rule's applications from the recorded rows without decoding them
    (decoding GPT-2's MLP block's took as long as its extraction); the first explanation
    decodes them all, and the counts agree."""
    r = fuse(lower(load_program(EXAMPLES / "attention.bbp", {"q": (128, 64), "k": (128, 64)})),
             pack, get_target("h100"))
    assert r.budgets()["read-back of firings"] == "not read"
    applied = {s.rule: s.applications for s in r.rules if s.applications}
    assert r.chain
    assert r.budgets()["read-back of firings"] == "complete"
    decoded: dict[str, int] = {}
    for f in r.graph.firings():
        rule = rule_of(r.compiled.egg_rules[f.ruleset])
        decoded[rule] = decoded.get(rule, 0) + 1
    assert decoded == applied
