"""The CUDA backend, checked without a GPU: every kernel compiles with nvcc for sm_90 (where nvcc
exists), and the same source, compiled as C++ with the emulation header (`tests/cuda_emu`),
computes what the reference interpreter computes.  Where CuPy finds a GPU the real kernels run
too; elsewhere those tests are skipped with the reason.

Programs run at small shapes with several blocks per axis and different block sizes on
different axes; the hand-fused programs use monoids registered here, so nothing in the
generator can be specific to the standard rule pack.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from bbrules import interp
from bbrules.blockfile import load_block_program, parse_block_program
from bbrules.codegen import cuda_gen
from bbrules.codegen.cuda_gen import (MAX_THREADS, CompileError, CudaModule, compile_check,
                                      from_storage, generate, to_storage)
from bbrules.cost import cost_kernel
from bbrules.errors import UsageError
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import BlockProgram, Const, Get, Load, Store, Unary, postorder
from bbrules.lower import lower
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.plan import MicroTile, micro_tile, plan_for
from bbrules.targets import get_target

from cuda_emu import emulate, fake_cupy, race_check
from irbuild import (add, attention_reference, flash_attention, mul, online_softmax,
                     program, reshaped_dims, sub, welford_stats)
from strategies import programs

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.bbp"))
MULTI = sorted((Path(__file__).parent / "programs" / "multi").glob("*.bbk"))

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None,
                               reason="g++ is not installed: the kernels cannot be emulated")


def _gpu_unavailable() -> str | None:
    try:
        import cupy
    except ImportError:
        return "cupy is not installed: the kernels only run in the emulator here"
    try:
        if cupy.is_available():
            return None
    except Exception as err:  # a driver problem is a reason to skip, not a test failure
        return f"cupy cannot use a GPU: {err}"
    return "cupy finds no GPU: the kernels only run in the emulator here"


_NO_GPU = _gpu_unavailable()
needs_gpu = pytest.mark.skipif(_NO_GPU is not None, reason=_NO_GPU or "")

# --------------------------------------------------------------------------------------------
# Programs

# Blockings for the multi-block dimensions of an example, used in turn: 2 to 4 blocks per axis,
# different block sizes on different axes.  A dimension with one block gets one block of 16.
SMALL_BLOCKINGS = [(48, 16), (32, 8), (24, 8), (64, 16)]


def small_example(path: Path) -> BlockProgram:
    """An example lowered at small sizes.  Dimensions that rename one another (a tensor loaded
    under other axis names) must stay the same size, so they are sized as a group."""
    declared = lower(load_program(path))
    group = {a: a for a in declared.dims}

    def root(a: str) -> str:
        while group[a] != a:
            a = group[a]
        return a

    for k in declared.stores:
        for n in postorder(k.value):
            if isinstance(n, Load):
                for declared_axis, used in declared.tensor_axes_dim(n):
                    group[root(used)] = root(declared_axis)
    sizes: dict[str, tuple[int, int]] = {a: (declared.dims[a].extent, declared.dims[a].block)
                                         for a in reshaped_dims(declared)}
    for d in declared.dims.values():
        r = root(d.name)
        if d.name in sizes:
            continue
        if r not in sizes:
            sizes[r] = (16, 16) if d.blocks == 1 else \
                SMALL_BLOCKINGS[len(sizes) % len(SMALL_BLOCKINGS)]
        sizes[d.name] = sizes[r]
    return lower(load_program(path, {a: sizes[a] for a in declared.dims}))


def fused_by_the_pack(stem: str) -> BlockProgram:
    """An example at small sizes, fused by the standard rule pack (as `bbrules apply` does)."""
    p = small_example(next(e for e in EXAMPLES if e.stem == stem))
    return fuse(p, load_packs([]), get_target("h100")).program


# Monoids unknown to every rule pack.  The online softmax finalizes to o / l, the attention
# output itself, so its fold is stored as it is.
ONLINE_SOFTMAX = online_softmax("cuda_test_online_softmax")


def welford_layernorm(n_m: int, b_m: int, n_e: int, b_e: int, dtype: str = "f32"
                      ) -> BlockProgram:
    """LayerNorm in one kernel over (m, e) blocks: the statistics of each row come from a loop
    over the blocks of e with the Welford monoid, inside a grid that also spans e."""
    x = Load("X", ("m", "e"))
    stats = welford_stats(x, "e", b_e)
    rstd = Unary("rsqrt", add(Get(1, stats), Const(1e-5)))
    y = add(mul(mul(sub(x, Get(0, stats)), rstd), Load("G", ("e",))), Load("B", ("e",)))
    return program({"m": (n_m, b_m), "e": (n_e, b_e)}, {"X": ("m", "e"), "G": ("e",), "B": ("e",)},
                   [Store("Y", ("m", "e"), y)], dtype=dtype)


FUSED = {
    "flash_attention": lambda: flash_attention(96, 32, 192, 64, 16, ONLINE_SOFTMAX),
    "welford_layernorm": lambda: welford_layernorm(24, 8, 96, 32),
}

# --------------------------------------------------------------------------------------------
# Checks


def assert_matches(got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                   rtol: float = 1e-4, context: str = "") -> None:
    """Every tensor within `rtol` norm-wise, and every element within 10 x `rtol`: the two
    sum in different orders, and in a deep program (a decoder layer: norm, projection, scores,
    exp) a few elements' rounding is amplified past `rtol` while a wrong block is not hidden.
    Infinities (masked scores) must be the same on both sides; the rest is compared."""
    assert set(got) == set(want)
    for name, ref in want.items():
        finite = np.isfinite(ref)
        np.testing.assert_array_equal(got[name][~finite], ref[~finite],
                                      err_msg=f"tensor {name} {context}")
        ref, out = ref[finite], got[name][finite]
        scale = max(1.0, float(np.abs(ref).max(initial=0.0)))
        diff = np.linalg.norm((out - ref).ravel())
        assert diff <= rtol * max(float(np.linalg.norm(ref.ravel())), 1e-30), \
            f"tensor {name} {context}: norm-wise error {diff / np.linalg.norm(ref.ravel()):.3g}"
        np.testing.assert_allclose(out, ref, rtol=10 * rtol, atol=rtol * scale,
                                   err_msg=f"tensor {name} {context}")


def check_emulated(p: BlockProgram, threads: tuple[int | None, ...] = (None,)) -> CudaModule:
    module = generate(p)
    inputs = random_inputs(p, seed=1)
    want = interp.run(p, inputs)
    for t in threads:
        assert_matches(emulate(module, inputs, threads=t), want, context=f"with {t} threads")
    return module


@needs_cxx
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_like_the_interpreter(path):
    check_emulated(small_example(path))


@needs_nvcc
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_compiles_for_sm90(path):
    module = generate(small_example(path))
    resources = compile_check(module.source)
    assert set(resources) == {k.name for k in module.kernels}
    assert all(0 < r.registers <= 255 for r in resources.values())


def test_small_examples_have_several_blocks_per_axis_and_non_square_blocks():
    """Guard on the shapes the other tests use: they must exercise the grid and loop logic."""
    non_square = []
    for path in EXAMPLES:
        multi = [d for d in small_example(path).dims.values() if d.blocks > 1]
        assert multi and all(d.blocks >= 2 for d in multi), path
        if len({d.block for d in multi}) > 1:
            non_square.append(path.stem)
    assert "attention" in non_square and len(non_square) >= len(EXAMPLES) // 2


# An embedding lookup of token ids declared i32, scaled by a whole-number input.
WHOLE_IDS = ("dim t = 24 / 8\ndim v = 40 / 16\ndim e = 32 / 16\ninput IDS[t], N[t] : i32\n"
             "input E[v, e] : f32\n"
             "X[t, e] = sum[v] where(IDS[t] == v, 1, 0) * E[v, e] * N[t]\noutput X\n")


@needs_cxx
def test_i32_inputs_are_passed_to_the_kernels_as_f32():
    """The launcher takes the caller's integers and the kernels read them as f32, exactly."""
    p = fuse(lower(parse_program(WHOLE_IDS)), load_packs([]), get_target("h100")).program
    module = check_emulated(p)
    assert {module.tensors[t].dtype for t in ("IDS", "N")} == {"f32"}
    inputs = random_inputs(p, seed=1)
    given = {**inputs, "IDS": inputs["IDS"].astype(np.int32), "N": inputs["N"].astype(np.int64)}
    assert_matches(emulate(module, given), interp.run(p, inputs))


