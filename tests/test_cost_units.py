"""Work priced by the unit that does it, the target fields for it, the tie resolution, and the
runner-up that `apply` reports.  Expected figures are closed forms, derived in the comments."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from bbrules.cli import main
from bbrules.cost import KernelCost, ProgramCost, Work, cost_program, fmt_time
from bbrules.errors import SourceError
from bbrules.frontend import parse_program
from bbrules.fuse import fuse
from bbrules.ir import Load, Store, Unary
from bbrules.lower import lower
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.targets import Target, get_target
from irbuild import matmul, program

REPO = Path(__file__).resolve().parent.parent
H100 = get_target("h100")


def machine(resolution: float = 0.0) -> Target:
    """Bandwidth so high that every kernel here is compute-bound; one processor, no launch
    cost; each unit at a rate of its own, so a time tells which unit was charged."""
    return Target("units", 1e18, 1 << 30, 1, 1e9, 8e9, 0.0, "", 4e9, 2e8, resolution)


def unary(op: str, extent: int = 1024) -> ProgramCost:
    p = program({"m": (extent, 64)}, {"X": ("m",)},
                [Store("Y", ("m",), Unary(op, Load("X", ("m",))))])
    return cost_program(p, machine())


def test_gpu_targets_state_their_unit_rates():
    for t in (H100, get_target("h200")):
        assert (t.peak_flops, t.peak_flops_f16, t.peak_flops_dot_f32) == (67e12, 990e12, 495e12)
        # 16 special-function evaluations per SM per clock, 132 SMs at 1.98 GHz
        assert t.special_rate == pytest.approx(16 * 132 * 1.98e9, rel=0.01)
        assert t.resolution == 0.03


def test_exp_is_one_special_function_evaluation_per_element():
    (k,) = unary("exp").kernels
    assert k.work == Work(special=1024) and k.flops == 1024
    assert k.time == pytest.approx(1024 / 2e8, rel=1e-12)


def test_sigmoid_is_one_exp_and_three_vector_flops():
    (k,) = unary("sigmoid").kernels  # 1 / (1 + exp(-x)): neg, add and div on the vector units
    assert k.work == Work(vector=3 * 1024, special=1024) and k.flops == 4 * 1024
    assert k.time == pytest.approx(3 * 1024 / 1e9 + 1024 / 2e8, rel=1e-12)


def test_abs_is_vector_work():
    (k,) = unary("abs").kernels
    assert k.work == Work(vector=1024) and k.time == pytest.approx(1024 / 1e9, rel=1e-12)


@pytest.mark.parametrize("dtype, unit, rate", [("f32", "matrix_f32", 4e9),
                                               ("f16", "matrix_f16", 8e9),
                                               ("bf16", "matrix_f16", 8e9)])
def test_a_dot_runs_on_the_matrix_unit_at_the_rate_for_its_operands(dtype, unit, rate):
    dims = {"m": (16, 16), "e": (32, 32), "n": (16, 16)}
    y = matmul(Load("A", ("m", "e")), Load("W", ("e", "n")), "e")
    p = program(dims, {"A": ("m", "e"), "W": ("e", "n")}, [Store("Y", ("m", "n"), y)],
                dtype=dtype)
    (k,) = cost_program(p, machine()).kernels
    dot, combine = 2 * 16 * 16 * 32, 16 * 16  # one block product, one accumulation
    assert k.work == Work(vector=combine, **{unit: dot})
    assert k.time == pytest.approx(dot / rate + combine / 1e9, rel=1e-12)


def test_a_dot_of_a_16_bit_tensor_and_a_computed_operand_runs_in_16_bit():
    """The computed operand is rounded to the tensor's format (FlashAttention's P @ V)."""
    dims = {"m": (16, 16), "e": (32, 32), "n": (16, 16)}
    y = matmul(Unary("exp", Load("A", ("m", "e"))), Load("W", ("e", "n")), "e")
    p = program(dims, {"A": ("m", "e"), "W": ("e", "n")}, [Store("Y", ("m", "n"), y)],
                dtype="f16")
    (k,) = cost_program(p, machine()).kernels
    assert k.work == Work(vector=16 * 16, special=16 * 32, matrix_f16=2 * 16 * 16 * 32)


def test_a_dot_of_two_computed_operands_is_an_f32_dot():
    dims = {"m": (16, 16), "e": (32, 32), "n": (16, 16)}
    y = matmul(Unary("exp", Load("A", ("m", "e"))), Unary("abs", Load("W", ("e", "n"))), "e")
    p = program(dims, {"A": ("m", "e"), "W": ("e", "n")}, [Store("Y", ("m", "n"), y)],
                dtype="f16")
    (k,) = cost_program(p, machine()).kernels
    assert k.work.matrix_f32 == 2 * 16 * 16 * 32 and k.work.matrix_f16 == 0


def test_flash_attention_work_adds_up_to_its_flops_and_reports_each_unit():
    p = lower(parse_program((REPO / "examples" / "attention.bbp").read_text()))
    cost = cost_program(p, H100)
    assert cost.work.total == cost.flops
    data = json.loads(json.dumps(cost.to_json()))
    n = 4096
    # S = Q K^T and O = P V, each 2 N^2 d flops, on f32 operands
    assert data["work"]["matrix_f32"] == data["work"]["matrix"] == 2 * 2 * n * n * 64
    assert data["work"]["special"] == n * n  # exp, once per score
    assert data["kernels"][2]["work"]["special"] == n * n  # the E kernel
    assert sum(data["work"][u] for u in ("vector", "special", "matrix")) == data["flops"]


# --------------------------------------------------------------------------------------------
# Target files


BASE = """\
global_bandwidth = 2000
local_capacity = 100
processors = 10
peak_flops = 1.5
peak_flops_f16 = 30
launch_cost = 2.5
"""


def test_a_target_file_may_give_its_block_granularity(tmp_path):
    (tmp_path / "plain.toml").write_text(BASE)
    assert get_target(str(tmp_path / "plain.toml")).block_granularity == 16
    (tmp_path / "coarse.toml").write_text(BASE + "block_granularity = 64\n")
    assert get_target(str(tmp_path / "coarse.toml")).block_granularity == 64
    (tmp_path / "bad.toml").write_text(BASE + "block_granularity = 0\n")
    with pytest.raises(SourceError, match="block_granularity"):
        get_target(str(tmp_path / "bad.toml"))


def test_optional_unit_fields_default_to_the_vector_rate_and_exact_times(tmp_path):
    (tmp_path / "old.toml").write_text(BASE)
    t = get_target(str(tmp_path / "old.toml"))
    assert (t.peak_flops_dot_f32, t.special_rate, t.resolution) == (1.5e12, 1.5e12, 0.0)


def test_unit_fields_are_read_in_their_units(tmp_path):
    (tmp_path / "new.toml").write_text(
        BASE + "peak_flops_dot_f32 = 15\nspecial_rate = 0.25\nresolution = 0.04\n")
    t = get_target(str(tmp_path / "new.toml"))
    assert (t.peak_flops_dot_f32, t.special_rate, t.resolution) == (15e12, 0.25e12, 0.04)


def test_step_cost_is_read_in_microseconds_and_defaults_to_nothing(tmp_path):
    (tmp_path / "old.toml").write_text(BASE)
    assert get_target(str(tmp_path / "old.toml")).step_cost == 0.0
    (tmp_path / "numpy.toml").write_text(BASE + "step_cost = 1.5\n")
    assert get_target(str(tmp_path / "numpy.toml")).step_cost == 1.5e-6
    assert H100.step_cost == get_target("h200").step_cost == 0.0
    assert get_target("cpu").step_cost > 0


def row_sum(rows: int, columns: int, target: Target = get_target("cpu")) -> KernelCost:
    """The kernel of Y[m] = sum[k] X[m, k] * 2, in blocks of 64 on both axes."""
    p = lower(parse_program(f"dim m = {rows} / 64\ndim k = {columns} / 64\n"
                            f"input X[m, k] : f32\nY[m] = sum[k] X[m, k] * 2\noutput Y"))
    (k,) = cost_program(p, target).kernels
    return k


def test_a_loop_step_s_operations_are_counted_once_for_the_whole_grid():
    # Each step of the loop over k loads a tile of X, doubles it and sums it into the state:
    # the same operations however many rows the grid covers, twice as many for twice the
    # steps, and priced at step_cost each on top of the kernel's other time.
    k = row_sum(256, 512)
    assert k.step_ops > 0 and k.step_ops % (512 // 64) == 0
    assert row_sum(1024, 512).step_ops == k.step_ops
    assert row_sum(256, 1024).step_ops == 2 * k.step_ops
    cpu = get_target("cpu")
    free = row_sum(256, 512, dataclasses.replace(cpu, step_cost=0.0))
    assert k.time - free.time == pytest.approx(k.step_ops * cpu.step_cost, rel=1e-9)
    # A kernel without loops has no steps.
    assert unary("exp").kernels[0].step_ops == 0


def one_kernel(source: str, target: Target) -> KernelCost:
    """The cost of the one kernel `source` lowers to."""
    (k,) = cost_program(lower(parse_program(source)), target).kernels
    return k


EMBEDDING = ("dim t = 64 / 16\ndim v = 256 / 64\ndim e = 32\ninput IDS[t], E[v, e] : f32\n"
             "X[t, e] = sum[v] where(IDS[t] == v, 1, 0) * E[v, e]\noutput X\n")


def embedding(target: Target) -> KernelCost:
    """X[t, e] = sum[v] where(IDS[t] == v, 1, 0) * E[v, e]: a lookup of E's rows by id."""
    return one_kernel(EMBEDDING, target)


