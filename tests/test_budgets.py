"""The budgets bound the whole of fusion: `--seconds`, `--nodes` and `--memory` hold within a
generous factor through saturation, read-back and extraction, the program returned is valid
and right, and the report names the budget that stopped each phase."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.cli import main
from bbrules.engine import Budget
from bbrules.extract import extract
from bbrules.frontend import load_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import validate
from bbrules.lower import lower
from bbrules.options import Meter
from bbrules.packs import load_packs
from bbrules.targets import get_target

ROOT = Path(__file__).resolve().parent.parent
CHAIN = ROOT / "tests" / "programs" / "chain12.bbp"
EXPLOSIVE = ROOT / "tests" / "packs" / "explosive"
ZERO_SS = ROOT / "benchmarks" / "programs" / "zero_ss.bbp"
SMALL = {"m": (64, 16)}
H100 = get_target("h100")


@pytest.fixture(scope="module")
def explosive():
    return load_packs([EXPLOSIVE])


def _agrees(ast, program) -> None:
    validate(program)
    inputs = random_inputs(ast, seed=0)
    out = ast.outputs[0]
    np.testing.assert_allclose(interp.run(program, inputs)[out], dense.evaluate(ast, inputs)[out],
                               rtol=1e-4, atol=1e-4)


def test_the_time_budget_holds_on_an_explosive_pack(explosive):
    ast = load_program(CHAIN, SMALL)
    start = time.perf_counter()
    r = fuse(lower(ast), explosive, H100, budget=Budget(seconds=0.5))
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5 * 4  # a generous factor: one iteration and set-up are not cut
    assert {"node limit", "time limit"} & set(r.budgets().values())
    assert r.after.key() <= r.before.key()
    _agrees(ast, r.program)


def test_the_node_budget_holds_inside_an_iteration(explosive):
    # Unbounded, the first fusion iteration here grows 1.6k e-nodes to 116k.
    ast = load_program(CHAIN, SMALL)
    r = fuse(lower(ast), explosive, H100, budget=Budget(nodes=5_000))
    assert max(s.enodes for s in r.stats) <= 5_000
    assert r.graph.n_nodes <= 5_000
    assert "node limit" in [s.stop for s in r.stats]
    _agrees(ast, r.program)


def test_each_stage_has_its_own_node_share():
    # With a global budget the algebra stage's growth left fusion three iterations; with
    # shares, fusion still runs and the sinking stage after it is not skipped.
    ast = load_program(ZERO_SS)
    r = fuse(lower(ast), load_packs([]), H100, budget=Budget(nodes=3_000))
    by_stage = {s.stage: s for s in r.stats}
    assert by_stage["fuse"].iterations > 3
    assert not by_stage["sink"].stop.startswith("skipped")
    _agrees(ast, r.program)


def test_a_spent_memory_budget_returns_the_best_so_far_and_says_so():
    ast = load_program(ROOT / "examples" / "softmax.bbp", {"r": (128, 64), "c": (256, 64)})
    r = fuse(lower(ast), load_packs([]), H100, budget=Budget(memory=1))
    assert r.extraction.stop == "memory limit"
    assert "skipped (memory limit)" in [s.stop for s in r.stats]
    assert r.after.key() <= r.before.key()
    _agrees(ast, r.program)


def test_extraction_out_of_time_returns_the_input_program():
    ast = load_program(ROOT / "examples" / "softmax.bbp", {"r": (128, 64), "c": (256, 64)})
    full = fuse(lower(ast), load_packs([]), H100)
    spent = Meter(Budget(seconds=0.0))
    program, _, stats = extract(full.graph, full.source, H100, meter=spent)
    assert stats.stop == "time limit"
    assert program == full.source


def test_apply_reports_the_budget_that_stopped_each_phase(capsys):
    args = ["apply", str(CHAIN), "--rules", str(EXPLOSIVE), "--dim", "m=64/16",
            "--seconds", "1"]
    # The first run also checks the pack's soundness (once: the verdict is cached), which the
    # fusion budget does not cover; the timed run is the second.  Its budget covers loading
    # the packs too: the whole command overruns it only by what egglog does uninterrupted.
    assert main([*args, "--json"]) == 0
    budgets = json.loads(capsys.readouterr().out)["budgets"]
    assert set(budgets) >= {"saturation fuse", "extraction", "read-back of firings"}
    start = time.perf_counter()
    assert main(args) == 0
    assert time.perf_counter() - start < 1 * 2
    out = capsys.readouterr().out
    assert "node limit" in out or "time limit" in out
