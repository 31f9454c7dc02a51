"""The `bbrules` command line.

Each subcommand is a function `cmd_<name>(args) -> int` registered with `@command`, together
with a function that declares its arguments, so adding one touches nothing else.  User mistakes
(`SourceError`, `UsageError`) are printed without a traceback and give exit status 2; a
traceback always means a bug in bbrules.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from . import __version__, dense, gpukit, interp
from .codegen import cuda_gen, native, numpy_gen, numpy_timing, triton_gen
from .blockfile import BlockFile, load_block_program
from .cost import ProgramCost, cost_program, fmt_bytes, fmt_flops, fmt_time
from .engine import Budget, run_checks
from .errors import SourceError, Span, UsageError
from .extract import NoCandidate
from .frontend import DimOverrides, load_program, parse_dim_override, parse_program
from .candidates import (DEFAULT_THRESHOLD, PackSource, StitchedResult, fuse_candidates,
                         select_candidates)
from .fuse import FuseResult, fuse
from .onnx_import import import_onnx
from .inputs import random_inputs
from .ir import WHOLE_DTYPES, BlockProgram, check_whole, show_program
from .lower import lower
from .memory import default_budget, run_bytes
from .options import SPENT, Meter, Options
from .packs import discover_packs, load_each, merge_all, pack_directories
from .program import Interface, Program
from .rule import RulePack
from .soundness import check_soundness, require_sound
from .targets import get_target
from .verdict import HELP as TOLERANCE_HELP
from .verdict import RULE as TOLERANCE_RULE
from .verdict import Comparison, reduction_length

Setup = Callable[[argparse.ArgumentParser], None]
Command = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Subcommand:
    help: str
    setup: Setup
    run: Command
    epilog: str | None = None


COMMANDS: dict[str, Subcommand] = {}


def command(name: str, help: str, setup: Setup,
            epilog: str | None = None) -> Callable[[Command], Command]:
    """Register `cmd_<name>` as the subcommand `name`, its arguments declared by `setup`;
    `epilog` ends its --help."""
    def register(fn: Command) -> Command:
        COMMANDS[name] = Subcommand(help, setup, fn, epilog)
        return fn
    return register


# --------------------------------------------------------------------------------------------
# Loading programs


def load_any(path: str, dims: DimOverrides) -> tuple[Program | None, BlockProgram]:
    """A program file as (AST, block program).

    `.bbp`: the parsed program (with `dims` overrides) and its unfused lowering.  `.bbk`: the
    block program as written, with the AST of the `.bbp` it records as its source (its text
    embedded in the file, or for a file without it the path relative to the `.bbk`), at the
    block program's dimensions; None if it records none or the recorded path is gone (a
    warning says that nothing will be compared).
    """
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file")
    if file.suffix == ".bbp":
        ast = load_program(path, dims)
        return ast, lower(ast)
    if file.suffix == ".onnx":
        ast = load_onnx(path, dims)
        return ast, lower(ast)
    if file.suffix == ".bbk":
        if dims:
            raise UsageError(f"{path}: --dim applies to .bbp programs; a block program's "
                             f"dimensions are fixed")
        block_file = load_block_program(path)
        if block_file.source is None:
            return None, block_file.program
        return _source_program(file, block_file), block_file.program
    raise UsageError(f"{path}: expected a .bbp program, a .bbk block program or an .onnx model")


def load_onnx(path: str, dims: DimOverrides) -> Program:
    """An ONNX model imported as a checked program that carries its weights."""
    imported = import_onnx(path, dims)
    ast = parse_program(imported.text, f"{path} (imported)")
    return replace(ast, values=imported.weights, interface=imported.interface)


def _source_program(bbk: Path, block_file: BlockFile) -> Program | None:
    """The recorded source program, re-dimensioned to match the block program fused from it,
    and checked to declare the block program's inputs and outputs."""
    if block_file.source_text is not None:
        ast = _embedded_source(bbk, block_file, {})
    else:
        path = bbk.parent / block_file.source
        if not path.is_file():
            print(f"{block_file.source_span}: warning: the source program {path} does not "
                  f"exist and this file does not embed its text: nothing will be compared",
                  file=sys.stderr)
            return None
        ast = load_program(str(path))
    dims = block_file.program.dims
    override = {n: (d.extent, d.block) for n, d in dims.items()
                if n in ast.dims and ast.dims[n] != d}
    if override:
        ast = _embedded_source(bbk, block_file, override) if block_file.source_text is not None \
            else load_program(str(bbk.parent / block_file.source), override)
    _check_source(block_file, ast)
    return ast


