"""Targets: the built-in figures, and user target files in TOML with their mistakes reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from bbrules.errors import SourceError, UsageError
from bbrules.targets import BUILTIN_TARGETS, Target, get_target

REPO = Path(__file__).resolve().parent.parent

VALID = """\
# a made-up accelerator
name = "toy"
doc = "for tests"
global_bandwidth = 2000     # GB/s
local_capacity = 100        # KiB
processors = 10
peak_flops = 1.5            # TFLOP/s
peak_flops_f16 = 30         # TFLOP/s
launch_cost = 2.5           # µs
"""


def write(tmp_path: Path, text: str, name: str = "t.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_builtin_figures_are_in_si_units():
    h100, h200, cpu = get_target("h100"), get_target("h200"), get_target("cpu")
    assert (h100.global_bandwidth, h100.local_capacity, h100.processors) == \
           (3.35e12, 227 * 1024, 132)
    assert (h100.peak_flops, h100.peak_flops_f16, h100.launch_cost) == (67e12, 990e12, 4e-6)
    assert h200.global_bandwidth == 4.8e12
    assert (h200.local_capacity, h200.processors, h200.peak_flops) == \
           (h100.local_capacity, h100.processors, h100.peak_flops)
    # measured by benchmarks/measure_cpu_target.py (see the target's doc)
    assert (cpu.global_bandwidth, cpu.local_capacity, cpu.processors) == (17.7e9, 512 << 10, 2)
    assert (cpu.peak_flops, cpu.peak_flops_dot_f32, cpu.launch_cost) == (6.46e9, 59.7e9, 1.8e-6)
    assert "measure_cpu_target.py" in cpu.doc
    assert all(t.doc for t in BUILTIN_TARGETS.values())


def test_builtin_names_are_case_insensitive():
    assert get_target("H100") is get_target("h100")


def test_unknown_name_lists_the_builtins():
    with pytest.raises(UsageError, match="unknown target 'tpu'.*h100, h200, cpu"):
        get_target("tpu")


def test_toml_file_converts_its_units(tmp_path):
    t = get_target(write(tmp_path, VALID))
    assert t == Target("toy", 2e12, 100 * 1024, 10, 1.5e12, 30e12, 2.5e-6, "for tests")


def test_toml_name_defaults_to_the_file_stem(tmp_path):
    text = "\n".join(line for line in VALID.splitlines() if not line.startswith("name"))
    assert get_target(write(tmp_path, text, "mygpu.toml")).name == "mygpu"


def test_shipped_example_target_loads():
    a100 = get_target(str(REPO / "targets" / "a100.toml"))
    assert (a100.name, a100.processors, a100.global_bandwidth) == ("a100", 108, 2039e9)
    assert a100.local_capacity == 163 * 1024


def test_missing_target_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read target file"):
        get_target(str(tmp_path / "absent.toml"))


def error_for(tmp_path: Path, text: str) -> SourceError:
    path = write(tmp_path, text)
    with pytest.raises(SourceError) as info:
        get_target(path)
    assert info.value.span.path == path
    return info.value


@pytest.mark.parametrize("old, new, line, col, message", [
    ("processors = 10", "processors = ", 6, 14, "invalid TOML: Invalid value"),
    ("name = \"toy\"", "name = \"toy", 2, 12, "invalid TOML: Illegal character"),
    ("launch_cost = 2.5           # µs", "launch_cost = [2.5,", 9, 20, "invalid TOML"),
    ("processors = 10", "processors = 10.5", 6, 1, "'processors' must be an integer"),
    ("peak_flops = 1.5", "peak_flops = \"fast\"", 7, 1, "'peak_flops' must be a number"),
    ("peak_flops = 1.5", "peak_flops = true", 7, 1, "'peak_flops' must be a number"),
    ("local_capacity = 100", "local_capacity = 0", 5, 1, "'local_capacity' must be positive"),
    ("global_bandwidth = 2000", "global_bandwith = 2000", 4, 1,
     "unknown target field 'global_bandwith'"),
    ("peak_flops_f16 = 30", "", 1, 1, "target file lacks peak_flops_f16"),
    ("doc = \"for tests\"", "doc = 3", 3, 1, "'doc' must be a string"),
])
def test_malformed_target_files_point_at_the_mistake(tmp_path, old, new, line, col, message):
    assert old in VALID
    err = error_for(tmp_path, VALID.replace(old, new))
    assert (err.span.line, err.span.column) == (line, col)
    assert err.message.startswith(message)
    shown = str(err)
    assert shown.startswith(f"{err.span}: error: {message}")
    if new:
        assert new.strip() in shown  # the offending line is quoted under the message
