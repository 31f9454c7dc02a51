"""Positions, comparisons and selections in programs, and the block skipping derived from them.

Masked attention is checked against a float64 reference written here with numpy (not the
dense evaluator): causal, sliding-window, prefix-LM and ALiBi masks, fused, through the
reference interpreter and the numpy backend (the CUDA backend runs every example in
test_cuda_backend).  Skipping is checked where it is decided: which folds may skip, on which
blocks, and what the cost model counts.
"""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.codegen import cuda_gen, numpy_gen
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import Binary, Const, Pos, Reduce, Unary, children, operator, postorder
from bbrules.lower import lower
from bbrules.masking import NumpyAlgebra, may_hold, skip_predicate, visited_share
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.plan import plan_for
from bbrules.targets import get_target

EXAMPLES = Path(__file__).parent.parent / "examples"
H100 = get_target("h100")
WHOLE = Options(split_folds=False, reblock=False)


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


def attention(mask: str, n: int = 256, bq: int = 32, bk: int = 64, heads: int = 2) -> str:
    """Attention over `heads` heads whose scores are `where(mask, scores, -inf)`."""
    return f"""
dim h = {heads} / 1
dim q = {n} / {bq}
dim k = {n} / {bk}
dim d = 32
input Q[h, q, d], K[h, k, d], V[h, k, d] : f32
S[h, q, k] = where({mask}, sum[d] Q[h, q, d] * K[h, k, d] * 0.125, -inf)
M[h, q]    = max[k] S[h, q, k]
E[h, q, k] = exp(S[h, q, k] - M[h, q])
L[h, q]    = sum[k] E[h, q, k]
O[h, q, d] = sum[k] E[h, q, k] * V[h, k, d] / L[h, q]
output O
"""


def reference(inputs: dict[str, np.ndarray], allowed: np.ndarray,
              bias: np.ndarray | float = 0.0) -> np.ndarray:
    """Masked attention in float64; a row with no allowed key gives 0 (FlashAttention)."""
    q, k, v = (inputs[n].astype(np.float64) for n in "QKV")
    s = np.einsum("hqd,hkd->hqk", q, k) * 0.125 + bias
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = e.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,hkd->hqd", e, v) / np.where(l == 0, 1.0, l)


Q_POS, K_POS = np.arange(256)[:, None], np.arange(256)[None, :]
MASKS = {
    "causal": ("k <= q", Q_POS >= K_POS),
    "sliding window": ("k <= q and q - k < 64", (Q_POS >= K_POS) & (Q_POS - K_POS < 64)),
    "prefix-LM": ("k <= q or k < 48", (Q_POS >= K_POS) | (K_POS < 48)),
    "strict causal": ("k < q", Q_POS > K_POS),  # row 0 attends to nothing
}


def fused_attention(pack, mask: str, **kw):
    ast = parse_program(attention(mask, **kw))
    return ast, fuse(lower(ast), pack, H100, options=WHOLE)


@pytest.mark.parametrize("name", MASKS)
def test_masked_attention_fuses_to_one_pass_that_matches_a_float64_reference(pack, name):
    mask, allowed = MASKS[name]
    ast, r = fused_attention(pack, mask)
    (kernel,) = r.program.kernels
    assert set(r.program.tensors) == {"Q", "K", "V", "O"}  # the scores are never stored
    inputs = random_inputs(ast, seed=3)
    want = reference(inputs, allowed)
    for got in (interp.run(r.program, inputs), numpy_gen.run(r.program, inputs)):
        assert np.isfinite(got["O"]).all()
        np.testing.assert_allclose(got["O"], want, rtol=1e-4, atol=1e-5)


def test_alibi_biases_the_scores_by_distance(pack):
    source = attention("k <= q").replace("* 0.125, -inf)", "* 0.125 - 0.5 * abs(q - k), -inf)")
    ast = parse_program(source)
    r = fuse(lower(ast), pack, H100, options=WHOLE)
    assert len(r.program.kernels) == 1 and "S" not in r.program.tensors
    inputs = random_inputs(ast, seed=4)
    want = reference(inputs, Q_POS >= K_POS, -0.5 * np.abs(Q_POS - K_POS))
    np.testing.assert_allclose(numpy_gen.run(r.program, inputs)["O"], want, rtol=1e-4,
                               atol=1e-5)


