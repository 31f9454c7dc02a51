"""Matrix products on this CPU: the native product (`codegen/matmul.c`) against numpy's BLAS
and onnxruntime's MLAS, warm and after the threads went idle.

The shapes are the products of the models the README measures: a LLaMA-style layer at 128
tokens (width 256, hidden 512; a projection, the MLP's up and down products, weights [in, out]
as ONNX's MatMul has them; one head's attention scores, Q K^T with K read transposed) and
magika's convolution as one product, and the MLP's up product of a GPT-2 or BERT layer at
128 tokens (width 768, hidden 3072).  Each variant runs on every core (`--threads`, default
all): `matmul(x, y, threads)` with the weight writeable (packed into panels each call) and
read-only (a constant, as an imported model's weights are: packed once), `np.matmul`
(OpenBLAS's own threads) and an onnxruntime session of one `MatMul` whose weight is an
initializer (pre-packed at session creation, as in a model) where onnxruntime is installed.

Two timings per variant: *warm*, calls back to back (a layer's products come every
0.1-0.3 ms, workers still spinning), and *after idle*, each call after `--idle` ms of sleep
(a model called now and then: workers asleep, caches cold).  Medians over `--repeat` calls,
in rounds alternating the variants so that load from other processes weighs on all alike,
each variant's calls after a pause in which the others' threads stop spinning.
Every result is checked against a float64 product first.

    python benchmarks/bench_products.py [--repeat 200] [--idle 2] [--threads N] [--json PATH]

Nothing is asserted: this measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np

from bbrules.codegen import native
from bbrules.codegen.native_matmul import compiled_matmul

# Before each variant's calls: the other runtimes' threads spin for a while after their work,
# on the cores the next variant needs (right after 100 calls of onnxruntime's session on 2
# threads, matmul.c's q projection took 100 µs for 60; 1 s later, 60).
SETTLE_SECONDS = 1.0

ROUNDS = 5
IDLE_CALLS = 10  # per round

# Then calls for this long before the warm ones are timed: after the pause a product took
# 20 calls (3 ms) to come down from 3-5x its time to a steady one (the cores' clocks and
# caches, the workers' wake-up).
WARM_UP_SECONDS = 0.02

# (name, m, k, n, right operand transposed)
SHAPES = [
    ("llama-128 q projection", 128, 256, 256, False),
    ("llama-128 up", 128, 256, 512, False),
    ("llama-128 down", 128, 512, 256, False),
    ("llama-128 scores, one head", 128, 64, 128, True),
    ("magika convolution", 512, 1280, 512, False),
    ("768-wide MLP up", 128, 768, 3072, False),
]


def onnxruntime_product(b: np.ndarray, threads: int) -> Callable[[np.ndarray], np.ndarray] | None:
    """A session computing a @ b with b an initializer, or None without onnxruntime."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    m, (k, n) = "M", b.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "B"], ["C"])], "product",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("C", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(np.ascontiguousarray(b), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return lambda a: session.run(None, {"A": a})[0]


def timings(variants: dict[str, Callable[[], np.ndarray]], repeat: int, idle: float
            ) -> dict[str, dict[str, float]]:
    """Median µs per variant, warm and after `idle` seconds of sleep, in alternating rounds."""
    warm = {name: [] for name in variants}
    cold = {name: [] for name in variants}
    for r in range(ROUNDS):
        order = list(variants) if r % 2 else list(variants)[::-1]
        for name in order:
            fn = variants[name]
            time.sleep(SETTLE_SECONDS)
            until = time.perf_counter() + WARM_UP_SECONDS
            while time.perf_counter() < until:
                fn()
            for _ in range(max(1, repeat // ROUNDS)):
                start = time.perf_counter()
                fn()
                warm[name].append(time.perf_counter() - start)
            for _ in range(IDLE_CALLS):
                time.sleep(idle)
                start = time.perf_counter()
                fn()
                cold[name].append(time.perf_counter() - start)
    return {name: {"warm_us": statistics.median(warm[name]) * 1e6,
                   "idle_us": statistics.median(cold[name]) * 1e6} for name in variants}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200, help="warm calls per variant")
    ap.add_argument("--idle", type=float, default=2.0, help="ms of sleep before an idle call")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if not native.available():
        print("no C compiler: the native product cannot be built", file=sys.stderr)
        return 2
    matmul = compiled_matmul()
    rng = np.random.default_rng(0)
    results = []
    print(f"{args.threads} threads; medians of {args.repeat} warm calls and "
          f"{ROUNDS * IDLE_CALLS} after {args.idle:g} ms idle (µs)\n")
    print("| product | shape | variant | warm | GFLOP/s | after idle |")
    print("|---|---|---|---|---|---|")
    for name, m, k, n, transposed in SHAPES:
        a = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((n, k) if transposed else (k, n), dtype=np.float32)
        b = w.T if transposed else w
        constant = w.copy()
        constant.flags.writeable = False
        c = constant.T if transposed else constant
        want = a.astype(np.float64) @ b.astype(np.float64)
        variants = {"matmul.c": lambda a=a, b=b: matmul(a, b, args.threads),
                    "matmul.c, constant weight": lambda a=a, c=c: matmul(a, c, args.threads),
                    "numpy (BLAS)": lambda a=a, b=b: np.matmul(a, b)}
        if (session := onnxruntime_product(b, args.threads)) is not None:
            variants["onnxruntime (MLAS)"] = lambda a=a, s=session: s(a)
        for variant, fn in variants.items():
            error = np.abs(fn() - want).max() / np.abs(want).max()
            if error > 1e-5:
                print(f"{name}: {variant} is off by {error:.1e}", file=sys.stderr)
                return 1
        for variant, t in timings(variants, args.repeat, args.idle / 1e3).items():
            rate = 2 * m * k * n / (t["warm_us"] * 1e-6) / 1e9
            shape = f"{m}x{k} @ {k}x{n}{' (W^T)' if transposed else ''}"
            print(f"| {name} | {shape} | {variant} | {t['warm_us']:.1f} | {rate:.0f} | "
                  f"{t['idle_us']:.1f} |", flush=True)
            results.append({"product": name, "m": m, "k": k, "n": n, "transposed": transposed,
                            "variant": variant, "gflops": rate, **t})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "idle_ms": args.idle, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
