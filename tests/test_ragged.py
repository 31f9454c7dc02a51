"""Extents that a block does not divide: the last block is ragged.  Global memory holds whole
blocks (the padding of inputs is zero), lowering masks every reduction over a ragged axis with
its identity past the extent, and every backend returns tensors at their extents."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.codegen import numpy_gen
from bbrules.codegen.cuda_gen import generate
from bbrules.cost import cost_program
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import BlockProgram, IRError, Kernel, validate
from bbrules.lower import lower
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.targets import get_target

from cuda_emu import emulate

EXAMPLE = Path(__file__).parent.parent / "examples" / "lm_head_cross_entropy.bbp"
H100 = get_target("h100")
# every axis ragged: 3 blocks of 16 for 40 tokens, 4 of 32 for a vocabulary of 100, ...
SMALL = {"t": (40, 16), "e": (24, 16), "v": (100, 32)}


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


def test_the_cross_entropy_of_a_ragged_vocabulary_in_every_backend(pack):
    ast = load_program(EXAMPLE, SMALL)
    inputs = random_inputs(ast, seed=4)
    h, w = (inputs[n].astype(np.float64) for n in "HW")
    z = h @ w
    m = z.max(axis=1)
    ce = m + np.log(np.exp(z - m[:, None]).sum(axis=1)) - (inputs["Y"] * z).sum(axis=1)
    want = ce.mean()
    assert dense.evaluate(ast, inputs, np.float64)["LOSS"] == pytest.approx(want, rel=1e-12)
    for p in (lower(ast), fuse(lower(ast), pack, H100).program):
        for run in (interp.run, numpy_gen.run, lambda q, x: emulate(generate(q), x)):
            got = run(p, inputs)
            assert got["LOSS"].shape == () and got["LOSS"] == pytest.approx(want, rel=1e-5)


def test_temporaries_come_back_at_their_extents(pack):
    ast = parse_program("dim r = 10 / 4\ndim c = 7 / 4\ninput X[r, c] : f32\n"
                        "Y[r, c] = exp(X[r, c] - max[c] X[r, c])\noutput Y\n")
    x = random_inputs(ast, seed=1)
    want = dense.evaluate(ast, x, np.float64)["Y"]
    for run in (interp.run, numpy_gen.run, lambda q, i: emulate(generate(q), i)):
        got = run(lower(ast), x)["Y"]
        assert got.shape == (10, 7)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_logits_are_stored_only_where_that_reads_less(pack):
    # At the program's blocks, the LM head runs inside the cross-entropy: the logits are
    # never stored.
    fixed = fuse(lower(load_program(EXAMPLE)), pack, H100, options=Options(reblock=False))
    assert "Z" not in fixed.program.tensors and len(fixed.program.kernels) == 2
    assert fixed.after.traffic < fixed.before.traffic
    assert fixed.after.time < fixed.before.time
    # With blocks chosen per kernel, the fused kernel fits tokens in blocks of 128 at most
    # (beside its tiles of logits and of the one-hot targets, over the ragged vocabulary's
    # blocks of 128), so it reads W 128 times; the LM head alone fits blocks of 256 and
    # reads it 64 times, which saves more than storing the logits and reading them back.
    r = fuse(lower(load_program(EXAMPLE)), pack, H100)
    assert r.after.traffic < fixed.after.traffic and r.after.time < fixed.after.time
    ce = fixed.program.kernels[0]
    for tokens in (128, 256):
        tiled = replace(fixed.program, kernels=(replace(ce, blocks=(("t", tokens),)),
                                                *fixed.program.kernels[1:]))
        cost = cost_program(tiled, H100)
        assert not cost.legal or cost.time > r.after.time
    (head,) = [k for k in r.program.kernels if k.tensors == ("Z",)]
    assert r.program.in_kernel(head).block("t") == 256


def test_the_full_vocabulary_in_blocks_of_128_fused_with_targets_in_the_ragged_block(pack):
    """50,257 words in blocks of 128 (393 blocks, the last holding 81 words), 256 tokens of
    width 64: fused into one kernel that never stores the logits, with half of the tokens'
    targets among the last block's words, the loss is a float64 reference's (the 47 padding
    columns must add nothing to the sums of exponentials nor to the maxima)."""
    ast = load_program(EXAMPLE, {"t": (256, 64), "e": (64, 64)})
    r = fuse(lower(ast), pack, H100, objective="traffic")
    assert len(r.program.kernels) == 1 and "Z" not in r.program.tensors
    inputs = random_inputs(ast, seed=6)
    rng = np.random.default_rng(6)
    targets = np.where(np.arange(256) % 2 == 0, rng.integers(50176, 50257, 256),
                       rng.integers(0, 50176, 256))
    inputs["Y"] = np.zeros((256, 50257), np.float32)
    inputs["Y"][np.arange(256), targets] = 1.0
    z = inputs["H"].astype(np.float64) @ inputs["W"].astype(np.float64)
    m = z.max(axis=1)
    ce = m + np.log(np.exp(z - m[:, None]).sum(axis=1)) - z[np.arange(256), targets]
    assert numpy_gen.run(r.program, inputs)["LOSS"] == pytest.approx(ce.mean(), rel=1e-5)


def test_a_ragged_axis_keeps_the_programs_blocks():
    p = lower(parse_program("dim r = 10 / 4\ninput X[r] : f32\nY[r] = X[r] * 2\noutput Y\n"))
    (k,) = p.kernels
    finer = BlockProgram(p.dims, p.tensors, (Kernel(k.grid, k.stores, (("r", 2),)),), p.outputs)
    with pytest.raises(IRError, match="ragged axis keeps the program's blocks"):
        validate(finer)
    assert cost_program(p, H100).kernels[0].bytes_read == 12 * 4  # three whole blocks of X
