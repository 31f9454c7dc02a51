"""CPU benchmark: what fusion buys a numpy program, in time and in peak memory.

For each case, in one run: the dense numpy evaluation of the program (`bbrules.dense`, the
baseline every ratio is taken against), the unfused block program and the fused block program
through the numpy backend, torch's `scaled_dot_product_attention` on the CPU when torch is
importable, and, for attention, the hand-written blocked online-softmax loop in plain numpy
(`blocked_attention.py`, the ceiling for a numpy backend).  Times are the median of `--repeat`
runs; peak memory is the tracemalloc peak of one more run (numpy reports its buffers to
tracemalloc; torch does not, so its memory is not shown).  Every variant's outputs are checked
against the dense evaluation, so a fast wrong answer shows up as an error, not a speed-up.

The fused program comes from `bbrules.fuse.fuse(lower(ast), load_packs([]), get_target("cpu"),
objective)`, or from `--fused CASE=PATH.bbk`.  The objective defaults to global traffic: on
the `cpu` target's figures attention is compute-bound, so modeled time barely separates the
two-kernel program that stores S from Flash Attention (5x less traffic; at N = 4096 storing S
models 3% faster, inside the target's 5% resolution, so the time objective too picks Flash
Attention), while what limits a numpy program in practice is the memory it streams and
allocates.  `--objective time` measures what the time objective picks.

    python benchmarks/bench_cpu.py [--case attention-8192 ...] [--dim k=8192/256 ...]
                                   [--fused CASE=PATH.bbk ...] [--repeat 3] [--json PATH]

The key block size sets the step of the generated loop over keys, so the attention cases use
blocks of 256 keys, the hand-written loop's block.  The other cases use a CPU-sized width
(1024, hidden 2816) and blocks large enough for BLAS to run near its speed: the numpy backend
runs each block of a reduction as its own matmul, so the example files' GPU-sized blocks
(4 hidden columns at a time) would measure Python loop overhead, not data movement.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from blocked_attention import blocked_attention
from bbrules import dense
from bbrules.blockfile import load_block_program
from bbrules.codegen import numpy_gen
from bbrules.errors import UsageError
from bbrules.frontend import load_program, parse_dim_override
from bbrules.inputs import random_inputs
from bbrules.fuse import fuse
from bbrules.ir import BlockProgram
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ATTENTION_SCALE = 0.125  # the constant examples/attention.bbp multiplies by (1 / sqrt(64))


@dataclass(frozen=True)
class Case:
    name: str
    example: str
    dims: dict[str, tuple[int, int]]

    @property
    def attention(self) -> bool:
        return self.example == "attention.bbp"


CASES = [
    *(Case(f"attention-{n}", "attention.bbp", {"q": (n, 64), "k": (n, 256), "d": (64, 64)})
      for n in (1024, 4096, 8192)),
    Case("layernorm-matmul", "layernorm_matmul.bbp",
         {"m": (2048, 64), "e": (1024, 256), "n": (1024, 1024)}),
    Case("rmsnorm-ffn-swiglu", "rmsnorm_ffn_swiglu.bbp",
         {"m": (512, 64), "e": (1024, 1024), "f": (2816, 704), "n": (1024, 1024)}),
]


@dataclass
class Measurement:
    variant: str
    seconds: float | None = None
    times: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    max_rel_error: float | None = None
    speedup: float | None = None  # dense time / this time
    memory_ratio: float | None = None  # this peak / dense peak
    note: str = ""


def fused_program(unfused: BlockProgram, given: Path | None, objective: str
                  ) -> tuple[BlockProgram, str]:
    """The fused program to measure and where it came from: `--fused` or the engine."""
    if given is not None:
        return load_block_program(given).program, str(given)
    fused = fuse(unfused, load_packs([]), get_target("cpu"), objective).program
    return fused, f"bbrules.fuse ({objective}): {len(fused.kernels)} kernel(s)"


Outputs = dict[str, np.ndarray]


def measure(variant: str, fn: Callable[[], Outputs], want: Outputs | None, repeat: int,
            traced: bool = True) -> tuple[Measurement, Outputs]:
    """Peak traced memory of a first run (which also warms up), then the median time of
    `repeat` more; with the first run's outputs, and their error against `want`."""
    out = Measurement(variant)
    gc.collect()
    if traced:
        tracemalloc.start()
        got = fn()
        out.peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    else:
        got = fn()
    if want is not None:
        out.max_rel_error = max(float(np.abs(got[n] - w).max() / max(1e-30, np.abs(w).max()))
                                for n, w in want.items())
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        out.times.append(time.perf_counter() - t0)
    out.seconds = statistics.median(out.times)
    return out, got


def _torch_attention() -> Callable[..., np.ndarray] | None:
    try:
        import torch
    except ImportError:
        return None

    def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        t = [torch.from_numpy(x)[None] for x in (q, k, v)]
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                *t, scale=ATTENTION_SCALE)[0].numpy()

    return sdpa


