"""Hardware targets: the handful of figures the cost model prices a block program with.

A target is deliberately coarse (one global tier, one local tier per processor, peak flops,
launch overhead): fusion decisions turn on data movement and on whether tiles fit, and these
figures are what decide both.  Built-in targets use published figures; nothing is measured at
run time, so costs are reproducible on any machine.

User targets are TOML files with the same fields, in the units people quote them in:

    name = "a100"                 # optional, defaults to the file's stem
    doc = "..."                   # optional
    global_bandwidth = 2039       # GB/s (1e9 bytes/s)
    local_capacity = 164          # KiB per processor (thread block)
    processors = 108
    peak_flops = 19.5             # TFLOP/s, f32
    peak_flops_f16 = 312          # TFLOP/s, f16/bf16 (tensor cores)
    launch_cost = 4               # µs per kernel

Each figure must be from 1e-6 to 1e9 in its unit, so that no time or ratio overflows.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import SourceError, Span, UsageError, read_source

KIB = 1024


@dataclass(frozen=True)
class Target:
    """A machine, in SI units: bytes/s, bytes, FLOP/s, seconds."""

    name: str
    global_bandwidth: float  # B/s between global memory and the processors, whole chip
    local_capacity: int  # bytes of fast local memory one processor (thread block) may use
    processors: int  # SMs / cores that run grid points in parallel
    peak_flops: float  # f32 FLOP/s, whole chip
    peak_flops_f16: float  # f16/bf16 FLOP/s for block matmuls on 16-bit data, whole chip
    launch_cost: float  # seconds of fixed overhead per kernel
    doc: str = ""


BUILTIN_TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("h100", 3.35e12, 227 * KIB, 132, 67e12, 990e12, 4e-6,
               "NVIDIA H100 SXM: 3.35 TB/s HBM3, 227 KiB shared memory per block, 132 SMs, "
               "67 TFLOP/s f32 (CUDA cores), ~990 TFLOP/s f16 (dense tensor cores)"),
        Target("h200", 4.8e12, 227 * KIB, 132, 67e12, 990e12, 4e-6,
               "NVIDIA H200: H100 SMs with 4.8 TB/s HBM3e"),
        Target("cpu", 20e9, 1024 * KIB, 2, 100e9, 100e9, 20e-6,
               "a 2-core x86 server: ~20 GB/s DRAM, 1 MiB L2 per core as local memory, "
               "~100 GFLOP/s f32 (no faster f16 path), ~20 µs interpreter/launch overhead "
               "per kernel"),
    )
}

# TOML field -> (expected kind, conversion of the file's unit to SI; see the module docstring).
# Dividing by 1e6 (not multiplying by 1e-6) keeps "2.5 µs" exactly 2.5e-6.
_FIELDS: dict[str, tuple[type, Callable[[float], float]]] = {
    "global_bandwidth": (float, lambda gb_s: gb_s * 1e9),
    "local_capacity": (int, lambda kib: kib * KIB),
    "processors": (int, lambda n: n),
    "peak_flops": (float, lambda tflop_s: tflop_s * 1e12),
    "peak_flops_f16": (float, lambda tflop_s: tflop_s * 1e12),
    "launch_cost": (float, lambda us: us / 1e6),
}
_OPTIONAL = {"name", "doc"}
# The values a target file may give, in its units: finite, and far enough from 0 and from
# float overflow that times, ratios and their reciprocals stay finite and positive.
_RANGE = (1e-6, 1e9)


def get_target(name_or_path: str) -> Target:
    """A built-in target by name (case-insensitive), or a target read from a TOML file."""
    builtin = BUILTIN_TARGETS.get(name_or_path.lower())
    if builtin is not None:
        return builtin
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return load_target(path)
    raise UsageError(f"unknown target '{name_or_path}': use a .toml file or one of "
                     f"{', '.join(BUILTIN_TARGETS)}")


def load_target(path: Path) -> Target:
    """Read a TOML target file; every mistake in it is a `SourceError` at its position."""
    text = read_source(path, "target file")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line, col = _decode_position(e, text)
        raise SourceError(Span(str(path), line, col), f"invalid TOML: {_decode_message(e)}",
                          text) from None

    def error(key: str | None, message: str) -> SourceError:
        return SourceError(Span(str(path), _key_line(text, key), 1), message, text)

    for key in data:
        if key not in _FIELDS and key not in _OPTIONAL:
            raise error(key, f"unknown target field '{key}' (fields: "
                             f"{', '.join([*_OPTIONAL, *_FIELDS])})")
    missing = [k for k in _FIELDS if k not in data]
    if missing:
        raise error(None, f"target file lacks {', '.join(missing)}")
    values: dict[str, float] = {}
    for key, (kind, to_si) in _FIELDS.items():
        v = data[key]
        ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok:
            raise error(key, f"'{key}' must be {'an integer' if kind is int else 'a number'}")
        if not v > 0:
            raise error(key, f"'{key}' must be positive")
        if not _RANGE[0] <= v <= _RANGE[1]:
            raise error(key, f"'{key}' must be from {_RANGE[0]:g} to {_RANGE[1]:g} in its "
                             f"unit (see the bbrules.targets docstring)")
        values[key] = kind(to_si(v))
    for key in _OPTIONAL:
        if key in data and not isinstance(data[key], str):
            raise error(key, f"'{key}' must be a string")
    return Target(name=data.get("name", path.stem), doc=data.get("doc", ""), **values)


def _key_line(text: str, key: str | None) -> int:
    """The line that assigns `key` at top level (1 if absent: the error is about the file)."""
    if key is not None:
        pattern = re.compile(rf"^\s*(\"{re.escape(key)}\"|{re.escape(key)})\s*=")
        for i, line in enumerate(text.splitlines(), 1):
            if pattern.match(line):
                return i
    return 1


_AT = re.compile(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)$")


def _decode_position(e: tomllib.TOMLDecodeError, text: str) -> tuple[int, int]:
    """tomllib's error position: attributes on Python >= 3.14, inside the message before.

    "At end of document" points just past the last character of the last line.
    """
    line, col = getattr(e, "lineno", None), getattr(e, "colno", None)
    if line is not None:
        return line, col
    m = _AT.search(str(e))
    if m and m[1]:
        return int(m[1]), int(m[2])
    lines = text.splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


def _decode_message(e: tomllib.TOMLDecodeError) -> str:
    return getattr(e, "msg", None) or _AT.sub("", str(e))
