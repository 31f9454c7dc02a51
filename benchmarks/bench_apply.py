"""How long `bbrules apply` takes: per example, and as programs grow.

For every example program, and for chains of 1, 2, 4 and 8 attention blocks (each block's
output is the next block's queries) and of MLP blocks (each block's output is the next block's
input), this fuses the unfused lowering with the standard pack and reports: the time to apply
(saturation plus extraction, median of `--repeat` runs), the e-graph's size when saturation
ended (e-nodes, e-classes) and what ended it, the candidates extraction priced and how, and
the kernel count and global traffic before and after.

    python benchmarks/bench_apply.py [--target h100] [--repeat 3] [--chains 1,2,4,8]
                                     [--json PATH]

Nothing here is asserted: the test suite checks what fusion produces, this measures its speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bbrules.frontend import load_program, parse_program
from bbrules.fuse import FuseResult, fuse
from bbrules.ir import BlockProgram
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.rule import RulePack
from bbrules.targets import Target, get_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def attention_chain(n: int) -> str:
    """n attention blocks: block i attends with the previous block's output as its queries."""
    lines = ["dim q = 4096 / 64", "dim k = 4096 / 64", "dim d = 64",
             "input Q0[q, d], K[k, d], V[k, d] : f32"]
    for i in range(1, n + 1):
        lines += [f"S{i}[q, k] = sum[d] Q{i - 1}[q, d] * K[k, d] * 0.125",
                  f"M{i}[q] = max[k] S{i}[q, k]",
                  f"E{i}[q, k] = exp(S{i}[q, k] - M{i}[q])",
                  f"L{i}[q] = sum[k] E{i}[q, k]",
                  f"P{i}[q, k] = E{i}[q, k] / L{i}[q]",
                  f"Q{i}[q, d] = sum[k] P{i}[q, k] * V[k, d]"]
    lines.append(f"output Q{n}")
    return "\n".join(lines) + "\n"


def mlp_chain(n: int) -> str:
    """n GELU MLP blocks: X_i = gelu(X_{i-1} W1_i) W2_i."""
    weights = ", ".join(f"W1_{i}[e, f], W2_{i}[f, e]" for i in range(1, n + 1))
    lines = ["dim m = 2048 / 32", "dim e = 2048 / 64", "dim f = 8192 / 64",
             f"input X0[m, e], {weights} : f32"]
    for i in range(1, n + 1):
        lines += [f"H{i}[m, f] = gelu(sum[e] X{i - 1}[m, e] * W1_{i}[e, f])",
                  f"X{i}[m, e] = sum[f] H{i}[m, f] * W2_{i}[f, e]"]
    lines.append(f"output X{n}")
    return "\n".join(lines) + "\n"


def measure(name: str, program: BlockProgram, pack: RulePack, target: Target,
            repeat: int) -> dict:
    times = []
    result: FuseResult | None = None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fuse(program, pack, target)
        times.append(time.perf_counter() - start)
    assert result is not None
    last = result.stats[-1]
    return {
        "case": name,
        "seconds": statistics.median(times),
        "saturation_seconds": sum(s.seconds for s in result.stats),
        "extraction_seconds": result.extraction.seconds,
        "iterations": sum(s.iterations for s in result.stats),
        "enodes": last.enodes,
        "eclasses": last.eclasses,
        "stop": result.stop,
        "method": result.extraction.method,
        "candidates": result.extraction.candidates,
        "kernels_before": result.before.n_kernels,
        "kernels_after": result.after.n_kernels,
        "traffic_before": result.before.traffic,
        "traffic_after": result.after.traffic,
    }


def cases(chains: list[int]) -> list[tuple[str, BlockProgram]]:
    out = [(path.stem, lower(load_program(path))) for path in sorted(EXAMPLES.glob("*.bbp"))]
    for n in chains:
        out.append((f"attention-chain-{n}",
                    lower(parse_program(attention_chain(n), f"attention-chain-{n}.bbp"))))
    for n in chains:
        out.append((f"mlp-chain-{n}", lower(parse_program(mlp_chain(n), f"mlp-chain-{n}.bbp"))))
    return out


def table(rows: list[dict]) -> str:
    head = ("case", "apply", "saturate", "extract", "iters", "e-nodes", "e-classes", "stop",
            "extraction", "kernels", "traffic ratio")
    body = [(r["case"], f"{r['seconds'] * 1e3:.0f} ms", f"{r['saturation_seconds'] * 1e3:.0f} ms",
             f"{r['extraction_seconds'] * 1e3:.0f} ms", str(r["iterations"]), str(r["enodes"]),
             str(r["eclasses"]), r["stop"], f"{r['method']} ({r['candidates']})",
             f"{r['kernels_before']} -> {r['kernels_after']}",
             f"{r['traffic_before'] / r['traffic_after']:.2f}x") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i in (0, 7, 8) else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [head, *body]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chains", default="1,2,4,8", help="chain lengths, comma-separated")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    pack = load_packs([])
    target = get_target(args.target)
    chains = [int(n) for n in args.chains.split(",") if n]
    rows = []
    for name, program in cases(chains):
        rows.append(measure(name, program, pack, target, args.repeat))
        print(f"{name}: {rows[-1]['seconds'] * 1e3:.0f} ms", file=sys.stderr)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"target": target.name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
