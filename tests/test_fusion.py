"""`fuse` on the paper's programs: the fused forms, their traffic, their numbers, their spellings."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.engine import Budget
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.blockfile import parse_block_program
from bbrules.ir import BlockProgram, Tuple, show_program, validate
from bbrules.lower import lower
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.rulefile import parse_rules
from bbrules.schedule import Loop, schedule_kernel, walk_steps
from bbrules.targets import get_target
from bbrules.verdict import Comparison, reduction_length

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
PROGRAMS = Path(__file__).parent / "programs"
NEG_SUB = Path(__file__).parent / "packs" / "neg_sub"
H100 = get_target("h100")


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


# These tests are about what the rules derive, so kernels are launched as written: folds
# whole, at the program's blocks (a split over keys, tests/test_split.py, would cut the Flash
# loop they look at into chunks; finer query blocks would change its traffic).
WHOLE = Options(split_folds=False, reblock=False)


def fused(path: Path, pack, dims=None, **kw):
    kw.setdefault("options", WHOLE)
    return fuse(lower(load_program(path, dims)), pack, H100, **kw)


def loops(p: BlockProgram) -> list[Loop]:
    """The real loops (more than one trip) of a one-kernel program, outermost first."""
    (k,) = p.kernels
    trips = {a: d.blocks for a, d in p.dims.items()}
    return [s for s, _ in walk_steps(schedule_kernel(k, trips).body)
            if isinstance(s, Loop) and trips[s.axis] > 1]


def assert_matches_dense(path: Path, program: BlockProgram, dims) -> None:
    """The fused program through the interpreter agrees with the dense evaluator, up to f32
    rounding relative to the output's magnitude (fusion reassociates sums)."""
    ast = load_program(path, dims)
    inputs = random_inputs(ast, seed=1)
    want = dense.evaluate(ast, inputs, dtype=np.float64)
    got = interp.run(program, inputs)
    for out in program.outputs:
        assert got[out].shape == want[out].shape
        assert np.max(np.abs(got[out] - want[out])) <= 1e-5 * np.max(np.abs(want[out]))


# --------------------------------------------------------------------------------------------
# Flash Attention

def test_attention_becomes_flash_attention(pack):
    r = fused(EXAMPLES / "attention.bbp", pack)
    p = r.program
    (kernel,) = p.kernels
    assert kernel.grid == ("q", "d") and p.dims["d"].blocks == 1  # grid over query blocks
    assert set(p.tensors) == {"Q", "K", "V", "O"}  # nothing N x N is stored
    (loop,) = loops(p)
    assert loop.axis == "k"
    (red,) = loop.reduces
    assert red.monoid.name == "softmax" and isinstance(red.x, Tuple) and len(red.x.items) == 3
    mib = 1 << 20
    q = k = v = o = 1 * mib  # 4096 x 64 f32
    assert r.after.traffic == q + o + p.dims["q"].blocks * (k + v)
    assert r.before.traffic > 5 * r.after.traffic
    assert r.stop == "saturated"


@pytest.mark.parametrize("target, n", [("h200", 4096), ("h100", 512), ("h200", 512)])
def test_attention_stores_no_scores_on_the_faster_chip_and_at_short_sequences(pack, target, n):
    """Flash Attention at N = 512 has 8 query blocks for 132 SMs; priced by unit (its dots on
    tensor cores), and with modeled-time ties going to less traffic, it still beats storing S."""
    dims = {"q": (n, 64), "k": (n, 64)}
    r = fuse(lower(load_program(EXAMPLES / "attention.bbp", dims)), pack, get_target(target),
             options=WHOLE)
    p = r.program
    assert [k.tensor for k in p.stores] == ["O"] and set(p.tensors) == {"Q", "K", "V", "O"}
    tile = n * 64 * 4  # Q, K, V and O are n x 64 f32
    assert r.after.traffic == 2 * tile + p.dims["q"].blocks * 2 * tile
    assert r.runner_up is not None and r.runner_up.n_kernels > 1


def test_flash_attention_computes_attention(pack):
    dims = {"q": (256, 64), "k": (256, 64)}
    r = fused(EXAMPLES / "attention.bbp", pack, dims)
    assert [k.tensor for k in r.program.stores] == ["O"]
    assert_matches_dense(EXAMPLES / "attention.bbp", r.program, dims)


