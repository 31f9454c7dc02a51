"""The command line: exit statuses, error reporting, and what show / cost / run print."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bbrules import dense
from bbrules.blockfile import parse_block_program
from bbrules.cli import main
from bbrules.frontend import parse_program
from bbrules.inputs import random_inputs
from bbrules.ir import show_program
from bbrules.lower import lower

ATTENTION = """\
dim q = 32 / 8
dim k = 48 / 16
dim d = 8

input Q[q, d], K[k, d], V[k, d] : f32

S[q, k] = sum[d] Q[q, d] * K[k, d] * 0.125
M[q]    = max[k] S[q, k]
E[q, k] = exp(S[q, k] - M[q])
L[q]    = sum[k] E[q, k]
P[q, k] = E[q, k] / L[q]
O[q, d] = sum[k] P[q, k] * V[k, d]

output O
"""

SCALE = """\
dim m = 16 / 4
dim n = 8 / 4
input A[m, n] : f32
B[m, n] = A[m, n] * {factor}
output B
"""

MALFORMED = """\
dim m = 16 / 4
input A[m] : f32
B[m] = A[m] + C[m]
output B
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def bbk(tmp_path: Path, name: str, program_text: str, source: str | None) -> Path:
    """A block file holding the lowering of `program_text`, recording `source` (or nothing)."""
    block = lower(parse_program(program_text, "<test>"))
    return write(tmp_path, name, show_program(block, source=source))


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_show_prints_the_unfused_lowering_which_reads_back(tmp_path, capsys):
    path = write(tmp_path, "attention.bbp", ATTENTION)
    status, out, _ = run_cli(capsys, "show", path)
    assert status == 0
    for tensor in "SMELPO":
        assert f"kernel {tensor}[" in out
    assert parse_block_program(out).program == lower(parse_program(ATTENTION, "<test>"))


def test_show_applies_dim_overrides(tmp_path, capsys):
    path = write(tmp_path, "attention.bbp", ATTENTION)
    status, out, _ = run_cli(capsys, "show", path, "--dim", "q=64/16", "--dim", "k=16/16")
    assert status == 0
    assert "dim q = 64 / 16" in out and "dim k = 16 / 16" in out


def test_show_reads_block_files(tmp_path, capsys):
    path = bbk(tmp_path, "scale.bbk", SCALE.format(factor=2.0), source=None)
    status, out, _ = run_cli(capsys, "show", path)
    assert status == 0
    assert "B[m, n] = load(A[m, n]) * 2.0" in out


def test_run_compares_with_the_dense_evaluator(tmp_path, capsys):
    path = write(tmp_path, "attention.bbp", ATTENTION)
    status, out, _ = run_cli(capsys, "run", path, "--seed", "3")
    assert status == 0
    assert out.startswith("O: norm-wise error") and ": ok" in out
    assert "interp time" in out


def test_run_json_reports_each_output(tmp_path, capsys):
    path = write(tmp_path, "attention.bbp", ATTENTION)
    status, out, _ = run_cli(capsys, "run", path, "--json", "--dim", "k=32/16")
    report = json.loads(out)
    assert status == 0 and report["ok"] and report["compared"]
    assert set(report["outputs"]) == {"O"}
    o = report["outputs"]["O"]
    assert o["error"] <= o["tolerance"] and o["mismatched_nonfinite"] == 0


def test_run_block_file_against_its_recorded_source(tmp_path, capsys):
    write(tmp_path, "scale2.bbp", SCALE.format(factor=2.0))
    good = bbk(tmp_path, "good.bbk", SCALE.format(factor=2.0), source="scale2.bbp")
    wrong = bbk(tmp_path, "wrong.bbk", SCALE.format(factor=3.0), source="scale2.bbp")
    assert run_cli(capsys, "run", good)[0] == 0
    status, out, _ = run_cli(capsys, "run", wrong)
    assert status == 1
    assert "B: norm-wise error" in out and "FAILED" in out


def test_block_file_source_is_evaluated_at_the_block_programs_dimensions(tmp_path, capsys):
    write(tmp_path, "attention.bbp", ATTENTION)
    block = lower(parse_program(ATTENTION, "<test>", dims={"q": (16, 8), "k": (32, 16)}))
    path = write(tmp_path, "small.bbk", show_program(block, source="attention.bbp"))
    status, out, _ = run_cli(capsys, "run", path, "--json")
    assert status == 0 and json.loads(out)["compared"]


