"""Deterministic random inputs for a program: what tests, `bbrules run` and `check` feed it."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .ir import Dim, TensorDecl


class HasTensors(Protocol):
    """A `Program` or a `BlockProgram`: both declare dims and tensors."""

    dims: dict[str, Dim]
    tensors: dict[str, TensorDecl]


def random_inputs(p: HasTensors, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal float32 arrays for every input tensor, the same for the same seed.

    Each tensor draws from its own stream (seeded by the seed and the tensor's position), so
    adding an input to a program does not change the values of the ones before it.
    """
    out = {}
    inputs = [t for t in p.tensors.values() if t.role == "input"]
    for i, t in enumerate(inputs):
        rng = np.random.default_rng([seed, i])
        out[t.name] = rng.standard_normal([p.dims[a].extent for a in t.axes], dtype=np.float32)
    return out
