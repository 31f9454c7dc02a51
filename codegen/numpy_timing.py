"""Timing generated numpy modules: where a program's time goes, kernel by kernel (`profile`),
and whether it runs faster in parts or whole on this machine and these inputs (`tune`).

`profile` times each kernel of a program's generated numpy module over repeated runs, beside
the time and share the cost model gives it.  The modeled figures are a target's (a GPU's,
unless the program was fused for `cpu`), so the shares are what compare: a kernel that takes
much more of the measured time than of the modeled one is where numpy does worse than the
model assumes (elementwise work on one core, a gather, a copy into a matmul's order) or where
a fusion that the model prices well does not pay here.  Each kernel is timed where the
module's `run` calls it: its whole function, or `run_parts` for a kernel split into parts;
kernels that the module runs as one call (products of one job, `numpy_gen._jointly`) are one
row, beside the sum of their modeled times.  The runs follow each other with no pause, as a
program called in a loop would; what `run` does between kernels (views of the inputs and
stores) is the difference between the kernels' sum and the whole run's time.

`tune` settles by the clock what `numpy_plan.parts_pay` estimates from rates measured on one
machine: whether a program's kernels run in parts on every core, or whole with BLAS threading
their products.  Which is faster depends on the machine's caches as much as on the work: on a
2-core Xeon whose cores read each other's data slowly, a chain of elementwise operations on
arrays of 1 MiB ran slower in two parts (330 µs) than whole (214 µs), and faster only on
arrays of 4 MiB and more (962 against 1464 µs); magika ran in 4.5-5.0 ms whole against
5.2-5.9 ms in parts (one round 7.2), where the estimate, from a machine with five times
slower exponentials, chose parts.
"""

from __future__ import annotations

import statistics
import time
import types
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from bbrules.codegen.numpy_gen import default_native, loaded
from bbrules.codegen.numpy_runtime import default_threads
from bbrules.cost import ProgramCost, fmt_time
from bbrules.ir import BlockProgram

# Runs before the timed ones: the first allocates the pool's threads and warms the caches.
WARMUP_RUNS = 2


@dataclass(frozen=True)
class KernelTime:
    """One kernel, or kernels the module runs as one call (their products as one job): the
    tensors they store, how many parts it runs in (1: whole), the median of its time over the
    runs, and the indices of its kernels in the program."""

    tensors: tuple[str, ...]
    parts: int
    seconds: float
    kernels: tuple[int, ...]


