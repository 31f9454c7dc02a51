"""The Triton backend, verified without a GPU.

- Numerics: the generated kernels run in Triton's interpreter (on the CPU) and must match the
  reference interpreter -- every example fused at small sizes, blocks that are not powers of
  two, ragged extents, contractions large enough for `tl.dot`, f16 tensors, every
  elementwise operator.
- Machine code: every example's fused kernels, at the sizes the example declares, compile for
  sm_90a with Triton's own toolchain; the SASS must hold tensor-core instructions wherever the
  kernel has a contraction on the matrix unit, no kernel may spill to local memory, and every
  kernel's shared memory must fit the H100's 227 KiB.

Triton ships for Linux on x86-64 only; there the test extra installs it and these tests run.
"""

from __future__ import annotations

import platform
import re
import sys
import types
from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest

from bbrules import interp
from bbrules.cli import main
from bbrules.errors import UsageError
from bbrules.fuse import fuse
from bbrules.frontend import load_program, parse_program
from bbrules.inputs import random_inputs
from bbrules.ir import Binary, Const, Load, Store, Unary, Where
from bbrules.lower import lower
from bbrules.ops import BINARY, ELEMENTWISE, UNARY
from bbrules.packs import load_packs
from bbrules.targets import get_target
from irbuild import flash_attention, online_softmax, program
from test_cuda_backend import EXAMPLES, WHOLE_IDS, assert_matches, small_example

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("Triton ships for Linux on x86-64 only", allow_module_level=True)

from bbrules.codegen import triton_gen  # noqa: E402  (after the platform check)

H100_SHARED = 227 * 1024


@lru_cache(maxsize=None)
def _pack():
    return load_packs([])


def fused(p):
    return fuse(p, _pack(), get_target("h100")).program


def check_interpreted(p, rtol: float = 1e-4, **options) -> triton_gen.TritonModule:
    module = triton_gen.generate(p, **options)
    inputs = random_inputs(p, seed=1)
    assert_matches(triton_gen.run_interpreted(module, inputs), interp.run(p, inputs), rtol)
    return module


# --------------------------------------------------------------------------------------------
# Numerics in Triton's interpreter


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_fused_example_runs_like_the_interpreter(path):
    check_interpreted(fused(small_example(path)))


def test_a_concatenation_fused_into_its_consumer_runs_like_the_interpreter():
    """`concat`'s one-hot sums in Triton: pieces of 64 and 32 elements joined and contracted
    by the matmul that reads them, in one kernel; rotate-half RoPE in one statement."""
    source = ("dim t = 64 / 32\ndim a = 64 / 32\ndim b = 32 / 32\ndim e = 96 / 32\n"
              "dim n = 32 / 32\ninput A[t, a], B[t, b], W[e, n] : f32\n"
              "Y[t, n] = sum[e] concat(e, A[t, a], 2 * B[t, b]) * W[e, n]\noutput Y\n")
    rope = ("dim t = 64 / 32\ndim d = 64 / 32\ndim i = 32 / 32\n"
            "input X[t, d], C[t, d], S[t, d] : f32\n"
            "R[t, d] = X[t, d] * C[t, d] + concat(d, -X[t, i + 32], X[t, i + 0]) * S[t, d]\n"
            "output R\n")
    for text in (source, rope):
        p = fused(lower(parse_program(text)))
        assert len(p.kernels) == 1
        check_interpreted(p, rtol=1e-5)


def test_unfused_programs_run_like_the_interpreter():
    """Kernels the rules did not touch: one store each, temporaries between them."""
    for stem in ("attention", "decoder_layer"):
        check_interpreted(small_example(next(e for e in EXAMPLES if e.stem == stem)))


@pytest.mark.parametrize("dims", [
    {"q": (60, 20), "k": (36, 12), "d": (24, 24)},  # no block is a power of two
    {"q": (100, 48), "k": (150, 48), "d": (40, 40)},  # ragged extents, padded tl.dot operands
], ids=["padded-blocks", "ragged"])
def test_causal_attention_with_padded_lanes(dims):
    path = next(e for e in EXAMPLES if e.stem == "causal_attention")
    check_interpreted(fused(lower(load_program(path, {"h": (2, 1), **dims}))))


