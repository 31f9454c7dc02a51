"""What generated numpy modules call while they run: gathers by a one-hot's picks
(`gather_one_hot`), read-only inputs copied into another layout once (`relaid`), and a
kernel's parts run at once on a pool of threads (`run_parts`), with numpy's BLAS held to one
thread meanwhile.  `numpy_gen` writes the calls; nothing here knows the block IR."""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import AbstractSet, Callable, Iterator, Sequence

import numpy as np

from bbrules.errors import UsageError


# Copies of read-only arrays into other layouts (`relaid`), by the relayout's code, its key and
# the array it reads; each kept while the array it was made from lives.
_RELAID: dict[tuple, tuple[weakref.ref, np.ndarray]] = {}


def relaid(array: np.ndarray, relayout: Callable[[np.ndarray], np.ndarray],
           *key: object) -> np.ndarray:
    """`relayout(array)`, a copy into another order or shape (a matmul operand's, zero
    padding), made once for a read-only array and kept for later calls while the array that
    owns its memory lives: a read-only array is a constant (`Imported` marks a model's
    weights so).  A writeable array may change between calls, so it is copied each time, as
    is what `relayout` returns as a view.  `key` tells apart relayouts written by one line of
    code (the program's padding of each input)."""
    kept = constant_relaid(array, relayout, *key)
    return relayout(array) if kept is None else kept


def constant_relaid(array: np.ndarray, relayout: Callable[[np.ndarray], np.ndarray],
                    *key: object, address: Callable[[np.ndarray], int] | None = None
                    ) -> np.ndarray | None:
    """`relaid`'s kept copy where `array` is a constant (the array owning its memory is
    read-only); None where it is not, for a caller that has a way without the copy.
    `address`: how to read the address of `array`'s first element, which tells its slices
    apart (numpy's `__array_interface__` by default, about 2.2 µs; the native product's
    reads it in 0.17)."""
    owner = _owner(array)
    if owner.flags.writeable:
        return None
    at = array.__array_interface__["data"][0] if address is None else address(array)
    spot = (relayout.__code__, key, id(owner), at, array.shape, array.strides)
    if (kept := _RELAID.get(spot)) is not None and kept[0]() is owner:
        return kept[1]
    value = relayout(array)
    if np.may_share_memory(value, array):
        return value  # a view keeps nothing to save, and would keep the owner alive
    value.flags.writeable = False
    _RELAID[spot] = (weakref.ref(owner, lambda _: _RELAID.pop(spot, None)), value)
    return value


def is_constant(array: np.ndarray) -> bool:
    """Is `array` a view of a constant (the array owning its memory is read-only)?"""
    return not _owner(array).flags.writeable


