"""The exact cost model, checked against counts derived by hand (in the comments beside them).

Sizes: every tensor here is f32 (4 bytes) unless a test says otherwise; for an axis a, N_a is
its extent, B_a its block and n_a = N_a / B_a its number of blocks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bbrules.cli import main
from bbrules.codegen.numpy_gen import run as numpy_run
from bbrules.cost import KernelCost, ProgramCost, cost_kernel, cost_program
from bbrules.frontend import load_program
from bbrules.fuse import fuse
from bbrules.interp import run
from bbrules.ir import (SUM, MAX, BlockProgram, BlockReduce, Const, Dot, Load, Reduce, Store, TensorDecl,
                        Unary)
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.plan import plan_for
from bbrules.schedule import Loop, schedule_kernel
from bbrules.targets import Target, get_target
from irbuild import (ATTENTION_INPUTS, add, div, matmul, mul, online_softmax, program,
                     softmax_fold, sub)

REPO = Path(__file__).resolve().parent.parent
ATTENTION = REPO / "examples" / "attention.bbp"
H100 = get_target("h100")
F = 4  # bytes per f32


def machine(capacity: int = 1 << 30, processors: int = 1, bandwidth: float = 1e9,
            peak: float = 1e9, peak_f16: float = 1e9, launch: float = 0.0) -> Target:
    return Target("test", bandwidth, capacity, processors, peak, peak_f16, launch)


def bsum(axis: str, x):
    return BlockReduce("sum", axis, x)


def bmax(axis: str, x):
    return BlockReduce("max", axis, x)


# --------------------------------------------------------------------------------------------
# The closed form of issue 2: unfused attention, as lowered from examples/attention.bbp


def unfused_attention_traffic(nq_: int, bq: int, nk_: int, bk: int, d: int
                              ) -> dict[str, tuple[int, int]]:
    """(bytes read, bytes written) per kernel, with N_q = nq_ * bq, N_k = nk_ * bk, one d block.

    S[q,k]  grid n_q*n_k: Q tile (B_q*d) and K tile (B_k*d) once per grid point, so Q is read
            n_k times over and K n_q times; writes the N_q*N_k scores.
    M[q]    grid n_q, loop over k: one S tile per iteration, S read once; writes N_q.
    E[q,k]  grid n_q*n_k: S once, M tile (B_q) per grid point, so M is read n_k times.
    L[q]    like M, over E.
    P[q,k]  like E: E once, L read n_k times.
    O[q,d]  grid n_q (d is one block), loop over k: P once, V tile (B_k*d) per iteration of
            every query block, so V is read n_q times; writes N_q*d.
    """
    n_q, n_k = nq_ * bq, nk_ * bk
    return {
        "S": (F * (n_q * d * nk_ + n_k * d * nq_), F * n_q * n_k),
        "M": (F * n_q * n_k, F * n_q),
        "E": (F * (n_q * n_k + n_q * nk_), F * n_q * n_k),
        "L": (F * n_q * n_k, F * n_q),
        "P": (F * (n_q * n_k + n_q * nk_), F * n_q * n_k),
        "O": (F * (n_q * n_k + n_k * d * nq_), F * n_q * d),
    }


@pytest.mark.parametrize("dims, blocks", [
    (None, (64, 64, 64, 64)),  # the example as written: N = 4096, 64x64 blocks
    ({"q": (512, 64), "k": (1024, 128)}, (8, 64, 8, 128)),
])
def test_unfused_attention_traffic_matches_the_closed_form(dims, blocks):
    p = lower(load_program(ATTENTION, dims))
    cost = cost_program(p, H100)
    want = unfused_attention_traffic(*blocks, 64)
    assert {k.tensors[0]: (k.bytes_read, k.bytes_written) for k in cost.kernels} == want
    assert cost.traffic == sum(r + w for r, w in want.values())
    n_q, n_k = blocks[0] * blocks[1], blocks[2] * blocks[3]
    assert cost.compulsory == F * (n_q * 64 + 2 * n_k * 64 + n_q * 64)  # Q, K, V in; O out
    assert cost.legal


def test_cost_command_prints_the_closed_form_traffic(capsys):
    assert main(["cost", str(ATTENTION), "--dim", "q=512/64", "--dim", "k=1024/128",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    want = unfused_attention_traffic(8, 64, 8, 128, 64)
    assert report["traffic"] == sum(r + w for r, w in want.values())
    assert report["target"] == "h100" and report["n_kernels"] == 6


# --------------------------------------------------------------------------------------------
# Flash Attention, built by hand


ONLINE_SOFTMAX = online_softmax("online_softmax_cost_test")


def flash_attention(n: int, block: int, d: int = 64, n_k: int | None = None) -> BlockProgram:
    """One kernel over query blocks; one loop over key blocks carrying (m, l, o), the scores
    a contraction over d (one block, so a loop of one trip) scaled by 0.125."""
    s = mul(matmul(Load("Q", ("q", "d")), Load("K", ("k", "d")), "d"), Const(0.125))
    o = softmax_fold(ONLINE_SOFTMAX, s, Load("V", ("k", "d")))
    dims = {"q": (n, block), "k": (n_k or n, block), "d": (d, d)}
    return program(dims, ATTENTION_INPUTS, [Store("O", ("q", "d"), o)], ("O",))


def test_flash_attention_reads_k_and_v_once_per_query_block_and_fits():
    n, d = 4096, 64
    cost = cost_program(flash_attention(n, 64), H100)
    (k,) = cost.kernels
    # Q + O + blocks(q) * (K + V)
    assert cost.traffic == F * (n * d + n * d + (n // 64) * (n * d + n * d))
    assert (k.grid, k.grid_points, k.loops) == (("q", "d"), 64, 2)  # loops over k and over d
    assert cost.legal and k.footprint <= H100.local_capacity
    unfused = cost_program(lower(load_program(ATTENTION)), H100)
    assert unfused.legal
    assert unfused.traffic > 5 * cost.traffic
    assert cost.key() < unfused.key() and cost.key("traffic") < unfused.key("traffic")


def test_flash_attention_flops_count_the_monoid_combine_and_finalize():
    bq = bk = 4
    d, nq, nk = 8, 2, 3
    cost = cost_program(flash_attention(nq * bq, bq, d, nk * bk), H100)
    # one iteration of the k loop: S = dot over d (2*Bq*Bk*d) folded by the one-block d loop
    # (an add per element), * 0.125, bmax, - m, exp, bsum (one flop per element each),
    # and the P@V dot (2*Bq*d*Bk)
    body = 2 * bq * bk * d + 6 * bq * bk + 2 * bq * d * bk
    # online combine on states m, l: (Bq) and o: (Bq, d): max, two subs, two exps and the l
    # update's two muls and an add, per row (shared subterms once); the o update's two muls
    # and an add, per element
    combine = 8 * bq + 3 * bq * d
    finalize = bq * d  # o / l
    assert cost.flops == nq * (nk * (body + combine) + finalize)


def test_512_by_512_score_tiles_do_not_fit_local_memory():
    cost = cost_program(lower(load_program(ATTENTION, {"q": (4096, 512), "k": (4096, 512)})),
                        H100)
    s = cost.kernels[0]
    assert s.tensors == ("S",) and not s.legal and s.time == math.inf
    assert s.footprint >= 512 * 512 * F > H100.local_capacity
    assert not cost.legal and cost.time == math.inf


# --------------------------------------------------------------------------------------------
# The schedule, as priced


def test_a_load_that_does_not_depend_on_the_loop_is_hoisted_out_of_it():
    # Y[m] = sum_e X[m, e] * R[m]: R is read once per grid point, X once
    dims = {"m": (32, 8), "e": (48, 16)}
    y = Reduce("e", SUM, bsum("e", mul(Load("X", ("m", "e")), Load("R", ("m",)))))
    p = program(dims, {"X": ("m", "e"), "R": ("m",)}, [Store("Y", ("m",), y)], ("Y",))
    (k,) = cost_program(p, H100).kernels
    assert k.bytes_read == F * (32 * 48 + 32) and k.bytes_written == F * 32
    assert k.resident == ()


def qk_rowsum(d_block: int) -> BlockProgram:
    """Y[q] = sum_k sum_d Q[q, d] K[k, d]: the Q load sits inside the loop over k."""
    dims = {"q": (64, 16), "k": (96, 16), "d": (64, d_block)}
    s = matmul(Load("Q", ("q", "d")), Load("K", ("k", "d")), "d")
    y = Reduce("k", SUM, bsum("k", s))
    return program(dims, {"Q": ("q", "d"), "K": ("k", "d")}, [Store("Y", ("q",), y)], ("Y",))


def test_a_one_block_axis_is_not_a_loop_for_placement():
    # d has one block: Q[q, d] is invariant in the loop over k, read once per query block;
    # K is read once per query block (n_q = 4 times)
    (k,) = cost_program(qk_rowsum(64), machine(capacity=1 << 20)).kernels
    assert k.bytes_read == F * (64 * 64 + 4 * 96 * 64)
    assert k.resident == ()


def test_a_load_in_a_loop_over_e_in_a_loop_over_f_runs_blocks_e_times_blocks_f():
    # d has 2 blocks: Q[q, d] is loaded inside the d loop inside the k loop, so each grid
    # point reads its Q tile (16 x 32) n_d * n_k = 2 * 6 times.  Resident slabs may use 3 KiB
    # of this capacity: Q's (16 x 64) does not fit.
    (k,) = cost_program(qk_rowsum(32), machine(capacity=12 * 1024)).kernels
    assert k.resident == () and k.legal
    assert k.bytes_read == F * (4 * (16 * 32) * 2 * 6 + 4 * 96 * 64)
    assert k.loops == 2


def test_a_re_read_input_stays_resident_when_its_slab_fits():
    # same kernel with room: Q's slab (its row block over all of d, 16 x 64) is read once
    (k,) = cost_program(qk_rowsum(32), machine(capacity=1 << 20)).kernels
    assert k.resident == ("Q",)
    assert k.bytes_read == F * (64 * 64 + 4 * 96 * 64)


def test_a_re_read_temporary_is_never_resident():
    dims = {"q": (64, 16), "k": (96, 16), "d": (64, 32)}
    q2 = Store("Q2", ("q", "d"), mul(Load("Q", ("q", "d")), Const(2.0)))
    s = matmul(Load("Q2", ("q", "d")), Load("K", ("k", "d")), "d")
    y = Store("Y", ("q",), Reduce("k", SUM, bsum("k", s)))
    p = program(dims, {"Q": ("q", "d"), "K": ("k", "d")}, [q2, y], ("Y",))
    k = cost_program(p, machine(capacity=1 << 20)).kernels[1]
    assert k.resident == ()
    assert k.bytes_read == F * (4 * (16 * 32) * 2 * 6 + 4 * 96 * 64)


def ffn_like(g_first: bool) -> BlockProgram:
    """Y[m, n] = sum_h (sum_e G[e] X[m, e] W1[e, h]) W2[h, n]: G and X sit in the loop over e
    inside the loop over h, which they do not depend on."""
    dims = {"m": (16, 8), "e": (64, 16), "h": (48, 16), "n": (32, 16)}
    g, x = Load("G", ("e",)), Load("X", ("m", "e"))
    scaled = mul(g, x) if g_first else mul(x, g)
    hidden = matmul(scaled, Load("W1", ("e", "h")), "e")
    y = matmul(hidden, Load("W2", ("h", "n")), "h")
    inputs = {"G": ("e",), "X": ("m", "e"), "W1": ("e", "h"), "W2": ("h", "n")}
    return program(dims, inputs, [Store("Y", ("m", "n"), y)], ("Y",))


@pytest.mark.parametrize("capacity, g_first, resident", [
    (1 << 20, True, ("G", "X")),
    (8192, True, ("G",)),  # slabs may use 2 KiB: G's 256 B fit, X's 2 KiB more do not
    (8192, False, ("X",)),  # execution order decides: X's 2 KiB come first and fill it
    (1000, True, ()),  # 250 B: not even G
])
def test_resident_slabs_are_admitted_in_order_within_a_quarter_of_local_memory(
        capacity, g_first, resident):
    (k,) = cost_program(ffn_like(g_first), machine(capacity=capacity)).kernels
    assert k.resident == resident
    points, n_e, n_h = 2 * 2, 4, 3
    slab = {"G": F * 64, "X": F * 8 * 64}
    tile = {"G": F * 16, "X": F * 8 * 16}
    read = sum(points * (slab[t] if t in resident else tile[t] * n_e * n_h) for t in ("G", "X"))
    read += points * (F * 16 * 16 * n_e * n_h + F * 16 * 16 * n_h)  # W1 and W2 tiles
    assert k.bytes_read == read
    # The slabs are buffers of the kernel's plan for the whole kernel (tests/test_plan.py).
    (store,) = ffn_like(g_first).kernels
    plan = plan_for(ffn_like(g_first), store, capacity)
    assert sorted(b.order for b in plan.buffers if b.role == "slab") == \
        sorted(ffn_like(g_first).tensors[t].axes for t in resident)
    assert k.footprint == plan.footprint


def rowstats(dependent: bool) -> BlockProgram:
    s = Load("S", ("q", "k"))
    mx = Reduce("k", MAX, bmax("k", s))
    if dependent:  # sum_k exp(S - max_k S) needs the max first
        y = Reduce("k", SUM, bsum("k", Unary("exp", sub(s, mx))))
    else:  # max_k S + sum_k S: independent
        y = add(mx, Reduce("k", SUM, bsum("k", s)))
    return program({"q": (32, 8), "k": (64, 16)}, {"S": ("q", "k")},
                   [Store("Y", ("q",), y)], ("Y",))


def test_independent_sibling_reductions_share_one_loop_and_its_loads():
    (k,) = cost_program(rowstats(dependent=False), H100).kernels
    assert k.loops == 1 and k.bytes_read == F * 32 * 64


def test_a_reduction_that_needs_its_sibling_runs_in_a_second_loop():
    (k,) = cost_program(rowstats(dependent=True), H100).kernels
    assert k.loops == 2 and k.bytes_read == 2 * F * 32 * 64


# --------------------------------------------------------------------------------------------
# Flops, footprint, time


def test_flops_count_operators_dots_combines_and_recomputation():
    # Y[m, n] = sum_e silu(A[m, e]) W[e, n] + B[n]; silu (5 flops) is recomputed for every
    # block of n, the dot costs 2*Bm*Bn*Be, the sum combine one add per (m, n) element
    bm, be, bn = 4, 8, 2
    nm, ne, nn = 3, 2, 5
    dims = {"m": (nm * bm, bm), "e": (ne * be, be), "n": (nn * bn, bn)}
    y = add(matmul(Unary("silu", Load("A", ("m", "e"))), Load("W", ("e", "n")), "e"),
            Load("B", ("n",)))
    p = program(dims, {"A": ("m", "e"), "W": ("e", "n"), "B": ("n",)},
                [Store("Y", ("m", "n"), y)], ("Y",))
    per_point = ne * (5 * bm * be + 2 * bm * bn * be + bm * bn) + bm * bn
    assert cost_program(p, H100).flops == nm * nn * per_point


# --------------------------------------------------------------------------------------------
# Footprint by liveness


def test_an_elementwise_chain_is_computed_in_the_pass_that_reads_it():
    # Y[m] = bsum_e exp(X) + bmax_e (X * 2), one block of e, so no loop.  exp(X) and X * 2 are
    # each read once, by an in-tile reduction over their own tile, and the sum is read once,
    # by the store: none is materialised.  The X tile (8 x 16) lives until bmax reads it, with
    # the two row results (8 each) that the store adds, and the partial sums of the 128
    # threads that split each row reduction (one reduction at a time).
    x = Load("X", ("m", "e"))
    y = add(bsum("e", Unary("exp", x)), bmax("e", mul(x, Const(2.0))))
    p = program({"m": (32, 8), "e": (16, 16)}, {"X": ("m", "e")}, [Store("Y", ("m",), y)],
                ("Y",))
    assert cost_program(p, H100).footprint == F * (8 * 16 + 8 + 8 + 128)


def test_a_value_broadcast_to_a_larger_tile_is_materialised():
    # Y[m, e] = X * (R + 1): R + 1 spans m only, and fusing it into the (m, e) product would
    # recompute it for every column, so it is a tile of its own (8), computed while R (8) is
    # live; the product itself is computed as it is stored.
    x, r = Load("X", ("m", "e")), Load("R", ("m",))
    p = program({"m": (32, 8), "e": (16, 16)}, {"X": ("m", "e"), "R": ("m",)},
                [Store("Y", ("m", "e"), mul(x, add(r, Const(1.0))))], ("Y",))
    assert cost_program(p, H100).footprint == F * (8 * 16 + 8 + 8)


def test_a_tile_read_in_a_loop_stays_for_the_whole_loop_and_first_fit_leaves_holes():
    # Y[m, n] = sum_e bsum_e(X[m, e] G[m, n]) + max_e bmax_e(X G), e in blocks of one: one loop
    # over e with two accumulators (8 x 32 each).  G (8 x 32) is loaded before the loop and
    # read by the product early in every iteration; it stays until the loop ends, so the
    # row sums and maxima computed after the product cannot take its place.  In order: G at
    # 0, the accumulators above it, X (8 x 1), the product X G (8 x 32, read twice, so
    # materialised), then bsum and bmax, each 8 x 32, above the product: X's 32-byte hole is
    # too small for them.  But bsum and bmax fold straight into their accumulators (sum and
    # max), so they have no tiles: G, two accumulators, X and the product, 4 x 8 x 33 + 8 (rows
    # of 32 are padded by one element against bank conflicts), and no scratch: e is one
    # element, so no thread splits an in-tile reduction along it.
    x, g = Load("X", ("m", "e")), Load("G", ("m", "n"))
    xg = mul(x, g)
    y = add(Reduce("e", SUM, bsum("e", xg)), Reduce("e", MAX, bmax("e", xg)))
    p = program({"m": (16, 8), "e": (8, 1), "n": (32, 32)}, {"X": ("m", "e"), "G": ("m", "n")},
                [Store("Y", ("m", "n"), y)], ("Y",))
    (k,) = cost_program(p, machine()).kernels
    assert k.loops == 1
    assert k.footprint == F * (4 * 8 * 33 + 8)
    (store,) = p.kernels
    plan = plan_for(p, store, H100.local_capacity)
    (g,) = [v for v in plan.values if v.kind == "load" and v.node.tensor == "G"]
    assert g.buffer.last >= plan.loops[0].end


def test_a_dot_before_a_loop_of_one_trip_is_its_accumulator():
    # The lowered S[q, k] = sum[d] Q K * 0.125 with d one block of 64: the Q and K tiles
    # (64 x 64) and the dot's, which is the loop's accumulator; the scaling is computed as S
    # is stored.  Rows of 64 are padded by one element against bank conflicts.
    cost = cost_program(lower(load_program(ATTENTION)), H100)
    assert cost.kernels[0].tensors == ("S",)
    assert cost.kernels[0].footprint == 3 * F * 64 * 65


def test_softmax_over_256_column_blocks_fuses_within_local_memory():
    # Y[r, c] = exp(X - M) / L over 64 x 256 blocks: one X tile (64 KiB) and the M and L rows
    # (64 each); the subtraction, exponential and division are one pass, as Y is stored.  Rows
    # of 256 are padded by one element against bank conflicts.
    # Counting each of them as a tile of its own would take four 64 KiB tiles, over an H100's
    # 227 KiB.
    x, m, l = Load("X", ("r", "c")), Load("M", ("r",)), Load("L", ("r",))
    y = div(Unary("exp", sub(x, m)), l)
    p = program({"r": (4096, 64), "c": (4096, 256)},
                {"X": ("r", "c"), "M": ("r",), "L": ("r",)}, [Store("Y", ("r", "c"), y)], ("Y",))
    (k,) = cost_program(p, H100).kernels
    assert k.legal and k.footprint == F * (64 * 257 + 64 + 64)
    source = lower(load_program(REPO / "examples" / "softmax.bbp"))
    fused = fuse(source, load_packs([]), H100)
    assert fused.after.legal and fused.after.n_kernels < fused.before.n_kernels


def test_loops_that_would_need_each_other_are_not_merged():
    # Every axis is one block, so all four loops sit in the kernel body.  Merging the loop over
    # i that sums rows of A with the one over i that needs sum_j A*A, and the loop over j that
    # needs sum_i A with the one that computes sum_j A*A, would make each merged loop need the
    # other's result.  The schedule merges only one pair; the program runs and is legal.
    a = Load("A", ("i", "j"))
    by_rows = Reduce("j", SUM, bsum("j", Reduce("i", SUM, bsum("i", a))))
    by_cols = Reduce("i", SUM, bsum("i", Reduce("j", SUM, Dot("j", a, a))))
    y = add(add(Unary("tanh", by_rows), Unary("tanh", by_cols)), a)
    p = program({"i": (1, 1), "j": (1, 1)}, {"A": ("i", "j")}, [Store("Y", ("i", "j"), y)],
                ("Y",))
    loops = [s for s in schedule_kernel(p.kernels[0], {"i": 1, "j": 1}).body
             if isinstance(s, Loop)]
    assert [(s.axis, len(s.reduces)) for s in loops] == [("i", 1), ("j", 2), ("i", 1)]
    x = {"A": np.array([[1.5]], dtype=np.float32)}
    np.testing.assert_allclose(numpy_run(p, x)["Y"], run(p, x)["Y"], rtol=1e-6)
    (k,) = cost_program(p, H100).kernels
    assert k.legal and k.loops == 3


def test_in_place_accumulation_only_for_additive_combines():
    dims = {"m": (32, 8), "e": (64, 16), "n": (48, 4)}
    a, w = Load("A", ("m", "e")), Load("W", ("e", "n"))
    inputs = {"A": ("m", "e"), "W": ("e", "n")}
    summed = program(dims, inputs, [Store("Y", ("m", "n"), matmul(a, w, "e"))], ("Y",))
    maxed = program(dims, inputs, [Store("Y", ("m", "n"), Reduce("e", MAX, Dot("e", a, w)))],
                    ("Y",))
    # The A and W tiles, then the partial sums of the 256 threads splitting the contraction,
    # and the (m, n) accumulator; a dot folded by max needs a tile of its own besides.
    tiles = F * (8 * 16 + 16 * 4 + 256)
    assert cost_program(summed, H100).footprint == tiles + F * 8 * 4
    assert cost_program(maxed, H100).footprint == tiles + 2 * F * 8 * 4


def elementwise(extent: int, block: int = 16) -> BlockProgram:
    return program({"m": (extent, block)}, {"X": ("m",)},
                   [Store("Y", ("m",), mul(Load("X", ("m",)), Const(2.0)))], ("Y",))


@pytest.mark.parametrize("extent, share", [(64, 0.5), (128, 1.0), (1024, 1.0)])
def test_a_small_grid_gets_only_its_share_of_the_chip(extent, share):
    t = machine(processors=8, bandwidth=1e9, peak=1e18, launch=3e-6)
    (k,) = cost_program(elementwise(extent), t).kernels
    assert k.grid_points == extent // 16
    assert k.time == pytest.approx(2 * F * extent / (1e9 * share) + 3e-6, rel=1e-12)


def test_compute_bound_time_and_half_precision_matmuls_on_tensor_cores():
    dims = {"m": (16, 16), "e": (32, 32), "n": (16, 16)}
    inputs = {"A": ("m", "e"), "W": ("e", "n")}
    y = matmul(Load("A", ("m", "e")), Load("W", ("e", "n")), "e")
    t = machine(bandwidth=1e18, peak=1e9, peak_f16=1e12)
    dot, combine = 2 * 16 * 16 * 32, 16 * 16
    for dtype, dot_peak in (("f32", 1e9), ("f16", 1e12)):
        p = program(dims, inputs, [Store("Y", ("m", "n"), y)], ("Y",), dtype=dtype)
        (k,) = cost_program(p, t).kernels
        assert k.time == pytest.approx(dot / dot_peak + combine / 1e9, rel=1e-9)


def test_half_precision_inputs_halve_their_traffic():
    p32, p16 = elementwise(64), elementwise(64)
    p16 = BlockProgram(p16.dims, {**p16.tensors, "X": TensorDecl("X", ("m",), "f16", "input")},
                       p16.kernels, p16.outputs)
    assert cost_program(p32, H100).bytes_read == 2 * cost_program(p16, H100).bytes_read == 256


def test_a_kernel_that_does_not_fit_is_illegal_and_sorts_last():
    p = elementwise(64)
    # the X tile (64 B): the product is computed as it is stored, the constant is a literal
    fits, tight = machine(capacity=64), machine(capacity=63)
    assert cost_program(p, fits).kernels[0].footprint == 64
    ok, bad = cost_program(p, fits), cost_program(p, tight)
    assert ok.legal and not bad.legal and bad.time == math.inf
    assert ok.key() < bad.key() and ok.key("traffic") < bad.key("traffic")
    assert bad.to_json()["time"] is None and bad.to_json()["kernels"][0]["legal"] is False


def kc(traffic: int, flops: int, legal: bool = True) -> KernelCost:
    return KernelCost("T", ("m",), 1, traffic, 0, flops, 0, legal,
                      traffic * 1e-9 if legal else math.inf, 0, ())


def test_key_orders_by_legality_objective_flops_then_kernels():
    t = machine()

    def pc(*kernels: KernelCost) -> ProgramCost:
        return ProgramCost(kernels, t, 0)

    ranked = [pc(kc(100, 5)), pc(kc(100, 6)), pc(kc(50, 3), kc(50, 3)), pc(kc(200, 1)),
              pc(kc(10, 1, legal=False))]
    assert sorted(ranked, key=lambda c: c.key("traffic")) == ranked
    assert sorted(reversed(ranked), key=ProgramCost.key) == ranked
    with pytest.raises(ValueError, match="objective"):
        ranked[0].key("energy")


def test_equal_kernels_built_apart_share_one_cached_cost():
    # extraction builds every candidate from fresh nodes: equal kernels must still be found
    first, again = flash_attention(256, 32), flash_attention(256, 32)
    k1, k2 = first.kernels[0], again.kernels[0]
    assert k1 == k2 and k1 is not k2 and k1.stores[0].value.x is not k2.stores[0].value.x
    assert cost_kernel(again, k2, H100) is cost_kernel(first, k1, H100)
    other = flash_attention(256, 64)
    assert cost_kernel(other, other.kernels[0], H100) != cost_kernel(first, k1, H100)


def test_the_cache_keys_on_the_dims_and_tensors_a_kernel_uses():
    small, large = elementwise(64), elementwise(256)
    assert small.kernels == large.kernels
    assert cost_kernel(small, small.kernels[0], H100).bytes_read == F * 64
    assert cost_kernel(large, large.kernels[0], H100).bytes_read == F * 256


# --------------------------------------------------------------------------------------------
# Reports and determinism


def test_table_and_json_report_every_kernel_and_the_lower_bound():
    cost = cost_program(lower(load_program(ATTENTION)), H100)
    table = cost.table()
    for name in "SMELPO":
        assert any(line.startswith(name + " ") for line in table.splitlines())
    assert "total" in table and "GFLOP" in table and "MiB" in table and "µs" in table
    ratio = cost.traffic / cost.compulsory
    assert f"compulsory 4.00 MiB ({ratio:.2f}x the lower bound)" in table
    data = json.loads(json.dumps(cost.to_json()))
    assert data["traffic"] == cost.traffic and data["compulsory"] == cost.compulsory
    assert [k["tensors"] for k in data["kernels"]] == [[t] for t in "SMELPO"]
    assert data["kernels"][0]["grid"] == ["q", "k"]


DETERMINISM = """
import json, sys
sys.path.insert(0, {tests!r})
from test_cost import flash_attention, rowstats, ffn_like, H100, cost_program
from bbrules.frontend import load_program
from bbrules.lower import lower
ps = [flash_attention(256, 32), rowstats(True), ffn_like(True),
      lower(load_program({attention!r}))]
print(json.dumps([cost_program(p, H100).to_json() for p in ps]))
print("\\n".join(cost_program(p, H100).table() for p in ps))
"""


def test_costs_do_not_depend_on_hash_order():
    script = DETERMINISM.format(tests=str(Path(__file__).parent), attention=str(ATTENTION))
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outputs.append(subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                      capture_output=True, text=True).stdout)
    assert outputs[0] == outputs[1] and outputs[0]