def masked_attention(mask: str, n: int = 192, block: int = 32):
    """One head of attention whose scores outside `mask` (over positions q, k) are -inf."""
    return lower(parse_program(
        f"dim q = {n} / {block}\ndim k = {n} / {block}\ndim d = 16\n"
        "input Q[q, d], K[k, d], V[k, d] : f32\n"
        f"S[q, k] = where({mask}, sum[d] Q[q, d] * K[k, d] * 0.25, -inf)\n"
        "M[q] = max[k] S[q, k]\nE[q, k] = exp(S[q, k] - M[q])\nL[q] = sum[k] E[q, k]\n"
        "O[q, d] = sum[k] E[q, k] * V[k, d] / L[q]\noutput O\n"))


def kernel_text(module: triton_gen.TritonModule) -> str:
    """The module's kernels, without its helpers and launcher."""
    return module.source[module.source.index("def k0_"):module.source.index("# name ->")]


def test_skipped_blocks_in_one_run_become_loop_bounds():
    """Causal: each query block visits key blocks 0 .. its own, so the loop runs over those
    bounds (found by scalar scans) with no test inside it."""
    text = kernel_text(check_interpreted(fused(masked_attention("k <= q"))))
    assert "while (lo" in text and "range(lo" in text and " if " not in text


@pytest.mark.parametrize("mask", ["k <= q", "k <= q and q - k < 64", "k <= q or k < 64"],
                         ids=["causal", "window", "prefix-lm"])
def test_only_blocks_the_predicate_cuts_are_masked(mask):
    """The visited run splits into the blocks the predicate holds on everywhere, emitted with
    no mask, and the cut blocks before and after them, masked; the numerics are unchanged."""
    text = kernel_text(check_interpreted(fused(masked_attention(mask))))
    loops = text.split("    for b")[1:]
    assert [loop.split(":")[0].split(" in ")[1] for loop in loops] == [
        "range(lo0, wlo0)", "range(wlo0, whi0)", "range(whi0, hi0)"]
    masked = [bool(re.search(r"tl\.where\(\(v\d+\) != 0\.0, r\d+, \(-float", loop))
              for loop in loops]
    assert masked == [True, False, True]


def test_skipped_blocks_in_two_runs_are_tested_block_by_block():
    """Keys far from the query on either side: a middle query block visits two runs of key
    blocks, so the loop tests each block."""
    text = kernel_text(check_interpreted(fused(masked_attention("abs(q - k) >= 96", n=384))))
    assert "range(lo" not in text and " if " in text


def test_softmax_exponent_is_one_multiply_add_per_element():
    """`exp(s - m)` with `m` per row: `exp2(s * log2(e) - m * log2(e))`, the row's product
    computed once, so each score costs one fused multiply-add before the exponential."""
    text = kernel_text(check_interpreted(fused(masked_attention("k <= q"))))
    scaled = re.findall(r"(v\d+) = v\d+ \* 1\.4426950408889634\n", text)
    assert scaled and all(re.search(rf"tl\.exp2\(\w+ \* 1\.4426950408889634 - {v}\[:, None\]\)",
                                    text) for v in scaled)


def test_contractions_use_tl_dot_and_match():
    """Blocks of 64: both contractions of Flash Attention go to the matrix unit."""
    p = flash_attention(256, 64, 256, 64, 64, online_softmax("triton_test_softmax"))
    module = check_interpreted(p, precision="ieee")
    assert [k.dots for k in module.kernels] == [2]
    assert "tl.dot(" in module.source


def with_dtype(p, dtype: str):
    """`p` with every tensor of element type `dtype`."""
    return replace(p, tensors={n: replace(t, dtype=dtype) for n, t in p.tensors.items()})


def test_i32_inputs_are_passed_to_the_kernels_as_f32():
    """Token ids declared i32 run in the interpreter like the reference (read as f32)."""
    module = check_interpreted(fused(lower(parse_program(WHOLE_IDS))))
    assert {module.tensors[t].dtype for t in ("IDS", "N")} == {"f32"}


def test_f16_tensors_are_loaded_and_stored_as_f16():
    p = flash_attention(128, 32, 128, 32, 32, online_softmax("triton_test_softmax16"))
    # Both round the stored output to f16 (relative step 2^-11), the operands too.
    module = check_interpreted(with_dtype(p, "f16"), rtol=2e-3, upcast_dots=True)
    assert "tl.float16" in module.source


