"""The numpy backend against the reference interpreter and the dense evaluator.

Every example at small shapes (several blocks per axis, non-square blocks, and one block per
axis), hand-built fused programs (Flash Attention with an online-softmax monoid, LayerNorm +
matmul with a Welford monoid, both built in `irbuild` and unknown to the backend), kernels of
several stores and map loops (the block programs of tests/programs/multi, a fused example, and
small hand-written kernels), the loops the generated code runs (exactly the schedule's), its
peak memory, and random programs.
"""

from __future__ import annotations

import gc
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from bbrules import dense, interp
from bbrules.blockfile import load_block_program, parse_block_program
from bbrules.codegen import numpy_gen, numpy_plan, numpy_runtime
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import (SUM, MAX, BlockProgram, BlockReduce, Const, Dot, Get, Load, Monoid, Reduce, Store,
                        Unary, Var)
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.plan import plan_for
from bbrules.targets import get_target

from irbuild import (add, attention_reference, div, flash_attention, mul, online_softmax,
                     program, rand, reshaped_dims, sub, welford_stats)
from strategies import programs
from test_views import ROPE_BY_SLICES

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.bbp"))
MULTI_DIR = Path(__file__).parent / "programs" / "multi"
MULTI = sorted(MULTI_DIR.glob("*.bbk"))
H100 = get_target("h100")

# Small replacement (extent, block) pairs: several blocks of unequal sizes per axis, and a
# one-block variant.  Dims that are equal in an example stay equal (renaming needs it).
SEVERAL_BLOCKS = [(24, 8), (32, 16), (36, 12), (20, 4), (16, 8)]
ONE_BLOCK = [(8, 8), (12, 12), (16, 16), (6, 6), (10, 10)]


