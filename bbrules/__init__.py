"""bbrules: block-level operator fusion for AI inference programs.

The Python API (the README's "Python API" section shows it at work):

- `load(source, dims=None)`: a program file as the commands read it, or program text, as a
  `Model`;
- `fuse(program, ...)`: the cheapest equivalent block program the rules reach, as a `Fusion`
  (the fused `Model`, its cost, the baseline's, and `explain()`);
- `cost(program, target)`: the modeled data movement and time, kernel by kernel (`Cost`);
- `compile(program, backend)`: a callable from input arrays to output arrays (`Compiled`).

Each takes a program as a path, program text, or what `load` or `fuse` returned, and each
result shows itself in a notebook.  A mistake in the input raises `SourceError` (at a position
in a file or text) or `UsageError`: what the command line reports with exit status 2.  The
modules behind fusion and code generation (egglog, the code generators, the command line) are
imported on first use, so that importing one part of the package does not import them all.
"""

from __future__ import annotations

__version__ = "0.1.0"  # first: `bbrules.cli` and `bbrules.soundness` import it from here

import html
import math
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .cost import ProgramCost, fmt_bytes, fmt_time
from .errors import SourceError, UsageError
from .options import Budget

if TYPE_CHECKING:
    from .candidates import StitchedResult
    from .frontend import DimOverrides
    from .fuse import FuseResult
    from .ir import BlockProgram
    from .program import Interface, Program

__all__ = ["Compiled", "Cost", "Fusion", "Model", "SourceError", "UsageError", "compile", "cost",
           "fuse", "load"]

DimSize = int | tuple[int, int] | str  # 256 (keep the declared blocking), (256, 64), "256/64"
BLOCK_HEADER = "# bbrules block program"  # the first line `show_program` writes


@dataclass(frozen=True, repr=False)
class Model:
    """A block program, with the `.bbp` program it was lowered from (`ast`; None for a block
    program read without its source): what `load` returns and the other functions take.

    The source is kept because it is the reference: `bbrules.dense.evaluate(model.ast,
    inputs)` computes what any fusion of the program must compute."""

    program: BlockProgram
    ast: Program | None = None
    name: str = "<program>"

    @property
    def text(self) -> str:
        """The block program in block-file syntax (what `bbrules show` prints)."""
        from .ir import show_program
        return show_program(self.program)

    def dot(self) -> str:
        """A Graphviz DOT picture of the program (`bbrules.picture`)."""
        from .picture import to_dot
        return to_dot(self.program, self.name)

    def __repr__(self) -> str:
        p = self.program
        n = len(p.kernels)
        return (f"<bbrules.Model {self.name}: {n} kernel{'s' * (n != 1)}, "
                f"{_shapes(p, p.inputs)} -> {_shapes(p, p.outputs)}>")

    def _repr_html_(self) -> str:
        return _html(repr(self), self.text)


class Cost(ProgramCost):
    """A `bbrules.cost.ProgramCost` that shows its table: per kernel its grid, loops, global
    bytes read and written, flops, local footprint and modeled time; the totals; and the
    compulsory-traffic lower bound."""

    @classmethod
    def of(cls, c: ProgramCost) -> Cost:
        return cls(**{f.name: getattr(c, f.name) for f in fields(c)})

    def __repr__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        return _html("", self.table())