@pytest.mark.parametrize("op", sorted(ELEMENTWISE))
def test_every_elementwise_operator_matches_numpy(op):
    arity = 1 if op in UNARY else 2 if op in BINARY else 3
    x, y, z = Load("X", ("s", "e")), Load("A", ("e",)), Load("B", ("s", "e"))
    node = {1: lambda: Unary(op, x), 2: lambda: Binary(op, x, y),
            3: lambda: Where(Binary("gt", x, Const(0.0)), y, z)}[arity]()
    p = program({"s": (24, 8), "e": (40, 20)}, {"X": ("s", "e"), "A": ("e",), "B": ("s", "e")},
                [Store("Y", ("s", "e"), node)])
    module = triton_gen.generate(p)
    inputs = random_inputs(p, seed=2)
    got = triton_gen.run_interpreted(module, inputs)["Y"]
    np.testing.assert_allclose(got, interp.run(p, inputs)["Y"], rtol=2e-6, atol=2e-6)


def test_the_gpu_targets_price_what_the_triton_kernels_get():
    """f32 contractions at the TF32 rate (the default precision), blocks no finer than the
    smallest `tl.dot` side."""
    p = small_example(EXAMPLES[0])
    assert triton_gen.generate(p).precision == "tf32"
    for name in ("h100", "h200"):
        t = get_target(name)
        assert t.block_granularity == triton_gen.DOT_MIN
        assert t.peak_flops_dot_f32 > t.peak_flops  # the matrix unit, not the CUDA cores


def test_every_elementwise_operator_has_a_triton_expression():
    assert set(ELEMENTWISE) <= set(triton_gen.TRITON_OPS)


# --------------------------------------------------------------------------------------------
# Machine code, compiled offline for sm_90a


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_compiles_to_tensor_core_code_without_spills(path):
    module = triton_gen.generate(fused(lower(load_program(path))))
    compiled = triton_gen.compile_offline(module)
    assert set(compiled) == {k.name for k in module.kernels}
    for k in module.kernels:
        c = compiled[k.name]
        assert c.local_bytes == 0, f"{k.name} spills {c.local_bytes} bytes per thread"
        assert c.shared_bytes <= H100_SHARED, f"{k.name} needs {c.shared_bytes} B of shared"
        if k.dots:
            assert c.tensor_core > 0, f"{k.name} has {k.dots} tl.dot but no HGMMA/HMMA"
        else:
            assert c.tensor_core == 0


def test_causal_attention_uses_warpgroup_mma_and_pipelined_copies():
    """On sm_90a causal Flash Attention's two contractions are warpgroup MMAs (HGMMA), fed by
    asynchronous global-to-shared copies of K and V (LDGSTS): the loop over the visited key
    blocks is one Triton can pipeline."""
    path = next(e for e in EXAMPLES if e.stem == "causal_attention")
    module = triton_gen.generate(fused(lower(load_program(path))))
    (c,) = triton_gen.compile_offline(module).values()
    assert c.count("HGMMA") > 0 and c.count("LDGSTS") > 0


def test_bf16_attention_multiplies_bf16_on_the_matrix_unit():
    """P is rounded to bf16 before P @ V, as FlashAttention does: both contractions are bf16
    warpgroup MMAs accumulating in f32, not f32 emulated with TF32."""
    path = next(e for e in EXAMPLES if e.stem == "causal_attention")
    p = with_dtype(lower(load_program(path, {"h": (2, 1), "q": (1024, 64), "k": (1024, 64)})),
                   "bf16")
    module = triton_gen.generate(fused(p))
    assert "input_precision" not in module.source
    (c,) = triton_gen.compile_offline(module).values()
    hgmma = [line for line in c.sass.splitlines() if "HGMMA" in line]
    assert hgmma and all(".BF16" in line for line in hgmma)


# --------------------------------------------------------------------------------------------
# The command line


def test_codegen_writes_a_triton_module(tmp_path, capsys):
    out = tmp_path / "attention.py"
    path = str(next(e for e in EXAMPLES if e.stem == "attention"))
    assert main(["codegen", path, "--backend", "triton", "--precision", "ieee",
                 "--dim", "q=256/64", "--dim", "k=256/64", "-o", str(out)]) == 0
    text = out.read_text()
    assert "@triton.jit" in text and 'input_precision="ieee"' in text
    compile(text, str(out), "exec")