def _embedded_source(bbk: Path, block_file: BlockFile, dims: DimOverrides) -> Program:
    """The source text embedded in a block file; a mistake in it is placed in the .bbk."""
    try:
        return parse_program(block_file.source_text, str(bbk), dims)
    except SourceError as err:
        at = Span(str(bbk), err.span.line + block_file.source_span.line, err.span.column + 2)
        raise SourceError(at, f"in the embedded source program: {err.message}") from None


def _check_source(block_file: BlockFile, ast: Program) -> None:
    """The source program must read the block program's inputs and define its outputs, with
    the same axes and dimensions: otherwise they cannot be compared."""
    program = block_file.program
    for name in (*(t.name for t in program.tensors.values() if t.role == "input"),
                 *program.outputs):
        mine, theirs = program.tensors[name], ast.tensors.get(name)
        role = "an input" if mine.role == "input" else "an output"
        same = theirs is not None and (theirs.role == "input") == (mine.role == "input") and \
            theirs.axes == mine.axes and all(ast.dims[a] == program.dims[a] for a in mine.axes)
        if not same:
            raise SourceError(block_file.source_span, f"the source program does not match: "
                              f"{role} {name} is not defined with the same shape by the "
                              f"source program")


def _dims(overrides: list[str]) -> DimOverrides:
    dims: DimOverrides = {}
    for text in overrides:
        name, extent, block = parse_dim_override(text)
        dims[name] = (extent, block)
    return dims