@needs_cxx
def test_flash_attention_in_one_kernel_for_any_thread_count():
    p = FUSED["flash_attention"]()
    module = check_emulated(p, threads=(None, 32, 48, MAX_THREADS))
    assert len(module.kernels) == 1 and module.kernels[0].grid == 3
    # An independent reference: dense softmax attention in float64.
    inputs = random_inputs(p, seed=1)
    want = attention_reference(inputs["Q"], inputs["K"], inputs["V"])
    np.testing.assert_allclose(emulate(module, inputs)["O"], want, rtol=1e-4, atol=1e-5)


@needs_cxx
def test_welford_layernorm_matches_numpy():
    p = FUSED["welford_layernorm"]()
    inputs = {name: x * 3.0 + 5.0 for name, x in random_inputs(p, seed=2).items()}
    module = generate(p)
    got = emulate(module, inputs, threads=40)["Y"]
    x = inputs["X"].astype(np.float64)
    want = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    want = want * inputs["G"] + inputs["B"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert_matches({"Y": got}, interp.run(p, inputs))


@needs_cxx
@pytest.mark.parametrize("dtype,rtol", [("f16", 2e-3), ("bf16", 2e-2)])
def test_16_bit_tensors_are_converted_on_load_and_store(dtype, rtol):
    p = welford_layernorm(24, 8, 96, 32, dtype)
    inputs = {n: from_storage(to_storage(x, dtype), dtype)
              for n, x in random_inputs(p, seed=3).items()}
    module = generate(p)
    assert all(ct == "unsigned short*" or ct == "const unsigned short*"
               for ct in module.kernels[0].signature)
    got = emulate(module, inputs)
    assert_matches(got, interp.run(p, inputs), rtol=rtol)


@needs_cxx
def test_a_reduction_that_re_binds_a_grid_axis_reads_along_it():
    # The inner sum walks all of j in a kernel whose grid has j: the load of A[t, j] inside
    # it may not be kept as a slab of the grid's one block of j.  (Found by the test below:
    # every output was -inf.)
    p = lower(parse_program("dim i = 2 / 1\ndim j = 3 / 1\ndim t = 2 / 1\ninput A[i, j] : f32\n"
                            "T[j, t] = max[i] ((sum[j] A[t, j] * A[i, j]) + A[i, j])\n"
                            "output T\n"))
    inputs = random_inputs(p, seed=0)
    a = inputs["A"].astype(np.float64)
    want = np.array([[max(a[t] @ a[i] + a[i, j] for i in range(2)) for t in range(2)]
                     for j in range(3)])
    np.testing.assert_allclose(emulate(generate(p), inputs)["T"], want, rtol=1e-5)
    np.testing.assert_allclose(interp.run(p, inputs)["T"], want, rtol=1e-5)


@needs_cxx
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_run_like_the_interpreter(source):
    p = lower(parse_program(source, "<random>"))
    module = generate(p)
    inputs = random_inputs(p, seed=0)
    assert_matches(emulate(module, inputs, threads=48), interp.run(p, inputs), context=source)
    if shutil.which("nvcc"):
        assert set(compile_check(module.source)) == {k.name for k in module.kernels}


@needs_cxx
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_fused_by_the_standard_pack_runs_like_the_interpreter(path):
    fused = fused_by_the_pack(path.stem)
    assert len(fused.kernels) < len(small_example(path).kernels)
    module = check_emulated(fused, threads=(None, 48))
    if shutil.which("nvcc"):
        assert set(compile_check(module.source)) == {k.name for k in module.kernels}


@needs_nvcc
@pytest.mark.parametrize("name", FUSED)
def test_fused_programs_compile_for_sm90(name):
    module = generate(FUSED[name]())
    assert set(compile_check(module.source)) == {k.name for k in module.kernels}


# --------------------------------------------------------------------------------------------
# Synchronisation: ThreadSanitizer sees a missing barrier even when the numbers come out right.


def _race_report(module: CudaModule) -> str:
    try:
        return race_check(module)
    except RuntimeError as err:
        pytest.skip(f"ThreadSanitizer cannot run here: {err}")


@needs_cxx
@pytest.mark.parametrize("name", [*FUSED, "attention fused by the pack"])
def test_fused_kernels_have_no_data_races(name):
    p = FUSED[name]() if name in FUSED else fused_by_the_pack("attention")
    assert _race_report(generate(p)) == ""


@needs_cxx
def test_race_check_sees_a_missing_barrier():
    module = generate(FUSED["flash_attention"]())
    broken = dataclasses.replace(module, source=module.source.replace("__syncthreads();", ""))
    assert "data race" in _race_report(broken)


# --------------------------------------------------------------------------------------------
# Kernels of several stores, and map loops: every block program in tests/programs/multi, and
# a few written here (nested map loops, an empty grid, a grid axis of one block).

MAP_LOOPS = {
    # Y walks the blocks of i and, inside, of j (w[j] is resident); Z's reduction over j
    # shares Y's loop over j.  The grid axis h has one block.
    "nested_map_loops": """\
dim h = 2
dim i = 32 / 8
dim j = 96 / 32
input X[h, i, j] : f32
input w[j] : f32
output Y[h, i, j] : f32
output Z[h, i] : f32

kernel [h]:
  Y[h, i, j] = exp(load(X[h, i, j])) * load(w[j])
  Z[h, i] = reduce(j, max, bmax(j, load(X[h, i, j])))
""",
    # One thread block: per block of rows, a reduction loop over c, then a map loop over c
    # that reads the reduction's result.
    "softmax_numerator_in_one_block": """\
dim r = 48 / 16
dim c = 64 / 16
input X[r, c] : f32
output Y[r, c] : f32
output M[r] : f32

kernel []:
  let t0 = reduce(c, max, bmax(c, load(X[r, c])))
  Y[r, c] = exp(load(X[r, c]) - t0)
  M[r] = t0
""",
}
MULTI_STORE = [*(p.stem for p in MULTI), *MAP_LOOPS]


def multi_store_program(name: str) -> BlockProgram:
    if name in MAP_LOOPS:
        return parse_block_program(MAP_LOOPS[name], f"<{name}>").program
    return load_block_program(next(p for p in MULTI if p.stem == name)).program


def test_multi_store_programs_exercise_several_stores_map_loops_and_an_empty_grid():
    """Guard on the programs the tests below use."""
    programs = {name: multi_store_program(name) for name in MULTI_STORE}
    assert {"one_processor", "qkv", "rowsum_add", "softmax_row",
            "stats_then_normalise"} <= set(programs)
    kernels = [k for p in programs.values() for k in p.kernels]
    assert sum(len(k.stores) > 1 for k in kernels) >= 5
    assert any(not k.grid for k in kernels)
    assert any(len(k.map_axes(s)) > 1 for k in kernels for s in k.stores)  # nested
    for name, p in programs.items():
        assert any(len(k.stores) > 1 or any(k.map_axes(s) for s in k.stores)
                   for k in p.kernels), name


@needs_cxx
@pytest.mark.parametrize("name", MULTI_STORE)
def test_multi_store_kernels_run_like_the_interpreter(name):
    p = multi_store_program(name)
    module = check_emulated(p, threads=(None, 32, 48))
    assert [k.tensors for k in module.kernels] == [k.tensors for k in p.kernels]
    for info, kernel in zip(module.kernels, p.kernels, strict=True):
        assert info.params[:len(kernel.stores)] == kernel.tensors
        assert info.grid == math.prod(p.blocks(a) for a in kernel.grid)


def test_the_grid_has_one_thread_block_per_point_of_the_kernels_grid_axes():
    grids = {name: [k.grid for k in generate(multi_store_program(name)).kernels]
             for name in ("one_processor", "rowsum_add", "stats_then_normalise",
                          "nested_map_loops")}
    assert grids == {"one_processor": [1], "rowsum_add": [4], "stats_then_normalise": [4, 16],
                     "nested_map_loops": [1]}


@needs_nvcc
@pytest.mark.parametrize("name", MULTI_STORE)
def test_multi_store_kernels_compile_for_sm90(name):
    module = generate(multi_store_program(name))
    resources = compile_check(module.source)
    assert set(resources) == {k.name for k in module.kernels}
    assert all(0 < r.registers <= 255 and r.spill_bytes == 0 for r in resources.values())


@pytest.mark.parametrize("name", MULTI_STORE)
def test_multi_store_kernels_allocate_the_cost_models_footprint(name):
    p = multi_store_program(name)
    target = get_target("h100")
    for info, kernel in zip(generate(p, target).kernels, p.kernels, strict=True):
        assert info.shared_bytes == cost_kernel(p, kernel, target).footprint > 0


@needs_cxx
@pytest.mark.parametrize("name", MULTI_STORE)
def test_multi_store_kernels_have_no_data_races(name):
    assert _race_report(generate(multi_store_program(name))) == ""


@needs_cxx
def test_a_map_loop_waits_for_its_write_before_reloading_its_tiles():
    """A write reads every element of the tile of v[j]; the next iteration's first step loads
    the next block of v into the same storage, with other threads.  Without the barrier after
    the write, ThreadSanitizer sees the race."""
    p = parse_block_program("""\
dim i = 32 / 8
dim j = 64 / 16
input v[j] : f32
input a[i, j] : f32
output c[i, j] : f32

kernel [i]:
  c[i, j] = load(v[j]) * load(a[i, j])
""").program
    module = generate(p)
    assert _race_report(module) == ""
    lines = module.source.splitlines()
    write = next(i for i, line in enumerate(lines) if "g_c[" in line)
    barrier = next(i for i in range(write, len(lines)) if lines[i].strip() == "__syncthreads();")
    assert lines[barrier + 1].strip() == "}"  # the last step of the map loop's body
    broken = dataclasses.replace(module, source="\n".join(lines[:barrier] + lines[barrier + 1:]))
    assert "data race" in _race_report(broken)


# --------------------------------------------------------------------------------------------
# Limits and the toolchain


def test_kernels_too_large_for_shared_memory_are_refused():
    # A 256 x 256 f32 score tile alone is 256 KiB, over the H100's 227 KiB per block.
    with pytest.raises(UsageError, match="shared memory"):
        generate(flash_attention(512, 256, 512, 256, 64, ONLINE_SOFTMAX))


@pytest.mark.parametrize("name", [*FUSED, *(p.stem for p in EXAMPLES)])
def test_shared_memory_is_the_cost_models_footprint(name):
    """Both read the kernel's plan, so a kernel allocates exactly the modelled footprint (and
    one the cost model finds legal is never refused; tests/test_plan.py checks more)."""
    p = FUSED[name]() if name in FUSED else lower(load_program(
        next(e for e in EXAMPLES if e.stem == name)))
    target = get_target("h100")
    for info, kernel in zip(generate(p, target).kernels, p.kernels, strict=True):
        assert info.shared_bytes == cost_kernel(p, kernel, target).footprint


def test_offsets_into_tensors_past_2_to_the_31_elements_are_64_bit():
    p = program({"r": (2**16, 64), "c": (2**15, 64)}, {"X": ("r", "c")},
                [Store("Y", ("r", "c"), Unary("exp", Load("X", ("r", "c"))))])
    source = generate(p).source
    assert source.count("(long long)") == 2  # the load and the store
    if shutil.which("nvcc"):
        compile_check(source)


@needs_nvcc
def test_compile_check_reports_nvcc_errors():
    with pytest.raises(CompileError, match="undefined"):
        compile_check('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }')


@needs_nvcc
def test_compile_check_treats_warnings_as_errors():
    with pytest.raises(CompileError):
        compile_check('extern "C" __global__ void k(float* x) { int unused = 3; x[0] = 1; }')


# --------------------------------------------------------------------------------------------
# The CuPy launcher: on a stand-in for cupy made of numpy and the emulator, then on a GPU.


@needs_cxx
def test_launcher_runs_on_a_numpy_stand_in_for_cupy(monkeypatch):
    # q and k blocks of 64 x 64 with d = 64: over 48 KiB, so the launcher must raise the
    # function's dynamic shared-memory limit.
    p = flash_attention(64, 64, 128, 64, 64, ONLINE_SOFTMAX)
    module = generate(p)
    assert module.kernels[0].shared_bytes > 48 * 1024
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(module))
    inputs = random_inputs(p, seed=4)
    assert_matches(module.runner()(**inputs), interp.run(p, inputs))
    with pytest.raises(ValueError, match="missing input 'V'"):
        module.runner()(Q=inputs["Q"], K=inputs["K"])


