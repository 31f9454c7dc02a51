"""Timing the generated numpy code (`bbrules.codegen.numpy_timing`): each kernel, and parts against whole."""

from __future__ import annotations

import itertools
import re
from types import SimpleNamespace

import numpy as np
import pytest

from bbrules.codegen import numpy_gen, numpy_plan, numpy_timing
from bbrules.cost import cost_program
from bbrules.frontend import parse_program
from bbrules.inputs import random_inputs
from bbrules.lower import lower
from bbrules.targets import get_target

from test_cli import ATTENTION
from test_numpy_threads import parts_in


# Unfused attention and a total of its row sums: kernels of a grid that split into parts, and
# one of no grid that runs whole.
ATTENTION_AND_TOTAL = ATTENTION.replace("output O", "T[] = sum[q] L[q]\n\noutput O, T")


def attention():
    p = lower(parse_program(ATTENTION_AND_TOTAL, "<test>"))
    return p, random_inputs(p, seed=0)


@pytest.mark.usefixtures("split_small")
def test_each_kernel_is_timed_once_a_run_whether_whole_or_in_parts(monkeypatch):
    """On a clock that ticks once per reading, every kernel call measures one tick: a kernel
    timed twice a run, or another's parts counted as its own, reads 2 (and that one 0)."""
    p, inputs = attention()
    ticks = itertools.count()
    monkeypatch.setattr(numpy_timing, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    got = numpy_timing.profile(p, inputs, runs=3, threads=2)
    generated = numpy_gen.generate_module(p, threads=2)
    assert parts_in(generated.source) >= 2, "nothing split: the test checks no parts"
    assert [k.tensors for k in got.kernels] == [tuple(k.tensors) for k in p.kernels]
    assert [k.parts for k in got.kernels] == list(generated.parts)
    assert any(k.parts > 1 for k in got.kernels) and any(k.parts == 1 for k in got.kernels)
    assert [k.seconds for k in got.kernels] == [1] * len(p.kernels)
    assert got.seconds == 2 * len(p.kernels) + 1  # the run's own two readings around them
    assert (got.runs, got.threads) == (3, 2)


def test_parts_in_the_module_match_what_run_hands_to_run_parts(split_small):
    p, _ = attention()
    generated = numpy_gen.generate_module(p, threads=2)
    for fns, count in zip(generated.functions, generated.parts):
        if count > 1:
            line = next(line for line in generated.source.splitlines()
                        if "run_parts(" in line and fns[0] in line)
            assert len(re.findall(r"\(kernel_\w+, \d+\)", line)) == count
            assert set(re.findall(r"\((kernel_\w+), \d+\)", line)) == set(fns)
        else:
            assert re.search(rf" = {fns[0]}\(", generated.source)


def test_no_kernel_takes_longer_than_the_run_it_is_part_of():
    """A kernel's time is within each run's, so its median is at most the runs' median."""
    p, inputs = attention()
    got = numpy_timing.profile(p, inputs, runs=5, threads=1)
    assert all(0 < k.seconds <= got.seconds for k in got.kernels)


def test_the_report_puts_measured_and_modeled_shares_side_by_side():
    p, inputs = attention()
    got = numpy_timing.profile(p, inputs, runs=2, threads=1)
    modeled = cost_program(p, get_target("cpu"))
    table = got.table(modeled)
    assert "modeled (cpu)" in table and "medians of 2 runs on 1 thread)" in table
    for k in p.kernels:
        assert any(line.startswith(",".join(k.tensors) + " ") for line in table.splitlines())
    data = got.to_json(modeled)
    assert data["target"] == "cpu" and len(data["kernels"]) == len(p.kernels)
    assert [k["modeled_seconds"] for k in data["kernels"]] == [k.time for k in modeled.kernels]


@pytest.mark.parametrize("faster", ["parts", "whole"])
def test_tune_keeps_the_module_that_ran_faster(split_small, monkeypatch, faster):
    p, inputs = attention()
    slower = {"parts": "whole", "whole": "parts"}[faster]
    monkeypatch.setattr(numpy_timing, "_rounds",
                        lambda modules, *_: {faster: [1.0, 3.0], slower: [2.0, 4.0]}
                        if set(modules) == {"parts", "whole"}
                        else pytest.fail(f"modules {set(modules)}"))
    tuned = numpy_timing.tune(p, inputs, threads=2)
    assert tuned.parts == (faster == "parts") and tuned.seconds[faster] == 1.0
    assert hasattr(tuned.module, "run_parts") == tuned.parts
    want = numpy_gen.run(p, inputs, threads=1)
    got = tuned.module.run(**inputs)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_tune_times_a_module_in_parts_even_where_the_estimate_runs_it_whole(monkeypatch):
    """The estimate (`parts_pay`) would run the program whole: tuning still times parts."""
    p, inputs = attention()
    monkeypatch.setattr(numpy_plan, "PARTS_START_NS", float("inf"))
    monkeypatch.setattr(numpy_plan, "MIN_CALL_FLOPS", 1)
    assert parts_in(numpy_gen.generate(p, threads=2)) == 0
    tuned = numpy_timing.tune(p, inputs, threads=2, runs=3)
    assert set(tuned.seconds) == {"parts", "whole"} and all(
        s > 0 for s in tuned.seconds.values())


def test_a_program_with_nothing_to_split_is_not_timed():
    p, inputs = attention()
    for threads in (1, 2):  # on 2 threads, no kernel of this size has enough work for parts
        tuned = numpy_timing.tune(p, inputs, threads=threads)
        assert tuned.seconds == {} and not tuned.parts


def test_candidates_are_run_once_then_timed_in_alternating_order():
    calls = []

    class Module:
        def __init__(self, name):
            self.outputs = lambda **_: calls.append(name)
    times = numpy_timing._rounds({"a": Module("a"), "b": Module("b")}, {}, runs=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3}


def test_rounds_go_on_for_the_seconds_asked_up_to_a_limit():
    calls = []

    class Module:
        def __init__(self, name):
            self.outputs = lambda **_: calls.append(name)
    times = numpy_timing._rounds({"a": Module("a"), "b": Module("b")}, {}, runs=3,
                                 seconds=60.0)
    assert len(times["a"]) == len(times["b"]) == numpy_timing.MAX_ROUNDS


@pytest.mark.parametrize("whole, parts, faster", [
    ((10, 5, 10, 10, 10), (8, 8, 8, 8, 8), "parts"),  # one lucky run does not decide
    ((4, 9, 4, 9, 4), (6, 6, 6, 6, 6), "whole"),  # nor rounds slowed by other work
])
def test_tune_keeps_the_module_ahead_in_the_median_round(split_small, monkeypatch, whole,
                                                         parts, faster):
    """In the first case the whole module's fastest run (5) beats the parts' (8), but the
    parts are ahead in four rounds of five; in the second the whole module is ahead in three
    rounds of five, twice slowed by other work."""
    p, inputs = attention()
    monkeypatch.setattr(numpy_timing, "_rounds",
                        lambda *_: {"whole": list(whole), "parts": list(parts)})
    tuned = numpy_timing.tune(p, inputs, threads=2)
    assert tuned.parts == (faster == "parts")
    assert tuned.seconds == {"whole": min(whole), "parts": min(parts)}
