"""Run a bbrules GPU kit: check every generated kernel against torch and time it against
torch's own kernels, on a machine that has torch, triton, cupy and numpy and nothing else.

    python runner.py --out RESULTS [--minutes 7] [--only NAME ...]
    python runner.py --out RESULTS --interpret     # no GPU: Triton's interpreter, tiny cases

The interpreter checks the runner and f32 numerics only: it multiplies bf16 `tl.dot` operands
wrongly, so bf16 errors under `--interpret` mean nothing.

`bbrules gpukit DIR` wrote this file beside `cases.json` and `kernels/`.  For each case and
each of its key-block variants, the module's own `tune` picks each kernel's warps and
pipeline stages (`KIT_CONFIGS`: 4 or 8 warps, 3 stages) by timing; the tuned program's output
is compared with a float32 torch reference, and the fastest correct variant is the case's
figure.  The baseline is
`torch.nn.functional.scaled_dot_product_attention` in the case's dtype for attention (flash or
memory-efficient kernels) and cuBLAS through `torch.matmul` for the matmul-shaped cases.  The
CUDA C kernels (CuPy), where the kit has them, are checked and timed too.  Times are medians
of CUDA-event timings after a warm-up, two ways for both sides: whole calls from Python, and
the replay of a CUDA graph captured from one call (the GPU's time without Python's launch
cost, which is most of a small case's call; `tune` ranks configurations by it).  The graph's
output is checked too, and the fastest variant is chosen by it.

Four files are written to RESULTS: results.json (every figure), results.md (the table),
target.toml (a bbrules target with the rates measured here) and run.log.  Cases left when
`--minutes` run out are recorded as skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
KIT_CONFIGS = [(4, 3), (8, 3)]  # (num_warps, num_stages) the kernels' `tune` tries here
TOLERANCE = {"f32": 1e-4, "tf32": 5e-3, "f16": 5e-3, "bf16": 3e-2}  # max |error| / max |ref|


class Log:
    """Lines to stdout and run.log."""

    def __init__(self, path: Path):
        self.file = path.open("w")

    def __call__(self, line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamped, flush=True)
        self.file.write(stamped + "\n")
        self.file.flush()


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench(fn, torch, device: str) -> float:
    """Median seconds of `fn()`: CUDA events after a warm-up, for at least 5 and at most 100
    runs or about 0.3 s; one wall-clock run on the CPU."""
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    fn()
    torch.cuda.synchronize()
    times: list[float] = []
    until = time.perf_counter() + 0.3
    while len(times) < 5 or (time.perf_counter() < until and len(times) < 100):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_of(fn, torch):
    """A function replaying `fn()` from a CUDA graph: warmed up on a side stream first (torch's
    libraries choose kernels and workspaces on first use, which a capture cannot hold)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def inputs_for(case: dict, torch, device: str) -> dict:
    """Seeded inputs in the case's dtype, named as the program names them."""
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[case["dtype"]]
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    h, n, d, w = case["heads"], case["keys"], case["head_dim"], case["width"]
    if case["kind"] == "attention":
        return {"Q": randn(h, case["queries"], d), "K": randn(h, n, d), "V": randn(h, n, d)}
    if case["kind"] == "decode":
        return {"Q": randn(h, d), "K": randn(h, n, d), "V": randn(h, n, d)}
    if case["kind"] == "matmul":
        return {"A": randn(w, w), "B": randn(w, w, scale=w ** -0.5)}
    return {"X": randn(w, w), "G": randn(w), "W": randn(w, w, scale=w ** -0.5)}


