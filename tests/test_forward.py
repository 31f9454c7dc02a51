"""Forwarding kernels that map one tensor into their readers (`bbrules.forward`): grouped-query
attention's repeated keys, a scale read through a view; and what stays a kernel."""

from __future__ import annotations

import numpy as np

from bbrules import dense, interp
from bbrules.candidates import fuse_candidates, select_candidates
from bbrules.cli import stitched_report
from bbrules.forward import forwarded
from bbrules.frontend import parse_program
from bbrules.inputs import random_inputs
from bbrules.ir import Load, postorder
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

PROGRAM = """
dim g = 2
dim h = 2
dim gh = 4
dim t = 8 / 4
dim u = 8 / 4
dim d = 16
input K[g, u, d] : f32
input Q[g, h, t, d] : f32
input P[gh, t, d] : f32
input X[t, d] : f32
input Y[t, d] : f32
R[g, h, u, d] = K[g, u, d] + 0 * h
S[g, h, t, u] = sum[d] Q[g, h, t, d] * R[g, h, u, d]
Ps[gh, t, d] = P[gh, t, d] * 0.125
T[g, h, t, u] = sum[d] Ps[(g, h), t, d] * K[g, u, d]
A[t, d] = X[t, d] + Y[t, d]
M[t] = max[d] X[t, d]
Z[t, d] = A[t, d] * M[t]
output S, T, Z
"""


def test_a_kernel_mapping_one_tensor_is_computed_where_it_is_read():
    """R (K repeated for each head of a group) and Ps (P scaled, read as [g, h, t, d]) stop
    being kernels: S and T compute them from K and P, through a view of P split as Ps's view
    splits Ps.  A sum of two tensors, a reduction and the outputs stay kernels; the results
    are the dense evaluation's."""
    ast = parse_program(PROGRAM)
    p = lower(ast)
    q = forwarded(p, get_target("h100"))
    assert [k.name for k in q.kernels] == ["S", "T", "A", "M", "Z"]
    assert "R" not in q.tensors and "Ps" not in q.tensors
    assert {n.tensor for k in q.kernels for s in k.stores for n in postorder(s.value)
            if isinstance(n, Load)} == {"K", "Q", "P__g_h_t_d", "X", "Y", "A", "M"}
    inputs = random_inputs(ast, seed=3)
    want = dense.evaluate(ast, inputs, dtype=np.float64)
    got = interp.run(q, inputs)
    for name in ("S", "T", "Z"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_a_program_with_nothing_to_forward_is_itself():
    p = lower(parse_program("dim t = 8\ndim d = 4\ninput X[t, d] : f32\n"
                            "M[t] = max[d] X[t, d]\nY[t, d] = X[t, d] - M[t]\noutput Y\n"))
    assert forwarded(p, get_target("cpu")) is p


def test_a_kernel_is_not_forwarded_where_its_readers_would_recompute_it_at_a_cost():
    """C's exponentials, forwarded into S, would be computed again for each of S's 64 blocks
    of u: on the cpu target that models three times the time, so C stays a kernel; on the
    h100, whose model is bound by memory there, the pass it saves wins."""
    p = lower(parse_program("dim t = 4096 / 64\ndim u = 4096 / 64\ndim d = 64\n"
                            "input X[t, d] : f32\ninput K[u, d] : f32\n"
                            "C[t, d] = exp(tanh(exp(X[t, d])) * 3 + sin(X[t, d]))\n"
                            "S[t, u] = sum[d] C[t, d] * K[u, d]\noutput S\n"))
    assert [k.name for k in forwarded(p, get_target("cpu")).kernels] == ["C", "S"]
    assert [k.name for k in forwarded(p, get_target("h100")).kernels] == ["S"]


def test_fusion_by_candidates_forwards_and_says_so():
    """Each kernel a candidate of its own, the stitched program is the unfused one: R and Ps
    are forwarded, the result says which (and `apply`'s report and its JSON), and the
    program computes what the dense evaluation does."""
    ast = parse_program(PROGRAM)
    p = lower(ast)
    r = fuse_candidates(p, select_candidates(p, 1), load_packs([]), get_target("h100"))
    assert r.forwarded == ("R", "Ps") and r.to_json()["forwarded"] == ["R", "Ps"]
    assert "computed where they are read (kernels that map one tensor): R, Ps" in \
        stitched_report(r, explain=False)
    assert r.after.n_kernels == sum(c.kernels_after for c in r.candidates) - 2
    inputs = random_inputs(ast, seed=4)
    want = dense.evaluate(ast, inputs, dtype=np.float64)
    got = interp.run(r.program, inputs)
    for name in ("S", "T", "Z"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)
