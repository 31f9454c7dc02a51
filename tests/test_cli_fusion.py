"""The CLI's fusion and code-generation commands: apply, codegen, run --backend, check, packs."""

import json
import re
from pathlib import Path

import pytest

from bbrules import extract
from bbrules.blockfile import load_block_program
from bbrules.cli import main
from bbrules.cost import fmt_bytes
from bbrules.targets import get_target

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = str(ROOT / "examples" / "attention.bbp")
SMALL = ["--dim", "q=256/64", "--dim", "k=256/64"]


def test_apply_fuses_attention_into_one_kernel_and_reports_both_sides(capsys):
    assert main(["apply", ATTENTION, *SMALL]) == 0
    out = capsys.readouterr().out
    kernels = next(line for line in out.splitlines() if line.startswith("kernels"))
    assert kernels.split()[1:] == ["6", "1"]
    assert "compulsory traffic" in out and "saturation:" in out and "extraction:" in out


def test_apply_writes_a_block_program_that_show_cost_and_run_read_back(tmp_path, capsys):
    out = tmp_path / "flash.bbk"
    assert main(["apply", ATTENTION, *SMALL, "-o", str(out)]) == 0
    fused = load_block_program(out)
    assert [k.tensor for k in fused.program.stores] == ["O"]
    assert fused.source is not None
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert "kernel O[q, d]" in capsys.readouterr().out  # one kernel, maybe of its own blocks
    assert main(["cost", str(out), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["kernels"]) == 1
    assert main(["run", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compared"] and report["ok"]


def test_apply_json_and_explain(capsys):
    assert main(["apply", ATTENTION, *SMALL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["after"]["traffic"] < report["before"]["traffic"]
    assert report["stop"] in ("saturated", "iteration limit", "node limit", "time limit")
    # each kernel's block sizes, its own where it chose them
    assert report["before"]["kernels"][0]["blocks"] == {"q": 64, "k": 64, "d": 64}
    (fused,) = report["after"]["kernels"]
    assert set(fused["blocks"]) == {"q", "k", "d"} and fused["blocks"]["k"] == 64
    assert main(["apply", ATTENTION, *SMALL, "--explain"]) == 0
    assert "forward" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--max-kernels", "0"], "at least 1"),
    (["--rules", "no/such/dir"], "not a rule pack directory"),
    (["--target", "no-such-target"], "no-such-target"),
])
def test_apply_usage_mistakes_exit_2(args, message, capsys):
    assert main(["apply", ATTENTION, *SMALL, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("backend", ["interp", "numpy"])
@pytest.mark.parametrize("fuse", [[], ["--no-fuse"]])
def test_run_backends_agree_with_the_dense_evaluation(backend, fuse, capsys):
    assert main(["run", ATTENTION, *SMALL, "--backend", backend, *fuse, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == backend and report["ok"]


def test_codegen_writes_numpy_and_cuda_sources(tmp_path, capsys):
    py = tmp_path / "attention.py"
    assert main(["codegen", ATTENTION, *SMALL, "--backend", "numpy", "-o", str(py)]) == 0
    assert "def run(" in py.read_text()
    assert main(["codegen", ATTENTION, *SMALL, "--backend", "cuda"]) == 0
    assert "__global__" in capsys.readouterr().out


def test_packs_lists_the_standard_pack(capsys):
    assert main(["packs", "--json"]) == 0
    packs = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert packs["standard"]["rules"] > 0 and packs["standard"]["checks"] > 0


def test_check_catches_an_unsound_pack_with_a_counterexample(capsys):
    assert main(["check", str(ROOT / "tests" / "packs" / "unsound")]) == 1
    out = capsys.readouterr().out
    assert "exp_of_sum" in out and "sides differ" in out


def test_check_runs_a_pack_on_top_of_the_standard_pack(capsys):
    # The pack joins the standard `fuse` stage; only its own rules and checks are run.
    assert main(["check", "--json", str(ROOT / "tests" / "packs" / "neg_sub")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["rules"], report["checks"]) == (1, 3)
    assert report["check_failures"] == [] and report["unsound"] == []
    assert main(["check", "--no-installed", str(ROOT / "tests" / "packs" / "neg_sub")]) == 2
    assert "names unknown stage 'fuse'" in capsys.readouterr().err


def test_check_passes_on_the_standard_pack(capsys):
    assert main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rules"] > 20 and report["checks"] >= report["rules"]
    assert report["check_failures"] == [] and report["unsound"] == []


@pytest.mark.parametrize("extra", [[], ["--json"], ["--target", "cpu"]])
def test_apply_refuses_when_no_legal_program_exists(extra, tmp_path, capsys):
    """A row of 2^20 - 1 floats in one block fits no target's local memory, fused or not, nor
    can the block be halved: apply says so, naming the kernel, its footprint and the capacity,
    and writes nothing."""
    out = tmp_path / "x.bbk"
    argv = ["apply", str(ROOT / "examples" / "softmax.bbp"), "--dim", "r=64/16",
            "--dim", "c=1048575/1048575", "-o", str(out), *extra]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    assert "no legal program was found" in captured.err
    assert "needs 128.00 MiB of local memory" in captured.err
    target = get_target(extra[1] if extra[:1] == ["--target"] else "h100")
    assert f"{target.name} has {fmt_bytes(target.local_capacity)}" in captured.err
    assert "inf" not in captured.err and "nan" not in captured.err


def test_apply_tiles_a_program_blocked_too_coarsely_until_it_fits(tmp_path, capsys):
    """Rows of 65,536 floats in blocks of 16 rows do not fit the cpu target's 512 KiB, but
    halved blocks do (of columns, or rows down to one): apply says the input does not fit,
    writes a program in finer blocks, and that program runs right."""
    out = tmp_path / "x.bbk"
    assert main(["apply", str(ROOT / "examples" / "softmax.bbp"), "--dim", "r=64/16",
                 "--dim", "c=65536/65536", "--target", "cpu", "-o", str(out)]) == 0
    assert "the input does not fit local memory" in capsys.readouterr().out
    assert re.search(r"with (c / (?!65536\b)\d+|r / [1248]\b)", out.read_text())
    assert main(["run", str(out)]) == 0
    assert ": ok" in capsys.readouterr().out


def test_apply_reports_progress_when_asked_and_never_with_json(monkeypatch, capsys):
    monkeypatch.setattr(extract, "PROGRESS_EVERY", 0.0)  # report at every candidate
    assert main(["apply", ATTENTION, *SMALL]) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    assert main(["apply", ATTENTION, *SMALL, "--progress"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert "  .. stage fuse: iteration 1" in lines and "  .. extracting" in lines
    built = [int(line.split()[2]) for line in lines if line.startswith("  .. extraction: ")]
    assert built and built == sorted(built) and len(set(built)) == len(built)
    assert "extraction:" in captured.out and "  .. " not in captured.out
    assert main(["apply", ATTENTION, *SMALL, "--progress", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out)["extraction"]
