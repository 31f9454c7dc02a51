"""Worker processes that run module-level functions of bbrules on pickled arguments: the pool
in which `candidates.fuse_candidates` fuses a model's candidates at once.

Why not `multiprocessing` (spawn): a spawned worker first imports the caller's main script
again, as `__mp_main__`.  A script that calls `bbrules.fuse` at its top level, without an
`if __name__ == "__main__":` guard, then re-ran its own code in every worker (an export it
writes, a model it loads) until the call, where multiprocessing refused to start a process
while one was starting: a RuntimeError in each worker, `BrokenProcessPool` in the caller.
These workers are fresh interpreters that import bbrules and nothing of the caller's.  (Not
fork: the caller may be running egglog's threads, which a fork would not carry.)

The protocol is pickles over the worker's stdin and a duplicate of its stdout; the worker's
own stdout goes to its stderr, so that nothing it prints can corrupt a reply."""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from typing import Any, Callable, Sequence

_SERVE = "from bbrules.workers import serve; serve()"


class WorkerError(RuntimeError):
    """A worker process ended without replying (killed, out of memory, a crash)."""


def run_all(calls: Sequence[tuple[Callable[..., Any], tuple]], workers: int,
            initializer: Callable[..., None], initargs: tuple = ()) -> list[Any]:
    """`[fn(*args) for fn, args in calls]`, computed in `workers` processes, each of which
    first runs `initializer(*initargs)`; a worker takes the next call as soon as it is free.
    An exception a call raised is raised here (the first in the order of `calls`), after
    every worker has stopped."""
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(calls)):
        todo.put(i)
    results: list[tuple[bool, Any]] = [(False, WorkerError("not run"))] * len(calls)
    processes = [_start() for _ in range(max(1, min(workers, len(calls))))]

    def feed(process: subprocess.Popen) -> None:
        taken: list[int] = []
        try:
            _send(process, (initializer, initargs))
            started = _receive(process)
            while True:
                try:
                    taken.append(todo.get_nowait())
                except queue.Empty:
                    return
                if started[0]:
                    _send(process, calls[taken[-1]])
                results[taken[-1]] = _receive(process) if started[0] else started
        except WorkerError as err:
            for i in [*taken[-1:], *_drain(todo)]:
                results[i] = (False, err)

    threads = [threading.Thread(target=feed, args=(p,), daemon=True) for p in processes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for p in processes:
            _stop(p)
    for done, value in results:
        if not done:
            raise value
    return [value for _, value in results]


def _start() -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)


def _send(process: subprocess.Popen, message: object) -> None:
    try:
        pickle.dump(message, process.stdin)
        process.stdin.flush()
    except (BrokenPipeError, OSError):
        raise WorkerError(f"a fusion worker (pid {process.pid}) exited") from None


def _receive(process: subprocess.Popen) -> tuple[bool, Any]:
    try:
        return pickle.load(process.stdout)
    except (EOFError, pickle.UnpicklingError, OSError):
        raise WorkerError(f"a fusion worker (pid {process.pid}) exited without replying "
                          f"(status {process.poll()})") from None


def _drain(todo: queue.Queue[int]) -> list[int]:
    taken = []
    while True:
        try:
            taken.append(todo.get_nowait())
        except queue.Empty:
            return taken


def _stop(process: subprocess.Popen) -> None:
    """Close the worker's input (it exits at the end of it), killing it if it does not."""
    try:
        process.stdin.close()
    except OSError:
        pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.stdout.close()


def serve() -> None:
    """A worker's loop: each call it is sent (the initializer first), replied to with
    (True, its result) or (False, the exception it raised), until its input ends."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # (what the worker prints: to stderr)
    requests = sys.stdin.buffer
    while True:
        try:
            fn, args = pickle.load(requests)  # the initializer first
        except EOFError:
            return
        try:
            reply: tuple[bool, Any] = (True, fn(*args))
        except Exception as err:  # (raised in the caller)
            reply = (False, err)
        try:
            data = pickle.dumps(reply)
        except Exception as err:  # (what cannot be pickled is told as text)
            data = pickle.dumps((False, WorkerError(f"{reply[1]!r} could not be sent back: "
                                                    f"{err}")))
        replies.write(data)
        replies.flush()
