"""The numpy backend on several threads: kernels split into parts along a grid axis.

Threaded runs are checked against the same program run whole (threads=1) and against the
float64 dense evaluation or the reference interpreter, on programs that exercise what a part
must get right: Flash Attention (a fold over keys), causal attention (positions of the split
axis and key blocks skipped by a predicate), a ragged split axis, kernels of several stores
with map loops, split folds over views (decode attention), and random programs.  These
programs are small, so the thresholds are lowered to let them split (`split_small`, in
conftest.py).
"""

from __future__ import annotations

import os
import re
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from bbrules import dense, interp
from bbrules.blockfile import load_block_program, parse_block_program
from bbrules.codegen import numpy_gen, numpy_plan, numpy_runtime
from bbrules.cost import cost_kernel
from bbrules.errors import UsageError
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import BlockProgram, Const, Get, Load, Pos, Store, Unary
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

from irbuild import add, attention_reference, mul, program, rand, sub, welford_stats
from strategies import programs
from test_numpy_backend import assert_close, flash

EXAMPLES = Path(__file__).parent.parent / "examples"
MULTI = sorted((Path(__file__).parent / "programs" / "multi").glob("*.bbk"))
H100 = get_target("h100")


def parts_in(source: str) -> int:
    """How many parts the generated run() starts, over all kernels."""
    return sum(len(re.findall(r"\(kernel_\w+, \d+\)", line))
               for line in source.splitlines() if "run_parts(" in line)


def assert_threads_agree(p: BlockProgram, inputs: dict[str, np.ndarray],
                         threads: tuple[int, ...] = (2, 3)) -> dict[str, np.ndarray]:
    """Every stored tensor on each thread count within float rounding of the whole run (BLAS
    may block a part's smaller matmul differently); returns the whole run's outputs."""
    whole = numpy_gen.run(p, inputs, threads=1)
    for n in threads:
        assert parts_in(numpy_gen.generate(p, threads=n)) >= 2, f"{n} threads: nothing split"
        got = numpy_gen.run(p, inputs, threads=n)
        assert set(got) == set(whole)
        for name, want in whole.items():
            assert got[name].dtype == np.float32 and got[name].shape == want.shape
            scale = max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0.0)))
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6 * scale,
                                       err_msg=f"{name} on {n} threads")
    return whole


@pytest.mark.usefixtures("split_small")
@pytest.mark.parametrize("n, d, bq, bk", [(64, 8, 8, 16), (96, 16, 16, 32)])
def test_flash_attention_on_threads_matches_whole_and_numpy(n, d, bq, bk):
    p = flash(n, d, bq, bk)
    inputs = {"Q": rand(n, d, seed=1), "K": rand(n, d, seed=2), "V": rand(n, d, seed=3)}
    whole = assert_threads_agree(p, inputs)
    assert_close(whole["O"], attention_reference(inputs["Q"], inputs["K"], inputs["V"]),
                 "vs numpy")


def test_fused_causal_attention_on_threads(monkeypatch, walked_folds):
    """The mask reads the positions of the split query axis: each part must see its own.  The
    cost model counts the flops of a kernel that skips masked blocks as a fraction, which must
    still make a whole number of parts (here fewer than the grid's 4 query blocks).  The key
    loop is walked in its blocks, as over longer sequences."""
    ast = load_program(EXAMPLES / "causal_attention.bbp",
                       dims={"h": (2, 1), "q": (64, 16), "k": (64, 16), "d": (16, 16)})
    p = fuse(lower(ast), load_packs([]), H100).program
    monkeypatch.setattr(numpy_plan, "MIN_CALL_FLOPS", 1500)
    monkeypatch.setattr(numpy_plan, "PARTS_START_NS", 0)
    assert numpy_plan.split_kernel(p, p.kernels[0], 2, H100) == ("q", [(0, 2), (2, 1), (3, 1)])
    # each part visits the key blocks its own query blocks reach: 2, then 3 or 4 of 4; those
    # below its first query are a loop of their own, without the mask
    code = numpy_gen.generate(p, threads=2)
    loops = [line.strip() for line in code.splitlines() if line.strip().startswith("for k0 in")]
    assert loops == ["for k0 in range(0, 32, 16):",
                     "for k0 in {32: range(0, 32, 16), 48: range(0, 48, 16)}[q_start]:",
                     "for k0 in {32: range(32, 48, 16), 48: range(48, 64, 16)}[q_start]:"]
    second = code[code.index(loops[1]):code.index(loops[2])]
    assert "elementwise_le" not in second and "elementwise_le" in code[code.index(loops[2]):]
    # the parts that visit most key blocks start first (4, 3, then 2 blocks): in query order,
    # the heaviest part would start last and run alone
    assert re.search(r"run_parts\(\[\(kernel_O_q1, 48\), \(kernel_O_q1, 32\), "
                     r"\(kernel_O_q2, 0\)\]", code)
    inputs = random_inputs(ast, seed=4)
    whole = assert_threads_agree(p, inputs)
    want = dense.evaluate(ast, inputs, dtype=np.float64)
    for name in whole:
        assert_close(whole[name], want[name], f"{name} vs dense")