def _integer(least: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer at least `least` and at most `most` (a count of runs or
    trials, which nothing else bounds); a mistake is a usage error, exit 2."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
        return value
    return parse


# The most runs `run --profile` times and trials `check` draws per rule: each takes real time,
# which no budget bounds (a median needs far fewer).
MAX_REPEATS = 10_000


def _seconds(text: str) -> float:
    """An argparse type: a finite positive number of seconds (nan or inf would lift the
    limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got '{text}'") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got '{text}'")
    return value


def _check_output(output: str | None, program: str) -> None:
    """`-o` must name a file in an existing directory, not the program read: checked before
    any work, so a mistake does not cost a fusion."""
    if output is None:
        return
    out = Path(output)
    if out.is_dir():
        raise UsageError(f"-o {output}: is a directory; name the file to write")
    if not out.parent.is_dir():
        raise UsageError(f"-o {output}: directory {out.parent} does not exist")
    if out.exists() and out.resolve() == Path(program).resolve():
        raise UsageError(f"-o {output}: is the program being read; write elsewhere")


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(text: str) -> int:
    """An argparse type: a number of bytes, optionally with a binary unit (512M, 16G)."""
    number, unit = text.rstrip("KMGTkmgt"), text[len(text.rstrip("KMGTkmgt")):].upper()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 16G, got '{text}'") \
            from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive size, got '{text}'")
    return int(value)


def _program_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", help="a .bbp program, a .bbk block program or an .onnx model")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=EXTENT[/BLOCK]",
                   help="override a dimension of a .bbp program, or set a symbolic dimension "
                        "of an .onnx model (repeatable)")


# --------------------------------------------------------------------------------------------
# Subcommands


def _show_args(p: argparse.ArgumentParser) -> None:
    _program_args(p)
    picture = p.add_mutually_exclusive_group()
    picture.add_argument("--dot", action="store_true",
                         help="print a Graphviz DOT picture: each kernel with its loops, its "
                              "loads and stores, and the global tensors between kernels")
    picture.add_argument("--svg", action="store_true",
                         help="the picture as SVG, drawn by Graphviz's dot (which must be "
                              "installed)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of printing")
    p.add_argument("--fuse", action="store_true",
                   help="show the program after fusion (with the fusion options below)")
    _fuse_args(p)


@command("show", "print the block program (the unfused lowering of a .bbp, or with --fuse the "
                 "fused one) as text, or as a picture (--dot, --svg)", _show_args)
def cmd_show(args: argparse.Namespace) -> int:
    from .picture import graphviz, to_dot, to_svg

    _check_output(args.output, args.program)
    if args.svg:
        graphviz()  # before any work: a missing Graphviz should not cost a fusion
    _, program = load_any(args.program, _dims(args.dim))
    if args.fuse:
        program = _fuse(args, program).program
    if args.dot or args.svg:
        text = to_dot(program, args.program)
        text = to_svg(text) if args.svg else text
    else:
        text = show_program(program)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="" if text.endswith("\n") else "\n")
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
    _fuse_args(p)
    p.add_argument("--backend", choices=tuple(BACKENDS), default="interp",
                   help="the reference interpreter (default), generated numpy, CUDA via CuPy, "
                        "or Triton (on a GPU, else in Triton's interpreter)")
    p.add_argument("--no-fuse", action="store_true", help="run the unfused program")
    p.add_argument("--seed", type=_integer(0), default=0, help="seed of the random inputs")
    p.add_argument("--values", metavar="FILE.npz",
                   help="values of inputs by name (the weights `bbrules import -o` writes); "
                        "the other inputs are random")
    p.add_argument("--profile", type=_integer(1, MAX_REPEATS), metavar="RUNS",
                   help="with --backend numpy: after the checked run, time RUNS more (back to "
                        "back) and print each kernel's median time and share beside its "
                        "modeled time and share on --target")
    _native_arg(p, "where a C compiler is found, unless $BBRULES_NATIVE=0")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _run_cuda(program: BlockProgram, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    try:
        import cupy
        available = cupy.is_available()
    except ImportError:
        available = False
    if not available:
        raise UsageError("the cuda backend needs CuPy and a GPU, and none was found; "
                         "`bbrules codegen --backend cuda` writes the CUDA source")
    outputs = cuda_gen.generate(program).runner()(**inputs)
    return {name: cupy.asnumpy(x) for name, x in outputs.items()}


def _run_triton(program: BlockProgram, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """On a GPU where torch finds one, each kernel's warps and stages tuned there first;
    otherwise in Triton's interpreter, on the CPU."""
    module = triton_gen.generate(program)
    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if not gpu:
        return triton_gen.run_interpreted(module, inputs)
    namespace = module.namespace()
    namespace["tune"](progress=lambda line: print(f"tuning {line}", file=sys.stderr),
                      **inputs)
    outputs = namespace["run"](**inputs)
    return {name: x.float().cpu().numpy() for name, x in outputs.items()}


BACKENDS: dict[str, Callable[[BlockProgram, dict[str, np.ndarray]], dict[str, np.ndarray]]] = {
    "interp": interp.run,
    "numpy": numpy_gen.run,
    "cuda": _run_cuda,
    "triton": _run_triton,
}

def _load_values(path: str, program: BlockProgram, interface: Interface | None = None
                 ) -> dict[str, np.ndarray]:
    """Input values from an .npz file, each checked to be an input of the program's shape;
    for an imported model, also by the model's own names in its shapes (`interface`)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            values = {name: f[name] for name in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise UsageError(f"--values {path}: not a readable .npz file ({err})") from None
    for name, (tensor, shape) in (interface.inputs.items() if interface else ()):
        if name in values and values[name].shape == shape:
            x = values.pop(name)
            values[tensor] = x.reshape([program.dims[a].extent
                                        for a in program.tensors[tensor].axes])
    for name, x in values.items():
        decl = program.tensors.get(name)
        if decl is None or decl.role != "input":
            raise UsageError(f"--values {path}: '{name}' is not an input of the program")
        shape = tuple(program.dims[a].extent for a in decl.axes)
        if x.shape != shape:
            own = interface.inputs.get(name) if interface else None
            wants = f"the model takes {list(own[1])}" if own else \
                f"the program declares {list(shape)}"
            raise UsageError(f"--values {path}: '{name}' has shape {list(x.shape)}, {wants}")
        if x.dtype.kind not in "biuf":
            raise UsageError(f"--values {path}: '{name}' holds {x.dtype} values, not real "
                             f"numbers")
        if decl.dtype in WHOLE_DTYPES:
            try:
                check_whole(name, x)
            except ValueError as e:
                raise UsageError(f"--values {path}: {e}") from None
    return {name: x.astype(np.float32) for name, x in values.items()}


def _finite(x: float) -> float | None:
    """JSON has no NaN/inf: report them as null."""
    return x if np.isfinite(x) else None


@command("run", "run a program on random inputs with the reference interpreter and compare "
                "with the dense evaluation", _run_args,
         epilog=TOLERANCE_HELP)
def cmd_run(args: argparse.Namespace) -> int:
    if args.profile and args.backend != "numpy":
        raise UsageError(f"--profile times the kernels of the generated numpy code; add "
                         f"--backend numpy (not {args.backend})")
    ast, program = _program_to_run(args)
    need = run_bytes(program, ast)
    if need > args.memory:
        raise UsageError(f"{args.program}: running it needs about {fmt_bytes(need)} of memory, "
                         f"more than the {fmt_bytes(args.memory)} allowed (--memory); choose "
                         f"smaller dimensions (--dim) or a larger --memory")
    inputs = random_inputs(program, seed=args.seed)
    if ast is not None:
        inputs.update(ast.values)
    if args.values:
        inputs.update(_load_values(args.values, program, ast.interface if ast else None))
    native_groups = _native(args, numpy_gen.default_native())
    execute = BACKENDS[args.backend]
    if args.backend == "numpy":
        execute = functools.partial(numpy_gen.run, native=native_groups)
    start = time.perf_counter()
    outputs = execute(program, inputs)
    elapsed = time.perf_counter() - start
    profiled = _profile(args, program, inputs, native_groups) if args.profile else None
    if ast is None:
        return _report_checksums(args, program, outputs, elapsed, profiled)
    reference = dense.evaluate(ast, inputs, dtype=np.float64)
    plain = dense.evaluate(ast, inputs, dtype=np.float32)
    for name in program.outputs:
        if name not in reference or reference[name].shape != outputs[name].shape:
            raise UsageError(f"{args.program}: output {name} is not defined with the same shape "
                             f"by the source program {ast.path}")
    results = {name: Comparison.of(outputs[name], reference[name], program.tensors[name].dtype,
                                   reduction_length(ast, name), plain[name])
               for name in program.outputs}
    ok = all(r.ok for r in results.values())
    if args.json:
        print(json.dumps({
            "program": args.program, "backend": args.backend, "seed": args.seed,
            "kernels": len(program.kernels),
            "time_s": elapsed, "compared": True, "rule": TOLERANCE_RULE,
            "ok": ok,
            "outputs": {n: r.to_json() for n, r in results.items()},
            **_profile_json(profiled),
        }, indent=2))
    else:
        for name, r in results.items():
            print(r.line(name))
        print(f"{args.backend} time: {elapsed:.3f} s")
        _print_profile(profiled)
    return 0 if ok else 1


# `--profile`'s report: the kernels' times, and the program's cost on --target beside them.
Profiled = tuple[numpy_timing.Profile, ProgramCost]


def _profile(args: argparse.Namespace, program: BlockProgram,
             inputs: dict[str, np.ndarray], native_groups: bool) -> Profiled:
    progress = _progress(args)
    if progress:
        progress(f"timing {args.profile} runs of the numpy code")
    return (numpy_timing.profile(program, inputs, args.profile, native=native_groups),
            cost_program(program, get_target(args.target)))


def _profile_json(profiled: Profiled | None) -> dict[str, object]:
    return {"profile": profiled[0].to_json(profiled[1])} if profiled else {}


def _print_profile(profiled: Profiled | None) -> None:
    if profiled:
        print()
        print(profiled[0].table(profiled[1]))


def _report_checksums(args: argparse.Namespace, program: BlockProgram,
                      outputs: dict[str, np.ndarray], elapsed: float,
                      profiled: Profiled | None) -> int:
    note = "the block program records no source program: nothing was compared"
    sums = {n: (float(np.sum(outputs[n], dtype=np.float64)),
                float(np.sum(np.abs(outputs[n]), dtype=np.float64))) for n in program.outputs}
    if args.json:
        print(json.dumps({
            "program": args.program, "backend": args.backend, "seed": args.seed,
            "kernels": len(program.kernels),
            "time_s": elapsed, "compared": False,
            "note": note,
            "outputs": {n: {"sum": _finite(s), "abs_sum": _finite(a)}
                        for n, (s, a) in sums.items()},
            **_profile_json(profiled),
        }, indent=2))
    else:
        for name, (s, a) in sums.items():
            print(f"{name}: sum {s:.6g}, sum of |x| {a:.6g}")
        print(f"{args.backend} time: {elapsed:.3f} s")
        print(f"note: {note}")
        _print_profile(profiled)
    return 0


# --------------------------------------------------------------------------------------------
# Rule packs, fusion and code generation


def _progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress lines on stderr when a person is watching a terminal, or on any stderr with
    --progress; never with --json, whose output a program reads."""
    if getattr(args, "json", False) or not (args.progress or sys.stderr.isatty()):
        return None
    return lambda line: print(f"  .. {line}", file=sys.stderr, flush=True)


def _pack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rules", action="append", default=[], metavar="DIR",
                   help="add a rule pack directory (repeatable)")
    p.add_argument("--no-installed", action="store_true",
                   help="use only the --rules packs, not the standard and installed ones")


