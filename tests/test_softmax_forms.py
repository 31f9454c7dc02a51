"""Attention as models write it reaches one pass over K and V: a learned sink logit joined to
the maximum (gpt-oss), soft-capped scores (Gemma 2), an additive bias, and a log-sum-exp output.

The online-softmax rules are identities about rescaling by any shift that does not depend on
the key axis, not the shape of one program: each variant is fused at 8 heads x 1024 positions
and compared with plain attention's flops and traffic, then run at a small size against a
float64 reference written here.
"""

from __future__ import annotations

import numpy as np
import pytest

from bbrules import interp
from bbrules.codegen import numpy_gen
from bbrules.frontend import parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.lower import lower
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.targets import get_target

H100 = get_target("h100")
F32 = 4
WHOLE = Options(split_folds=False, reblock=False)

HEAD = """
dim h = {h} / 1
dim q = {n} / {b}
dim k = {n} / {b}
dim d = 32
input Q[h, q, d], K[h, k, d], V[h, k, d], SINK[h], B[q, k] : f32
"""
PLAIN = """
S[h, q, k] = sum[d] Q[h, q, d] * K[h, k, d] * 0.125
M[h, q]    = max[k] S[h, q, k]
E[h, q, k] = exp(S[h, q, k] - M[h, q])
L[h, q]    = sum[k] E[h, q, k]
O[h, q, d] = sum[k] E[h, q, k] * V[h, k, d] / L[h, q]
output O
"""
VARIANTS = {
    "sink": PLAIN.replace("M[h, q]    = max[k] S[h, q, k]",
                          "M[h, q]    = max(max[k] S[h, q, k], SINK[h])")
                 .replace("L[h, q]    = sum[k] E[h, q, k]",
                          "L[h, q]    = sum[k] E[h, q, k] + exp(SINK[h] - M[h, q])"),
    "soft cap": PLAIN.replace("S[h, q, k] = sum[d] Q[h, q, d] * K[h, k, d] * 0.125",
                              "S[h, q, k] = 5 * tanh(sum[d] Q[h, q, d] * K[h, k, d] * 0.025)"),
    "bias": PLAIN.replace("* 0.125\n", "* 0.125 + B[q, k]\n"),
    "log-sum-exp": PLAIN.replace("output O", "LSE[h, q] = M[h, q] + log(L[h, q])\n"
                                             "output O, LSE"),
}


def program(body: str, h: int, n: int, b: int):
    return parse_program(HEAD.format(h=h, n=n, b=b) + body)


def reference(name: str, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    q, k, v = (x[t].astype(np.float64) for t in "QKV")
    s = np.einsum("hqd,hkd->hqk", q, k)
    if name == "soft cap":
        s = 5 * np.tanh(s * 0.025)
    else:
        s = s * 0.125 + (x["B"] if name == "bias" else 0.0)
    m = s.max(axis=-1, keepdims=True)
    if name == "sink":
        m = np.maximum(m, x["SINK"].astype(np.float64)[:, None, None])
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    if name == "sink":
        l = l + np.exp(x["SINK"].astype(np.float64)[:, None, None] - m)
    out = {"O": np.einsum("hqk,hkd->hqd", e, v) / l}
    if name == "log-sum-exp":
        out["LSE"] = (m + np.log(l))[..., 0]
    return out


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


@pytest.fixture(scope="module")
def plain(pack):
    return fuse(lower(program(PLAIN, 8, 1024, 64)), pack, H100, options=WHOLE)


@pytest.mark.parametrize("name", VARIANTS)
def test_the_variant_is_one_pass_over_k_and_v(pack, plain, name):
    r = fuse(lower(program(VARIANTS[name], 8, 1024, 64)), pack, H100, options=WHOLE)
    (kernel,) = r.program.kernels
    assert not {"S", "E", "P"} & set(r.program.tensors)  # nothing N x N is stored
    assert r.after.flops <= 1.05 * plain.after.flops
    # K and V are read as often as in plain attention; besides, each of the 8 x 16 grid points
    # reads its head's sink logit, or its query block's rows of the bias
    extra = {"sink": 8 * 16 * F32, "bias": 8 * 1024 * 1024 * F32}.get(name, 0)
    assert r.after.bytes_read <= plain.after.bytes_read + extra


@pytest.mark.parametrize("name", VARIANTS)
def test_the_fused_variant_matches_a_float64_reference(pack, name):
    ast = program(VARIANTS[name], 2, 128, 32)
    r = fuse(lower(ast), pack, H100, options=WHOLE)
    inputs = random_inputs(ast, seed=7)
    want = reference(name, inputs)
    for got in (interp.run(r.program, inputs), numpy_gen.run(r.program, inputs)):
        for out, value in want.items():
            np.testing.assert_allclose(got[out], value, rtol=1e-4, atol=1e-5)
