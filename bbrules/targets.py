"""Hardware targets: the handful of figures the cost model prices a block program with.

A target is deliberately coarse (one global tier, one local tier per processor, a rate per
compute unit, launch overhead): fusion decisions turn on data movement and on whether tiles
fit, and these figures are what decide both.  GPU targets use published figures; the `cpu`
target's were measured (`benchmarks/measure_cpu_target.py`); nothing is measured at run time,
so costs are reproducible on any machine.

Work is priced by the unit that does it (`bbrules.cost`): block contractions on the matrix
unit at the rate for their operands' dtype (16-bit: `peak_flops_f16`; f32: `peak_flops_dot_f32`,
which on H100/H200 is the TF32 tensor-core rate, the choice a compiler makes for f32 matmuls
when it may, e.g. torch's `allow_tf32`), special functions (exp, log, rsqrt, tanh, ...) at
`special_rate`, everything else (elementwise arithmetic, in-tile reductions, monoid combines)
on the vector units at `peak_flops`.  `step_cost` is the fixed cost of one operation in a
step of a kernel's loops (a load, an elementwise step, a contraction, a combine), paid once
per step for the whole grid: the numpy backend runs a step as one numpy call per operation
over every grid point at once, and a call costs microseconds whatever its size, so many
small steps are slow there.  GPU targets leave it at 0: a thread block's steps overlap other
blocks' work, and their cost is the work itself.  `gathers` says the backend runs a
contraction by a one-hot (an embedding lookup, a convolution's shifts: `bbrules.onehot`) as a
gather, one copied element per picked element of the result, as the numpy backend does; the
GPU backends contract it like any other operand, and their targets price it so.
`resolution` is how far apart two modeled times must be for the model to tell them apart:
closer, they count as a tie and the one with less global traffic wins (`ProgramCost.key`).

User targets are TOML files with the same fields, in the units people quote them in:

    name = "a100"                 # optional, defaults to the file's stem
    doc = "..."                   # optional
    global_bandwidth = 2039       # GB/s (1e9 bytes/s)
    local_capacity = 164          # KiB per processor (thread block)
    processors = 108
    peak_flops = 19.5             # TFLOP/s, f32 vector (CUDA cores)
    peak_flops_f16 = 312          # TFLOP/s, block matmuls on f16/bf16 operands (tensor cores)
    peak_flops_dot_f32 = 156      # TFLOP/s, block matmuls on f32 operands; optional, default
                                  #   peak_flops (no faster f32 matrix path)
    special_rate = 2.44           # T evaluations/s of exp, log, rsqrt, ...; optional, default
                                  #   peak_flops (one special function costs one f32 flop)
    launch_cost = 4               # µs per kernel
    step_cost = 1.9               # µs per operation in a step of a kernel's loops, once per
                                  #   step for the whole grid; optional, default 0
    gathers = true                # the backend runs a contraction by a one-hot as a gather;
                                  #   optional, default false
    resolution = 0.03             # fraction; optional, default 0 (times compared exactly)
    block_granularity = 16        # elements; optional, default 16 (the matrix units' tile
                                  #   side): the smallest block extraction gives a kernel

Each figure must be from 1e-6 to 1e9 in its unit, so that no time or ratio overflows; the
resolution from 0 to 0.5.  The defaults price every program exactly as before these optional
fields existed, so older target files keep their meaning.
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
    """A machine, in SI units: bytes/s, bytes, FLOP/s, evaluations/s, seconds.

    `peak_flops_dot_f32` and `special_rate` left at 0 take `peak_flops`, the vector rate."""

    name: str
    global_bandwidth: float  # B/s between global memory and the processors, whole chip
    local_capacity: int  # bytes of fast local memory one processor (thread block) may use
    processors: int  # SMs / cores that run grid points in parallel
    peak_flops: float  # f32 FLOP/s of the vector units (CUDA cores), whole chip
    peak_flops_f16: float  # FLOP/s of block matmuls on 16-bit operands, whole chip
    launch_cost: float  # seconds of fixed overhead per kernel
    doc: str = ""
    peak_flops_dot_f32: float = 0.0  # FLOP/s of block matmuls on f32 operands, whole chip
    special_rate: float = 0.0  # special-function evaluations/s, whole chip
    resolution: float = 0.0  # modeled times closer than this fraction are a tie
    block_granularity: int = 16  # the smallest block a kernel may choose for itself
    step_cost: float = 0.0  # seconds per operation in a loop step, once for the whole grid
    gathers: bool = False  # contractions by a one-hot run as gathers (`bbrules.onehot`)

    def __post_init__(self) -> None:
        for name in ("peak_flops_dot_f32", "special_rate"):
            if not getattr(self, name):
                object.__setattr__(self, name, self.peak_flops)


BUILTIN_TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("h100", 3.35e12, 227 * KIB, 132, 67e12, 990e12, 4e-6,
               "NVIDIA H100 SXM: 3.35 TB/s HBM3, 227 KiB shared memory per block, 132 SMs, "
               "67 TFLOP/s f32 (CUDA cores), dense tensor cores ~990 TFLOP/s on f16/bf16 "
               "operands and ~495 TFLOP/s on f32 operands (as TF32), special functions "
               "16/SM/clock x 132 SMs x 1.98 GHz ~ 4.18e12/s; modeled times within 3% tie",
               495e12, 4.18e12, 0.03),
        Target("h200", 4.8e12, 227 * KIB, 132, 67e12, 990e12, 4e-6,
               "NVIDIA H200: H100 SMs with 4.8 TB/s HBM3e", 495e12, 4.18e12, 0.03),
        Target("cpu", 17.7e9, 512 * KIB, 2, 6.46e9, 59.7e9, 1.8e-6,
               "the 2-core AMD EPYC development server, measured with numpy 2.5 by "
               "benchmarks/measure_cpu_target.py on 2026-12-03 (best of three runs of "
               "--repeat 15): 17.7 GB/s DRAM copy, 512 KiB L2 per core as local memory, "
               "batched 64x64 f32 matmul 59.7 GFLOP/s (also the f16 rate: numpy computes "
               "in f32), exp 0.773e9/s, multiply 6.46 GFLOP/s, 1.8 µs per generated kernel; "
               "modeled times within 5% tie; 1.9 µs per operation of a loop step (measured "
               "2026-12-05); one-hot contractions are gathers", 59.7e9, 0.773e9, 0.05,
               step_cost=1.9e-6, gathers=True),
    )
}

# The values a target file may give, in its units: finite, and far enough from 0 and from
# float overflow that times, ratios and their reciprocals stay finite and positive.
_RANGE = (1e-6, 1e9)
# A resolution is a fraction of a modeled time; half of it is already no resolution at all.
_RESOLUTION_RANGE = (0.0, 0.5)


@dataclass(frozen=True)
class _Field:
    """A numeric field of a target file: its kind, the conversion of the file's unit to SI
    (see the module docstring) and the range the file's value must lie in."""

    kind: type
    to_si: Callable[[float], float]
    range: tuple[float, float] = _RANGE