@dataclass(frozen=True, repr=False)
class Fusion:
    """What `fuse` returns: the fused program as a `Model` (so it goes wherever a loaded
    program goes, its source kept for comparisons), and how it was found (`result`, the
    report `bbrules apply` prints)."""

    model: Model
    result: FuseResult | StitchedResult

    @property
    def program(self) -> BlockProgram:
        return self.model.program

    @property
    def cost(self) -> Cost:
        """The fused program's cost."""
        return Cost.of(self.result.after)

    @property
    def baseline(self) -> Cost:
        """The input program's cost."""
        return Cost.of(self.result.before)

    def explain(self) -> list[str]:
        """The chain of rule applications that turns the input into the output, in replay
        order, one line each: the rule's file:line, the kernel, the iteration, and the subterm
        before and after (`bbrules apply --explain`).  Fused by candidates: one line per
        candidate, the kernels it covered and what they fused to."""
        from .candidates import StitchedResult
        if isinstance(self.result, StitchedResult):
            return [c.line() for c in self.result.candidates]
        return self.result.explain()

    def report(self) -> str:
        """`bbrules apply`'s report: costs before and after, the runner-up, saturation and
        extraction (fused by candidates: the candidates)."""
        from .candidates import StitchedResult
        from .cli import fusion_report, stitched_report
        if isinstance(self.result, StitchedResult):
            return stitched_report(self.result, explain=False)
        return fusion_report(self.result)

    def __repr__(self) -> str:
        b, a = self.result.before, self.result.after
        return (f"<bbrules.Fusion {self.model.name}: {b.n_kernels} -> {a.n_kernels} kernels, "
                f"traffic {fmt_bytes(b.traffic)} -> {fmt_bytes(a.traffic)}, modeled time "
                f"{fmt_time(b.time)} -> {fmt_time(a.time)} on {a.target.name}>")

    def _repr_html_(self) -> str:
        return _html(repr(self), self.report(), self.model.text)