def test_run_with_the_triton_backend_compares_with_the_dense_program(capsys):
    path = str(next(e for e in EXAMPLES if e.stem == "softmax"))
    assert main(["run", path, "--backend", "triton", "--dim", "r=64/16",
                 "--dim", "c=96/32"]) == 0
    assert ": ok" in capsys.readouterr().out


def test_unknown_precision_is_refused():
    with pytest.raises(UsageError, match="unknown precision"):
        triton_gen.generate(small_example(EXAMPLES[0]), precision="fp8")


def test_bf16_programs_are_refused_by_the_interpreter_with_a_reason():
    p = with_dtype(small_example(next(e for e in EXAMPLES if e.stem == "softmax")), "bf16")
    with pytest.raises(UsageError, match="bf16"):
        triton_gen.run_interpreted(triton_gen.generate(p), random_inputs(p, seed=0))



# --------------------------------------------------------------------------------------------
# Tuning warps and stages (the module's `tune`; its timings need a GPU, so they are replaced)


class OutOfResources(Exception):
    """Named as Triton's: a configuration too big for the GPU."""


def test_tune_keeps_each_kernels_fastest_configuration_that_fits():
    module = triton_gen.generate(fused(small_example(
        next(e for e in EXAMPLES if e.stem == "decoder_layer"))))
    ns = module.namespace()
    names = [k[0] for k in ns["KERNELS"]]
    assert len(names) > 1
    calls = []

    def fake_run(**inputs):  # launches with KERNELS as they are; too big at 8 warps, 2 stages
        configs = [tuple(k[4:]) for k in ns["KERNELS"]]
        if (8, 2) in configs:
            raise OutOfResources("shared memory")
        calls.append(configs)

    def fake_milliseconds(inputs):  # every kernel faster with more warps and stages but one
        ns["run"](**inputs)
        return sum(10.0 / (w * s) if j != 1 else w * s for j, (w, s) in enumerate(calls[-1]))

    ns["run"], ns["_milliseconds"] = fake_run, fake_milliseconds
    timings = ns["tune"]()
    assert list(timings) == names
    for j, name in enumerate(names):
        assert (8, 2) not in timings[name] and len(timings[name]) == 3
        assert tuple(ns["KERNELS"][j][4:]) == ((4, 2) if j == 1 else (8, 3))


def test_tune_says_when_no_configuration_fits():
    module = triton_gen.generate(fused(masked_attention("k <= q")))
    ns = module.namespace()

    def too_big(**inputs):
        raise OutOfResources("registers")

    ns["run"], ns["DEVICE"] = too_big, "cpu"  # the wall-clock timer: no GPU to time with
    with pytest.raises(RuntimeError, match="no configuration"):
        ns["tune"]()


def test_graphed_compiles_outside_the_capture_and_replays_it(monkeypatch):
    """`graphed` (CUDA graphs need a GPU, so torch's graph API is replaced by a recorder):
    every kernel launched once before the capture (a first launch compiles, which a capture
    cannot hold), launched once inside it, and each replay reruns the capture and returns the
    stored tensors, whose buffers live as long as the replay."""
    module = triton_gen.generate(fused(masked_attention("k <= q")))
    ns = module.namespace()
    events: list[str] = []

    class Capture:
        def __init__(self, graph):
            self.graph = graph

        def __enter__(self):
            events.append("capture")

        def __exit__(self, *exc):
            events.append("end")

    class Graph:
        def replay(self):
            events.append("replay")

    cuda = types.SimpleNamespace(synchronize=lambda: events.append("sync"), CUDAGraph=Graph,
                                 graph=Capture)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    memory = {name: np.zeros(shape, np.float32)
              for name, (shape, *_) in ns["TENSORS"].items()}

    def launch(buffers):
        assert buffers is memory
        events.append("launch")

    ns["_memory"], ns["_launch"] = (lambda inputs: memory), launch
    replay = ns["graphed"]()
    assert events == ["launch", "sync", "capture", "launch", "end"]
    assert replay.memory is memory
    out = replay()
    assert events[-1] == "replay" and set(out) == set(ns["OUTPUTS"])
    assert all(np.shares_memory(out[t], memory[t]) for t in out)