def run_case(case: Case, overrides: dict[str, tuple[int, int | None]],
             given: dict[str, Path], repeat: int, objective: str) -> dict[str, object]:
    """Every variant of one case, measured in turn; the dense evaluation is the reference."""
    dims = dict(case.dims)
    for name, (extent, block) in overrides.items():
        if name in dims:
            dims[name] = (extent, block if block is not None else dims[name][1])
    ast = load_program(EXAMPLES / case.example, dims=dims)
    unfused = lower(ast)
    inputs = random_inputs(ast, seed=0)
    print(f"{case.name} {dims}", file=sys.stderr, flush=True)
    results: list[Measurement] = []

    def record(variant: str, fn: Callable[[], Outputs], want: Outputs | None,
               traced: bool = True, note: str = "") -> Outputs:
        m, got = measure(variant, fn, want, repeat, traced)
        m.note = note
        results.append(m)
        mem = f", peak {m.peak_bytes / 2**20:.0f} MiB" if m.peak_bytes is not None else ""
        print(f"  {variant}: {m.seconds * 1e3:.0f} ms{mem}", file=sys.stderr, flush=True)
        return got

    def skip(variant: str, note: str) -> None:
        results.append(Measurement(variant, note=note))
        print(f"  {variant}: {note}", file=sys.stderr, flush=True)

    reference = record("dense numpy", lambda: dense.evaluate(ast, inputs), None)
    want = {n: reference[n] for n in unfused.outputs}
    results[0].max_rel_error = 0.0
    del reference
    module = numpy_gen.load(unfused)
    record("unfused (numpy backend)", lambda: module.run(**inputs), want)
    fused, origin = fused_program(unfused, given.get(case.name), objective)
    fused_module = numpy_gen.load(fused)
    record("fused (numpy backend)", lambda: fused_module.run(**inputs), want, note=origin)
    if case.attention:
        q, k, v, block = inputs["Q"], inputs["K"], inputs["V"], dims["k"][1]
        record(f"hand-blocked numpy ({block} keys)",
               lambda: {"O": blocked_attention(q, k, v, block=block, scale=ATTENTION_SCALE)},
               want)
        sdpa = _torch_attention()
        if sdpa is None:
            skip("torch sdpa (cpu)", "torch not installed")
        else:
            record("torch sdpa (cpu)", lambda: {"O": sdpa(q, k, v)}, want, traced=False,
                   note="memory not visible to tracemalloc")
    base = results[0]
    for m in results:
        if m.seconds is not None:
            m.speedup = base.seconds / m.seconds
        if m.peak_bytes is not None:
            m.memory_ratio = m.peak_bytes / base.peak_bytes
    return {"case": case.name, "example": case.example, "dims": dims,
            "measurements": [asdict(m) for m in results]}


def table(report: list[dict[str, object]]) -> str:
    """Times and peak memory with their ratios to the dense baseline of the same case."""
    head = (f"{'case':<20} {'variant':<28} {'time ms':>9} {'speed-up':>9} {'peak MiB':>9} "
            f"{'memory':>8} {'max rel err':>11}  note")
    lines = [head, "-" * len(head)]
    for case in report:
        for m in case["measurements"]:
            t, peak, err = m["seconds"], m["peak_bytes"], m["max_rel_error"]
            cells = [
                f"{t * 1e3:9.1f}" if t is not None else f"{'-':>9}",
                f"{m['speedup']:8.2f}x" if t is not None else f"{'-':>9}",
                f"{peak / 2**20:9.1f}" if peak is not None else f"{'-':>9}",
                f"{m['memory_ratio']:8.3f}" if peak is not None else f"{'-':>8}",
                f"{err:11.1e}" if err is not None else f"{'-':>11}",
            ]
            lines.append(f"{case['case']:<20} {m['variant']:<28} {' '.join(cells)}  {m['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=[c.name for c in CASES],
                    help="run only these cases (repeatable; default: all)")
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=EXTENT[/BLOCK]",
                    help="override a dim in every case that declares it")
    ap.add_argument("--fused", action="append", default=[], metavar="CASE=PATH.bbk",
                    help="measure this fused block program for CASE instead of fusing")
    ap.add_argument("--objective", choices=("traffic", "time"), default="traffic",
                    help="what fusion minimises on the cpu target (default: traffic)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")
    args = ap.parse_args(argv)
    try:
        overrides = {n: (e, b) for n, e, b in map(parse_dim_override, args.dim)}
    except UsageError as err:
        print(err, file=sys.stderr)
        return 2
    given = {}
    for spec in args.fused:
        name, sep, path = spec.partition("=")
        if not sep or name not in {c.name for c in CASES}:
            print(f"--fused {spec}: expected CASE=PATH.bbk with a known case", file=sys.stderr)
            return 2
        given[name] = Path(path)
    cases = [c for c in CASES if not args.case or c.name in args.case]
    report = [run_case(c, overrides, given, args.repeat, args.objective) for c in cases]
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps({
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "numpy": np.__version__, "processor": platform.processor()},
            "repeat": args.repeat, "objective": args.objective, "cases": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
