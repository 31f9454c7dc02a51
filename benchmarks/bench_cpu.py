"""CPU benchmark: what fusion buys a numpy program, in time and in peak memory.

For each case, in one run: the dense numpy evaluation of the program (`bbrules.dense`, the
baseline the speed-up and memory ratios are taken against), the unfused block program and the
fused block program through the numpy backend on `--threads` threads (default: the backend's
own, `numpy_runtime.default_threads`), the fused program with native groups and products where a
C compiler is found (`codegen/native.py`, `codegen/matmul.c`; both fused modules in parts or
whole, whichever `numpy_timing.tune` times faster, as the ONNX benchmarks run them), the fused
program again on one thread, onnxruntime on the same program written as an ONNX graph (attention: the opset-23
`Attention` operator; the norms written out as the programs compute them, `NORM_GRAPHS`),
and for attention torch's
`scaled_dot_product_attention` on the CPU and the hand-written blocked online-softmax loop in
plain numpy (`blocked_attention.py`, the single-threaded ceiling for a numpy backend).  torch
runs in this process when it imports, else under `--torch-python PYTHON` (an environment with
torch, such as the CPU wheel for Python 3.11), in a subprocess given the same inputs through
.npy files.  onnxruntime and torch use every core, as they do by default.

Times are the median of `--repeat` runs after a first (warm-up) run, taken in rounds of one
run of every variant (so that load from other processes, coming and going, weighs on every
variant alike and the ratios between them hold), each after a pause (`SETTLE`: the other
variants' threads stop spinning) and 20 ms of untimed runs (`WARM_UP`: the cores back to
speed), with glibc's malloc keeping freed memory (`timing.keep_freed_memory`: otherwise what
one variant freed gave the next one's allocations fresh pages: in two runs minutes apart,
without and with it, dense attention took 7.7 -> 4.7 ms at N = 1024 and 2415 -> 506 ms at
8192); peak memory is the tracemalloc peak of the first run (numpy reports its buffers to
tracemalloc; torch and onnxruntime do not, so their memory is not shown).  Every variant's
outputs are checked against the dense evaluation, so a fast wrong answer shows up as an
error, not a speed-up.  The table (markdown) gives each variant's time over torch's and over
onnxruntime's: below 1 is faster.

The fused program comes from `bbrules.fuse.fuse(lower(ast), load_packs([]), get_target("cpu"),
objective)`, or from `--fused CASE=PATH.bbk`.  The objective defaults to global traffic: on
the `cpu` target's figures attention is compute-bound, so modeled time barely separates the
two-kernel program that stores S from Flash Attention (5x less traffic; at N = 4096 storing S
models 3% faster, inside the target's 5% resolution, so the time objective too picks Flash
Attention), while what limits a numpy program in practice is the memory it streams and
allocates.  `--objective time` measures what the time objective picks.

    python benchmarks/bench_cpu.py [--case attention-8192 ...] [--dim k=8192/256 ...]
                                   [--fused CASE=PATH.bbk ...] [--repeat 3] [--threads N]
                                   [--torch-python PYTHON] [--json PATH]

The key block size sets the step of the generated loop over keys, so the attention cases use
blocks of 256 keys, the hand-written loop's block.  The other cases use a CPU-sized width
(1024, hidden 2816) and blocks of 256, large enough for BLAS to run near its speed (the numpy
backend runs each block of a reduction as its own matmul, so the example files' GPU-sized
blocks, 4 hidden columns at a time, would measure Python loop overhead, not data movement) and
small enough for every kernel's tiles to fit the `cpu` target's 512 KiB of local memory
(blocks of 1024 output columns do not: fusion finds no legal program).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from blocked_attention import blocked_attention
from timing import keep_freed_memory
from bbrules import dense
from bbrules.blockfile import load_block_program
from bbrules.codegen import native, numpy_gen, numpy_runtime
from bbrules.codegen.numpy_timing import Tuned, tune
from bbrules.errors import UsageError
from bbrules.frontend import load_program, parse_dim_override
from bbrules.inputs import random_inputs
from bbrules.fuse import fuse
from bbrules.ir import BlockProgram
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.targets import get_target

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ATTENTION_SCALE = 0.125  # the constant examples/attention.bbp multiplies by (1 / sqrt(64))
# The constant the norm examples multiply sums by for a mean (1 / 4096, their width): at the
# width measured here the programs keep it, so the ONNX graphs do too.
NORM_SCALE = 0.000244140625


@dataclass(frozen=True)
class Case:
    name: str
    example: str
    dims: dict[str, tuple[int, int]]

    @property
    def attention(self) -> bool:
        return self.example == "attention.bbp"


CASES = [
    *(Case(f"attention-{n}", "attention.bbp", {"q": (n, 64), "k": (n, 256), "d": (64, 64)})
      for n in (1024, 4096, 8192)),
    Case("layernorm-matmul", "layernorm_matmul.bbp",
         {"m": (2048, 64), "e": (1024, 256), "n": (1024, 256)}),
    Case("rmsnorm-ffn-swiglu", "rmsnorm_ffn_swiglu.bbp",
         {"m": (512, 64), "e": (1024, 256), "f": (2816, 256), "n": (1024, 256)}),
]


@dataclass
class Measurement:
    variant: str
    seconds: float | None = None
    times: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    max_rel_error: float | None = None
    speedup: float | None = None  # dense time / this time
    memory_ratio: float | None = None  # this peak / dense peak
    vs_torch: float | None = None  # this time / torch's
    vs_ort: float | None = None  # this time / onnxruntime's
    note: str = ""


def _ran(tuned: Tuned) -> str:
    """How `tune` ran the fused program: in parts or whole, whichever it timed faster."""
    return "in parts" if tuned.parts else "whole"


def fused_program(unfused: BlockProgram, given: Path | None, objective: str
                  ) -> tuple[BlockProgram, str]:
    """The fused program to measure and where it came from: `--fused` or the engine."""
    if given is not None:
        return load_block_program(given).program, str(given)
    fused = fuse(unfused, load_packs([]), get_target("cpu"), objective).program
    return fused, f"bbrules.fuse ({objective}): {len(fused.kernels)} kernel(s)"


Outputs = dict[str, np.ndarray]


def max_rel_error(got: Outputs, want: Outputs) -> float:
    return max(float(np.abs(got[n] - w).max() / max(1e-30, np.abs(w).max()))
               for n, w in want.items())


def first_run(variant: str, fn: Callable[[], Outputs], want: Outputs | None,
              traced: bool = True) -> tuple[Measurement, Outputs]:
    """A first run (which also warms up): its peak traced memory, its outputs and their error
    against `want`.  The timed runs come after, interleaved with other variants' (`timed`)."""
    out = Measurement(variant)
    gc.collect()
    if traced:
        tracemalloc.start()
        got = fn()
        out.peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    else:
        got = fn()
    if want is not None:
        out.max_rel_error = max_rel_error(got, want)
    return out, got


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """One timed run of `fn`, in seconds."""
    def once() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return once