@pytest.mark.parametrize("spelling", ["attention_div.bbp", "attention_commuted.bbp",
                                      "attention_folded.bbp", "attention_qscaled.bbp"])
def test_spellings_of_attention_fuse_to_the_same_cost(pack, spelling):
    reference = fused(EXAMPLES / "attention.bbp", pack).after
    r = fused(PROGRAMS / spelling, pack)
    assert len(r.program.kernels) == 1
    assert (r.after.traffic, r.after.flops) == (reference.traffic, reference.flops)
    assert math.isclose(r.after.time, reference.time, rel_tol=1e-12)


@pytest.mark.parametrize("old, new", [
    ("max[k] S[q, k]\n", "max[k] S[q, k] + 0.0\n"),
    ("max[k] S[q, k]\n", "0.0 + max[k] S[q, k]\n"),
    ("exp(S[q, k] - M[q])", "exp(S[q, k] - M[q] - 0.0)"),
    ("exp(S[q, k] - M[q])", "exp(-(-(S[q, k] - M[q])))"),
    ("exp(S[q, k] - M[q])", "exp(S[q, k] + -1 * M[q])"),
    ("E[q, k] / L[q]", "E[q, k] * 1.0 / L[q]"),
    ("E[q, k] / L[q]", "E[q, k] / L[q] / 1.0"),
    ("* 0.125", "* -0.125 * -1"),
])
def test_identity_elements_do_not_stop_fusion(pack, old, new):
    # `+ 0.0`, `- 0.0`, `-(-x)`, `* 1.0`, `* -1`: attention fuses exactly as written plainly.
    text = (EXAMPLES / "attention.bbp").read_text()
    assert old in text
    reference = fused(EXAMPLES / "attention.bbp", pack)
    r = fuse(lower(parse_program(text.replace(old, new), "attention.bbp")), pack, H100,
             options=WHOLE)
    assert r.program.stores == reference.program.stores
    assert (r.after.traffic, r.after.flops, r.after.time) == \
        (reference.after.traffic, reference.after.flops, reference.after.time)


def flash_form(r, reference) -> bool:
    """Whether `r` is attention's Flash form: one kernel, one loop over `k` folding a 3-tuple
    with the softmax monoid, and the global traffic of `reference` (attention.bbp fused)."""
    p = r.program
    if [k.tensor for k in p.stores] != ["O"] or r.after.traffic != reference.traffic:
        return False
    (loop,) = loops(p)
    reds = loop.reduces
    return loop.axis == "k" and len(reds) == 1 and reds[0].monoid.name == "softmax" and \
        isinstance(reds[0].x, Tuple) and len(reds[0].x.items) == 3


@pytest.mark.parametrize("dims", [None, {"q": (256, 64), "k": (256, 64)}])
def test_a_rule_joined_into_fuse_lets_a_negated_exponent_fuse(pack, dims, tmp_path):
    # `exp(-(M - S))` reaches the softmax rules only if `-(x - y) => y - x` runs between the
    # fusion steps: in the standard `fuse` stage, not in a stage of its own after it.
    negated = PROGRAMS / "attention_negated.bbp"
    reference = fused(EXAMPLES / "attention.bbp", pack, dims).after
    alone = fused(negated, pack, dims)
    assert not flash_form(alone, reference) and alone.after.traffic > reference.traffic
    own_stage = tmp_path / "neg_sub"
    own_stage.mkdir()
    text = (NEG_SUB / "neg_sub.bbr").read_text()
    (own_stage / "neg_sub.bbr").write_text(text.replace("stage fuse += neg_sub",
                                                        "stage mine: neg_sub"))
    after = fused(negated, load_packs([own_stage]), dims)
    assert not flash_form(after, reference)
    joined = fused(negated, load_packs([NEG_SUB]), dims)
    assert flash_form(joined, reference)
    assert (joined.after.flops, joined.after.time) == (reference.flops, reference.time)
    if dims is not None:
        assert_matches_dense(negated, joined.program, dims)


@pytest.mark.parametrize("objective, dims", [
    ("traffic", None),
    # By time, at the example's 1024 positions the one-kernel form's grid of 16 query blocks
    # gets 16/132 of the chip and materialising S is cheaper (see test_extract); at attention's
    # 4096 positions the one kernel wins.
    ("time", {"s": (4096, 64), "t": (4096, 64)})])