def _owner(array: np.ndarray) -> np.ndarray:
    """The array that owns `array`'s memory (a view's base, through views of views): read-only
    there, the memory is a constant."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def constant(tile: np.ndarray) -> np.ndarray:
    """`tile`, read-only: a tile a module computes once, when it loads, for every call (what
    `_geometry` finds of read-only positions it keeps)."""
    if isinstance(tile, np.ndarray):  # (the memory's owner too: a view of a fresh arange)
        _owner(tile).flags.writeable = tile.flags.writeable = False
    return tile


def gather_one_hot(values: np.ndarray, axis: int,
                   picks: Sequence[tuple[np.ndarray, Sequence[np.ndarray]]],
                   window: bool = False, own: bool = False, threads: int = 1) -> np.ndarray:
    """The sum along `axis` of `values` times a one-hot that is 1 at each pick's position
    (relative to the block `values` holds: a position outside it, or not a whole number,
    picks nothing) where the pick's guards hold; two picks of one position count once, as the
    one-hot's `or` does.  With `window`, one pick that steps evenly is a read-only view of the
    values (`_window`): for the native product, which reads any strides (numpy's matmul,
    given magika's window, whose rows overlap, took 3.9 ms; 1.9 given a copy of it); with
    `own` too, an array of its own, which the caller may write into; a padded copy on
    `threads` threads.  A position known while generating may be a number, not a tile: one
    position everywhere."""
    picks = [(np.reshape(at, (1,) * values.ndim) if np.ndim(at) == 0 else at, guards)
             for at, guards in picks]
    if window and len(picks) == 1 and \
            (view := _window(values, axis, *picks[0], own=own, threads=threads)) is not None:
        return view
    size = values.shape[axis]
    total, zeroed = None, None
    taken: list[tuple[np.ndarray, np.ndarray]] = []
    # (no Python-level numpy helpers, `any`, `all`, `moveaxis`, where a lookup by ids runs
    # every call: they cost several times their warm time after a product has streamed its
    # operands through the caches)
    for at, guards in picks:
        at = np.asarray(at)
        if not at.size or (lo := at.min()) >= size or (hi := at.max()) < 0:
            continue  # (ONNX's second pick, of negative ids, where there are none)
        index = at.astype(np.intp)
        if lo >= 0 and hi < size and not guards and not taken and (index == at).all():
            # a lookup by ids all in range (a handful of calls, not the mask's dozen)
            taken.append((index, np.True_))
            total = _take(values, axis, index)
            continue
        held = (index == at) & (index >= 0) & (index < size)
        for guard in guards:
            held = held & (np.asarray(guard) != 0)
        for other, other_held in taken:
            held = held & ~(other_held & (other == index))
        count = np.count_nonzero(held)
        if not count:
            continue
        taken.append((index, held))
        if count == held.size:
            part = _take(values, axis, index)
        elif values.size <= prod(np.broadcast_shapes(
                values.shape[:axis] + (1,) + values.shape[axis + 1:], held.shape)):
            # what picks nothing picks a row of zeros appended to the values: a copy of the
            # values, smaller than a pass masking the result
            if zeroed is None:  # rows outermost, as `_take` reads them (magika's window
                # gathered from a copy in the values' layout, positions innermost: 346 µs,
                # against 229)
                rows = np.moveaxis(values, axis, 0)
                zeroed = np.moveaxis(np.concatenate([rows, np.zeros_like(rows[:1])]), 0, axis)
            part = _take(zeroed, axis, np.where(held, index, size))
        else:
            part = np.where(held, _take(values, axis, np.where(held, index, 0)), np.float32(0))
        total = part if total is None else total + part
    if total is None:
        shape = values.shape[:axis] + (1,) + values.shape[axis + 1:]
        picked = [np.shape(x) for at, guards in picks for x in (at, *guards)]
        return np.zeros(np.broadcast_shapes(shape, *picked), np.float32)
    return total


def _window(values: np.ndarray, axis: int, at: np.ndarray, guards: Sequence[np.ndarray],
            own: bool = False, threads: int = 1) -> np.ndarray | None:
    """The pick as a read-only strided view of `values` where its positions are whole numbers
    that step evenly (forwards) along each of their dimensions the values do not span, and its
    guards all hold: a convolution's window (position + tap), a slice, a shift; else None.
    Positions past the values read zeros from a padded copy of them.  A product then reads the
    window in place: magika's convolution gathered 2.6 MB a call (0.2 ms); its product reads
    the window of its 0.5 MB of values instead (the model: 3.23 -> 3.10 ms).
    With `own`, an array of its own: the view itself, writable, where it is of a padded copy
    and no two of its elements share memory (each step past the span of the steps within it:
    a KV cache grown by a token, whose window is then the copy, its pad written by the
    caller), else a copy of the view.  The window's shape is found once for positions that
    do not change (`_geometry`)."""
    at = np.asarray(at)
    if not all(np.all(np.asarray(g) != 0) for g in guards) or \
            (w := _geometry(values, axis, at)) is None:
        return None
    if w.pad is not None and not own and \
            (grown := _grown(values, axis, w.pad.below, w.pad.above, threads)) is not None:
        values = grown
        if (w := _geometry(values, axis, at, shift=w.pad.below)) is None:
            return None
    if w.pad is None:
        view = np.lib.stride_tricks.as_strided(values[w.start], w.shape, w.strides,
                                               writeable=False)
        return view.copy(order="K") if own else view
    memory = np.empty(w.pad.shape, values.dtype)  # (in the values' own order: the window's
    padded = memory.transpose(w.pad.order)  # strides then merge as theirs)
    copy_into = _native_copy()
    copy_into(padded[w.pad.middle], values, threads)
    for end in w.pad.ends:  # (only the pads: zeroing the whole copy first was a pass of its own)
        copy_into(padded[end], None, threads)
    view = np.ndarray(w.shape, values.dtype, memory, w.offset, w.strides)
    view.flags.writeable = own and w.apart
    return view if w.apart or not own else view.copy(order="K")


def _grown(values: np.ndarray, axis: int, below: int, above: int, threads: int = 1
           ) -> np.ndarray | None:
    """`values` grown by `below` zeros before and `above` after along `axis`, as a read-only
    view of a padded copy of the memory it views, where `values` views a C-contiguous array
    no larger than itself (a window: a convolution's taps along another spatial dimension),
    walks each dimension of that array in whole steps of it without passing its end, and
    walks one of them, whole and alone, along `axis`; else None.  Where the values' elements
    overlap, a padded copy of them holds each element once per tap: MBConv's 3 x 3 window
    over 3072 channels of a 10 x 10 image took 1.6 ms so, its memory 0.1."""
    memory = values.base
    if not isinstance(memory, np.ndarray):  # (`as_strided`'s view has a holder between)
        memory = getattr(memory, "base", None)
    if not isinstance(memory, np.ndarray) or not memory.flags.c_contiguous or \
            memory.dtype != values.dtype or memory.size > values.size or \
            memory.size == 0 or values.shape[axis] < 2:
        return None
    memory = memory.reshape([n for n in memory.shape if n > 1])
    if memory.ndim == 0:
        return None
    where = values.__array_interface__["data"][0] - memory.__array_interface__["data"][0]
    start = []  # the memory's index of the values' first element
    for s in memory.strides:
        start.append(where // s)
        where %= s
    walks = {}  # values' dimension -> (memory's dimension, steps of it)
    reach = list(start)
    for d, (n, s) in enumerate(zip(values.shape, values.strides)):
        if n == 1 or s == 0:
            continue
        m = next((m for m, ms in enumerate(memory.strides) if 0 < ms <= s and s % ms == 0),
                 None)
        if m is None:
            return None
        walks[d] = (m, s // memory.strides[m])
        reach[m] += walks[d][1] * (n - 1)
    if where or any(r >= n for r, n in zip(reach, memory.shape)) or \
            walks.get(axis, (0, 0))[1] != 1:
        return None
    m = walks[axis][0]
    if start[m] or memory.shape[m] != values.shape[axis] or \
            any(w[0] == m for d, w in walks.items() if d != axis):
        return None
    shape = list(memory.shape)
    shape[m] += below + above
    grown = np.empty(shape, memory.dtype)
    ahead = (slice(None),) * m
    copy_into = _native_copy()
    copy_into(grown[ahead + (slice(below, below + memory.shape[m]),)], memory, threads)
    for end in (slice(0, below), slice(below + memory.shape[m], shape[m])):
        copy_into(grown[ahead + (end,)], None, threads)
    view = np.ndarray(values.shape[:axis] + (shape[m],) + values.shape[axis + 1:],
                      values.dtype, grown, sum(i * s for i, s in zip(start, grown.strides)),
                      tuple(walks[d][1] * grown.strides[walks[d][0]] if d in walks else 0
                            for d in range(values.ndim)))
    view.flags.writeable = False
    return view


@lru_cache(maxsize=None)
def _native_copy() -> Callable[[np.ndarray, np.ndarray | None, int], None]:
    """`native_matmul.copy_into` where the native product's library loads (a window is a view
    only native modules ask for, which load it), else numpy's assignment: a padded copy's rows
    and pads are short runs, which numpy copies one at a time."""
    from bbrules.codegen import native_matmul
    try:
        native_matmul.library()
        return native_matmul.copy_into
    except native_matmul.NativeUnavailable:
        def assign(out: np.ndarray, values: np.ndarray | None, threads: int) -> None:
            out[...] = 0 if values is None else values
        return assign


@dataclass(frozen=True)
class _Padding:
    """A padded copy of a window's values: the memory's shape (in the values' order), the
    order of the values' dimensions in it, where the values go and the pads, and how many
    zeros go before and after them along the window's axis."""
    shape: tuple[int, ...]
    order: tuple[int, ...]
    middle: tuple[slice, ...]
    ends: tuple[tuple[slice, ...], ...]
    below: int
    above: int


@dataclass(frozen=True)
class _Geometry:
    """A window (`_window`) as a strided view: of the values from `start` along the axis, or
    of a padded copy of them from `offset` bytes; `apart` where no two of its elements share
    memory."""
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    start: tuple[slice, ...]
    offset: int
    pad: _Padding | None
    apart: bool


# The windows of read-only positions (`_geometry`), by the positions and the values' layout,
# kept while the positions live: a module's positions computed once (magika's window,
# position + tap) took 60 µs a call to check; a KV cache's window, 30 µs to lay out.
_GEOMETRY: dict[tuple, tuple[weakref.ref, _Geometry | None]] = {}


def _geometry(values: np.ndarray, axis: int, at: np.ndarray, shift: int = 0
              ) -> _Geometry | None:
    """The window of `values` that positions `at` (plus `shift`) pick along `axis`
    (`_window`), or None where they do not step evenly along dimensions the values do not
    span."""
    fixed = is_constant(at)
    spot = (id(at), at.shape, at.strides, values.shape, values.strides, values.dtype.str, axis,
            shift)
    if fixed and (kept := _GEOMETRY.get(spot)) is not None and kept[0]() is at:
        return kept[1]
    found = _laid_out(values, axis, at, shift)
    if fixed:
        _GEOMETRY[spot] = (weakref.ref(at, lambda _: _GEOMETRY.pop(spot, None)), found)
    return found


def _laid_out(values: np.ndarray, axis: int, at: np.ndarray, shift: int) -> _Geometry | None:
    """`_geometry`, found."""
    if at.ndim != values.ndim:
        return None
    spans = [d for d in range(values.ndim) if d != axis and at.shape[d] > 1]
    if at.shape[axis] != 1 or any(values.shape[d] > 1 for d in spans) or \
            (stepping := _stepping(at, tuple(spans))) is None:
        return None
    base, steps = stepping
    base += shift
    last = base + sum(s * (at.shape[d] - 1) for d, s in steps.items())
    n = values.shape[axis]
    below, above = max(0, -base), max(0, last + 1 - n)
    ahead = (slice(None),) * axis
    pad, strides = None, values.strides
    if below or above:
        order = sorted(range(values.ndim), key=lambda d: -abs(values.strides[d]))
        shape = tuple(values.shape[d] + (below + above if d == axis else 0) for d in order)
        inverse = tuple(order.index(d) for d in range(values.ndim))
        pads = (slice(0, below), slice(below + n, below + n + above))
        ends = tuple(ahead + (part,) for part in pads if part.stop != part.start)
        pad = _Padding(shape, inverse, ahead + (slice(below, below + n),), ends, below, above)
        strides = np.empty(shape, values.dtype).transpose(inverse).strides
    start = base + below
    window = tuple(steps[d] * strides[axis] if d in steps
                   else strides[d] if d != axis and values.shape[d] > 1 else 0
                   for d in range(values.ndim))
    apart, reach = pad is not None, 1  # (each step past the span of those within it)
    for step, extent in sorted((s, at.shape[d]) for d, s in steps.items()):
        apart, reach = apart and step >= reach, step * extent
    return _Geometry(tuple(1 if d == axis else max(at.shape[d], values.shape[d])
                           for d in range(values.ndim)),
                     window, ahead + (slice(start, None),), start * strides[axis], pad, apart)


def _stepping(at: np.ndarray, spans: tuple[int, ...]) -> tuple[int, dict[int, int]] | None:
    """(the first position, the step along each of `spans`) where `at` holds whole numbers
    stepping evenly (forwards) along each of those dimensions; None where it does not."""
    index = at.astype(np.intp)
    if not np.array_equal(index, at):
        return None
    base = int(index.flat[0])
    steps = {d: int(index[tuple(int(e == d) for e in range(at.ndim))]) - base for d in spans}
    even = base + sum((np.arange(at.shape[d]) * s).reshape([-1 if e == d else 1
                                                            for e in range(at.ndim)])
                      for d, s in steps.items())
    return None if any(s < 0 for s in steps.values()) or not np.array_equal(
        np.broadcast_to(even, index.shape), index) else (base, steps)


def lookup(values: np.ndarray, axis: int, at: np.ndarray, whole: bool = False) -> np.ndarray:
    """`gather_one_hot` of two picks, at `at` and at `at` plus the axis' size: a lookup by
    ids, a negative one counted from the end (ONNX's Gather), which is numpy's own indexing.
    Where every id is a whole number in [-size, size) it is one take: LLaMA's 128 ids into a
    1024 x 256 table took 48 µs in a run of its layer as two picks checked one by one (a
    numpy call costs several times its warm time once a product has streamed its weights
    through the caches), and the layer ran 2% faster as one take.  Other ids pick nothing,
    as the picks say, through `gather_one_hot`.  `whole`: the ids are known to be whole
    numbers (an input declared i32, which the module checks as it reads it)."""
    index = at.astype(np.intp)
    if whole or (index == at).all():
        try:
            return _take(values, axis, index)
        except IndexError:  # an id out of range: it picks nothing
            pass
    return gather_one_hot(values, axis, ((at, ()), (at + values.shape[axis], ())))


def _take(values: np.ndarray, axis: int, index: np.ndarray) -> np.ndarray:
    """`np.take_along_axis(values, index, axis)` for an index of extent 1 along `axis`
    (numpy's indexing: a negative index counts from the end, one out of range raises
    IndexError).  Where the index and the values span different dimensions (a lookup of table
    rows by ids, a window of positions over channels), whole rows are taken with one flat
    index and laid out with one copy: several times faster than the general function's index
    arrays.

    A lookup runs once per call of a model: few Python-level steps (from 10.5 µs to 6 for
    LLaMA's 128 ids into a 1024 x 256 table)."""
    ids = [d for d in range(values.ndim) if d != axis and index.shape[d] > 1]
    spans = [d for d in range(values.ndim) if d != axis and values.shape[d] > 1]
    if set(ids) & set(spans):
        return np.take_along_axis(values, index, axis=axis)
    shape = [i if i > 1 else v for v, i in zip(values.shape, index.shape)]
    shape[axis] = 1
    others = [d for d in range(values.ndim) if d != axis]
    rows = values.transpose(axis, *others)
    # (`np.take` of a table laid out in rows, an embedding, takes a third of indexing's time;
    # given other strides it first copies the whole table, which pays where the rows taken
    # hold more elements than the table: magika's 2,048 bytes from a 64 x 320 table laid out
    # by columns took 151 µs by indexing, 30 copied first)
    flat = index.reshape(-1)
    if not rows.flags.c_contiguous and rows.size < flat.size * prod(rows.shape[1:]):
        rows = np.ascontiguousarray(rows)
    rows = rows.take(flat, axis=0) if rows.flags.c_contiguous else rows[flat]
    if not ids or not spans or ids[-1] < spans[0]:  # the rows' order is the result's
        return rows.reshape(shape)
    rows = rows.reshape(tuple(index.shape[d] for d in others) + rows.shape[1:])
    n = len(others)  # pair each dimension of the index with the same one of the values
    return rows.transpose([k for i in range(n) for k in (i, n + i)]).reshape(shape)


def _find_openblas() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """Get and set the thread count of the OpenBLAS numpy loaded, or None where there is none
    this can find (another BLAS, or no /proc/self/maps to find it by: not Linux).

    numpy has no API for it and reads OPENBLAS_NUM_THREADS only when it loads, so this calls
    OpenBLAS's own C functions, under the names OpenBLAS and numpy's scipy-openblas build export.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas_", "openblas_"):
            for suffix in ("64_", ""):
                get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
                set_ = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
                if get is not None and set_ is not None:
                    get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
                    return get, set_
    return None


_OPENBLAS = _find_openblas()
_blas_lock = threading.Lock()
_blas_users = 0
_blas_saved = 0


@contextmanager
def _running_parts() -> Iterator[bool]:
    """numpy's BLAS on one thread while parts run, its own count restored after the last part
    running in this process (parts of several calls may overlap) has finished.  Yields whether
    this call's parts run alone, no other call's overlapping them."""
    global _blas_users, _blas_saved
    with _blas_lock:
        if _blas_users == 0 and _OPENBLAS is not None:
            _blas_saved = _OPENBLAS[0]()
            _OPENBLAS[1](1)
        _blas_users += 1
        alone = _blas_users == 1
    try:
        yield alone
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0 and _OPENBLAS is not None:
                _OPENBLAS[1](_blas_saved)


def _cores_to_bind(allowed: AbstractSet[int] | None, threads: int) -> list[int] | None:
    """The cores the threads running parts are bound to, one each: every core the calling
    thread may run on (`allowed`), where the threads are as many; else None, leaving them to
    the scheduler (None too where `allowed` is: off Linux no thread can be bound).

    Threads left to the scheduler share a core when they wake after a pause: on the 2 cores
    this was measured on, a call made 0.25 s after the last took 48 ms, against 27 ms back to
    back, its two parts running on one core at half speed each.  Bound, it took 26-27 ms.
    With fewer threads than cores, which to take is the scheduler's call: processes that each
    bound their threads to the first cores they may use would all share those."""
    if allowed is None or len(allowed) != threads:
        return None
    return sorted(allowed)


def default_threads() -> int:
    """Threads `load` and `run` split kernels over: `$BBRULES_THREADS` when set, else the cores
    this process may run on, else 1 where numpy's BLAS threads cannot be limited (parts each
    calling a multithreaded BLAS run slower than one)."""
    given = os.environ.get("BBRULES_THREADS")
    if given is not None:
        if not given.strip().isdigit() or int(given) < 1:
            raise UsageError(f"BBRULES_THREADS={given!r}: expected a whole number of threads "
                             f">= 1")
        return int(given)
    if _OPENBLAS is None:
        return 1
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return len(cores) if cores else os.cpu_count() or 1


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _workers(n: int) -> ThreadPoolExecutor:
    """The process's pool of part threads (started on first use, shared by every generated
    module), replaced by a larger one when a kernel has more parts than it has workers."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n:
            old, _pool, _pool_size = _pool, ThreadPoolExecutor(n, "bbrules-part"), n
            if old is not None:
                old.shutdown(wait=False)  # its idle workers exit; queued parts still run
        return _pool