def test_a_one_hot_contraction_is_a_copy_where_the_backend_gathers():
    # Each of the 4 x 4 steps (row blocks x vocabulary blocks) contracts a 16 x 64 one-hot
    # with a 64 x 32 tile of E: 2 x 16 x 32 x 64 matrix flops where the backend multiplies,
    # one copied element per element of the 16 x 32 result where it gathers.
    steps = 4 * 4
    gathers = dataclasses.replace(machine(), gathers=True)
    assert embedding(machine()).work.matrix_f32 == steps * 2 * 16 * 32 * 64
    copied = embedding(gathers).work
    assert copied.matrix_f32 == copied.matrix_f16 == 0
    assert copied.vector - embedding(machine()).work.vector == steps * 16 * 32
    assert get_target("cpu").gathers and not H100.gathers


def test_a_sum_of_a_selection_that_pins_its_position_is_a_copy_where_the_backend_gathers():
    # A cache of 63 tokens read at the positions of 64 (a concatenation's piece), in blocks
    # of 9: the in-tile sum over each block's 16 x 9 x 32 selection, where the backend sums
    # it, is one copied element per element of the 16 x 32 result where it gathers (the
    # numpy backend writes it as the contraction by a one-hot it is).
    cache = ("dim p = 63 / 9\ndim t = 64 / 16\ndim d = 32\ninput C[p, d] : f32\n"
             "K[t, d] = sum[p] where(p == t, C[p, d], 0)\noutput K\n")
    summed = one_kernel(cache, machine()).work
    copied = one_kernel(cache, dataclasses.replace(machine(), gathers=True)).work
    visits = 2 + 3 + 3 + 2  # the blocks of p each block of t may read (block skipping)
    assert summed.vector - copied.vector == visits * (16 * 9 * 32 - 16 * 32)


