"""The GPU kit's dry run: `bbrules gpukit --quick` prepares a folder a bare GPU machine can run.

The GPU machine has torch, triton, cupy and numpy and nothing else, so everything the kit
ships must import only those and the standard library; its manifest must name files that
exist; the runner must start (`--help`) without any of them imported.
"""

from __future__ import annotations

import ast
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from bbrules.cli import main
from bbrules.frontend import parse_program
from bbrules.fuse import fuse
from bbrules.gpukit import TARGET, Case, cases, variants
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

ALLOWED = {"torch", "triton", "cupy", "numpy"} | set(sys.stdlib_module_names)


def imports(path: Path) -> set[str]:
    """Top-level packages a Python file imports, wherever the import statement is."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kit")
    assert main(["gpukit", str(folder), "--quick"]) == 0
    return folder


def test_the_kit_ships_a_runner_kernels_and_a_manifest(kit):
    manifest = json.loads((kit / "cases.json").read_text())
    assert [c["name"] for c in manifest["cases"]] == [c.name for c in cases(quick=True)]
    for case in manifest["cases"]:
        assert case["variants"], case["name"]
        for v in case["variants"]:
            assert (kit / v["triton"]).is_file()
            assert v["cuda"] is None or (kit / v["cuda"]).is_file()
            assert v["kernels"] >= 1 and v["modeled_time_s"] > 0


def test_everything_the_kit_ships_imports_only_what_the_gpu_machine_has(kit):
    files = [kit / "runner.py", *sorted((kit / "kernels").glob("*.py"))]
    assert len(files) > 1
    for f in files:
        extra = imports(f) - ALLOWED
        assert not extra, f"{f.name} imports {sorted(extra)}"
        compile(f.read_text(), str(f), "exec")


def test_the_runner_starts_without_torch(kit):
    proc = subprocess.run([sys.executable, str(kit / "runner.py"), "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--out" in proc.stdout and "--interpret" in proc.stdout


def test_kit_cases_are_programs_of_the_shapes_the_runner_compares():
    """The output shapes the runner's torch computations give: O[h, q, d], O[h, d], C[m, n]."""
    for case in cases() + [Case("rmsnorm_matmul", "bf16", width=256)]:
        p = lower(parse_program(case.source((64, 64)), f"<{case.name}>"))
        (out,) = p.outputs
        shape = tuple(p.extent(a) for a in p.tensors[out].axes)
        want = {"attention": (case.heads, case.queries, case.head_dim),
                "decode": (case.heads, case.head_dim)}.get(case.kind, (case.width,) * 2)
        assert shape == want, case.name
        assert {p.tensors[t].dtype for t in p.inputs} == {case.dtype}


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                    reason="Triton ships for Linux on x86-64 only")
def test_the_quick_kits_kernels_compile_for_the_gpu_without_spills():
    """What the kit ships, compiled offline for sm_90a: tensor cores wherever a `tl.dot` is,
    nothing in local memory, shared memory within the H200's 227 KiB."""
    from bbrules.codegen import triton_gen
    pack, target = load_packs([]), get_target(TARGET)
    for case in cases(quick=True):
        for blocks in variants(case):
            fused = fuse(lower(parse_program(case.source(blocks))), pack, target).program
            module = triton_gen.generate(fused, target, case.precision)
            compiled = triton_gen.compile_offline(module)
            for k in module.kernels:
                c = compiled[k.name]
                assert c.local_bytes == 0 and c.shared_bytes <= 227 * 1024, k.name
                assert (c.tensor_core > 0) == (k.dots > 0), k.name