def _load_packs(args: argparse.Namespace) -> RulePack:
    """The packs to fuse with, refused if any rule is unsound (`soundness.require_sound`)."""
    directories = pack_directories([Path(d) for d in args.rules], not args.no_installed)
    packs = load_each(directories)
    require_sound(list(directories), packs)
    return merge_all(packs)


def _fuse_args(p: argparse.ArgumentParser) -> None:
    _pack_args(p)
    p.add_argument("--target", default="h100", help="a built-in target name or a .toml file")
    p.add_argument("--objective", choices=("time", "traffic"), default="time",
                   help="minimise modeled time (default) or global traffic")
    p.add_argument("--max-kernels", type=_integer(1), metavar="N",
                   help="the cheapest program with at most N kernels")
    p.add_argument("--no-split", action="store_true",
                   help="never split a reduction over chunks stored and combined by a second "
                        "kernel (Flash-Decoding, split-K)")
    p.add_argument("--fixed-blocks", action="store_true",
                   help="every kernel keeps the program's block sizes (by default a kernel "
                        "whose grid leaves processors idle may tile an axis finer, and the "
                        "best candidates' kernels coarser where that reads less)")
    p.add_argument("--nodes", type=_integer(1), default=Budget.nodes, help="e-node budget")
    p.add_argument("--iterations", type=_integer(1), default=Budget.iterations,
                   help="iteration budget per stage")
    p.add_argument("--seconds", type=_seconds, default=Budget.seconds,
                   help="time budget of fusion: loading the rule packs, saturation, read-back "
                        "and extraction together (the best program found in time is the result)")
    p.add_argument("--memory", type=_size, default=default_budget(), metavar="BYTES",
                   help="memory budget (e.g. 512M, 16G; default: half the machine's memory): "
                        "fusion keeps its resident memory under it, and run refuses a program "
                        "whose estimated peak exceeds it")
    whole = p.add_mutually_exclusive_group()
    whole.add_argument("--candidates", type=_integer(1), metavar="N",
                       help="cut the program into candidates of at most N kernels, fuse each "
                            "(identical ones once, in parallel) and stitch the results (default "
                            f"for programs of more than {DEFAULT_THRESHOLD} kernels, with "
                            f"N = {DEFAULT_THRESHOLD})")
    whole.add_argument("--no-candidates", action="store_true",
                       help="fuse the whole program in one e-graph, however large")
    _progress_arg(p)


