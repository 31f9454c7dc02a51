"""Deterministic random inputs for a program: what tests, `bbrules run` and `check` feed it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from .ir import WHOLE_DTYPES, Binary, Dim, Load, TensorDecl, children, postorder, tile_type
from .program import Apply, Program, Ref, free_axes, operands


class HasTensors(Protocol):
    """A `Program` or a `BlockProgram`: both declare dims and tensors."""

    dims: dict[str, Dim]
    tensors: dict[str, TensorDecl]


# Whole numbers an i32 input that indexes nothing is drawn below.
WHOLE_DRAWN = 256


def random_inputs(p: HasTensors, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal float32 arrays for every input tensor, the same for the same seed; for
    an input of indices (`index_inputs`), whole numbers below the extent it indexes; for
    another input declared whole (i32), whole numbers below `WHOLE_DRAWN`.

    Each tensor draws from its own stream (seeded by the seed and the tensor's position), so
    adding an input to a program does not change the values of the ones before it.
    """
    out = {}
    indices = index_inputs(p)
    inputs = [t for t in p.tensors.values() if t.role == "input"]
    for i, t in enumerate(inputs):
        rng = np.random.default_rng([seed, i])
        shape = [p.dims[a].extent for a in t.axes]
        if t.name in indices or t.dtype in WHOLE_DTYPES:
            below = indices.get(t.name, WHOLE_DRAWN)
            out[t.name] = rng.integers(0, below, shape).astype(np.float32)
        else:
            out[t.name] = rng.standard_normal(shape, dtype=np.float32)
    return out


def index_inputs(p: HasTensors) -> dict[str, int]:
    """The inputs that hold indices, each with the extent it indexes: those the program reads
    only to compare them for equality with something over axes they lack (`IDS[t] == v`, an
    embedding lookup or a one-hot as models import them), the largest of those axes' extents.
    Real numbers would never equal a position: every one-hot would be 0, and a check of the
    outputs would hold vacuously."""
    bounds: dict[str, int] = {}
    other: set[str] = set()
    for tensor, axes in _reads(p):
        extents = [p.dims[a].extent for a in set(axes) - set(p.tensors[tensor].axes)]
        if extents:
            bounds[tensor] = max(bounds.get(tensor, 0), *extents)
        else:
            other.add(tensor)
    return {t: n for t, n in bounds.items()
            if t not in other and p.tensors[t].role == "input"}


@dataclass(frozen=True)
class _Syntax:
    """What `_reads` needs of a program's expressions: the nodes under a root, each one's
    operands, the tensor a node reads (else None), whether it is an equality, and the axes
    its value spans."""

    nodes: Callable[[Any], Iterator[Any]]
    operands: Callable[[Any], tuple[Any, ...]]
    reads: Callable[[Any], str | None]
    is_eq: Callable[[Any], bool]
    axes: Callable[[Any], tuple[str, ...]]


def _tree(root: Any) -> Iterator[Any]:
    stack = [root]
    while stack:
        e = stack.pop()
        yield e
        stack += operands(e)


_PROGRAM = _Syntax(
    _tree, operands, lambda e: e.tensor if isinstance(e, Ref) else None,
    lambda e: isinstance(e, Apply) and e.op == "eq", lambda e: tuple(free_axes(e)))
_BLOCKS = _Syntax(
    postorder, children, lambda n: n.tensor if isinstance(n, Load) else None,
    lambda n: isinstance(n, Binary) and n.op == "eq",
    lambda n: tuple(tile_type(n).deps | tile_type(n).shape))


def _reads(p: HasTensors) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Each read of a tensor, with the axes of what an equality compares it with (none for
    any other read).  A view's reads are other reads of the tensor it views."""
    if isinstance(p, Program):
        syntax, roots = _PROGRAM, [s.expr for s in p.statements]
    else:
        syntax, roots = _BLOCKS, [s.value for k in p.kernels for s in k.stores]
    for root in roots:
        if (name := syntax.reads(root)) is not None:
            yield p.tensors[name].base or name, ()
        for n in syntax.nodes(root):
            for c in syntax.operands(n):
                if (name := syntax.reads(c)) is None:
                    continue
                if syntax.is_eq(n) and not p.tensors[name].base:
                    yield name, tuple(a for o in syntax.operands(n) if o is not c
                                      for a in syntax.axes(o))
                else:
                    yield p.tensors[name].base or name, ()
