"""Views in programs: a reference may read one dimension of its tensor as several
(`X[t, (h, d)]`, row-major), which is what rotary embeddings, head splitting and fused QKV
weights need.  RoPE (rotate-half and interleaved) and QK-norm are checked against float64
references written here with numpy, fused into attention."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.codegen import numpy_gen
from bbrules.errors import SourceError
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

EXAMPLES = Path(__file__).parent.parent / "examples"
H100 = get_target("h100")
SMALL = {"h": (2, 1), "q": (128, 32), "k": (128, 32)}


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotate_pairs(x: np.ndarray) -> np.ndarray:
    """The interleaved form (GPT-J): features (2j, 2j + 1) are a pair."""
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    s = np.einsum("hqd,hkd->hqk", q, k) * 0.125
    n = s.shape[-1]
    s = np.where(np.arange(n)[None, :] <= np.arange(n)[:, None], s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hqk,hkd->hqd", e, v) / e.sum(axis=-1, keepdims=True)


def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6) * g


def assert_reported(text: str, line: int, column: int, message: str) -> None:
    """Parsing `text` fails with `message` at `line` and `column`."""
    with pytest.raises(SourceError) as err:
        parse_program(text, "bad.bbp")
    assert message in str(err.value)
    assert (err.value.span.line, err.value.span.column) == (line, column)


def fused_outputs(pack, ast) -> list[dict[str, np.ndarray]]:
    r = fuse(lower(ast), pack, H100)
    assert not {"S", "E", "QR"} & set(r.program.tensors)  # scores, rotated Q never stored
    inputs = random_inputs(ast, seed=9)
    return inputs, [interp.run(r.program, inputs), numpy_gen.run(r.program, inputs)]


@pytest.mark.parametrize("example", ["rope_attention", "rope_qknorm_attention"])
def test_rope_fused_into_attention_matches_a_float64_reference(pack, example):
    ast = load_program(EXAMPLES / f"{example}.bbp", SMALL)
    inputs, outputs = fused_outputs(pack, ast)
    x = {n: a.astype(np.float64) for n, a in inputs.items()}
    cos, sin = np.tile(x["COS"], 2), np.tile(x["SIN"], 2)  # [positions, 64]: both halves
    q, k = x["Q"], x["K"]
    if example == "rope_qknorm_attention":
        q, k = rms(q, x["GQ"]), rms(k, x["GK"])
    want = causal_attention(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin,
                            x["V"])
    for got in outputs:
        np.testing.assert_allclose(got["O"], want, rtol=1e-4, atol=1e-5)


def test_interleaved_rope_reads_the_head_dimension_as_pairs(pack):
    source = (EXAMPLES / "rope_attention.bbp").read_text()
    source = source.replace("(p, i)", "(i, p)").replace("(p2, i)", "(i, p2)")
    ast = parse_program(source, dims=SMALL)
    inputs, outputs = fused_outputs(pack, ast)
    x = {n: a.astype(np.float64) for n, a in inputs.items()}
    cos, sin = np.repeat(x["COS"], 2, axis=1), np.repeat(x["SIN"], 2, axis=1)
    q, k = x["Q"], x["K"]
    want = causal_attention(q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin,
                            x["V"])
    for got in outputs:
        np.testing.assert_allclose(got["O"], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("example", ["rope_attention", "rope_qknorm_attention"])
def test_rope_at_full_size_rotates_each_key_once_and_each_query_block_in_flash(pack, example):
    """At 8 heads x 4096: the keys rotated (and normalised) once and stored, each query block
    rotated inside Flash Attention, so the scores are never stored nor recomputed per output
    block: the flops within 5% of causal attention's without RoPE."""
    r = fuse(lower(load_program(EXAMPLES / f"{example}.bbp")), pack, H100)
    assert [k.tensors for k in r.program.kernels] == [("KR",), ("O",)]
    kr = 8 * 4096 * 64 * 4
    assert r.after.bytes_written == kr + 8 * 4096 * 64 * 4  # KR and O
    causal = fuse(lower(load_program(EXAMPLES / "causal_attention.bbp")), pack, H100)
    assert r.after.flops <= 1.05 * causal.after.flops