def _progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action="store_true",
                   help="report progress on stderr even when it is not a terminal (never with "
                        "--json)")


def _fuse(args: argparse.Namespace, program: BlockProgram) -> FuseResult | StitchedResult:
    """Fuse the program in one e-graph, or by candidates (`bbrules.candidates`) when it has
    more than `DEFAULT_THRESHOLD` kernels or `--candidates` asks (the budget then bounds all
    the candidates' fusions together)."""
    budget = Budget(nodes=args.nodes, iterations=args.iterations, seconds=args.seconds,
                    memory=max(1, args.memory // 2**20))
    meter = Meter(budget)  # loading the packs counts against the time budget too
    options = Options(split_folds=not args.no_split, reblock=not args.fixed_blocks)
    size = _candidate_size(args, program)
    try:
        if size is not None:
            return fuse_candidates(program, select_candidates(program, size), _load_packs(args),
                                   get_target(args.target), args.objective, budget, options,
                                   PackSource(tuple(args.rules), not args.no_installed),
                                   progress=_progress(args), meter=meter)
        return fuse(program, _load_packs(args), get_target(args.target), args.objective,
                    args.max_kernels, budget, _progress(args), options, meter)
    except NoCandidate as e:
        raise UsageError(str(e)) from None


def _candidate_size(args: argparse.Namespace, program: BlockProgram) -> int | None:
    """The most kernels per candidate, or None to fuse the program whole.  `--max-kernels`
    bounds the whole program, which separate candidates cannot promise."""
    if args.candidates is not None:
        if args.max_kernels is not None:
            raise UsageError("--max-kernels bounds the whole program's kernels and cannot be "
                             "combined with --candidates; use --no-candidates")
        return args.candidates
    if args.no_candidates or args.max_kernels is not None:
        return None
    return DEFAULT_THRESHOLD if len(program.kernels) > DEFAULT_THRESHOLD else None


def _apply_args(p: argparse.ArgumentParser) -> None:
    _program_args(p)
    _fuse_args(p)
    p.add_argument("-o", "--output", metavar="OUT.bbk",
                   help="write the fused block program (readable by show, cost, run, codegen)")
    p.add_argument("--explain", action="store_true",
                   help="print the chain of rule applications that turns the input into the "
                        "output, each with the rule's file:line and the subterm it rewrote "
                        "(fused by candidates: the candidates formed)")
    p.add_argument("--stats", action="store_true",
                   help="print per-rule statistics: matches, applications, time")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


@command("apply", "fuse a program: rewrite it with the rule packs and extract the cheapest "
                  "equivalent block program", _apply_args)
def cmd_apply(args: argparse.Namespace) -> int:
    _check_output(args.output, args.program)
    ast, program = load_any(args.program, _dims(args.dim))
    result = _fuse(args, program)
    if args.output:
        out = Path(args.output)
        source = text = None
        if args.program.endswith((".bbp", ".onnx")):  # an import embeds the imported text
            source = os.path.relpath(Path(args.program).resolve(), out.resolve().parent)
            text = ast.source
        out.write_text(show_program(result.program, source=source, source_text=text))
    if args.json:
        print(json.dumps(result.to_json(), indent=2, default=_finite))
        return 0
    if isinstance(result, StitchedResult):
        print(stitched_report(result, args.explain))
    else:
        _print_single(result, args)
    if args.output:
        print(f"\nwrote {args.output}")
    else:
        print("\n" + show_program(result.program), end="")
    return 0


def _print_single(result: FuseResult, args: argparse.Namespace) -> None:
    # The chain first: the report says whether reading the firings for it was cut short.
    chain = result.explain() if args.explain else None
    print(fusion_report(result))
    if args.stats:
        print("\n" + rule_table(result))
    if chain is not None:
        print("\nrule applications from the input to the output, in replay order:")
        for line in chain:
            print(f"  {line}")


def stitched_report(r: StitchedResult, explain: bool) -> str:
    """Before/after totals and the candidates (with `explain`, what each covered)."""
    distinct = sum(c.reused_from is None for c in r.candidates)
    lines = _totals(r.before, r.after)
    lines.append(f"fused by candidates: {len(r.candidates)} candidates, {distinct} distinct "
                 f"(identical ones fused once), {r.workers} process{'es' * (r.workers > 1)}, "
                 f"{r.seconds:.2f} s")
    for c in r.candidates:
        lines.append(f"  {c.line()}")
    if r.forwarded:
        lines.append(f"computed where they are read (elementwise maps): "
                     f"{', '.join(r.forwarded)}")
    if explain:
        lines.append("no chain of rule applications for a program stitched from candidates: "
                     "run apply on a candidate's kernels alone (--no-candidates) for one")
    return "\n".join(lines)


def _totals(b: ProgramCost, a: ProgramCost) -> list[str]:
    """The before/after table and the line comparing both with the compulsory traffic."""
    rows = [
        ("kernels", str(b.n_kernels), str(a.n_kernels)),
        ("global read", fmt_bytes(b.bytes_read), fmt_bytes(a.bytes_read)),
        ("global written", fmt_bytes(b.bytes_written), fmt_bytes(a.bytes_written)),
        ("flops", fmt_flops(b.flops), fmt_flops(a.flops)),
        ("local footprint", fmt_bytes(b.footprint), fmt_bytes(a.footprint)),
        ("modeled time", fmt_time(b.time), fmt_time(a.time)),
    ]
    lines = [f"{'':16} {'before':>14} {'after':>14}"]
    lines += [f"{name:16} {x:>14} {y:>14}" for name, x, y in rows]
    faster = (f"modeled time {b.time / a.time:.2f}x less" if b.legal
              else "the input does not fit local memory")
    lines.append(f"compulsory traffic {fmt_bytes(a.compulsory)} on {a.target.name}: before "
                 f"{b.traffic / a.compulsory:.2f}x, after {a.traffic / a.compulsory:.2f}x; "
                 f"traffic {b.traffic / max(a.traffic, 1):.2f}x less, {faster}")
    return lines


def fusion_report(r: FuseResult) -> str:
    """Before/after totals, saturation per stage, extraction."""
    b, a = r.before, r.after
    lines = _totals(b, a)
    if (margin := r.margin()) is not None:
        ru = r.runner_up
        ties = (f"; times within {a.target.resolution:.0%} tie, less traffic wins"
                if a.target.resolution and r.objective == "time" else "")
        lines.append(f"runner-up: {ru.n_kernels} kernel{'s' * (ru.n_kernels != 1)}, "
                     f"{fmt_time(ru.time)} ({margin[0]:+.1%}), traffic {margin[1]:.2f}x{ties}")
    lines.append("saturation:")
    for s in r.stats:
        lines.append(f"  {s.stage:12} {s.iterations:3} iterations {s.enodes:7} e-nodes "
                     f"{s.eclasses:6} e-classes {s.seconds:6.2f} s  {s.stop}")
    x = r.extraction
    if r.graph.stop in SPENT:
        lines.append(f"read-back: the {r.graph.stop} cut the recorded firings short "
                     f"(explanations and rule applications may be incomplete)")
    stopped = "" if x.stop == "complete" else f", stopped by the {x.stop}"
    lines.append(f"extraction: {x.method}, {x.candidates} candidates costed, {x.rejected} "
                 f"rejected, {x.seconds:.2f} s{stopped}")
    return "\n".join(lines)


def rule_table(r: FuseResult) -> str:
    """Per-rule statistics, the rules that matched most first (the others are counted)."""
    used = sorted((s for s in r.rules if s.matches), key=lambda s: (-s.matches, s.rule))
    lines = [f"{'rule':20} {'matches':>8} {'applications':>13} {'time':>9}"]
    lines += [f"{s.rule:20} {s.matches:8} {s.applications:13} {s.seconds * 1e3:7.2f} ms"
              for s in used]
    lines.append(f"{len(r.rules) - len(used)} other rules never matched")
    return "\n".join(lines)


def _native_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--native", action=argparse.BooleanOptionalAction,
                   help="numpy: chains of elementwise operators, and matrix products, as C the "
                        "module compiles when it loads (needs a C compiler, $CC or cc; "
                        f"default: {default})")


def _native(args: argparse.Namespace, default: bool) -> bool:
    """Whether the numpy code has native groups: --native / --no-native, else `default`."""
    if args.native and args.backend != "numpy":
        raise UsageError(f"--native writes C loops into the generated numpy code; add "
                         f"--backend numpy (not {args.backend})")
    if args.native and not native.available():
        raise UsageError("--native needs a C compiler, and none was found (set $CC)")
    return default if args.native is None else args.native


def _codegen_args(p: argparse.ArgumentParser) -> None:
    _program_args(p)
    _fuse_args(p)
    p.add_argument("--backend", choices=("numpy", "cuda", "triton"), default="numpy")
    p.add_argument("--precision", choices=triton_gen.PRECISIONS, default="tf32",
                   help="triton: how f32 contractions use the matrix unit (tf32, the rate the "
                        "GPU targets price them at; tf32x3: three TF32 products, about f32 "
                        "accuracy; ieee: CUDA cores)")
    p.add_argument("--threads", type=_integer(1), default=1,
                   help="numpy: split each kernel with enough work into parts for this many "
                        "threads (default 1: the code does not depend on the machine)")
    _native_arg(p, "numpy code alone")
    p.add_argument("--no-fuse", action="store_true", help="generate code for the unfused program")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the code here (cuda: FILE gets the CUDA source and FILE.py the "
                        "CuPy launcher) instead of printing it")


def _program_to_run(args: argparse.Namespace) -> tuple[Program | None, BlockProgram]:
    """The program a command works on: a .bbp is fused unless --no-fuse; a .bbk is as written."""
    ast, program = load_any(args.program, _dims(args.dim))
    if ast is not None and args.program.endswith((".bbp", ".onnx")) and not args.no_fuse:
        program = _fuse(args, program).program
    return ast, program


def _import_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an ONNX model (.onnx)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=EXTENT[/BLOCK]",
                   help="the extent of a symbolic dimension (default 1), or the block of an "
                        "imported one (d768=768/128); repeatable")
    p.add_argument("-o", "--output", metavar="OUT.bbp",
                   help="write the program here and the model's weights beside it (OUT.npz)")