@needs_cxx
def test_launcher_converts_16_bit_tensors(monkeypatch):
    p = welford_layernorm(24, 8, 96, 32, "bf16")
    module = generate(p)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(module))
    inputs = {n: from_storage(to_storage(x, "bf16"), "bf16")
              for n, x in random_inputs(p, seed=5).items()}
    got = module.runner()(**inputs)
    assert got["Y"].dtype == np.float32
    assert_matches(got, interp.run(p, inputs), rtol=2e-2)


@needs_cxx
def test_launcher_returns_every_tensor_a_kernel_stores(monkeypatch):
    p = multi_store_program("rowsum_add")
    module = generate(p)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(module))
    inputs = random_inputs(p, seed=6)
    got = module.runner()(**inputs)
    assert set(got) == {"c", "d"}
    assert_matches(got, interp.run(p, inputs))


@needs_gpu
@pytest.mark.parametrize("name", [*FUSED, *(p.stem for p in EXAMPLES), *MULTI_STORE])
def test_kernels_on_the_gpu_match_the_interpreter(name):
    if name in MULTI_STORE:
        p = multi_store_program(name)
    else:
        p = FUSED[name]() if name in FUSED else small_example(
            next(e for e in EXAMPLES if e.stem == name))
    module = generate(p)
    inputs = random_inputs(p, seed=1)
    got = {t: a.get() for t, a in module.runner()(**inputs).items()}
    assert_matches(got, interp.run(p, inputs))


