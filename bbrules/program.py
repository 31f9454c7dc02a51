"""The checked syntax tree of a `.bbp` program: what the frontend hands to lowering and to the
dense evaluator.

A `Program` has passed every check of `bbrules.frontend`: names resolve, axes match, every
statement's free axes are its target's axes.  Nodes keep a `Span` so that later stages (the
lowering) can still point at the offending source; spans take no part in equality, so two
programs that say the same thing compare equal wherever they were written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Callable, TypeVar, Union

import numpy as np

from .errors import Span, UsageError
from .ir import Axis, AxisSet, Dim, TensorDecl


@dataclass(frozen=True)
class Number:
    """A scalar constant: broadcasts over every axis."""

    value: float
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True)
class Position:
    """A dimension's name used as a value: each element's position along it (0 ...
    extent - 1)."""

    axis: Axis
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True)
class Ref:
    """A use of a tensor, its dimensions named `axes` (renamed when they differ from the
    declaration)."""

    tensor: str
    axes: tuple[Axis, ...]
    span: Span = field(compare=False, repr=False)
    axis_spans: tuple[Span, ...] = field(compare=False, repr=False, default=())


@dataclass(frozen=True)
class Apply:
    """An elementwise operator of `bbrules.ops` (`add`, `exp`, `le`, `where`, ...) on one to
    three operands; infix arithmetic, comparisons and function calls all end up here."""

    op: str
    args: tuple[Expr, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True)
class Reduction:
    """`sum[axis] body`, `max[axis] body` or `min[axis] body` over the whole extent of `axis`."""

    op: str
    axis: Axis
    body: Expr
    span: Span = field(compare=False, repr=False)
    axis_span: Span | None = field(compare=False, repr=False, default=None)


Expr = Union[Number, Position, Ref, Apply, Reduction]
T = TypeVar("T")
E = TypeVar("E")  # any tree: nodes are told apart by identity


@dataclass(frozen=True)
class Statement:
    """`target[axes] = expr`: one operator, which defines a new tensor."""

    target: str
    axes: tuple[Axis, ...]
    expr: Expr
    span: Span = field(compare=False, repr=False)
    axis_spans: tuple[Span, ...] = field(compare=False, repr=False, default=())


def squeezed(shape: Sequence[int]) -> tuple[int, ...]:
    """An imported array's shape as its `.bbp` tensor has it: without dimensions of one."""
    return tuple(n for n in shape if n != 1)


@dataclass(frozen=True)
class Interface:
    """An imported model's own names and shapes for a program's inputs and outputs: name ->
    (the program's tensor, the model's shape).  An array passes between the two by `reshape`,
    the same elements in the same order (an ONNX model's unit dimensions are dropped, and its
    names made identifiers)."""

    inputs: dict[str, tuple[str, tuple[int, ...]]]
    outputs: dict[str, tuple[str, tuple[int, ...]]]

    def program_inputs(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`arrays`, by the model's input names and in its shapes, as the program's inputs;
        a missing one or one of another shape is a `UsageError`."""
        missing = [n for n in self.inputs if n not in arrays]
        if missing:
            raise UsageError(f"the model takes inputs {self.listed(self.inputs)}; missing "
                             f"{', '.join(missing)}")
        out = {}
        for name, (tensor, shape) in self.inputs.items():
            x = np.asarray(arrays[name])
            if x.shape != shape:
                raise UsageError(f"input {name} has shape {x.shape}, the model takes {shape}")
            out[tensor] = x.reshape(squeezed(shape))
        return out

    def model_outputs(self, results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The program's `results` by the model's output names, in its shapes."""
        return {name: np.asarray(results[tensor]).reshape(shape)
                for name, (tensor, shape) in self.outputs.items()}

    @staticmethod
    def listed(names: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
        """The model's inputs or outputs with their shapes: `input.1[1, 8, 16]`."""
        return ", ".join(f"{n}{list(shape)}" for n, (_, shape) in names.items())


@dataclass(frozen=True)
class Program:
    """A checked program.  `tensors` holds inputs, then statement targets in statement order
    (role `temp` or `output`); `source` is the text, kept for carets in later errors.
    `values` holds inputs whose values are known (an imported model's weights): runs load
    them instead of drawing random ones; `interface`, an imported model's own names and
    shapes (`bbrules.compile` takes and returns those)."""

    path: str
    dims: dict[str, Dim]
    tensors: dict[str, TensorDecl]
    statements: tuple[Statement, ...]
    outputs: tuple[str, ...]
    source: str = field(default="", compare=False, repr=False)
    values: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    interface: Interface | None = field(default=None, compare=False, repr=False)

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors.values() if t.role == "input")


def operands(e: Expr) -> tuple[Expr, ...]:
    """The subexpressions `e` is computed from."""
    match e:
        case Apply(_, args):
            return args
        case Reduction(_, _, body):
            return (body,)
    return ()


def sum_factors(e: Expr) -> tuple[Expr, ...]:
    """`operands`, but a sum's are the factors of its body: what lowering and the dense
    evaluator compute a sum of a product from, without building the product."""
    if isinstance(e, Reduction) and e.op == "sum":
        return tuple(f for f, _ in factors(e.body))
    return operands(e)


def fold(root: E, combine: Callable[[E, list[T]], T],
         parts: Callable[[E], tuple[E, ...]] = operands) -> T:
    """`combine(e, [value of each part])` bottom-up from the leaves, without recursion: an
    expression thousands of terms long is as deep, and every pass over a tree of syntax walks
    through here (program expressions; with their own `parts`, block and rule syntax, rule
    patterns and constant arithmetic).  `parts` says what a node is computed from (by default
    its operands; a lowering of `sum[k] a * b` may fold over the factors instead of the
    product).  It is asked once per node, parents before children and left to right, so it
    may also check or record things in the order the expression is written."""
    values: dict[int, T] = {}
    stack: list[tuple[E, tuple[E, ...] | None]] = [(root, None)]
    while stack:
        e, ps = stack.pop()
        if ps is not None:
            values[id(e)] = combine(e, [values[id(p)] for p in ps])
        elif id(e) not in values:
            ps = tuple(parts(e))
            stack.append((e, ps))
            stack.extend((p, None) for p in reversed(ps))
    return values[id(root)]


def free_axes(e: Expr) -> AxisSet:
    """The axes an expression's value spans: those of its references, less reduced ones."""
    return fold(e, _free_axes)


def _free_axes(e: Expr, parts: list[AxisSet]) -> AxisSet:
    match e:
        case Number():
            return frozenset()
        case Ref(_, axes):
            return frozenset(axes)
        case Position(axis):
            return frozenset((axis,))
        case Apply():
            return frozenset().union(*parts)
        case Reduction(_, axis):
            return parts[0] - {axis}
    raise TypeError(f"not a program expression: {e!r}")


def factors(e: Expr, inverted: bool = False) -> list[tuple[Expr, bool]]:
    """A product as its factors, each with whether it divides (`a / (b * c)` -> a, 1/b, 1/c).

    Reductions use this: a sum of a product is linear in every factor that does not span the
    reduced axis, and a contraction pairs up the factors that do.
    """
    out: list[tuple[Expr, bool]] = []
    stack = [(e, inverted)]
    while stack:
        x, inv = stack.pop()
        match x:
            case Apply("mul", (a, b)):
                stack += [(b, inv), (a, inv)]
            case Apply("div", (a, b)):
                stack += [(b, not inv), (a, inv)]
            case _:
                out.append((x, inv))
    return out