@command("import", "translate an ONNX model into a .bbp program (every command also takes the "
                   ".onnx directly)", _import_args)
def cmd_import(args: argparse.Namespace) -> int:
    if not Path(args.model).is_file():
        raise UsageError(f"{args.model}: no such file")
    _check_output(args.output, args.model)
    imported = import_onnx(args.model, _dims(args.dim))
    if imported.symbolic:
        print("symbolic dimensions: " + ", ".join(f"{n}={e}" for n, e in imported.symbolic.items())
              + " (set them with --dim NAME=EXTENT)", file=sys.stderr)
    if args.output is None:
        print(imported.text, end="")
        return 0
    out = Path(args.output)
    weights = out.with_suffix(".npz")
    if weights.resolve() == Path(args.model).resolve():
        raise UsageError(f"-o {args.output}: the weights would overwrite the model")
    out.write_text(imported.text)
    np.savez(weights, **imported.weights)
    print(f"wrote {out} and {weights} ({len(imported.weights)} weights); run it with "
          f"`bbrules run {out} --values {weights}`", file=sys.stderr)
    return 0


@command("codegen", "generate numpy (CPU), CUDA C or Triton (GPU) code for a program",
         _codegen_args)
def cmd_codegen(args: argparse.Namespace) -> int:
    _check_output(args.output, args.program)
    _, program = _program_to_run(args)
    if args.backend == "numpy":
        files = {args.output: numpy_gen.generate(program, threads=args.threads,
                                                 native=_native(args, False))}
    elif args.backend == "triton":
        target = get_target(args.target)
        files = {args.output: triton_gen.generate(program, target, args.precision).source}
    else:
        module = cuda_gen.generate(program, get_target(args.target))
        files = {args.output: module.source,
                 f"{args.output}.py" if args.output else None: module.launcher}
    for path, text in files.items():
        if path is None:
            print(text, end="" if text.endswith("\n") else "\n")
        else:
            Path(path).write_text(text)
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _gpukit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="a new (or empty) folder for the kit")
    p.add_argument("--quick", action="store_true",
                   help="one small case of each kind: a dry run of the kit")
    p.add_argument("--progress", action="store_true", help="progress lines on stderr")


