"""A LLaMA-style decoder stack as an ONNX model, imported and fused by bbrules.

Token ids in, an embedding lookup (Gather), then per layer: RMSNorm, Q/K/V projections
(grouped-query: fewer K/V heads), rotate-half RoPE written as an exporter writes it (Slice,
Neg, Concat), the opset-23 `Attention` operator with `is_causal`, the output projection and
residual, RMSNorm, a SwiGLU MLP and residual.  The
script builds the model with `onnx.helper`, imports it, fuses it (by candidates above the
threshold) and reports per layer count: statements, kernels before and after, modeled time
and traffic, the candidates (and how many distinct ones were fused), wall time of import
plus fusion; with `--check`, the fused program's outputs against
ONNX's reference evaluator on random inputs; with `--cpu`, its numpy code's time (in parts or
whole, whichever `numpy_timing.tune` timed faster) against onnxruntime's.

    python benchmarks/llama_onnx.py [--layers 1,4,32] [--tokens 128] [--width 256]
                                    [--vocab 1024] [--check] [--cpu [--save DIR]]

Nothing is asserted: this measures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bbrules.codegen import native, numpy_gen
from bbrules.codegen.numpy_runtime import default_threads
from bbrules.codegen.numpy_timing import tune
from bbrules.cost import fmt_bytes, fmt_time
from bbrules.engine import Budget
from bbrules.candidates import DEFAULT_THRESHOLD, fuse_candidates, select_candidates
from bbrules.frontend import parse_program
from bbrules.lower import lower
from bbrules.onnx_import import import_onnx
from bbrules.packs import load_packs
from bbrules.targets import get_target
from timing import compare


def llama(layers: int, tokens: int, width: int, heads: int, kv_heads: int, hidden: int,
          vocab: int, seed: int = 0) -> onnx.ModelProto:
    """The model: token ids IDS[1, tokens] (int64) -> hidden states Y[1, tokens, width]."""
    rng = np.random.default_rng(seed)
    d = width // heads
    inits, nodes = [], []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def weight(name: str, *shape: int) -> str:
        return const(name, (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))

    def node(op: str, inputs: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    pos = np.arange(tokens)[:, None] / (10000 ** (np.arange(d // 2) * 2 / d))[None, :]
    cos = const("cos", np.concatenate([np.cos(pos)] * 2, axis=1).astype(np.float32))
    sin = const("sin", np.concatenate([np.sin(pos)] * 2, axis=1).astype(np.float32))
    half = [const("h0", np.array([0], np.int64)), const("h1", np.array([d // 2], np.int64)),
            const("h2", np.array([d], np.int64)), const("ax", np.array([3], np.int64))]

    def rope(x: str, tag: str) -> str:
        x1 = node("Slice", [x, half[0], half[1], half[3]], f"{tag}_x1")
        x2 = node("Slice", [x, half[1], half[2], half[3]], f"{tag}_x2")
        rot = node("Concat", [node("Neg", [x2], f"{tag}_nx2"), x1], f"{tag}_rot", axis=3)
        return node("Add", [node("Mul", [x, cos], f"{tag}_c"),
                            node("Mul", [rot, sin], f"{tag}_s")], f"{tag}_rope")

    def heads_of(x: str, n: int, tag: str) -> str:
        shape = const(f"{tag}_shape", np.array([1, tokens, n, d], np.int64))
        return node("Transpose", [node("Reshape", [x, shape], f"{tag}_4")], f"{tag}_t",
                    perm=[0, 2, 1, 3])

    x = node("Gather", [weight("embed", vocab, width), "IDS"], "X")
    for i in range(layers):
        p = f"l{i}"
        xn = node("RMSNormalization", [x, const(f"{p}_g1", np.ones(width, np.float32))],
                  f"{p}_xn", axis=-1, epsilon=1e-5)
        q = heads_of(node("MatMul", [xn, weight(f"{p}_wq", width, width)], f"{p}_q"), heads,
                     f"{p}_q")
        k = heads_of(node("MatMul", [xn, weight(f"{p}_wk", width, kv_heads * d)], f"{p}_k"),
                     kv_heads, f"{p}_k")
        v = heads_of(node("MatMul", [xn, weight(f"{p}_wv", width, kv_heads * d)], f"{p}_v"),
                     kv_heads, f"{p}_v")
        a = node("Attention", [rope(q, f"{p}_q"), rope(k, f"{p}_k"), v], f"{p}_a", is_causal=1)
        merged = const(f"{p}_merged", np.array([1, tokens, width], np.int64))
        o = node("Reshape", [node("Transpose", [a], f"{p}_at", perm=[0, 2, 1, 3]), merged],
                 f"{p}_o")
        h = node("Add", [x, node("MatMul", [o, weight(f"{p}_wo", width, width)], f"{p}_proj")],
                 f"{p}_h")
        hn = node("RMSNormalization", [h, const(f"{p}_g2", np.ones(width, np.float32))],
                  f"{p}_hn", axis=-1, epsilon=1e-5)
        gate = node("MatMul", [hn, weight(f"{p}_w1", width, hidden)], f"{p}_gate")
        up = node("MatMul", [hn, weight(f"{p}_w3", width, hidden)], f"{p}_up")
        act = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate], f"{p}_sg")], f"{p}_silu"),
                           up], f"{p}_act")
        x = node("Add", [h, node("MatMul", [act, weight(f"{p}_w2", hidden, width)], f"{p}_down")],
                 f"{p}_y")
    nodes.append(helper.make_node("Identity", [x], ["Y"]))
    graph = helper.make_graph(
        nodes, "llama", [helper.make_tensor_value_info("IDS", TensorProto.INT64, [1, tokens])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, tokens, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,4")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--target", help="what fusion prices the program on (default: h100, or "
                                     "cpu with --cpu, the machine the numpy backend runs on)")
    ap.add_argument("--seconds", type=float, default=Budget.seconds,
                    help="the fusion budget, the same whatever the layer count")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--cpu", action="store_true",
                    help="time the fused model through the numpy backend against onnxruntime "
                         "(when installed) on the same input")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --cpu, rounds of timed calls per runtime (`timing.compare`)")
    ap.add_argument("--save", type=Path, metavar="DIR",
                    help="with --cpu, write each layer count's native module and its inputs "
                         "into DIR (llama-L.py, llama-L-inputs.npz), for benchmarks/paired.py")
    args = ap.parse_args()
    target = get_target(args.target or ("cpu" if args.cpu else "h100"))
    pack = load_packs([])
    print("| layers | statements | kernels | traffic | modeled time | candidates (distinct) "
          "| import | fusion |")
    print("|---|---|---|---|---|---|---|---|")
    for layers in map(int, args.layers.split(",")):
        model = llama(layers, args.tokens, args.width, args.heads, args.kv_heads, args.hidden,
                      args.vocab)
        began = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "llama.onnx"
            onnx.save(model, str(path))
            imported = import_onnx(path)
        ast = parse_program(imported.text, "llama.onnx")
        program = lower(ast)
        start = time.perf_counter()
        loading = start - began
        size = DEFAULT_THRESHOLD if len(program.kernels) > DEFAULT_THRESHOLD else len(
            program.kernels)
        r = fuse_candidates(program, select_candidates(program, size), pack, target,
                            budget=Budget(seconds=args.seconds))
        wall = time.perf_counter() - start
        b, a = r.before, r.after
        distinct = sum(c.reused_from is None for c in r.candidates)
        print(f"| {layers} | {len(ast.statements)} | {b.n_kernels} -> {a.n_kernels} | "
              f"{fmt_bytes(b.traffic)} -> {fmt_bytes(a.traffic)} | {fmt_time(b.time)} -> "
              f"{fmt_time(a.time)} | {len(r.candidates)} ({distinct}) | {loading:.1f} s | "
              f"{wall:.1f} s |",
              flush=True)
        if args.check:
            from onnx.reference import ReferenceEvaluator
            feed = token_ids(args, seed=1)
            want = ReferenceEvaluator(model).run(None, feed)[0]
            got = imported.onnx_outputs(numpy_gen.run(r.program, imported.bbp_inputs(feed)))
            err = np.abs(got["Y"] - want).max() / np.abs(want).max()
            print(f"  layers={layers}: max error relative to max |Y|: {err:.2e}", file=sys.stderr)
        if args.cpu:
            print(f"  layers={layers}: {cpu_times(model, imported, r.program, args, layers)}",
                  file=sys.stderr)
    return 0


def token_ids(args, seed: int) -> dict[str, np.ndarray]:
    """Random token ids, the model's input."""
    ids = np.random.default_rng(seed).integers(0, args.vocab, size=(1, args.tokens))
    return {"IDS": ids.astype(np.int64)}