def test_self_attention_becomes_flash_attention(pack, objective, dims):
    r = fused(EXAMPLES / "self_attention.bbp", pack, dims, objective=objective)
    p = r.program
    (kernel,) = p.kernels
    assert kernel.grid == ("s", "d") and set(p.tensors) == {"X", "O"}  # nothing s x t stored
    (loop,) = loops(p)
    assert loop.axis == "t"
    (red,) = loop.reduces
    assert red.monoid.name == "softmax"
    x = o = p.dims["s"].extent * 64 * 4
    # X read once as queries, and blocks(s) times as keys and values (one load serves both).
    assert r.after.traffic == x + o + p.dims["s"].blocks * x


def test_self_attention_through_renamed_references(pack):
    dims = {"s": (256, 64), "t": (256, 64)}
    r = fused(EXAMPLES / "self_attention.bbp", pack, dims)
    assert r.after.key() <= r.before.key()
    assert_matches_dense(EXAMPLES / "self_attention.bbp", r.program, dims)


# --------------------------------------------------------------------------------------------
# LayerNorm + matmul

def test_layernorm_matmul_is_one_loop_with_welford(pack):
    r = fused(EXAMPLES / "layernorm_matmul.bbp", pack)
    p = r.program
    assert len(p.kernels) == 1 and "XN" not in p.tensors
    (loop,) = loops(p)  # statistics and matmul share the one loop over e
    assert loop.axis == "e"
    monoids = sorted(red.monoid.name for red in loop.reduces)
    assert "welford" in monoids and "sum" in monoids
    assert r.after.legal


def test_fused_layernorm_matmul_computes_layernorm_matmul(pack):
    dims = {"m": (128, 64), "n": (128, 64)}  # e keeps its extent: the mean is * 1/4096
    r = fused(EXAMPLES / "layernorm_matmul.bbp", pack, dims)
    assert len(r.program.kernels) == 1
    assert_matches_dense(EXAMPLES / "layernorm_matmul.bbp", r.program, dims)


def test_welford_stays_accurate_when_the_mean_is_large(pack):
    dims = {"m": (128, 64), "n": (128, 64)}
    path = EXAMPLES / "layernorm_matmul.bbp"
    program = fused(path, pack, dims).program
    ast = load_program(path, dims)
    inputs = random_inputs(ast, seed=2)
    inputs["X"] = inputs["X"] + np.float32(1000.0)
    want = dense.evaluate(ast, inputs, dtype=np.float64)["Y"]
    got = interp.run(program, inputs)["Y"]
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-2


# --------------------------------------------------------------------------------------------
# RMSNorm + FFN-SwiGLU

def test_rmsnorm_ffn_swiglu_is_one_kernel_at_the_example_shapes(pack):
    r = fused(EXAMPLES / "rmsnorm_ffn_swiglu.bbp", pack)
    assert len(r.program.kernels) == 1 and r.after.legal
    assert {"A", "U", "H", "XN"}.isdisjoint(r.program.tensors)
    # The sum of squares has no pass of its own: gate and up both carry it in their loop
    # over e, nested in the loop over f.
    f_loop, e_loop = loops(r.program)
    assert (f_loop.axis, e_loop.axis) == ("f", "e")
    assert [red.monoid.name for red in e_loop.reduces] == ["sum2", "sum2"]


def test_rmsnorm_ffn_swiglu_splits_where_one_kernel_does_not_fit(pack):
    big = {"e": (4096, 2048)}  # wider X, W1, W3 tiles: the one-kernel form overflows
    r = fused(EXAMPLES / "rmsnorm_ffn_swiglu.bbp", pack, big)
    assert len(r.program.kernels) > 1 and r.after.legal
    assert r.after.key() < r.before.key()
    # Asked for one kernel, the search's one-kernel form is tiled finer until it fits
    # (`Extractor.legalize`).
    one = fused(EXAMPLES / "rmsnorm_ffn_swiglu.bbp", pack, big, max_kernels=1)
    [k] = one.program.kernels
    assert one.after.legal and k.blocks
    assert all(block < one.program.block(a) for a, block in k.blocks)