FUSED_QKV = """
dim t = 64 / 16
dim e = 32 / 16
dim s = 3 / 1          # which of q, k, v
dim h = 2 / 1
dim d = 16
input X[t, e], W[e, f] : f32
dim f = 96 / 32
QKV[t, s, h, d] = sum[e] X[t, e] * W[e, (s, h, d)]
O[h, t, d] = sum[s] where(s == 2, QKV[t, s, h, d], 0.0) + X[t, (h, d)]
output O
"""


def test_fused_qkv_weights_and_head_splitting(pack):
    text = FUSED_QKV.replace("dim f = 96 / 32\n", "").replace("dim d = 16\n",
                                                             "dim d = 16\ndim f = 96 / 32\n")
    ast = parse_program(text)
    inputs = random_inputs(ast, seed=2)
    x, w = (inputs[n].astype(np.float64) for n in "XW")
    v = (x @ w).reshape(64, 3, 2, 16)[:, 2]  # [t, h, d]
    want = v.transpose(1, 0, 2) + x.reshape(64, 2, 16).transpose(1, 0, 2)
    np.testing.assert_allclose(dense.evaluate(ast, inputs, np.float64)["O"], want, rtol=1e-12)
    fused = fuse(lower(ast), pack, H100).program
    for got in (interp.run(lower(ast), inputs), numpy_gen.run(lower(ast), inputs),
                interp.run(fused, inputs), numpy_gen.run(fused, inputs)):
        np.testing.assert_allclose(got["O"], want, rtol=1e-5, atol=1e-5)


MULTI_HEAD = """
dim t = 128 / 32           # queries
dim s = 128 / 32           # keys
dim h = 4 / 1              # heads
dim d = 16                 # features of a head
dim c = 64 / 32            # the model width, 4 heads x 16
dim n = 64 / 32            # output columns
input Q[t, c], K[s, c], V[s, c], WO[c, n] : f32
S[h, t, s] = sum[d] Q[t, (h, d)] * K[s, (h, d)] * 0.25
M[h, t]    = max[s] S[h, t, s]
E[h, t, s] = exp(S[h, t, s] - M[h, t])
L[h, t]    = sum[s] E[h, t, s]
A[h, t, d] = sum[s] E[h, t, s] * V[s, (h, d)] / L[h, t]
Y[t, n]    = sum[h, d] A[h, t, d] * WO[(h, d), n]
output Y
"""


