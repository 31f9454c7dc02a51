"""Block sizes chosen per kernel: a kernel may tile an axis its own way (`Kernel.blocks`),
extraction picks finer blocks where a grid leaves processors idle, and every backend and the
cost model honour them."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.blockfile import parse_block_program
from bbrules.codegen import cuda_gen, numpy_gen
from bbrules.cost import cost_program
from bbrules.errors import SourceError
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import Const, IRError, Reduce, postorder, show_program, validate
from bbrules.lower import lower
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.plan import block_bound_axes
from bbrules.refold import refolded
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


def every_backend(threads: int = 32) -> list:
    """The interpreter, the numpy backend and, where g++ can build it, the CUDA emulator."""
    runs = [interp.run, numpy_gen.run]
    if shutil.which("g++"):
        runs.append(lambda q, inputs: emulate(cuda_gen.generate(q), inputs, threads=threads))
    return runs


def assert_computes_a_times_b(p, m: int, k: int, n: int, seed: int) -> None:
    """Every backend computes C = A @ B of `p` as float64 does."""
    rng = np.random.default_rng(seed)
    inputs = {"A": rng.standard_normal((m, k), dtype=np.float32),
              "B": rng.standard_normal((k, n), dtype=np.float32)}
    want = inputs["A"].astype(np.float64) @ inputs["B"].astype(np.float64)
    for run in every_backend(threads=64):
        np.testing.assert_allclose(run(p, inputs)["C"], want, rtol=1e-4, atol=1e-3)


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
    for run in every_backend():
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


MATMUL = """
dim m = 2048 / 64
dim k = 128 / 64
dim n = 1024 / 64
input A[m, k], B[k, n] : f32
C[m, n] = sum[k] A[m, k] * B[k, n]
output C
"""


def test_a_matmul_takes_coarser_output_blocks_where_they_read_less(pack):
    # In 64 x 64 output blocks, A is read once per 64 columns of C and B once per 64 rows;
    # the fused matmul is memory-bound on h100, so blocks twice as large on an axis read
    # the other operand half as often and are faster.
    p = lower(parse_program(MATMUL))
    r = fuse(p, pack, H100)
    (kernel,) = r.program.kernels
    blocks = dict(kernel.blocks)
    assert blocks and all(b > 64 for b in blocks.values())
    assert kernel.grid == ("m", "n") and r.after.legal
    fixed = fuse(p, pack, H100, options=Options(reblock=False))
    assert fixed.program.kernels[0].blocks == ()
    assert r.after.bytes_read < fixed.after.bytes_read and r.after.time < fixed.after.time
    # The cost model's reads at the chosen blocks: A once per block of n, B once per block
    # of m.
    q = r.program.in_kernel(kernel)
    assert r.after.bytes_read == (q.blocks("n") * 2048 * 128 + q.blocks("m") * 128 * 1024) * F32
    assert_computes_a_times_b(r.program, 2048, 128, 1024, seed=0)


def test_coarser_blocks_stop_where_the_tiles_no_longer_fit(pack):
    # By traffic alone coarser blocks always pay: they grow until local memory is full.
    r = fuse(lower(parse_program(MATMUL)), pack, H100, objective="traffic")
    (kernel,) = r.program.kernels
    assert r.after.legal and r.after.footprint <= H100.local_capacity
    q = r.program.in_kernel(kernel)
    for axis in kernel.grid:
        if q.block(axis) < q.extent(axis):
            coarser = replace(kernel, blocks=tuple({**dict(kernel.blocks),
                                                    axis: 2 * q.block(axis)}.items()))
            assert not cost_program(replace(r.program, kernels=(coarser,)), H100).legal


def test_a_kernel_s_own_loop_blocks_run_alike_in_every_backend():
    p = lower(parse_program(MATMUL.replace("2048 / 64", "64 / 16").replace("128 / 64", "64 / 32")
                            .replace("1024 / 64", "64 / 16")))
    (kernel,) = p.kernels
    p = replace(p, kernels=(replace(kernel, blocks=(("m", 32), ("k", 16))),))
    validate(p)
    # The cost model and the CUDA kernel both tile k by 16, not the program's 32.
    footprint = cost_program(p, H100).kernels[0].footprint
    assert cuda_gen.generate(p).kernels[0].shared_bytes == footprint
    default = replace(p, kernels=(replace(p.kernels[0], blocks=(("m", 32),)),))
    assert footprint < cost_program(default, H100).kernels[0].footprint
    assert_computes_a_times_b(p, 64, 64, 64, seed=1)


def test_a_fold_takes_coarser_loop_blocks_where_the_kernel_then_works_less(pack):
    # Flash attention rescales its running output tile once per key block.  On the cpu
    # target that vector work is a visible share of the kernel, so key blocks larger than
    # the program's 64 are faster, for the same traffic, as long as the tiles fit.
    cpu = get_target("cpu")
    p = lower(load_program(EXAMPLES / "attention.bbp"))
    r = fuse(p, pack, cpu)
    (kernel,) = r.program.kernels  # the scores are never stored
    q = r.program.in_kernel(kernel)
    assert q.block("k") > p.block("k") and r.after.legal
    declared = replace(kernel, blocks=tuple((a, b) for a, b in kernel.blocks if a != "k"))
    at_declared = cost_program(replace(r.program, kernels=(declared,)), cpu)
    assert at_declared.traffic == r.after.traffic and at_declared.time > r.after.time
    # One more doubling of the key block is slower or no longer fits.
    coarser = replace(kernel, blocks=tuple({**dict(kernel.blocks), "k": 2 * q.block("k")}
                                           .items()))
    assert not cost_program(replace(r.program, kernels=(coarser,)), cpu).time < r.after.time
    rng = np.random.default_rng(2)
    inputs = {n: rng.standard_normal((4096, 64), dtype=np.float32) for n in "QKV"}
    s = inputs["Q"].astype(np.float64) @ inputs["K"].astype(np.float64).T * 0.125
    e = np.exp(s - s.max(axis=1, keepdims=True))
    want = e / e.sum(axis=1, keepdims=True) @ inputs["V"].astype(np.float64)
    np.testing.assert_allclose(numpy_gen.run(r.program, inputs)["O"], want, rtol=1e-4,
                               atol=1e-5)


LAYERNORM_MATMUL = ("dim m = 128 / 64\ndim e = 256 / 64\ndim n = 256 / 64\n"
                    "input X[m, e], W[e, n] : f32\n"
                    "MU[m] = mean[e] X[m, e]\n"
                    "VAR[m] = mean[e] square(X[m, e] - MU[m])\n"
                    "XN[m, e] = (X[m, e] - MU[m]) * rsqrt(VAR[m] + 1e-5)\n"
                    "Y[m, n] = sum[e] XN[m, e] * W[e, n]\noutput Y\n")


def counted_folds(p) -> list:
    """The kernels of `p` folding Welford or co-moment states, which count their blocks."""
    return [k for k in p.kernels if any(
        isinstance(x, Reduce) and x.monoid.name in ("welford", "comoment")
        for s in k.stores for x in postorder(s.value))]


def test_a_welford_fold_walks_coarser_blocks_written_for_them(pack):
    """A LayerNorm's statistics as a Welford fold: each block's state is `tuple(64.0,
    bsum(e, x) * 0.015625, ...)`, a block of 64's count and mean.  On the cpu target coarser
    loop blocks are faster; walked in blocks of 256 with the state as written for 64, the fold
    counted 64 elements for each 256 (a GPT-2 block exported from torch: its output off by
    half its scale).  The fold is now written again for the blocks it walks: its count is
    its kernel's block."""
    ast = parse_program(LAYERNORM_MATMUL)
    r = fuse(lower(ast), pack, get_target("cpu"), "traffic")
    counted = counted_folds(r.program)
    assert counted, show_program(r.program)
    for k in counted:
        block = r.program.in_kernel(k).block("e")
        counts = {x.x.items[0] for s in k.stores for x in postorder(s.value)
                  if isinstance(x, Reduce) and x.monoid.name in ("welford", "comoment")}
        assert block > 64 and counts == {Const(float(block))}, show_program(r.program)
    inputs = random_inputs(ast, seed=4)
    want = dense.evaluate(ast, inputs, dtype=np.float64)["Y"]
    for run in (interp.run, numpy_gen.run):  # (its tiles fit the cpu's memory, not a GPU's)
        np.testing.assert_allclose(run(r.program, inputs)["Y"], want, rtol=1e-4, atol=1e-4)