# Seconds to wait before each timed run: OpenBLAS's, OpenMP's (torch) and onnxruntime's worker
# threads keep spinning for a while after a call returns (OpenBLAS's up to about 0.1 s), and on
# a machine of few cores they would slow whichever variant runs next.
SETTLE = 0.25

# Then runs, untimed, for at least this long: after a pause the cores take a few milliseconds
# to come back to speed (a 0.12 ms product took 3-5 times as long for its first 20 calls),
# and a worker pool that slept wakes up; timed straight after the pause, attention at
# N = 1024 took 3.9 ms native where it runs in 1.6.
WARM_UP = 0.02


def interleave(timers: list[tuple[Measurement, Callable[[], float]]], repeat: int) -> None:
    """`repeat` rounds of one timed run of every variant in turn; each variant's median.

    Round by round rather than variant by variant: on a machine whose other load comes and
    goes, every variant then runs under the same conditions, so their ratios hold even when
    the absolute times drift."""
    for _ in range(repeat):
        for m, once in timers:
            gc.collect()
            time.sleep(SETTLE)
            until = time.perf_counter() + WARM_UP
            once()
            while time.perf_counter() < until:
                once()
            m.times.append(once())
    for m, _ in timers:
        m.seconds = statistics.median(m.times)


def _torch_attention() -> Callable[..., np.ndarray] | None:
    try:
        import torch
    except ImportError:
        return None

    def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        t = [torch.from_numpy(x)[None] for x in (q, k, v)]
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                *t, scale=ATTENTION_SCALE)[0].numpy()

    return sdpa