def test_max_kernels_one_asks_for_the_mega_kernel(pack):
    # Where the cheapest program has two kernels, a one-kernel program is still found.
    dims = {"m": (4096, 8), "f": (14336, 4)}
    free = fused(EXAMPLES / "gated_mlp.bbp", pack, dims)
    one = fused(EXAMPLES / "gated_mlp.bbp", pack, dims, max_kernels=1)
    assert len(free.program.kernels) == 2
    assert len(one.program.kernels) == 1 and one.after.legal
    assert free.after.key() < one.after.key()  # recomputing H per output block costs
    swiglu = fused(EXAMPLES / "rmsnorm_ffn_swiglu.bbp", pack, max_kernels=1)
    assert len(swiglu.program.kernels) == 1 and swiglu.after.legal


def test_fused_rmsnorm_ffn_swiglu_computes_it(pack):
    dims = {"m": (16, 8), "e": (128, 64), "f": (32, 4), "n": (128, 128)}
    r = fused(EXAMPLES / "rmsnorm_ffn_swiglu.bbp", pack, dims)
    assert len(r.program.kernels) == 1
    assert_matches_dense(EXAMPLES / "rmsnorm_ffn_swiglu.bbp", r.program, dims)


def test_sum_of_squares_sinks_into_the_projection_loop(pack):
    r = fused(PROGRAMS / "rmsnorm_mlp.bbp", pack)
    assert len(r.program.kernels) == 1
    f_loop, e_loop = loops(r.program)
    assert (f_loop.axis, e_loop.axis) == ("f", "e")
    assert [red.monoid.name for red in e_loop.reduces] == ["sum2"]
    dims = {"m": (16, 8), "e": (4096, 64), "f": (32, 16), "n": (64, 64)}
    small = fused(PROGRAMS / "rmsnorm_mlp.bbp", pack, dims)
    assert_matches_dense(PROGRAMS / "rmsnorm_mlp.bbp", small.program, dims)


# --------------------------------------------------------------------------------------------
# A whole decoder layer

def test_the_decoder_layer_example_never_stores_the_attention_scores(pack):
    """At its own sizes and with every launch choice (splits, per-kernel blocks) on."""
    r = fuse(lower(load_program(EXAMPLES / "decoder_layer.bbp")), pack, H100)
    assert not [name for name, t in r.program.tensors.items() if {"s", "t"} <= set(t.axes)]
    assert r.after.legal and r.after.time < r.before.time


def test_decoder_layer_never_stores_the_attention_scores(pack):
    """RMSNorm, Q/K/V, multi-head attention, output projection, residual, RMSNorm, SwiGLU FFN and
    residual in one program: the fused layer holds no tensor over both sequence axes (the
    attention runs as Flash Attention inside one kernel), is legal, has fewer kernels and
    computes the dense evaluator's numbers as `bbrules run` judges them.  (Not
    `assert_matches_dense`: its 1e-5 max-norm bound is tighter than float32 allows for the
    layer's chained reductions with unit-variance weights; the unfused program through the
    interpreter misses it too, by 2e-5 to 8e-5 depending on the seed.)"""
    path = EXAMPLES / "decoder_layer.bbp"
    # Launched as written: at these sizes the grids are so small that storing the scores
    # over finer query blocks is modeled faster.
    dims = {"s": (128, 64), "t": (128, 64), "h": (2, 1), "e": (128, 64), "n": (128, 64),
            "f": (192, 64)}
    r = fused(path, pack, dims)
    p = r.program
    assert not [name for name, t in p.tensors.items() if {"s", "t"} <= set(t.axes)]
    assert r.after.legal
    assert len(p.kernels) < len(r.before.kernels)
    ast = load_program(path, dims)
    for seed in (1, 2):
        inputs = random_inputs(ast, seed=seed)
        want = dense.evaluate(ast, inputs, dtype=np.float64)["Y"]
        c = Comparison.of(interp.run(p, inputs)["Y"], want, "f32", reduction_length(ast, "Y"))
        assert c.ok, c.line("Y")


# --------------------------------------------------------------------------------------------
# Reports and budgets

def test_report_explains_the_derivation(pack):
    r = fused(EXAMPLES / "attention.bbp", pack)
    rules = [s.rule for s in r.chain]
    assert len(r.explain()) == len(rules)
    for name in ("forward", "online_sum", "online_dot", "softmax_merge"):
        assert name in rules
    assert rules.index("forward") < rules.index("online_dot") < rules.index("softmax_merge")
    data = r.to_json()
    assert data["after"]["n_kernels"] == 1 and data["before"]["n_kernels"] == 6
    assert [s["stage"] for s in data["saturation"]] == [s.name for s in pack.stages]
    assert data["extraction"]["candidates"] >= 1
    assert data["explain"][0]["rule"] == "forward"