def test_heads_split_from_the_model_width_and_merged_by_the_output_projection(pack):
    """Multi-head attention on model-width Q, K and V: each head reads its 16 features through
    a view (`Q[t, (h, d)]`), and the heads are merged where the output projection reads its
    weights' rows as (head, feature) pairs, `sum[h, d] A * WO[(h, d), n]`: the concatenation
    of the heads times WO, with no merged tensor stored.  Fused, the scores are never stored;
    the numbers are a float64 reference's (split, attend per head, merge, project)."""
    ast = parse_program(MULTI_HEAD)
    r = fuse(lower(ast), pack, H100)
    assert not {"S", "E"} & set(r.program.tensors)
    inputs = random_inputs(ast, seed=8)
    q, k, v = (inputs[n].astype(np.float64).reshape(128, 4, 16).transpose(1, 0, 2)
               for n in "QKV")
    s = np.einsum("htd,hsd->hts", q, k) * 0.25
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    heads = np.einsum("hts,hsd->htd", e, v) / e.sum(axis=-1, keepdims=True)
    merged = heads.transpose(1, 0, 2).reshape(128, 64)
    want = merged @ inputs["WO"].astype(np.float64)
    for got in (interp.run(r.program, inputs), numpy_gen.run(r.program, inputs),
                dense.evaluate(ast, inputs, np.float64)):
        np.testing.assert_allclose(got["Y"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("body, column, message", [
    ("Y[t, h, d] = X[t, (h, c)]", 20, "h (2) x c (4) is 8 elements, 'e' of 'X' has 32"),
    ("Y[t, h, d] = X[(t, h), d]", 17, "t (8) x h (2) is 16 elements, 't' of 'X' has 8"),
    ("Y[t, h, d] = X[t, (h, d), c]", 14, "'X' has 2 axes (X[t, e]), this reference gives 3"),
    ("Y[t, h, d] = R[t, (h, d)]", 20, "a view of the ragged axis 'r'"),
    # (a KV cache of an odd length, its heads split for RoPE: once a traceback from lowering)
    ("Y[r, h, d] = C[r, (h, d)]", 14, "a view of 'C', whose axis 'r' is ragged"),
])
def test_views_whose_sizes_do_not_multiply_out_are_reported_where_they_are(body, column,
                                                                          message):
    text = ("dim t = 8 / 4\ndim e = 32 / 16\ndim h = 2 / 1\ndim d = 16\ndim c = 4\n"
            "dim r = 32 / 12\ninput X[t, e], R[t, r], C[r, e] : f32\n" + body + "\noutput Y\n")
    assert_reported(text, 8, column, message)


# --------------------------------------------------------------------------------------------
# Slices: `X[t, i + c]` reads X's dimension from element c on, over i's extent.


ROPE_BY_SLICES = """
dim t = 256 / 64
dim d = 64
dim i = 32
input X[t, d], COS[t, i], SIN[t, i] : f32
LO[t, i] = X[t, i + 0] * COS[t, i] - X[t, i + 32] * SIN[t, i]
HI[t, i] = X[t, i + 32] * COS[t, i] + X[t, i + 0] * SIN[t, i]
output LO, HI
"""


def test_rotate_half_rope_written_with_slices_is_one_kernel_reading_x_once(pack):
    """The two halves of rotate-half RoPE, each a slice of the head dimension: one kernel
    storing both, X, COS and SIN read once each (the compulsory traffic), and the numbers
    of a float64 reference."""
    ast = parse_program(ROPE_BY_SLICES, "rope.bbp")
    r = fuse(lower(ast), pack, H100)
    assert len(r.program.kernels) == 1
    assert r.after.traffic == (256 * 64 + 2 * 256 * 32 + 2 * 256 * 32) * 4
    inputs = random_inputs(ast, seed=3)
    x, c, s = (inputs[n].astype(np.float64) for n in ("X", "COS", "SIN"))
    cos, sin = np.concatenate([c, c], axis=1), np.concatenate([s, s], axis=1)
    want = x * cos + rotate_half(x) * sin
    for got in (interp.run(r.program, inputs), numpy_gen.run(r.program, inputs),
                dense.evaluate(ast, inputs, np.float64)):
        np.testing.assert_allclose(np.concatenate([got["LO"], got["HI"]], axis=1), want,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ref, column, message", [
    ("X[t, i + 16]", 20, "must start at a multiple of i's extent 32"),
    ("X[t, i + 64]", 20, "runs past its extent 64"),
    ("X[t, i + 2.5]", 20, "must start at a multiple"),
    ("X[t, i + 1e400]", 20, "must start at a multiple"),
    ("X[t, i + 1e300]", 20, "runs past its extent 64"),
    ("X[t, j + 0]", 16, "unknown axis 'j'"),
    ("R[t, i + 0]", 20, "a slice of the ragged axis 'r'"),
    ("X[t, i]", 16, "a slice of it is `i + OFFSET`"),
])
def test_slices_that_are_not_whole_chunks_are_reported_where_they_are(ref, column, message):
    text = ("dim t = 8 / 4\ndim d = 64\ndim i = 32\ndim r = 40 / 32\n"
            f"input X[t, d], R[t, r] : f32\nY[t, i] = {ref} * 2\noutput Y\n")
    assert_reported(text, 6, column, message)


# --------------------------------------------------------------------------------------------
# Concatenation: concat(e, X1, X2, ...), each piece read along an axis of its own


CONCAT = """dim t = 128 / 32
dim a = 64 / 32
dim b = 32 / 32
dim c = 32 / 16
dim e = 128 / 32
dim n = 64 / 32
input A[t, a], B[t, b], C[t, c], W[e, n] : f32
J[t, e] = concat(e, A[t, a], 2 * B[t, b], exp(C[t, c]))
Y[t, n] = sum[e] J[t, e] * W[e, n]
output J, Y
"""


def test_concat_joins_pieces_of_different_extents_and_fuses_into_its_consumer(pack):
    """Three pieces (64, 32 and 32 elements, one computed, one with blocks of 16) against
    numpy's concatenate; fused into the matmul that reads it, whose kernel reads each piece's
    blocks only where they fill the concatenation."""
    ast = parse_program(CONCAT, "concat.bbp")
    inputs = random_inputs(ast, seed=4)
    a, b, c, w = (inputs[x].astype(np.float64) for x in "ABCW")
    joined = np.concatenate([a, 2 * b, np.exp(c)], axis=1)
    r = fuse(lower(ast), pack, H100)
    for got in (interp.run(r.program, inputs), numpy_gen.run(r.program, inputs),
                dense.evaluate(ast, inputs, np.float64)):
        np.testing.assert_allclose(got["J"], joined, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["Y"], joined @ w, rtol=1e-5, atol=1e-5)


def test_rotate_half_rope_written_with_concat_is_one_kernel(pack):
    text = ("dim t = 256 / 64\ndim d = 64 / 32\ndim i = 32 / 32\n"
            "input X[t, d], COS[t, d], SIN[t, d] : f32\n"
            "R[t, d] = X[t, d] * COS[t, d] + concat(d, -X[t, i + 32], X[t, i + 0]) * SIN[t, d]\n"
            "output R\n")
    ast = parse_program(text, "rope.bbp")
    r = fuse(lower(ast), pack, H100)
    assert len(r.program.kernels) == 1
    inputs = random_inputs(ast, seed=5)
    x, c, s = (inputs[n].astype(np.float64) for n in ("X", "COS", "SIN"))
    want = x * c + rotate_half(x) * s
    for got in (numpy_gen.run(r.program, inputs), dense.evaluate(ast, inputs, np.float64)):
        np.testing.assert_allclose(got["R"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value, column, message", [
    ("concat(e, A[t, a], B[t, a])", 11, "are 64 + 64 = 128 elements along 'e', which has 96"),
    ("concat(e, A[t, e], B[t, b])", 21, "piece 1 of concat(e, ...) has no axis of its own"),
    ("concat(e, A[t, a] * B[t, b], B[t, b])", 21, "(a, b), so which one lies along 'e'"),
    ("concat(A[t, a], B[t, b])", 11, "concat joins two or more pieces along an axis"),
    ("concat(e, A[t, a])", 11, "concat joins two or more pieces"),
    ("concat(z, A[t, a], B[t, b])", 18, "unknown axis 'z'"),
    ("concat(e, A[t, a], R[t, r])", 35, "a concatenation of the ragged axis 'r'"),
    ("sum[b] concat(e, A[t, a], B[t, b])", 37, "piece 2 of concat(e, ...) has no axis"),
])
def test_malformed_concatenations_are_reported_where_they_are(value, column, message):
    text = ("dim t = 8 / 4\ndim a = 64 / 32\ndim b = 32 / 32\ndim e = 96 / 32\n"
            f"dim r = 40 / 32\ninput A[t, a], B[t, b], R[t, r] : f32\nY[t, e] = {value}\n"
            "output Y\n")
    assert_reported(text, 7, column, message)
