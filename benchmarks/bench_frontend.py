"""Front-end speed: parse + lower + cost of every example program (median of 5 cold runs).

The extractor costs thousands of candidate programs, and every CLI command parses and lowers
first, so these stages must stay far below a second.  Each repetition starts cold: the
per-kernel cost cache and the IR's type caches are cleared, so the numbers are what a fresh
process pays, not cache hits.

    python benchmarks/bench_frontend.py [--json] [--target h100] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bbrules import ir
from bbrules.cost import clear_cache, cost_program
from bbrules.frontend import load_program
from bbrules.lower import lower
from bbrules.targets import Target, get_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _cold() -> None:
    clear_cache()
    ir.type_of.cache_clear()
    ir.sched_deps.cache_clear()


def measure(path: Path, target: Target, repeat: int) -> dict[str, object]:
    """Median seconds of each stage over `repeat` cold runs of one example."""
    stages: dict[str, list[float]] = {"parse": [], "lower": [], "cost": []}
    kernels = 0
    for _ in range(repeat):
        _cold()
        t0 = time.perf_counter()
        program = load_program(path)
        t1 = time.perf_counter()
        block = lower(program)
        t2 = time.perf_counter()
        report = cost_program(block, target)
        t3 = time.perf_counter()
        for stage, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2)):
            stages[stage].append(dt)
        kernels = report.n_kernels
    medians = {stage: statistics.median(ts) for stage, ts in stages.items()}
    total = statistics.median(map(sum, zip(*stages.values())))
    return {"example": path.name, "kernels": kernels, **medians, "total": total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--target", default="h100", help="a built-in target or a .toml file")
    parser.add_argument("--repeat", type=int, default=5, help="runs per example (median)")
    args = parser.parse_args(argv)
    target = get_target(args.target)
    rows = [measure(p, target, args.repeat) for p in sorted(EXAMPLES.glob("*.bbp"))]
    if args.json:
        print(json.dumps({"target": target.name, "repeat": args.repeat, "seconds": rows},
                         indent=2))
        return 0
    print(f"{'example':26} {'kernels':>7} {'parse':>9} {'lower':>9} {'cost':>9} {'total':>9}")
    for r in rows:
        times = " ".join(f"{r[s] * 1e3:7.2f}ms" for s in ("parse", "lower", "cost", "total"))
        print(f"{r['example']:26} {r['kernels']:>7} {times}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