def test_the_dense_evaluator_reads_positions_as_numbers():
    ast = parse_program("dim i = 6 / 2\ndim j = 4 / 2\ninput A[i, j] : f32\n"
                        "B[i, j] = where(not (i > j) or i == 5, A[i, j], i - 2 * j)\noutput B\n")
    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    i, j = np.arange(6)[:, None], np.arange(4)[None, :]
    want = np.where((i <= j) | (i == 5), a, i - 2.0 * j)
    np.testing.assert_array_equal(dense.evaluate(ast, {"A": a})["B"], want)
    np.testing.assert_array_equal(interp.run(lower(ast), {"A": a})["B"], want)
    np.testing.assert_array_equal(numpy_gen.run(lower(ast), {"A": a})["B"], want)


# --------------------------------------------------------------------------------------------
# Which folds skip, and where


def test_causal_attention_at_4096_visits_about_half_the_key_blocks(pack):
    causal = fuse(lower(load_program(EXAMPLES / "causal_attention.bbp")), pack, H100)
    plain_source = (EXAMPLES / "causal_attention.bbp").read_text().replace(
        "where(k <= q, sum[d] Q[h, q, d] * K[h, k, d] * 0.125, -inf)",
        "sum[d] Q[h, q, d] * K[h, k, d] * 0.125")
    plain = fuse(lower(parse_program(plain_source)), pack, H100)
    (kernel,) = causal.program.kernels
    assert set(causal.program.tensors) == {"Q", "K", "V", "O"}
    assert len(plain.program.kernels) == 1
    assert causal.after.flops <= 0.55 * plain.after.flops
    assert causal.after.traffic <= 0.55 * plain.after.traffic
    (loop,) = [op for op in plan_for(causal.program, kernel, H100.local_capacity).loops
               if op.skip is not None]
    assert loop.axis == "k" and loop.skip == Binary("le", Pos("k"), Pos("q"))


N = 4096
Q_FULL, K_FULL = np.arange(N)[:, None], np.arange(N)[None, :]
AT_4096 = {  # mask, allowed keys, additive bias, the largest share of the plain flops
    "causal": ("k <= q", Q_FULL >= K_FULL, 0.0, 0.55),
    "sliding window 256": ("k <= q and q - k < 256",
                           (Q_FULL >= K_FULL) & (Q_FULL - K_FULL < 256), 0.0, 0.1),
    "prefix-LM 512": ("k <= q or k < 512", (Q_FULL >= K_FULL) | (K_FULL < 512), 0.0, 0.55),
    "ALiBi": ("k <= q", Q_FULL >= K_FULL, -0.5 * np.abs(Q_FULL - K_FULL), 0.55),
}


@pytest.fixture(scope="module")
def plain_at_4096(pack):
    return fuse(lower(load_program(EXAMPLES / "attention.bbp")), pack, H100, options=WHOLE)


@pytest.mark.parametrize("name", AT_4096)
def test_masked_attention_at_4096_visits_only_what_its_mask_reaches(pack, plain_at_4096, name):
    """One head at N = 4096: one kernel, the scores never stored, modeled flops and traffic
    the share of the unmasked program's that the mask's blocks reach (about half for causal
    masks, the band for a window of 256), and the numbers of a float64 reference."""
    mask, allowed, bias, share = AT_4096[name]
    source = attention(mask, n=N, bq=64, bk=64, heads=1).replace("dim d = 32", "dim d = 64")
    if name == "ALiBi":
        source = source.replace("* 0.125, -inf)", "* 0.125 - 0.5 * abs(q - k), -inf)")
    ast = parse_program(source)
    r = fuse(lower(ast), pack, H100, options=WHOLE)
    assert len(r.program.kernels) == 1 and set(r.program.tensors) == {"Q", "K", "V", "O"}
    plain = plain_at_4096.after
    assert r.after.flops <= share * plain.flops and r.after.traffic <= share * plain.traffic
    inputs = random_inputs(ast, seed=5)
    want = reference(inputs, allowed[None], bias)
    np.testing.assert_allclose(numpy_gen.run(r.program, inputs)["O"], want, rtol=1e-4,
                               atol=1e-5)


def test_a_band_visits_only_the_blocks_it_crosses():
    band = Binary("and", Binary("le", Pos("k"), Pos("q")),
                  Binary("lt", Binary("sub", Pos("q"), Pos("k")), Const(256.0)))
    visits = visited_share(band, {"q": (64, 64), "k": (64, 64)}, frozenset({"q"}))
    # each query block crosses its own key block and the four before it (fewer at the start)
    assert visits.mean == pytest.approx(sum(min(i + 1, 5) for i in range(64)) / 64 ** 2)
    assert visits.heaviest == pytest.approx(5 / 64)


