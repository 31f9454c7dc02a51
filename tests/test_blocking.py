"""Block sizes chosen per kernel: a kernel may tile an axis its own way (`Kernel.blocks`),
extraction picks finer blocks where a grid leaves processors idle, and every backend and the
cost model honour them."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bbrules import interp
from bbrules.blockfile import parse_block_program
from bbrules.codegen import cuda_gen, numpy_gen
from bbrules.cost import cost_program
from bbrules.errors import SourceError
from bbrules.frontend import load_program
from bbrules.fuse import fuse
from bbrules.ir import IRError, show_program, validate
from bbrules.lower import lower
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.targets import get_target
from cuda_emu import emulate

EXAMPLES = Path(__file__).parent.parent / "examples"
H100 = get_target("h100")
F32 = 4

SOFTMAX_BBK = """
dim r = 64 / 32
dim c = 512 / 128
input X[r, c] : f32
output Y[r, c] : f32
monoid online(m, s)
  identity = (-inf, 0.0)
  combine  = (max(a.m, b.m), a.s * exp(a.m - max(a.m, b.m)) + b.s * exp(b.m - max(a.m, b.m)))
  finalize = (s)

kernel [r] with r / 16, c / 64:
  let t0 = bmax(c, load(X[r, c]))
  Y[r, c] = exp(load(X[r, c]) - reduce(c, max, t0)) / reduce(c, online, tuple(t0, bsum(c, exp(load(X[r, c]) - t0))))
"""


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


def softmax_reference(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_the_softmax_example_is_one_kernel_reading_x_twice(pack):
    r = fuse(lower(load_program(EXAMPLES / "softmax.bbp")), pack, H100)
    (kernel,) = r.program.kernels
    assert kernel.grid == ("r",) and kernel.tensors == ("Y",)
    assert dict(kernel.blocks)["r"] < r.program.dims["r"].block  # finer than the default 64
    assert set(r.program.tensors) == {"X", "Y"}  # no statistic stored
    x_bytes = 4096 * 4096 * F32
    assert r.after.bytes_read == 2 * x_bytes  # statistics pass, then normalise pass
    assert r.after.flops < 2 * r.before.flops  # no statistic recomputed per output block
    whole = fuse(lower(load_program(EXAMPLES / "softmax.bbp")), pack, H100,
                 options=Options(reblock=False))
    assert len(whole.program.kernels) == 2 and r.after.time < whole.after.time


def test_a_kernel_s_own_blocks_round_trip_and_run_alike_in_every_backend():
    p = parse_block_program(SOFTMAX_BBK).program
    (kernel,) = p.kernels
    assert kernel.blocks == (("r", 16), ("c", 64))
    assert "kernel [r] with r / 16, c / 64:" in show_program(p)
    assert parse_block_program(show_program(p)).program.kernels == p.kernels
    x = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)
    want = softmax_reference(x)
    runs = [interp.run, numpy_gen.run]
    if shutil.which("g++"):
        runs.append(lambda q, inputs: emulate(cuda_gen.generate(q), inputs, threads=32))
    for run in runs:
        np.testing.assert_allclose(run(p, {"X": x})["Y"], want, rtol=1e-5, atol=1e-7)


def test_the_cost_model_and_the_cuda_kernel_use_the_kernel_s_blocks():
    p = parse_block_program(SOFTMAX_BBK).program
    c = cost_program(p, H100).kernels[0]
    assert c.grid_points == 64 // 16
    assert c.bytes_read == 2 * 64 * 512 * F32  # two passes over X, 64-column tiles
    module = cuda_gen.generate(p)
    assert module.kernels[0].grid == 4 and module.kernels[0].shared_bytes == c.footprint
    default = replace(p, kernels=(replace(p.kernels[0], blocks=()),))
    assert cost_program(default, H100).kernels[0].grid_points == 64 // 32
    assert c.footprint < cost_program(default, H100).kernels[0].footprint


@pytest.mark.parametrize("header, message", [
    ("with r / 24", "block size 24 does not divide the extent 64"),
    ("with z / 16", "unknown axis 'z'"),
])
def test_a_bad_block_size_is_reported_at_its_place(header, message):
    text = SOFTMAX_BBK.replace("with r / 16, c / 64", header)
    with pytest.raises(SourceError, match=message) as e:
        parse_block_program(text)
    assert e.value.span.line == text[:text.index(header)].count("\n") + 1


def test_validate_refuses_blocks_that_do_not_divide():
    p = parse_block_program(SOFTMAX_BBK).program
    bad = replace(p, kernels=(replace(p.kernels[0], blocks=(("r", 24),)),))
    with pytest.raises(IRError, match="does not divide"):
        validate(bad)


def test_finer_blocks_never_go_below_the_target_granularity(pack):
    r = fuse(lower(load_program(EXAMPLES / "softmax.bbp")), pack,
             replace(H100, block_granularity=32))
    for kernel in r.program.kernels:
        assert all(b >= 32 for _, b in kernel.blocks)

