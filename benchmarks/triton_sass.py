"""What the Triton backend's kernels compile to, without a GPU: every example fused (h100) and
compiled for sm_90a by Triton's own toolchain, one row per kernel: its `tl.dot`s, the
tensor-core instructions (HGMMA warpgroup and HMMA warp MMAs) and asynchronous global-to-shared copies
(LDGSTS) in its SASS, registers per thread, local memory (spills) and shared memory.

    python benchmarks/triton_sass.py [--precision tf32|tf32x3|ieee] [--json PATH] [EXAMPLE ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bbrules.codegen import triton_gen
from bbrules.frontend import load_program
from bbrules.fuse import fuse
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("examples", nargs="*", help="example stems (default: all)")
    ap.add_argument("--precision", choices=triton_gen.PRECISIONS, default="tf32")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    pack, target = load_packs([]), get_target("h100")
    rows = []
    print("| example | kernel | tl.dot | HGMMA | HMMA | LDGSTS | registers | spills (B) | "
          "shared (KiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sorted(EXAMPLES.glob("*.bbp")):
        if args.examples and path.stem not in args.examples:
            continue
        fused = fuse(lower(load_program(path)), pack, target).program
        module = triton_gen.generate(fused, target, args.precision)
        start = time.perf_counter()
        compiled = triton_gen.compile_offline(module)
        seconds = time.perf_counter() - start
        for k in module.kernels:
            c = compiled[k.name]
            row = {"example": path.stem, "kernel": k.name, "dots": k.dots,
                   "hgmma": c.count("HGMMA"), "hmma": c.count("HMMA"),
                   "ldgsts": c.count("LDGSTS"),
                   "registers": c.registers, "spill_bytes": c.local_bytes,
                   "shared_bytes": c.shared_bytes, "compile_s": seconds}
            rows.append(row)
            print(f"| {path.stem} | {k.name} | {k.dots} | {row['hgmma']} | {row['hmma']} | "
                  f"{row['ldgsts']} | "
                  f"{c.registers} | {c.local_bytes} | {c.shared_bytes / 1024:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