@dataclass(frozen=True)
class Profile:
    """Medians over `runs` runs of the generated module on `threads` threads: of each kernel
    (or kernels run as one call), in program order, and of the whole run."""

    threads: int
    runs: int
    seconds: float
    kernels: tuple[KernelTime, ...]

    def table(self, modeled: ProgramCost) -> str:
        """One row per kernel: parts, measured time and share, modeled time and share."""
        head = ("kernel", "parts", "measured", "share", f"modeled ({modeled.target.name})",
                "share")
        rows = [head]
        measured = sum(k.seconds for k in self.kernels)
        for k in self.kernels:
            m = _modeled(k, modeled)
            rows.append((",".join(k.tensors), str(k.parts), fmt_time(k.seconds),
                         _percent(k.seconds, measured), fmt_time(m),
                         _percent(m, modeled.time)))
        rows.append(("kernels", "", fmt_time(measured), "", fmt_time(modeled.time), ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(-1, "-" * len(lines[0]))
        lines.append(f"whole run {fmt_time(self.seconds)} (medians of {self.runs} runs on "
                     f"{self.threads} thread{'s' * (self.threads != 1)})")
        return "\n".join(lines)

    def to_json(self, modeled: ProgramCost) -> dict:
        """Plain data for `--json`: seconds, and the modeled seconds on `modeled`'s target
        (null for an illegal kernel)."""
        return {
            "threads": self.threads,
            "runs": self.runs,
            "seconds": self.seconds,
            "target": modeled.target.name,
            "kernels": [{"tensors": list(k.tensors), "parts": k.parts, "seconds": k.seconds,
                         "modeled_seconds": m if np.isfinite(m := _modeled(k, modeled)) else None}
                        for k in self.kernels],
        }


def _modeled(k: KernelTime, modeled: ProgramCost) -> float:
    """The modeled time of `k`'s kernels."""
    return sum(modeled.kernels[i].time for i in k.kernels)


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 and np.isfinite(whole) else ""


def profile(p: BlockProgram, inputs: Mapping[str, np.ndarray], runs: int = 10,
            threads: int | None = None, native: bool | None = None) -> Profile:
    """Run `p`'s generated numpy module `WARMUP_RUNS` + `runs` times on `threads` threads
    (default: `default_threads()`), with native groups or not (default: `default_native()`),
    timing every kernel of the last `runs`."""
    threads = default_threads() if threads is None else threads
    generated, module = loaded(p, threads, default_native() if native is None else native)
    # kernels run as one call share its function: one row
    rows: dict[tuple[str, ...], list[int]] = {}
    for i, fns in enumerate(generated.functions):
        rows.setdefault(fns, []).append(i)
    spent = [0.0] * len(rows)
    kernel_of = {fn: r for r, fns in enumerate(rows) for fn in fns}

    def timed(fn: Callable[..., object], kernel: Callable[..., int]) -> Callable[..., object]:
        def call(*args: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[kernel(*args)] += time.perf_counter() - start
        return call

    for fns, kernels in rows.items():
        if generated.parts[kernels[0]] == 1:
            r = kernel_of[fns[0]]
            setattr(module, fns[0], timed(getattr(module, fns[0]), lambda *_, r=r: r))
    if hasattr(module, "run_parts"):
        module.run_parts = timed(module.run_parts,
                                 lambda parts, *_: kernel_of[parts[0][0].__name__])
    per_kernel: list[list[float]] = [[] for _ in rows]
    totals = []
    for n in range(WARMUP_RUNS + runs):
        spent[:] = [0.0] * len(spent)
        start = time.perf_counter()
        module.outputs(**inputs)
        if n >= WARMUP_RUNS:
            totals.append(time.perf_counter() - start)
            for times, s in zip(per_kernel, spent):
                times.append(s)
    return Profile(threads, runs, statistics.median(totals), tuple(
        KernelTime(tuple(t for i in kernels for t in p.kernels[i].tensors),
                   generated.parts[kernels[0]], statistics.median(times), tuple(kernels))
        for kernels, times in zip(rows.values(), per_kernel)))


@dataclass(frozen=True)
class Tuned:
    """The faster of a program's modules on some inputs (`tune`): whether it runs kernels in
    parts, and the fastest run's seconds of each module timed ("parts", "whole")."""

    module: types.ModuleType
    parts: bool
    seconds: Mapping[str, float]


def tune(p: BlockProgram, inputs: Mapping[str, np.ndarray], threads: int | None = None,
         runs: int = 5, native: bool | None = None) -> Tuned:
    """The faster on `inputs` of `p`'s module with every kernel of enough work in parts on
    `threads` threads (default: `default_threads()`) and its module of whole kernels, BLAS
    (or the native product, on `threads` threads) threading their products; each run once,
    then in rounds of one run each (`_rounds`: at least `runs`, and `TUNE_SECONDS`), the
    faster being the one ahead in the median round.  A program with no kernel to split, or
    one thread, has one module, which is not timed.  Both have native groups or neither
    (default: `default_native()`)."""
    threads = default_threads() if threads is None else threads
    native = default_native() if native is None else native
    modules = {"whole": loaded(p, threads, native, split=False)[1]}
    split = loaded(p, threads, native, split=True) if threads > 1 else None
    if split is not None and any(n > 1 for n in split[0].parts):
        modules["parts"] = split[1]
    if len(modules) == 1:
        return Tuned(modules["whole"], False, {})
    times = _rounds(modules, inputs, runs, TUNE_SECONDS)
    ratio = statistics.median(a / b for a, b in zip(times["parts"], times["whole"]))
    best = "parts" if ratio < 1 else "whole"
    return Tuned(modules[best], best == "parts", {name: min(t) for name, t in times.items()})


# A pause before tuning: threads of earlier work (OpenBLAS's after numpy's products) spin for
# a while on the cores the modules need.  Tuned right after the numpy code's own tuning,
# magika's native module chose parts in two runs of three (4.1-4.3 ms, whole 2.8 ms).
SETTLE_SECONDS = 0.25

# Rounds of tuning go on until this long has passed (and at most `MAX_ROUNDS`): a module of a
# millisecond gets dozens, where five rounds left the choice to a run or two.
TUNE_SECONDS = 0.5
MAX_ROUNDS = 41


def _rounds(modules: Mapping[str, types.ModuleType], inputs: Mapping[str, np.ndarray],
            runs: int, seconds: float = 0.0) -> dict[str, list[float]]:
    """Each module's time in each round of one run each, after a first run each: at least
    `runs` rounds, more until `seconds` have passed (at most `MAX_ROUNDS`), the order of the
    modules alternating between rounds.

    Modules are compared round by round (`tune`), not by their fastest runs: what else the
    machine does slows both runs of a round alike, where the fastest of a few runs is the one
    that met a quiet moment.  LLaMA's layer at 2048 tokens kept its module of whole kernels
    by its fastest of five runs, and ran 1.15-1.22x slower than in parts in paired runs
    (`benchmarks/paired.py`).  Nor by their medians: magika's whole module ran 4.3 ms in most
    rounds and 8.7-9.5 ms in two of five, against 6.1-11 ms for its parts; a median over such
    rounds once chose the parts, which then ran 6.0 ms against the whole module's 4.1."""
    time.sleep(SETTLE_SECONDS)
    for module in modules.values():
        module.outputs(**inputs)
    times: dict[str, list[float]] = {name: [] for name in modules}
    names = list(modules)
    began = time.perf_counter()
    n = 0
    while n < runs or n < MAX_ROUNDS and time.perf_counter() - began < seconds:
        for name in names if n % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            modules[name].outputs(**inputs)
            times[name].append(time.perf_counter() - start)
        n += 1
    return times