# Dividing by 1e6 (not multiplying by 1e-6) keeps "2.5 µs" exactly 2.5e-6.
_FIELDS: dict[str, _Field] = {
    "global_bandwidth": _Field(float, lambda gb_s: gb_s * 1e9),
    "local_capacity": _Field(int, lambda kib: kib * KIB),
    "processors": _Field(int, lambda n: n),
    "peak_flops": _Field(float, lambda tflop_s: tflop_s * 1e12),
    "peak_flops_f16": _Field(float, lambda tflop_s: tflop_s * 1e12),
    "launch_cost": _Field(float, lambda us: us / 1e6),
}
# Optional figures: absent, they take the `Target` defaults (see the module docstring).
_DEFAULTED: dict[str, _Field] = {
    "peak_flops_dot_f32": _Field(float, lambda tflop_s: tflop_s * 1e12),
    "special_rate": _Field(float, lambda t_s: t_s * 1e12),
    "resolution": _Field(float, lambda fraction: fraction, _RESOLUTION_RANGE),
    "block_granularity": _Field(int, lambda n: n, (1, 4096)),
    "step_cost": _Field(float, lambda us: us / 1e6),
}
_OPTIONAL = {"name", "doc"}
_FLAGS = {"gathers"}  # optional booleans, default false


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

    numeric = {**_FIELDS, **_DEFAULTED}
    for key in data:
        if key not in numeric and key not in _OPTIONAL and key not in _FLAGS:
            raise error(key, f"unknown target field '{key}' (fields: "
                             f"{', '.join([*_OPTIONAL, *numeric, *_FLAGS])})")
    missing = [k for k in _FIELDS if k not in data]
    if missing:
        raise error(None, f"target file lacks {', '.join(missing)}")
    values: dict[str, float] = {}
    for key, f in numeric.items():
        if key not in data:
            continue
        v = data[key]
        ok = isinstance(v, int) if f.kind is int else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok:
            raise error(key, f"'{key}' must be {'an integer' if f.kind is int else 'a number'}")
        low, high = f.range
        if low > 0 and not v > 0:
            raise error(key, f"'{key}' must be positive")
        if not low <= v <= high:
            raise error(key, f"'{key}' must be from {low:g} to {high:g} in its unit (see the "
                             f"bbrules.targets docstring)")
        values[key] = f.kind(f.to_si(v))
    for key in _OPTIONAL:
        if key in data and not isinstance(data[key], str):
            raise error(key, f"'{key}' must be a string")
    for key in _FLAGS & data.keys():
        if not isinstance(data[key], bool):
            raise error(key, f"'{key}' must be true or false")
        values[key] = data[key]
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
