"""Measure this CPU as a bbrules target: the figures the cost model prices the numpy backend with.

Each figure is what the numpy backend does on this machine, timed as it does it:

- global_bandwidth: a large copy (`np.copyto` of 128 MiB f32), bytes read plus bytes written;
- peak_flops_f16, peak_flops_dot_f32: batched `np.matmul` of f32 64 x 64 tiles, 2 x 64^3 flops
  a tile pair (the backend runs a block contraction as one batched matmul over the grid; numpy
  has no faster 16-bit path, it computes in f32);
- special_rate: `np.exp` on a 1 MiB f32 array (resident in the cache), evaluations per second;
- peak_flops: `np.multiply` on the same arrays, one flop per element;
- step_cost: a generated kernel whose map loop stores a 16-element block per step, run for
  one step and for `STEPS`; the difference over the difference in the step operations the
  cost model counts for the two (`KernelCost.step_ops`), seconds per operation;
- launch_cost: a generated kernel that does almost nothing (one 16-element block, no loop),
  run through the generated module's `run`, per kernel;
- local_capacity: the per-core L2 cache size the OS reports (1 MiB if it reports none);
- processors: the cores this process may use;
- gathers: true, not measured: the numpy backend runs a contraction by a one-hot as a gather;
- resolution: 0.05, not measured: a numpy program's time has overheads (Python loops over
  blocks, temporaries) that the model does not see, so it resolves less than on a GPU (0.03).
  The run-to-run spread of each timing (median over best) is printed beside the figures.

Each timing is the best of `--repeat` runs (the machine may be shared; the best run is the
least disturbed).  The figures are printed (or `--json`); the TOML target file is written only
to the file given with `-o`:

    python benchmarks/measure_cpu_target.py [-o targets/mycpu.toml] [--repeat 7] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from bbrules.blockfile import parse_block_program
from bbrules.codegen import numpy_gen
from bbrules.cost import cost_program
from bbrules.frontend import parse_program
from bbrules.lower import lower
from bbrules.targets import get_target

TILE = 64  # the block size of the examples' contractions
RESOLUTION = 0.05
KERNELS = 16  # kernels in the chain whose run time gives the per-kernel overhead
STEPS = 256  # steps of the map loop whose run time gives the per-operation overhead


@dataclass(frozen=True)
class Figures:
    """The measured target, in the units of a TOML target file (see `bbrules.targets`)."""

    global_bandwidth: float  # GB/s
    local_capacity: int  # KiB
    processors: int
    peak_flops: float  # TFLOP/s
    peak_flops_f16: float  # TFLOP/s
    peak_flops_dot_f32: float  # TFLOP/s
    special_rate: float  # T/s
    step_cost: float  # µs
    launch_cost: float  # µs
    resolution: float


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(best, median) seconds of `repeat` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def measure(repeat: int) -> tuple[Figures, dict[str, float]]:
    """The figures, and each timing's spread (median / best - 1)."""
    spread: dict[str, float] = {}

    def rate(name: str, work: float, fn: Callable[[], object]) -> float:
        best, median = timed(fn, repeat)
        spread[name] = median / best - 1
        return work / best

    def copied() -> float:
        big = np.ones(32 << 20, np.float32)  # 128 MiB, freed on return
        copy = np.empty_like(big)
        return rate("copy", 2 * big.nbytes, lambda: np.copyto(copy, big))
    bandwidth = copied()

    tiles = 256
    a = np.random.default_rng(0).standard_normal((tiles, TILE, TILE), np.float32)
    out = np.empty_like(a)
    matmul = rate("matmul", 2 * tiles * TILE**3, lambda: np.matmul(a, a, out=out))

    x = np.random.default_rng(1).standard_normal(1 << 18, np.float32)  # 1 MiB
    y = np.empty_like(x)
    special = rate("exp", x.size, lambda: np.exp(x, out=y))
    vector = rate("multiply", x.size, lambda: np.multiply(x, x, out=y))

    step = per_step_op(repeat, spread)
    launch = per_kernel(repeat, spread)
    figures = Figures(
        global_bandwidth=round(bandwidth / 1e9, 2),
        local_capacity=l2_kib(),
        processors=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1,
        peak_flops=_sig(vector / 1e12),
        peak_flops_f16=_sig(matmul / 1e12),
        peak_flops_dot_f32=_sig(matmul / 1e12),
        special_rate=_sig(special / 1e12),
        step_cost=round(step * 1e6, 2),
        launch_cost=round(launch * 1e6, 1),
        resolution=RESOLUTION,
    )
    return figures, spread