def run_parts(parts: Sequence[tuple[Callable[..., None], int]], threads: int,
              *arrays: np.ndarray) -> None:
    """Run a kernel's parts, `threads` at a time: part(*arrays, start) for each (function,
    start), in order, taken by the calling thread and `threads` - 1 of the pool's as each
    becomes free; numpy's BLAS on one thread meanwhile.  Where these threads take every core
    the caller may run on and no other call's parts overlap them, each is bound to a core of
    its own (`_cores_to_bind`), the calling thread only until the parts are done.

    Returns when every part has finished; an exception a part raised is raised here."""
    todo = iter(parts)
    taking = threading.Lock()
    helpers = min(threads, len(parts)) - 1

    def work(cores: AbstractSet[int] | None) -> None:
        if cores is not None:
            with suppress(OSError):  # binding only speeds the parts up; they run unbound
                os.sched_setaffinity(0, cores)
        # numpy's error state is per thread (a context variable): a worker starts from the default
        with np.errstate(all="ignore"):
            while True:
                with taking:
                    part = next(todo, None)
                if part is None:
                    return
                fn, start = part
                fn(*arrays, start)

    with _running_parts() as alone:
        own = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
        bound = _cores_to_bind(own, helpers + 1) if alone and helpers > 0 else None
        # a worker bound by an earlier call runs this one's parts on the caller's cores
        cores = [{c} for c in bound] if bound else [None] + [own] * helpers
        pool = _workers(helpers) if helpers > 0 else None
        futures = [pool.submit(work, cores[i + 1]) for i in range(helpers)]
        try:
            work(cores[0])
        finally:
            if bound:
                with suppress(OSError):
                    os.sched_setaffinity(0, own)
            wait(futures)
        for future in futures:
            future.result()
