"""Soundness: every rule's two sides compute the same numbers on random tiles.

A rule is checked by instantiating it (`bbrules.instantiate`: fresh axes of random extents and
block sizes, sometimes one block and sometimes several, each `?x` a block of a fresh input),
building one block program that stores both sides, running it through the reference
interpreter on random inputs, and comparing the two results.  Sides are stored over their
shape; a side whose dependencies exceed its shape (an in-tile reduction whose axis no loop
consumes) is summed over the extra axes first, the same way on both sides.  A tuple-valued side
is stored component by component.  `load(store(?v))` is a load of a tensor that an earlier
kernel of the same program stores.

Inputs are uniform in [-2, 2], signs included: a rule that holds only for positive values (such
as `log(x * y) = log(x) + log(y)`) is unsound as written and is reported.

`require_sound` is the gate every fusing command passes: a pack with an unsound rule is
refused, its verdict cached by the pack's content so that the check runs once per pack.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import zlib
from dataclasses import dataclass, replace
from functools import reduce
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from . import __version__
from .errors import UsageError
from .instantiate import Instance, flipped, instances
from .interp import run
from .ir import (BUILTIN_MONOIDS, SUM, BlockProgram, Get, IRError, Monoid, Node, Reduce, Store,
                 TensorDecl, TileType, show_node, tile_type, type_of, validate)
from .patterns import NotInstantiable, checked_type
from .rule import Rule, RulePack

RTOL = 1e-4
ATOL = 1e-5
TRIES = 400  # random instantiations tried per trial before a rule counts as uninstantiable


@dataclass(frozen=True)
class Unsound:
    """A rule that failed: the counterexample, or why none could be built."""

    rule: Rule
    instance: str  # the bindings and both sides as block expressions
    seed: int | None  # seed of the inputs (numpy default_rng), None if nothing was run
    max_error: float  # largest absolute difference between the sides (inf: NaN vs number)
    reason: str = "sides differ"

    def __str__(self) -> str:
        where = f"{self.rule.span}: error: " if self.rule.span else ""
        head = f"{where}rule {self.rule.name}: {self.reason}"
        if self.seed is None:
            return f"{head}\n  {self.instance}" if self.instance else head
        error = "" if np.isnan(self.max_error) else f"max error {self.max_error:.3g}, "
        return f"{head} ({error}input seed {self.seed})\n  {self.instance}"


@dataclass(frozen=True)
class _Case:
    """One instantiation: a program with kernels `lhs<i>` and `rhs<i>` per component, or the
    reason the right side does not fit the left (`problem`)."""

    text: str
    program: BlockProgram | None = None
    components: int = 0
    problem: str = ""


def _side_kernels(value: Node, prefix: str) -> list[Store]:
    """Kernels storing `value` (each component of a tuple), summed over deps beyond its shape."""
    t = type_of(value)
    parts = [value] if isinstance(t, TileType) else [Get(i, value) for i in range(len(t))]
    kernels = []
    for i, part in enumerate(parts):
        pt = tile_type(part)
        for axis in sorted(pt.deps - pt.shape):
            part = Reduce(axis, SUM, part)
        kernels.append(Store(f"{prefix}{i}", tuple(sorted(pt.shape)), part))
    return kernels


def _case(rule: Rule, inst: Instance) -> _Case:
    """The program comparing both sides under `inst` (whose left side is well formed)."""
    stored: dict[Node, Store] = {}
    lhs = inst.build(rule.lhs, stored)
    text = f"{inst.describe()}; lhs = {show_node(lhs)}"
    try:
        rhs = inst.build(rule.rhs, stored)
        same = checked_type(rhs) == type_of(lhs)
    except NotInstantiable as e:
        return _Case(text, problem=f"the right-hand side is ill-formed here: {e}")
    text += f"; rhs = {show_node(rhs)}"
    if not same:
        return _Case(text, problem="the sides differ in shape or dependencies")
    left, right = _side_kernels(lhs, "lhs"), _side_kernels(rhs, "rhs")
    tensors = dict(inst.inputs)
    for k in stored.values():
        tensors[k.tensor] = TensorDecl(k.tensor, k.axes, "f32", "temp")
    for k in left + right:
        tensors[k.tensor] = TensorDecl(k.tensor, k.axes, "f32", "output")
    kernels = (*stored.values(), *left, *right)
    program = BlockProgram.of_stores(inst.dims, tensors, kernels,
                                     tuple(k.tensor for k in left + right))
    try:
        validate(program)
    except IRError as e:
        raise NotInstantiable(str(e)) from None
    return _Case(text, program, len(left))


def _max_error(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |a - b|, where equal values (infinities included) and NaN pairs count as 0 and a
    NaN against a number as infinite."""
    with np.errstate(invalid="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        diff = np.where(same, 0.0, np.abs(a.astype(np.float64) - b))
    return float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0))


def _inputs(program: BlockProgram, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.uniform(-2.0, 2.0, [program.extent(a) for a in
                                           program.tensors[name].axes]).astype(np.float32)
            for name in program.inputs}


def _first_case(rule: Rule, rng: random.Random, monoids: Mapping[str, Monoid]
                ) -> _Case | None:
    for inst in instances(rule, rng, TRIES, monoids):
        try:
            return _case(rule, inst)
        except NotInstantiable:
            continue
    return None