@command("gpukit", "prepare a folder of generated kernels and a runner for a GPU machine that "
                   "has torch, triton, cupy and numpy only", _gpukit_args)
def cmd_gpukit(args: argparse.Namespace) -> int:
    manifest = gpukit.prepare(args.folder, args.quick, _progress(args))
    n = sum(len(c["variants"]) for c in manifest["cases"])
    print(f"wrote {args.folder}: {len(manifest['cases'])} cases, {n} kernel variants; on the "
          f"GPU machine run `python {Path(args.folder) / 'runner.py'} --out RESULTS`",
          file=sys.stderr)
    return 0


def _packs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the list as JSON")


@command("packs", "list the installed rule packs", _packs_args)
def cmd_packs(args: argparse.Namespace) -> int:
    rows = []
    installed = discover_packs()
    for (name, directory), pack in zip(installed.items(),
                                       load_each({d: n for n, d in installed.items()})):
        rows.append({"name": name, "path": str(directory), "rules": len(pack.rules),
                     "checks": len(pack.checks), "monoids": [m.name for m in pack.monoids]})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:12} {r['rules']:3} rules {r['checks']:3} checks  {r['path']}")
    return 0


def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("packs", nargs="*", metavar="PACK",
                   help="rule pack directories to check, loaded on top of the standard and "
                        "installed packs (default: check the standard and installed packs)")
    p.add_argument("--no-installed", action="store_true",
                   help="load the PACKs alone, not on top of the standard and installed packs")
    p.add_argument("--trials", type=_integer(1, MAX_REPEATS), default=20,
                   help="random instantiations per rule in the soundness check")
    p.add_argument("--seed", type=_integer(0), default=0)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    _progress_arg(p)


