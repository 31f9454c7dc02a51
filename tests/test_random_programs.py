"""Random programs: the lowered block program, run by the reference interpreter, computes what
the dense evaluator computes from the source, for every tensor; fused by the standard pack, it
still does, through the interpreter and the numpy backend.  Programs that select by position
over a few chunks (what slices, concatenations and RoPE lower to) run through every backend."""

from __future__ import annotations

from functools import cache

import numpy as np
from hypothesis import HealthCheck, given, settings

from bbrules import dense, interp
from bbrules.codegen import cuda_gen, numpy_gen
from bbrules.frontend import parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import show_program
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.rule import RulePack
from bbrules.targets import get_target
from bbrules.verdict import Comparison, reduction_length

from cuda_emu import emulate
from strategies import programs, selecting_programs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_lowering_agrees_with_the_dense_evaluator(source):
    program = parse_program(source, "<random>")
    block = lower(program)
    inputs = random_inputs(program, seed=0)
    got = interp.run(block, inputs)
    # The reference is computed in float64, so the comparison measures the interpreter's
    # float32 rounding only; it is judged at the scale of each tensor's values.
    want = dense.evaluate(program, inputs, dtype=np.float64)
    assert set(got) == set(want)
    for name, ref in want.items():
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-4 * scale,
                                   err_msg=f"tensor {name} of\n{source}")



@cache
def standard_pack() -> RulePack:
    return load_packs([])


def check_fused_agrees(source: str) -> None:
    """Fuse the program with the standard pack; the fused program, through the interpreter and
    through the numpy backend (numpy code, and native code on two threads), computes every
    output as `bbrules run` judges it: within the norm-wise tolerance of the float64 dense
    evaluation."""
    program = parse_program(source, "<random>")
    fused = fuse(lower(program), standard_pack(), get_target("h100")).program
    inputs = random_inputs(program, seed=0)
    want = dense.evaluate(program, inputs, dtype=np.float64)
    plain = dense.evaluate(program, inputs, dtype=np.float32)
    runs = {"interp": interp.run,
            "numpy": lambda p, i: numpy_gen.run(p, i, native=False),
            "native": lambda p, i: numpy_gen.run(p, i, threads=2, native=True)}
    for backend, run in runs.items():
        got = run(fused, inputs)
        for name in program.outputs:
            c = Comparison.of(got[name], want[name], program.tensors[name].dtype,
                              reduction_length(program, name), plain[name])
            assert c.ok, f"{backend}: {c.line(name)}\nof\n{source}\nfused:\n" \
                         f"{show_program(fused)}"


# About 0.3 s an example; benchmarks/fuse_property.py runs many more.
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_fused_programs_agree_with_the_dense_evaluator(source):
    check_fused_agrees(source)


# About 3 s an example (a fusion, eight runs).
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(selecting_programs())
def test_selections_by_position_agree_in_every_backend(source):
    """Lowered and fused, through the numpy backend on one thread and on two, with native
    groups and products, the interpreter and the CUDA C emulator: every output within 1e-4 of
    the float64 dense evaluation, -inf where it is -inf (a maximum over chunks no predicate
    keeps)."""
    program = parse_program(source, "<random>")
    inputs = random_inputs(program, seed=0)
    want = dense.evaluate(program, inputs, dtype=np.float64)
    runs = {"numpy": lambda p: numpy_gen.run(p, inputs, threads=1, native=False),
            "numpy, 2 threads": lambda p: numpy_gen.run(p, inputs, threads=2, native=False),
            "native": lambda p: numpy_gen.run(p, inputs, threads=2, native=True),
            "interp": lambda p: interp.run(p, inputs),
            "cuda": lambda p: emulate(cuda_gen.generate(p), inputs)}
    fused = fuse(lower(program), standard_pack(), get_target("h100")).program
    for block in (lower(program), fused):
        for backend, run in runs.items():
            got = run(block)
            for name in program.outputs:
                ref = want[name]
                finite = np.isfinite(ref)
                assert (got[name][~finite] == ref[~finite]).all(), (backend, name, source)
                scale = max(1.0, float(np.abs(ref[finite]).max(initial=0.0)))
                np.testing.assert_allclose(got[name][finite], ref[finite], rtol=1e-4,
                                           atol=1e-4 * scale,
                                           err_msg=f"{backend}: {name} of\n{source}")