def test_a_fold_no_rule_wrote_for_its_blocks_keeps_them():
    """A fold whose contribution holds its block's size by no standard rule's instance (here
    a hand-written one: the sum of each block's mean) cannot be written for other blocks."""
    p = parse_block_program("dim m = 64 / 64\ndim e = 256 / 64\ninput X[m, e] : f32\n"
                            "output S[m] : f32\n"
                            "kernel [m]:\n"
                            "  S[m] = reduce(e, sum, bsum(e, load(X[m, e])) * 0.015625)\n"
                            ).program
    (k,) = p.kernels
    assert block_bound_axes(p, k) == {"e"}
    assert refolded(p, k, "e", 128) is None
    assert refolded(p, k, "e", 256) is None


@pytest.mark.parametrize("block", [128, 256])
def test_a_welford_fold_written_again_computes_the_same_statistics(pack, block):
    """`refolded` of each fused kernel with a Welford or co-moment fold over e, at a coarser
    block, against float64: the fold's count, mean and the co-moment's centring are the new
    block's."""
    ast = parse_program(LAYERNORM_MATMUL)
    r = fuse(lower(ast), pack, get_target("h100"), "traffic", options=Options(reblock=False))
    counted = counted_folds(r.program)
    assert counted and all(r.program.in_kernel(k).block("e") == 64 for k in counted)
    kernels = tuple(refolded(r.program, k, "e", block) if k in counted else k
                    for k in r.program.kernels)
    assert None not in kernels
    q = replace(r.program, kernels=kernels)
    validate(q)
    for k in counted_folds(q):
        assert q.in_kernel(k).block("e") == block
    inputs = random_inputs(ast, seed=5)
    want = dense.evaluate(ast, inputs, dtype=np.float64)["Y"]
    for run in every_backend():
        np.testing.assert_allclose(run(q, inputs)["Y"], want, rtol=1e-4, atol=1e-4)