def torch_op(case: dict, torch, x: dict, f32: bool):
    """The case computed by torch: in float32 (the reference) or in the case's dtype (the
    baseline: SDPA or cuBLAS)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if f32:
        x = {k: v.float() for k, v in x.items()}
    scale = case["head_dim"] ** -0.5
    if case["kind"] == "attention":
        return sdpa(x["Q"][None], x["K"][None], x["V"][None], is_causal=case["causal"],
                    scale=scale)[0]
    if case["kind"] == "decode":
        return sdpa(x["Q"][:, None], x["K"], x["V"], scale=scale)[:, 0]
    if case["kind"] == "matmul":
        return x["A"] @ x["B"]
    xs = x["X"]
    norm = xs * torch.rsqrt((xs.float() * xs.float()).mean(-1, keepdim=True) + 1e-6).to(xs.dtype)
    return (norm * x["G"]) @ x["W"]


def work(case: dict) -> tuple[float, float]:
    """(flops, bytes) the case needs at least: for TFLOP/s and GB/s columns."""
    size = {"f32": 4, "f16": 2, "bf16": 2}[case["dtype"]]
    h, n, d, w = case["heads"], case["keys"], case["head_dim"], case["width"]
    if case["kind"] == "attention":
        q = case["queries"]
        flops = 4.0 * h * q * n * d * (0.5 if case["causal"] else 1.0)
        return flops, size * h * d * (2 * q + 2 * n)
    if case["kind"] == "decode":
        return 4.0 * h * n * d, size * h * d * (2 * n + 2)
    return 2.0 * w ** 3, size * 3 * w * w


def relative_error(out, ref) -> float:
    scale = float(ref.abs().max()) or 1.0
    return float((out.float() - ref).abs().max()) / scale


def run_case(case: dict, torch, device: str, log: Log, deadline: float) -> dict:
    x = inputs_for(case, torch, device)
    ref = torch_op(case, torch, x, f32=True)
    result: dict = {"name": case["name"], "variants": []}

    def baseline():
        return torch_op(case, torch, x, f32=False)

    result["torch_s"] = bench(baseline, torch, device)
    if device == "cuda":
        try:
            result["torch_graph_s"] = bench(graph_of(baseline, torch), torch, device)
        except Exception as e:  # a baseline that cannot be captured keeps its call time
            result["torch_graph_failure"] = f"{type(e).__name__}: {str(e)[:300]}"
    output = {"attention": "O", "decode": "O", "matmul": "C", "rmsnorm_matmul": "Y"}[case["kind"]]
    tol = TOLERANCE["tf32" if case.get("precision") == "tf32" and case["dtype"] == "f32"
                    else case["dtype"]]
    for v in case["variants"]:
        if time.time() > deadline:
            break
        module = load(HERE / v["triton"], f"kit_{case['name']}_{v['label']}".replace("-", "_"))
        module.DEVICE = device
        # Compiling dominates the kit's minutes: two configurations a kernel here, the first
        # alone under the interpreter (which checks the tuner, not the times).
        module.CONFIGS[:] = KIT_CONFIGS if device == "cuda" else KIT_CONFIGS[:1]
        entry = {"variant": v["label"], "kernels": v["kernels"], "modeled_s": v["modeled_time_s"]}
        try:
            timings = module.tune(**x)
            entry["configs"] = [f"w{k[4]}s{k[5]}" for k in module.KERNELS]
            entry["tuning_ms"] = {k: {f"w{w}s{s}": t for (w, s), t in c.items()}
                                  for k, c in timings.items()}
            err = relative_error(module.run(**x)[output], ref)
            entry.update(error=err, ok=err <= tol,
                         seconds=bench(lambda: module.run(**x), torch, device))
        except Exception as e:  # a variant that does not compile or fit
            entry.update(ok=False, failure=f"{type(e).__name__}: {str(e)[:300]}")
        if "seconds" in entry and device == "cuda":
            try:
                replay = module.graphed(**x)
                graph_err = relative_error(replay()[output], ref)
                entry.update(graph_error=graph_err, ok=entry["ok"] and graph_err <= tol,
                             graph_seconds=bench(replay, torch, device))
            except Exception as e:  # the call's figures stand without the graph's
                entry["graph_failure"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["variants"].append(entry)
        graph = (f", graph {entry['graph_seconds'] * 1e6:.1f} us" if "graph_seconds" in entry
                 else f" (no graph: {entry['graph_failure']})" if "graph_failure" in entry else "")
        log(f"  {case['name']} {v['label']} " + (
            f"{'+'.join(entry['configs'])}: {entry['seconds'] * 1e6:.1f} us{graph}, error "
            f"{entry['error']:.2e}" if "seconds" in entry else entry["failure"]))
        if v.get("cuda") and device == "cuda":
            result["cuda_c"] = run_cuda(HERE / v["cuda"], case, x, ref, output, torch, tol)
    measured = [e for e in result["variants"] if "error" in e]
    result["ok"] = bool(measured) and all(e["ok"] for e in measured)
    good = [e for e in measured if e["ok"]]
    if good:
        best = min(good, key=lambda e: e.get("graph_seconds", e["seconds"]))
        seconds = best.get("graph_seconds", best["seconds"])
        flops, nbytes = work(case)
        result.update(best=best, speedup=result["torch_s"] / best["seconds"],
                      tflops=flops / seconds / 1e12, gbps=nbytes / seconds / 1e9)
        if "graph_seconds" in best and "torch_graph_s" in result:
            result["graph_speedup"] = result["torch_graph_s"] / best["graph_seconds"]
    return result


def run_cuda(path: Path, case: dict, x: dict, ref, output: str, torch, tol: float) -> dict:
    """The CUDA C backend's kernels (CuPy), checked and timed like the Triton ones."""
    try:
        import cupy as cp
        module = load(path, f"kit_cuda_{case['name']}".replace("-", "_"))
        arrays = {k: cp.asarray(v.float().contiguous()) for k, v in x.items()}
        out = module.run(**arrays)[output]
        err = relative_error(torch.as_tensor(out, device="cuda"), ref)
        seconds = bench(lambda: module.run(**arrays), torch, "cuda")
        return {"error": err, "ok": err <= tol, "seconds": seconds}
    except Exception as e:
        return {"ok": False, "failure": f"{type(e).__name__}: {str(e)[:300]}"}