def small_dims(path: Path, pool: list[tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Overrides giving each distinct (extent, block) of the example the next pair of `pool`."""
    distinct: dict[tuple[int, int], tuple[int, int]] = {}
    out = {}
    program = load_program(path)
    fixed = reshaped_dims(program)
    for d in program.dims.values():
        if d.name in fixed:
            out[d.name] = (d.extent, d.block)
            continue
        key = (d.extent, d.block)
        if key not in distinct:
            distinct[key] = pool[len(distinct) % len(pool)]
        out[d.name] = distinct[key]
    return out


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Within 1e-4 of the largest finite magnitude; infinities (masked scores) must match."""
    scale = max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=what)


def python_loops(source: str) -> int:
    return len(re.findall(r"^\s*for \w+ in range\(", source, re.MULTILINE))


def scheduled_loops(p: BlockProgram) -> int:
    """Loops the kernels' plans run with more than one iteration (one-block loops need no
    `for`), at the block sizes numpy runs them (`coarsened`)."""
    cap = H100.local_capacity
    return sum(1 for k in p.kernels
               for loop in plan_for(p, numpy_plan.coarsened(p, k, cap), cap).loops
               if loop.trips > 1)


@pytest.mark.parametrize("pool", [SEVERAL_BLOCKS, ONE_BLOCK], ids=["several", "one-block"])
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_match_interpreter_and_dense(path, pool):
    ast = load_program(path, dims=small_dims(path, pool))
    block = lower(ast)
    inputs = random_inputs(ast, seed=1)
    source = numpy_gen.generate(block)
    got = numpy_gen.run(block, inputs)
    ref = interp.run(block, inputs)
    want = dense.evaluate(ast, inputs, dtype=np.float64)
    assert set(got) == set(ref) == {s.tensor for s in block.stores}
    for name in got:
        assert got[name].dtype == np.float32
        assert got[name].shape == ref[name].shape
        assert_close(got[name], ref[name], f"{path.stem}: {name} vs interpreter")
        assert_close(got[name], want[name], f"{path.stem}: {name} vs dense")
    assert python_loops(source) == scheduled_loops(block)


# --------------------------------------------------------------------------------------------
# Hand-built fused programs with monoids the backend does not know.


# Finalizes to (l, o): the stored output divides the two results outside the fold.
LO_SOFTMAX = online_softmax("test_online_softmax", (Var("l"), Var("o")))


def flash(n: int, d: int, bq: int, bk: int) -> BlockProgram:
    """Flash Attention over n queries and n keys, reading o / l from the fold's two results."""
    return flash_attention(n, bq, n, bk, d, LO_SOFTMAX,
                           lambda fold: div(Get(1, fold), Get(0, fold)))


@pytest.mark.parametrize("n, d, bq, bk", [(48, 8, 16, 12), (64, 16, 64, 8), (32, 4, 8, 32)])
def test_flash_attention_matches_plain_attention(n, d, bq, bk, walked_folds):
    p = flash(n, d, bq, bk)
    inputs = {"Q": rand(n, d, seed=1), "K": rand(n, d, seed=2), "V": rand(n, d, seed=3)}
    got = numpy_gen.run(p, inputs)["O"]
    assert_close(got, interp.run(p, inputs)["O"], "vs interpreter")
    assert_close(got, attention_reference(inputs["Q"], inputs["K"], inputs["V"]), "vs numpy")
    assert python_loops(numpy_gen.generate(p)) == (1 if n // bk > 1 else 0)


def test_an_online_softmax_over_one_key_block_is_that_blocks_state():
    """combine(identity, b) = b, the monoid's identity law: over one key block the fold's
    state is the block's maximum, sum and product, with no rescaling by exp(m - m') and no
    identity's zeros added (one exp, that of the scores), and the output is theirs."""
    n, d = 32, 4
    p = flash(n, d, 8, n)
    code = numpy_gen.generate(p)
    kernel = code[code.index("def kernel_"):code.index("def _input")]
    assert kernel.count("np.exp(") == 1 and "-inf" not in kernel, kernel
    inputs = {"Q": rand(n, d, seed=4), "K": rand(n, d, seed=5), "V": rand(n, d, seed=6)}
    got = numpy_gen.run(p, inputs)["O"]
    assert_close(got, interp.run(p, inputs)["O"], "vs interpreter")
    assert_close(got, attention_reference(inputs["Q"], inputs["K"], inputs["V"]), "vs numpy")


def test_an_online_softmax_with_small_tiles_is_one_block_of_the_whole_axis():
    """Over 64 keys in blocks of 16 the scores of all queries at once are a small tile
    (`WHOLE_FOLD_TILE`): the fold takes the whole axis in one block, its contribution the
    state (no loop, no rescaling, no identity); a tile too large for that keeps the loop."""
    p = flash(64, 16, 16, 16)
    code = numpy_gen.generate(p)
    assert python_loops(code) == 0 and "-inf" not in code.split("def kernel_O")[1], code
    inputs = {"Q": rand(64, 16, seed=1), "K": rand(64, 16, seed=2), "V": rand(64, 16, seed=3)}
    assert_close(numpy_gen.run(p, inputs)["O"],
                 attention_reference(inputs["Q"], inputs["K"], inputs["V"]), "vs numpy")
    assert python_loops(numpy_gen.generate(flash(1024, 16, 64, 64))) == 1


def test_a_fold_reading_a_fold_of_its_own_axis_is_free_to_take_larger_blocks():
    """A softmax in two passes, the sum of exp(s - max) over k after the maximum over k: the
    sum's contribution reads the maximum's in-block reduction (`bmax`), which is the
    maximum's own, not the sum's, so both walk k in one block."""
    text = ("# bbrules block program\ndim q = 64 / 16\ndim k = 256 / 64\ndim d = 16 / 16\n"
            "input S[q, k] : f32\ninput V[k, d] : f32\noutput O[q, d] : f32\n\n"
            "kernel [q]:\n  O[q, d] = reduce(k, sum, dot(k, exp(load(S[q, k]) - "
            "reduce(k, max, bmax(k, load(S[q, k])))), load(V[k, d])))\n")
    p = parse_block_program(text).program
    assert numpy_plan.coarsened(p, p.kernels[0], H100.local_capacity).blocks == (("k", 256),)
    assert python_loops(numpy_gen.generate(p)) == 0
    inputs = random_inputs(p, seed=4)
    s, v = (inputs[x].astype(np.float64) for x in "SV")
    want = np.exp(s - s.max(axis=1, keepdims=True)) @ v
    assert_close(numpy_gen.run(p, inputs)["O"], want, "vs numpy")
    assert_matches_interpreter(p, inputs)


def test_the_scores_of_a_key_loop_are_multiplied_column_major(walked_folds):
    """Q K^T inside the loop over key blocks, whose row maxima and sums reduce across its
    columns: computed as (K Q^T)^T, a transposed view, so each reduction runs over
    contiguous memory; P V, whose columns are features, is an ordinary product."""
    p = flash(64, 16, 16, 16)
    source = numpy_gen.generate(p)
    products = re.findall(r"np\.matmul\(.*", source)
    assert len(products) == 2 and sum(".swapaxes(-1, -2)" in m for m in products) == 1
    inputs = {"Q": rand(64, 16, seed=1), "K": rand(64, 16, seed=2), "V": rand(64, 16, seed=3)}
    assert_close(numpy_gen.run(p, inputs)["O"],
                 attention_reference(inputs["Q"], inputs["K"], inputs["V"]), "vs numpy")


def test_fused_attention_never_allocates_n_by_n():
    n, d, bk = 1024, 16, 64
    fused = numpy_gen.load(flash(n, d, 64, bk))
    unfused_ast = parse_program(
        "dim q = 1024 / 64\ndim k = 1024 / 64\ndim d = 16\n"
        "input Q[q, d], K[k, d], V[k, d] : f32\n"
        "S[q, k] = sum[d] Q[q, d] * K[k, d] * 0.25\n"
        "M[q] = max[k] S[q, k]\nE[q, k] = exp(S[q, k] - M[q])\n"
        "L[q] = sum[k] E[q, k]\nO[q, d] = sum[k] E[q, k] * V[k, d] / L[q]\noutput O\n")
    unfused = numpy_gen.load(lower(unfused_ast))
    inputs = {"Q": rand(n, d, seed=1), "K": rand(n, d, seed=2), "V": rand(n, d, seed=3)}
    n_by_n = n * n * 4

    def peak(module) -> int:
        tracemalloc.start()
        try:
            module.run(**inputs)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # One score tile (all queries x one key block) and a few N x d accumulators: the loop
    # overwrites its dying temporaries, as the hand-written loop does, instead of allocating.
    assert peak(fused) <= n * bk * 4 + 4 * n * d * 4 + 2**16
    assert peak(unfused) >= 2 * n_by_n  # S and E are materialised


def layernorm_matmul(m: int, e: int, n: int, bm: int, be: int, bn: int) -> BlockProgram:
    """Y = LayerNorm(X) @ W, fused by hand with the mean deferred (the standard pack's co-moment
    form is tests/test_norm_numerics.py's): rstd * (X @ GW - mean * 1^T GW) + B @ W, every
    reduction over e in one loop (the scheduler merges the four siblings)."""
    x, g, b, wt = Load("X", ("m", "e")), Load("G", ("e",)), Load("B", ("e",)), Load("W", ("e", "n"))
    stats = welford_stats(x, "e", be)
    gw = mul(g, wt)
    xgw = Reduce("e", SUM, Dot("e", x, gw))
    ones_gw = Reduce("e", SUM, BlockReduce("sum", "e", gw))
    bw = Reduce("e", SUM, Dot("e", b, wt))
    rstd = Unary("rsqrt", add(Get(1, stats), Const(1e-5)))
    y = add(mul(rstd, sub(xgw, mul(Get(0, stats), ones_gw))), bw)
    return program({"m": (m, bm), "e": (e, be), "n": (n, bn)},
                   {"X": ("m", "e"), "G": ("e",), "B": ("e",), "W": ("e", "n")},
                   [Store("Y", ("m", "n"), y)])


def test_welford_layernorm_matmul_runs_in_one_loop():
    p = layernorm_matmul(24, 32, 20, 8, 8, 4)
    # rows with a large mean: a one-pass sum-of-squares variance would lose its digits here
    inputs = {"X": rand(24, 32, seed=1, loc=100.0), "G": rand(32, seed=2), "B": rand(32, seed=3),
              "W": rand(32, 20, seed=4)}
    x = inputs["X"].astype(np.float64)
    xn = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    want = (xn * inputs["G"] + inputs["B"]) @ inputs["W"]
    got = numpy_gen.run(p, inputs)["Y"]
    assert_close(got, interp.run(p, inputs)["Y"], "vs interpreter")
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    source = numpy_gen.generate(p)
    assert python_loops(source) == 1
    assert "test_welford" in source and "test_welford" not in Path(numpy_gen.__file__).read_text()


@pytest.mark.parametrize("block", [4, 16], ids=["four-blocks", "one-block"])
def test_layernorm_statistics_over_the_grid_axis_itself(block):
    """The store's grid includes e and a reduction loops over e: inside the loop, e is the
    loop's block; outside, every block of the grid.  Over one block the fold is simplified
    (no loop), which must not change the statistics."""
    x = Load("X", ("m", "e"))
    stats = welford_stats(x, "e", block)
    y = mul(sub(x, Get(0, stats)), Unary("rsqrt", add(Get(1, stats), Const(1e-5))))
    p = program({"m": (12, 4), "e": (16, block)}, {"X": ("m", "e")},
                [Store("Y", ("m", "e"), y)])
    inputs = {"X": rand(12, 16, seed=5, loc=3.0)}
    x64 = inputs["X"].astype(np.float64)
    want = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    got = numpy_gen.run(p, inputs)["Y"]
    assert_close(got, interp.run(p, inputs)["Y"], "vs interpreter")
    assert_close(got, want, "vs numpy")


def test_a_sum_over_one_block_is_its_contribution():
    """No pass adding the identity: the contraction's result is stored as it is."""
    value = Reduce("d", SUM, Dot("d", Load("Q", ("q", "d")), Load("K", ("k", "d"))))
    p = program({"q": (16, 8), "k": (12, 4), "d": (8, 8)}, {"Q": ("q", "d"), "K": ("k", "d")},
                [Store("S", ("q", "k"), value)])
    inputs = {"Q": rand(16, 8, seed=1), "K": rand(12, 8, seed=2)}
    source = numpy_gen.generate(p)
    body = source[source.index("def kernel_S"):source.index("def _input")]
    assert "np.matmul" in body and not re.search(r"np\.add|\+ |np\.empty", body)
    assert_close(numpy_gen.run(p, inputs)["S"], inputs["Q"] @ inputs["K"].T, "vs numpy")


def test_a_chunk_computed_anew_is_stored_as_it_is():
    """A split of a sum (GPT-2's Q as the first chunk of its QKV projection plus its bias,
    once the bias is forwarded into the split): the chunk's sum is a new array, which the
    store returns, not a copy of it; a chunk that is a view of an input is still copied."""
    ast = parse_program("dim r = 128 / 64\ndim t = 3 / 1\ndim c = 256 / 64\n"
                        "input X[r, t, c] : f32\ninput B[t, c] : f32\n"
                        "Q[r, c] = sum[t] where(t == 1, X[r, t, c] + B[t, c], 0)\n"
                        "V[r, c] = sum[t] where(t == 2, X[r, t, c], 0)\noutput Q\noutput V\n")
    p = lower(ast)
    inputs = random_inputs(ast, seed=3)
    source = numpy_gen.generate(p)
    assert "np.empty" not in kernel_body(source, "kernel_Q"), source
    assert "np.empty" in kernel_body(source, "kernel_V"), source
    got, want = numpy_gen.run(p, inputs), dense.evaluate(ast, inputs, dtype=np.float64)
    for name in ("Q", "V"):
        assert_close(got[name], want[name], f"{name} vs dense")
    assert not np.shares_memory(got["V"], inputs["X"])


def test_a_temporary_an_accumulator_aliases_is_not_overwritten():
    """A monoid whose combine passes the contribution through ("last block") makes the
    accumulator alias that array; a later step must not write into it in place."""
    last = Monoid("test_last", ("s",), (Const(0.0),), (Var("b.s"),), (Var("s"),))
    e = Unary("exp", Load("A", ("q",)))
    y = add(Reduce("k", last, e), Unary("neg", e))
    p = program({"q": (8, 4), "k": (6, 2)}, {"A": ("q",)}, [Store("Y", ("q",), y)])
    inputs = {"A": rand(8, seed=1)}
    got = numpy_gen.run(p, inputs)["Y"]
    assert_close(got, interp.run(p, inputs)["Y"], "vs interpreter")
    assert np.allclose(got, 0.0, atol=1e-6)  # exp(a) - exp(a)


def test_transposed_store_renamed_load_and_scalar_tiles():
    """A store whose axes are not the load's order, a tensor loaded under other axis names,
    and an all-constant subterm."""
    a = Load("A", ("i", "j"))
    twin = Load("A", ("i", "t"))
    c = Unary("exp", add(Const(1.0), Const(0.5)))
    value = mul(sub(a, Reduce("t", MAX, BlockReduce("max", "t", twin))), c)
    p = program({"i": (6, 3), "j": (8, 4), "t": (8, 4)}, {"A": ("i", "j")},
                [Store("T", ("j", "i"), value)])
    inputs = {"A": rand(6, 8, seed=3)}
    got = numpy_gen.run(p, inputs)["T"]
    want = ((inputs["A"] - inputs["A"].max(1, keepdims=True)) * np.exp(1.5)).T
    assert got.shape == (8, 6)
    assert_close(got, want, "vs numpy")


def test_inputs_are_checked():
    p = flash(16, 4, 8, 8)
    module = numpy_gen.load(p)
    with pytest.raises(ValueError, match="missing input 'V'"):
        module.run(Q=rand(16, 4), K=rand(16, 4))
    with pytest.raises(ValueError, match=r"input 'K' has shape \(4, 16\)"):
        module.run(Q=rand(16, 4), K=rand(4, 16), V=rand(16, 4))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs(source):
    ast = parse_program(source, "<random>")
    block = lower(ast)
    inputs = random_inputs(ast, seed=0)
    got = numpy_gen.run(block, inputs)
    ref = interp.run(block, inputs)
    want = dense.evaluate(ast, inputs, dtype=np.float64)
    for name in ref:
        assert_close(got[name], ref[name], f"{name} vs interpreter in\n{source}")
        assert_close(got[name], want[name], f"{name} vs dense in\n{source}")


# --------------------------------------------------------------------------------------------
# Kernels of several stores, and map loops: a store's axes outside the grid.


def kernel_body(source: str, fn: str) -> str:
    """The text of generated function `fn`."""
    start = source.index(f"def {fn}(")
    return source[start:source.index("\n\n\n", start)]


def assert_matches_interpreter(p: BlockProgram, inputs: dict[str, np.ndarray]) -> None:
    got = numpy_gen.run(p, inputs)
    ref = interp.run(p, inputs)
    assert set(got) == set(ref) == {s.tensor for s in p.stores}
    for name in ref:
        assert got[name].dtype == np.float32
        assert got[name].shape == ref[name].shape
        assert not np.isnan(ref[name]).any(), f"{name}: the interpreter left blocks unwritten"
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_multi_store_programs_are_what_these_tests_cover():
    assert {p.stem for p in MULTI} == {"rowsum_add", "softmax_row", "stats_then_normalise",
                                       "one_processor", "qkv"}
    programs = {path.stem: load_block_program(path).program for path in MULTI}
    assert any(len(k.stores) > 1 for p in programs.values() for k in p.kernels)
    assert any(k.map_axes(s) for p in programs.values() for k in p.kernels for s in k.stores)
    assert any(not k.grid for p in programs.values() for k in p.kernels)


@pytest.mark.parametrize("path", MULTI, ids=[p.stem for p in MULTI])
def test_multi_store_programs_match_interpreter(path):
    p = load_block_program(path).program
    assert_matches_interpreter(p, random_inputs(p, seed=0))
    source = numpy_gen.generate(p)
    assert python_loops(source) == scheduled_loops(p)
    cap = H100.local_capacity
    for k in p.kernels:
        body = kernel_body(source, f"kernel_{k.name}")
        assert body.rstrip().endswith(f"return {', '.join(k.tensors)}")
        coarse = numpy_plan.coarsened(p, k, cap)
        walked = {loop.axis for loop in plan_for(p, coarse, cap).loops if loop.trips > 1}
        for s in k.stores:  # a store in a map loop of several blocks writes one per iteration
            looped = [a for a in k.map_axes(s) if a in walked]
            written = re.findall(rf"^\s*{s.tensor}\[(.*)\] = ", body, re.MULTILINE)
            assert bool(written) == bool(looped), s.tensor
            assert all(re.search(rf"{a}0_*:{a}0_* \+ {p.in_kernel(coarse).block(a)}", written[0])
                       for a in looped)


def test_one_processor_nests_map_loops_over_every_axis(monkeypatch):
    """`kernel []`: no grid, so c walks i and then j, and s shares both loops (its sum over j
    is folded in c's loop over j, which loads a and b once).  Tiles of 8 x 16 at most keep
    the blocks the plan gives (`coarsened`)."""
    monkeypatch.setattr(numpy_plan, "COARSE_TILE", 8 * 16)
    p = load_block_program(MULTI_DIR / "one_processor.bbk").program
    body = kernel_body(numpy_gen.generate(p), "kernel_c_s")
    assert python_loops(body) == 2
    assert re.search(r"^        for j0 in range", body, re.MULTILINE)  # nested in the i loop
    assert body.count("a[") == body.count("b[") == 1
    assert "c[i0:i0 + 8, j0:j0 + 16] = " in body and "s[i0:i0 + 8] = " in body


def test_a_map_loop_is_one_block_where_the_tiles_allow(monkeypatch):
    """RoPE's cosine half as a fused import leaves it: a kernel over t storing every head,
    [h, t, d], from Q[t, h, d].  The map loop over h is one block of four heads, its store the
    tile as it is (h leads the layout); small tiles keep the plan's loop of one head each."""
    text = ("# bbrules block program\ndim t = 64 / 16\ndim h = 4 / 1\ndim d = 32 / 32\n"
            "input Q[t, h, d] : f32\ninput C[t, d] : f32\noutput R[h, t, d] : f32\n\n"
            "kernel [t]:\n  R[h, t, d] = load(Q[t, h, d]) * load(C[t, d])\n")
    p = parse_block_program(text).program
    inputs = random_inputs(p, seed=3)
    want = np.einsum("thd,td->htd", inputs["Q"].astype(np.float64), inputs["C"])
    body = kernel_body(numpy_gen.generate(p), "kernel_R")
    assert python_loops(body) == 0 and "transpose" not in body.split("R = ")[1]
    np.testing.assert_allclose(numpy_gen.run(p, inputs)["R"], want, rtol=1e-6)
    assert_matches_interpreter(p, inputs)
    monkeypatch.setattr(numpy_plan, "COARSE_TILE", 64 * 32)
    body = kernel_body(numpy_gen.generate(p), "kernel_R")
    assert python_loops(body) == 1 and re.search(r"R\[h0:h0 \+ 1\] = ", body)
    np.testing.assert_allclose(numpy_gen.run(p, inputs)["R"], want, rtol=1e-6)


def test_fused_rowsum_add_is_one_kernel_that_matches_the_interpreter():
    path = Path(__file__).parent.parent / "examples" / "rowsum_add.bbp"
    ast = load_program(path, dims={"i": (64, 16), "j": (1024, 256)})
    p = fuse(lower(ast), load_packs([]), get_target("h100")).program
    assert len(lower(ast).kernels) == 2
    assert len(p.kernels) == 1
    (k,) = p.kernels
    assert set(k.tensors) == {"c", "d"} and k.grid == ("i",)
    inputs = random_inputs(ast, seed=0)
    assert_matches_interpreter(p, inputs)
    got = numpy_gen.run(p, inputs)
    assert_close(got["d"], inputs["b"].sum(1), "d vs numpy")
    body = kernel_body(numpy_gen.generate(p), f"kernel_{k.name}")
    assert python_loops(body) == 1 and body.count("b[") == 1  # b is read once


def bbk(body: str, dims: str = "dim i = 24 / 8\ndim j = 32 / 16\n") -> BlockProgram:
    return parse_block_program(dims + body).program


def test_map_loop_over_the_leading_axis_of_a_store():
    """The grid is the store's last axis: each iteration writes rows i0:i0 + 8, all columns."""
    p = bbk("input a[i, j] : f32\noutput c[i, j] : f32\noutput s[j] : f32\n"
            "kernel [j]:\n"
            "  c[i, j] = exp(load(a[i, j]))\n"
            "  s[j] = reduce(i, sum, bsum(i, load(a[i, j])))\n")
    inputs = random_inputs(p, seed=2)
    assert_matches_interpreter(p, inputs)
    body = kernel_body(numpy_gen.generate(p), "kernel_c_s")
    assert "c[i0:i0 + 8] = " in body and python_loops(body) == 1


def test_grid_in_another_order_than_the_store_axes():
    p = bbk("input a[i, j] : f32\noutput c[i, j] : f32\n"
            "kernel [j, i]:\n  c[i, j] = load(a[i, j]) * 3\n")
    assert p.kernels[0].grid == ("j", "i")
    inputs = random_inputs(p, seed=3)
    assert_matches_interpreter(p, inputs)
    assert_close(numpy_gen.run(p, inputs)["c"], inputs["a"] * 3, "vs numpy")


def test_a_map_axis_of_one_block_has_no_loop():
    p = bbk("input a[i, j] : f32\noutput c[i, j] : f32\noutput s[i] : f32\n"
            "kernel [i]:\n"
            "  c[i, j] = load(a[i, j]) + 1\n"
            "  s[i] = reduce(j, sum, bsum(j, load(a[i, j])))\n",
            dims="dim i = 24 / 8\ndim j = 16 / 16\n")
    assert_matches_interpreter(p, random_inputs(p, seed=4))
    assert python_loops(numpy_gen.generate(p)) == 0


def test_stores_of_one_value_get_arrays_of_their_own():
    """Two stores of one fresh tile outside every loop: the first may return the tile itself,
    the second must copy it."""
    p = bbk("input a[i, j] : f32\noutput x[i, j] : f32\noutput y[i, j] : f32\n"
            "kernel [i, j]:\n"
            "  x[i, j] = exp(load(a[i, j]))\n"
            "  y[i, j] = exp(load(a[i, j]))\n")
    inputs = random_inputs(p, seed=5)
    assert_matches_interpreter(p, inputs)
    got = numpy_gen.run(p, inputs)
    assert not np.shares_memory(got["x"], got["y"])
    got["x"][...] = 0.0
    assert_close(got["y"], np.exp(inputs["a"]), "y after overwriting x")


def test_a_row_softmax_stored_block_by_block_allocates_only_tiles():
    """The statistics loop and the map loop each hold one column block of every row: nothing
    of the row's full width is allocated but the output."""
    r, c, bc = 256, 4096, 256
    text = (MULTI_DIR / "softmax_row.bbk").read_text()
    assert "dim r = 64 / 16\ndim c = 128 / 32\n" in text
    p = parse_block_program(text.replace("dim c = 128 / 32", f"dim c = {c} / {bc}")
                            .replace("dim r = 64 / 16", f"dim r = {r} / 16")).program
    module = numpy_gen.load(p)
    inputs = {"X": rand(r, c, seed=6)}
    tracemalloc.start()
    try:
        got = module.run(**inputs)["Y"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    x = inputs["X"].astype(np.float64)
    want = np.exp(x - x.max(1, keepdims=True))
    assert_close(got, want / want.sum(1, keepdims=True), "vs numpy")
    tile = r * bc * 4
    assert peak <= r * c * 4 + 2 * tile + 2**16


@pytest.mark.parametrize("operand", ["A[m, k]", "sigmoid(A[m, k])"], ids=["loaded", "computed"])
def test_a_contraction_loop_runs_in_blocks_as_large_as_the_tiles_allow(monkeypatch, operand):
    """Blocks sized for a GPU's local memory make numpy add 64-wide partial products in
    passes of their own; numpy contracts as much of the axis at once as `COARSE_TILE` allows
    the tiles it computes, and the result is the matmul's.  A loaded tile is a view of the
    tensor, which bounds nothing: Phi-3's fused gate-and-up weight, 768 x 6144, kept its
    product in two passes of 384 and an addition."""
    source = ("dim m = 256 / 64\ndim n = 128 / 64\ndim k = 1024 / 64\n"
              f"input A[m, k], B[k, n] : f32\nC[m, n] = sum[k] {operand} * B[k, n]\noutput C\n")
    p = lower(parse_program(source))
    inputs = random_inputs(parse_program(source), seed=3)
    a = inputs["A"].astype(np.float64)
    want = (a if operand.startswith("A") else 1 / (1 + np.exp(-a))) @ inputs["B"]
    # the A tile holds all 256 rows at once: 256 x 1024 elements fit, one matmul
    assert numpy_plan.coarsened(p, p.kernels[0], H100.local_capacity).blocks == (("k", 1024),)
    assert python_loops(numpy_gen.generate(p)) == 0
    assert_close(numpy_gen.run(p, inputs)["C"], want, "one block")
    # a quarter of that fits: four blocks of 256 for a computed tile, a loop of four
    monkeypatch.setattr(numpy_plan, "COARSE_TILE", 256 * 256)
    block = 1024 if operand.startswith("A") else 256
    assert numpy_plan.coarsened(p, p.kernels[0], H100.local_capacity).blocks == (("k", block),)
    assert ("for k0 in range(0, 1024, 256):" in numpy_gen.generate(p)) == (block == 256)
    assert_close(numpy_gen.run(p, inputs)["C"], want, f"blocks of {block}")


def test_axes_summed_into_one_matmul_count_only_its_result(monkeypatch):
    """An output projection of grouped heads sums over (heads, group, d), the group in
    blocks of one.  The sums within a block and the contraction are one matmul whose result
    spans neither the heads nor the group, so the group's block may grow as the heads' did:
    one matmul over all 512 contracted elements and no loop, where counting the product's
    own tile (all heads and groups at once) had kept a loop over the group: two matmuls half
    as deep, added in a pass of their own."""
    source = ("dim t = 512 / 64\ndim h = 4 / 1\ndim g = 2 / 1\ndim d = 64\ndim n = 512 / 64\n"
              "input A[h, g, t, d], W[h, g, d, n] : f32\n"
              "Y[t, n] = sum[h, g, d] A[h, g, t, d] * W[h, g, d, n]\noutput Y\n")
    ast = parse_program(source)
    p = lower(ast)
    monkeypatch.setattr(numpy_plan, "COARSE_TILE", 1 << 20)  # 4 x 2 x 512 x 512 would not fit
    k = numpy_plan.summed_inward(p, p.kernels[0])
    assert dict(numpy_plan.coarsened(p, k, H100.local_capacity).blocks) == {"h": 4, "g": 2}
    code = numpy_gen.generate(p)
    assert python_loops(code) == 0 and code.count("np.matmul") == 1
    assert ".reshape(512, 512)" in code
    inputs = random_inputs(ast, seed=5)
    want = np.einsum("hgtd,hgdn->tn", inputs["A"].astype(np.float64),
                     inputs["W"].astype(np.float64))
    assert_close(numpy_gen.run(p, inputs)["Y"], want, "vs numpy")


@pytest.mark.parametrize("vocab, hot, ids_type", [
    (256, "where(IDS[t] == v, 1, 0)", "f32"),
    (256, "where(IDS[t] == v or IDS[t] == v - 256, 1, 0)", "f32"),
    (256, "where(IDS[t] == v or IDS[t] == v - 256, 1, 0)", "i32"),
    (257, "where(IDS[t] == v, 1, 0)", "f32"),
    (257, "(IDS[t] == v)", "f32"),
])
def test_a_one_hot_contraction_is_a_gather(vocab, hot, ids_type):
    """An embedding lookup as models import it, a sum over the vocabulary of a one-hot times
    the table, is a gather in numpy: no matmul by a matrix of zeros, no loop over the
    vocabulary's blocks.  Ids out of range or not whole pick nothing, as the one-hot does;
    negative ids wrap with the second equality (ONNX's Gather): numpy's indexing, one take
    (`lookup`), which need not check that ids declared i32 are whole.  A vocabulary of 257 in
    blocks of 64 masks both operands past 257: the values carry the mask, so the one-hot's
    copy of it does not keep the gather from being one, and the padding is never picked.  A
    comparison is a one-hot as it stands (its values are 1 and 0)."""
    source = (f"dim t = 64 / 16\ndim v = {vocab} / 64\ndim e = 32\ninput IDS[t] : {ids_type}\n"
              f"input E[v, e] : f32\nX[t, e] = sum[v] {hot} * E[v, e]\noutput X\n")
    ast = parse_program(source)
    p = lower(ast)
    code = numpy_gen.generate(p)
    wraps = " or " in hot
    assert ("lookup(" if wraps else "gather_one_hot(") in code and "np.matmul" not in code
    assert python_loops(code) == 0 and ("whole=True" in code) == (ids_type == "i32")
    inputs = random_inputs(ast, seed=2)
    ids = np.random.default_rng(3).integers(-vocab, 320, 64).astype(np.float32)
    ids[:6] = [300, -300, 2.5 if ids_type == "f32" else 3, vocab - 1, 257, 319]
    inputs["IDS"] = ids
    got = numpy_gen.run(p, inputs)["X"]
    assert_close(got, interp.run(p, inputs)["X"], "vs interpreter")
    assert_close(got, dense.evaluate(ast, inputs, np.float64)["X"], "vs dense")
    rows = [inputs["E"][int(i) % vocab] if (0 <= i < vocab or wraps and -vocab <= i < 0)
            and i == int(i) else np.zeros(32) for i in ids]
    np.testing.assert_allclose(got, np.array(rows), rtol=1e-6)


def test_a_ragged_axis_mask_does_not_keep_a_fold_in_blocks():
    """A row maximum over 508 columns in blocks of 64 masks the padding of its last block,
    which holds valid columns too: no block is skipped, so the fold is coarsened to one block
    (one numpy call per step, not eight).  A causal mask skips whole blocks, and keeps them,
    unless the whole axis' tiles are small (`WHOLE_FOLD_TILE`): then one block is fewer calls
    for all the rows at once."""
    ragged = ("dim r = 512 / 16\ndim c = 508 / 64\ninput X[r, c] : f32\n"
              "Y[r] = max[c] tanh(X[r, c])\noutput Y\n")
    ast = parse_program(ragged)
    p = lower(ast)
    assert dict(numpy_plan.coarsened(p, p.kernels[0], H100.local_capacity).blocks)["c"] == 512
    code = numpy_gen.generate(p)
    assert python_loops(code) == 0, code
    inputs = random_inputs(ast, seed=8)
    assert_close(numpy_gen.run(p, inputs)["Y"], dense.evaluate(ast, inputs, np.float64)["Y"],
                 "vs dense")
    for n, block in ((1024, 64), (256, 256)):
        causal = (f"dim r = {n} / 64\ndim c = {n} / 64\ninput X[r, c] : f32\n"
                  "Y[r] = max[c] where(c <= r, X[r, c], -inf)\noutput Y\n")
        p = lower(parse_program(causal))
        assert dict(numpy_plan.coarsened(p, p.kernels[0], H100.local_capacity).blocks).get(
            "c", 64) == block


@pytest.mark.parametrize("columns, statement, fills", [
    # a padded axis' mask before a max: the padding set to -inf in the dying tanh
    (508, "Y[r] = max[c] tanh(X[r, c])", ['[:, :, 508:512] = f32("-inf")']),
    # off a box: before it and after it
    (512, "Y[r] = sum[c] where(c >= 8 and c < 300, X[r, c] * 2, -1)",
     ["[:, :, :8] = f32(-1.0)", "[:, :, 300:512] = f32(-1.0)"]),
    # on a box: the number inside it
    (512, "Y[r] = sum[c] where(c >= 10 and c < 20, 0, X[r, c] * 2)", ["[:, :, 10:20] = f32(0.0)"]),
    # a loaded tile is copied, never written
    (512, "Y[r] = max[c] where(c >= 64, X[r, c], 0)", ["[:, :, :64] = f32(0.0)"]),
    # a grid axis in blocks: a box of whole blocks of it
    (512, "Y[r, c] = where(r < 96 and c >= 64, X[r, c] * 2, -1)",
     ["[6:32] = f32(-1.0)", "[:6, :, :1] = f32(-1.0)"]),
    # a condition that holds everywhere: the tile itself
    (512, "Y[r, c] = where(r < 512, X[r, c] * 2, -1)", []),
    # not a box: np.where
    (512, "Y[r] = max[c] where(c <= r, X[r, c], 0)", []),
    (512, "Y[r, c] = where(r < 100, X[r, c] * 2, -1)", []),
])
def test_a_selection_known_while_generating_sets_slices(columns, statement, fills, monkeypatch):
    """A selection between a tile and a number whose condition is a box of known positions,
    or the complement of one, sets the number slice by slice: in place where the tile dies
    there, else in a copy (an input is never written).  A grid axis is held in blocks, so
    only a box of whole blocks of it is one.  Results are those of `np.where`, bit for bit,
    and the interpreter's."""
    ast = parse_program(f"dim r = 512 / 16\ndim c = {columns} / 64\ninput X[r, c] : f32\n"
                        f"{statement}\noutput Y\n")
    p = lower(ast)
    code = numpy_gen.generate(p)
    body = code[code.index("def kernel_Y"):code.index("def _input")]
    assert [line[line.index("["):] for line in body.splitlines() if "] = f32(" in line] == \
        fills, body
    assert ("elementwise_where" in body) == (not fills and "r < 512" not in statement), body
    assert (".copy(order='K')" in body) == ("X[r, c], 0)" in statement and bool(fills)), body
    inputs = random_inputs(ast, seed=4)
    given = inputs["X"].copy()
    got = numpy_gen.run(p, inputs)["Y"]
    np.testing.assert_array_equal(inputs["X"], given)
    assert_close(got, interp.run(p, inputs)["Y"], "vs interpreter")
    monkeypatch.setattr(numpy_gen, "MOST_FILLS", -1)
    assert "elementwise_where" in numpy_gen.generate(p) or "r < 512" in statement
    np.testing.assert_array_equal(got, numpy_gen.run(p, inputs)["Y"])


def test_a_selection_of_a_number_by_known_positions_stays_a_selection():
    """`where(r < 1, 2 * 3, 0)` over an axis of one position: both sides are numbers (numpy
    scalars, which have no slices to set), so `np.where` selects; a later step may write
    into its result."""
    ast = parse_program("dim r = 1 / 1\ninput X[r] : f32\n"
                        "Y[r] = where(r < 1, 2 * 3, 0) + X[r]\noutput Y\n")
    p = lower(ast)
    x = np.array([1.5], np.float32)
    np.testing.assert_array_equal(numpy_gen.run(p, {"X": x})["Y"], interp.run(p, {"X": x})["Y"])


def test_a_tile_of_positions_is_computed_once_when_the_module_loads(monkeypatch):
    """A causal mask over known positions is a module global computed on loading (read-only),
    not on every call; a store of it copies it, so a caller writing into an output does not change
    the next call's.  Results are those of the code computing it per call, bit for bit."""
    ast = parse_program("dim q = 128 / 128\ndim k = 128 / 128\ndim d = 32\n"
                        "input Q[q, d], K[k, d] : f32\n"
                        "S[q, k] = sum[d] Q[q, d] * K[k, d] - where(k <= q, 0, inf)\n"
                        "M[q, k] = where(k <= q, 1, 0)\noutput S, M\n")
    p = lower(ast)
    code = numpy_gen.generate(p)
    computed = re.findall(r"^(known_\d+) = constant\(elementwise_where\(", code, re.M)
    assert len(computed) == 2, code
    for kernel in code.split("\ndef ")[1:]:
        assert "np.arange" not in kernel and "elementwise_where" not in kernel, kernel
    inputs = random_inputs(ast, seed=2)
    module = numpy_gen.load(p, threads=1)
    assert not any(getattr(module, name).flags.writeable for name in computed)
    first = module.run(**inputs)
    first["M"][...] = 7.0
    again = module.run(**inputs)
    assert_close(again["M"], np.tril(np.ones((128, 128))), "vs numpy")
    monkeypatch.setattr(numpy_gen, "KNOWN_ELEMENTS", 1)
    assert "known_" not in numpy_gen.generate(p)
    per_call = numpy_gen.run(p, inputs)
    for name in ("S", "M"):
        np.testing.assert_array_equal(again[name], per_call[name])
    assert_close(again["S"], interp.run(p, inputs)["S"], "vs interpreter")


def test_a_shift_by_a_one_hot_is_a_gather_and_a_guard_still_applies():
    """A convolution's taps as imported: output position i and tap s read input position
    i + s.  A guard free of the contracted axis (here: even taps only) masks the picks."""
    source = ("dim i = 60 / 4\ndim s = 5\ndim j = 64 / 16\ndim c = 8\ninput X[j, c] : f32\n"
              "Y[i, s, c] = sum[j] where(j == i + s and s != 1, 1, 0) * X[j, c]\noutput Y\n")
    ast = parse_program(source)
    p = lower(ast)
    assert "gather_one_hot(" in numpy_gen.generate(p)
    inputs = random_inputs(ast, seed=4)
    got = numpy_gen.run(p, inputs)["Y"]
    x = inputs["X"]
    want = np.stack([x[i:i + 5] for i in range(60)])
    want[:, 1] = 0
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert_close(got, interp.run(p, inputs)["Y"], "vs interpreter")


def test_a_concatenation_at_an_offset_no_block_divides_is_a_gather():
    """A KV cache of 63 past tokens and the new one, as the import writes the concatenation
    of pieces that share no chunk longer than one element: a selection summed over the
    cache's positions (blocks of 9).  The numpy code gathers it in one call, with no loop over
    the cache's blocks and no selection built against every position
    (`numpy_plan.selections_as_gathers`), at positions computed once (`known_tile`); the
    numbers are the interpreter's and numpy's own concatenation."""
    source = ("dim p = 63 / 9\ndim t = 64 / 16\ndim d = 32\n"
              "input C[p, d] : f32\ninput N[d] : f32\n"
              "K[t, d] = (sum[p] where(p == t, C[p, d], 0)) + where(t == 63, N[d], 0)\n"
              "output K\n")
    ast = parse_program(source)
    p = lower(ast)
    kernel = numpy_gen.generate(p).split("def kernel_K")[1].split("\ndef ")[0]
    assert kernel.count("gather_one_hot(") == 1, kernel
    assert "loop over p" not in kernel and "elementwise_eq" not in kernel, kernel
    assert re.search(r"gather_one_hot\(\w+, \d+, \(\(known_\d+, \(\)\),\)", kernel), kernel
    inputs = random_inputs(ast, seed=5)
    got = numpy_gen.run(p, inputs)["K"]
    np.testing.assert_array_equal(got, np.concatenate([inputs["C"], inputs["N"][None]]))
    assert_close(got, interp.run(p, inputs)["K"], "vs interpreter")


@pytest.mark.parametrize("first", [False, True], ids=["appended", "prepended"])
def test_a_token_concatenated_to_a_cache_is_written_into_the_caches_padded_copy(first):
    """With native code, the cache's window is its padded copy, an array of the gather's own
    (`own=True`), and the token is added on the one position where it goes
    (`_KernelWriter.box_add`): no native group reads the window and writes a new array, no
    condition is computed.  Exactly numpy's own concatenation, either way round."""
    at, new = ("p == t - 1", "t == 0") if first else ("p == t", "t == 63")
    source = ("dim p = 63 / 9\ndim t = 64 / 16\ndim d = 32\n"
              "input C[p, d] : f32\ninput N[d] : f32\n"
              f"K[t, d] = (sum[p] where({at}, C[p, d], 0)) + where({new}, N[d], 0)\n"
              "output K\n")
    ast = parse_program(source)
    p = lower(ast)
    code = numpy_gen.generate(p, native=True)
    kernel = code.split("def kernel_K")[1].split("\ndef ")[0]
    assert re.search(r"= gather_one_hot\(.*, window=True, own=True\)", kernel), kernel
    assert re.search(r"\[[:, 0-9]+\] \+= ", kernel), kernel
    assert "native_" not in kernel and "known_" not in kernel.split("own=True)")[1], kernel
    inputs = random_inputs(ast, seed=6)
    got = numpy_gen.module_from_source(code).run(**inputs)["K"]
    pieces = [inputs["C"], inputs["N"][None]]
    np.testing.assert_array_equal(got, np.concatenate(pieces[::-1] if first else pieces))
    assert_close(got, interp.run(p, inputs)["K"], "vs interpreter")


def test_an_own_window_is_the_padded_copy_where_no_elements_share_memory():
    """`own=True`: a window past the values is their padded copy, writable, where positions
    step apart (a position's block and its place in the block); overlapping taps, or a window
    within the values, are copied.  Either way the values are not written."""
    values = numpy_runtime.constant(np.arange(40, dtype=np.float32).reshape(1, 40))
    blocks = (np.arange(4, dtype=np.float32).reshape(4, 1, 1) * 12
              + np.arange(12, dtype=np.float32).reshape(1, 12, 1)).reshape(4, 12, 1)
    got = numpy_runtime.gather_one_hot(values.reshape(1, 1, 40), 2, ((blocks, ()),),
                                       window=True, own=True)
    assert got.flags.writeable and got.shape == (4, 12, 1)
    np.testing.assert_array_equal(got.reshape(48), np.r_[np.arange(40), np.zeros(8)])
    taps = np.arange(40, dtype=np.float32).reshape(40, 1) + np.arange(3).reshape(1, 3)
    for at in (taps.reshape(40, 3, 1), np.arange(30, dtype=np.float32).reshape(30, 1)):
        held = numpy_runtime.gather_one_hot(values.reshape((1,) * (at.ndim - 1) + (40,)),
                                            at.ndim - 1, ((at, ()),), window=True, own=True)
        assert held.flags.writeable and not np.shares_memory(held, values)
        np.testing.assert_array_equal(held, numpy_runtime.gather_one_hot(
            values.reshape((1,) * (at.ndim - 1) + (40,)), at.ndim - 1, ((at, ()),)))


def test_the_first_run_of_an_unrolled_fold_takes_its_contribution():
    """Rotate-half's scores, the halves' contractions summed over the pair: the first half's
    product is the fold's state (combine(identity, b) = b), the second is added to it; no
    accumulator starts at zero, no pass adds the first product to zero."""
    source = ("dim q = 32 / 16\ndim k = 32 / 16\ndim p = 2 / 1\ndim d = 8\n"
              "input A[q, d], B[q, d], C[k, d], D[k, d] : f32\n"
              "S[q, k] = sum[p, d] where(p == 0, A[q, d], B[q, d]) * "
              "where(p == 0, C[k, d], D[k, d])\noutput S\n")
    ast = parse_program(source)
    p = lower(ast)
    code = numpy_gen.generate(p, native=False)
    kernel = code[code.index("def kernel_S"):code.index("def _input")]
    assert "f32(0.0)" not in kernel and kernel.count("np.add(") == 1, kernel
    inputs = random_inputs(ast, seed=7)
    assert_close(numpy_gen.run(p, inputs, native=False)["S"],
                 dense.evaluate(ast, inputs, np.float64)["S"], "vs dense")


def test_a_contraction_over_two_axes_is_one_matmul():
    """Rotate-half RoPE leaves a head split in halves, `sum[p, d] Q[q, p, d] * K[k, p, d]`:
    the sum over the halves of the contraction over d is one matmul over (p, d), not a
    matmul per half and a pass adding them."""
    source = ("dim q = 128 / 64\ndim k = 128 / 64\ndim p = 2\ndim d = 32\n"
              "input Q[q, p, d], K[k, p, d] : f32\n"
              "S[q, k] = sum[p, d] Q[q, p, d] * K[k, p, d]\noutput S\n")
    ast = parse_program(source)
    p = lower(ast)
    code = numpy_gen.generate(p)
    body = code[code.index("def kernel_S"):code.index("def _input")]
    assert body.count("np.matmul") == 1 and "np.sum" not in body, body
    inputs = random_inputs(ast, seed=6)
    assert_close(numpy_gen.run(p, inputs)["S"], dense.evaluate(ast, inputs, np.float64)["S"],
                 "vs dense")


def test_a_convolutions_taps_are_summed_in_the_matmul_over_its_channels(monkeypatch):
    """A convolution as imported, `sum[s, c] W[m, c, s] * (X shifted by tap s)`, with its
    channels looped in blocks: the sum over the taps moves into the loop over channels and
    joins the contraction, one matmul over (taps, channels) a step, where it was a matmul
    per tap and the taps added after the loop.  The larger operand is contracted in the order
    its memory holds: each step's gathered window (60 positions x 5 taps x 64 channels) is
    passed as the gather laid it out, taps outer, and the block of W[m, c, s] (32 x 64 x 5)
    is copied into that order."""
    source = ("dim o = 60 / 30\ndim s = 5\ndim j = 64\ndim c = 256 / 64\ndim m = 32\n"
              "input X[j, c], W[m, c, s] : f32\n"
              "Y[o, m] = sum[s, c] W[m, c, s] * sum[j] where(j == o + s, 1, 0) * X[j, c]\n"
              "output Y\n")
    ast = parse_program(source)
    p = lower(ast)
    monkeypatch.setattr(numpy_plan, "COARSE_TILE", 4096)  # the channels stay in blocks of 64
    code = numpy_gen.generate(p)
    body = code[code.index("def kernel_Y"):code.index("def _input")]
    assert "for c0 in range(0, 256, 64):" in body
    assert body.count("np.matmul") == 1 and "reshape(32, 320)" in body, body
    assert "np.sum" not in body, body
    inputs = random_inputs(ast, seed=7)
    x, w = inputs["X"].astype(np.float64), inputs["W"].astype(np.float64)
    want = np.einsum("osc,mcs->om", np.stack([x[o:o + 5] for o in range(60)]), w)
    module = numpy_gen.load(p, threads=1)
    operands, gathered = _recording_matmuls_and_gathers(module, monkeypatch)
    got = module.run(**inputs)["Y"]
    assert len(operands) == 4 and len(gathered) == 4, "a gather and a matmul per block"
    for (weights, window), rows in zip(operands, gathered):
        assert np.shares_memory(window, rows), "the gathered window copied"
        assert not np.shares_memory(weights, inputs["W"])
    assert_close(got, want, "vs numpy")
    assert_close(got, dense.evaluate(ast, inputs, np.float64)["Y"], "vs dense")


def test_a_selection_folded_inside_a_contraction_keeps_the_contractions_shapes():
    """Per chunk, `where(p == 1, X[h, s, d], 0)` is X or a plain 0, which lacks X's head axis;
    the contraction that reads it reshapes by the node's dimensions, so the 0 is broadcast to
    them.  A fold of one block nested in the chunk loop still folds what it selects."""
    ast = parse_program("""
dim h = 2 / 1
dim t = 64 / 32
dim s = 64 / 32
dim p = 2 / 1
dim d = 16
input X[h, s, d], C[s, p, d], Q[h, t, p, d] : f32
R[h, s, p, d] = where(p == 1, X[h, s, d], 0) * C[s, p, d]
Z[h, t, s] = sum[p, d] Q[h, t, p, d] * R[h, s, p, d]
output Z
""", "select_dot.bbp")
    r = fuse(lower(ast), load_packs([]), H100)
    assert len(r.program.kernels) == 1
    assert "np.broadcast_to(f32(0.0)" in numpy_gen.generate(r.program)
    inputs = random_inputs(ast, seed=1)
    q, x, c = (inputs[n].astype(np.float64) for n in "QXC")
    want = np.einsum("htd,hsd->hts", q[:, :, 1], x * c[:, 1])
    assert_close(numpy_gen.run(r.program, inputs)["Z"], want, "vs numpy")


def test_a_gather_pinned_to_a_chunks_known_position_reads_that_row():
    """A chunk loop that selects (so it is written per chunk) and also gathers the row its
    position pins: the position is a number there, and the gather's index an array of it."""
    ast = parse_program("dim a = 3 / 1\ndim k = 8\ndim t = 16 / 8\ninput X[t, k], Y[t, a] : f32\n"
                        "Z[t] = sum[a] where(a == 1, Y[t, a], 0) + "
                        "sum[a] sum[k] where(k == a, 1, 0) * X[t, k]\noutput Z\n")
    p = lower(ast)
    assert "in (2,):" in numpy_gen.generate(p)
    inputs = random_inputs(ast, seed=1)
    want = inputs["Y"][:, 1] + inputs["X"][:, :3].astype(np.float64).sum(axis=1)
    assert_close(numpy_gen.run(p, inputs)["Z"], want, "vs numpy")


# A convolution as imported: 60 output positions, 5 taps (blocks of one), 256 channels in
# blocks of 64, 64 input positions.
CONVOLUTION = ("dim o = 60 / 30\ndim s = 5 / 1\ndim j = 64\ndim c = 256 / 64\n"
               "dim m = {filters}\ninput X[j, c], W[m, c, s] : f32\n"
               "Y[o, m] = sum[s, c] W[m, c, s] * sum[j] where(j == o + s, 1, 0) * X[j, c]\n"
               "output Y\n")


def test_taps_in_blocks_of_one_are_walked_at_once_not_one_by_one():
    """Magika's import gives a convolution's taps blocks of one: their position only picks
    the rows to gather, so the loop over them is coarsened into the matmul over (taps,
    channels), not written once per tap (`_unrollable` is for selections, not gathers)."""
    source = CONVOLUTION.format(filters=32)
    ast = parse_program(source)
    p = lower(ast)
    code = numpy_gen.generate(p)
    body = code[code.index("def kernel_Y"):code.index("def _input")]
    assert "for s0" not in body and body.count("np.matmul") == 1, body
    inputs = random_inputs(ast, seed=7)
    x, w = inputs["X"].astype(np.float64), inputs["W"].astype(np.float64)
    want = np.einsum("osc,mcs->om", np.stack([x[o:o + 5] for o in range(60)]), w)
    assert_close(numpy_gen.run(p, inputs)["Y"], want, "vs numpy")


def test_a_grid_axis_of_chunks_a_selection_reads_is_written_once_per_chunk():
    """A concatenation over a grid axis of blocks of one, as ONNX's Concat of RoPE's halves
    imports: vectorised over the grid, `where(p == 0, ...)` is a mask over every element; walked
    by a loop written once per chunk, each chunk is one of the two values, no mask computed.
    An axis of larger blocks stays in the grid."""
    source = ("dim t = 64 / 16\ndim p = 2 / 1\ndim i = 32 / {i}\ninput A[t, i], B[t, i] : f32\n"
              "Y[t, p, i] = where(p == 0, A[t, i], 0 - B[t, i]) * where(i < 8, 2, 1)\n"
              "output Y\n")
    ast = parse_program(source.format(i=1))
    p = lower(ast)
    (kernel,) = p.kernels
    assert set(kernel.grid) == {"t", "p", "i"}
    assert numpy_plan.ungridded(p, kernel).grid == ("t", "i")
    code = numpy_gen.generate(p)
    body = code[code.index("def kernel_Y"):code.index("def _input")]
    assert "for p0 in (0,):" in body and "for p0 in (1,):" in body, body
    assert "elementwise_eq" not in body, body
    inputs = random_inputs(ast, seed=3)
    got = numpy_gen.run(p, inputs)["Y"]
    scale = np.where(np.arange(32) < 8, 2, 1)
    np.testing.assert_allclose(got[:, 0], inputs["A"] * scale, rtol=1e-6)
    np.testing.assert_allclose(got[:, 1], -inputs["B"] * scale, rtol=1e-6)
    assert_close(got, interp.run(p, inputs)["Y"], "vs interpreter")
    wide = lower(parse_program(source.format(i=1).replace("dim p = 2 / 1", "dim p = 2 / 2")))
    assert numpy_plan.ungridded(wide, wide.kernels[0]).grid == wide.kernels[0].grid


def _recording_matmuls_and_gathers(module, monkeypatch):
    """The operands of every matmul and the result of every gather a generated module's run
    computes, in order."""
    operands, gathered = [], []

    def matmul(a, b):
        operands.append((a, b))
        return np.matmul(a, b)

    def gather(*args):
        gathered.append(module_gather(*args))
        return gathered[-1]
    module_gather = module.gather_one_hot
    monkeypatch.setattr(module, "np", type("numpy", (), {**vars(np),
                                                         "matmul": staticmethod(matmul)}))
    monkeypatch.setattr(module, "gather_one_hot", gather)
    return operands, gathered


@pytest.mark.parametrize("outputs, window_copied", [(128, True), (60, False)])
def test_a_convolution_copies_the_smaller_operand_into_the_larger_ones_order(
        monkeypatch, outputs, window_copied):
    """The gathered window is laid out (position, tap, channel) and the weights W[m, c, s]
    (channel, tap): one of them is copied into the other's order, the smaller.  The window
    (60 positions x 1280) is copied for 128 filters, kept for 60; of equal sizes it is kept,
    its copy the slower (taps innermost: 537 µs for magika's 512 x 1280, the weights' 241).

    A copied window is copied as (position, channel x tap) and passed to the matmul
    transposed, which keeps its positions outer; copied as (channel x tap, position) it would
    read across the whole window for every element of a row (3.9 ms for magika's, against
    0.3 ms)."""
    source = CONVOLUTION.format(filters=outputs)
    ast = parse_program(source)
    module = numpy_gen.load(lower(ast), threads=1)
    operands, gathered = _recording_matmuls_and_gathers(module, monkeypatch)
    inputs = random_inputs(ast, seed=7)
    got = module.run(**inputs)["Y"]
    [(weights, window)], [rows] = operands, gathered
    assert np.shares_memory(weights, inputs["W"]) == window_copied
    assert np.shares_memory(window, rows) != window_copied
    assert window.shape == (1280, 60) and window.T.flags.c_contiguous
    x, w = inputs["X"].astype(np.float64), inputs["W"].astype(np.float64)
    want = np.einsum("osc,mcs->om", np.stack([x[o:o + 5] for o in range(60)]), w)
    assert_close(got, want, "vs numpy")


@pytest.mark.parametrize("read_only", [True, False])
def test_read_only_weights_are_copied_into_a_matmuls_order_once(monkeypatch, read_only):
    """Weights W[m, c, s] contracted in the window's order (tap, channel) are copied into it.
    A read-only array is a constant: its copy is made on the first call and kept for the
    next; a writeable one may change between calls, and is copied every time."""
    source = CONVOLUTION.format(filters=60)
    ast = parse_program(source)
    module = numpy_gen.load(lower(ast), threads=1)
    operands, _ = _recording_matmuls_and_gathers(module, monkeypatch)
    inputs = random_inputs(ast, seed=5)
    inputs["W"].flags.writeable = not read_only
    got = [module.run(**inputs)["Y"] for _ in range(2)]
    (first, _), (second, _) = operands
    assert np.shares_memory(first, second) == read_only
    assert not np.shares_memory(first, inputs["W"])
    np.testing.assert_array_equal(got[0], got[1])
    assert_close(got[0], dense.evaluate(ast, inputs, np.float64)["Y"], "vs dense")
    if not read_only:
        inputs["W"] *= 2
        assert_close(module.run(**inputs)["Y"], 2 * got[0], "after W changed")


def test_a_kept_copy_lives_as_long_as_its_array():
    """`relaid` keeps a read-only array's padded copy while the array lives, not after."""
    ast = parse_program("dim r = 100 / 64\ninput X[r] : f32\nY[r] = X[r] * 2\noutput Y\n")
    module = numpy_gen.load(lower(ast), threads=1)
    x = np.arange(100, dtype=np.float32)
    x.flags.writeable = False
    owner = id(x)

    def kept() -> int:  # the copies kept of x (the key holds its owner's id)
        return sum(spot[2] == owner for spot in list(numpy_runtime._RELAID))
    for _ in range(2):
        np.testing.assert_array_equal(module.run(X=x)["Y"], x * 2)
        assert kept() == 1
    del x
    gc.collect()
    assert kept() == 0


@pytest.mark.parametrize("values, index, axis", [
    ((1, 2, 1, 64, 40), (3, 1, 5, 1, 1), 4),  # disjoint dimensions: rows taken at once
    ((3, 2, 1, 40), (3, 1, 7, 1), 3),  # a dimension both span: numpy's own take_along_axis
    ((40, 6), (1, 6), 0),
    ((1, 1, 2, 8, 40), (1, 5, 1, 1, 1), 4),  # ids outside the row: the rows' order as it is
    ("table", (1, 5, 1, 1, 1), 4),  # an embedding's table (rows contiguous), read transposed
    ((1, 1, 1, 16, 40), (4, 50, 1, 1, 1), 4),  # a small table by columns, many ids: copied
])
def test_a_gather_takes_what_take_along_axis_takes(values, index, axis):
    rng = np.random.default_rng(7)
    if values == "table":  # as the lookup's kernel reads it: embed.T.reshape(...)
        v = rng.standard_normal((40, 16)).astype(np.float32).T.reshape(1, 1, 2, 8, 40)
    else:
        v = rng.standard_normal(values).astype(np.float32)
    i = rng.integers(0, v.shape[axis], index)
    np.testing.assert_array_equal(numpy_runtime._take(v, axis, i), np.take_along_axis(v, i, axis))


def test_a_window_past_the_end_is_gathered_as_whole_rows_of_zeros_after_the_values():
    """Taps past the last position pick nothing: a row of zeros appended to the values,
    which the kernel layout holds with their positions innermost.  The result holds the
    picked positions' rows outermost, channels contiguous: the order `held_order` tells a
    matmul."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 4, 16)).astype(np.float32)  # X[j, c, e]
    values = x.transpose(1, 2, 0).reshape(1, 1, 4, 16, 64)  # kernel layout (o, s, c, e, j)
    at = (np.arange(64, dtype=np.float32)[:, None] + np.arange(5)).reshape(64, 5, 1, 1, 1)
    got = numpy_runtime.gather_one_hot(values, 4, ((at, ()),))
    padded = np.concatenate([x, np.zeros((4, 4, 16), np.float32)])
    want = np.stack([padded[o:o + 5] for o in range(64)])
    np.testing.assert_array_equal(got.reshape(64, 5, 4, 16), want)
    assert got.reshape(64, 5, 4, 16).flags.c_contiguous


def test_the_online_softmax_rescales_its_output_in_the_contributions_buffer(walked_folds):
    """`o' = o * exp(m - m') + P V * exp(m_b - m')` allocates three arrays of the output's
    size per key block as an expression; scaled and added into the dying P V product it
    allocates one.  The results are those of the expression."""
    n, d = 256, 16
    p = flash(n, d, 64, 64)
    code = numpy_gen.generate(p)
    assert re.search(r"np\.multiply\((t\d+_dot), t\d+_c, out=\1\)\n\s+np\.add\(\1, ", code)
    inputs = {"Q": rand(n, d, seed=1), "K": rand(n, d, seed=2), "V": rand(n, d, seed=3)}
    assert_close(numpy_gen.run(p, inputs)["O"],
                 attention_reference(inputs["Q"], inputs["K"], inputs["V"]), "vs numpy")


@pytest.mark.parametrize("start, step", [(0, 1), (-2, 1), (3, 2), (0, 0)])
def test_a_window_is_a_view_with_what_the_gather_picks(start, step):
    """`window=True`: positions that step evenly (by position and tap, from `start`, taps
    `step` apart) are a read-only view of the values, in the values' own order, zero-padded
    where they run past either end; what it holds is what the gather picks."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 4, 16)).astype(np.float32)  # X[j, c, e]
    values = x.transpose(1, 2, 0).reshape(1, 1, 4, 16, 64)  # positions innermost
    at = (start + np.arange(60, dtype=np.float32)[:, None]
          + step * np.arange(5)).reshape(60, 5, 1, 1, 1)
    guard = np.ones((1, 5, 1, 1, 1), np.float32)
    got = numpy_runtime.gather_one_hot(values, 4, ((at, (guard,)),), window=True)
    want = numpy_runtime.gather_one_hot(values, 4, ((at, (guard,)),))
    np.testing.assert_array_equal(got, want)
    assert not got.flags.writeable
    inside = start >= 0 and start + 59 + 4 * step < 64
    assert np.shares_memory(got, x) == inside


@pytest.mark.parametrize("side, taps, pad", [(10, 3, 1), (7, 5, 2), (6, 3, 0)])
def test_a_window_of_a_window_pads_the_memory_they_view(side, taps, pad):
    """A 2-D convolution's window, picked a spatial dimension at a time: the second pick pads
    the memory the first one's window views (the padded image), not a copy of that window,
    which would hold each element once per tap; what it holds is what the gathers pick."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, side, side + 1)).astype(np.float32)
    values = x.reshape(4, 1, 1, 1, 1, side, side + 1)  # [c, i, j, s, t, h, w]
    out = side + 2 * pad - taps + 1
    cols = np.arange(out + 1).reshape(1, 1, out + 1, 1, 1, 1, 1) + \
        np.arange(taps).reshape(1, 1, 1, 1, taps, 1, 1) - pad
    rows = np.arange(out).reshape(1, out, 1, 1, 1, 1, 1) + \
        np.arange(taps).reshape(1, 1, 1, taps, 1, 1, 1) - pad
    cols, rows = (numpy_runtime.constant(a.astype(np.float32)) for a in (cols, rows))
    first = numpy_runtime.gather_one_hot(values, 6, ((cols, ()),), window=True)
    got = numpy_runtime.gather_one_hot(first, 5, ((rows, ()),), window=True)
    padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad)))
    want = np.stack([np.stack([padded[:, i:i + taps, j:j + taps] for j in range(out + 1)], 1)
                     for i in range(out)], 1)  # [c, i, j, s, t]
    np.testing.assert_array_equal(got.reshape(want.shape), want)
    reach = 4 + sum((n - 1) * abs(step) for n, step in zip(got.shape, got.strides))
    assert reach <= padded.nbytes  # (the bytes from its first element to its last)


def test_a_sum_of_quotients_of_a_contraction_is_one_product_divided():
    """`bsum(a, reduce(e, sum, dot(e, P, V)) / B)` with B constant along a and e (a softmax's
    weights times values over keys laid as two dimensions, normalised inside the sum over
    the first): one product over (a, e), divided once, where it was a product per a and a
    sum; what it computes is the interpreter's."""
    text = ("# bbrules block program\ndim q = 32 / 32\ndim a = 8 / 8\ndim e = 8 / 8\n"
            "dim d = 16 / 16\ninput P[q, a, e] : f32\ninput V[a, e, d] : f32\n"
            "input B[q] : f32\noutput O[q, d] : f32\n\nkernel [q]:\n  O[q, d] = reduce(a, sum, "
            "bsum(a, reduce(e, sum, dot(e, load(P[q, a, e]), load(V[a, e, d]))) / load(B[q])))\n")
    p = parse_block_program(text).program
    body = kernel_body(numpy_gen.generate(p), "kernel_O")
    assert body.count("np.matmul(") == 1 and "P.reshape(32, 64)" in body, body
    assert python_loops(body) == 0 and "np.sum(" not in body
    inputs = random_inputs(p, seed=5)
    inputs["B"] = np.abs(inputs["B"]) + 1  # (a softmax's sums: away from zero)
    assert_close(numpy_gen.run(p, inputs)["O"], interp.run(p, inputs)["O"], "vs interpreter")


def test_sums_over_several_dimensions_of_a_tile_are_one_call():
    """A sum over a group's channels and an image's positions (a group norm's mean), each
    dimension one block: one numpy sum over the three, where it was one a dimension; what
    it computes is the interpreter's.  A sum another node reads too keeps its own step."""
    ast = parse_program("dim g = 4\ndim c = 6\ndim h = 5\ndim w = 7\ninput X[g, c, h, w] : f32\n"
                        "M[g] = sum[c, h, w] exp(X[g, c, h, w])\noutput M\n")
    p = lower(ast)
    source = numpy_gen.generate(p)
    assert len(re.findall(r"np\.sum\(", source)) == 1 and "axis=(2, 3, 4)" in source
    inputs = random_inputs(ast, seed=3)
    np.testing.assert_allclose(numpy_gen.run(p, inputs)["M"], interp.run(p, inputs)["M"],
                               rtol=1e-5)
    shared = parse_program("dim c = 6\ndim h = 5\ndim w = 7\ninput X[c, h, w] : f32\n"
                           "S[c, h] = sum[w] exp(X[c, h, w])\nM[c] = sum[h] S[c, h] * S[c, h]\n"
                           "output M\n")
    p = fuse(lower(shared), load_packs([]), get_target("cpu")).program
    inputs = random_inputs(shared, seed=4)
    np.testing.assert_allclose(numpy_gen.run(p, inputs)["M"], interp.run(p, inputs)["M"],
                               rtol=1e-5)


def test_the_steps_of_read_only_positions_are_found_once():
    """Positions a module computes once (`constant`, read-only) are checked for even steps on
    the first call, and what was found is kept while they live; positions that may change
    are checked on each call."""
    values = np.arange(40, dtype=np.float32).reshape(1, 40)

    def kept(at: np.ndarray) -> bool:
        return any(spot[0] == id(at) for spot in list(numpy_runtime._GEOMETRY))
    fixed = numpy_runtime.constant(np.arange(8, dtype=np.float32).reshape(8, 1) + 3)
    first = numpy_runtime._window(values, 1, fixed, ())
    assert kept(fixed)
    view = numpy_runtime.constant(np.arange(8, dtype=np.float32).reshape(8, 1))  # of an arange
    numpy_runtime._window(values, 1, view, ())
    assert kept(view) and not view.base.flags.writeable
    np.testing.assert_array_equal(numpy_runtime._window(values, 1, fixed, ()), first)
    np.testing.assert_array_equal(first.reshape(8), np.arange(3, 11))
    changing = np.arange(8, dtype=np.float32).reshape(8, 1)
    assert numpy_runtime._window(values, 1, changing, ()) is not None and not kept(changing)
    changing **= 2
    assert numpy_runtime._window(values, 1, changing, ()) is None
    spot = next(spot for spot in numpy_runtime._GEOMETRY if spot[0] == id(fixed))
    del fixed, first
    gc.collect()
    assert spot not in numpy_runtime._GEOMETRY


def test_a_window_is_not_taken_where_positions_jump_or_a_guard_fails():
    values = np.arange(40, dtype=np.float32).reshape(1, 40)
    even = np.arange(8, dtype=np.float32).reshape(8, 1)
    for at, guards in [(even[::-1].copy(), ()), (even ** 2, ()), (even + 0.5, ()),
                       (even, (np.array([[1], [0]] * 4, np.float32),))]:
        assert numpy_runtime._window(values, 1, at, guards) is None
        got = numpy_runtime.gather_one_hot(values, 1, ((at, guards),), window=True)
        np.testing.assert_array_equal(got, numpy_runtime.gather_one_hot(values, 1, ((at, guards),)))


@pytest.mark.parametrize("ids", [[3, 0, 9, 3], [3, -1, -10, 9], [3, 2.5, 10, -11]],
                         ids=["in range", "negative", "outside or fractional"])
def test_a_lookup_by_ids_picks_rows_as_onnx_gather_does(ids):
    """An embedding lookup as imported: position i picks row ids[i], or ids[i] + 10 for a
    negative id (ONNX's Gather), a row of zeros where neither is a row.  Ids all in range
    take the lookup's few calls (they ran 43 µs of LLaMA's first kernel, the mask's dozen 48);
    the others, the mask's, and a row two picks both name counts once."""
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    at = np.array(ids, np.float32).reshape(4, 1, 1)
    values = table.T.reshape(1, 4, 10)
    got = numpy_runtime.gather_one_hot(values, 2, ((at, ()), (at + 10, ())))
    want = np.array([table[int(i) % 10] if i == int(i) and -10 <= i < 10 else np.zeros(4)
                     for i in ids], np.float32)
    np.testing.assert_array_equal(got.reshape(4, 4), want)
    twice = numpy_runtime.gather_one_hot(values, 2, ((at, ()), (at, ())))
    np.testing.assert_array_equal(twice, numpy_runtime.gather_one_hot(values, 2, ((at, ()),)))


def test_a_gather_that_picks_nothing_is_zeros_of_the_contractions_shape():
    values = np.ones((1, 4, 10), np.float32)
    far = np.full((3, 1, 1), 50.0, np.float32)
    guard = np.ones((1, 1, 1), np.float32)
    got = numpy_runtime.gather_one_hot(values, 2, ((far, (guard,)), (far - 100, ())))
    np.testing.assert_array_equal(got, np.zeros((3, 4, 1), np.float32))


def test_a_short_loop_selecting_chunks_by_position_is_written_per_chunk():
    """Rotate-half RoPE's two slices are one-hot sums over a chunk axis of two blocks of one:
    written once per chunk, each sum reads its own half, with no mask, no positions and no
    selection left; the numbers are those of a float64 reference."""
    ast = parse_program(ROPE_BY_SLICES, "rope.bbp")
    r = fuse(lower(ast), load_packs([]), H100)
    source = numpy_gen.generate(r.program)
    assert re.findall(r"for d__i0 in \((\d),\):", source) == ["0", "1"]
    assert not re.search(r"elementwise_where|elementwise_eq|np\.arange", source)
    inputs = random_inputs(ast, seed=3)
    x, c, s = (inputs[n].astype(np.float64) for n in ("X", "COS", "SIN"))
    lo, hi = x[:, :32], x[:, 32:]
    got = numpy_gen.run(r.program, inputs)
    np.testing.assert_allclose(got["LO"], lo * c - hi * s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["HI"], hi * c + lo * s, rtol=1e-5, atol=1e-6)


def test_per_chunk_folding_skips_sums_that_select_other_chunks_and_keeps_contractions():
    """Three sums over the same four chunks of one element, selecting chunk 2, chunk 1 and
    weighting by the position: each chunk combines only the sums its selections keep, and a
    contraction whose operand became a known number still contracts."""
    ast = parse_program("""
dim t = 64 / 16
dim c = 4 / 1
dim n = 32 / 16
input X[t, c], W[c, n] : f32
Y[t, n] = sum[c] where(c == 2, 1, 0) * W[c, n] * X[t, c] + sum[c] where(c == 1, 1, 0) * X[t, c] * W[c, n]
Z[t, n] = sum[c] (c * 2) * W[c, n] + Y[t, n]
output Z
""", "chunks.bbp")
    r = fuse(lower(ast), load_packs([]), H100)
    source = numpy_gen.generate(r.program)
    assert re.findall(r"for c0 in \((\d),\):", source) == ["0", "1", "2", "3"]
    assert source.count("X[:, c0:c0 + 1]") == 2  # chunks 1 and 2 only
    inputs = random_inputs(ast, seed=2)
    x, w = inputs["X"].astype(np.float64), inputs["W"].astype(np.float64)
    want = x[:, [2]] * w[2] + x[:, [1]] * w[1] + (2 * np.arange(4.0)) @ w
    np.testing.assert_allclose(numpy_gen.run(r.program, inputs)["Z"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(interp.run(r.program, inputs)["Z"], want, rtol=1e-5, atol=1e-5)


def test_a_mask_added_to_a_value_is_subtracted_where_the_condition_fails():
    """`where(c, x, x + a)` is computed as `x - where(c, 0, -a)`, the selection over the
    condition's axes only, and both orientations give the interpreter's values bit for bit:
    infinities, NaN, and the sign of a zero that the mask keeps."""
    source = """
dim h = 3
dim q = 8 / 4
dim k = 8 / 4
input X[h, q, k] : f32
A[h, q, k] = where(k <= q, X[h, q, k], X[h, q, k] + -inf)
B[h, q, k] = where(k == q, X[h, q, k] + 2.5, X[h, q, k])
output A, B
"""
    p = lower(parse_program(source))
    x = rand(3, 8, 8, seed=4)
    x[0, 0, 0], x[1, 5, 2], x[2, 3, 3], x[0, 7, 1] = -0.0, np.inf, np.nan, -np.inf
    code = numpy_gen.generate(p)
    assert re.search(r"elementwise_where\(\w+, f32\(0\.0\), f32\(\"inf\"\)\)", code)
    assert re.search(r"elementwise_where\(\w+, f32\(-2\.5\), f32\(0\.0\)\)", code)
    got, want = numpy_gen.run(p, {"X": x}), interp.run(p, {"X": x})
    for name in ("A", "B"):
        assert np.array_equal(got[name], want[name], equal_nan=True), name
        assert np.array_equal(np.signbit(got[name]), np.signbit(want[name])), name


def test_heads_repeated_by_a_sum_with_zero_positions_are_a_view():
    """Grouped-query attention's shared key heads, as an import writes their repeat for each
    query head (`K[g, j, d] + 0 * h`), are a broadcast view of K's memory, stored as that view
    and read by the product with a batch stride of 0 (LLaMA's layer at 128 tokens copied K
    and V so, 10-13 µs each); an input's repeat is copied, its memory being the caller's.
    The numbers are those of the interpreter and a float64 evaluation."""
    ast = parse_program("dim g = 2\ndim h = 3\ndim i = 8\ndim j = 16 / 8\ndim d = 4\n"
                        "input Q[g, h, i, d], K[g, j, d], V[g, j, d] : f32\n"
                        "KR[g, j, d] = K[g, j, d] * 0.5\n"
                        "R[g, h, j, d] = KR[g, j, d] + 0 * h\n"
                        "VR[g, h, j, d] = V[g, j, d] + 0 * h\n"
                        "S[g, h, i, j] = sum[d] Q[g, h, i, d] * R[g, h, j, d]\n"
                        "O[g, h, i, d] = sum[j] S[g, h, i, j] * VR[g, h, j, d]\n"
                        "output O\n")
    p = lower(ast)
    inputs = random_inputs(ast, seed=31)
    source = numpy_gen.generate(p)
    repeat = kernel_body(source, "kernel_R")
    assert "np.broadcast_to(" in repeat and "np.empty" not in repeat and "+" not in repeat, \
        repeat
    assert "np.empty" in kernel_body(source, "kernel_VR"), source
    got, want = numpy_gen.run(p, inputs), interp.run(p, inputs)
    assert got["R"].strides[1] == 0 and np.shares_memory(got["R"], got["KR"])
    for name in ("R", "VR", "S", "O"):
        assert_close(got[name], want[name], f"{name} vs interpreter")
    assert_close(got["O"], dense.evaluate(ast, inputs, dtype=np.float64)["O"], "O vs float64")


def test_a_half_sliced_from_a_written_tensor_is_a_view():
    """RoPE's halves, as an import writes its Slice (`sum[c] where(c == 0, K[t, (h, c, e)], 0)`
    over chunks of one), are the chunk taken as it is: stored as a view of K's memory, not
    copied (LLaMA's layer at 128 tokens: its two key halves 14.5 -> 6.2 µs); an input's half
    is copied, its memory being the caller's.  The numbers are the interpreter's."""
    ast = parse_program("dim t = 16 / 8\ndim h = 2\ndim c = 2 / 1\ndim e = 4\ndim f = 16\n"
                        "input X[t, f] : f32\n"
                        "K[t, f] = X[t, f] * 0.5\n"
                        "K1[h, t, e] = sum[c] where(c == 0, K[t, (h, c, e)], 0)\n"
                        "K2[h, t, e] = sum[c] where(c == 1, K[t, (h, c, e)], 0)\n"
                        "X1[h, t, e] = sum[c] where(c == 0, X[t, (h, c, e)], 0)\n"
                        "Y[h, t, e] = K1[h, t, e] - K2[h, t, e] + X1[h, t, e]\n"
                        "output Y\n")
    p = lower(ast)
    inputs = random_inputs(ast, seed=32)
    source = numpy_gen.generate(p)
    for half in ("kernel_K1", "kernel_K2"):
        assert "np.empty" not in kernel_body(source, half), source
    assert "np.empty" in kernel_body(source, "kernel_X1"), source
    got, want = numpy_gen.run(p, inputs), interp.run(p, inputs)
    assert np.shares_memory(got["K1"], got["K"]) and np.shares_memory(got["K2"], got["K"])
    assert not np.shares_memory(got["X1"], inputs["X"])
    for name in ("K1", "K2", "X1", "Y"):
        assert_close(got[name], want[name], f"{name} vs interpreter")


# A's direct reader (B) comes before its reader through a view (Y): A, and its view, must live
# until Y has run.
CHAIN_WITH_A_VIEW = """
dim r = 256 / 64
dim c = 1024 / 64
dim h = 2
dim d = 512 / 64
input X[r, c] : f32
A[r, c] = X[r, c] * 2
B[r, c] = A[r, c] + 1
C[r, h, d] = B[r, (h, d)] * 3
D[r, h, d] = C[r, h, d] - 1
Y[r, h, d] = D[r, h, d] + A[r, (h, d)]
output Y
"""


def test_outputs_returns_the_outputs_and_frees_each_temporary_after_its_last_reader():
    """`run` returns every stored tensor, so every temporary lives to the end; `outputs`
    returns the outputs and drops a temporary once no later kernel reads it (directly or
    through a view), so a chain of 1 MiB arrays holds a few at a time, not all of them."""
    p = lower(parse_program(CHAIN_WITH_A_VIEW))
    module = numpy_gen.load(p, threads=1, native=False)
    inputs = {"X": rand(256, 1024, seed=3)}
    every, outputs = module.run(**inputs), module.outputs(**inputs)
    assert set(every) == {"A", "B", "C", "D", "Y"} and set(outputs) == {"Y"}
    want = interp.run(p, inputs)["Y"]
    assert np.array_equal(outputs["Y"], every["Y"])
    np.testing.assert_allclose(outputs["Y"], want, rtol=1e-6)

    def peak(fn) -> int:
        gc.collect()
        tracemalloc.start()
        try:
            fn(**inputs)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    mib = 2 ** 20
    assert peak(module.run) >= 5 * mib
    assert peak(module.outputs) <= 3 * mib + 2 ** 16  # A, the array being read, the new one


def test_a_temporary_only_reshaped_later_is_computed_where_it_is_read():
    """`t = x.reshape(a)` read as `t.reshape(b)` is `x.reshape(b)` there; any other value so
    read moves to its reader, parenthesized where it is not a primary.  Not where the reader
    reads it otherwise, reads a computed value twice, reads it inside a loop, or a statement
    between redefines what it reads; never for a kept name (a parameter, an output)."""
    S = numpy_gen._Stmt
    def once(stmts, kept=frozenset()):
        return [s.lines for s in numpy_gen._reshaped_once(stmts, kept)]
    view = S(["t1 = x.reshape(1, 4, 8)"], ("t1",))
    twice = S(["y = f(t1.reshape(4, 8), t1.reshape(4, 8))"], ("y",), frozenset({"t1"}))
    assert once([view, twice]) == [["y = f(x.reshape(4, 8), x.reshape(4, 8))"]]
    summed = S(["t2 = a + b"], ("t2",))
    assert once([summed, S(["y = t2.reshape(4, 8)"], ("y",), frozenset({"t2"}))]) == \
        [["y = (a + b).reshape(4, 8)"]]
    assert once([summed, S(["y = f(t2.reshape(4, 8), t2.reshape(8, 4))"], ("y",),
                           frozenset({"t2"}))])[0] == ["t2 = a + b"]
    assert once([view, S(["y = t1 + t1.reshape(1, 4, 8)"], ("y",), frozenset({"t1"}))])[0] == \
        view.lines
    assert once([view, S(["for i in (0, 1):", "    y = t1.reshape(4, 8)[i]"], ("y",),
                         frozenset({"t1"}))])[0] == view.lines
    product = S(["t3 = matmul(a, b).reshape(1, 4, 8)"], ("t3",), frozenset({"a", "b"}))
    assert once([product, S(["a = g()"], ("a",)), S(["y = t3.reshape(4, 8)"], ("y",),
                                                   frozenset({"t3"}))])[0] == product.lines
    assert once([product, S(["y = t3.reshape(4, 8)"], ("y",), frozenset({"t3"}))]) == \
        [["y = matmul(a, b).reshape(4, 8)"]]
    assert once([view, S(["y = t1.reshape(4, 8)"], ("y",), frozenset({"t1"}))], {"t1"})[0] == \
        view.lines


def test_a_store_that_regroups_dimensions_is_a_reshape():
    """Stores that regroup a tensor's dimensions, as the importer writes them where two
    operators cut one dimension two ways (`regroup`): a tensor's pieces merged in memory order
    (a view of its memory), in another order (a transposed copy), three at once, and an
    input's (a copy: the caller's array is not the program's).  Each is a reshape, without a
    loop; so is the regrouping of values a store computes (a concatenation of two pieces),
    after a kernel of its own stores them.  A selection that looks alike but picks some
    positions twice and others never is not one.  Every value is the interpreter's."""
    source = ("dim a = 5 / 1\ndim b = 2 / 1\ndim c = 3 / 1\ndim r = 10 / 1\ndim q = 30 / 1\n"
              "dim e = 16\ninput X[a, b, e] : f32\ninput U[a, c, b, e] : f32\n"
              "T[a, b, e] = exp(X[a, b, e])\n"
              "R[r, e] = (sum[a, b] where((a * 2 + b) == (r), T[a, b, e], 0))\n"
              "S[r, e] = (sum[b, a] where((b * 5 + a) == (r), T[a, b, e], 0))\n"
              "V[a, c, b, e] = U[a, c, b, e] * 2\n"
              "Q[q, e] = (sum[a, c, b] where((a * 6 + c * 2 + b) == (q), V[a, c, b, e], 0))\n"
              "I[r, e] = (sum[a, b] where((a * 2 + b) == (r), X[a, b, e], 0))\n"
              "N[r, e] = (sum[a, b] where((a * 3 + b) == (r), T[a, b, e], 0))\n"
              "W[r, e] = (sum[a, b] where((a * 2 + b) == (r), where(a < 3, T[a, b, e], "
              "X[a, b, e] * 3), 0))\n"
              "Y[r, e] = R[r, e] + S[r, e]\n"
              "output Y\noutput Q\noutput I\noutput N\noutput W\n")
    ast = parse_program(source)
    p = lower(ast)
    code = numpy_gen.generate(p)
    for fn in ("kernel_R", "kernel_S", "kernel_Q", "kernel_I"):
        assert python_loops(kernel_body(code, fn)) == 0 and ".reshape(" in kernel_body(code, fn)
    assert "regrouped" not in kernel_body(code, "kernel_N")
    assert "W_values = kernel_W_values(" in kernel_body(code, "kernel_W")
    inputs = random_inputs(ast, seed=8)
    got, ref = numpy_gen.run(p, inputs), interp.run(p, inputs)
    for name in ("R", "S", "Q", "I", "N", "W", "Y"):
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    t = np.exp(inputs["X"])
    np.testing.assert_allclose(got["S"], t.transpose(1, 0, 2).reshape(10, 16), rtol=1e-6)
    assert np.shares_memory(got["R"], got["T"]) and not np.shares_memory(got["I"], inputs["X"])



def test_stores_of_one_regrouping_share_an_array_only_where_the_caller_gets_neither():
    """A kernel storing one regrouping twice (a fused program's two readers of it): one
    array for a temporary, but each output an array of its own, as any two outputs are."""
    regrouped = ("reduce(a, sum, bsum(a, reduce(b, sum, bsum(b, where(eq(pos(a) * 2.0 + "
                 "pos(b), pos(r)), load(X[a, b, e]), 0.0)))))")
    dims = "dim a = 5 / 1\ndim b = 2 / 1\ndim r = 10 / 1\ndim e = 16\n"
    for roles, shared in (("temp Q[r, e]", True), ("output Q[r, e]", False)):
        p = bbk(f"input X[a, b, e] : f32\noutput P[r, e] : f32\n{roles} : f32\n"
                f"output Y[r, e] : f32\nkernel [r, e]:\n  P[r, e] = {regrouped}\n"
                f"  Q[r, e] = {regrouped}\nkernel [r, e]:\n  Y[r, e] = load(Q[r, e]) * 2.0\n",
                dims)
        inputs = random_inputs(p, seed=9)
        got = numpy_gen.run(p, inputs)
        want = inputs["X"].reshape(10, 16)
        for name in ("P", "Q"):
            np.testing.assert_array_equal(got[name], want)
        assert np.shares_memory(got["P"], got["Q"]) == shared
        assert not np.shares_memory(got["P"], inputs["X"])
