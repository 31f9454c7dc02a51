"""`bbrules run`'s verdict: norm-wise against a float64 dense evaluation, NaN and infinities
that match agree, the worst entry is reported, and a wrong program fails."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.cli import main
from bbrules.frontend import load_program, parse_program
from bbrules.inputs import random_inputs
from bbrules.lower import lower
from bbrules.verdict import EPS, B, Comparison, reduction_length, tolerance

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"

# Every example at a size that keeps several blocks per axis but runs in a second.
SMALL = {
    "attention": ["q=128/32", "k=256/64", "d=64"],
    "causal_attention": ["h=2/1", "q=128/32", "k=128/64"],
    "decode_attention": ["h=4/1", "k=1024/64"],
    "decoder_layer": ["s=128/64", "t=128/64", "h=2/1", "e=128/64", "n=128/64", "f=192/64"],
    "gated_mlp": ["m=64/32", "e=128/64", "f=256/64", "n=128/64"],
    "layernorm_matmul": ["m=128/64", "e=256/64", "n=128/64"],
    "lm_head_cross_entropy": ["t=40/16", "e=24/16", "v=100/32"],  # every axis ragged
    "rmsnorm_ffn_swiglu": ["m=16/8", "e=128/64", "f=64/4", "n=128"],
    "rmsnorm_matmul": ["m=128/64", "e=256/64", "n=128/64"],
    "residual_rmsnorm": ["t=64/16", "e=512/128"],
    "rmsnorm_qkv": ["t=64/16", "e=128/32", "q=128/32", "k=64/32"],
    "rope_attention": ["h=2/1", "q=128/32", "k=128/32"],
    "rope_qknorm_attention": ["h=2/1", "q=128/32", "k=128/32"],
    "rowsum_add": ["i=64/16", "j=256/64"],
    "self_attention": ["s=128/64", "t=128/64", "d=64"],
    "softmax": ["r=128/64", "c=512/256"],
}


def _dims(name: str) -> list[str]:
    return [a for d in SMALL[name] for a in ("--dim", d)]


def test_every_example_has_a_small_size():
    assert set(SMALL) == {p.stem for p in EXAMPLES.glob("*.bbp")}


@pytest.mark.parametrize("backend", ["interp", "numpy"])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_fused_example_passes(name, backend, capsys):
    assert main(["run", str(EXAMPLES / f"{name}.bbp"), *_dims(name), "--backend", backend,
                 "--objective", "traffic", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"]
    for o in report["outputs"].values():
        assert o["error"] <= o["tolerance"] and o["mismatched_nonfinite"] == 0


# Sizes at which the time objective splits folds: few output blocks, long reductions.
SPLIT = {
    "decode_attention": ["h=4/1", "k=1024/64"],
    "attention": ["q=128/64", "k=2048/64", "d=64"],
    "rmsnorm_matmul": ["m=128/64", "e=8192/64", "n=128/64"],
}


@pytest.mark.parametrize("backend", ["interp", "numpy"])
@pytest.mark.parametrize("name", sorted(SPLIT))
def test_examples_fused_with_split_folds_pass(name, backend, capsys):
    """Under the time objective these sizes leave processors idle, so folds are split over
    chunks (the traffic objective above never splits: the chunks' states cost traffic)."""
    dims = [a for d in SPLIT[name] for a in ("--dim", d)]
    assert main(["run", str(EXAMPLES / f"{name}.bbp"), *dims, "--backend", backend,
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["kernels"] >= 2


def test_reduction_length_sums_every_reduction_the_output_depends_on():
    p = load_program(str(EXAMPLES / "layernorm_matmul.bbp"))
    # MU, VAR and the matmul each sum over e; VAR and XN subtract MU, XN adds 1e-5 and B
    assert reduction_length(p, "Y") == 3 * 4096 + 4
    assert reduction_length(p, "MU") == 4096
    assert tolerance("f32", 12288) == pytest.approx(16 * EPS["f32"] * (1 + math.sqrt(12288)))


def test_entries_near_zero_do_not_fail_a_correct_output():
    """An element-wise relative test fails here (0.5 relative error at one tiny entry); the
    norm-wise one sees a rounding-sized error."""
    ref = np.array([100.0, -50.0, 2e-7, 3.0])
    got = ref + np.array([1e-5, -3e-5, 1e-7, 0.0])
    c = Comparison.of(got, ref, "f32", 4096)
    assert c.ok and c.error < 1e-6
    assert c.worst == (1,) and c.expected == -50.0


def test_matching_nan_and_infinities_agree_and_unmatched_ones_fail():
    ref = np.array([np.nan, np.inf, -np.inf, 1.0, 2.0])
    assert Comparison.of(ref.astype(np.float32), ref, "f32", 1).ok
    got = np.array([np.nan, np.inf, np.inf, 1.0, np.nan], dtype=np.float32)
    c = Comparison.of(got, ref, "f32", 1)
    assert not c.ok and c.mismatched == 2
    assert c.worst in ((2,), (4,))


def test_the_worst_entry_is_reported_with_its_index():
    ref = np.arange(12.0).reshape(3, 4) + 1
    got = ref.copy()
    got[2, 1] += 0.5
    c = Comparison.of(got, ref, "f32", 1)
    assert not c.ok and c.worst == (2, 1)
    assert (c.got, c.expected) == (got[2, 1], ref[2, 1])
    assert c.error == pytest.approx(0.5 / np.linalg.norm(ref))


def test_identical_nan_outputs_pass(tmp_path, capsys):
    prog = tmp_path / "logs.bbp"
    prog.write_text("dim m = 64 / 16\ninput X[m] : f32\nY[m] = log(X[m])\noutput Y\n")
    assert main(["run", str(prog), "--backend", "numpy", "--json"]) == 0
    y = json.loads(capsys.readouterr().out)["outputs"]["Y"]
    assert y["ok"] and y["mismatched_nonfinite"] == 0


def test_a_perturbed_block_program_fails_and_names_the_worst_entry(tmp_path, capsys):
    source = EXAMPLES / "layernorm_matmul.bbp"
    good = tmp_path / "ln.bbk"
    assert main(["apply", str(source), *_dims("layernorm_matmul"), "-o", str(good)]) == 0
    capsys.readouterr()
    text = good.read_text()
    assert "1e-05" in text
    wrong = tmp_path / "wrong.bbk"
    wrong.write_text(text.replace("1e-05", "0.001"))  # the epsilon of the variance, perturbed
    assert main(["run", str(good), "--backend", "numpy"]) == 0
    capsys.readouterr()
    assert main(["run", str(wrong), "--backend", "numpy", "--json"]) == 1
    y = json.loads(capsys.readouterr().out)["outputs"]["Y"]
    assert not y["ok"] and y["error"] > y["tolerance"]
    assert len(y["worst"]["index"]) == 2 and y["worst"]["got"] != y["worst"]["expected"]
    assert main(["run", str(wrong), "--backend", "numpy"]) == 1
    out = capsys.readouterr().out
    assert "Y: norm-wise error" in out and "worst Y[" in out and "FAILED" in out


def test_run_help_states_the_tolerance_rule(capsys):
    assert main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "||got - ref|| / ||ref|| is at most 16 * (eps(dtype) + eps(f32) * sqrt(K))" in text
    assert "2^-23 for f32, 2^-10 for f16 and 2^-7 for bf16" in text


CANCELLING = """\
dim i = 1 / 1
dim k = 3 / 3
input A[i, k] : f32
T0[i, k] = rsqrt(square((0.5 - A[i, k])) + 1)
T1[i] = (sum[k] A[i, k] * T0[i, k] * 0.3333333333333333)
output T1
"""


def test_an_output_whose_sums_cancel_is_judged_against_plain_float32_arithmetic():
    """Found by the fused-program property test: terms of about 0.3 summing to -0.004 lose
    digits in any float32 evaluation; the fused program is as accurate as the plain one."""
    program = parse_program(CANCELLING, "<cancelling>")
    inputs = random_inputs(program, seed=0)
    ref = dense.evaluate(program, inputs, dtype=np.float64)["T1"]
    plain = dense.evaluate(program, inputs, dtype=np.float32)["T1"]
    got = interp.run(lower(program), inputs)["T1"]
    k = reduction_length(program, "T1")
    assert not Comparison.of(got, ref, "f32", k).ok  # beyond the K-based tolerance alone
    judged = Comparison.of(got, ref, "f32", k, plain)
    assert judged.ok and judged.error <= B * judged.baseline
    assert "plain float32" in judged.line("T1")
    wrong = got * (1 + 1e-3)
    assert not Comparison.of(wrong, ref, "f32", k, plain).ok
