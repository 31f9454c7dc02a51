"""The kernels fusion chooses, case by case: the figures behind the cost model's choices.

For each case (a program, a target, sizes) this fuses the unfused lowering with the standard
pack under the default objective and reports: kernels before and after, global traffic and
modeled time before and after, whether a tensor over both sequence axes (attention scores) is
stored, the work by unit (matrix, special-function, vector), the runner-up with its margin, and
the launches: each kernel's grid and the tensors it stores.  The cases are those issue 9 asks
about that the IR can say today: attention at N = 4096 on h100 and h200 and at N = 512,
decode-time attention (split over keys), the decoder layer, the norm examples, and the kernels of several stores (the paper's first figure,
softmax over a blocked row, a residual add with RMSNorm, RMSNorm with Q, K and V projections).  (Numerical accuracy of the
fused LayerNorm is `bench_norm_accuracy.py`'s.)

    python benchmarks/bench_kernels.py [--json PATH]

Nothing here is asserted: the test suite checks the properties, this prints the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bbrules.cost import fmt_bytes, fmt_time
from bbrules.frontend import load_program
from bbrules.fuse import fuse
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@dataclass(frozen=True)
class Case:
    name: str
    example: str
    target: str
    dims: dict[str, tuple[int, int]] | None = None
    sequence: tuple[str, str] | None = None  # the query and key axes, if it attends


CASES = (
    Case("attention N=4096", "attention", "h100", sequence=("q", "k")),
    Case("attention N=4096", "attention", "h200", sequence=("q", "k")),
    Case("attention N=512", "attention", "h100", {"q": (512, 64), "k": (512, 64)}, ("q", "k")),
    Case("attention N=512", "attention", "h200", {"q": (512, 64), "k": (512, 64)}, ("q", "k")),
    Case("self-attention N=1024", "self_attention", "h100", sequence=("s", "t")),
    Case("causal attention 8 heads, N=4096", "causal_attention", "h100", sequence=("q", "k")),
    Case("causal attention 1 head, N=4096", "causal_attention", "h100", {"h": (1, 1)},
         ("q", "k")),
    Case("decode attention 32 heads, 32k keys", "decode_attention", "h100", sequence=("h", "k")),
    Case("decode attention 8 heads, 1k keys", "decode_attention", "h100",
         {"h": (8, 1), "k": (1024, 64)}, ("h", "k")),
    Case("decoder layer", "decoder_layer", "h100", sequence=("s", "t")),
    Case("layernorm + matmul", "layernorm_matmul", "h100"),
    Case("LM head + cross-entropy, vocabulary 50257", "lm_head_cross_entropy", "h100",
         sequence=("t", "v")),
    Case("rmsnorm + FFN-SwiGLU", "rmsnorm_ffn_swiglu", "h100"),
    Case("c = a + b, d = rowsum(b)", "rowsum_add", "h100"),
    Case("softmax r=4096/64", "softmax", "h100"),
    Case("softmax r=4096/16", "softmax", "h100", {"r": (4096, 16)}),
    Case("residual + rmsnorm", "residual_rmsnorm", "h100"),
    Case("rmsnorm + QKV t=4096", "rmsnorm_qkv", "h100"),
    Case("rmsnorm + QKV t=16384", "rmsnorm_qkv", "h100", {"t": (16384, 64)}),
)


def measure(case: Case, pack) -> dict:
    program = lower(load_program(EXAMPLES / f"{case.example}.bbp", case.dims))
    start = time.perf_counter()
    r = fuse(program, pack, get_target(case.target))
    seconds = time.perf_counter() - start
    scores = None
    if case.sequence is not None:
        scores = any(set(case.sequence) <= set(t.axes) for t in r.program.tensors.values()
                     if t.role == "temp")
    runner = r.runner_up
    margin = r.margin()
    return {
        "case": case.name, "target": case.target, "apply_s": seconds,
        "kernels": [r.before.n_kernels, r.after.n_kernels],
        "traffic": [r.before.traffic, r.after.traffic],
        "time": [r.before.time, r.after.time],
        "scores_stored": scores,
        "work": r.after.work.to_json(),
        "launches": [f"[{','.join(k.grid)}]:{','.join(k.tensors)}" for k in r.program.kernels],
        "runner_up": None if runner is None else {
            "kernels": runner.n_kernels, "time": runner.time, "time_margin": margin[0],
            "traffic_ratio": margin[1]},
    }


def row(m: dict) -> str:
    ru = m["runner_up"]
    second = "-" if ru is None else (f"{ru['kernels']}k {fmt_time(ru['time'])} "
                                     f"({ru['time_margin']:+.1%}, traffic {ru['traffic_ratio']:.2f}x)")
    scores = {None: "-", True: "stored", False: "never"}[m["scores_stored"]]
    return (f"{m['case']:24} {m['target']:5} {m['kernels'][0]:3} -> {m['kernels'][1]:<3} "
            f"{fmt_bytes(m['traffic'][0]):>11} -> {fmt_bytes(m['traffic'][1]):<11} "
            f"{fmt_time(m['time'][0]):>10} -> {fmt_time(m['time'][1]):<10} {scores:7} "
            f"{m['apply_s']:6.1f} s  {second:40} {' '.join(m['launches'])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    pack = load_packs([])
    print(f"{'case':24} {'target':5} {'kernels':10} {'traffic':26} {'modeled time':24} "
          f"{'scores':7} {'apply':8}  {'runner-up':40} launches")
    results = []
    for case in CASES:
        results.append(measure(case, pack))
        print(row(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
