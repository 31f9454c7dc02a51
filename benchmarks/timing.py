"""Wall times of whole-model runs, compared fairly: each contender timed in turn, over rounds.

Why rounds and pauses: runtimes' worker threads (OpenBLAS's behind numpy, onnxruntime's, the
native product's) spin for a while after their work, on the cores whatever is timed next
needs (onnxruntime timed right after the numpy backend took 3x as long; LLaMA's native layer
at 128 tokens, alternated call by call with onnxruntime, took 1.47 ms instead of 1.19).  So
each contender is timed after a pause.  Why many calls a round: nine calls of a 1 ms model
gave medians 25% apart from one run of the benchmark to the next on the 2-core Xeon; a round
times at least `LEAST_SECONDS` of calls, and a contender's figure is the median of its rounds'.
Why glibc's malloc is told to keep what is freed (`keep_freed_memory`): otherwise what one
runtime frees decides whether the next one's allocations fault in fresh pages.  After
onnxruntime had run, LLaMA's layer at 2048 tokens took 9,700 page faults a call as numpy code
(131 -> 189 ms) and its native rounds ranged over 94-158 ms; keeping freed memory, as a
long-running server's would, its rounds agreed within 3% native, 7% as numpy code.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping

# glibc's mallopt parameters, and the bytes below which it keeps freed memory and serves
# allocations from its heap rather than from pages mapped for them
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT_BYTES = 1 << 30

PAUSE_SECONDS = 1.0
LEAST_SECONDS = 0.3
LEAST_CALLS = 9


@dataclass(frozen=True)
class Timing:
    """A contender's median seconds a call, and the lowest and highest of its rounds'."""

    seconds: float
    low: float
    high: float


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory below `KEPT_BYTES` for later allocations instead
    of returning it to the system (nothing where the C library is not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_TRIM_THRESHOLD, KEPT_BYTES)
    mallopt(M_MMAP_THRESHOLD, KEPT_BYTES)


def compare(contenders: Mapping[str, Callable[[], object]], rounds: int = 3
            ) -> dict[str, Timing]:
    """Each contender's `Timing`: `rounds` rounds, each timing every contender in turn, after
    a pause and one untimed call, for at least `LEAST_CALLS` calls and `LEAST_SECONDS`; freed
    memory kept (`keep_freed_memory`)."""
    keep_freed_memory()
    medians: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            time.sleep(PAUSE_SECONDS)
            fn()
            times: list[float] = []
            end = time.perf_counter() + LEAST_SECONDS
            while len(times) < LEAST_CALLS or time.perf_counter() < end:
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times))
    return {name: Timing(statistics.median(m), min(m), max(m)) for name, m in medians.items()}


@dataclass(frozen=True)
class PairedBlock:
    """One block of `paired` calls: the median seconds of each contender's calls, and the
    median of the pairs' ratios (variant over base)."""

    base: float
    variant: float
    ratio: float


def paired(base: Callable[[], object], variant: Callable[[], object], pairs: int = 2000,
           blocks: int = 4, warmup: int = 50) -> list[PairedBlock]:
    """Two versions of one computation timed call by call: `pairs` pairs in `blocks` blocks,
    each pair one call of each, which goes first swapped every pair; a block's figure is the
    median of its pairs' ratios.

    Why pairs: on the 2-core Xeon one module timed in rounds ranged 1.16-1.72 ms a call, which
    hides a change of 1-2%, while the two calls of a pair see the same load, caches and
    clock.  The ratio of 2,000 pairs moved by less than 0.01 between blocks while the times
    moved by 20%.  The blocks show whether it holds.  Only for contenders that do not leave
    threads spinning on the cores the other needs (two modules of one runtime, not a module
    against onnxruntime, which `compare` times apart)."""
    keep_freed_memory()
    for _ in range(warmup):
        base()
        variant()
    out: list[PairedBlock] = []
    for _ in range(blocks):
        times: tuple[list[float], list[float]] = ([], [])
        ratios: list[float] = []
        for i in range(max(1, pairs // blocks)):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            spent = [0.0, 0.0]
            for which in order:
                fn = variant if which else base
                start = time.perf_counter()
                fn()
                spent[which] = time.perf_counter() - start
            times[0].append(spent[0])
            times[1].append(spent[1])
            ratios.append(spent[1] / spent[0])
        out.append(PairedBlock(statistics.median(times[0]), statistics.median(times[1]),
                               statistics.median(ratios)))
    return out