def test_a_kit_is_never_written_over_a_folder_in_use(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep")
    assert main(["gpukit", str(tmp_path), "--quick"]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "keep"
    assert main(["gpukit", str(tmp_path / "mine.txt"), "--quick"]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def load_runner():
    import importlib.util
    path = Path(__file__).parent.parent / "codegen" / "gpu_runner.py"
    spec = importlib.util.spec_from_file_location("kit_runner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runner_writes_a_target_with_what_it_measured(tmp_path):
    """Copy bandwidth, exp2 rate and the matmul cases' TFLOP/s replace the kit target's
    figures; what the run did not measure (a case out of time) stays as the target has it."""
    from bbrules.gpukit import target_fields
    h200 = get_target(TARGET)
    manifest = {"target": TARGET, "target_file": target_fields(h200)}
    env = {"device": "cuda", "gpu": "NVIDIA H200", "triton": "3.6.0",
           "rates": {"copy_bytes_per_s": 4.2e12, "exp2_per_s": 3.7e12}}
    results = [{"name": "matmul-bf16-4096", "tflops": 640.0},
               {"name": "matmul-f32-tf32-4096", "skipped": "out of time"}]
    path = tmp_path / "target.toml"
    path.write_text(load_runner().measured_target(manifest, env, results))
    t = get_target(str(path))
    assert t.name == "h200-measured" and "NVIDIA H200" in t.doc
    assert (t.global_bandwidth, t.special_rate, t.peak_flops_f16) == (4.2e12, 3.7e12, 640e12)
    assert t.peak_flops_dot_f32 == h200.peak_flops_dot_f32
    assert (t.local_capacity, t.processors, t.peak_flops, t.launch_cost, t.resolution,
            t.block_granularity) == (h200.local_capacity, h200.processors, h200.peak_flops,
                                     h200.launch_cost, h200.resolution, h200.block_granularity)


def test_the_measured_h200_target_is_a_target():
    t = get_target(str(Path(__file__).parent.parent / "targets" / "h200-measured.toml"))
    assert "2026-12-04" in t.doc
    assert t.global_bandwidth < get_target(TARGET).global_bandwidth


def test_the_table_gives_call_and_graph_times_of_both_sides():
    """A case timed both ways shows both speed-ups; one whose graph could not be captured keeps
    its call figures and leaves the graph columns empty."""
    runner = load_runner()
    best = {"variant": "64x64", "configs": ["w4s3"], "kernels": 1, "modeled_s": 20e-6,
            "seconds": 100e-6, "graph_seconds": 40e-6, "error": 1e-3, "graph_error": 2e-3}
    graphed = {"name": "attention-bf16-bh1-n4096", "best": best, "torch_s": 80e-6,
               "torch_graph_s": 50e-6, "speedup": 0.8, "graph_speedup": 1.25, "tflops": 10.0,
               "gbps": 50.0, "ok": True}
    called = {k: v for k, v in graphed.items() if k not in ("graph_speedup", "torch_graph_s")}
    called.update(name="decode-f32-bh32-n4096",
                  best={k: v for k, v in best.items() if not k.startswith("graph")})
    lines = runner.table({"device": "cuda", "torch": "2", "triton": "3"},
                         [graphed, called]).splitlines()
    row = next(line for line in lines if line.startswith("| attention")).split(" | ")
    assert row[3:10] == ["100.0 us", "40.0 us", "20.0 us", "80.0 us", "50.0 us", "0.80x",
                         "1.25x"]
    assert row[-2] == "2.0e-03"  # the larger of the call's and the graph's errors
    row = next(line for line in lines if line.startswith("| decode")).split(" | ")
    assert row[3:10] == ["100.0 us", "", "20.0 us", "80.0 us", "", "0.80x", ""]


def test_f32_matmul_cases_also_step_through_the_contraction_32_wide():
    f32, bf16 = Case("matmul", "f32", width=256), Case("matmul", "bf16", width=256)
    assert (128, 128, 32) in variants(f32) and all(len(b) == 2 for b in variants(bf16))
    assert "dim e = 256 / 32" in f32.source((128, 128, 32))
    assert "dim e = 256 / 64" in bf16.source((128, 128))
    assert all(b != (128, 128) for b in variants(Case("attention", "f32", 1, 64, 64)))


def test_kit_cases_have_names_of_their_own():
    """A name is a case's files' stem: two cases of one name would overwrite each other."""
    more = [Case("matmul", "f32", width=4096, precision=p) for p in ("ieee", "tf32", "tf32x3")]
    names = [c.name for c in cases() + more[:1]]
    assert len(set(names)) == len(names)
    assert [c.name for c in more] == ["matmul-f32-ieee-4096", "matmul-f32-tf32-4096",
                                      "matmul-f32-4096"]
