"""How accurate fused LayerNorm + matmul is when rows have a large mean.

`examples/layernorm_matmul.bbp`, resized (default m = 128/32, e = 256/64, n = 128/64, the mean
constant set to 1/e), runs unfused and fused (standard pack, h100 target) on inputs whose rows
have mean/std = 0, 1, 10 and 100 (X = ratio + a standard normal draw; G, B and W standard
normal), with the inputs declared f32, bf16 or f16 (their values rounded to that type).  Each
program runs through the numpy backend and the reference interpreter; the error is norm-wise,
||Y - Y64|| / ||Y64||, against the float64 dense evaluation of the same rounded inputs
(`bbrules.verdict.Comparison`).

The backends compute in float32 whatever the storage type.  For 16-bit inputs the table also
shows `op16`: the interpreter with every block contraction's operands rounded to the input
type, as tensor cores take them (accumulation stays float32).  This is where cancellation in a
fused form shows most.

    python benchmarks/bench_norm_accuracy.py [--dim m=128/32 ...] [--seed 0] [--json PATH]

`ratio` is the fused error over the unfused one per column.  Nothing is asserted here;
tests/test_norm_numerics.py holds the fused program to a factor of the unfused one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np

from bbrules import dense, interp
from bbrules.codegen import numpy_gen
from bbrules.codegen.cuda_gen import from_storage, to_storage
from bbrules.frontend import parse_dim_override, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import BlockProgram
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.program import Program
from bbrules.targets import get_target
from bbrules.verdict import Comparison

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "layernorm_matmul.bbp"
DIMS = {"m": (128, 32), "e": (256, 64), "n": (128, 64)}
RATIOS = (0.0, 1.0, 10.0, 100.0)
DTYPES = ("f32", "bf16", "f16")


def layernorm_matmul(dtype: str, dims: dict[str, tuple[int, int | None]]) -> Program:
    """The example with its inputs declared `dtype`, resized to `dims`, its mean over e."""
    text = EXAMPLE.read_text().replace(": f32", f": {dtype}")
    extent = dims.get("e", (4096, None))[0]
    text = text.replace("0.000244140625", repr(1.0 / extent))
    return parse_program(text, str(EXAMPLE), dims)


def inputs_for(program: Program, ratio: float, dtype: str, seed: int) -> dict[str, np.ndarray]:
    """Standard-normal inputs, X shifted by `ratio` (mean/std of its rows), rounded to `dtype`."""
    inputs = random_inputs(program, seed)
    inputs["X"] = inputs["X"] + np.float32(ratio)
    return {k: from_storage(to_storage(v, dtype), dtype) for k, v in inputs.items()}


@contextlib.contextmanager
def operands_rounded_to(dtype: str):
    """The interpreter's contractions round their operands to `dtype` (tensor-core inputs)."""
    exact = interp._dot

    def rounded(axis, x, y):
        def r(t):
            return interp.Tile(t.axes, from_storage(to_storage(t.data, dtype), dtype))
        return exact(axis, r(x), r(y))
    interp._dot = rounded
    try:
        yield
    finally:
        interp._dot = exact


def backends(dtype: str) -> dict:
    runs = {"numpy": numpy_gen.run, "interp": interp.run}
    if dtype != "f32":
        def op16(p: BlockProgram, x: dict) -> dict:
            with operands_rounded_to(dtype):
                return interp.run(p, x)
        runs["op16"] = op16
    return runs


def error(program: Program, block: BlockProgram, run, inputs: dict) -> float:
    want = dense.evaluate(program, inputs, dtype=np.float64)["Y"]
    got = run(block, inputs)["Y"]
    return Comparison.of(got, want, "f32", 1).error


def measure(dims: dict, seed: int) -> list[dict]:
    pack, target = load_packs([]), get_target("h100")
    rows = []
    for dtype in DTYPES:
        program = layernorm_matmul(dtype, dims)
        unfused = lower(program)
        fused = fuse(unfused, pack, target).program
        assert len(fused.kernels) == 1, "layernorm + matmul did not fuse to one kernel"
        for ratio in RATIOS:
            inputs = inputs_for(program, ratio, dtype, seed)
            for backend, run in backends(dtype).items():
                u = error(program, unfused, run, inputs)
                f = error(program, fused, run, inputs)
                rows.append({"dtype": dtype, "mean_over_std": ratio, "backend": backend,
                             "unfused": u, "fused": f, "ratio": f / u if u else None})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'dtype':<6}{'mean/std':>9}  {'backend':<8}{'unfused':>11}{'fused':>11}"
             f"{'ratio':>8}"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(f"{r['dtype']:<6}{r['mean_over_std']:>9g}  {r['backend']:<8}"
                     f"{r['unfused']:>11.3g}{r['fused']:>11.3g}{ratio:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=EXTENT[/BLOCK]",
                        help="resize a dimension (default m=128/32, e=256/64, n=128/64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': stdout)")
    args = parser.parse_args(argv)
    dims = dict(DIMS)
    for d in args.dim:
        name, extent, block = parse_dim_override(d)
        dims[name] = (extent, block)
    rows = measure(dims, args.seed)
    if args.json == "-":
        print(json.dumps(rows, indent=2))
        return 0
    print(f"layernorm_matmul, m = {dims['m']}, e = {dims['e']}, n = {dims['n']} "
          f"(extent, block); norm-wise error against float64")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
