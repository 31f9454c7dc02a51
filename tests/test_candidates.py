"""Candidate selection: long programs are cut into candidates, identical candidates are fused
once, and the stitched program computes what the unfused one does with fewer kernels."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bbrules import interp
from bbrules.candidates import (PackSource, _cut_costs, _loads, canonical, fuse_candidates,
                               select_candidates)
from bbrules.cli import main
from bbrules.engine import Budget
from bbrules.extract import NoCandidate
from bbrules.frontend import load_program, parse_program
from bbrules.inputs import random_inputs
from bbrules.ir import show_program, validate
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

from test_numpy_backend import CHAIN_WITH_A_VIEW

TARGET = get_target("h100")
ROOT = Path(__file__).resolve().parent.parent


def attention_chain(n: int) -> str:
    """n small attention blocks, each block's output the next block's queries (as
    benchmarks/bench_apply.py builds them, at 128 x 128)."""
    lines = ["dim q = 128 / 32", "dim k = 128 / 32", "dim d = 32",
             "input Q0[q, d], K[k, d], V[k, d] : f32"]
    for i in range(1, n + 1):
        lines += [f"S{i}[q, k] = sum[d] Q{i - 1}[q, d] * K[k, d] * 0.125",
                  f"M{i}[q] = max[k] S{i}[q, k]",
                  f"E{i}[q, k] = exp(S{i}[q, k] - M{i}[q])",
                  f"L{i}[q] = sum[k] E{i}[q, k]",
                  f"P{i}[q, k] = E{i}[q, k] / L{i}[q]",
                  f"Q{i}[q, d] = sum[k] P{i}[q, k] * V[k, d]"]
    return "\n".join(lines) + f"\noutput Q{n}\n"


def norm_chain(acts: list[str]) -> str:
    """Blocks of `X_i = act(X_{i-1} / rowsum(X_{i-1}^2)) W_i`, one per activation."""
    weights = ", ".join(f"W{i}[f, e]" for i in range(1, len(acts) + 1))
    lines = ["dim m = 64 / 32", "dim e = 64 / 32", "dim f = 64 / 32",
             f"input X0[m, e], {weights} : f32"]
    for i, act in enumerate(acts, 1):
        lines += [f"R{i}[m] = sum[f] X{i - 1}[m, f] * X{i - 1}[m, f]",
                  f"N{i}[m, f] = {act}(X{i - 1}[m, f] / R{i}[m])",
                  f"X{i}[m, e] = sum[f] N{i}[m, f] * W{i}[f, e]"]
    return "\n".join(lines) + f"\noutput X{len(acts)}\n"


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


@pytest.fixture(scope="module")
def attention(pack):
    p = lower(parse_program(attention_chain(4), "chain.bbp"))
    candidates = select_candidates(p, 6)
    return p, candidates, fuse_candidates(p, candidates, pack, TARGET)


def test_cuts_at_the_cheapest_tensors(attention):
    p, candidates, _ = attention
    # Between the blocks only Q_i (128 x 32) crosses; inside, the 128 x 128 scores would.
    assert [(c.start, c.stop) for c in candidates] == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert [c.program.inputs for c in candidates] == [(f"Q{i}", "K", "V") for i in range(4)]
    assert [c.program.outputs for c in candidates] == [(f"Q{i}",) for i in range(1, 5)]


def test_identical_blocks_are_fused_once(attention):
    _, _, result = attention
    assert [c.reused_from for c in result.candidates] == [None, 0, 0, 0]
    assert all(c.kernels_after == result.candidates[0].kernels_after for c in result.candidates)


def test_stitched_program_is_equivalent_and_cheaper(attention):
    p, _, result = attention
    validate(result.program)
    inputs = random_inputs(p, seed=1)
    want, got = interp.run(p, inputs)["Q4"], interp.run(result.program, inputs)["Q4"]
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert result.after.n_kernels < result.before.n_kernels
    assert result.after.traffic <= result.before.traffic
    # Each block's scores stay local: none of S, E, P is stored by the stitched program.
    stored = {s.tensor for s in result.program.stores}
    assert not stored & {f"{t}{i}" for t in "SEP" for i in range(1, 5)}
    assert result.program.tensors["Q2"].role == "temp"


def test_distinct_candidates_are_fused_in_a_pool(pack):
    p = lower(parse_program(norm_chain(["exp", "tanh"]), "norms.bbp"))
    candidates = select_candidates(p, 3)
    assert [(c.start, c.stop) for c in candidates] == [(0, 3), (3, 6)]
    result = fuse_candidates(p, candidates, pack, TARGET, source=PackSource(), workers=2)
    assert result.workers == 2 and [c.reused_from for c in result.candidates] == [None, None]
    inputs = random_inputs(p, seed=2)
    want, got = interp.run(p, inputs)["X2"], interp.run(result.program, inputs)["X2"]
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert result.after.traffic <= result.before.traffic


@pytest.mark.parametrize("workers", [1, 2])
def test_time_a_quick_candidate_leaves_goes_to_those_after_it(pack, workers):
    # Four distinct candidates share 40 s: the first is given a quarter (an eighth of it per
    # worker's two rounds when two fuse at once) and finishes in well under a second, so the
    # last is given more than an equal part.
    p = lower(parse_program(norm_chain(["exp", "tanh", "sigmoid", "relu"]), "norms.bbp"))
    candidates = select_candidates(p, 3)
    source = PackSource() if workers > 1 else None
    result = fuse_candidates(p, candidates, pack, TARGET, budget=Budget(seconds=40.0),
                             source=source, workers=workers)
    budgets = [c.budget for c in result.candidates]
    assert [c.reused_from for c in result.candidates] == [None] * 4
    assert budgets[0] <= 40.0 / math.ceil(4 / workers)
    assert budgets[-1] > 40.0 / math.ceil(4 / workers)
    assert all(c.seconds < c.budget and not c.cut() for c in result.candidates)
    report = result.to_json()["candidates"][-1]
    assert report["budget_seconds"] == budgets[-1] and report["budgets"]["extraction"] == "complete"


def test_a_candidate_cut_short_says_where(pack):
    """A fusion given no time stops each phase at its time limit, and its report names them
    (the saturation's first stop alone would say the algebra stage's iteration cap)."""
    p = lower(parse_program(norm_chain(["exp", "tanh"]), "norms.bbp"))
    result = fuse_candidates(p, select_candidates(p, 3), pack, TARGET, budget=Budget(seconds=0))
    for c in result.candidates:
        assert "extraction" in c.cut() and c.budgets["extraction"] == "time limit"
        assert "cut short: " in c.line() and "extraction" in c.line()


def test_apply_reports_candidates(tmp_path, capsys):
    program = tmp_path / "norms.bbp"
    program.write_text(norm_chain(["exp"] * 3))
    assert main(["apply", str(program), "--candidates", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["kernels"] for c in report["candidates"]] == [[0, 3], [3, 6], [6, 9]]
    assert [c["reused"] for c in report["candidates"]] == [False, True, True]
    assert report["after"]["n_kernels"] < report["before"]["n_kernels"]

    out = tmp_path / "norms.bbk"
    assert main(["apply", str(program), "--candidates", "3", "--explain", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "candidate 2: kernels 6-8" in text and "no chain of rule applications" in text
    assert main(["run", str(out)]) == 0


def test_the_api_fuses_by_candidates_as_apply_does():
    # 18 kernels: above the threshold the API cuts candidates as `apply` does; 0 turns it off
    import bbrules
    text = norm_chain(["exp", "tanh", "sigmoid", "exp", "tanh", "sigmoid"])
    by_candidates = bbrules.fuse(text)
    assert [line.split(":")[0] for line in by_candidates.explain()] == \
        ["candidate 0", "candidate 1"]
    assert "fused by candidates: 2 candidates" in by_candidates.report()
    inputs = random_inputs(by_candidates.program, seed=4)
    want = interp.run(bbrules.load(text).program, inputs)["X6"]
    got = bbrules.compile(by_candidates)(**inputs)["X6"]
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert by_candidates.cost.n_kernels < by_candidates.baseline.n_kernels
    three = bbrules.fuse(text, candidates=3)
    assert len(three.explain()) == 6
    with pytest.raises(bbrules.UsageError, match="cannot be combined"):
        bbrules.fuse(text, candidates=3, max_kernels=4)
    with pytest.raises(bbrules.UsageError, match="candidates must be"):
        bbrules.fuse(text, candidates=-1)


def test_candidates_and_max_kernels_conflict(tmp_path, capsys):
    program = tmp_path / "norms.bbp"
    program.write_text(norm_chain(["exp"]))
    assert main(["apply", str(program), "--candidates", "2", "--max-kernels", "1"]) == 2
    assert "--max-kernels" in capsys.readouterr().err


def test_a_repeating_program_is_cut_alike_in_every_repetition():
    # Five blocks of 6 kernels, candidates of up to 10: a period of 6 holds one block, so every
    # block is cut the same way (without the repetition the cheapest cut could straddle them).
    p = lower(parse_program(attention_chain(5), "chain.bbp"))
    candidates = select_candidates(p, 10)
    assert [(c.start, c.stop) for c in candidates] == [(i, i + 6) for i in range(0, 30, 6)]
    forms = {show_program(canonical(c.program)[0]) for c in candidates}
    assert len(forms) == 1


def test_a_program_that_does_not_repeat_is_cut_by_bytes_alone():
    p = lower(parse_program(norm_chain(["exp", "tanh", "sigmoid"]), "norms.bbp"))
    assert [(c.start, c.stop) for c in select_candidates(p, 3)] == [(0, 3), (3, 6), (6, 9)]


def test_a_candidate_that_fits_nowhere_is_named_with_the_program_s_tensors(pack):
    # Rows of 2^20 - 1 floats in one block fit no local memory, nor can the block be halved:
    # the refusal names the candidate, its kernels and the program's own tensors, not the
    # canonical names it was fused under.
    p = lower(load_program(ROOT / "examples" / "softmax.bbp",
                           {"r": (64, 16), "c": ((1 << 20) - 1, (1 << 20) - 1)}))
    with pytest.raises(NoCandidate, match=r"candidate 0 \(kernels 0-1\): .*kernel (M|E)\b"):
        fuse_candidates(p, select_candidates(p, 2), pack, TARGET)


def test_a_mask_from_positions_does_not_count_against_a_candidate():
    """A kernel that loads nothing is a leaf its readers inline: a causal block's mask makes
    it seven kernels, and candidates of six still keep the scores with their softmax."""
    block = attention_chain(1).replace(
        "S1[q, k] = sum[d] Q0[q, d] * K[k, d] * 0.125",
        "B[q, k] = where(k <= q, 0, -inf)\n"
        "S1[q, k] = (sum[d] Q0[q, d] * K[k, d] * 0.125) + B[q, k]")
    program = lower(parse_program(block))
    assert len(program.kernels) == 7
    assert [(c.start, c.stop) for c in select_candidates(program, 6)] == [(0, 7)]
    assert [(c.start, c.stop) for c in select_candidates(program, 5)] != [(0, 7)]


def cut_cost_by_definition(p, c: int) -> tuple[int, int]:
    """A cut before kernel c: (the reads through a view, by the kernels from c on, of a
    tensor stored before c; the bytes of the tensors stored before c and read from c on, twice
    for a temporary, written and read back, once for an output)."""
    if c in (0, len(p.kernels)):
        return 0, 0
    before = {t for k in p.kernels[:c] for t in k.tensors}
    reads = [(name, p.tensors[name].storage) for k in p.kernels[c:] for name in _loads(k)]
    crossing = {storage for _, storage in reads if storage in before}
    views = sum(p.tensors[name].role == "view" for name, storage in reads if storage in before)
    size = sum(math.prod(p.extent(a) for a in p.tensors[t].axes) * p.tensors[t].itemsize
               * (1 if t in p.outputs else 2) for t in crossing)
    return views, size


# A temporary read through a view past later kernels (cuts before C, D and Y each cross it),
# and an output read by the kernel after it.
VIEWED_TEMPORARY = CHAIN_WITH_A_VIEW.replace("output Y", "output B, Y")


@pytest.mark.parametrize("source", ["decoder_layer", "rope_qknorm_attention",
                                    "lm_head_cross_entropy", VIEWED_TEMPORARY])
def test_every_cut_costs_what_its_definition_says(source):
    """`_cut_costs` sums each read over the range of cuts it crosses, in one pass; the cut by
    cut definition it replaced took seconds on a program of 3,000 kernels."""
    p = lower(parse_program(source) if "\n" in source else
              load_program(ROOT / "examples" / f"{source}.bbp"))
    costs = _cut_costs(p, [_loads(k) for k in p.kernels])
    assert costs == [cut_cost_by_definition(p, c) for c in range(len(p.kernels) + 1)]
    if source == VIEWED_TEMPORARY:
        assert [views for views, _ in costs] == [0, 1, 2, 1, 1, 0]
