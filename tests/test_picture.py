"""Pictures of block programs: `bbrules show --dot / --svg` and `bbrules.picture`.

The DOT text is read back with regular expressions over the lines `picture.to_dot` writes: a
kernel is a top-level `subgraph cluster_kN`, a global tensor a node `"tensor NAME"`, and an
edge a line `"A" -> "B"`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bbrules import picture
from bbrules.cli import load_any, main
from bbrules.frontend import parse_program
from bbrules.lower import lower

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = ROOT / "examples" / "attention.bbp"
SMALL = ("--dim", "q=128/64", "--dim", "k=128/64")

KERNEL = re.compile(r"^  subgraph cluster_k\d+ \{$", re.M)
TENSOR = re.compile(r'^  "tensor (\w+)" \[', re.M)
EDGE = re.compile(r'^  "([^"]+)" -> "([^"]+)"', re.M)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def fused_bbk(tmp_path_factory) -> Path:
    """Attention fused by `bbrules apply` at a small size, as a .bbk file."""
    out = tmp_path_factory.mktemp("picture") / "attention.bbk"
    assert main(["apply", str(ATTENTION), *SMALL, "-o", str(out)]) == 0
    return out


def assert_connected(dot: str) -> None:
    """Every tensor has an edge; inputs are read by a load, outputs written by a store."""
    edges = EDGE.findall(dot)
    for name in TENSOR.findall(dot):
        node = f"tensor {name}"
        assert any(node in edge for edge in edges), f"{name} has no edge"
    for name in ("Q", "K", "V"):
        assert any(a == f"tensor {name}" and "load" in b for a, b in edges)
    assert any("store O" in a and b == "tensor O" for a, b in edges)


def test_unfused_attention_is_one_cluster_per_kernel(capsys):
    status, dot, _ = run_cli(capsys, "show", ATTENTION, *SMALL, "--dot")
    assert status == 0
    assert len(KERNEL.findall(dot)) == 6
    assert TENSOR.findall(dot) == ["Q", "K", "V", "S", "M", "E", "L", "P", "O"]
    assert dot.count("shape=house") == 6  # one store per kernel
    assert 'label="load S[q, k]"' in dot and 'label="store S[q, k]"' in dot
    # the row maximum walks the two key blocks carrying a max; the scores go through memory
    assert "loop over k: 2 blocks\\ncarries max" in dot
    assert '"k1 store S" -> "tensor S"' in dot and '"tensor S" -> "k2 load 1"' in dot
    assert_connected(dot)


def test_fused_attention_has_fewer_clusters_and_keeps_scores_local(fused_bbk, capsys):
    status, dot, _ = run_cli(capsys, "show", fused_bbk, "--dot")
    assert status == 0
    kernels = len(load_any(str(fused_bbk), {})[1].kernels)
    assert len(KERNEL.findall(dot)) == kernels < 6
    assert not {"S", "E", "P"} & set(TENSOR.findall(dot))
    assert "carries softmax" in dot  # the online-softmax state of Flash Attention's loop
    assert_connected(dot)


def test_show_fuse_pictures_the_fused_program(capsys):
    softmax = ROOT / "examples" / "softmax.bbp"
    dims = ("--dim", "r=256/64", "--dim", "c=256/64")
    _, before, _ = run_cli(capsys, "show", softmax, *dims, "--dot")
    status, after, _ = run_cli(capsys, "show", softmax, *dims, "--dot", "--fuse")
    assert status == 0
    assert len(KERNEL.findall(before)) == 4 and len(KERNEL.findall(after)) == 1
    assert TENSOR.findall(before) == ["X", "M", "E", "L", "Y"]
    assert TENSOR.findall(after) == ["X", "Y"]  # M, E and L no longer go through memory


def test_a_loop_that_skips_blocks_says_where():
    program = lower(parse_program("dim q = 256 / 64\ndim k = 256 / 64\ninput X[q, k] : f32\n"
                                  "M[q] = max[k] where(k <= q, X[q, k], -inf)\noutput M\n"))
    dot = picture.to_dot(program)
    assert "loop over k: 4 blocks\\ncarries max\\nvisits blocks where le(pos(k), pos(q))" in dot


def test_dot_is_the_same_in_every_process(tmp_path):
    """No set or hash order leaks into the picture."""
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "bbrules", "show", str(ATTENTION), "--dot"],
                              capture_output=True, text=True, env=env, cwd=ROOT, check=True)
        outs.append(done.stdout)
    assert outs[0] == outs[1]


def test_labels_and_names_are_escaped():
    assert picture.quote('a "b" \\ c\nd') == '"a \\"b\\" \\\\ c\\nd"'
    program = load_any(str(ATTENTION), {})[1]
    dot = picture.to_dot(program, 'dir "x"\\attention.bbp')
    assert 'graph [label="dir \\"x\\"\\\\attention.bbp"' in dot


def test_dot_and_svg_are_written_to_a_file(tmp_path, capsys, monkeypatch):
    _, printed, _ = run_cli(capsys, "show", ATTENTION, "--dot")
    status, out, err = run_cli(capsys, "show", ATTENTION, "--dot", "-o", tmp_path / "a.dot")
    assert status == 0 and out == "" and "wrote" in err
    assert (tmp_path / "a.dot").read_text() == printed

    fed: list[str] = []

    def fake_dot(argv, input, **kw):  # Graphviz's dot, as the picture module runs it
        fed.append(input)
        return subprocess.CompletedProcess(argv, 0, "<svg>picture</svg>\n", "")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/dot" if name == "dot" else None)
    monkeypatch.setattr(subprocess, "run", fake_dot)
    status, _, _ = run_cli(capsys, "show", ATTENTION, "--svg", "-o", tmp_path / "a.svg")
    assert status == 0
    assert fed == [printed] and (tmp_path / "a.svg").read_text() == "<svg>picture</svg>\n"


def test_svg_without_graphviz_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr("bbrules.cli._fuse", lambda *a: pytest.fail("fused before checking"))
    status, out, err = run_cli(capsys, "show", ATTENTION, "--svg", "--fuse")
    assert status == 2 and out == ""
    assert "Graphviz" in err and "--dot" in err and "Traceback" not in err


def test_graphviz_failing_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/dot")
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(
        argv, 1, "", "Error: syntax error in line 1"))
    status, _, err = run_cli(capsys, "show", ATTENTION, "--svg")
    assert status == 2 and "dot failed (exit 1): Error: syntax error in line 1" in err


def test_dot_and_svg_exclude_each_other(capsys):
    status, _, err = run_cli(capsys, "show", ATTENTION, "--dot", "--svg")
    assert status == 2 and "not allowed with" in err


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_svg_from_graphviz(fused_bbk, capsys):
    status, svg, _ = run_cli(capsys, "show", fused_bbk, "--svg")
    assert status == 0 and "<svg" in svg and "kernel 1: O" in svg
