"""The Python API: `bbrules.load`, `fuse`, `cost` and `compile`, and what they show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import bbrules
from bbrules import dense
from bbrules.cost import ProgramCost
from bbrules.errors import SourceError, UsageError
from bbrules.inputs import random_inputs

ROOT = Path(__file__).resolve().parent.parent
SOFTMAX = ROOT / "examples" / "softmax.bbp"
SMALL = {"r": (256, 64), "c": (256, 64)}


@pytest.fixture(scope="module")
def model() -> bbrules.Model:
    return bbrules.load(SOFTMAX, dims=SMALL)


@pytest.fixture(scope="module")
def fused(model) -> bbrules.Fusion:
    return bbrules.fuse(model)


def test_load_a_path_with_dims_in_each_form():
    for dims in (SMALL, {"r": "256/64", "c": "256/64"}, {"r": 256, "c": (256, 64)}):
        m = bbrules.load(str(SOFTMAX), dims=dims)
        assert m.program.dims["r"].extent == 256 and m.program.dims["r"].block == 64
        assert [k.name for k in m.program.kernels] == ["M", "E", "L", "Y"]
        assert m.ast is not None and m.ast.outputs == ("Y",)
    assert bbrules.load(SOFTMAX).program.dims["r"].extent == 4096


def test_load_text_is_loading_the_file(model):
    m = bbrules.load(SOFTMAX.read_text(), dims=SMALL)
    assert m.program == model.program and m.name == "<string>"
    assert m.ast.statements == model.ast.statements


def test_load_block_programs_as_files_and_as_text(fused, tmp_path):
    path = tmp_path / "softmax.bbk"
    path.write_text(fused.model.text)
    for m in (bbrules.load(path), bbrules.load(fused.model.text)):
        assert m.program == fused.program and m.ast is None


def test_fuse_drops_kernels_and_computes_the_same(model, fused):
    assert fused.baseline.n_kernels == 4 and fused.cost.n_kernels < 4
    assert fused.model.ast is model.ast  # the fused program keeps its reference
    inputs = random_inputs(model.ast, seed=3)
    want = dense.evaluate(model.ast, inputs, dtype=np.float64)["Y"]
    for backend in ("numpy", "interp"):
        got = bbrules.compile(fused, backend)(**inputs)
        assert set(got) == {"Y"} and got["Y"].shape == want.shape
        assert np.max(np.abs(got["Y"] - want)) <= 1e-5 * np.max(np.abs(want))


def test_cost_after_fusion_moves_fewer_bytes(model, fused):
    before, after = bbrules.cost(model), bbrules.cost(fused)
    assert isinstance(after, ProgramCost)
    assert after.traffic < before.traffic and after.n_kernels < before.n_kernels
    assert after.traffic == fused.cost.traffic and before.traffic == fused.baseline.traffic
    assert bbrules.cost(SOFTMAX, target="cpu").target.name == "cpu"


def test_explain_gives_rule_applications(fused):
    lines = fused.explain()
    assert lines and all(re.match(r"\S+\.bbr:\d+: \w+ in \w+, iteration \d+\n", s)
                         for s in lines)
    assert any("forward" in s for s in lines)  # loads of M, E and L replaced by their values


def test_reprs_show_the_program_and_its_costs(model, fused):
    assert repr(model) == (f"<bbrules.Model {SOFTMAX}: 4 kernels, X[256, 256] -> "
                           f"Y[256, 256]>")
    page = model._repr_html_()
    assert "<pre># bbrules block program" in page and "kernel M[r]:" in page
    assert "-&gt;" in page  # escaped
    assert len(re.findall(r"subgraph cluster_k\d+ ", model.dot())) == 4  # one per kernel

    n = fused.cost.n_kernels
    assert repr(fused).startswith(f"<bbrules.Fusion {SOFTMAX}: 4 -> {n} kernel")
    assert "traffic" in repr(fused) and repr(fused).endswith("on h100>")
    page = fused._repr_html_()
    assert "modeled time" in page and "saturation:" in page and "kernel Y[r, c]" in page

    table = repr(bbrules.cost(fused))
    assert table == fused.cost.table() and "compulsory" in table
    assert bbrules.cost(fused)._repr_html_().startswith("<pre>kernel")
    assert repr(bbrules.compile(model)) == ("<bbrules.Compiled numpy: X[256, 256] -> "
                                            "Y[256, 256]>")


def test_mistakes_in_programs_are_the_commands_errors(tmp_path, model):
    with pytest.raises(UsageError, match="no such file"):
        bbrules.load(tmp_path / "missing.bbp")
    (tmp_path / "model.txt").write_text("")
    with pytest.raises(UsageError, match="model.txt: expected a .bbp program"):
        bbrules.load(tmp_path / "model.txt")
    with pytest.raises(SourceError) as err:
        bbrules.load("dim r = 4\ninput X[r] : f32\nY[r] = X[q]\noutput Y\n")
    assert str(err.value).startswith("<string>:3:")
    with pytest.raises(UsageError, match="declares no dimension 'zz'"):
        bbrules.load(SOFTMAX, dims={"zz": 4})
    with pytest.raises(UsageError, match="bad dimension override"):
        bbrules.load(SOFTMAX, dims={"r": (0, 64)})
    with pytest.raises(UsageError, match="dimensions are fixed"):
        bbrules.load(model.text, dims=SMALL)
    with pytest.raises(TypeError, match="expected a program"):
        bbrules.cost(42)


def test_mistakes_in_options_are_usage_errors(tmp_path, model):
    for options, message in (({"objective": "speed"}, "unknown objective"),
                             ({"target": "tpu"}, "unknown target"),
                             ({"seconds": 0}, "seconds must be"),
                             ({"nodes": 0}, "nodes must be"),
                             ({"rules": tmp_path}, "no .bbr files")):
        with pytest.raises(UsageError, match=message):
            bbrules.fuse(model, **options)
    with pytest.raises(UsageError, match="unknown backend 'jax': one of interp, numpy, cuda"):
        bbrules.compile(model, "jax")


def test_a_compiled_program_checks_its_inputs(model, monkeypatch):
    run = bbrules.compile(model, "interp")
    x = np.zeros((256, 256), np.float32)
    with pytest.raises(UsageError, match=r"takes inputs X\[256, 256\]; missing X"):
        run()
    with pytest.raises(UsageError, match="no input named Z"):
        run(X=x, Z=x)
    with pytest.raises(UsageError, match=r"input X has shape \(256, 255\)"):
        run(X=x[:, 1:])
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails: no GPU here
    with pytest.raises(UsageError, match="needs CuPy and a GPU"):
        bbrules.compile(model, "cuda")(X=x)


def test_inputs_the_model_holds_need_not_be_given():
    m = bbrules.load("dim m = 8 / 4\ndim n = 4\ninput X[m, n], W[n] : f32\n"
                     "Y[m] = sum[n] X[m, n] * W[n]\noutput Y\n")
    w = np.arange(4, dtype=np.float32)
    run = bbrules.compile(bbrules.Model(m.program, replace(m.ast, values={"W": w})))
    assert repr(run) == "<bbrules.Compiled numpy: X[8, 4] -> Y[8]>"
    x = np.ones((8, 4), np.float32)
    assert np.array_equal(run(X=x)["Y"], np.full(8, 6.0))
    assert np.array_equal(run(X=x, W=2 * w)["Y"], np.full(8, 12.0))  # a given value wins


def test_the_api_keeps_its_names_when_submodules_are_imported_later():
    """`bbrules.fuse` and `bbrules.cost` are also submodules; importing them first after the
    package must not replace the functions."""
    code = ("import bbrules, bbrules.fuse, bbrules.cost\n"
            "from bbrules.fuse import FuseResult\n"
            "print(callable(bbrules.fuse), callable(bbrules.cost), FuseResult.__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, check=True)
    assert done.stdout == "True True FuseResult\n"


def test_the_readme_example_runs(monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), {})
    assert "4 -> 1 kernels" in capsys.readouterr().out


def test_a_script_without_a_main_guard_fuses_by_candidates_in_workers(tmp_path):
    """Candidates are fused in worker processes that import bbrules, not the caller's script:
    spawned by multiprocessing, each re-ran the script's top level (printing twice more here)
    and failed in its call of `fuse` (BrokenProcessPool in the caller)."""
    script = tmp_path / "fuse_it.py"
    script.write_text(
        "import os, bbrules\n"
        "print('top level')\n"
        f"f = bbrules.fuse({str(ROOT / 'examples' / 'rmsnorm_ffn_swiglu.bbp')!r}, "
        "candidates=2, seconds=20)\n"
        "print(f.result.workers, len(f.result.candidates), len(f.model.program.kernels))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    top, counts = done.stdout.splitlines()
    workers, candidates, kernels = map(int, counts.split())
    assert top == "top level" and candidates == 3 and kernels < 6
    assert workers == min(2, os.cpu_count() or 1)


def test_an_imported_model_is_called_with_its_own_names_and_shapes(tmp_path):
    """As onnxruntime runs it: inputs and outputs by the model's names (not identifiers) in
    its shapes (with the unit dimensions the program drops), unfused and fused alike."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator
    w = np.random.default_rng(2).standard_normal((16, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input.1", "w"], ["logits"]),
         helper.make_node("Softmax", ["logits"], ["probs.0"], axis=-1)], "g",
        [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 8, 16])],
        [helper.make_tensor_value_info("probs.0", TensorProto.FLOAT, [1, 8, 4])],
        [numpy_helper.from_array(w, "w")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    x = np.random.default_rng(3).standard_normal((1, 8, 16)).astype(np.float32)
    want = ReferenceEvaluator(str(path)).run(None, {"input.1": x})[0]
    for program in (path, bbrules.fuse(path)):
        run = bbrules.compile(program)
        assert repr(run) == "<bbrules.Compiled numpy: input.1[1, 8, 16] -> probs.0[1, 8, 4]>"
        got = run(**{"input.1": x})
        assert list(got) == ["probs.0"] and got["probs.0"].shape == (1, 8, 4)
        np.testing.assert_allclose(got["probs.0"], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(UsageError, match=r"input input.1 has shape \(8, 16\), the model takes "
                                         r"\(1, 8, 16\)"):
        run(**{"input.1": x[0]})
    with pytest.raises(UsageError, match=r"takes inputs input.1\[1, 8, 16\]; missing input.1; "
                                         r"no input named input_1"):
        run(input_1=x)
