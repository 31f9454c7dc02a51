"""Transformer blocks as torch exports them, at a model's size, fused and run against onnxruntime.

`tests/models/export.py` writes seventeen transformer blocks (GPT-2, LLaMA, BERT, Mistral,
ViT, GPT-NeoX, T5, Gemma, Qwen, BLOOM, GPT-J, Phi-3, cross-attention, Falcon, Gemma 2, OPT,
CLIP), a LLaMA decode step and five blocks over images and convolutions (Swin, Stable
Diffusion's attention, ConvNeXt, Conformer's convolution module, EfficientNet's MBConv; an
image of the largest even side whose square is at most TOKENS) as model code is usually
written (a QKV projection split three ways, a buffer mask, `repeat_interleave`, an additive
padding mask, RoPE on interleaved pairs, a sliding window, SDPA, ALiBi, a KV cache grown by
`torch.cat`, rolled windows, depthwise convolutions), through torch's TorchScript exporter.  The
suite runs them at width 32; this script exports them at a model's size (default 128 tokens,
width 768, 12 heads, 4 key/value heads in the grouped-query blocks, hidden 3072: a GPT-2
small or BERT-base layer; the decode step's cache holds TOKENS - 1 tokens before the new
one) with `--torch-python`, a Python that has torch and onnx (torch is no dependency of
bbrules: a side environment), or reads blocks exported before (`--models DIR`; those not
found there are left out).  Each block is imported, fused for the cpu target (by candidates),
its native numpy module tuned (`numpy_timing.tune`: in parts or whole), checked against
torch's own outputs, and timed against onnxruntime's CPU session on the same input
(`timing.compare`: rounds, each contender after a pause).  Programs neither the rules nor the
generator were shaped after: what they find on these is what a user's export would get.

    python benchmarks/torch_blocks.py --torch-python /path/to/python [--tokens 128]
        [--width 768] [--heads 12] [--kv-heads 4] [--hidden 3072] [--rounds 5] [--json PATH]
        [--blocks decode,llama]
    python benchmarks/torch_blocks.py --models DIR      # NAME-TOKENS-WIDTH.onnx, _io.npz

Nothing is asserted: this measures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bbrules.candidates import DEFAULT_THRESHOLD, fuse_candidates, select_candidates
from bbrules.codegen import native
from bbrules.codegen.numpy_timing import tune
from bbrules.cost import fmt_bytes
from bbrules.engine import Budget
from bbrules.frontend import parse_program
from bbrules.lower import lower
from bbrules.onnx_import import import_onnx
from bbrules.packs import load_packs
from bbrules.targets import get_target
from timing import compare

EXPORT = Path(__file__).resolve().parent.parent / "tests" / "models" / "export.py"
BLOCKS = ("gpt2", "llama", "bert", "mistral", "vit", "neox", "t5", "gemma", "qwen", "decode",
          "bloom", "gptj", "phi3", "cross", "falcon", "gemma2", "opt", "clip", "swin",
          "diffusion", "convnext", "conformer", "mbconv")
# Fusion time, so that every candidate stops at its iteration limit, as on an idle machine,
# and not at its share of the default 20 s: LLaMA's block fused into 64.77 MiB, not 56.06, in
# an hour when the shared machine ran everything 20% slower.
FUSION_SECONDS = 120.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--torch-python", metavar="PYTHON",
                        help="a Python with torch and onnx, to export the blocks with")
    source.add_argument("--models", type=Path, metavar="DIR",
                        help="blocks exported before (NAME-TOKENS-WIDTH.onnx and _io.npz)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4,
                    help="key/value heads of the grouped-query blocks")
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of timed calls per runtime (`timing.compare`)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--blocks", default=",".join(BLOCKS),
                    help=f"the blocks to measure, by name (default: {','.join(BLOCKS)})")
    args = ap.parse_args()
    blocks = [b for b in args.blocks.split(",") if b]
    if unknown := set(blocks) - set(BLOCKS):
        print(f"unknown blocks: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if not native.available():
        print("no C compiler: the native module cannot be built", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.models or Path(tmp)
        if args.torch_python:
            started = time.perf_counter()
            done = subprocess.run([args.torch_python, str(EXPORT), "--tokens", str(args.tokens),
                                   "--width", str(args.width), "--heads", str(args.heads),
                                   "--kv-heads", str(args.kv_heads), "--hidden",
                                   str(args.hidden), "--out", str(folder)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(f"exporting failed: {done.stderr.strip()[-2000:]}", file=sys.stderr)
                return 2
            print(f"exported in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        stems = [folder / f"{name}-{args.tokens}-{args.width}" for name in blocks]
        for stem in stems:
            if not stem.with_suffix(".onnx").exists():
                print(f"{stem}.onnx: not found, left out", file=sys.stderr)
        rows = [measure(stem, args.rounds) for stem in stems
                if stem.with_suffix(".onnx").exists()]
    print(f"{args.tokens} tokens, width {args.width}, {args.heads} heads ({args.kv_heads} "
          f"key/value heads in the grouped-query blocks), hidden {args.hidden}; cpu target")
    print("| block | kernels | traffic | fusion | error vs torch | fused native | "
          "onnxruntime | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['block']} | {r['kernels'][0]} -> {r['kernels'][1]} | "
              f"{fmt_bytes(r['traffic'][0])} -> {fmt_bytes(r['traffic'][1])} | "
              f"{r['fusion_s']:.1f} s | {r['error']:.1e} | {r['native_ms']:.2f} ms "
              f"({r['layout']}, rounds {r['native_rounds_ms'][0]:.2f}-"
              f"{r['native_rounds_ms'][1]:.2f}) | {r['onnxruntime_ms']:.2f} ms (rounds "
              f"{r['onnxruntime_rounds_ms'][0]:.2f}-{r['onnxruntime_rounds_ms'][1]:.2f}) | "
              f"{r['ratio']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def measure(stem: Path, rounds: int) -> dict:
    """One exported block (`stem`.onnx, `stem`_io.npz): fused, checked and timed."""
    import onnxruntime
    saved = np.load(f"{stem}_io.npz")
    session = onnxruntime.InferenceSession(f"{stem}.onnx", providers=["CPUExecutionProvider"])
    feed = {i.name: saved[i.name] for i in session.get_inputs()}
    started = time.perf_counter()
    imported = import_onnx(f"{stem}.onnx")
    program = lower(parse_program(imported.text, f"{stem.name}.onnx"))
    candidates = select_candidates(program, min(DEFAULT_THRESHOLD, len(program.kernels)))
    r = fuse_candidates(program, candidates, load_packs([]), get_target("cpu"),
                        budget=Budget(seconds=FUSION_SECONDS))
    fusion = time.perf_counter() - started
    inputs = imported.bbp_inputs(feed)
    tuned = tune(r.program, inputs, native=True)
    got = imported.onnx_outputs(tuned.module.outputs(**inputs))
    error = max(float(np.abs(y - saved[n]).max() / np.abs(saved[n]).max())
                for n, y in got.items())
    timed = compare({"native": lambda: tuned.module.outputs(**inputs),
                     "onnxruntime": lambda: session.run(None, feed)}, rounds)
    ours, theirs = timed["native"], timed["onnxruntime"]
    print(f"{stem.name}: done", file=sys.stderr)
    return {"block": stem.name.split("-")[0],
            "kernels": [r.before.n_kernels, r.after.n_kernels],
            "traffic": [r.before.traffic, r.after.traffic], "fusion_s": fusion,
            "error": error, "layout": "in parts" if tuned.parts else "whole",
            "native_ms": ours.seconds * 1e3, "native_rounds_ms": [ours.low * 1e3, ours.high * 1e3],
            "onnxruntime_ms": theirs.seconds * 1e3,
            "onnxruntime_rounds_ms": [theirs.low * 1e3, theirs.high * 1e3],
            "ratio": ours.seconds / theirs.seconds}


if __name__ == "__main__":
    sys.exit(main())
