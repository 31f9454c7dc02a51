"""The `bbrules` command line.

Each subcommand is a function `cmd_<name>(args) -> int` registered with `@command`, together
with a function that declares its arguments, so adding one touches nothing else.  User mistakes
(`SourceError`, `UsageError`) are printed without a traceback and give exit status 2; a
traceback always means a bug in bbrules.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from . import __version__, dense, interp
from .blockfile import load_block_program
from .cost import cost_program
from .errors import SourceError, UsageError
from .frontend import DimOverrides, load_program, parse_dim_override
from .inputs import random_inputs
from .ir import BlockProgram, Dim, show_program
from .lower import lower
from .program import Program
from .targets import get_target

Setup = Callable[[argparse.ArgumentParser], None]
Command = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Subcommand:
    help: str
    setup: Setup
    run: Command


COMMANDS: dict[str, Subcommand] = {}


def command(name: str, help: str, setup: Setup) -> Callable[[Command], Command]:
    """Register `cmd_<name>` as the subcommand `name`, its arguments declared by `setup`."""
    def register(fn: Command) -> Command:
        COMMANDS[name] = Subcommand(help, setup, fn)
        return fn
    return register


# --------------------------------------------------------------------------------------------
# Loading programs


def load_any(path: str, dims: DimOverrides) -> tuple[Program | None, BlockProgram]:
    """A program file as (AST, block program).

    `.bbp`: the parsed program (with `dims` overrides) and its unfused lowering.  `.bbk`: the
    block program as written, with the AST of the `.bbp` it records as its source (resolved
    relative to the `.bbk` file, at the block program's dimensions), or None if it records none.
    """
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file")
    if file.suffix == ".bbp":
        ast = load_program(path, dims)
        return ast, lower(ast)
    if file.suffix == ".bbk":
        if dims:
            raise UsageError(f"{path}: --dim applies to .bbp programs; a block program's "
                             f"dimensions are fixed")
        block_file = load_block_program(path)
        if block_file.source is None:
            return None, block_file.program
        return _source_program(file, block_file.source, block_file.program.dims), \
            block_file.program
    raise UsageError(f"{path}: expected a .bbp program or a .bbk block program")


def _source_program(bbk: Path, source: str, dims: dict[str, Dim]) -> Program:
    """The recorded source program, re-dimensioned to match the block program fused from it."""
    path = bbk.parent / source
    if not path.is_file():
        raise UsageError(f"{bbk}: its source program {path} does not exist")
    ast = load_program(str(path))
    override = {n: (d.extent, d.block) for n, d in dims.items()
                if n in ast.dims and ast.dims[n] != d}
    return load_program(str(path), override) if override else ast


def _dims(overrides: list[str]) -> DimOverrides:
    dims: DimOverrides = {}
    for text in overrides:
        name, extent, block = parse_dim_override(text)
        dims[name] = (extent, block)
    return dims


def _program_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", help="a .bbp program or a .bbk block program")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=EXTENT[/BLOCK]",
                   help="override a dimension of a .bbp program (repeatable)")


# --------------------------------------------------------------------------------------------
# Subcommands


@command("show", "print the block program (the unfused lowering of a .bbp)", _program_args)
def cmd_show(args: argparse.Namespace) -> int:
    _, program = load_any(args.program, _dims(args.dim))
    print(show_program(program), end="")
    return 0


def _cost_args(p: argparse.ArgumentParser) -> None:
    _program_args(p)
    p.add_argument("--target", default="h100", help="a built-in target name or a .toml file")
    p.add_argument("--json", action="store_true", help="print the cost report as JSON")


@command("cost", "print the data-movement cost of a program, kernel by kernel", _cost_args)
def cmd_cost(args: argparse.Namespace) -> int:
    _, program = load_any(args.program, _dims(args.dim))
    report = cost_program(program, get_target(args.target))
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 0


def _run_args(p: argparse.ArgumentParser) -> None:
    _program_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


# (rtol, atol) per output dtype: f16/bf16 outputs are checked at their own precision.
TOLERANCE = {"f32": (1e-3, 1e-4), "f16": (1e-2, 1e-3), "bf16": (5e-2, 1e-2)}


@dataclass(frozen=True)
class Comparison:
    """One output against its dense reference; relative error is |err| / max(|ref|, atol)."""

    max_abs: float
    max_rel: float
    ok: bool
    rtol: float
    atol: float

    @staticmethod
    def of(got: np.ndarray, want: np.ndarray, dtype: str) -> Comparison:
        rtol, atol = TOLERANCE[dtype]
        got64, want64 = got.astype(np.float64), want.astype(np.float64)
        err = np.abs(got64 - want64)
        ok = bool(np.all(err <= atol + rtol * np.abs(want64)))
        rel = err / np.maximum(np.abs(want64), atol)
        return Comparison(float(np.max(err)), float(np.max(rel)), ok, rtol, atol)

    def line(self, name: str) -> str:
        verdict = "ok" if self.ok else f"FAILED (tolerance rtol {self.rtol:g}, atol {self.atol:g})"
        return (f"{name}: max abs error {self.max_abs:.3g}, "
                f"max rel error {self.max_rel:.3g}: {verdict}")


def _finite(x: float) -> float | None:
    """JSON has no NaN/inf: report them as null."""
    return x if np.isfinite(x) else None


@command("run", "run a program on random inputs with the reference interpreter and compare "
                "with the dense evaluation", _run_args)
def cmd_run(args: argparse.Namespace) -> int:
    ast, program = load_any(args.program, _dims(args.dim))
    inputs = random_inputs(program, seed=args.seed)
    start = time.perf_counter()
    outputs = interp.run(program, inputs)
    elapsed = time.perf_counter() - start
    if ast is None:
        return _report_checksums(args, program, outputs, elapsed)
    reference = dense.evaluate(ast, inputs)
    for name in program.outputs:
        if name not in reference or reference[name].shape != outputs[name].shape:
            raise UsageError(f"{args.program}: output {name} is not defined with the same shape "
                             f"by the source program {ast.path}")
    results = {name: Comparison.of(outputs[name], reference[name], program.tensors[name].dtype)
               for name in program.outputs}
    ok = all(r.ok for r in results.values())
    if args.json:
        print(json.dumps({
            "program": args.program, "seed": args.seed, "time_s": elapsed, "compared": True,
            "ok": ok,
            "outputs": {n: {"max_abs_err": _finite(r.max_abs), "max_rel_err": _finite(r.max_rel),
                            "ok": r.ok} for n, r in results.items()},
        }, indent=2))
    else:
        for name, r in results.items():
            print(r.line(name))
        print(f"interpreter time: {elapsed:.3f} s")
    return 0 if ok else 1


def _report_checksums(args: argparse.Namespace, program: BlockProgram,
                      outputs: dict[str, np.ndarray], elapsed: float) -> int:
    note = "the block program records no source program: nothing was compared"
    sums = {n: (float(np.sum(outputs[n], dtype=np.float64)),
                float(np.sum(np.abs(outputs[n]), dtype=np.float64))) for n in program.outputs}
    if args.json:
        print(json.dumps({
            "program": args.program, "seed": args.seed, "time_s": elapsed, "compared": False,
            "note": note,
            "outputs": {n: {"sum": _finite(s), "abs_sum": _finite(a)}
                        for n, (s, a) in sums.items()},
        }, indent=2))
    else:
        for name, (s, a) in sums.items():
            print(f"{name}: sum {s:.6g}, sum of |x| {a:.6g}")
        print(f"interpreter time: {elapsed:.3f} s")
        print(f"note: {note}")
    return 0


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bbrules", description="Block-level operator fusion for AI inference programs.")
    parser.add_argument("--version", action="version", version=f"bbrules {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, c in COMMANDS.items():
        p = sub.add_parser(name, help=c.help, description=c.help)
        c.setup(p)
        p.set_defaults(run=c.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (2 for any user mistake)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:  # argparse reports usage errors (status 2) and --help (0)
        return int(exit.code or 0)
    try:
        return args.run(args)
    except SourceError as err:
        print(err, file=sys.stderr)
    except UsageError as err:
        print(f"bbrules: error: {err}", file=sys.stderr)
    return 2