def _check_rule(rule: Rule, rtol: float, trials: int, seed: int,
                monoids: Mapping[str, Monoid]) -> Unsound | None:
    for direction in (rule, flipped(rule)) if rule.bidirectional else (rule,):
        for trial in range(trials):
            key = f"{seed}/{rule.name}/{trial}"
            case = _first_case(direction, random.Random(key), monoids)
            if case is None:
                return Unsound(rule, "", None, float("nan"),
                               f"could not instantiate (no well-formed left-hand side in "
                               f"{TRIES} random tries)")
            if case.program is None:
                return Unsound(rule, case.text, None, float("nan"), case.problem)
            input_seed = zlib.crc32(key.encode())
            try:
                out = run(case.program, _inputs(case.program, input_seed))
            except Exception as e:  # a crash on a well-formed instance is a finding to report
                return Unsound(rule, case.text, input_seed, float("nan"),
                               f"the interpreter failed ({type(e).__name__}: {e})")
            for i in range(case.components):
                a, b = out[f"lhs{i}"], out[f"rhs{i}"]
                if not np.allclose(a, b, rtol=rtol, atol=ATOL, equal_nan=True):
                    return Unsound(rule, case.text, input_seed, _max_error(a, b))
    return None


def check_soundness(pack: RulePack, trials: int = 20, seed: int = 0) -> list[Unsound]:
    """Every rule of `pack` that is not numerically sound, with a counterexample.

    Each rule is tried on `trials` random instantiations (both directions of a two-way rule);
    the tolerance is relative, `pack.tolerances[rule]` or 1e-4, plus an absolute 1e-5.
    """
    monoids = {**BUILTIN_MONOIDS, **{m.name: m for m in pack.monoids}}
    failures = []
    for rule in pack.rules:
        failure = _check_rule(rule, pack.tolerances.get(rule.name, RTOL), trials, seed,
                              monoids)
        if failure is not None:
            failures.append(failure)
    return failures


# --------------------------------------------------------------------------------------------
# The gate: packs with an unsound rule are never used


CACHE_ENV = "BBRULES_CACHE_DIR"


class UnsoundPack(UsageError):
    """A pack that fuses with an unsound rule would compute wrong numbers: it is refused."""


def cache_dir() -> Path:
    """Where verdicts are kept: $BBRULES_CACHE_DIR, else $XDG_CACHE_HOME/bbrules, else
    ~/.cache/bbrules."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bbrules"


def _content_key(directories: list[Path], trials: int, seed: int) -> str:
    """A hash of the bbrules version, the check's settings and the text of every `.bbr` file
    of `directories` (a pack's verdict depends on the packs below it, whose monoids it uses)."""
    h = hashlib.sha256(f"bbrules {__version__}; trials {trials}; seed {seed}".encode())
    for d in directories:
        for f in sorted(d.glob("*.bbr")):
            h.update(f"\0{f.name}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _cached_unsound(key: str, directory: Path, check: Callable[[], list[Unsound]]) -> list[str]:
    """The reports of the unsound rules of the pack in `directory`, whose content is `key`:
    from the cache, or from `check()`.  A report is cached with its rule's file named relative
    to the pack, so that the same pack copied elsewhere is reported where it now is."""
    path = cache_dir() / "soundness" / f"{key}.json"
    try:
        reports = [(str(file), str(rest))
                   for file, rest in json.loads(path.read_text())["reports"]]
    except (OSError, ValueError, KeyError, TypeError):
        reports = [_relative(u, directory) for u in check()]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"reports": reports}))
        except OSError:  # an unwritable cache costs time, never correctness
            pass
    return [str(directory / file) + rest if file else rest for file, rest in reports]


def _relative(u: Unsound, directory: Path) -> tuple[str, str]:
    """`u`'s report as its rule's file relative to `directory` and the text after that path,
    or ("", the whole report) for a rule with no position in the pack."""
    text, file = str(u), u.rule.span.path if u.rule.span else ""
    if file.startswith(str(directory)) and text.startswith(file):
        return os.path.relpath(file, directory), text[len(file):]
    return "", text


def require_sound(directories: list[Path], packs: list[RulePack], trials: int = 20,
                  seed: int = 0) -> None:
    """Raise `UnsoundPack` naming every unsound rule (with its counterexample) of the packs
    loaded from `directories` (by `packs.load_each`, in order).

    The check is `bbrules check`'s, with its default trials and seed, so the two agree.  Each
    pack is checked on top of the packs before it, once per content: its verdict is cached
    under a hash of its and its base packs' files (`cache_dir()`), so the standard pack costs
    about 1.3 s the first time and nothing after.
    """
    problems = []
    for i, (directory, pack) in enumerate(zip(directories, packs)):
        below = reduce(RulePack.merge, packs[:i + 1])
        key = _content_key(directories[:i + 1], trials, seed)
        unsound = _cached_unsound(key, directory, lambda: check_soundness(
            replace(below, rules=pack.rules), trials, seed))
        if unsound:
            problems.append((directory, unsound))
    if problems:
        lines = []
        for directory, unsound in problems:
            lines.append(f"rule pack {directory} has {len(unsound)} unsound "
                         f"rule{'s' if len(unsound) > 1 else ''}; fusing with it would compute "
                         f"wrong numbers, so it is not used (`bbrules check {directory}` "
                         f"reports the same):")
            lines += [f"  {line}" for u in unsound for line in u.splitlines()]
        raise UnsoundPack("\n".join(lines))
