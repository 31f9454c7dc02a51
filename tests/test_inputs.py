"""Random inputs: ids drawn as ids, everything else standard normal; inputs declared i32:
drawn whole, and refused where they hold what f32 would round."""

import re

import numpy as np
import pytest

from bbrules import interp
from bbrules.codegen import numpy_gen
from bbrules.frontend import parse_program
from bbrules.inputs import WHOLE_DRAWN, index_inputs, random_inputs
from bbrules.lower import lower

LOOKUP = ("dim t = 64 / 16\ndim v = 300 / 64\ndim e = 32\ninput IDS[t], E[v, e] : f32\n"
          "X[t, e] = sum[v] where(IDS[t] == v or IDS[t] == v - 300, 1, 0) * E[v, e]\n"
          "output X\n")


@pytest.mark.parametrize("lowered", [False, True], ids=["program", "block program"])
def test_an_input_only_compared_with_positions_holds_ids_below_their_extent(lowered):
    ast = parse_program(LOOKUP)
    p = lower(ast) if lowered else ast
    assert index_inputs(p) == {"IDS": 300}
    inputs = random_inputs(p, seed=5)
    ids = inputs["IDS"]
    assert ids.dtype == np.float32 and np.array_equal(ids, np.round(ids))
    assert ids.min() >= 0 and ids.max() < 300 and len(np.unique(ids)) > 32
    e = inputs["E"]
    assert e.dtype == np.float32 and not np.array_equal(e, np.round(e))
    assert np.array_equal(random_inputs(p, seed=5)["IDS"], ids)
    assert not np.array_equal(random_inputs(p, seed=6)["IDS"], ids)


@pytest.mark.parametrize("use", [
    "IDS[t] + sum[v] where(IDS[t] == v, 1, 0) * E[v, e]",  # read as a number too
    "sum[v] where(IDS[t] == 3, 1, 0) * E[v, e]",  # compared with a number: no extent
    "sum[v] where(IDS[t] < v, 1, 0) * E[v, e]",  # an order, not an equality
])
def test_an_input_read_otherwise_is_not_ids(use):
    src = ("dim t = 64 / 16\ndim v = 300 / 64\ndim e = 32\ninput IDS[t], E[v, e] : f32\n"
           f"X[t, e] = {use}\noutput X\n")
    ast = parse_program(src)
    assert index_inputs(ast) == {} and index_inputs(lower(ast)) == {}
    assert not np.array_equal(random_inputs(ast)["IDS"], np.round(random_inputs(ast)["IDS"]))


def test_ids_compared_with_a_tensor_index_its_axes():
    """magika's one-hot, unfused: the ids are compared with a tensor of the positions 0 ..
    256 (ONNX's constant range), which spans the axis they index."""
    ast = parse_program("dim t = 64 / 16\ndim v = 257 / 64\ninput IDS[t] : f32\n"
                        "R[v] = (v)\nH[t, v] = IDS[t] == R[v]\noutput H\n")
    assert index_inputs(ast) == {"IDS": 257} and index_inputs(lower(ast)) == {"IDS": 257}
    hot = lower(ast)
    got = interp.run(hot, random_inputs(hot))["H"]
    assert np.array_equal(got.sum(axis=1), np.ones(64))


WHOLE = ("dim t = 64 / 16\ndim v = 300 / 64\ndim e = 32\ninput IDS[t], N[t] : i32\n"
         "input E[v, e] : f16\n"
         "X[t, e] = sum[v] where(IDS[t] == v, 1, 0) * E[v, e] * N[t]\noutput X\n")


@pytest.mark.parametrize("lowered", [False, True], ids=["program", "block program"])
def test_inputs_declared_i32_are_drawn_whole(lowered):
    """An i32 input is whole whatever reads it: below the extent it indexes, else below
    `WHOLE_DRAWN`; the outputs are stored as the first input of real numbers is (f16)."""
    ast = parse_program(WHOLE)
    p = lower(ast) if lowered else ast
    assert p.tensors["X"].dtype == "f16"
    inputs = random_inputs(p, seed=2)
    for name, below in (("IDS", 300), ("N", WHOLE_DRAWN)):
        x = inputs[name]
        assert x.dtype == np.float32 and np.array_equal(x, np.round(x))
        assert x.min() >= 0 and x.max() < below and len(np.unique(x)) > 16


@pytest.mark.parametrize("run", [interp.run, numpy_gen.run], ids=["interp", "numpy"])
def test_i32_inputs_take_integers_and_refuse_what_f32_would_round(run):
    """Integer arrays are taken as they are; a fraction, an infinity, a NaN and a magnitude
    past 2^24 (16777217 would be read as 16777216, another id) are refused, naming the
    element."""
    p = lower(parse_program(WHOLE))
    inputs = random_inputs(p, seed=2)
    ids = inputs["IDS"].astype(np.int64)
    got = run(p, {**inputs, "IDS": ids})["X"]
    assert np.array_equal(got, run(p, inputs)["X"])
    for bad, shown in ((0.5, "0.5"), (np.inf, "inf"), (np.nan, "nan"),
                       (2 ** 24 + 1, "16777217"), (-2.0 ** 25, "-33554432.0")):
        given = ids.astype(type(bad)) if isinstance(bad, int) else ids.astype(np.float64)
        given[7] = bad
        with pytest.raises(ValueError, match=rf"input 'IDS' is declared i32 but holds "
                                             rf"{re.escape(shown)} at \[7\]"):
            run(p, {**inputs, "IDS": given})