def per_step_op(repeat: int, spread: dict[str, float]) -> float:
    """Seconds per operation of a loop step: a kernel whose map loop doubles one 16-element block
    of X per step, timed for 1 and for `STEPS` steps, over the operations the cost model
    counts for each."""
    def kernel(steps: int) -> tuple[float, float]:
        p = parse_block_program(f"dim r = 16\ndim c = {16 * steps} / 16\ninput X[r, c] : f32\n"
                                f"output Y[r, c] : f32\nkernel [r]:\n"
                                f"  Y[r, c] = load(X[r, c]) * 2.0\n").program
        module = numpy_gen.load(p)
        x = np.ones((16, 16 * steps), np.float32)
        best, median = timed(lambda: module.run(X=x), repeat * 5)
        spread[f"steps {steps}"] = median / best - 1
        return best, sum(k.step_ops for k in cost_program(p, get_target("cpu")).kernels)
    (one, ops_one), (many, ops_many) = kernel(1), kernel(STEPS)
    return max(0.0, many - one) / (ops_many - ops_one)


def per_kernel(repeat: int, spread: dict[str, float]) -> float:
    """Seconds per kernel of a generated numpy module whose kernels do almost nothing: a chain
    of `KERNELS` elementwise kernels on one 16-element block."""
    lines = ["dim m = 16", "input X0[m] : f32"]
    lines += [f"X{i + 1}[m] = X{i}[m] * 2" for i in range(KERNELS)]
    lines.append(f"output X{KERNELS}")
    module = numpy_gen.load(lower(parse_program("\n".join(lines))))
    x = np.ones(16, np.float32)
    best, median = timed(lambda: module.run(X0=x), repeat * 20)
    spread["kernel"] = median / best - 1
    return best / KERNELS


def l2_kib() -> int:
    """The per-core L2 cache the OS reports, in KiB (1024 if it reports none)."""
    path = Path("/sys/devices/system/cpu/cpu0/cache/index2/size")
    try:
        text = path.read_text().strip()
    except OSError:
        return 1024
    scale = {"K": 1, "M": 1024}.get(text[-1:], None)
    return int(text[:-1]) * scale if scale else int(text) // 1024


def _sig(v: float) -> float:
    """`v` to 3 significant digits (the figures are not more precise than that)."""
    return float(f"{v:.3g}")


def toml_text(f: Figures, date: str) -> str:
    cpu = platform.processor() or platform.machine()
    doc = (f"{f.processors}-core {cpu} measured by benchmarks/measure_cpu_target.py on {date}: "
           f"numpy {np.__version__}")
    lines = [f"# Measured by benchmarks/measure_cpu_target.py on {date}; units as in "
             f"targets/a100.toml.",
             'name = "cpu-measured"', f"doc = {json.dumps(doc)}"]
    # a step cost that rounds to nothing is left out: the field is optional, meaning none, and
    # a target file must give a positive figure where it gives one
    lines += [f"{k} = {v}" for k, v in asdict(f).items() if k != "step_cost" or v > 0]
    if f.step_cost <= 0:
        lines.append("# step_cost: more steps took no longer; left out (none)")
    lines.append("gathers = true  # the numpy backend runs one-hot contractions as gathers")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", metavar="FILE.toml",
                    help="write the target file here (nothing is written without -o)")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per figure (best taken)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    figures, spread = measure(max(1, args.repeat))
    date = datetime.date.today().isoformat()
    if args.output:
        Path(args.output).write_text(toml_text(figures, date))
    if args.json:
        print(json.dumps({"date": date, "figures": asdict(figures), "spread": spread,
                          "output": args.output}, indent=2))
        return 0
    for k, v in asdict(figures).items():
        print(f"{k:20} {v}")
    print("spread (median / best - 1): "
          + ", ".join(f"{k} {v:.1%}" for k, v in spread.items()))
    print(f"wrote {args.output}" if args.output else "\n" + toml_text(figures, date), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