def machine_rates(torch, log: Log) -> dict:
    """What the cost model's target figures can be set from: copy bandwidth (bytes read and
    written by a 1 GiB device-to-device copy) and special-function throughput (a Triton
    kernel of chained `exp2`s, each element's chain independent of every other's)."""
    import triton
    import triton.language as tl

    @triton.jit
    def exp_chain(x, out, steps: tl.constexpr):
        i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
        v = tl.load(x + i)
        for _ in tl.static_range(steps):
            v = tl.exp2(v) - 1.0  # stays in [-0.5, 0]: exp2 never saturates
        tl.store(out + i, v)

    source = torch.empty(1 << 28, device="cuda")
    target = torch.empty_like(source)
    copy_s = bench(lambda: target.copy_(source), torch, "cuda")
    source = target = None  # 2 GiB back before the cases run
    n, steps = 1 << 22, 256
    x = -torch.rand(n, device="cuda")
    y = torch.empty_like(x)
    exp_s = bench(lambda: exp_chain[(n // 1024,)](x, y, steps, num_warps=4), torch, "cuda")
    rates = {"copy_bytes_per_s": 2 * 4 * (1 << 28) / copy_s, "exp2_per_s": n * steps / exp_s}
    log(f"rates: copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), exp2 "
        f"{rates['exp2_per_s'] / 1e12:.2f} T/s")
    return rates


def measured_target(manifest: dict, env: dict, results: list[dict]) -> str:
    """A bbrules target file (TOML) with the figures this run measured: the copy bandwidth,
    the `exp2` rate, and the matrix rates the kit's own Triton matmuls reached (bf16, and f32
    at `tf32`); the rest as the kit's target has them.  `bbrules cost --target FILE` prices
    programs with it."""
    figures = dict(manifest["target_file"])
    measured = []
    if "rates" in env:
        figures["global_bandwidth"] = env["rates"]["copy_bytes_per_s"] / 1e9
        figures["special_rate"] = env["rates"]["exp2_per_s"] / 1e12
        measured += ["copy bandwidth", "exp2 rate"]
    for name, field in (("matmul-bf16-4096", "peak_flops_f16"),
                        ("matmul-f32-tf32-4096", "peak_flops_dot_f32")):
        r = next((r for r in results if r["name"] == name and "tflops" in r), None)
        if r is not None:
            figures[field] = r["tflops"]
            measured.append(f"{field} from {name}")
    gpu = env.get("gpu", env["device"])
    doc = (f"{gpu} as measured by the bbrules GPU kit on {time.strftime('%Y-%m-%d')} "
           f"(triton {env['triton']}): {', '.join(measured) or 'nothing'}; the rest as the "
           f"'{manifest['target']}' target")
    counts = ("local_capacity", "processors", "block_granularity")
    lines = ["# Written by the GPU kit's runner.py: `bbrules cost PROG --target FILE`.",
             f'name = "{manifest["target"]}-measured"', f"doc = {json.dumps(doc)}"]
    lines += [f"{k} = {int(v) if k in counts else float(v)!r}" for k, v in figures.items()]
    return "\n".join(lines) + "\n"


def environment(torch, device: str) -> dict:
    import numpy
    import triton
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "numpy": numpy.__version__, "device": device}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        import cupy
        env["cupy"] = cupy.__version__
    except ImportError:
        env["cupy"] = None
    return env


def table(env: dict, results: list[dict]) -> str:
    lines = [f"GPU kit results: {env.get('gpu', env['device'])}, torch {env['torch']}, "
             f"triton {env['triton']}, {time.strftime('%Y-%m-%d')}", ""]
    if "rates" in env:
        lines += [f"Measured in the same run: copy {env['rates']['copy_bytes_per_s'] / 1e12:.2f} "
                  f"TB/s (bytes read + written), exp2 {env['rates']['exp2_per_s'] / 1e12:.2f} "
                  "T/s. Modeled: the fused program's time on the kit's target.", ""]
    lines += ["Calls: whole calls from Python. Graphs: replays of a CUDA graph of one call "
              "(both sides). TFLOP/s and GB/s from the graph time.", "",
              "| case | kernels | best (blocks, warps+stages per kernel) | bbrules Triton call "
              "| graph | modeled | torch call | graph | speed-up call | speed-up graph | "
              "TFLOP/s | GB/s | CUDA C | max rel. error | ok |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def us(seconds):
        return "" if seconds is None else f"{seconds * 1e6:.1f} us"

    for r in results:
        if "skipped" in r or "failure" in r:
            why = r.get("skipped") or r["failure"]
            lines.append(f"| {r['name']} | | {why[:80]} | | | | | | | | | | | | no |")
            continue
        cuda = r.get("cuda_c", {})
        cuda_text = f"{cuda['seconds'] * 1e6:.0f} us" if "seconds" in cuda else \
            ("failed" if cuda else "")
        b = r.get("best")
        if b is None:
            lines.append(f"| {r['name']} | | no correct configuration | | | | "
                         f"{us(r['torch_s'])} | {us(r.get('torch_graph_s'))} | | | | | "
                         f"{cuda_text} | | no |")
            continue
        graph_speedup = f"{r['graph_speedup']:.2f}x" if "graph_speedup" in r else ""
        error = max(b["error"], b.get("graph_error", 0.0))
        lines.append(
            f"| {r['name']} | {b['kernels']} | {b['variant']}, {'+'.join(b['configs'])} | "
            f"{us(b['seconds'])} | {us(b.get('graph_seconds'))} | {us(b['modeled_s'])} | "
            f"{us(r['torch_s'])} | {us(r.get('torch_graph_s'))} | {r['speedup']:.2f}x | "
            f"{graph_speedup} | {r['tflops']:.1f} | {r['gbps']:.0f} | {cuda_text} | "
            f"{error:.1e} | {'yes' if r['ok'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for results.json, results.md, run.log")
    ap.add_argument("--minutes", type=float, default=7.0, help="stop starting cases after this")
    ap.add_argument("--only", nargs="*", default=[], help="case names to run (default: all)")
    ap.add_argument("--interpret", action="store_true",
                    help="no GPU: run in Triton's interpreter on the CPU (small kits only)")
    args = ap.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "run.log")
    device = "cuda" if torch.cuda.is_available() and not args.interpret else "cpu"
    if device == "cpu" and not args.interpret:
        log("no GPU found: run with --interpret for a CPU check of the kit")
        return 2
    env = environment(torch, device)
    log(f"environment: {env}")
    if device == "cuda":
        env["rates"] = machine_rates(torch, log)
    manifest = json.loads((HERE / "cases.json").read_text())
    deadline = time.time() + 60 * args.minutes
    results = []
    for case in manifest["cases"]:
        if args.only and case["name"] not in args.only:
            continue
        if time.time() > deadline:
            results.append({"name": case["name"], "skipped": "out of time"})
            continue
        log(f"{case['name']}")
        try:
            results.append(run_case(case, torch, device, log, deadline))
        except Exception as e:  # one case's failure must not lose the others' figures
            log(traceback.format_exc())
            results.append({"name": case["name"], "failure": f"{type(e).__name__}: {e}"[:300]})
        if device == "cuda":
            torch.cuda.empty_cache()
    (out / "results.json").write_text(json.dumps({"environment": env, "results": results},
                                                 indent=1))
    (out / "results.md").write_text(table(env, results))
    (out / "target.toml").write_text(measured_target(manifest, env, results))
    log(f"wrote {out / 'results.json'}, {out / 'results.md'} and {out / 'target.toml'}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
