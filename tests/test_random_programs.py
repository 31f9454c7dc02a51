"""Random programs: the lowered block program, run by the reference interpreter, computes what
the dense evaluator computes from the source, for every tensor."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings

from bbrules import dense, interp
from bbrules.frontend import parse_program
from bbrules.inputs import random_inputs
from bbrules.lower import lower

from strategies import programs


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