@pytest.mark.usefixtures("split_small")
def test_a_ragged_split_axis():
    """Parts of a padded axis: the last part holds the ragged block, outputs are unpadded."""
    ast = parse_program("dim r = 50 / 8\ndim c = 40 / 16\ninput X[r, c] : f32\n"
                        "M[r] = max[c] X[r, c]\nE[r, c] = exp(X[r, c] - M[r])\n"
                        "Y[r, c] = E[r, c] / sum[c] E[r, c]\noutput Y\n")
    p = fuse(lower(ast), load_packs([]), H100).program
    inputs = random_inputs(ast, seed=5)
    whole = assert_threads_agree(p, inputs, threads=(2, 4))
    assert whole["Y"].shape == (50, 40)
    assert_close(whole["Y"], dense.evaluate(ast, inputs, dtype=np.float64)["Y"], "vs dense")


@pytest.mark.usefixtures("split_small")
def test_the_split_axis_also_folded_over():
    """Grid (m, e) with statistics folded over all of e, and m one block: split along e (each
    part repeats the statistics), each part's loop still walks every block of e, and its
    stores cover only its own."""
    x = Load("X", ("m", "e"))
    stats = welford_stats(x, "e", 4)
    y = mul(sub(x, Get(0, stats)), Unary("rsqrt", add(Get(1, stats), Const(1e-5))))
    p = program({"m": (12, 12), "e": (24, 4)}, {"X": ("m", "e")}, [Store("Y", ("m", "e"), y)])
    assert numpy_plan.split_kernel(p, p.kernels[0], 2, H100)[0] == "e"
    inputs = {"X": rand(12, 24, seed=5, loc=3.0)}
    whole = assert_threads_agree(p, inputs)
    x64 = inputs["X"].astype(np.float64)
    want = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    assert_close(whole["Y"], want, "vs numpy")


@pytest.mark.usefixtures("split_small")
def test_a_kernel_of_positions_alone():
    """No input at all: the part's positions are all it has to go by."""
    y = add(mul(Pos("i"), Const(100.0)), Pos("j"))
    p = program({"i": (20, 4), "j": (6, 3)}, {}, [Store("Y", ("i", "j"), y)])
    whole = assert_threads_agree(p, {})
    np.testing.assert_array_equal(whole["Y"], np.add.outer(np.arange(20) * 100.0, np.arange(6)))


