"""Forwarding elementwise maps into their readers (`bbrules.forward`): grouped-query attention's
repeated keys, a scale and rotary embedding's `x * cos` read through views, one store of a kernel
of two; and what stays a kernel."""

from __future__ import annotations

import numpy as np

from bbrules import dense, interp
from bbrules.blockfile import parse_block_program
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


def test_a_kernel_mapping_tensors_is_computed_where_it_is_read():
    """R (K repeated for each head of a group), Ps (P scaled, read as [g, h, t, d]) and A (a
    sum of two tensors) stop being kernels: S, T and Z compute them from K, P, X and Y, through
    a view of P split as Ps's view splits Ps.  A reduction and the outputs stay kernels; the
    results are the dense evaluation's."""
    ast = parse_program(PROGRAM)
    p = lower(ast)
    q = forwarded(p, get_target("h100"))
    assert [k.name for k in q.kernels] == ["S", "T", "M", "Z"]
    assert not {"R", "Ps", "A"} & set(q.tensors)
    assert {n.tensor for k in q.kernels for s in k.stores for n in postorder(s.value)
            if isinstance(n, Load)} == {"K", "Q", "P__g_h_t_d", "X", "Y", "M"}
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
    """Each kernel a candidate of its own, the stitched program is the unfused one: R, Ps and
    A are forwarded, the result says which (and `apply`'s report and its JSON), and the
    program computes what the dense evaluation does."""
    ast = parse_program(PROGRAM)
    p = lower(ast)
    r = fuse_candidates(p, select_candidates(p, 1), load_packs([]), get_target("h100"))
    assert r.forwarded == ("R", "Ps", "A") and r.to_json()["forwarded"] == ["R", "Ps", "A"]
    assert "computed where they are read (elementwise maps): R, Ps, A" in \
        stitched_report(r, explain=False)
    assert r.after.n_kernels == sum(c.kernels_after for c in r.candidates) - 3
    inputs = random_inputs(ast, seed=4)
    want = dense.evaluate(ast, inputs, dtype=np.float64)
    got = interp.run(r.program, inputs)
    for name in ("S", "T", "Z"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


ROPE = """# bbrules block program
dim t = 8 / 4
dim h = 2
dim i = 2
dim j = 4
dim d = 8
input Q[t, h, d] : f32
input COS[t, d] : f32
input SIN[t, d] : f32
temp C[h, t, d] : f32
temp X1[h, t, j] : f32
output R[h, t, i, j] : f32
view Q__t_h_i_j[t, h, i, j] : f32 = Q
view C__h_t_i_j[h, t, i, j] : f32 = C
view SIN__t_i_j[t, i, j] : f32 = SIN

kernel [h, t]:
  C[h, t, d] = load(Q[t, h, d]) * {factor}
  X1[h, t, j] = reduce(i, sum, bsum(i, where(eq(pos(i), 0.0), load(Q__t_h_i_j[t, h, i, j]), 0.0)))

kernel R[h, t, i, j]:
  R[h, t, i, j] = load(C__h_t_i_j[h, t, i, j]) + load(X1[h, t, j]) * load(SIN__t_i_j[t, i, j])
"""


def test_one_store_of_a_kernel_is_forwarded_through_a_view_with_each_of_its_operands():
    """Rotary embedding's `q * cos`, stored beside the first half of q (a selection, which
    stays), read split in halves [i, j]: R reads q and cos through that split of their own
    memory (`Q__t_h_i_j`, which is there, and `COS__t_i_j`, a new view), and the kernel keeps
    its other store.  The results are the reference interpreter's on the program before."""
    p = parse_block_program(ROPE.format(factor="load(COS[t, d])")).program
    q = forwarded(p, get_target("cpu"))
    assert [k.tensors for k in q.kernels] == [("X1",), ("R",)]
    assert "C" not in q.tensors and q.tensors["COS__t_i_j"].base == "COS"
    assert {n.tensor for n in postorder(q.kernels[1].stores[0].value)
            if isinstance(n, Load)} == {"Q__t_h_i_j", "COS__t_i_j", "X1", "SIN__t_i_j"}
    inputs = random_inputs(p, seed=5)
    np.testing.assert_allclose(interp.run(q, inputs)["R"], interp.run(p, inputs)["R"],
                               rtol=1e-6)


def test_a_map_using_the_position_along_an_axis_its_readers_split_stays():
    """`pos(d)` has no value in R's [i, j] but as `j + 4 i`, which forwarding does not write:
    C stays."""
    p = parse_block_program(ROPE.format(factor="pos(d)")).program
    assert forwarded(p, get_target("cpu")) is p
