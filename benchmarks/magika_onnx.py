"""A real trained model through bbrules: magika's file-type classifier (`model.onnx` from the
`magika` PyPI package: 95 nodes, opset 15, exported from JAX; a one-hot through Equal + Cast,
a 5x1 convolution, GlobalMaxPool, decomposed LayerNorms, tanh-GELU).

Imports it for a batch size, fuses it as `bbrules apply` does (by candidates; if fusion finds
no program that fits the target, says why and goes on with the unfused program), runs it with
the model's own weights through the numpy backend on random byte sequences and compares with
onnxruntime on the same inputs; reports kernels, traffic and modeled time, the largest
difference and whether the predicted labels agree, and CPU times (the fused program in parts
or whole, whichever `numpy_timing.tune` timed faster; with its elementwise chains as C
loops, `codegen.native`, where a C compiler is found, and without).

    python benchmarks/magika_onnx.py [--model PATH] [--batch 1] [--target h100]

Without --model the wheel is fetched with `pip download --no-deps magika` (a package index
must be reachable).  Needs onnxruntime.  Nothing is asserted: this measures.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from bbrules.candidates import DEFAULT_THRESHOLD, PackSource, fuse_candidates, select_candidates
from bbrules.codegen import native, numpy_gen
from bbrules.codegen.numpy_timing import tune
from bbrules.cost import cost_program, fmt_bytes, fmt_time
from bbrules.extract import NoCandidate
from bbrules.frontend import parse_program
from bbrules.lower import lower
from bbrules.onnx_import import import_onnx
from bbrules.packs import load_packs
from bbrules.targets import get_target
from timing import compare

MODEL = "magika/models/standard_v3_3/model.onnx"


def fetch(into: Path) -> Path:
    """The model file out of the magika wheel."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "magika", "-d", str(into)], check=True)
    wheel = next(into.glob("magika-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(MODEL, into)
    return into / MODEL


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="magika's model.onnx (default: fetched)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--target", default="h100",
                    help="what fusion prices the program on (default: h100, whose program "
                         "ran through the numpy backend at least as fast as the cpu target's: "
                         "11.5-16.8 ms against 15.1-16.5 ms over runs on 2026-12-05)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of timed calls per runtime (`timing.compare`)")
    args = ap.parse_args()
    import onnxruntime
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else fetch(Path(tmp))
        imported = import_onnx(path, {"unk__214": (args.batch, None)})
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ast = parse_program(imported.text, "model.onnx")
    program, target = lower(ast), get_target(args.target)
    b = cost_program(program, target)
    print(f"statements {len(ast.statements)}; unfused: {b.n_kernels} kernels, traffic "
          f"{fmt_bytes(b.traffic)}, modeled time {fmt_time(b.time)}, fits {args.target}'s "
          f"local memory: {b.legal}")
    start = time.perf_counter()
    size = min(DEFAULT_THRESHOLD, len(program.kernels))
    try:
        r = fuse_candidates(program, select_candidates(program, size), load_packs([]), target,
                            source=PackSource())
        a = r.after
        print(f"fused in {time.perf_counter() - start:.1f} s: {a.n_kernels} kernels, traffic "
              f"{fmt_bytes(a.traffic)}, modeled time {fmt_time(a.time)}")
        program = r.program
    except NoCandidate as err:  # reported, and the unfused program is run instead
        print(f"not fused: {err}")
    x = np.random.default_rng(0).integers(0, 257, size=(args.batch, 2048)).astype(np.int32)
    inputs = imported.bbp_inputs({"bytes": x})
    # before onnxruntime first runs: its threads spin after its work, on the cores tuning times
    modules = {"numpy": tune(program, inputs, native=False)}
    if native.available():
        modules["native"] = tune(program, inputs, native=True)
    want = session.run(None, {"bytes": x})[0]
    unfused = numpy_gen.load(lower(ast), native=False).run
    for name, tuned in modules.items():
        got = imported.onnx_outputs(tuned.module.outputs(**inputs))["target_label"]
        print(f"{name}: largest difference from onnxruntime {np.abs(got - want).max():.2e}; "
              f"labels agree: {bool((got.argmax(-1) == want.argmax(-1)).all())}")
    timed = compare({**{name: (lambda m: lambda: m.outputs(**inputs))(tuned.module)
                        for name, tuned in modules.items()},
                     "unfused": lambda: unfused(**inputs),
                     "onnxruntime": lambda: session.run(None, {"bytes": x})}, args.rounds)
    plain, theirs = timed.pop("unfused"), timed.pop("onnxruntime")
    fused = ", ".join(f"{t.seconds * 1e3:.2f} ms {name} "
                      f"({'in parts' if modules[name].parts else 'whole'}, rounds "
                      f"{t.low * 1e3:.2f}-{t.high * 1e3:.2f}, "
                      f"{t.seconds / theirs.seconds:.2f}x onnxruntime's)"
                      for name, t in timed.items())
    print(f"CPU: fused {fused}; unfused numpy {plain.seconds * 1e3:.1f} ms; "
          f"onnxruntime {theirs.seconds * 1e3:.2f} ms (rounds {theirs.low * 1e3:.2f}-"
          f"{theirs.high * 1e3:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
