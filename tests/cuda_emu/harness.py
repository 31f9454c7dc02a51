"""Compile generated CUDA source with the emulation header; launch it, or hunt for races.

`emulate` runs the kernels through a shared library loaded with ctypes.  `race_check` builds
the same source with ThreadSanitizer into a small program that runs every kernel once: a
missing `__syncthreads()` then shows up as a data race even when the emulated numbers happen to
come out right.

Compiling takes about a second per program, so builds are cached by a hash of everything that
goes into them, in the system temporary directory; a new name is written atomically, so
concurrent test runs can share the cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import numpy as np

from bbrules.codegen.cuda_gen import FORMATS, CudaModule, from_storage, to_storage

HEADER = Path(__file__).with_name("cuda_emu.h")
CACHE = Path(tempfile.gettempdir()) / "bbrules-cuda-emu"
FLAGS = ("-std=c++20", "-O1", "-pthread", "-Wall", "-Werror")
LIBRARY_FLAGS = ("-shared", "-fPIC")
TSAN_FLAGS = ("-g", "-fsanitize=thread")
TSAN_RACE_EXIT = 66  # ThreadSanitizer's exit status when it reported something

_NAN_BITS = {"f32": np.float32(np.nan), "f16": np.float16(np.nan), "bf16": np.uint16(0x7FC0)}


def _wrappers(module: CudaModule) -> str:
    """A C entry point per kernel: bb_emu_<name>(grid, threads, shared bytes, void** args)."""
    out = []
    for k in module.kernels:
        args = ", ".join(f"({ct})args[{i}]" for i, ct in enumerate(k.signature))
        out.append(f'extern "C" void bb_emu_{k.name}(unsigned grid, unsigned threads, '
                   f"unsigned long shared_bytes, void** args) {{\n"
                   f"    bb_emu::launch(grid, threads, shared_bytes,\n"
                   f"                   [args] {{ {k.name}({args}); }});\n"
                   f"}}\n")
    return "\n".join(out)


def _compile(text: str, flags: tuple[str, ...], suffix: str) -> Path:
    """`text` compiled with g++ and `flags` (cached by content); the output's path."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("g++ is not on PATH: cannot emulate CUDA kernels")
    key = hashlib.sha256("\0".join([text, HEADER.read_text(), *flags]).encode()).hexdigest()
    target = CACHE / f"{key[:32]}{suffix}"
    if not target.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            src = Path(tmp) / "kernels.cpp"
            src.write_text(text)
            out = Path(tmp) / f"out{suffix}"
            proc = subprocess.run([compiler, *flags, "-o", str(out), str(src)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"g++ rejected the generated source:\n{proc.stderr}")
            os.replace(out, target)
    return target


def build(module: CudaModule) -> ctypes.CDLL:
    """The module's kernels compiled for the CPU as a shared library (cached)."""
    text = f'#include "{HEADER}"\n\n{module.source}\n{_wrappers(module)}'
    return ctypes.CDLL(str(_compile(text, FLAGS + LIBRARY_FLAGS, ".so")))


def race_check(module: CudaModule, threads: int = 64) -> str:
    """ThreadSanitizer's report on running every kernel once ('' when it found no race).

    The inputs are arbitrary (races do not depend on values).  Raises RuntimeError when the
    sanitizer cannot run here (no libtsan, or a kernel that refuses its memory layout).
    """
    lines = [f'#include "{HEADER}"', "", module.source, "int main() {"]
    for name, info in module.tensors.items():
        fmt = FORMATS[info.dtype]
        size = int(np.prod(info.shape, dtype=np.int64))
        one = {"f32": "(i % 7) * 0.25f", "f16": "0x3c00", "bf16": "0x3f80"}[info.dtype]
        lines.append(f"    static {fmt.ctype} t_{name}[{size}];")
        lines.append(f"    for (long i = 0; i < {size}; ++i) t_{name}[i] = {one};")
    for k in module.kernels:
        args = ", ".join(f"t_{t}" for t in k.params)
        lines.append(f"    bb_emu::launch({k.grid}, {threads}, {k.shared_bytes}, "
                     f"[&] {{ {k.name}({args}); }});")
    lines += ["    return 0;", "}", ""]
    program = _compile("\n".join(lines), FLAGS + TSAN_FLAGS, ".tsan")
    proc = subprocess.run([str(program)], capture_output=True, text=True)
    if proc.returncode == 0:
        return ""
    if proc.returncode == TSAN_RACE_EXIT and "ThreadSanitizer" in proc.stderr:
        return proc.stderr
    raise RuntimeError(f"the sanitized program failed (status {proc.returncode}):\n"
                       f"{proc.stderr[-2000:]}")


def emulate(module: CudaModule, inputs: dict[str, np.ndarray],
            threads: int | None = None) -> dict[str, np.ndarray]:
    """Run every kernel in order on `inputs`; every stored tensor as float32.

    `threads` overrides each kernel's threads per block (the kernels must be correct for any
    count up to `MAX_THREADS`).  Stored tensors start as NaN, so a read of an element no kernel
    wrote shows up.
    """
    lib = build(module)
    memory: dict[str, np.ndarray] = {}
    for name in module.inputs:
        info = module.tensors[name]
        memory[name] = to_storage(inputs[name], info.dtype)
        if memory[name].shape != info.extent:
            raise ValueError(f"input '{name}' has shape {memory[name].shape}, "
                             f"expected {info.extent}")
        memory[name] = np.pad(memory[name], info.padding())  # zeros past ragged extents
    for k in module.kernels:
        for t in k.params:
            if t not in memory:
                info = module.tensors[t]
                memory[t] = np.full(info.shape, _NAN_BITS[info.dtype])
        args = (ctypes.c_void_p * len(k.params))(*(memory[t].ctypes.data for t in k.params))
        entry = getattr(lib, f"bb_emu_{k.name}")
        entry.argtypes = (ctypes.c_uint, ctypes.c_uint, ctypes.c_ulong, ctypes.c_void_p)
        entry(k.grid, threads or k.threads, k.shared_bytes, args)
    stored = dict.fromkeys(t for k in module.kernels for t in k.tensors)
    return {t: from_storage(memory[t], module.tensors[t].dtype)[
        tuple(slice(0, n) for n in module.tensors[t].extent)] for t in stored}


class _Function:
    """A kernel of the emulated library, called the way CuPy calls a RawModule function."""

    def __init__(self, lib: ctypes.CDLL, name: str):
        self.entry = getattr(lib, f"bb_emu_{name}")
        self.entry.argtypes = (ctypes.c_uint, ctypes.c_uint, ctypes.c_ulong, ctypes.c_void_p)
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def __call__(self, grid: tuple[int], block: tuple[int], args: tuple[np.ndarray, ...],
                 shared_mem: int = 0) -> None:
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise ValueError(f"launch with {shared_mem} bytes of shared memory, above the "
                             f"{self.max_dynamic_shared_size_bytes} the function allows")
        pointers = (ctypes.c_void_p * len(args))(*(a.ctypes.data for a in args))
        self.entry(grid[0], block[0], shared_mem, pointers)


def fake_cupy(module: CudaModule) -> types.ModuleType:
    """A stand-in for the `cupy` module, backed by numpy and the emulator: enough of it to run
    the module's generated launcher unchanged, so the launcher is tested without a GPU."""
    lib = build(module)
    cp = types.ModuleType("cupy")
    for name in ("float32", "float16", "uint16", "uint32", "asarray", "ascontiguousarray",
                 "where", "empty"):
        setattr(cp, name, getattr(np, name))

    class RawModule:
        def __init__(self, code: str):
            if code != module.source:
                raise ValueError("the launcher compiles other source than the module's")

        def get_function(self, name: str) -> _Function:
            return _Function(lib, name)

    cp.RawModule = RawModule
    return cp