def cpu_times(model: onnx.ModelProto, imported, program, args, layers: int) -> str:
    """Median wall times on this machine (`timing.compare`: rounds, each contender after a
    pause): the fused program's generated numpy code (in parts or whole, whichever `tune`
    timed faster), without and with native groups (where a C compiler is found), against
    onnxruntime's CPU session of the same model, on the same input.  With `--save`, the
    native module's source and the inputs are written first."""
    feed = token_ids(args, seed=2)
    inputs = imported.bbp_inputs(feed)
    modules = {"numpy": tune(program, inputs, native=False)}
    if native.available():
        modules["native"] = tune(program, inputs, native=True)
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            generated = numpy_gen.generate_module(program, threads=default_threads(),
                                                  split=modules["native"].parts, native=True)
            (args.save / f"llama-{layers}.py").write_text(generated.source)
            np.savez(args.save / f"llama-{layers}-inputs.npz", **inputs)

    contenders = {name: (lambda m: lambda: m.outputs(**inputs))(tuned.module)
                  for name, tuned in modules.items()}
    try:
        import onnxruntime
    except ImportError:
        pass
    else:
        session = onnxruntime.InferenceSession(model.SerializeToString(),
                                               providers=["CPUExecutionProvider"])
        contenders["onnxruntime"] = lambda: session.run(None, feed)
    timed = compare(contenders, args.rounds)
    theirs = timed.pop("onnxruntime", None)
    return ", ".join(
        f"{name} {t.seconds * 1e3:.2f} ms {'in parts' if modules[name].parts else 'whole'}"
        f" (rounds {t.low * 1e3:.2f}-{t.high * 1e3:.2f}"
        + (f"; {t.seconds / theirs.seconds:.2f}x onnxruntime's)" if theirs else ")")
        for name, t in timed.items()) + (
        f"; onnxruntime {theirs.seconds * 1e3:.2f} ms (rounds {theirs.low * 1e3:.2f}-"
        f"{theirs.high * 1e3:.2f})" if theirs else " (onnxruntime is not installed)")


if __name__ == "__main__":
    sys.exit(main())