@pytest.mark.usefixtures("split_small")
@pytest.mark.parametrize("path", MULTI, ids=[p.stem for p in MULTI])
def test_multi_store_programs_on_threads(path):
    """Several stores per kernel, map loops writing block by block into the caller's arrays;
    `one_processor` has no grid, so it runs whole."""
    p = load_block_program(path).program
    inputs = random_inputs(p, seed=0)
    if all(not k.grid for k in p.kernels):
        assert parts_in(numpy_gen.generate(p, threads=2)) == 0
        return
    whole = assert_threads_agree(p, inputs)
    ref = interp.run(p, inputs)
    for name in ref:
        np.testing.assert_allclose(whole[name], ref[name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.usefixtures("split_small")
def test_a_map_loop_over_the_leading_axis_with_the_grid_split():
    """The grid is the store's last axis: each part writes its columns of every row block."""
    p = parse_block_program(
        "dim i = 24 / 8\ndim j = 64 / 16\n"
        "input a[i, j] : f32\noutput c[i, j] : f32\noutput s[j] : f32\n"
        "kernel [j]:\n"
        "  c[i, j] = exp(load(a[i, j]))\n"
        "  s[j] = reduce(i, sum, bsum(i, load(a[i, j])))\n").program
    inputs = random_inputs(p, seed=2)
    source = numpy_gen.generate(p, threads=2)
    assert "c[i0:i0 + 8, j_start:j_start + 16] = " in source
    whole = assert_threads_agree(p, inputs)
    np.testing.assert_allclose(whole["c"], np.exp(inputs["a"]), rtol=1e-6)
    np.testing.assert_allclose(whole["s"], inputs["a"].sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("split_small")
def test_split_folds_over_views_on_threads():
    """Decode attention split over keys: chunks read through views, a second kernel combines
    the chunks' states; both kernels split."""
    ast = load_program(EXAMPLES / "decode_attention.bbp", {"h": (4, 1), "k": (1024, 64)})
    p = fuse(lower(ast), load_packs([]), H100).program
    assert len(p.kernels) == 2
    inputs = random_inputs(ast, seed=1)
    whole = assert_threads_agree(p, inputs)
    np.testing.assert_allclose(whole["O"], dense.evaluate(ast, inputs)["O"], rtol=1e-5,
                               atol=1e-6)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(programs())
def test_random_programs_on_threads(split_small, source):
    ast = parse_program(source, "<random>")
    block = lower(ast)
    inputs = random_inputs(ast, seed=0)
    got = numpy_gen.run(block, inputs, threads=3)
    want = dense.evaluate(ast, inputs, dtype=np.float64)
    for name, g in got.items():
        assert_close(g, want[name], f"{name} vs dense in\n{source}")


# --------------------------------------------------------------------------------------------
# When to split, and the runtime of parts.


def test_parts_cover_the_axis_in_near_equal_runs(split_small):
    p = flash(80, 8, 8, 16)  # 10 query blocks
    (k,) = p.kernels
    axis, runs = numpy_plan.split_kernel(p, k, 2, H100)  # PARTS_PER_THREAD parts per thread
    assert axis == "q" and runs == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert numpy_plan.split_kernel(p, k, 16, H100)[1] == [(i, 1) for i in range(10)]
    source = numpy_gen.generate(p, threads=2)
    assert "def kernel_O_q3(" in source and "def kernel_O_q2(" in source  # one per length
    assert ("run_parts([(kernel_O_q3, 0), (kernel_O_q3, 24), (kernel_O_q2, 48), "
            "(kernel_O_q2, 64)], 2, Q, K, V, O)") in source


@pytest.mark.usefixtures("split_small")
def test_parts_that_would_leave_a_thread_idle_take_finer_blocks():
    """Three column blocks on two threads: one thread would compute the third alone while the
    other waits.  In blocks half as large, each thread computes half the columns (2 + 1
    blocks each); on three threads, one block each, the blocks stay."""
    ast = parse_program("dim m = 64 / 64\ndim n = 192 / 64\ndim k = 32\n"
                        "input X[m, k], W[k, n] : f32\n"
                        "Y[m, n] = sum[k] X[m, k] * W[k, n]\noutput Y\n")
    p = lower(ast)
    (k,) = p.kernels
    assert numpy_plan.split_kernel(p, k, 2, H100) == ("n", [(0, 1), (1, 1), (2, 1)])
    finer = numpy_plan.balanced(p, k, 2, H100)
    assert p.in_kernel(finer).block("n") == 32
    assert numpy_plan.split_kernel(p, finer, 2, H100) == ("n", [(0, 2), (2, 2), (4, 1), (5, 1)])
    assert numpy_plan.balanced(p, k, 3, H100) is k
    assert ("run_parts([(kernel_Y_n2, 0), (kernel_Y_n2, 64), (kernel_Y_n1, 128), "
            "(kernel_Y_n1, 160)], 2, X, W, Y)") in numpy_gen.generate(p, threads=2)
    inputs = random_inputs(ast, seed=6)
    whole = assert_threads_agree(p, inputs)
    assert_close(whole["Y"], dense.evaluate(ast, inputs, np.float64)["Y"], "vs dense")


@pytest.mark.usefixtures("split_small")
def test_a_folded_split_axis_keeps_its_blocks_however_its_parts_fall():
    """Statistics folded over the split axis (each part walks all of it, storing its own
    blocks): three blocks on two threads, but the fold's blocks are the axis' blocks (a
    Welford state holds their count), so the axis is not tiled finer."""
    x = Load("X", ("m", "e"))
    stats = welford_stats(x, "e", 64)
    y = mul(sub(x, Get(0, stats)), Unary("rsqrt", add(Get(1, stats), Const(1e-5))))
    p = program({"m": (4, 4), "e": (192, 64)}, {"X": ("m", "e")}, [Store("Y", ("m", "e"), y)])
    (k,) = p.kernels
    assert numpy_plan.split_kernel(p, k, 2, H100) == ("e", [(0, 1), (1, 1), (2, 1)])
    assert numpy_plan.balanced(p, k, 2, H100) is k


def test_small_kernels_and_one_block_grids_run_whole():
    small = flash(64, 8, 8, 16)
    assert numpy_plan.split_kernel(small, small.kernels[0], 8, H100) is None  # little work
    assert numpy_gen.generate(small, threads=8) == numpy_gen.generate(small)
    one_block = flash(512, 64, 512, 64)  # enough work, one query block
    assert numpy_plan.split_kernel(one_block, one_block.kernels[0], 8, H100) is None
    big = flash(512, 64, 64, 64)
    assert numpy_plan.split_kernel(big, big.kernels[0], 2, H100) is not None
    assert numpy_plan.split_kernel(big, big.kernels[0], 1, H100) is None


def test_a_kernel_too_small_to_split_does_not_take_the_program_into_parts(monkeypatch):
    """Elementwise work that would pay for parts (`parts_pay`) in a kernel whose numpy calls
    are too small to split (`MIN_CALL_FLOPS`) leaves the program whole, its product threaded
    by BLAS: magika's GELU took the whole model into parts, 4.8-5.1 ms against 3.7 whole."""
    ast = parse_program("dim r = 256 / 16\ndim c = 512 / 512\ndim k = 512\n"
                        "input X[r, c], A[r, k], B[k, c] : f32\n"
                        "Y[r, c] = tanh(tanh(tanh(X[r, c]))) * 2\n"
                        "Z[r, c] = sum[k] A[r, k] * B[k, c]\noutput Y, Z\n")
    p = lower(ast)
    pays = [k for k in p.kernels if numpy_plan.parts_pay(p.in_kernel(k), k)]
    assert [k.name for k in pays] == ["Y"]
    assert numpy_plan.split_kernel(p, pays[0], 2, H100) is None
    assert parts_in(numpy_gen.generate(p, threads=2)) == 0
    monkeypatch.setattr(numpy_plan, "MIN_CALL_FLOPS", 1 << 10)  # now Y splits, and so does Z
    assert numpy_plan.split_kernel(p, pays[0], 2, H100) is not None
    assert parts_in(numpy_gen.generate(p, threads=2)) >= 4
    inputs = random_inputs(ast, seed=3)
    got = numpy_gen.run(p, inputs, threads=2)
    assert_close(got["Z"], dense.evaluate(ast, inputs, np.float64)["Z"], "vs dense")


def test_threads_default_and_override(monkeypatch):
    monkeypatch.setenv("BBRULES_THREADS", "3")
    assert numpy_runtime.default_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("BBRULES_THREADS", bad)
        with pytest.raises(UsageError, match="BBRULES_THREADS"):
            numpy_runtime.default_threads()
    monkeypatch.delenv("BBRULES_THREADS")
    assert numpy_runtime.default_threads() >= 1


def test_parts_run_threads_at_a_time_and_report_their_errors():
    """Every part runs, `threads` at once and never more, with numpy's BLAS on one thread; the
    BLAS count is restored after; a part's exception reaches the caller."""
    seen: dict[int, tuple[str, int | None]] = {}
    barrier = threading.Barrier(3, timeout=10)  # passes only when three parts run at once
    running, most = [0], [0]
    count = threading.Lock()
    blas = numpy_runtime._OPENBLAS
    before = blas[0]() if blas else None

    def part(out: np.ndarray, start: int) -> None:
        with count:
            running[0] += 1
            most[0] = max(most[0], running[0])
        barrier.wait()
        seen[start] = threading.current_thread().name, blas[0]() if blas else None
        out[start] = start + 1
        with count:
            running[0] -= 1

    out = np.zeros(6, np.float32)
    numpy_runtime.run_parts([(part, i) for i in range(6)], 3, out)
    assert out.tolist() == [1, 2, 3, 4, 5, 6]
    assert most[0] == 3 and len({name for name, _ in seen.values()}) == 3
    if blas:
        assert {count for _, count in seen.values()} == {1}
        assert blas[0]() == before

    def failing(out: np.ndarray, start: int) -> None:
        if start:
            raise RuntimeError(f"part {start}")

    with pytest.raises(RuntimeError, match="part 1"):
        numpy_runtime.run_parts([(failing, 0), (failing, 1)], 2, out)
    if blas:
        assert blas[0]() == before


BINDABLE = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


def test_threads_are_bound_only_where_they_take_every_core():
    """With fewer threads than cores, which to take is the scheduler's call: processes that
    each bound their threads to the first cores they may use would all share those."""
    assert numpy_runtime._cores_to_bind({3, 1}, 2) == [1, 3]
    assert numpy_runtime._cores_to_bind({0, 1, 2, 3}, 2) is None
    assert numpy_runtime._cores_to_bind({0}, 2) is None
    assert numpy_runtime._cores_to_bind(None, 2) is None


@pytest.mark.skipif(not BINDABLE, reason="binds threads to cores: needs Linux and 2 cores")
def test_parts_run_on_cores_of_their_own_unless_another_call_overlaps():
    """Two threads running parts for a caller that may run on two cores are bound one to
    each; the caller's own cores are restored after.  A call overlapping one that runs leaves
    its threads on the caller's cores: binding both would put their parts on the same cores."""
    everywhere = os.sched_getaffinity(0)
    own = set(sorted(everywhere)[:2])
    os.sched_setaffinity(0, own)
    try:
        out = np.zeros(2, np.float32)
        both = threading.Barrier(2, timeout=10)  # the two parts run at once, on two threads
        seen: dict[int, set[int]] = {}

        def part(out: np.ndarray, start: int) -> None:
            both.wait()
            seen[start] = os.sched_getaffinity(0)

        numpy_runtime.run_parts([(part, 0), (part, 1)], 2, out)
        assert all(len(cores) == 1 and cores <= own for cores in seen.values())
        assert seen[0] != seen[1]
        assert os.sched_getaffinity(0) == own

        running = threading.Barrier(3, timeout=10)  # the first call's two parts and this one
        released = threading.Event()
        overlapped: dict[int, set[int]] = {}

        def holding(out: np.ndarray, start: int) -> None:
            running.wait()
            released.wait(10)

        def overlapping(out: np.ndarray, start: int) -> None:
            overlapped[start] = os.sched_getaffinity(0)
            released.set()

        first = threading.Thread(target=numpy_runtime.run_parts,
                                 args=([(holding, 0), (holding, 1)], 2, out))
        first.start()
        running.wait()
        numpy_runtime.run_parts([(overlapping, 0), (overlapping, 1)], 2, out)
        first.join(10)
        assert overlapped and all(cores == own for cores in overlapped.values())
    finally:
        os.sched_setaffinity(0, everywhere)


@pytest.mark.skipif(not BINDABLE, reason="binds threads to cores: needs Linux and 2 cores")
def test_parts_run_where_their_threads_cannot_be_bound(monkeypatch):
    """Binding a thread to a core may be refused (a container's CPU set changed meanwhile):
    the parts run unbound, every one of them."""
    def refused(pid: int, cores: object) -> None:
        raise PermissionError("not allowed")

    monkeypatch.setattr(os, "sched_setaffinity", refused)
    out = np.zeros(4, np.float32)

    def part(out: np.ndarray, start: int) -> None:
        out[start] = start + 1

    numpy_runtime.run_parts([(part, i) for i in range(4)], 2, out)
    assert out.tolist() == [1, 2, 3, 4]


def test_parts_do_not_raise_peak_memory():
    n, d, bk = 2048, 16, 128
    p = flash(n, d, 64, bk)
    inputs = {"Q": rand(n, d, seed=1), "K": rand(n, d, seed=2), "V": rand(n, d, seed=3)}

    def peak(threads: int) -> int:
        module = numpy_gen.load(p, threads=threads)
        tracemalloc.start()
        try:
            module.run(**inputs)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert parts_in(numpy_gen.generate(p, threads=2)) == 4
    assert peak(2) <= peak(1)


def test_a_kernel_skipping_blocks_by_its_split_axis_runs_in_more_parts():
    """Causal attention's parts each visit the key blocks their own queries reach: twice the
    parts visit fewer blocks in all (56% of them with 8 parts, 62% with 4).  Attention
    without a mask has nothing to gain and keeps two parts per thread."""
    parts = {}
    for name in ("causal_attention", "attention"):  # 8 heads and 1, N = 4096
        ast = load_program(EXAMPLES / f"{name}.bbp")
        p = fuse(lower(ast), load_packs([]), H100).program
        kernel = max(p.kernels, key=lambda k: len(k.grid))
        parts[name] = numpy_plan.split_kernel(p, kernel, 2, H100)
    assert parts["causal_attention"][0] == "q" and len(parts["causal_attention"][1]) == \
        2 * numpy_plan.PARTS_PER_THREAD * numpy_plan.SKIPPING_PARTS
    assert len(parts["attention"][1]) == 2 * numpy_plan.PARTS_PER_THREAD


def test_a_lookup_by_a_one_hot_is_split_by_what_its_gather_copies():
    """numpy gathers by a one-hot, however the target prices the contraction: an embedding
    lookup of 2048 rows of 64 from a vocabulary of 32000 copies 131072 elements, too little
    for parts, though the 8.4 GFLOP matmul the h100 target prices would be split four ways
    (magika's lookup, so split, took 0.83 ms where it takes 0.17 ms whole)."""
    source = ("dim t = 2048 / 64\ndim v = 32000 / 64\ndim e = 64\n"
              "input IDS[t], E[v, e] : f32\n"
              "X[t, e] = sum[v] where(IDS[t] == v, 1, 0) * E[v, e]\noutput X\n")
    p = lower(parse_program(source))
    (kernel,) = p.kernels
    assert cost_kernel(p, kernel, H100).flops > 8e9
    assert numpy_plan.split_kernel(p, kernel, 2, H100) is None


def test_a_program_splits_only_where_some_kernel_has_elementwise_work_to_share():
    """Products alone run whole, BLAS threading them itself: a chain of matmuls at 128 rows
    has nothing numpy would do on one core.  Attention's exponentials and rescaling are such
    work; with a kernel like that, the program's products are split into parts too, so that
    BLAS's threads do not spin on the cores the parts need."""
    source = ("dim t = 128 / 64\ndim e = 256 / 64\ndim f = 1024 / 64\n"
              "input X[t, e], W1[e, f], W2[f, e] : f32\n"
              "H[t, f] = sum[e] X[t, e] * W1[e, f]\nY[t, e] = sum[f] H[t, f] * W2[f, e]\n"
              "output Y\n")
    products = lower(parse_program(source))
    assert not any(numpy_plan.parts_pay(products, k) for k in products.kernels)
    assert parts_in(numpy_gen.generate(products, threads=2)) == 0
    longer = source.replace("dim t = 128 / 64", "dim t = 4096 / 64")
    assert parts_in(numpy_gen.generate(lower(parse_program(longer)), threads=2)) == 0
    ast = load_program(EXAMPLES / "attention.bbp")
    attention = lower(ast)  # unfused: scores, softmax and the product by V, each a kernel
    pays = [k.name for k in attention.kernels if numpy_plan.parts_pay(attention, k)]
    assert pays and len(pays) < len(attention.kernels)
    code = numpy_gen.generate(attention, threads=2)
    split = {name for name in re.findall(r"\(kernel_(\w+?)_[a-z]+\d+, \d+\)", code)}
    assert set(pays) < split, (pays, split)


def test_a_kernel_is_split_along_the_axis_its_work_depends_on():
    """Row statistics then a normalised row: the statistics do not depend on the columns, so
    splitting by columns would compute them once per part; the rows are split instead, although
    the columns have more blocks."""
    x = Load("X", ("m", "e"))
    stats = welford_stats(x, "e", 4)
    y = mul(sub(x, Get(0, stats)), Unary("rsqrt", add(Get(1, stats), Const(1e-5))))
    p = program({"m": (12, 4), "e": (24, 4)}, {"X": ("m", "e")}, [Store("Y", ("m", "e"), y)])
    assert numpy_plan._split_axis(p, p.kernels[0]) == "m"


def test_a_contraction_counts_its_contracted_axis_once():
    """LayerNorm folded into a matmul: the statistics and the normalised row do not depend on
    the columns, the bias's product `sum[e] B[e] W[e, n]` does not depend on the rows.  That
    product is n x e multiply-adds, not n x e x e: counted once, it is the cheaper work to
    repeat, and the rows are split (split by columns, each part normalised all of X again)."""
    ast = load_program(EXAMPLES / "layernorm_matmul.bbp",
                       {"m": (256, 64), "e": (128, 32), "n": (128, 32)})
    p = fuse(lower(ast), load_packs([]), get_target("cpu"), "traffic").program
    kernel = next(k for k in p.kernels if set(k.grid) == {"m", "n"})
    assert numpy_plan._split_axis(p.in_kernel(kernel), kernel) == "m"
