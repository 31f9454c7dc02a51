"""GPU benchmark: fused CUDA vs unfused CUDA vs CuPy dense ops (and torch's attention).

For each case, in one run: the program lowered from its example (one kernel per statement) and
fused by the standard rule pack for this GPU's target, both through the CUDA backend
(`bbrules.codegen.cuda_gen`, launched with CuPy); the same computation written as dense CuPy
operations (cuBLAS matmuls, whole-array elementwise ops), which is the baseline every ratio is
taken against; and `torch.nn.functional.scaled_dot_product_attention` for attention when torch
with CUDA is importable.  Times are the median of `--repeat` runs measured with CUDA events
after two warm-up runs, each a whole call as a user makes it (for the generated code: the
launcher allocating outputs and launching every kernel); memory is what one run adds to
CuPy's memory pool (not measured for torch, which has its own allocator).  Every
variant's output is compared with the dense one, so a fast wrong answer shows up as an error,
not a speed-up.  The cost model's predicted time and traffic are recorded beside the measured
ones.

    python benchmarks/bench_gpu.py --out DIR [--case attention-4096 ...] [--repeat 10]
    python benchmarks/bench_gpu.py --out DIR --dry-run      # no GPU: build, fuse, compile only

Everything goes under DIR: `bench_gpu.json` (all numbers), `bench_gpu.md` (the table), and
`kernels/` (the generated CUDA source, launcher and ptxas resource usage of every variant).
The generated kernels use CUDA cores and shared memory only (no tensor cores), so the dense
baseline's cuBLAS matmuls have an advantage the fusion has to make up in data movement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bbrules.codegen.cuda_gen import CompileError, CudaModule, compile_check, generate
from bbrules.cost import cost_program
from bbrules.frontend import load_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import Target, get_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MEAN_OF_4096 = 0.000244140625  # the examples' 1/4096, exact in binary


@dataclass(frozen=True)
class Case:
    name: str
    example: str
    dims: dict[str, tuple[int, int]]
    output: str


CASES = [
    *(Case(f"attention-{n}", "attention.bbp", {"q": (n, 64), "k": (n, 64), "d": (64, 64)}, "O")
      for n in (1024, 4096, 8192)),
    Case("layernorm-matmul", "layernorm_matmul.bbp", {}, "Y"),
    Case("rmsnorm-ffn-swiglu", "rmsnorm_ffn_swiglu.bbp", {}, "Y"),
]


def _dense(case: Case, cp: Any) -> Callable[[dict], Any]:
    """The case as dense CuPy operations, exactly the formula of its example."""
    def silu(x):
        return x / (1 + cp.exp(-x))

    if case.example == "attention.bbp":
        def attention(t):
            s = t["Q"] @ t["K"].T * np.float32(0.125)
            e = cp.exp(s - s.max(axis=1, keepdims=True))
            return (e / e.sum(axis=1, keepdims=True)) @ t["V"]
        return attention
    if case.example == "layernorm_matmul.bbp":
        def layernorm_matmul(t):
            x = t["X"]
            mu = x.sum(axis=1, keepdims=True) * np.float32(MEAN_OF_4096)
            var = ((x - mu) ** 2).sum(axis=1, keepdims=True) * np.float32(MEAN_OF_4096)
            return ((x - mu) / cp.sqrt(var + np.float32(1e-5)) * t["G"] + t["B"]) @ t["W"]
        return layernorm_matmul
    if case.example == "rmsnorm_ffn_swiglu.bbp":
        def rmsnorm_ffn(t):
            x = t["X"]
            ss = (x * x).sum(axis=1, keepdims=True) * np.float32(MEAN_OF_4096)
            xn = x / cp.sqrt(ss + np.float32(1e-5)) * t["G"]
            return (silu(xn @ t["W1"]) * (xn @ t["W3"])) @ t["W2"]
        return rmsnorm_ffn
    raise ValueError(f"no dense CuPy version of {case.example}")


@dataclass
class Variant:
    name: str
    kernels: int | None = None
    seconds: float | None = None
    times: list[float] = field(default_factory=list)
    pool_bytes: int | None = None
    max_abs_error: float | None = None
    predicted_seconds: float | None = None
    predicted_traffic: int | None = None
    shared_bytes: list[int] = field(default_factory=list)
    registers: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass
class CaseResult:
    case: str
    dims: dict[str, list[int]]
    variants: list[Variant] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Building (no GPU needed)


def build(case: Case, target: Target, kernels_dir: Path, log: Callable[[str], None]
          ) -> tuple[CaseResult, dict[str, CudaModule]]:
    """Lower, fuse and generate a case; its result so far and the modules that generated."""
    program = load_program(EXAMPLES / case.example, case.dims or None)
    unfused = lower(program)
    started = time.perf_counter()
    fused = fuse(unfused, load_packs([]), target).program
    log(f"{case.name}: fused {len(unfused.kernels)} kernels into {len(fused.kernels)} "
        f"in {time.perf_counter() - started:.1f} s")
    result = CaseResult(case.name, {n: [d.extent, d.block] for n, d in unfused.dims.items()})
    modules = {}
    for label, p in (("fused CUDA", fused), ("unfused CUDA", unfused)):
        v = Variant(label, kernels=len(p.kernels))
        cost = cost_program(p, target)
        v.predicted_seconds, v.predicted_traffic = cost.time, cost.traffic
        result.variants.append(v)
        try:
            module = generate(p, target)
        except Exception as err:  # a refused kernel is a result to report, not a crash
            v.error = f"{type(err).__name__}: {err}"
            log(f"{case.name}: {label}: {v.error}")
            continue
        v.shared_bytes = [k.shared_bytes for k in module.kernels]
        stem = f"{case.name}-{label.split()[0]}"
        (kernels_dir / f"{stem}.cu").write_text(module.source)
        (kernels_dir / f"{stem}_launcher.py").write_text(module.launcher)
        if shutil.which("nvcc"):
            try:
                resources = compile_check(module.source)
                v.registers = [resources[k.name].registers for k in module.kernels]
                (kernels_dir / f"{stem}.resources.json").write_text(json.dumps(
                    {n: asdict(r) for n, r in resources.items()}, indent=1))
            except CompileError as err:
                v.error = str(err)
                log(f"{case.name}: {label}: {err}")
                continue
        modules[label] = module
    return result, modules


# --------------------------------------------------------------------------------------------
# Measuring (needs CuPy and a GPU)


def _time(fn: Callable[[], Any], repeat: int, cp: Any) -> list[float]:
    for _ in range(2):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return times


def _pool_bytes(fn: Callable[[], Any], cp: Any) -> int:
    """Bytes a run adds to CuPy's memory pool (its high-water mark, as the pool keeps blocks)."""
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    out = fn()
    cp.cuda.Device().synchronize()
    added = pool.total_bytes() - before
    del out
    return added