def test_gathers_is_a_boolean_target_field(tmp_path):
    (tmp_path / "numpy.toml").write_text(BASE + "gathers = true\n")
    assert get_target(str(tmp_path / "numpy.toml")).gathers
    (tmp_path / "old.toml").write_text(BASE)
    assert not get_target(str(tmp_path / "old.toml")).gathers
    (tmp_path / "bad.toml").write_text(BASE + "gathers = 1\n")
    with pytest.raises(SourceError, match="'gathers' must be true or false"):
        get_target(str(tmp_path / "bad.toml"))


def test_the_shipped_a100_gives_every_unit():
    a100 = get_target(str(REPO / "targets" / "a100.toml"))
    assert (a100.peak_flops_dot_f32, a100.resolution) == (156e12, 0.03)
    assert a100.special_rate == pytest.approx(16 * 108 * 1.41e9, rel=0.01)


@pytest.mark.parametrize("line, message", [
    ("resolution = 0.7", "'resolution' must be from 0 to 0.5"),
    ("resolution = -0.01", "'resolution' must be from 0 to 0.5"),
    ("resolution = \"3%\"", "'resolution' must be a number"),
    ("special_rate = 0", "'special_rate' must be positive"),
    ("special_rate = nan", "'special_rate' must be positive"),
    ("peak_flops_dot_f32 = 1e300", "'peak_flops_dot_f32' must be from 1e-06 to 1e+09"),
    ("peak_flops_tf32 = 15", "unknown target field 'peak_flops_tf32'"),
])
def test_bad_unit_fields_are_positioned_errors(tmp_path, line, message):
    path = tmp_path / "t.toml"
    path.write_text(BASE + line + "\n")
    with pytest.raises(SourceError) as info:
        get_target(str(path))
    assert (info.value.span.line, info.value.span.column) == (7, 1)
    assert info.value.message.startswith(message)


