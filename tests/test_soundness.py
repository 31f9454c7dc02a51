"""The soundness checker: sound rules pass, wrong rules come back with a counterexample."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from bbrules import soundness
from bbrules.ir import SUM, BlockProgram, BlockReduce, Reduce, postorder
from bbrules.rule import PAxis, PVar, Rule
from bbrules.rulefile import load_pack, parse_rules
from bbrules.soundness import check_soundness

PACKS = Path(__file__).parent / "packs"

SOUND = """\
monoid pair_soundness_test(s, t)
  identity = (0.0, 0.0)
  combine  = (a.s + b.s, a.t + b.t)
  finalize = (s, t)
rule hoist_factor: reduce(?a, sum, ?x * ?s) => reduce(?a, sum, ?x) * ?s when ?a not in deps(?s)
rule max_absorbs_term: reduce(?a, max, ?x) + ?y => reduce(?a, max, ?x + ?y)
  when ?a not in deps(?y)
rule mul_comm: ?x * ?y <=> ?y * ?x
rule fold_mul: const(?c) * const(?d) => const(?c * ?d)
rule forward: load(store(?v)) => ?v
rule scale_through_dot: dot(?a, ?x * ?s, ?y) <=> dot(?a, ?x, ?y) * ?s when ?a not in shape(?s)
rule mean: reduce(?e, sum, bsum(?e, ?x)) * const(?c)
  => reduce(?e, sum, bsum(?e, ?x)) / const(extent(?e)) when ?c == 1 / extent(?e)
rule pair_loops: tuple(reduce(?a, sum, ?x), reduce(?a, sum, ?y))
  => reduce(?a, pair_soundness_test, tuple(?x, ?y))
rule first: get(0, tuple(?x, ?y)) => ?x
"""


def _recording(monkeypatch) -> list[BlockProgram]:
    """Record every program the checker runs."""
    programs: list[BlockProgram] = []
    run = soundness.run

    def recording_run(program: BlockProgram, inputs: dict) -> dict:
        programs.append(program)
        return run(program, inputs)

    monkeypatch.setattr(soundness, "run", recording_run)
    return programs


def test_sound_rules_pass(monkeypatch) -> None:
    programs = _recording(monkeypatch)
    pack = parse_rules(SOUND, "sound.bbr")
    assert check_soundness(pack, trials=10) == []
    two_way = sum(r.bidirectional for r in pack.rules)
    assert len(programs) == 10 * (len(pack.rules) + two_way)
    # The loops tried run over one block and over several.
    trips = {p.blocks(n.axis) for p in programs for k in p.stores
             for n in postorder(k.value) if isinstance(n, Reduce)}
    assert 1 in trips and max(trips) > 1


def test_deliberately_wrong_rules_are_caught() -> None:
    pack = load_pack(PACKS / "unsound")
    failures = check_soundness(pack)
    assert [f.rule.name for f in failures] == ["sum_absorbs_term", "exp_of_sum"]
    for f in failures:
        assert f.reason == "sides differ"
        assert f.max_error > 0.01
        assert "lhs = " in f.instance and "rhs = " in f.instance
        assert str(f).startswith(f"{PACKS / 'unsound' / 'bad.bbr'}:")
    # The counterexample is reproducible from the seed.
    assert check_soundness(pack) == failures


def test_axis_sizes_are_evaluated() -> None:
    text = SOUND.split("rule hoist_factor")[0] + (
        "rule mean_by_block: reduce(?e, sum, bsum(?e, ?x)) * const(?c)\n"
        "  => reduce(?e, sum, bsum(?e, ?x)) / const(block(?e)) when ?c == 1 / extent(?e)\n"
        "rule mean_by_extent: reduce(?e, sum, bsum(?e, ?x)) * const(?c)\n"
        "  => reduce(?e, sum, bsum(?e, ?x)) / const(block(?e) * trips(?e))\n"
        "  when ?c == 1 / extent(?e)\n")
    failures = check_soundness(parse_rules(text, "sizes.bbr"))
    assert [f.rule.name for f in failures] == ["mean_by_block"]


def test_negative_inputs_are_tried() -> None:
    failures = check_soundness(parse_rules("rule log_mul: log(?x * ?y) => log(?x) + log(?y)"))
    assert [f.rule.name for f in failures] == ["log_mul"]
    assert math.isinf(failures[0].max_error)  # NaN on one side, a number on the other


def test_tolerance_is_the_packs() -> None:
    text = "rule approx: ?x * 1.001 => ?x\n"
    assert [f.rule.name for f in check_soundness(parse_rules(text))] == ["approx"]
    assert check_soundness(parse_rules(text + "tolerance approx = 0.01\n")) == []


def test_a_rule_that_never_applies_is_reported() -> None:
    pack = parse_rules("rule never: reduce(?a, sum, ?x) => ?x when ?a in shape(?x)")
    [failure] = check_soundness(pack)
    assert failure.reason.startswith("could not instantiate")
    assert failure.seed is None


def test_a_packs_monoids_are_what_its_rules_reduce_with() -> None:
    pack = parse_rules(SOUND, "sound.bbr")
    pair_rule = [r for r in pack.rules if r.name == "pair_loops"]
    assert check_soundness(soundness.RulePack("p", pair_rule, pack.monoids), trials=3) == []


def test_errors_compare_nan_and_infinity_sensibly() -> None:
    a = np.array([1.0, np.nan, np.inf, 2.0], dtype=np.float32)
    b = np.array([1.5, np.nan, np.inf, 2.0], dtype=np.float32)
    assert soundness._max_error(a, b) == 0.5
    assert soundness._max_error(a, np.array([1.0, 0.0, np.inf, 2.0], np.float32)) == math.inf


def test_rules_built_in_python_are_type_checked_too() -> None:
    """The parser rejects such rules; rules constructed directly reach the checker as they are."""
    x = PVar("?x")
    a = PAxis("?a")
    rules = [Rule("drops_axis", BlockReduce("sum", a, x), x),
             Rule("bad_rhs", BlockReduce("sum", a, x), Reduce(a, SUM, x))]
    failures = check_soundness(soundness.RulePack("python", rules), trials=2)
    assert [(f.rule.name, f.reason.split(":")[0]) for f in failures] == [
        ("drops_axis", "the sides differ in shape or dependencies"),
        ("bad_rhs", "the right-hand side is ill-formed here")]
    assert all("lhs = bsum(" in f.instance for f in failures)
