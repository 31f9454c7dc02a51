"""ONNX's own backend test cases run through bbrules: import -> (fuse) -> a backend -> compare.

The cases come from the generators the `onnx` package ships (`onnx/backend/test/case/node`):
each builds a one-operator model (and, for operators defined as ONNX functions, an `_expanded`
model of the function body) with inputs and expected outputs computed by numpy reference code.
Shape-like integer inputs (a Reshape's shape, a ReduceSum's axes) are made initializers, since
bbrules compiles for static shapes.  `benchmarks/onnx_conformance.py` reports every operator;
the test suite runs a fixed subset.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import SourceError, UsageError
from .frontend import parse_program
from .ir import BlockProgram
from .lower import lower
from .onnx_import import Importer


@dataclass(frozen=True)
class Outcome:
    """`passed`, `failed` (wrong numbers or a crash) or `unsupported` (a clear refusal)."""

    case: str
    status: str
    detail: str = ""


def backend_cases(ops: list[str]) -> list:
    """The backend test cases (onnx's `TestCase`) of operators `ops`.  Importing a generator
    module runs its exports (onnx registers them as the classes are created), which add the
    cases to onnx's list: the new entries are this operator's."""
    from onnx.backend.test.case import node as cases
    found = []
    for op in ops:
        if op not in _CASES:
            before = len(cases._NodeTestCases)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(f"onnx.backend.test.case.node.{_module(op)}")
            _CASES[op] = [c for c in cases._NodeTestCases[before:] if c.model is not None]
        found += _CASES[op]
    return found


_CASES: dict[str, list] = {}  # by operator: a generator module runs once per process


def _module(op: str) -> str:
    """The generator module of operator `op`: its name in lower case (`layernormalization`),
    or in snake case where the lower case names none (`instance_normalization`)."""
    lower = op.lower()
    if importlib.util.find_spec(f"onnx.backend.test.case.node.{lower}") is not None:
        return lower
    return re.sub(r"(?<!^)(?=[A-Z])", "_", op).lower()


def _numpy(x) -> np.ndarray:
    """A case's data: numpy already, or (for some element types) a TensorProto."""
    from onnx import TensorProto, numpy_helper
    return numpy_helper.to_array(x) if isinstance(x, TensorProto) else np.asarray(x)


def _static(case) -> tuple[object, dict[str, np.ndarray]]:
    """The case's model with 64-bit integer inputs made initializers (and inputs declared
    without a shape given their data's), and its other inputs."""
    from onnx import numpy_helper
    model = type(case.model)()
    model.CopyFrom(case.model)
    known = {t.name for t in model.graph.initializer}
    inputs, arrays = [i for i in model.graph.input if i.name not in known], {}
    for info, value in zip(inputs, map(_numpy, case.data_sets[0][0])):
        dims = info.type.tensor_type.shape.dim
        if isinstance(value, np.ndarray) and len(dims) != value.ndim:
            del dims[:]  # an input declared without its shape takes the case's
            for n in value.shape:
                dims.add().dim_value = n
        if isinstance(value, np.ndarray) and value.dtype == np.int64:
            model.graph.initializer.append(numpy_helper.from_array(value, info.name))
        else:
            arrays[info.name] = value
    return model, arrays


def run_case(case, compile_and_run: Callable[[BlockProgram, dict[str, np.ndarray]],
                                                 dict[str, np.ndarray]]) -> Outcome:
    """Import the case's model, run it with `compile_and_run` (block program, inputs ->
    outputs), compare with the expected outputs at a tolerance for the inputs' precision.
    The cases' shapes are tiny: each dimension is one block."""
    model, arrays = _static(case)
    try:
        imported = Importer(model, case.name, {}, block=lambda extent: extent).run()
        program = lower(parse_program(imported.text, case.name))
        inputs = imported.bbp_inputs(arrays)
    except (UsageError, SourceError) as err:
        return Outcome(case.name, "unsupported", str(err).splitlines()[0])
    try:
        got = imported.onnx_outputs(compile_and_run(program, inputs))
    except Exception as err:  # a crash is a failure, reported with its type
        return Outcome(case.name, "failed", f"{type(err).__name__}: {err}")
    for info, want in zip(model.graph.output, case.data_sets[0][1]):
        low = info.type.tensor_type.elem_type in (10, 16) or \
            any(a.dtype.itemsize <= 2 and a.dtype.kind not in "iub" for a in arrays.values())
        tol = 1e-2 if low else 1e-4  # f16 or bf16 results or inputs: their precision
        have, want = got[info.name], _numpy(want).astype(np.float64)
        if have.shape != want.shape:
            return Outcome(case.name, "failed", f"{info.name}: shape {list(have.shape)}, "
                                                f"expected {list(want.shape)}")
        if not np.allclose(have, want, rtol=tol, atol=tol, equal_nan=True):
            worst = float(np.nanmax(np.abs(have - want)))
            return Outcome(case.name, "failed", f"{info.name}: off by up to {worst:.3g}")
    return Outcome(case.name, "passed")