def test_run_block_file_without_source_prints_checksums(tmp_path, capsys):
    text = SCALE.format(factor=2.0)
    path = bbk(tmp_path, "scale.bbk", text, source=None)
    status, out, _ = run_cli(capsys, "run", path, "--json", "--seed", "5")
    report = json.loads(out)
    assert status == 0 and not report["compared"]
    assert "nothing was compared" in report["note"]
    ast = parse_program(text, "<test>")
    want = dense.evaluate(ast, random_inputs(lower(ast), seed=5))["B"]
    np.testing.assert_allclose(report["outputs"]["B"]["sum"], want.sum(), rtol=1e-5)
    np.testing.assert_allclose(report["outputs"]["B"]["abs_sum"], np.abs(want).sum(), rtol=1e-5)


def test_run_profile_times_each_kernel_of_the_numpy_code(tmp_path, capsys):
    path = write(tmp_path, "attention.bbp", ATTENTION)
    status, out, _ = run_cli(capsys, "run", path, "--no-fuse", "--backend", "numpy",
                             "--profile", "3", "--target", "cpu", "--json")
    report = json.loads(out)
    assert status == 0 and report["ok"]
    profile = report["profile"]
    assert profile["runs"] == 3 and profile["target"] == "cpu"
    assert [k["tensors"] for k in profile["kernels"]] == [[t] for t in "SMELPO"]
    assert all(0 < k["seconds"] <= profile["seconds"] and k["modeled_seconds"] > 0
               for k in profile["kernels"])


def test_run_profile_prints_a_table_after_the_comparison(tmp_path, capsys):
    path = bbk(tmp_path, "scale.bbk", SCALE.format(factor=2.0), source=None)
    status, out, _ = run_cli(capsys, "run", path, "--backend", "numpy", "--profile", "2")
    assert status == 0
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("kernel "))
    assert "note: " in "\n".join(lines[:head]) and "modeled (h100)" in lines[head]
    assert lines[head + 2].startswith("B ") and lines[-1].startswith("whole run ")


def test_run_profile_needs_the_numpy_backend(tmp_path, capsys):
    path = write(tmp_path, "attention.bbp", ATTENTION)
    status, _, err = run_cli(capsys, "run", path, "--profile", "2")
    assert status == 2 and "--profile times the kernels of the generated numpy code" in err
    status, _, err = run_cli(capsys, "run", path, "--backend", "numpy", "--profile", "0")
    assert status == 2 and "must be at least 1" in err


def test_cost_prints_a_table_and_json(tmp_path, capsys):
    path = write(tmp_path, "attention.bbp", ATTENTION)
    status, table, _ = run_cli(capsys, "cost", path)
    assert status == 0 and table.strip()
    status, out, _ = run_cli(capsys, "cost", path, "--json", "--target", "h100")
    assert status == 0
    assert isinstance(json.loads(out), dict)


def test_malformed_program_reports_position_and_caret(tmp_path, capsys):
    path = write(tmp_path, "bad.bbp", MALFORMED)
    status, out, err = run_cli(capsys, "run", path)
    assert status == 2 and out == ""
    assert f"{path}:3:" in err and "^" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["show", "{tmp}/missing.bbp"], "no such file"),
    (["show", "{tmp}/scale.txt"], "expected a .bbp program, a .bbk block program or an .onnx model"),
    (["run", "{tmp}/scale.bbk", "--dim", "m=8/4"], "--dim applies to .bbp programs"),
    (["show", "{tmp}/scale.bbp", "--dim", "m=abc"], "bad dimension override 'm=abc'"),
    (["cost", "{tmp}/scale.bbp", "--target", "nope"], "unknown target 'nope'"),
    (["run", "{tmp}/other.bbk"], "output B is not defined with the same shape"),
    (["frobnicate"], "invalid choice"),
    (["show"], "required"),
])
def test_usage_mistakes_exit_2_without_traceback(tmp_path, capsys, argv, message):
    write(tmp_path, "scale.txt", SCALE.format(factor=2.0))
    write(tmp_path, "scale.bbp", SCALE.format(factor=2.0))
    write(tmp_path, "other.bbp", SCALE.format(factor=2.0).replace("B", "C"))
    bbk(tmp_path, "other.bbk", SCALE.format(factor=2.0), source="other.bbp")
    bbk(tmp_path, "scale.bbk", SCALE.format(factor=2.0), source=None)
    status, _, err = run_cli(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert status == 2
    assert message in err and "Traceback" not in err


def test_python_dash_m_entry_point(tmp_path):
    bad = write(tmp_path, "bad.bbp", MALFORMED)
    good = write(tmp_path, "scale.bbp", SCALE.format(factor=2.0))
    done = subprocess.run([sys.executable, "-m", "bbrules", "run", str(bad)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    assert f"{bad}:3:" in done.stderr and "^" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "bbrules", "run", str(good), "--json"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)["ok"]