def test_apply_with_a_bad_resolution_exits_2_with_file_line_col(tmp_path, capsys):
    path = tmp_path / "t.toml"
    path.write_text(BASE + "resolution = 2\n")
    status = main(["apply", str(REPO / "examples" / "softmax.bbp"), "--target", str(path)])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert re.search(rf"{re.escape(str(path))}:7:1: error: 'resolution' must be", err), err


# --------------------------------------------------------------------------------------------
# The tie rule


def candidate(t: Target, time_us: float, traffic: int, kernels: int = 1) -> ProgramCost:
    """A program of `kernels` equal kernels taking `time_us` and moving `traffic` in all."""
    k = KernelCost(("T",), ("m",), 1, traffic // kernels, 0, 0, 0, True, time_us * 1e-6 / kernels,
                   0, ())
    return ProgramCost((k,) * kernels, t, 0)


def test_within_the_resolution_less_traffic_wins():
    t = machine(resolution=0.03)
    fast, lean = candidate(t, 100.0, 2000), candidate(t, 101.0, 1000)
    assert lean.key(anchor=fast.time) < fast.key(anchor=fast.time)


def test_beyond_the_resolution_the_faster_wins():
    t = machine(resolution=0.03)
    fast, lean = candidate(t, 100.0, 2000), candidate(t, 104.0, 1000)  # 4% > 3%
    assert fast.key(anchor=fast.time) < lean.key(anchor=fast.time)


def test_within_the_resolution_and_equal_traffic_fewer_kernels_win():
    t = machine(resolution=0.03)
    one, two = candidate(t, 102.0, 1000), candidate(t, 100.0, 1000, kernels=2)
    assert one.key(anchor=two.time) < two.key(anchor=two.time)


def test_resolution_zero_compares_times_exactly():
    t = machine(resolution=0.0)
    fast, lean = candidate(t, 100.0, 2000), candidate(t, 100.1, 1000)
    assert fast.key() < lean.key()


def test_bands_are_a_total_order_where_a_tolerance_is_not():
    # a ~ b and b ~ c within 3%, but a and c are 5.1% apart: bands from a put a and b in
    # band 0 and c in band 1, consistently, whichever pair is compared
    t = machine(resolution=0.03)
    a, b, c = candidate(t, 100.0, 3000), candidate(t, 102.5, 2000), candidate(t, 105.1, 1000)
    keys = {name: x.key(anchor=a.time) for name, x in (("a", a), ("b", b), ("c", c))}
    assert [k[1] for k in keys.values()] == [0, 0, 1]
    assert sorted(keys, key=keys.get) == ["b", "a", "c"]


LLAMA_HEAD = """\
dim q = 1024 / 64
dim k = 1024 / 64
dim d = 128
input Q[q, d], K[k, d], V[k, d] : f32
S[q, k] = sum[d] Q[q, d] * K[k, d] * 0.088
M[q]    = max[k] S[q, k]
E[q, k] = exp(S[q, k] - M[q])
L[q]    = sum[k] E[q, k]
O[q, d] = sum[k] E[q, k] * V[k, d] / L[q]
output O
"""


