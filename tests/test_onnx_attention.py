"""Attention checked against an independent oracle: ONNX's own reference implementation of its
`Attention` operator (`onnx.reference`, opset 23), on the kinds of inputs of its backend test
cases: causal, grouped-query heads, soft-capping, additive and boolean masks, a value head size
other than the key's, an explicit scale.  Each case is written here as a `.bbp`, fused by the
standard pack, and run through the reference interpreter and the numpy backend.

The forms these hand-written programs leave out (past key/value caches, concatenated to the
new keys; 3-D inputs whose heads are split out of the model width; the `qk_matmul_output_mode`
extra outputs) are checked on ONNX's own backend test cases, imported from their models
(`test_onnx_import.py::test_backend_cases_agree_or_are_refused`): 171 of the 186 `Attention`
cases agree with their expected outputs.  The other 15 give each batch its own number of
valid keys (`nonpad_kv_seqlen`), an input whose values decide the mask.  ONNX's own function
inliner fails on them, which the importer reports; and a `.bbp` mask is a predicate over
positions fixed when the program is written, not one that data decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from bbrules import interp  # noqa: E402
from bbrules.codegen import numpy_gen  # noqa: E402
from bbrules.frontend import parse_program  # noqa: E402
from bbrules.fuse import fuse  # noqa: E402
from bbrules.lower import lower  # noqa: E402
from bbrules.packs import load_packs  # noqa: E402
from bbrules.targets import get_target  # noqa: E402

B, HQ, N, KV, D = 2, 4, 64, 48, 16  # batch, query heads, query length, key length, head size


@dataclass(frozen=True)
class Case:
    """One `Attention` node: its attributes, its mask, its head counts and sizes."""

    attrs: dict = field(default_factory=dict)
    mask: str | None = None  # None, "bool" or "float": a [q, kv] attn_mask input
    kv_heads: int = HQ
    v_size: int = D


CASES = {
    "plain": Case(),
    "causal": Case({"is_causal": 1}),
    "grouped-query heads": Case(kv_heads=2),
    "soft cap": Case({"softcap": 2.0}),
    "additive mask": Case(mask="float"),
    "boolean mask": Case(mask="bool"),
    "value head size 24": Case(v_size=24),
    "scale and causal": Case({"scale": 0.3, "is_causal": 1}),
}


def onnx_attention(case: Case, inputs: dict[str, np.ndarray]) -> np.ndarray:
    names = ["Q", "K", "V"] + (["M"] if case.mask else [])
    node = helper.make_node("Attention", names, ["Y"], **case.attrs)
    elem = {n: TensorProto.BOOL if n == "M" and case.mask == "bool" else TensorProto.FLOAT
            for n in names}
    graph = helper.make_graph(
        [node], "attention",
        [helper.make_tensor_value_info(n, elem[n], inputs[n].shape) for n in names],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    feeds = {n: inputs[n].astype(bool) if elem[n] == TensorProto.BOOL else inputs[n]
             for n in names}
    return ReferenceEvaluator(model).run(None, feeds)[0]


def bbp(case: Case) -> str:
    """The case as a program.  Query head h = (g, r): g is its key/value head and r one of
    the query heads sharing it (ONNX's grouping), so Q[b, h, ...] is read as Q[b, g, r, ...]."""
    groups, reps = case.kv_heads, HQ // case.kv_heads
    scale = float(case.attrs.get("scale", 1 / np.sqrt(D)))
    score = f"sum[d] Q[b, g, r, q, d] * K[b, g, k, d] * {scale!r}"
    if "softcap" in case.attrs:
        cap = case.attrs["softcap"]
        score = f"{cap!r} * tanh({score} / {cap!r})"
    if case.mask == "float":
        score += " + M[q, k]"
    conditions = []
    if case.attrs.get("is_causal"):
        conditions.append("k <= q")
    if case.mask == "bool":
        conditions.append("M[q, k] != 0")
    if conditions:
        score = f"where({' and '.join(conditions)}, {score}, -inf)"
    mask = ", M[q, k]" if case.mask else ""
    return f"""
dim b = {B} / 1
dim g = {groups} / 1
dim r = {reps} / 1
dim q = {N} / 16
dim k = {KV} / 16
dim d = {D}
dim e = {case.v_size}
input Q[b, g, r, q, d], K[b, g, k, d], V[b, g, k, e]{mask} : f32
S[b, g, r, q, k] = {score}
X[b, g, r, q]    = max[k] S[b, g, r, q, k]
P[b, g, r, q, k] = exp(S[b, g, r, q, k] - X[b, g, r, q])
L[b, g, r, q]    = sum[k] P[b, g, r, q, k]
Y[b, g, r, q, e] = sum[k] P[b, g, r, q, k] * V[b, g, k, e] / L[b, g, r, q]
output Y
"""


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


@pytest.mark.parametrize("name", CASES)
def test_fused_attention_agrees_with_onnx_reference(pack, name):
    case = CASES[name]
    rng = np.random.default_rng(11)
    onnx_inputs = {
        "Q": rng.standard_normal((B, HQ, N, D), dtype=np.float32),
        "K": rng.standard_normal((B, case.kv_heads, KV, D), dtype=np.float32),
        "V": rng.standard_normal((B, case.kv_heads, KV, case.v_size), dtype=np.float32),
    }
    if case.mask == "float":
        onnx_inputs["M"] = rng.standard_normal((N, KV), dtype=np.float32)
    elif case.mask == "bool":
        allowed = rng.random((N, KV)) < 0.7
        allowed[:, 0] = True  # every row attends somewhere
        onnx_inputs["M"] = allowed.astype(np.float32)
    want = onnx_attention(case, onnx_inputs)

    ast = parse_program(bbp(case))
    r = fuse(lower(ast), pack, get_target("h100"))
    assert "S" not in r.program.tensors and "P" not in r.program.tensors
    reps = HQ // case.kv_heads
    inputs = {**onnx_inputs, "Q": onnx_inputs["Q"].reshape(B, case.kv_heads, reps, N, D)}
    for got in (interp.run(r.program, inputs), numpy_gen.run(r.program, inputs)):
        y = got["Y"].reshape(B, HQ, N, case.v_size)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