# --------------------------------------------------------------------------------------------
# Register micro-tiles

MULTI_HEAD = """\
dim h = 2 / 1
dim q = 128 / 64
dim k = 128 / 64
dim d = 64

input Q[h, q, d], K[h, k, d], V[h, k, d] : f32

S[h, q, k] = sum[d] Q[h, q, d] * K[h, k, d] * 0.125
M[h, q]    = max[k] S[h, q, k]
E[h, q, k] = exp(S[h, q, k] - M[h, q])
L[h, q]    = sum[k] E[h, q, k]
O[h, q, d] = sum[k] E[h, q, k] * V[h, k, d] / L[h, q]

output O
"""


def test_micro_tile_skips_a_leading_axis_of_block_1():
    blocks = {"h": 1, "q": 64, "k": 64}
    assert micro_tile(("h", "q", "k"), blocks, 256) == MicroTile("q", "k", 4, 4)
    assert micro_tile(("q", "k"), blocks, 256) == MicroTile("q", "k", 4, 4)
    assert micro_tile(("h", "k"), blocks, 16) == MicroTile("h", "k", 1, 4)  # no other choice
    assert micro_tile(("k",), blocks, 32) == MicroTile(None, "k", 1, 2)  # 64 / 2 >= 32 threads
    # Too few outputs for 16 per thread: 8, wider along the last axis.
    assert micro_tile(("h", "q", "k"), blocks, 4096 // 16 + 1) == MicroTile("q", "k", 2, 4)
    assert micro_tile((), blocks, 32) is None


def _dots(p: BlockProgram):
    for k in p.kernels:
        for x in plan_for(p, k, get_target("h100").local_capacity).values:
            if x.kind == "dot":
                yield x


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_multi_head_contractions_get_a_4x4_micro_tile(fused):
    p = lower(parse_program(MULTI_HEAD, "<multi-head>"))
    if fused:  # at the program's 64-row blocks: finer ones would get smaller micro-tiles
        p = fuse(p, load_packs([]), get_target("h100"),
                 options=Options(split_folds=False, reblock=False)).program
    dots = list(_dots(p))
    assert dots and all(x.order[0] == "h" for x in dots)
    assert all(x.micro is not None and x.micro.ri * x.micro.rj == 16 and x.micro.i != "h"
               for x in dots)
    source = generate(p).source
    assert "bb_acc_3_3" in source


@needs_cxx
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_multi_head_attention_with_4x4_micro_tiles_runs_like_the_interpreter(fused):
    p = lower(parse_program(MULTI_HEAD, "<multi-head>"))
    if fused:
        p = fuse(p, load_packs([]), get_target("h100")).program
    module = check_emulated(p, threads=(None, 64))
    if shutil.which("nvcc"):
        assert set(compile_check(module.source)) == {k.name for k in module.kernels}


# --------------------------------------------------------------------------------------------
# What the generated code asks of nvcc, read back from the source and from the SASS (nvdisasm:
# the CUDA toolkit's, or the copy Triton bundles), so that a change undoing one of these
# optimisations fails here instead of only running slower.


def _nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    spec = importlib.util.find_spec("triton")
    if found is None and spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        found = str(bundled) if bundled.exists() else None
    return found


NVDISASM = _nvdisasm()
needs_sass = pytest.mark.skipif(shutil.which("nvcc") is None or NVDISASM is None,
                                reason="reading SASS needs nvcc and nvdisasm")
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")


def sass(source: str) -> dict[str, list[tuple[str, str]]]:
    """Each kernel's SASS for sm_90 in order: (opcode with modifiers, operands); a label is
    ('label', its name)."""
    with tempfile.TemporaryDirectory(prefix="bbrules-sass-") as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(source)
        subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", str(cubin), str(cu)],
                       check=True, capture_output=True)
        text = subprocess.run([NVDISASM, "-c", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
    parts = re.split(r"\n\s*\.text\.(\w+):", text)
    out = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        out[name] = []
        for line in body.splitlines():
            if (m := _LABEL.match(line)) is not None:
                out[name].append(("label", m.group(1)))
            elif (m := _SASS_LINE.search(line)) is not None:
                out[name].append((m.group(1), m.group(2)))
    return out


def outermost_loop(code: list[tuple[str, str]]) -> list[str]:
    """The opcodes of the longest backward branch's body: a kernel's outermost loop."""
    labels, loops = {}, []
    for i, (op, args) in enumerate(code):
        if op == "label":
            labels[args] = i
        elif op.startswith("BRA") and (m := re.search(r"L_x_\d+", args)) and m[0] in labels:
            loops.append((labels[m[0]], i))
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return [op for op, _ in code[start:end + 1] if op != "label"]


def first_loop(text: str) -> str:
    """The source of the first reduction or map loop in a kernel's `text`, braces matched."""
    start = text.index("for (int bb_b")
    depth = 0
    for i in range(text.index("{", start), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
    raise ValueError("unbalanced braces")


def kernel_texts(module: CudaModule) -> dict[str, str]:
    """Each kernel's source, from its signature to the next kernel."""
    starts = [module.source.index(f" {k.name}(") for k in module.kernels]
    ends = starts[1:] + [len(module.source)]
    return {k.name: module.source[a:b] for k, a, b in zip(module.kernels, starts, ends)}


@pytest.mark.parametrize("name", [*FUSED, "attention fused by the pack"])
def test_kernels_are_compiled_for_the_thread_count_they_are_launched_with(name):
    """The launch width is a compile-time constant of each kernel, the one its launch bounds
    name and the launcher uses; the kernels never ask blockDim (only the prelude's emulator
    branch does)."""
    p = FUSED[name]() if name in FUSED else fused_by_the_pack("attention")
    module = generate(p)
    for k in module.kernels:
        text = kernel_texts(module)[k.name]
        assert f"__launch_bounds__({k.threads}) {k.name}(" in module.source
        assert f"const int bb_nthr = BB_THREADS({k.threads});" in text
        assert "blockDim" not in text


def test_tiles_are_loaded_16_bytes_at_a_time_where_their_rows_allow():
    """Rows of whole 16-byte vectors along the contiguous axis: 4 floats or 8 halves per load.
    Rows of 6 floats (block 6 on the last axis) are loaded one element at a time."""
    assert generate(FUSED["flash_attention"]()).source.count("bb_load_f32x4(&") == 3  # Q K V
    assert "bb_load_u16x8(&g_X" in generate(welford_layernorm(24, 8, 96, 32, "f16")).source
    narrow = generate(welford_layernorm(24, 8, 96, 6)).source
    assert "bb_load_f32x4(&" not in narrow and "= g_X[" in narrow


@needs_cxx
def test_16_byte_loads_of_rows_that_cross_blocks_run_like_the_interpreter():
    """A narrow tile (blocks of 4 floats, one vector per row) in f32 and f16, through a map
    loop and a Welford reduction."""
    for dtype in ("f32", "f16"):
        p = welford_layernorm(24, 8, 96, 8 if dtype == "f16" else 4, dtype)
        module = generate(p)
        assert "bb_load_" + ("f32x4" if dtype == "f32" else "u16x8") + "(&" in module.source
        inputs = {n: from_storage(to_storage(x, dtype), dtype)
                  for n, x in random_inputs(p, seed=7).items()}
        for threads in (None, 48):
            assert_matches(emulate(module, inputs, threads=threads), interp.run(p, inputs),
                           rtol=2e-3, context=f"{dtype}, {threads} threads")


def test_the_launcher_passes_every_tensor_16_byte_aligned():
    """The kernels' vector loads need aligned tensors: a device array whose memory does not
    start on a 16-byte boundary (a view into a larger one) is copied; others pass as they are."""
    namespace: dict = {}
    launcher = generate(FUSED["flash_attention"]()).launcher
    exec(compile(launcher.replace("import cupy as cp", "import numpy as cp"), "<launcher>",
                 "exec"), namespace)

    class DeviceArray:
        def __init__(self, pointer: int):
            self.__cuda_array_interface__ = {"data": (pointer, False)}

        def copy(self) -> str:
            return "a copy"

    aligned = DeviceArray(4096)
    assert namespace["_aligned"](aligned) is aligned
    assert namespace["_aligned"](DeviceArray(4100)) == "a copy"


@needs_cxx
def test_accumulators_only_their_own_combine_reads_stay_in_registers():
    """The attention output's state is read only by its own combine: each thread keeps its
    elements in registers across the key loop.  The running maximum is read by the output's
    combine too (at other elements), so it stays in shared memory.  Welford's mean and M2 (per
    row) stay in registers; its count (one scalar) is read by their combine, so it does not."""
    source = generate(FUSED["flash_attention"]()).source
    arrays = re.findall(r"float (bb_s\d+)\[BB_PER_THREAD\((\d+), 256\)\];", source)
    assert sorted(int(size) for _, size in arrays) == [32, 32 * 16]  # the sum and the output
    assert all(f"{name}[bb_r] = bb_n" in source for name, _ in arrays)
    welford = generate(FUSED["welford_layernorm"]()).source
    assert re.findall(r"float bb_s\d+\[BB_PER_THREAD\((\d+), 256\)", welford) == ["8", "8"]
    # Without registers for them (STATE_REGISTERS = 0), the same numbers.
    p = FUSED["flash_attention"]()
    inputs = random_inputs(p, seed=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_gen, "STATE_REGISTERS", 0)
        in_shared = generate(p)
    assert "BB_PER_THREAD(" not in in_shared.source.split('extern "C"')[1]
    assert_matches(emulate(in_shared, inputs), emulate(generate(p), inputs), rtol=1e-5)


@needs_sass
@pytest.mark.parametrize("name", ["flash_attention", "attention fused by the pack"])
def test_fused_attention_key_loop_in_sass(name):
    """nvcc's code for the key-block loop of fused attention:

    - no local memory anywhere: the register accumulators and micro-tiles stay registers
      (an accumulator array indexed in a loop nvcc did not unroll would be local memory);
    - every global load in the loop is a 16-byte vector;
    - one copy of the loop body: as many barriers as the source's loop has (a branch on a
      kernel argument, such as a pointer-alignment test, gets the loop unswitched into two);
    - the thread count being a constant, nvcc unrolls the strided loops: the same kernel
      with the thread count read from blockDim at run time has at least twice the branches,
      and more instructions.
    """
    p = FUSED[name]() if name in FUSED else fused_by_the_pack("attention")
    module = generate(p)
    assert all(r.spill_bytes == 0 and r.stack_bytes == 0
               for r in compile_check(module.source).values())
    (kernel,) = [k for k in module.kernels if "for (int bb_b" in kernel_texts(module)[k.name]]
    code = sass(module.source)[kernel.name]
    loop = outermost_loop(code)
    assert not any(op.startswith(("LDL", "STL")) for op, _ in code)
    loads = [op for op in loop if op.startswith("LDG")]
    assert loads and all(op.startswith("LDG.E.128") for op in loads)
    assert sum(op.startswith("BAR.SYNC") for op in loop) == \
        first_loop(kernel_texts(module)[kernel.name]).count("__syncthreads();")
    at_run_time = module.source.replace("#define BB_THREADS(n) (n)",
                                        "#define BB_THREADS(n) ((int)blockDim.x)")
    slow = [op for op, _ in sass(at_run_time)[kernel.name] if op != "label"]
    fast = [op for op, _ in code if op != "label"]
    assert sum(op.startswith("BRA") for op in slow) >= 2 * sum(op.startswith("BRA") for op in fast)
    assert len(slow) > len(fast)


@needs_sass
def test_the_online_softmax_rescale_is_computed_once_per_row():
    """The output's combine reads the running maximum's rescale factors, `exp(a.m - max)` and
    `exp(b.m - max)`, computed once per row into a buffer of the plan's: in the key loop the
    hardware exponentials are the scores' (one per score) and the factors' (a row's two, and
    the sum's own two), not two more per output element.  The same numbers either way."""
    p = flash_attention(128, 64, 128, 32, 64, ONLINE_SOFTMAX)  # 64 rows x 64 features
    module = generate(p)
    (kernel,) = [k for k in module.kernels if "for (int bb_b" in kernel_texts(module)[k.name]]
    assert kernel.threads == 256
    loop = outermost_loop(sass(module.source)[kernel.name])
    scores, rows = 64 * 32 // 256, math.ceil(64 / 256)
    # per thread and key block: 8 scores, 2 factors and the sum's 2 (42 with 2 per output
    # element: 64 x 64 / 256 elements a thread)
    assert sum(op.startswith("MUFU.EX2") for op in loop) <= scores + 4 * rows
    factors = [buf for op in plan_for(p, p.kernels[0], get_target("h100").local_capacity).loops
               for acc in op.accs for _, buf in acc.factors]
    assert len(factors) == 2 and all(len(buf.order) == 1 for buf in factors)
    assert_matches(emulate(module, random_inputs(p, seed=2)),
                   interp.run(p, random_inputs(p, seed=2)), rtol=1e-5)


@needs_sass
@pytest.mark.parametrize("dtype,convert,back", [("f16", "HADD2.F32", "F2FP.F16.F32.PACK_AB"),
                                                ("bf16", None, "F2FP.BF16.F32.PACK_AB")])
def test_16_bit_conversions_are_hardware_instructions(dtype, convert, back):
    """f16 -> f32 is one HADD2.F32, f32 -> f16/bf16 one F2FP (bf16 -> f32 is a shift), and
    the kernel is shorter than with the prelude's portable bit arithmetic (the emulator's
    branch) compiled for the device instead."""
    module = generate(welford_layernorm(24, 8, 96, 32, dtype))
    name = module.kernels[0].name
    ops = [op for op, _ in sass(module.source)[name] if op != "label"]
    assert back in ops
    if convert is not None:
        assert convert in ops
    portable = module.source
    for converter in ("bb_h2f", "bb_f2h", "bb_f2b"):
        guard = portable.index("#ifdef __CUDA_ARCH__", portable.index(f" {converter}("))
        portable = f"{portable[:guard]}#if 0{portable[guard + len('#ifdef __CUDA_ARCH__'):]}"
    assert len([op for op, _ in sass(portable)[name] if op != "label"]) > len(ops)