@pytest.fixture(scope="module")
def llama() -> tuple:
    """One LLaMA-sized attention head (d = 128, 1024 positions) fused on the H100 with its
    3% resolution and with none, launched as written (folds whole, the program's blocks): what
    is at stake is the near-tie between Flash Attention and storing the scores (split over
    keys or in finer query blocks the head is faster than both: `test_split.py`)."""
    p = lower(parse_program(LLAMA_HEAD))
    pack = load_packs([])
    whole = Options(split_folds=False, reblock=False)
    return (fuse(p, pack, H100, options=whole),
            fuse(p, pack, dataclasses.replace(H100, resolution=0.0), options=whole))


def test_a_head_that_stores_scores_only_slightly_faster_fuses(llama):
    tied, exact = llama
    # exactly, storing the scores (two kernels) is fastest, by under the 3% resolution
    assert exact.after.n_kernels == 2
    assert exact.after.time < exact.runner_up.time < exact.after.time * 1.03
    # with the resolution, the fused kernel wins on traffic and the stored scores come second
    assert tied.after.n_kernels == 1 and tied.after.traffic < exact.after.traffic
    assert tied.after.time == pytest.approx(exact.runner_up.time, rel=1e-12)
    assert tied.runner_up.n_kernels == 2
    assert tied.runner_up.time == pytest.approx(exact.after.time, rel=1e-12)
    # never worse than the input in the order extraction ranked with
    anchor = tied.extraction.anchor
    assert anchor == exact.after.time
    assert tied.after.key(anchor=anchor) < tied.before.key(anchor=anchor)


# --------------------------------------------------------------------------------------------
# The runner-up in apply's report


def test_apply_prints_the_runner_up_and_its_margin(tmp_path, capsys):
    path = tmp_path / "head.bbp"
    path.write_text(LLAMA_HEAD)
    assert main(["apply", str(path), "--json", "--no-split", "--fixed-blocks"]) == 0
    data = json.loads(capsys.readouterr().out)
    after, second = data["after"], data["runner_up"]
    assert (after["n_kernels"], second["n_kernels"]) == (1, 2)
    assert second["time_margin"] == pytest.approx(second["time"] / after["time"] - 1)
    assert second["traffic_ratio"] == pytest.approx(second["traffic"] / after["traffic"])
    assert -0.03 < second["time_margin"] < 0 and second["traffic_ratio"] > 1

    assert main(["apply", str(path), "--no-split", "--fixed-blocks"]) == 0
    out = capsys.readouterr().out
    line = (f"runner-up: 2 kernels, {fmt_time(second['time'])} "
            f"({second['time_margin']:+.1%}), traffic {second['traffic_ratio']:.2f}x; "
            f"times within 3% tie, less traffic wins")
    assert line in out.splitlines()


def test_a_program_with_one_candidate_has_no_runner_up():
    text = "dim m = 64 / 16\ninput X[m] : f32\nY[m] = X[m] * 2\noutput Y\n"
    r = fuse(lower(parse_program(text)), load_packs([]), H100)
    assert r.runner_up is None and r.to_json()["runner_up"] is None


def test_the_cpu_measurement_writes_a_target_file_that_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import measure_cpu_target

    out = tmp_path / "measured.toml"
    assert measure_cpu_target.main(["-o", str(out), "--repeat", "1", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    t = get_target(str(out))
    assert t.name == "cpu-measured" and "measure_cpu_target.py" in t.doc
    assert t.global_bandwidth == pytest.approx(figures["global_bandwidth"] * 1e9)
    assert t.special_rate == pytest.approx(figures["special_rate"] * 1e12)
    assert t.launch_cost == pytest.approx(figures["launch_cost"] * 1e-6)
    assert t.step_cost == pytest.approx(figures["step_cost"] * 1e-6) and t.gathers


def test_a_step_cost_measured_as_nothing_is_left_out_of_the_target_file(tmp_path, monkeypatch):
    """A target file refuses a step cost of 0 (figures must be positive); where more steps
    took no longer (a quieter second run), the measurement omits the optional field."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import measure_cpu_target

    figures = measure_cpu_target.Figures(17.7, 512, 2, 0.00646, 0.0597, 0.0597, 0.000773,
                                         0.0, 1.8, 0.05)
    out = tmp_path / "measured.toml"
    out.write_text(measure_cpu_target.toml_text(figures, "2026-12-05"))
    t = get_target(str(out))
    assert t.step_cost == 0 and t.launch_cost == pytest.approx(1.8e-6) and t.gathers
