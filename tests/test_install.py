"""The installed `bbrules` works from any directory: grammars, rule pack and code generators
travel with the package (CI installs it non-editable into a fresh virtual environment)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "attention.bbp"


def _bbrules() -> str:
    script = Path(sys.executable).with_name("bbrules")
    found = str(script) if script.exists() else shutil.which("bbrules")
    if found is None:
        pytest.skip("the bbrules console script is not installed beside this Python")
    return found


def _run(cwd: Path, *args: str) -> str:
    done = subprocess.run([_bbrules(), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_console_script_runs_the_whole_pipeline_from_another_directory(tmp_path):
    small = ["--dim", "q=128/64", "--dim", "k=128/64"]
    packs = json.loads(_run(tmp_path, "packs", "--json"))
    assert packs[0]["name"] == "standard" and packs[0]["rules"] > 0
    report = json.loads(_run(tmp_path, "apply", str(EXAMPLE), *small, "--json",
                             "-o", "flash.bbk"))
    assert len(report["after"]["kernels"]) == 1
    assert json.loads(_run(tmp_path, "run", "flash.bbk", "--backend", "numpy", "--json"))["ok"]
    assert "__global__" in _run(tmp_path, "codegen", "flash.bbk", "--backend", "cuda")
