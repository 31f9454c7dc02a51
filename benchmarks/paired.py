"""Two generated numpy modules of one program, timed against each other call by call.

The way to see whether a change to the generator or its runtime pays on a machine as noisy as
the 2-core Xeon, where one module timed in rounds ranges over 40%: generate the program's
module before and after the change (`bbrules codegen PROGRAM --backend numpy -o FILE`, or
`llama_onnx.py --cpu --save DIR`, which also writes the inputs), then

    python benchmarks/paired.py BASE.py VARIANT.py --inputs INPUTS.npz [--pairs 2000]
                                [--blocks 4] [--json PATH]

Both modules run in this process with the runtime installed here, so this measures changes
to the generated code, not to the runtime (`bbrules.codegen.numpy_runtime`, `matmul.c`),
which both modules then share.  The inputs are read-only, as an imported model's weights are,
so that a module lays out a weight for its product once (`relaid`), as it does in the
benchmarks that import the model.  The modules' outputs are compared first; each
block of pairs then prints the median time of each and the median ratio of the pairs
(`timing.paired`).  Nothing is asserted: this measures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bbrules.codegen.numpy_gen import module_from_source
from timing import paired


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path, help="the generated module timed as the baseline")
    ap.add_argument("variant", type=Path, help="the generated module compared with it")
    ap.add_argument("--inputs", type=Path, required=True,
                    help="an .npz of the program's inputs by name")
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--json", type=Path, help="also write the blocks' figures here")
    args = ap.parse_args()
    try:
        base, variant = (module_from_source(path.read_text()) for path in
                         (args.base, args.variant))
        with np.load(args.inputs) as npz:
            inputs = {name: np.array(npz[name]) for name in npz.files}
        for array in inputs.values():
            array.flags.writeable = False
        want, got = base.outputs(**inputs), variant.outputs(**inputs)
    except (OSError, SyntaxError, ValueError) as e:  # (a missing input is a ValueError)
        print(f"paired.py: {e}", file=sys.stderr)
        return 2
    if want.keys() != got.keys():
        print(f"paired.py: the modules return {sorted(want)} and {sorted(got)}",
              file=sys.stderr)
        return 2
    for name in want:
        scale = max(float(np.abs(want[name]).max(initial=0.0)), 1e-30)
        err = float(np.abs(got[name] - want[name]).max(initial=0.0)) / scale
        print(f"{name}: the variant's largest difference is {err:.1e} of the largest |value|")
    blocks = paired(lambda: base.outputs(**inputs), lambda: variant.outputs(**inputs),
                    args.pairs, args.blocks)
    print("| block | base | variant | median ratio of pairs |")
    print("|---|---|---|---|")
    for i, b in enumerate(blocks, 1):
        print(f"| {i} | {b.base * 1e6:.1f} µs | {b.variant * 1e6:.1f} µs | {b.ratio:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(
            {"base": str(args.base), "variant": str(args.variant), "pairs": args.pairs,
             "blocks": [vars(b) for b in blocks]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