def measure(case: Case, result: CaseResult, modules: dict[str, CudaModule], repeat: int,
            cp: Any, log: Callable[[str], None]) -> None:
    """Time every variant of a case on the GPU and check it against the dense one."""
    program = load_program(EXAMPLES / case.example, case.dims or None)
    inputs = {n: cp.asarray(x) for n, x in random_inputs(program, seed=0).items()}
    dense = _dense(case, cp)
    reference = dense(inputs)
    scale = max(1.0, float(cp.abs(reference).max()))
    runs: dict[str, Callable[[], Any]] = {"CuPy dense": lambda: dense(inputs)}
    for label, module in modules.items():
        run = module.runner()
        runs[label] = lambda run=run: run(**inputs)[case.output]
    torch_run = _torch_attention(case, inputs, cp)
    if torch_run is not None:
        runs["torch SDPA"] = torch_run
    by_name = {v.name: v for v in result.variants}
    for label, fn in runs.items():
        v = by_name.get(label)
        if v is None:
            v = Variant(label)
            result.variants.append(v)
        try:
            out = fn()
            v.max_abs_error = float(cp.abs(cp.asarray(out) - reference).max()) / scale
            v.times = _time(fn, repeat, cp)
            v.seconds = statistics.median(v.times)
            v.pool_bytes = _pool_bytes(fn, cp) if label != "torch SDPA" else None
            log(f"{case.name}: {label}: {v.seconds * 1e3:.3f} ms, "
                f"error {v.max_abs_error:.2e} (relative to the largest output)")
        except Exception as err:  # one failing variant must not lose the others' numbers
            v.error = f"{type(err).__name__}: {err}"
            log(f"{case.name}: {label}: FAILED {v.error}")


def _torch_attention(case: Case, inputs: dict, cp: Any) -> Callable[[], Any] | None:
    if case.example != "attention.bbp":
        return None
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    q, k, v = (torch.as_tensor(inputs[n], device="cuda")[None, None] for n in "QKV")

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, scale=0.125)[0, 0]
        return cp.asarray(out)

    return sdpa


# --------------------------------------------------------------------------------------------
# Report


def table(results: list[CaseResult]) -> str:
    lines = ["| case | variant | kernels | time (ms) | vs dense | predicted (ms) | pool MiB "
             "| error |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        dense = next((v.seconds for v in r.variants if v.name == "CuPy dense"), None)
        for v in r.variants:
            ms = f"{v.seconds * 1e3:.3f}" if v.seconds is not None else "-"
            ratio = f"{dense / v.seconds:.2f}x" if dense and v.seconds else "-"
            pred = f"{v.predicted_seconds * 1e3:.3f}" if v.predicted_seconds not in (
                None, float("inf")) else "-"
            pool = f"{v.pool_bytes / 2**20:.1f}" if v.pool_bytes is not None else "-"
            err = v.error or (f"{v.max_abs_error:.1e}" if v.max_abs_error is not None else "-")
            lines.append(f"| {r.case} | {v.name} | {v.kernels or '-'} | {ms} | {ratio} "
                         f"| {pred} | {pool} | {err} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-results"),
                        help="results directory (default: $OUT, else ./gpu-results)")
    parser.add_argument("--case", action="append", choices=[c.name for c in CASES],
                        help="run only these cases (repeatable)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--target", help="fusion target (default: h200 on an H200, else h100)")
    parser.add_argument("--dry-run", action="store_true",
                        help="build, fuse, generate and compile only: no GPU needed")
    args = parser.parse_args(argv)
    out = Path(args.out)
    (out / "kernels").mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(f"[bench_gpu] {message}", flush=True)

    cp, device = None, "none (dry run)"
    if not args.dry_run:
        import cupy as cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    target = get_target(args.target or ("h200" if "H200" in device else "h100"))
    log(f"device: {device}; fusion target: {target.name}")
    cases = [c for c in CASES if not args.case or c.name in args.case]
    results = []
    for case in cases:
        result, modules = build(case, target, out / "kernels", log)
        if cp is not None:
            measure(case, result, modules, args.repeat, cp, log)
        results.append(result)
        report = {"device": device, "target": target.name, "python": sys.version.split()[0],
                  "platform": platform.platform(), "repeat": args.repeat,
                  "cases": [asdict(r) for r in results]}
        # written after every case, so a run cut short keeps what it measured
        (out / "bench_gpu.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "bench_gpu.md").write_text(f"# GPU benchmark on {device}\n\n" + table(results))
    print(table(results))
    return 0 if all(v.error is None for r in results for v in r.variants) else 1


if __name__ == "__main__":
    sys.exit(main())
