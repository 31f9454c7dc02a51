"""ONNX's backend test cases for the operators of transformer inference, through bbrules:
import -> fuse (standard pack) -> numpy backend, compared with the expected outputs the onnx
package computes.  Prints passed / failed / not supported per operator (a markdown table), and
the reason of each refusal with `--why`.

    python benchmarks/onnx_conformance.py [--ops MatMul,Softmax] [--no-fuse] [--why]
                                          [--json PATH]

Cases whose name ends in `_expanded` run the operator's ONNX function definition instead of
the operator.  Nothing is asserted here; tests/test_onnx_import.py runs a fixed subset.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from bbrules.codegen import numpy_gen
from bbrules.engine import Budget
from bbrules.fuse import fuse
from bbrules.onnx_conformance import Outcome, backend_cases, run_case
from bbrules.packs import load_packs
from bbrules.targets import get_target

OPERATORS = ["MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Pow", "Exp", "Log", "Sqrt",
             "Reciprocal", "Tanh", "Sigmoid", "Relu", "Erf", "Gelu", "Softmax", "LogSoftmax",
             "ReduceSum", "ReduceMean", "ReduceMax", "LayerNormalization", "RMSNormalization",
             "Attention", "RotaryEmbedding", "Transpose", "Reshape", "Squeeze", "Unsqueeze",
             "Slice", "Concat", "Split", "Expand", "Where", "Equal", "Less", "Greater", "Cast",
             "Constant", "Identity", "Conv", "Gather", "Pad"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPERATORS))
    ap.add_argument("--no-fuse", action="store_true", help="run the unfused lowering")
    ap.add_argument("--why", action="store_true", help="list each case not passed and why")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    pack, target = load_packs([]), get_target("h100")
    budget = Budget(seconds=20.0)

    def execute(program, inputs):
        if not args.no_fuse:
            program = fuse(program, pack, target, budget=budget).program
        return numpy_gen.run(program, inputs)

    rows: dict[str, list[Outcome]] = {}
    start = time.perf_counter()
    for op in args.ops.split(","):
        rows[op] = [run_case(case, execute) for case in backend_cases([op])]
        counts = Counter(o.status for o in rows[op])
        print(f"{op}: {dict(counts)} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    print("| operator | passed | failed | not supported |\n|---|---|---|---|")
    total: Counter = Counter()
    for op, outcomes in rows.items():
        c = Counter(o.status for o in outcomes)
        total += c
        print(f"| {op} | {c['passed']} | {c['failed']} | {c['unsupported']} |")
    print(f"| **all** | {total['passed']} | {total['failed']} | {total['unsupported']} |")
    if args.why:
        for op, outcomes in rows.items():
            for o in outcomes:
                if o.status != "passed":
                    print(f"- {o.case}: {o.status}: {o.detail[:300]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({op: [o.__dict__ for o in outs] for op, outs in rows.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