# Each position occurs once in these: interval bounds are exact.
EXACT = [
    Binary("le", Pos("k"), Pos("q")),
    Binary("lt", Binary("sub", Pos("q"), Pos("k")), Const(40.0)),
    Binary("le", Unary("abs", Binary("sub", Pos("q"), Pos("k"))), Const(9.0)),
    Binary("ne", Binary("mul", Pos("q"), Const(2.0)), Pos("k")),
    Unary("not", Binary("gt", Pos("k"), Binary("add", Pos("q"), Const(5.0)))),
]
# k occurs twice: the bounds may say "may hold" where it does not, never the reverse.
OVER = [
    Binary("and", Binary("le", Pos("k"), Pos("q")),
           Unary("not", Binary("lt", Pos("k"), Const(30.0)))),
    Binary("or", Binary("eq", Pos("q"), Pos("k")), Binary("gt", Pos("k"), Const(70.0))),
]


@pytest.mark.parametrize("p", EXACT + OVER, ids=str)
def test_bounds_say_where_a_predicate_may_hold(p):
    q, k = np.meshgrid(np.arange(96.0), np.arange(96.0), indexing="ij")
    holds = np.asarray(_eval(p, {"q": q, "k": k}), dtype=bool)
    inexact = 0
    for bq, bk in ((16, 16), (32, 8), (8, 32)):
        for i, j in itertools.product(range(96 // bq), range(96 // bk)):
            block = holds[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            bounds = {"q": (np.float64(i * bq), np.float64(i * bq + bq - 1)),
                      "k": (np.float64(j * bk), np.float64(j * bk + bk - 1))}
            may = bool(may_hold(p, bounds, NumpyAlgebra()))
            assert may >= bool(block.any()), (i, j)
            inexact += may != bool(block.any())
    assert inexact == 0 or p in OVER


def _eval(p, positions: dict[str, np.ndarray]) -> np.ndarray:
    """`p` at every position, elementwise (the operators' own numpy implementations)."""
    values: dict = {}
    for n in postorder(p):
        if isinstance(n, Pos):
            values[n] = positions[n.axis]
        elif isinstance(n, Const):
            values[n] = n.value
        else:
            values[n] = operator(n).numpy(*(values[c] for c in children(n)))
    return values[p]


def _folds(pack, source: str) -> list[Reduce]:
    r = fuse(lower(parse_program(source)), pack, H100, options=WHOLE)
    return [n for k in r.program.stores for n in postorder(k.value)
            if isinstance(n, Reduce) and n.axis == "k"]


def test_a_fold_skips_only_where_its_masked_contribution_is_its_identity(pack):
    # a masked max contributes -inf, its identity; a sum of masked values replaced by 0 does too
    src = ("dim q = 64 / 16\ndim k = 64 / 16\ninput A[q, k] : f32\n"
           "B[q] = max[k] where(k <= q, A[q, k], -inf)\n"
           "C[q] = sum[k] where(k <= q, A[q, k], 0.0)\n"
           "D[q] = sum[k] where(k <= q, A[q, k], 1.0)\n"
           "output B, C, D\n")
    skips = {n.monoid.name: skip_predicate(n) for n in _folds(pack, src)}
    assert skips["max"] == Binary("le", Pos("k"), Pos("q"))
    ds = [n for n in _folds(pack, src) if n.monoid.name == "sum"]
    predicates = {skip_predicate(n) for n in ds}
    assert predicates == {Binary("le", Pos("k"), Pos("q")), None}  # C skips, D cannot


@pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator compiles with g++")
@pytest.mark.parametrize("name", ["causal", "sliding window", "strict causal"])
def test_generated_cuda_tests_each_key_block_and_masks_only_the_cut_ones(pack, name):
    """Each key block is tested before it is visited; a block the mask allows everywhere
    runs a copy of the body without the mask (the other copy applies it), and the emulated
    kernel matches the float64 reference."""
    from cuda_emu import emulate
    mask, allowed = MASKS[name]
    ast, r = fused_attention(pack, mask)
    module = cuda_gen.generate(r.program)
    loop = module.source[module.source.index("for (int bb_b"):]
    assert loop.count("continue;  // every element masked") == 1
    whole, cut = re.split(r"\n\s*else \{\n", loop, maxsplit=1)
    assert "? (v" not in whole and "? (v" in cut  # where(mask, score, -inf)
    got = emulate(module, random_inputs(ast, seed=3))
    np.testing.assert_allclose(got["O"], reference(random_inputs(ast, seed=3), allowed),
                               rtol=1e-4, atol=1e-5)


def test_a_split_fold_keeps_positions_and_skips_the_masked_chunks(pack):
    """Decode attention over a cache of which only the first 3000 keys are valid: the split
    chunks read positions as chunk start plus position in the chunk, and chunks wholly past
    the valid keys are skipped (they store their identity state, which the combine ignores)."""
    source = (EXAMPLES / "decode_attention.bbp").read_text().replace(
        "S[h, k] = sum[d] Q[h, d] * K[h, k, d] * 0.08838834764831845",
        "S[h, k] = where(k < 3000, sum[d] Q[h, d] * K[h, k, d] * 0.08838834764831845, -inf)")
    ast = parse_program(source, dims={"h": (8, 1), "k": (4096, 64)})
    r = fuse(lower(ast), pack, H100)
    assert len(r.program.kernels) == 2 and any(t.role == "view" for t in r.program.tensors.values())
    kv = 2 * 8 * 4096 * 128 * 4
    assert r.after.bytes_read < 0.8 * kv  # 3000 of 4096 keys, in whole blocks of 64
    inputs = random_inputs(ast, seed=5)
    allowed = np.arange(4096)[None, :] < 3000
    q, k, v = (inputs[n].astype(np.float64) for n in "QKV")
    s = np.where(allowed, np.einsum("hd,hkd->hk", q, k) * 0.08838834764831845, -np.inf)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    want = np.einsum("hk,hkd->hd", e, v) / e.sum(axis=1, keepdims=True)
    for got in (interp.run(r.program, inputs), numpy_gen.run(r.program, inputs)):
        np.testing.assert_allclose(got["O"], want, rtol=1e-4, atol=1e-5)


def test_numpy_iterates_only_the_blocks_a_predicate_of_the_loop_axis_may_hold_on(walked_folds):
    """numpy computes every grid block at once, so it skips a block of the loop only where
    the predicate is false for all of them: here, one that reads the loop's positions alone
    (walked in blocks, as larger tiles are)."""
    ast = parse_program("dim r = 64 / 16\ndim c = 256 / 32\ninput X[r, c] : f32\n"
                        "Y[r] = sum[c] where(c < 100 and c >= 40, X[r, c], 0.0)\n"
                        "Z[r] = max[c] where(c < 70 or c >= 200, X[r, c], -inf)\noutput Y, Z\n")
    source = numpy_gen.generate(lower(ast))
    # Y's blocks: the mask cuts the first and the last; the middle one needs no mask
    assert all(f"in range({lo}, {lo + 32}, 32):" in source for lo in (32, 64, 96))
    # Z's blocks where its predicate holds are two runs: one loop, masked throughout
    assert "in (0, 32, 64, 192, 224):" in source
    inputs = random_inputs(ast, seed=1)
    want = dense.evaluate(ast, inputs, np.float64)
    got = numpy_gen.run(lower(ast), inputs)
    for o in ("Y", "Z"):
        np.testing.assert_allclose(got[o], want[o], rtol=1e-5, atol=1e-5)


def fused_into_one_kernel(text: str, pack) -> tuple[str, dict[str, np.ndarray]]:
    """`text` fused on h100 into one kernel: its numpy code, and its inputs (random) and
    outputs by name."""
    ast = parse_program(text)
    program = fuse(lower(ast), pack, H100).program
    assert len(program.kernels) == 1
    inputs = random_inputs(ast, seed=2)
    return numpy_gen.generate(program), {**inputs, **numpy_gen.run(program, inputs)}


def test_numpy_skips_by_an_enclosing_loops_position_and_may_visit_nothing(pack):
    """A band fused into its consumer: the fold over `a` skips by the position of the loop
    storing `e`, so each block of `e` visits only the blocks of `a` its predicate may hold on
    (a table by the enclosing loop's block), split where it holds throughout (unmasked) from
    where it is cut (masked), and the first block of `e` visits none, leaving the fold's
    identity."""
    source, got = fused_into_one_kernel(
        "dim t = 64 / 16\ndim a = 64 / 32\ndim e = 96 / 32\ndim n = 32 / 16\n"
        "input A[t, a], W[e, n] : f32\nJ[t, e] = sum[a] where(a + 32 <= e, exp(A[t, a]), 0)\n"
        "Y[t, n] = sum[e] J[t, e] * W[e, n]\noutput J, Y\n", pack)
    for table in ("{0: (), 32: range(0, 32, 32), 64: ()}[e0]",  # cut by the band
                  "{0: (), 32: (), 64: range(0, 32, 32)}[e0]",  # within it
                  "{0: (), 32: (), 64: range(32, 64, 32)}[e0]"):
        assert table in source, source
    e, a = np.arange(96)[:, None], np.arange(64)[None, :]
    band = np.exp(got["A"].astype(np.float64)) @ (a + 32 <= e).T
    np.testing.assert_allclose(got["J"], band, rtol=1e-6)
    np.testing.assert_array_equal(got["J"][:, :32], 0)
    np.testing.assert_allclose(got["Y"], band @ got["W"], rtol=1e-5, atol=1e-4)


def test_a_concatenation_fused_into_its_consumer_gathers_each_piece(pack):
    """Each piece of a concatenation is a one-hot sum over the piece's blocks of several
    elements: the numpy code gathers it for each block of the joined axis, the whole piece at
    once, where it built a selection per block of the piece (`selections_as_gathers`)."""
    source, got = fused_into_one_kernel(
        "dim t = 64 / 16\ndim a = 64 / 32\ndim b = 32 / 16\ndim e = 96 / 32\ndim n = 32 / 16\n"
        "input A[t, a], B[t, b], W[e, n] : f32\nJ[t, e] = concat(e, exp(A[t, a]), B[t, b])\n"
        "Y[t, n] = sum[e] J[t, e] * W[e, n]\noutput J, Y\n", pack)
    assert source.count("gather_one_hot(") == 2 and "for a0" not in source, source
    joined = np.concatenate([np.exp(got["A"].astype(np.float64)), got["B"]], axis=1)
    np.testing.assert_allclose(got["J"], joined, rtol=1e-6)
    np.testing.assert_allclose(got["Y"], joined @ got["W"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocks", ["4 / 1", "64 / 16"])
def test_a_fold_whose_predicate_never_holds_visits_nothing_and_gives_its_identity(blocks):
    """No block of c may hold `c > 100`: the loops visit none, the max is -inf and the sum 0
    on every element (the identity, broadcast to the tile), also where a store or a
    contraction reads them."""
    ast = parse_program(f"dim t = 32 / 16\ndim c = {blocks}\ndim n = 8\n"
                        "input X[t, c], W[t, n] : f32\n"
                        "M[t] = max[c] where(c > 100, X[t, c], -inf)\n"
                        "S[t] = sum[c] where(c > 100 and c < 200, X[t, c], 0)\n"
                        "Y[n] = sum[t] (S[t] + 1) * W[t, n]\noutput M, S, Y\n")
    inputs = random_inputs(ast, seed=3)
    for p in (lower(ast), fuse(lower(ast), load_packs([]), H100).program):
        got = numpy_gen.run(p, inputs)
        assert (got["M"] == -np.inf).all() and (got["S"] == 0).all()
        np.testing.assert_allclose(got["Y"], inputs["W"].sum(axis=0), rtol=1e-5)


def test_an_additive_mask_from_positions_skips_blocks_as_a_select_does(pack):
    """A mask added to the scores (as ONNX writes masks), `S + where(k <= q, 0, -inf)`: where
    the predicate is false the score is a finite sum plus -inf, which is -inf, so the fold skips
    the same blocks as with `where(k <= q, S, -inf)`, and the numbers are the reference's."""
    select = fused_attention(pack, "k <= q")[1]
    ast = parse_program(attention("k <= q").replace(
        "where(k <= q, sum[d] Q[h, q, d] * K[h, k, d] * 0.125, -inf)",
        "sum[d] Q[h, q, d] * K[h, k, d] * 0.125 + where(k <= q, 0.0, -inf)"))
    r = fuse(lower(ast), pack, H100, options=WHOLE)
    assert len(r.program.kernels) == 1
    assert r.after.bytes_read == select.after.bytes_read
    assert r.after.bytes_read < 0.7 * r.before.bytes_read
    inputs = random_inputs(ast, seed=3)
    for got in (interp.run(r.program, inputs), numpy_gen.run(r.program, inputs)):
        np.testing.assert_allclose(got["O"], reference(inputs, MASKS["causal"][1]),
                                   rtol=1e-4, atol=1e-5)