def test_exploding_pack_stops_at_its_budget_with_a_valid_program():
    terms = " + ".join(f"X{i}[m]" for i in range(12))
    source = ("dim m = 64 / 16\ninput " + ", ".join(f"X{i}[m]" for i in range(12)) +
              " : f32\nT[m] = " + terms + "\nY[m] = T[m] * 2.0\noutput Y\n")
    ast = parse_program(source, "chain.bbp")
    explode = parse_rules("""
rule forward: load(store(?v)) => ?v
rule add_comm: ?x + ?y => ?y + ?x
rule add_assoc: (?x + ?y) + ?z <=> ?x + (?y + ?z)
""", "explode.bbr")
    r = fuse(lower(ast), explode, H100, budget=Budget(nodes=2_000))
    assert r.stop == "node limit"
    assert 1_000 < r.stats[-1].enodes <= 2_000  # held within an iteration, not after it
    assert r.budgets()["saturation default"] == "node limit"
    validate(r.program)
    assert r.after.key() <= r.before.key()
    inputs = random_inputs(ast, seed=0)
    np.testing.assert_allclose(interp.run(r.program, inputs)["Y"],
                               dense.evaluate(ast, inputs)["Y"], rtol=1e-5, atol=1e-5)


def test_fused_program_is_self_contained(pack):
    # Written out and read back, the program carries the monoid definitions it uses.
    r = fused(EXAMPLES / "attention.bbp", pack, {"q": (256, 64), "k": (256, 64)})
    assert set(r.program.monoids) == {"softmax"}
    back = parse_block_program(show_program(r.program), "fused.bbk").program
    assert back.stores == r.program.stores
    assert back.monoids == r.program.monoids


# EfficientNet's squeeze-and-excitation after a depthwise 3 x 3 convolution, on a 4 x 4 image
# walked a position at a time (as `tests/models/mbconv.onnx` imports): the mean over the image
# feeds a gate that scales the same image.  The convolution's output depends on its positions
# only through the one-hot that picks its window.
SQUEEZE_EXCITATION = """\
dim c = 64
dim h = 4 / 1
dim w = 4 / 1
dim s = 4 / 1
dim t = 4 / 1
dim i = 3 / 1
dim j = 3 / 1
dim e = 8 / 1
dim o = 32
input X[o, h, w], U[c, s, t], K[c, i, j], Kb[c], Sq[e, c], Sqb[e], Ex[c, e], Exb[c] : f32
input P[o, c], Pb[o] : f32
D[c, h, w] = (sum[i, j] K[c, i, j] * (sum[s] where(s == h + i - 1, 1, 0) * \
(sum[t] where(t == w + j - 1, 1, 0) * U[c, s, t]))) + Kb[c]
A[c, h, w] = D[c, h, w] * sigmoid(D[c, h, w])
M[c] = mean[h, w] A[c, h, w]
Q[e] = (sum[c] Sq[e, c] * M[c]) + Sqb[e]
G[c] = sigmoid((sum[e] Ex[c, e] * (Q[e] * sigmoid(Q[e]))) + Exb[c])
Y[o, h, w] = X[o, h, w] + (sum[c] P[o, c] * (A[c, h, w] * G[c])) + Pb[o]
output Y
"""


def test_squeeze_and_excitation_after_a_depthwise_convolution_fuses_soundly(pack):
    """The e-graph's analysis gave a position no axis: D, merged with its load, lost w from
    its dependencies, and `hoist_mul` took D out of the sum over w, one e-class holding
    sum[w] bsum[w](D * sigmoid(D)) and sum[w](D) * bsum[w](sigmoid(D)).  Fused for h100,
    the output was off by 60% of its scale."""
    ast = parse_program(SQUEEZE_EXCITATION)
    fused = fuse(lower(ast), pack, H100).program
    inputs = random_inputs(ast, seed=0)
    want = dense.evaluate(ast, inputs, np.float64)["Y"]
    got = interp.run(fused, inputs)["Y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