@command("check", "run the rule packs' check cases and test every rule's soundness on random "
                  "tiles", _check_args)
def cmd_check(args: argparse.Namespace) -> int:
    loaded, pack = _packs_to_check([Path(d) for d in args.packs], not args.no_installed)
    progress = _progress(args)
    if progress:
        progress(f"{len(pack.checks)} check cases")
    failures = [str(f) for f in run_checks(replace(loaded, checks=pack.checks))]
    if progress:
        progress(f"soundness of {len(pack.rules)} rules, {args.trials} trials each")
    unsound = [str(u) for u in check_soundness(replace(loaded, rules=pack.rules),
                                               trials=args.trials, seed=args.seed)]
    if args.json:
        print(json.dumps({"rules": len(pack.rules), "checks": len(pack.checks),
                          "check_failures": failures, "unsound": unsound}, indent=2))
    else:
        for line in failures + unsound:
            print(line)
        print(f"{len(pack.rules)} rules, {len(pack.checks)} checks: {len(failures)} checks "
              f"failed, {len(unsound)} rules unsound")
    return 1 if failures or unsound else 0


def _packs_to_check(dirs: list[Path], include_installed: bool) -> tuple[RulePack, RulePack]:
    """(every loaded pack, the packs in `dirs` or all loaded ones if none is given).

    A pack is checked where it is used: on top of the installed packs, so that its checks may
    name their rules and rulesets and its stages theirs; only its own rules and checks run.
    """
    directories = pack_directories(dirs, include_installed)
    packs = load_each(directories)
    given = {d.resolve() for d in dirs}
    chosen = [p for d, p in zip(directories, packs) if not given or d in given]
    return merge_all(packs), RulePack("checked", [r for p in chosen for r in p.rules],
                                      checks=[c for p in chosen for c in p.checks])


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bbrules", description="Block-level operator fusion for AI inference programs.")
    parser.add_argument("--version", action="version", version=f"bbrules {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, c in COMMANDS.items():
        p = sub.add_parser(name, help=c.help, description=c.help, epilog=c.epilog)
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
    except BrokenPipeError:  # the reader went away (`bbrules apply ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 2