@dataclass(frozen=True, repr=False)
class Compiled:
    """A program compiled for a backend.  Call it with one array per input, by name; it
    returns the program's outputs by name, at their extents.  Inputs whose values the model
    holds (`values`: an imported model's weights) may be left out.  An imported model
    (`interface`) is called as the model itself is, as onnxruntime calls it: its inputs and
    outputs by the model's names, in the model's shapes."""

    program: BlockProgram
    backend: str
    run: Callable[..., dict[str, np.ndarray]]
    values: Mapping[str, np.ndarray] = field(default_factory=dict)
    interface: Interface | None = None

    def __call__(self, **given: np.ndarray) -> dict[str, np.ndarray]:
        face = self.interface
        if face is None:
            return self._run(given)
        unknown = sorted(set(given) - set(face.inputs))
        missing = [n for n in face.inputs if n not in given]
        if missing or unknown:
            raise UsageError(f"the model takes inputs {face.listed(face.inputs)}"
                             + (f"; missing {', '.join(missing)}" if missing else "")
                             + (f"; no input named {', '.join(unknown)}" if unknown else ""))
        return face.model_outputs(self._run(face.program_inputs(given)))

    def _run(self, given: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The program on `given` and the values it holds, checked against its inputs."""
        p = self.program
        inputs = {**self.values, **given}
        missing = [n for n in p.inputs if n not in inputs]
        unknown = sorted(set(inputs) - set(p.inputs))
        if missing or unknown:
            raise UsageError(f"the program takes inputs {_shapes(p, self.arguments)}"
                             + (f"; missing {', '.join(missing)}" if missing else "")
                             + (f"; no input named {', '.join(unknown)}" if unknown else ""))
        for name in p.inputs:
            want = tuple(p.extent(a) for a in p.tensors[name].axes)
            if np.shape(inputs[name]) != want:
                raise UsageError(f"input {name} has shape {np.shape(inputs[name])}, the "
                                 f"program declares {want}")
        outputs = self.run(**inputs)
        return {name: outputs[name] for name in p.outputs}

    @property
    def arguments(self) -> tuple[str, ...]:
        """The inputs a call must give: those whose values the model does not hold."""
        return tuple(n for n in self.program.inputs if n not in self.values)

    def __repr__(self) -> str:
        p, face = self.program, self.interface
        if face is not None:
            return (f"<bbrules.Compiled {self.backend}: {face.listed(face.inputs)} -> "
                    f"{face.listed(face.outputs)}>")
        return (f"<bbrules.Compiled {self.backend}: {_shapes(p, self.arguments)} -> "
                f"{_shapes(p, p.outputs)}>")


if TYPE_CHECKING:
    ProgramLike = str | os.PathLike[str] | Model | Fusion | BlockProgram


def load(source: str | os.PathLike[str], dims: Mapping[str, DimSize] | None = None) -> Model:
    """A program, read as the commands read it (`bbrules.cli.load_any`): a `.bbp` file
    lowered to one kernel per statement, a `.bbk` block program as `bbrules apply -o` wrote it
    (with the `.bbp` it records as its source), an `.onnx` model imported; or the text of a
    `.bbp` or `.bbk` (a string with a line break that names no file).

    `dims` resizes a `.bbp` program as `--dim` does: {"q": 256} keeps the declared blocking,
    {"q": (256, 64)} or {"q": "256/64"} sets the blocks too.
    """
    overrides = _overrides(dims or {})
    if isinstance(source, str) and "\n" in source and not _is_file(source):
        return _from_text(source, overrides)
    from .cli import load_any
    path = os.fspath(source)
    ast, program = load_any(path, overrides)
    return Model(program, ast, path)


def fuse(program: ProgramLike, rules: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
         = (), target: str = "h100", objective: str = "time", max_kernels: int | None = None,
         nodes: int = Budget.nodes, iterations: int = Budget.iterations,
         seconds: float = Budget.seconds, memory: int | None = None, split: bool = True,
         reblock: bool = True, installed: bool = True, candidates: int | None = None) -> Fusion:
    """Fuse `program` as `bbrules apply` does: rewrite it with the rule packs and extract the
    equivalent block program that minimises `objective` ("time" or "traffic") on `target` (a
    built-in name or a .toml file), with at most `max_kernels` kernels if given.

    `rules`: rule pack directories loaded on top of the standard and installed packs (alone
    with `installed=False`); a pack with an unsound rule is refused.  Budgets, as on the
    command line: `nodes` e-nodes, `iterations` per stage, `seconds` for the whole fusion and
    `memory` MiB of resident memory (default: half the machine's); hitting one is not an
    error, the best program found in time is the result.  `split=False` launches every
    reduction whole (`--no-split`); `reblock=False` keeps the program's block sizes in every
    kernel (`--fixed-blocks`).

    `candidates`: the most kernels per candidate, as `--candidates N` (0: fuse the program in
    one e-graph, `--no-candidates`).  By default a program of more than 12 kernels is fused by
    candidates (`bbrules.candidates`) in a process pool, as `apply` fuses it; `explain()` then
    lists the candidates instead of rule applications.
    """
    from .candidates import DEFAULT_THRESHOLD, PackSource, fuse_candidates, select_candidates
    from .extract import NoCandidate
    from .fuse import fuse as fuse_program
    from .memory import default_budget
    from .options import Meter, Options
    from .packs import load_each, merge_all, pack_directories
    from .soundness import require_sound
    from .targets import get_target

    model = _model(program)
    if objective not in ("time", "traffic"):
        raise UsageError(f"unknown objective '{objective}': time or traffic")
    for name, value in (("nodes", nodes), ("iterations", iterations),
                        ("max_kernels", max_kernels), ("memory", memory)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    if candidates is not None and (not isinstance(candidates, int) or candidates < 0):
        raise UsageError(f"candidates must be a number of kernels or 0, got {candidates!r}")
    if candidates and max_kernels is not None:
        raise UsageError("max_kernels bounds the whole program's kernels and cannot be combined "
                         "with candidates; pass candidates=0")
    size = candidates or None
    if candidates is None and max_kernels is None and \
            len(model.program.kernels) > DEFAULT_THRESHOLD:
        size = DEFAULT_THRESHOLD
    if not 0 < seconds < math.inf:
        raise UsageError(f"seconds must be a finite positive number, got {seconds!r}")
    chip = get_target(target)
    budget = Budget(nodes, iterations, seconds, memory or max(1, default_budget() // 2**20))
    meter = Meter(budget)  # loading the packs counts against the time budget, as in `apply`
    extra = [rules] if isinstance(rules, (str, os.PathLike)) else list(rules)
    directories = pack_directories([Path(d) for d in extra], installed)
    packs = load_each(directories)
    require_sound(list(directories), packs)
    options = Options(split_folds=split, reblock=reblock)
    try:
        if size is not None:
            result = fuse_candidates(model.program, select_candidates(model.program, size),
                                     merge_all(packs), chip, objective, budget, options,
                                     PackSource(tuple(map(str, extra)), installed),
                                     meter=meter)
        else:
            result = fuse_program(model.program, merge_all(packs), chip, objective,
                                  max_kernels, budget, None, options, meter)
    except NoCandidate as e:
        raise UsageError(str(e)) from None
    return Fusion(Model(result.program, model.ast, model.name), result)


def cost(program: ProgramLike, target: str = "h100") -> Cost:
    """The modeled cost of `program` on `target` (a built-in name or a .toml file), as
    `bbrules cost` prints it."""
    from .cost import cost_program
    from .targets import get_target
    return Cost.of(cost_program(_model(program).program, get_target(target)))


def compile(program: ProgramLike, backend: str = "numpy") -> Compiled:
    """`program` as a callable for `backend`: "numpy" (generated once, runs on the CPU),
    "interp" (the reference interpreter) or "cuda" (CUDA C through CuPy, needs a GPU), the
    backends of `bbrules run`.  The inputs whose values the source program holds (an imported
    model's weights) are passed for the caller unless it gives them; an imported model takes
    and returns arrays by its own names, in its own shapes (`Compiled`)."""
    from .cli import BACKENDS

    if backend not in BACKENDS:
        raise UsageError(f"unknown backend '{backend}': one of {', '.join(BACKENDS)}")
    model = _model(program)
    p, ast = model.program, model.ast
    values, face = (ast.values, ast.interface) if ast is not None else ({}, None)
    if backend == "numpy":
        from .codegen import numpy_gen
        return Compiled(p, backend, numpy_gen.load(p).outputs, values, face)
    execute = BACKENDS[backend]
    return Compiled(p, backend, lambda **inputs: execute(p, inputs), values, face)


# --------------------------------------------------------------------------------------------


def _model(x: ProgramLike) -> Model:
    if isinstance(x, Model):
        return x
    if isinstance(x, Fusion):
        return x.model
    if isinstance(x, (str, os.PathLike)):
        return load(x)
    from .ir import BlockProgram
    if isinstance(x, BlockProgram):
        return Model(x)
    raise TypeError(f"expected a program (a path, program text, a Model, a Fusion or a "
                    f"BlockProgram), got {type(x).__name__}")


def _overrides(dims: Mapping[str, DimSize]) -> DimOverrides:
    """`dims` as the frontend's overrides, each checked as `--dim NAME=...` is."""
    from .frontend import parse_dim_override
    out: DimOverrides = {}
    for name, size in dims.items():
        text = "/".join(map(str, size)) if isinstance(size, tuple) else str(size)
        name, extent, block = parse_dim_override(f"{name}={text}")
        out[name] = (extent, block)
    return out


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # too long for a file name, or holds a NUL: program text
        return False


def _from_text(text: str, dims: DimOverrides) -> Model:
    """Program text: a block program if it starts as `show_program` writes one, else `.bbp`."""
    if text.lstrip().startswith(BLOCK_HEADER):
        from .blockfile import parse_block_program
        if dims:
            raise UsageError("dims apply to .bbp programs; a block program's dimensions are "
                             "fixed")
        return Model(parse_block_program(text).program, None, "<string>")
    from .frontend import parse_program
    from .lower import lower
    ast = parse_program(text, "<string>", dims)
    return Model(lower(ast), ast, "<string>")


def _shapes(p: BlockProgram, names: Sequence[str]) -> str:
    """Tensors with their extents: what a caller passes and gets back."""
    return ", ".join(f"{n}[{', '.join(str(p.extent(a)) for a in p.tensors[n].axes)}]"
                     for n in names)


def _html(summary: str, *blocks: str) -> str:
    head = f"<p><code>{html.escape(summary)}</code></p>" if summary else ""
    return head + "".join(f"<pre>{html.escape(b)}</pre>" for b in blocks)


class _Package(types.ModuleType):
    """This package.  Its functions `fuse` and `cost` share their names with the submodules
    `bbrules.fuse` and `bbrules.cost`, and Python sets a package's attribute to a submodule
    when the submodule is first imported, so whichever code first imported `bbrules.fuse`
    would replace the function.  The functions keep their names; the submodules are imported
    by their full names (`from bbrules.fuse import fuse`) as before."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("fuse", "cost") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