# Run by `--torch-python` in a subprocess: argv is the folder holding Q.npy, K.npy and V.npy
# and the scale.  It writes O.npy there, prints which torch on how many threads, then times one
# run per line it reads, printing the seconds.
TORCH_SCRIPT = """
import sys, time
from pathlib import Path
import numpy as np
import torch
folder, scale = Path(sys.argv[1]), float(sys.argv[2])
q, k, v = (torch.from_numpy(np.load(folder / f"{n}.npy"))[None] for n in "QKV")
def sdpa():
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)[0]
np.save(folder / "O.npy", sdpa().numpy())
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
for _ in sys.stdin:
    t0 = time.perf_counter()
    sdpa()
    print(time.perf_counter() - t0, flush=True)
"""


class TorchSubprocess:
    """torch's SDPA under `python` (an interpreter with torch) on the same inputs, kept
    running so that its timed runs interleave with this process's variants."""

    def __init__(self, python: str, q: np.ndarray, k: np.ndarray, v: np.ndarray):
        self.folder = tempfile.TemporaryDirectory()
        where = Path(self.folder.name)
        for name, x in zip("QKV", (q, k, v)):
            np.save(where / f"{name}.npy", x)
        self.process = subprocess.Popen(
            [python, "-c", TORCH_SCRIPT, str(where), repr(ATTENTION_SCALE)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.about = self.process.stdout.readline().strip()
        if not self.about:
            self.close()
            raise RuntimeError(f"{python} could not run torch's SDPA (exit status "
                               f"{self.process.returncode})")
        self.output = np.load(where / "O.npy")

    def once(self) -> float:
        """One timed run, in seconds (torch's own clock, without the pipe)."""
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self.folder.cleanup()


# The norm cases as ONNX graph steps, (operator, inputs, output), written out as the programs
# compute them: a mean is a row sum (`last`: the last axis, kept) times `scale`.
NORM_GRAPHS = {
    "layernorm_matmul.bbp": [
        ("ReduceSum", ["X", "last"], "XS"), ("Mul", ["XS", "scale"], "MU"),
        ("Sub", ["X", "MU"], "XC"), ("Mul", ["XC", "XC"], "XC2"),
        ("ReduceSum", ["XC2", "last"], "VS"), ("Mul", ["VS", "scale"], "VAR"),
        ("Add", ["VAR", "eps"], "VE"), ("Sqrt", ["VE"], "SD"), ("Div", ["XC", "SD"], "XZ"),
        ("Mul", ["XZ", "G"], "XG"), ("Add", ["XG", "B"], "XN"), ("MatMul", ["XN", "W"], "Y")],
    "rmsnorm_ffn_swiglu.bbp": [
        ("Mul", ["X", "X"], "X2"), ("ReduceSum", ["X2", "last"], "SS"),
        ("Mul", ["SS", "scale"], "MS"), ("Add", ["MS", "eps"], "MSE"), ("Sqrt", ["MSE"], "RMS"),
        ("Div", ["X", "RMS"], "XR"), ("Mul", ["XR", "G"], "XN"),
        ("MatMul", ["XN", "W1"], "A"), ("MatMul", ["XN", "W3"], "U"),
        ("Sigmoid", ["A"], "SA"), ("Mul", ["A", "SA"], "SILU"), ("Mul", ["SILU", "U"], "H"),
        ("MatMul", ["H", "W2"], "Y")],
}


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]], output: str,
           shape: list[int], opset: int) -> onnx.ModelProto:
    """A one-output model of f32 tensors."""
    def value(name: str, dims: list[int]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    graph = helper.make_graph(nodes, "bench_cpu", [value(n, d) for n, d in inputs.items()],
                              [value(output, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def onnx_model(case: Case, inputs: Outputs, output: str, shape: tuple[int, ...]
               ) -> tuple[onnx.ModelProto, Outputs] | None:
    """The case's program as an ONNX model computing `output` (of `shape`), with its feed (the
    same inputs), or None: attention is onnxruntime's own operator (opset 23), the norms are
    `NORM_GRAPHS`."""
    shapes = {n: list(x.shape) for n, x in inputs.items()}
    if case.attention:
        n, d = shapes["Q"]
        node = helper.make_node("Attention", ["Q", "K", "V"], [output], scale=ATTENTION_SCALE)
        model = _model([node], {x: [1, 1, n, d] for x in "QKV"}, output, [1, 1, n, d], 23)
        return model, {x: inputs[x][None, None] for x in "QKV"}
    steps = NORM_GRAPHS.get(case.example)
    if steps is None:
        return None
    constants = [helper.make_node("Constant", [], [name], value=helper.make_tensor(
                     name, kind, dims, [value]))
                 for name, kind, dims, value in [("eps", TensorProto.FLOAT, [], 1e-5),
                                                 ("scale", TensorProto.FLOAT, [], NORM_SCALE),
                                                 ("last", TensorProto.INT64, [1], -1)]]
    nodes = constants + [helper.make_node(op, args, [out]) for op, args, out in steps]
    return _model(nodes, shapes, output, list(shape), 13), dict(inputs)


def _onnxruntime(model: onnx.ModelProto, feed: Outputs, output: str, shape: tuple[int, ...]
                 ) -> Callable[[], Outputs] | str:
    """A run of `model` in an onnxruntime CPU session (its default threads) returning the
    program's `output` in its own `shape`, or why there is none."""
    try:
        import onnxruntime
    except ImportError:
        return "onnxruntime not installed"
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return lambda: {output: session.run(None, feed)[0].reshape(shape)}


def run_case(case: Case, overrides: dict[str, tuple[int, int | None]],
             given: dict[str, Path], repeat: int, objective: str, threads: int,
             torch_python: str | None) -> dict[str, object]:
    """Every variant of one case: a first run each, then their timed runs interleaved; the
    dense evaluation is the reference."""
    dims = dict(case.dims)
    for name, (extent, block) in overrides.items():
        if name in dims:
            dims[name] = (extent, block if block is not None else dims[name][1])
    ast = load_program(EXAMPLES / case.example, dims=dims)
    unfused = lower(ast)
    inputs = random_inputs(ast, seed=0)
    print(f"{case.name} {dims}", file=sys.stderr, flush=True)
    results: list[Measurement] = []
    timers: list[tuple[Measurement, Callable[[], float]]] = []
    torch_row = ort_row = None

    def record(variant: str, fn: Callable[[], Outputs], want: Outputs | None,
               traced: bool = True, note: str = "") -> Outputs:
        m, got = first_run(variant, fn, want, traced)
        m.note = note
        results.append(m)
        timers.append((m, timed(fn)))
        mem = f": peak {m.peak_bytes / 2**20:.0f} MiB" if m.peak_bytes is not None else ""
        print(f"  {variant}{mem}", file=sys.stderr, flush=True)
        return got

    def skip(variant: str, note: str) -> None:
        results.append(Measurement(variant, note=note))
        print(f"  {variant}: {note}", file=sys.stderr, flush=True)

    reference = record("dense numpy", lambda: dense.evaluate(ast, inputs), None)
    want = {n: reference[n] for n in unfused.outputs}
    results[0].max_rel_error = 0.0
    del reference
    each = "thread" if threads == 1 else "threads"
    module = numpy_gen.load(unfused, threads=threads, native=False)
    record(f"unfused (numpy, {threads} {each})", lambda: module.outputs(**inputs), want)
    fused, origin = fused_program(unfused, given.get(case.name), objective)
    fused_module = tune(fused, inputs, threads, native=False)
    record(f"fused (numpy, {threads} {each})", lambda: fused_module.module.outputs(**inputs), want,
           note=f"{origin}, {_ran(fused_module)}")
    if native.available():
        with_c = tune(fused, inputs, threads, native=True)
        record(f"fused (native, {threads} {each})", lambda: with_c.module.outputs(**inputs), want,
               note=_ran(with_c))
    if threads > 1:
        one = numpy_gen.load(fused, threads=1, native=False)
        record("fused (numpy, 1 thread)", lambda: one.outputs(**inputs), want)
    (output,) = unfused.outputs
    built = onnx_model(case, inputs, output, want[output].shape)
    if built is None:
        skip("onnxruntime", "no ONNX graph for this case")
    else:
        ort = _onnxruntime(*built, output, want[output].shape)
        if isinstance(ort, str):
            skip("onnxruntime", ort)
        else:
            op = "Attention" if case.attention else "graph"
            record(f"onnxruntime ({op})", ort, want, traced=False,
                   note="memory not visible to tracemalloc")
            ort_row = results[-1]
    with ExitStack() as cleanup:
        if case.attention:
            q, k, v, block = inputs["Q"], inputs["K"], inputs["V"], dims["k"][1]
            record(f"hand-blocked numpy ({block} keys)",
                   lambda: {"O": blocked_attention(q, k, v, block=block, scale=ATTENTION_SCALE)},
                   want)
            sdpa = _torch_attention()
            if sdpa is not None:
                record("torch sdpa (cpu)", lambda: {"O": sdpa(q, k, v)}, want, traced=False,
                       note="memory not visible to tracemalloc")
                torch_row = results[-1]
            elif torch_python is not None:
                torch = TorchSubprocess(torch_python, q, k, v)
                cleanup.callback(torch.close)
                torch_row = Measurement("torch sdpa (cpu)", note=f"{torch.about}, {torch_python}")
                torch_row.max_rel_error = max_rel_error({"O": torch.output}, want)
                results.append(torch_row)
                timers.append((torch_row, torch.once))
            else:
                skip("torch sdpa (cpu)", "torch not installed (see --torch-python)")
        interleave(timers, repeat)
    for m, _ in timers:
        print(f"  {m.variant}: {m.seconds * 1e3:.1f} ms", file=sys.stderr, flush=True)
    base = results[0]
    for m in results:
        if m.seconds is not None:
            m.speedup = base.seconds / m.seconds
            m.vs_torch = m.seconds / torch_row.seconds if torch_row else None
            m.vs_ort = m.seconds / ort_row.seconds if ort_row else None
        if m.peak_bytes is not None:
            m.memory_ratio = m.peak_bytes / base.peak_bytes
    return {"case": case.name, "example": case.example, "dims": dims,
            "measurements": [asdict(m) for m in results]}


def table(report: list[dict[str, object]]) -> str:
    """A markdown table: times and peak memory with their ratios to the dense baseline of the
    same case, and each time over torch's and onnxruntime's."""
    lines = ["| case | variant | time ms | speed-up | peak MiB | memory | max rel err "
             "| / torch | / ort | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for case in report:
        for m in case["measurements"]:
            t, peak, err = m["seconds"], m["peak_bytes"], m["max_rel_error"]
            cells = [
                f"{t * 1e3:.1f}" if t is not None else "-",
                f"{m['speedup']:.2f}x" if t is not None else "-",
                f"{peak / 2**20:.1f}" if peak is not None else "-",
                f"{m['memory_ratio']:.3f}" if peak is not None else "-",
                f"{err:.1e}" if err is not None else "-",
                f"{m['vs_torch']:.2f}" if m["vs_torch"] is not None else "-",
                f"{m['vs_ort']:.2f}" if m["vs_ort"] is not None else "-",
            ]
            lines.append(f"| {case['case']} | {m['variant']} | {' | '.join(cells)} "
                         f"| {m['note']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=[c.name for c in CASES],
                    help="run only these cases (repeatable; default: all)")
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=EXTENT[/BLOCK]",
                    help="override a dim in every case that declares it")
    ap.add_argument("--fused", action="append", default=[], metavar="CASE=PATH.bbk",
                    help="measure this fused block program for CASE instead of fusing")
    ap.add_argument("--objective", choices=("traffic", "time"), default="traffic",
                    help="what fusion minimises on the cpu target (default: traffic)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=numpy_runtime.default_threads(),
                    help="threads of the numpy backend (default: numpy_runtime.default_threads(), "
                         "the cores or $BBRULES_THREADS); the fused program also runs on one")
    ap.add_argument("--torch-python", metavar="PYTHON",
                    help="where torch does not import here: a Python with torch to time SDPA "
                         "in a subprocess (e.g. /tmp/torchenv/bin/python)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")
    args = ap.parse_args(argv)
    keep_freed_memory()  # (each variant's allocations unaffected by what the others freed)
    try:
        overrides = {n: (e, b) for n, e, b in map(parse_dim_override, args.dim)}
    except UsageError as err:
        print(err, file=sys.stderr)
        return 2
    given = {}
    for spec in args.fused:
        name, sep, path = spec.partition("=")
        if not sep or name not in {c.name for c in CASES}:
            print(f"--fused {spec}: expected CASE=PATH.bbk with a known case", file=sys.stderr)
            return 2
        given[name] = Path(path)
    cases = [c for c in CASES if not args.case or c.name in args.case]
    report = [run_case(c, overrides, given, args.repeat, args.objective, args.threads,
                       args.torch_python) for c in cases]
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps({
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "numpy": np.__version__, "processor": platform.processor()},
            "repeat": args.repeat, "objective": args.objective, "threads": args.threads,
            "cases": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
