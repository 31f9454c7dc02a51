"""ONNX models in: each operator of the graph lowered to `.bbp` statements.

The importer writes a `.bbp` program (text, so that `bbrules import` can show it and every later
stage reports positions in it) plus the values of the model's initializers, which become inputs
that the backends load rather than draw at random.

How ONNX shapes become named axes.  A `.bbp` tensor has named axes of extent > 1; an ONNX value
is *a view of one*: its dimensions are groups of "pieces", each piece a factor of one of the
tensor's axes.  So

- Reshape, Squeeze, Unsqueeze, Flatten, Transpose, Expand and Identity emit nothing: they
  regroup, permute or broadcast the pieces of the same tensor (pieces need not stay in memory
  order, so a transpose followed by a reshape moves no data either).
- An operator that computes emits one statement over *atomic axes*: per dimension, the common
  refinement of how its operands factor it.  An operand reads a tensor axis that covers several
  atomic axes through a view (`X[t, (h, d)]`), so a head split feeds attention without a copy.
- Dimensions of extent 1 have no axis at all: broadcasting them is free, keepdims costs nothing.
- Slice, Split and Concat select chunks with one-hot sums whose block skipping visits only the
  blocks of chunks that hold the selection (`gather_parts`).

Constant subgraphs (shape arithmetic: Shape, Gather, Concat, Range on constants) are evaluated
here with ONNX's own reference implementation of each operator, for the batch size given with
`--dim`.  Anything else that is not supported is reported with the node's position in the
graph, its name and its operator, exit status 2.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .errors import UsageError
from .ir import check_whole
from .program import Interface, squeezed

DEFAULT_SYMBOLIC_EXTENT = 1
_KEYWORDS = {"dim", "input", "output", "sum", "max", "min", "mean", "inf", "and", "or", "not"}
_DTYPES = {1: "f32", 10: "f16", 16: "bf16"}  # ONNX TensorProto element types kept as such


def block_of(extent: int) -> int:
    """The block an imported dimension gets unless overridden (`--dim d768=768/128`).

    Tiles should be matrix-unit sized whatever the rank: a small extent (a batch, a head
    count) is walked one element at a time, a middling one (a head size) is one block, and a
    large one is cut into blocks of 64 (the last one ragged where 64 does not divide it and
    the extent is above 128); extraction may coarsen them per kernel."""
    if extent < 16:
        return 1
    if extent <= 64 or (extent <= 128 and extent % 64):
        return extent
    return 64


def dividing_block(extent: int) -> int:
    """A block for a dimension a view reads, where `block_of`'s would leave the last one
    ragged: the largest divisor of the extent from 16 to 64, else the whole extent (a KV cache
    of 1023 past tokens, its heads split for RoPE, in blocks of 33)."""
    return next((b for b in range(64, 15, -1) if extent % b == 0), extent)


@dataclass(frozen=True)
class Value:
    """An ONNX value as the program holds it.

    Either a number (`number`, broadcast to `shape`), or a view of the tensor `tensor`:
    `pieces` factor its axes in order (`owner[i]` is the axis piece i belongs to) and
    `groups[j]` lists the pieces of ONNX dimension j, outer first.  A dimension of extent > 1
    with no pieces is broadcast (Expand); one of extent 1 has none either.
    """

    shape: tuple[int, ...]
    tensor: str | None = None
    number: float | None = None
    pieces: tuple[int, ...] = ()
    owner: tuple[int, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()

    @property
    def dense(self) -> bool:
        """Is the value the tensor's memory as ONNX lays it out (row-major, no broadcast)?"""
        flat = tuple(p for g in self.groups for p in g)
        return flat == tuple(range(len(self.pieces))) and \
            all(g or n == 1 for g, n in zip(self.groups, self.shape))


@dataclass
class Imported:
    """A model as a `.bbp` program.

    `weights`: initializer values by `.bbp` input name, shaped as the program declares them,
    read-only: constants, of which a backend may keep copies in other layouts (`relaid`).
    `interface`: the model's input and output names and shapes, and the `.bbp` tensor each
    is; an array passes between the two shapes by `reshape` (the same elements in the same
    order).
    """

    text: str
    weights: dict[str, np.ndarray]
    interface: Interface
    symbolic: dict[str, int] = field(default_factory=dict)
    whole: frozenset[str] = frozenset()  # the inputs of integers, declared i32

    def bbp_inputs(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The program's inputs: the weights, and `arrays` (by ONNX name) reshaped; integers
        past what f32 holds exactly are refused."""
        given = self.interface.program_inputs(arrays)
        for name in self.whole:
            try:
                check_whole(name, arrays[name])
            except ValueError as e:
                raise UsageError(str(e)) from None
        return {**self.weights, **{t: x.astype(np.float32) for t, x in given.items()}}

    def onnx_outputs(self, results: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The program's results by ONNX output name, in ONNX shapes."""
        return self.interface.model_outputs(results)


def _number(x: float) -> str:
    """A literal the `.bbp` grammar reads back exactly."""
    if math.isnan(x):
        raise UsageError("a NaN constant cannot be written in a .bbp program")
    if math.isinf(x):
        return "inf" if x > 0 else "(-inf)"
    text = repr(float(x))
    return f"({text})" if x < 0 else text


def _strides(factors: Sequence[int]) -> list[int]:
    """Suffix products, outermost first: [2, 3, 4] -> [24, 12, 4, 1]."""
    out = [1]
    for f in reversed(factors):
        out.append(out[-1] * f)
    return out[::-1]


def refine(extent: int, factorizations: Sequence[Sequence[int]]) -> list[int] | None:
    """The coarsest factorization of `extent` that refines each of `factorizations` (each a
    row-major split of the same extent), or None where none exists ([2, 3] against [3, 2])."""
    cuts = sorted({s for f in factorizations for s in _strides(f)} | {1, extent}, reverse=True)
    if any(a % b for a, b in zip(cuts, cuts[1:])):
        return None
    return [a // b for a, b in zip(cuts, cuts[1:])]


class _Index:
    """The atomic axes of one statement: per statement dimension, its axis names (and their
    extents) outer first."""

    def __init__(self, names: list[list[str]], extents: list[list[int]]):
        self.names = names
        self.extents = extents

    def axes(self, dims: Sequence[int]) -> list[str]:
        return [n for d in dims for n in self.names[d]]

    def position(self, d: int) -> str:
        """The position along statement dimension `d`, from its axes' positions."""
        names, extents = self.names[d], self.extents[d]
        terms = [f"{n} * {math.prod(extents[i + 1:])}" if i + 1 < len(names) else n
                 for i, n in enumerate(names)]
        return f"({' + '.join(terms)})" if terms else "0"


def reduce_expr(op: str, axes: list[str], body: str) -> str:
    """`op[axes] body`, or the body alone when there is nothing to reduce (extent 1)."""
    return f"({op}[{', '.join(axes)}] {body})" if axes else f"({body})"


Operand = tuple[Value, Sequence[int | None]]  # a value, and the statement dim of each of its dims
ExprFn = Callable[[list[str], _Index], str]


@dataclass(frozen=True)
class Band:
    """A matrix that is `inside` where lo <= j - i <= hi (a bound of None: no bound) and
    `outside` elsewhere: a causal, sliding-window or banded attention mask, as exporters fold
    it into a constant."""

    inside: float
    outside: float
    lo: int | None
    hi: int | None


def band_of(arr: np.ndarray) -> Band | None:
    """The band `arr` is, when it is two-valued over two axes of extent > 1 and one of its
    values fills exactly the cells between two diagonals (bounded on at least one side), or
    None.  Where both values qualify (a triangle), `outside` is preferably an additive mask's
    -inf, else a multiplicative mask's 0: the identities that let reductions skip blocks.

    Row by row, so that a mask of a long context costs one boolean matrix, not index
    matrices; a weight (many values) is refused from its first elements."""
    plane = np.asarray(arr).reshape(squeezed(np.shape(arr)))
    if plane.ndim != 2 or len(np.unique(plane.ravel()[:1024])) > 2:
        return None
    first = plane.flat[0]
    second = plane[plane != first][:1]
    if second.size == 0:
        return None
    pair = [float(first), float(second[0])]
    if any(map(math.isnan, pair)):
        return None
    n, m = plane.shape
    rows = np.arange(n)
    for inside, outside in sorted([pair, pair[::-1]],
                                  key=lambda io: (math.isfinite(io[1]), io[1] != 0)):
        held = plane == inside
        if not (held | (plane == outside)).all():
            return None  # a third value
        count = held.sum(axis=1)
        some = count > 0
        start = held.argmax(axis=1)
        last = m - 1 - held[:, ::-1].argmax(axis=1)
        if not np.array_equal((last - start + 1)[some], count[some]):
            continue  # a row with a gap
        lo, hi = int((start - rows)[some].min()), int((start + count - 1 - rows)[some].max())
        want_start, want_stop = np.clip(rows + lo, 0, m), np.clip(rows + hi + 1, 0, m)
        want_count = np.maximum(want_stop - want_start, 0)
        if not (np.array_equal(count, want_count)
                and np.array_equal(start[some], want_start[some])):
            continue
        lo_bound, hi_bound = (None if lo <= 1 - n else lo), (None if hi >= m - 1 else hi)
        if lo_bound is None and hi_bound is None:
            continue
        return Band(inside, outside, lo_bound, hi_bound)
    return None


@dataclass(frozen=True)
class Ramp:
    """A constant that is `start + step * i` along its one dimension of extent > 1 (`axis`):
    the class ids a one-hot compares with (`Equal(ids, Range(n))`, which exporters fold into
    a constant), or positions."""

    axis: int
    start: float
    step: float


def ramp_of(arr: np.ndarray) -> Ramp | None:
    """The ramp `arr` is, or None: it must vary along exactly one dimension, by a whole,
    nonzero step from a whole start, no value on the way (start, step x position, their
    sum) beyond 2^24, so that float32 computes each exactly, as the constant holds it."""
    arr = np.asarray(arr)
    varying = [d for d, n in enumerate(arr.shape) if n > 1]
    if len(varying) != 1 or arr.size > 1 << 24:
        return None
    line = arr.reshape(-1).astype(np.float64)
    start, step = line[0], line[1] - line[0]
    if not (np.isfinite(start) and np.isfinite(step) and step != 0
            and start == round(start) and step == round(step)
            and abs(start) + abs(step) * (line.size - 1) <= 1 << 24):
        return None
    if not np.array_equal(line, start + step * np.arange(line.size)):
        return None
    return Ramp(varying[0], float(start), float(step))


class OnnxError(UsageError):
    """A model bbrules cannot import, said with the node's position, name and operator."""


class Importer:
    """Walks a (shape-static) ONNX graph in order, emitting statements."""

    def __init__(self, model, path: str, dims: dict[str, tuple[int, int | None]],
                 block: Callable[[int], int] = block_of):
        self.model = model
        self.block = block
        self.path = path
        self.overrides = dims
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                          1)
        self.lines: list[tuple[str, str, frozenset[str]]] = []  # (target, text, tensors read)
        self.decls: list[str] = []
        # extents of the axes a view reads (`reference`): a view cannot hold a ragged axis,
        # whose layout is padded, so `text` gives them blocks that divide them
        self.viewed: set[int] = set()
        # a slice -> (what it slices, along which dimension, from where): a concatenation
        # that puts a slice back where it was reads its source there (`gather_parts`)
        self.sliced: dict[Value, tuple[Value, int, int]] = {}
        self.values: dict[str, Value] = {}
        self.consts: dict[str, np.ndarray] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.tensor_axes: dict[str, tuple[int, ...]] = {}
        self.names: set[str] = set()
        self.dim_copies: dict[int, int] = {}  # extent -> axis names needed
        self.symbolic: dict[str, int] = {}
        self.node_at = ""
        self.elem_types: dict[str, int] = {}

    # --- names --------------------------------------------------------------------------

    def fresh(self, hint: str) -> str:
        """A `.bbp` name for an ONNX name: identifier characters, no keyword, unique.
        Exporters name values by their scope (`/model/layers.0/attn/MatMul_output_0`): the
        last two parts say what a value is and keep the program readable.  A name that is
        not UTF-8 (protobuf hands it over as bytes) keeps what it can."""
        if isinstance(hint, bytes):
            hint = hint.decode("utf-8", "replace")
        base = re.sub(r"\W+", "_", "/".join(hint.split("/")[-2:])).strip("_") or "t"
        if not base[0].isalpha() or base in _KEYWORDS or re.fullmatch(r"d\d+(_\d+)?", base):
            base = "t_" + base
        name, i = base, 1
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def axis_names(self, extents: Sequence[int]) -> list[str]:
        """Distinct axis names for a statement's atomic axes: `d<extent>`, `d<extent>_1`, ..."""
        seen: dict[int, int] = {}
        out = []
        for e in extents:
            k = seen.get(e, 0)
            seen[e] = k + 1
            self.dim_copies[e] = max(self.dim_copies.get(e, 0), k + 1)
            out.append(f"d{e}" if k == 0 else f"d{e}_{k}")
        return out

    # --- values -------------------------------------------------------------------------

    def error(self, message: str) -> OnnxError:
        return OnnxError(f"{self.path}: {self.node_at}{message}")

    def declare(self, onnx_name: str, shape: tuple[int, ...], dtype: str,
                values: np.ndarray | None = None) -> Value:
        """A graph input or a weight: a fresh input tensor with an axis per dimension > 1."""
        self.check_shape(shape)
        name = self.fresh(onnx_name)
        extents = squeezed(shape)
        axes = self.axis_names(extents)
        self.decls.append(f"input {name}[{', '.join(axes)}] : {dtype}")
        self.tensor_axes[name] = extents
        if values is not None:
            weight = np.ascontiguousarray(values, dtype=np.float32)
            weight.flags.writeable = False  # a constant: backends may keep copies of it
            self.weights[name] = weight.reshape(extents)
        return self.whole(name, shape)

    def check_shape(self, shape: Sequence[int]) -> None:
        if 0 in shape:
            raise self.error(f"shape {list(shape)}: empty tensors (an extent 0) are not "
                             f"supported")

    def whole(self, tensor: str, shape: tuple[int, ...]) -> Value:
        """The value that is all of `tensor`, laid out as `shape`."""
        groups, i = [], 0
        for n in shape:
            groups.append((i,) if n > 1 else ())
            i += n > 1
        extents = squeezed(shape)
        return Value(tuple(shape), tensor, None, extents, tuple(range(len(extents))),
                     tuple(groups))

    def value(self, name: str) -> Value:
        """An operand: a computed value, or a constant (a number when uniform, else a weight)."""
        if name in self.values:
            return self.values[name]
        if name in self.consts:
            try:  # bfloat16 and float8 arrays convert too
                arr = np.asarray(self.consts[name]).astype(np.float32)
            except (TypeError, ValueError):
                raise self.error(f"constant '{name}' of type {self.consts[name].dtype} is not "
                                 f"a number") from None
            if arr.size == 0:
                raise self.error(f"constant '{name}' has no elements (shape {list(arr.shape)}): "
                                 f"empty tensors are not supported")
            if np.all(arr == arr.flat[0]) and np.isfinite(arr.flat[0]):
                v = Value(tuple(arr.shape), number=float(arr.flat[0]))
            elif (band := band_of(arr)) is not None:
                v = self.band(name, tuple(arr.shape), band)
            elif (ramp := ramp_of(arr)) is not None:
                v = self.ramp(name, tuple(arr.shape), ramp)
            else:
                v = self.declare(name, tuple(arr.shape), "f32", arr)
            self.values[name] = v
            return v
        raise self.error(f"value '{name}' is not defined before its use")

    def band(self, name: str, shape: tuple[int, ...], band: Band) -> Value:
        """A constant mask over two positions written as the predicate it is, so that fused
        reductions skip the blocks where it holds the consumer's identity everywhere."""
        rows, cols = [d for d, n in enumerate(shape) if n > 1]

        def expr(_refs: list[str], ix: _Index) -> str:
            i, j = ix.position(rows), ix.position(cols)
            def shifted(k: int) -> str:
                return f"{i} + {k}" if k >= 0 else f"{i} - {-k}"
            tests = ([f"{j} >= {shifted(band.lo)}"] if band.lo is not None else []) + \
                    ([f"{j} <= {shifted(band.hi)}"] if band.hi is not None else [])
            return f"where({' and '.join(tests)}, {_number(band.inside)}, " \
                   f"{_number(band.outside)})"
        return self.statement(name, shape, range(len(shape)), [], expr)

    def ramp(self, name: str, shape: tuple[int, ...], ramp: Ramp) -> Value:
        """A constant ramp written as the position it is: a one-hot's comparison of ids with
        it is then a gather (a lookup of table rows), not a product by a matrix of zeros."""
        def expr(_refs: list[str], ix: _Index) -> str:
            at = ix.position(ramp.axis)
            scaled = at if ramp.step == 1 else f"{_number(ramp.step)} * {at}"
            return scaled if ramp.start == 0 else f"{_number(ramp.start)} + {scaled}"
        return self.statement(name, shape, range(len(shape)), [], expr)

    def const(self, name: str, what: str) -> np.ndarray:
        """An operand that must be known when importing (a shape, axes, a starting index)."""
        if name not in self.consts:
            raise self.error(f"{what} ('{name}') must be a constant (computed from constants "
                             f"and shapes only)")
        return self.consts[name]

    # --- statements ---------------------------------------------------------------------

    def statement(self, hint: str, dims: Sequence[int], out: Sequence[int],
                  operands: Sequence[Operand], expr: ExprFn) -> Value:
        """Emit `hint[out axes] = expr(...)` over statement dimensions of extents `dims`.

        Each operand maps each of its dimensions to a statement dimension (None: extent 1,
        broadcast).  `expr` gets the operands' references (or literals) and the index of
        atomic axes (for reductions and positions); `out` lists the dimensions of the result.
        """
        self.check_shape(dims)
        operands = list(operands)
        while isinstance(atoms := self.atoms(dims, operands), int):
            d = atoms  # a dimension the operands factor in incompatible ways ([3, 4], [4, 3])
            split = [(i, j) for i, (v, where) in enumerate(operands) for j, e in enumerate(where)
                     if e == d and v.groups and len(v.groups[j]) > 1 and v.shape[j] == dims[d]]
            if not split:
                raise self.error("operands factor a dimension in incompatible ways; no view "
                                 "reads them together")
            i, j = split[0]
            operands[i] = (self.regrouped(operands[i][0], j), operands[i][1])
        flat = [e for d in range(len(dims)) for e in atoms[d]]
        names_flat = iter(self.axis_names(flat))
        names = [[next(names_flat) for _ in atoms[d]] for d in range(len(dims))]
        index = _Index(names, atoms)
        refs = [self.reference(v, where, index) for v, where in operands]
        body = expr(refs, index)
        target = self.fresh(hint)
        out_axes = index.axes(out)
        for a in out_axes:  # a broadcast store: `0 * a` names the axis, the value is unchanged
            if not re.search(rf"\b{a}\b", body):
                body = f"{body} + 0 * {a}"
        self.lines.append((target, f"{target}[{', '.join(out_axes)}] = {body}",
                           frozenset(v.tensor for v, _ in operands if v.tensor is not None)))
        self.tensor_axes[target] = tuple(e for d in out for e in atoms[d])
        groups, i = [], 0
        for d in out:
            groups.append(tuple(range(i, i + len(atoms[d]))))
            i += len(atoms[d])
        extents = self.tensor_axes[target]
        return Value(tuple(dims[d] for d in out), target, None, extents,
                     tuple(range(len(extents))), tuple(groups))

    def atoms(self, dims: Sequence[int], operands: Sequence[Operand]) -> list[list[int]] | int:
        """The atomic axes of each statement dimension: the coarsest factorization that
        refines every operand's of it; or the first dimension that none refines."""
        factors: list[list[list[int]]] = [[] for _ in dims]
        for v, where in operands:
            for j, d in enumerate(where):
                if d is not None and v.groups and v.groups[j] and v.shape[j] == dims[d]:
                    factors[d].append([v.pieces[p] for p in v.groups[j]])
        atoms: list[list[int]] = []
        for d, n in enumerate(dims):
            r = refine(n, factors[d]) if n > 1 else []
            if r is None:
                return d
            atoms.append(r)
        return atoms

    def regrouped(self, v: Value, j: int) -> Value:
        """`v` stored again with its dimension `j` one axis, which any factorization reads:
        a sum over v's own factors of it, selected by position.  Where two operands factor a
        dimension in incompatible ways: Phi-3's 12 query heads, sliced from one QKV
        projection in thirds of 256 features and viewed as heads of 64, are (3, 4); its 4
        key heads repeated for them are (4, 3).  The numpy backend computes such a selection
        as the reshape it is (`bbrules.regroup`)."""
        r = len(v.shape)

        def expr(refs: list[str], ix: _Index) -> str:
            return reduce_expr("sum", ix.axes([j]),
                               f"where({ix.position(j)} == {ix.position(r)}, {refs[0]}, 0)")
        return self.statement(f"{v.tensor}_regrouped", (*v.shape, v.shape[j]),
                              [r if d == j else d for d in range(r)], [(v, range(r))], expr)

    def reference(self, v: Value, where: Sequence[int | None], index: _Index) -> str:
        """The operand `v` read at the statement's atomic axes: `T[a, (b, c)]`, or a literal."""
        if v.tensor is None:
            return _number(v.number)
        piece_axes: dict[int, list[str]] = {}
        for j, group in enumerate(v.groups):
            if not group or v.shape[j] == 1:
                continue
            d = where[j]
            names, extents = index.names[d], index.extents[d]
            cut = _strides(extents)
            mine = _strides([v.pieces[p] for p in group])
            for k, p in enumerate(group):
                hi, lo = mine[k], mine[k + 1]
                piece_axes[p] = [names[i] for i in range(len(names)) if hi >= cut[i] > lo]
        parts, read = [], []
        for axis in range(len(self.tensor_axes[v.tensor])):
            axes = [n for p in range(len(v.pieces)) if v.owner[p] == axis
                    for n in piece_axes[p]]
            parts.append(axes[0] if len(axes) == 1 else f"({', '.join(axes)})")
            read += axes
        if len(read) > len(parts):  # a view
            extent = {n: e for names, extents in zip(index.names, index.extents)
                      for n, e in zip(names, extents)}
            self.viewed.update(extent[n] for n in read)
        return f"{v.tensor}[{', '.join(parts)}]"

    def map(self, hint: str, args: Sequence[Value], fn: Callable[..., str]) -> Value:
        """An elementwise operator with numpy broadcasting."""
        shape = self.broadcast([a.shape for a in args])
        if all(a.tensor is None for a in args):
            raise self.error("an operator on constants only should have been folded")
        r = len(shape)
        operands = [(a, [r - len(a.shape) + j if a.shape[j] == shape[r - len(a.shape) + j]
                         else None for j in range(len(a.shape))]) for a in args]
        return self.statement(hint, shape, range(r), operands, lambda refs, _: fn(*refs))

    def broadcast(self, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
        """numpy's broadcast of `shapes`, without numpy's limit on an array's size: a shape
        too large to run may still be imported, costed and fused."""
        rank = max(map(len, shapes), default=0)
        result = []
        for j in range(rank):
            extents = {s[j - rank + len(s)] for s in shapes if j >= rank - len(s)} - {1}
            if len(extents) > 1:
                raise self.error(f"shapes {[list(s) for s in shapes]} do not broadcast")
            result.append(extents.pop() if extents else 1)
        return tuple(result)

    def reduce(self, hint: str, x: Value, axes: Sequence[int], op: str,
               body: Callable[[str], str] = lambda a: a, keepdims: bool = True,
               extra: Sequence[Value] = ()) -> Value:
        """`op` over `axes` of `x` (of `body(x)`, where `extra` operands, broadcast against
        x, are passed after it)."""
        r = len(x.shape)
        axes = sorted({a % r for a in axes}) if r else []
        kept = [d for d in range(r) if d not in axes]
        operands: list[Operand] = [(x, list(range(r)))]
        for e in extra:
            operands.append((e, [r - len(e.shape) + j if e.shape[j] == x.shape[r - len(e.shape) + j]
                                 else None for j in range(len(e.shape))]))
        result = self.statement(hint, x.shape, kept, operands,
                                lambda refs, ix: reduce_expr(op, ix.axes(axes), body(*refs)))
        if keepdims:
            return self.reshape(result, tuple(1 if d in axes else x.shape[d] for d in range(r)))
        return result

    # --- views --------------------------------------------------------------------------

    def reshape(self, v: Value, shape: Sequence[int]) -> Value:
        """`v` read as `shape` (the same elements, row-major): its pieces, in the order the
        dimensions list them, cut finer where needed and regrouped.  Pieces need not be in
        memory order, so a transpose followed by a reshape moves no data; only a broadcast
        dimension is stored first, and a value whose pieces cut a dimension in a way the new
        shape cannot refine (Swin's image of 10 x 10 rolled by 2, its rows in pieces of 5 x 2,
        read as windows of 2 x 5) is stored again with each such dimension one axis
        (`regrouped`)."""
        shape = tuple(int(n) for n in shape)
        if math.prod(shape) != math.prod(v.shape):
            raise self.error(f"cannot reshape {list(v.shape)} to {list(shape)}")
        if v.tensor is None:
            return Value(shape, number=v.number)
        if any(not g and n > 1 for g, n in zip(v.groups, v.shape)):
            v = self.copy(v)
        order = [p for g in v.groups for p in g]  # the pieces as row-major digits of `shape`
        new = refine(math.prod(shape), [[v.pieces[p] for p in order], squeezed(shape)])
        if new is None and any(len(g) > 1 for g in v.groups):
            for j in [j for j, g in enumerate(v.groups) if len(g) > 1]:
                v = self.regrouped(v, j)
            order = [p for g in v.groups for p in g]
            new = refine(math.prod(shape), [[v.pieces[p] for p in order], squeezed(shape)])
        if new is None:
            raise self.error(f"cannot read {list(v.shape)} as {list(shape)}: the two shapes "
                             f"cut it in ways no view can join (the shapes interleave)")
        cuts: dict[int, list[int]] = {}  # each piece's finer pieces, outer first
        it = iter(new)
        for p in order:
            cuts[p], left = [], v.pieces[p]
            while left > 1:
                cuts[p].append(next(it))
                left //= cuts[p][-1]
        pieces, owner, index = [], [], {}
        for p in range(len(v.pieces)):  # memory order, as `pieces` must stay
            index[p] = list(range(len(pieces), len(pieces) + len(cuts[p])))
            pieces += cuts[p]
            owner += [v.owner[p]] * len(cuts[p])
        digits = [i for p in order for i in index[p]]
        groups, i = [], 0
        for n in shape:
            j = i
            while n > 1 and math.prod(pieces[d] for d in digits[i:j]) < n:
                j += 1
            groups.append(tuple(digits[i:j]))
            i = j
        return Value(shape, v.tensor, None, tuple(pieces), tuple(owner), tuple(groups))

    def transpose(self, v: Value, perm: Sequence[int]) -> Value:
        if sorted(perm) != list(range(len(v.shape))):
            raise self.error(f"perm {list(perm)} is not a permutation of the value's "
                             f"{len(v.shape)} dimensions")
        shape = tuple(v.shape[p] for p in perm)
        if v.tensor is None:
            return Value(shape, number=v.number)
        return Value(shape, v.tensor, None, v.pieces, v.owner, tuple(v.groups[p] for p in perm))

    def expand(self, v: Value, shape: Sequence[int]) -> Value:
        """`v` broadcast to `shape`: new dimensions are broadcast ones, no data moves."""
        shape = self.broadcast([v.shape, tuple(int(n) for n in shape)])
        if v.tensor is None:
            return Value(shape, number=v.number)
        lead = len(shape) - len(v.shape)
        groups = [()] * lead + [g if n == v.shape[j] else () for j, (g, n) in
                                enumerate(zip(v.groups, shape[lead:]))]
        return Value(shape, v.tensor, None, v.pieces, v.owner, tuple(groups))

    def copy(self, v: Value, hint: str | None = None) -> Value:
        """A statement that stores `v` densely in its ONNX layout."""
        return self.map(hint or f"{v.tensor or 'c'}_copy", [v], lambda a: a) \
            if v.tensor is not None else self.statement(
                hint or "c", v.shape, range(len(v.shape)), [], lambda refs, ix: _number(v.number))

    # --- the graph ----------------------------------------------------------------------

    def run(self) -> Imported:
        self.check_declarations()
        self.model = _expand_functions(self.model, self.path)
        self.elem_types = _element_types(self.model)
        graph = self.model.graph
        inputs: dict[str, tuple[str, tuple[int, ...]]] = {}
        whole: set[str] = set()  # the inputs of integers
        for inp in graph.input:
            if inp.name in self.consts:
                continue  # an initializer listed as an input (older exporters): its default
            shape = self.shape_of(inp)
            elem = inp.type.tensor_type.elem_type
            if elem not in _NUMBERS:
                raise self.error(f"graph input '{inp.name}' is not a tensor of numbers "
                                 f"(ONNX element type {elem})")
            if elem in _INTEGERS:
                whole.add(inp.name)
            v = self.declare(inp.name, shape,
                             "i32" if elem in _INTEGERS else _DTYPES.get(elem, "f32"))
            self.values[inp.name] = v
            inputs[inp.name] = (v.tensor, shape)
        for i, node in enumerate(graph.node):
            label = node.name or next(iter(node.output), "")
            self.node_at = f"node {i} '{label}' ({node.op_type}): "
            self.lower(node)
        self.node_at = ""
        outputs: dict[str, tuple[str, tuple[int, ...]]] = {}
        for out in graph.output:
            v = self.value(out.name)
            if v.tensor is None or v.tensor in self.weights or not v.dense or \
                    any(v.tensor == t for t, _ in inputs.values()):
                v = self.copy(v, out.name)
            outputs[out.name] = (v.tensor, v.shape)
        if not outputs:
            raise self.error("the graph has no outputs")
        return Imported(self.text(outputs), self.weights, Interface(inputs, outputs),
                        self.symbolic, frozenset(whole))

    def check_declarations(self) -> None:
        """Read the initializers and refuse negative declared dimensions before ONNX's shape
        inference sees them: it aborts the whole process on some (a negative extent reaching
        Slice's bounds fails an assertion in its C++)."""
        graph = self.model.graph
        for init in graph.initializer:
            self.consts[init.name] = self.initializer(init)
        for info in (*graph.input, *graph.output, *graph.value_info):
            dims = info.type.tensor_type.shape.dim
            if any(d.HasField("dim_value") and d.dim_value < 0 for d in dims):
                raise self.error(f"'{info.name}' is declared with a negative dimension: "
                                 f"{[d.dim_value or d.dim_param for d in dims]}")

    def initializer(self, tensor) -> np.ndarray:
        """An initializer's values, or an error naming it where its data do not fit its
        dimensions and element type (a truncated or hand-edited file)."""
        if any(n < 0 for n in tensor.dims):
            raise self.error(f"initializer '{tensor.name}' has a negative dimension: "
                             f"{list(tensor.dims)}")
        from onnx import numpy_helper
        try:
            return numpy_helper.to_array(tensor)
        except (ValueError, TypeError, KeyError) as err:
            raise self.error(f"initializer '{tensor.name}' (dims {list(tensor.dims)}, element "
                             f"type {tensor.data_type}) cannot be read: {err}") from None

    def shape_of(self, info) -> tuple[int, ...]:
        """A graph input's shape; a symbolic dimension takes its `--dim` extent (default 1)."""
        if not info.type.tensor_type.HasField("shape"):
            raise self.error(f"graph input '{info.name}' has no shape: bbrules compiles for "
                             f"static shapes")
        shape = []
        for d in info.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            else:
                name = d.dim_param or "unnamed"
                extent = self.overrides.get(name, (DEFAULT_SYMBOLIC_EXTENT, None))[0]
                self.symbolic[name] = extent
                shape.append(extent)
        return tuple(shape)

    def text(self, outputs: dict[str, tuple[str, tuple[int, ...]]]) -> str:
        dims, extents = [], {}
        for extent in sorted(self.dim_copies):
            block = self.block(extent)
            if extent % block and extent in self.viewed:
                block = dividing_block(extent)
            for name, (e, b) in self.overrides.items():
                if re.fullmatch(rf"d{extent}(_\d+)?", name) and e == extent and b:
                    block = b
            for k in range(self.dim_copies[extent]):
                name = f"d{extent}" if k == 0 else f"d{extent}_{k}"
                extents[name] = extent
                dims.append(f"dim {name} = {extent}" + (f" / {block}" if block < extent else ""))
        self.check_overrides(extents)
        head = f"# Imported from {Path(self.path).name} by `bbrules import`.\n"
        stored: dict[str, list[str]] = {}  # outputs by storage type: ONNX's, where bbrules has it
        for name, (tensor, _) in outputs.items():
            stored.setdefault(_DTYPES.get(self.elem_types.get(name, 1), "f32"), []).append(tensor)
        body = [*dims, "", *self.decls, "", *self.live(outputs), "",
                *(f"output {', '.join(ts)}" + (f" : {dtype}" if dtype != "f32" else "")
                  for dtype, ts in stored.items())]
        return head + "\n".join(body) + "\n"

    def live(self, outputs: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
        """The statements an output depends on, in order: a slice that a concatenation no
        longer reads (it reads the slice's source: `gather_parts`) is left out."""
        needed = {tensor for tensor, _ in outputs.values()}
        kept = []
        for target, text, reads in reversed(self.lines):
            if target in needed:
                kept.append(text)
                needed |= reads
        return kept[::-1]

    def check_overrides(self, extents: dict[str, int]) -> None:
        """Every `--dim` names a symbolic dimension of the model (and sets its extent) or a
        dimension of the imported program at its extent (and sets its block): any other is a
        mistake, as it is for a `.bbp` program, not something to ignore."""
        for name, (extent, _) in self.overrides.items():
            if name in self.symbolic:
                continue
            if name not in extents:
                symbolic = ", ".join(sorted(self.symbolic)) or "none"
                raise UsageError(f"dimension override for '{name}': {self.path} has no "
                                 f"symbolic dimension '{name}' (it has {symbolic}) and the "
                                 f"program imported from it no dimension '{name}'")
            if extent != extents[name]:
                raise UsageError(f"dimension override for '{name}': the imported dimension "
                                 f"has extent {extents[name]}; only its block can be set "
                                 f"({name}={extents[name]}/BLOCK)")

    def lower(self, node) -> None:
        if all(i in self.consts for i in [*node.input, *_outer_names(node)] if i) and \
                node.op_type not in _NO_FOLD:
            self.fold(node)
            return
        if node.op_type == "CastLike" and node.input[0] in self.consts:
            self.consts[node.output[0]] = self.consts[node.input[0]]  # the like only types it
            return
        if node.op_type == "Shape" and node.input[0] in self.values:
            shape = np.array(self.values[node.input[0]].shape, dtype=np.int64)
            start, end = _attr(node, "start", 0), _attr(node, "end", None)
            self.consts[node.output[0]] = shape[start:end]
            return
        exact = _INTEGER_EXACT.get(node.op_type)
        if exact and self.elem_types.get(node.output[0], 1) in _INTEGERS and not exact(self, node):
            raise self.error(f"{node.op_type} on integers rounds; bbrules computes in floating "
                             f"point and does not import it")
        rule = LOWERINGS.get(node.op_type)
        if rule is None or node.domain not in ("", "ai.onnx"):
            raise self.error(f"operator {node.domain + '.' if node.domain else ''}"
                             f"{node.op_type} is not supported (supported: "
                             f"{', '.join(sorted(LOWERINGS))})")
        try:
            results = rule(self, node)
        except (IndexError, ValueError, TypeError) as err:  # a malformed node (missing inputs)
            raise self.error(f"cannot import it ({type(err).__name__}: {err})") from None
        for name, v in zip(node.output, results):
            if name:
                self.values[name] = v

    def fold(self, node) -> None:
        """Evaluate a node on constants with ONNX's reference implementation."""
        from onnx import helper
        from onnx.reference import ReferenceEvaluator
        inputs = [n for n in node.input if n]
        inputs += sorted(_outer_names(node) - set(inputs))
        try:
            graph = helper.make_graph(
                [node], "fold",
                [helper.make_tensor_value_info(
                    n, helper.np_dtype_to_tensor_dtype(self.consts[n].dtype),
                    self.consts[n].shape) for n in inputs],
                [helper.make_tensor_value_info(n, 0, None) for n in node.output if n])
            model = helper.make_model(graph, opset_imports=list(self.model.opset_import))
            results = ReferenceEvaluator(model).run(None, {n: self.consts[n] for n in inputs})
        except Exception as err:  # the reference implementation's own complaint, reported
            raise self.error(f"evaluating it on constants failed: {err}") from None
        for name, r in zip([n for n in node.output if n], results):
            self.consts[name] = np.asarray(r)

    def input(self, node, i: int) -> Value | None:
        return self.value(node.input[i]) if len(node.input) > i and node.input[i] else None

    def axes_of(self, node, rank: int, index: int = 1, default=None) -> list[int] | None:
        """An `axes` attribute, or (newer opsets) the constant input at `index`."""
        axes = _attr(node, "axes", None)
        if axes is None and len(node.input) > index and node.input[index]:
            axes = self.const(node.input[index], "axes").reshape(-1).tolist()
        if axes is None:
            return default
        return [int(a) % rank if rank else 0 for a in axes]


def _expand_functions(model, path: str):
    """The model with every operator that has no lowering here but has a definition as an
    ONNX function (Attention, RotaryEmbedding, GroupNormalization, Mish, ...) replaced by that
    definition, recursively."""
    import onnx
    import onnx.inliner
    for _ in range(8):  # an expansion may use operators that are functions themselves
        known = _constant_names(model.graph)
        missing = sorted({(n.domain, n.op_type) for n in model.graph.node
                          if n.op_type not in LOWERINGS and _has_function(n)
                          and not all(i in known for i in n.input if i)})
        if not missing:
            return model
        for node in model.graph.node:  # the inliner does not fill in defaulted attributes
            if (node.domain, node.op_type) in missing:
                _add_defaults(node)
        try:
            model = onnx.inliner.inline_selected_functions(
                onnx.shape_inference.infer_shapes(model), missing, inline_schema_functions=True)
        except Exception as err:  # the inliner's own complaint (an untyped input, ...)
            ops = ", ".join(op for _, op in missing)
            raise OnnxError(f"{path}: expanding {ops} into its ONNX function definition "
                            f"failed: {err}") from None
    return model


def _constant_names(graph) -> set[str]:
    """Values computed from initializers and shapes only: folded when imported, so an
    operator on them (a Range, say) needs no expansion."""
    known = {t.name for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Shape" or all(i in known for i in [*n.input, *_outer_names(n)] if i):
            known.update(n.output)
    return known


def _add_defaults(node) -> None:
    import onnx
    schema = onnx.defs.get_schema(node.op_type, domain=node.domain)
    given = {a.name for a in node.attribute}
    for name, attr in schema.attributes.items():
        if name not in given and attr.default_value.name:
            node.attribute.append(attr.default_value)


def _has_function(node) -> bool:
    import onnx
    try:
        schema = onnx.defs.get_schema(node.op_type, domain=node.domain)
    except Exception:  # not a standard operator: reported when it is lowered
        return False
    return schema.has_function or schema.has_context_dependent_function


def _element_types(model) -> dict[str, int]:
    """The element type of every value ONNX's shape inference can type."""
    import onnx
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is advisory here: untyped values are taken to be floats
        pass
    g = model.graph
    return {v.name: v.type.tensor_type.elem_type
            for v in (*g.input, *g.value_info, *g.output) if v.type.HasField("tensor_type")}


# ONNX element types: those that hold numbers, and those of them that are integers
_NUMBERS = {1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 16}
_INTEGERS = {2, 3, 4, 5, 6, 7, 12, 13}
# Operators whose integer results equal the floating-point ones only under a condition
_INTEGER_EXACT: dict[str, Callable[[Importer, object], bool]] = {
    "Div": lambda im, node: False,
    "Cast": lambda im, node: im.elem_types.get(node.input[0], 1) in _INTEGERS | {9},
    "Mean": lambda im, node: False,
    "ReduceMean": lambda im, node: False,
}


def _outer_names(node) -> set[str]:
    """The names a node's subgraphs (a Loop's body, an If's branches) read from outside."""
    names: set[str] = set()
    for a in node.attribute:
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            local = {i.name for i in (*g.input, *g.initializer)} | \
                {o for n in g.node for o in n.output}
            for n in g.node:
                names.update(i for i in n.input if i not in local)
                names |= _outer_names(n) - local
    return names - {""}


def _attr(node, name: str, default):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


# ------------------------------------------------------------------------------------------
# Lowerings, one per operator family: each returns the values of the node's outputs.

Lowering = Callable[[Importer, object], list[Value]]
LOWERINGS: dict[str, Lowering] = {}
_NO_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike"}


def lowering(*ops: str) -> Callable[[Lowering], Lowering]:
    def register(fn: Lowering) -> Lowering:
        for op in ops:
            LOWERINGS[op] = fn
        return fn
    return register


_ELEMENTWISE: dict[str, Callable[..., str]] = {
    "Add": lambda a, b: f"{a} + {b}",
    "Sub": lambda a, b: f"{a} - {b}",
    "Mul": lambda a, b: f"{a} * {b}",
    "Div": lambda a, b: f"{a} / {b}",
    "Pow": lambda a, b: f"pow({a}, {b})",
    "Equal": lambda a, b: f"{a} == {b}",
    "Less": lambda a, b: f"{a} < {b}",
    "LessOrEqual": lambda a, b: f"{a} <= {b}",
    "Greater": lambda a, b: f"{a} > {b}",
    "GreaterOrEqual": lambda a, b: f"{a} >= {b}",
    "And": lambda a, b: f"{a} and {b}",
    "Or": lambda a, b: f"{a} or {b}",
    "Xor": lambda a, b: f"{a} != {b}",
    "Not": lambda a: f"not {a}",
    "IsNaN": lambda a: f"{a} != {a}",  # true of NaN alone (torch's SDPA with a mask writes it)
    "Neg": lambda a: f"-{a}",
    "Abs": lambda a: f"abs({a})",
    "Exp": lambda a: f"exp({a})",
    "Log": lambda a: f"log({a})",
    "Sqrt": lambda a: f"sqrt({a})",
    "Reciprocal": lambda a: f"1 / {a}",
    "Tanh": lambda a: f"tanh({a})",
    "Sigmoid": lambda a: f"sigmoid({a})",
    "Relu": lambda a: f"relu({a})",
    "Erf": lambda a: f"erf({a})",
    "Sin": lambda a: f"sin({a})",
    "Cos": lambda a: f"cos({a})",
    "Softplus": lambda a: f"softplus({a})",
    "Where": lambda c, a, b: f"where({c}, {a}, {b})",
}


@lowering(*_ELEMENTWISE)
def _elementwise(im: Importer, node) -> list[Value]:
    args = [im.value(n) for n in node.input]
    return [im.map(node.output[0], args, _ELEMENTWISE[node.op_type])]


@lowering("Max", "Min", "Sum", "Mean")
def _variadic(im: Importer, node) -> list[Value]:
    args = [im.value(n) for n in node.input]
    n = len(args)

    def fn(*refs: str) -> str:
        if node.op_type in ("Max", "Min"):
            out = refs[0]
            for r in refs[1:]:
                out = f"{node.op_type.lower()}({out}, {r})"
            return out
        total = " + ".join(refs)
        return f"({total}) / {n}" if node.op_type == "Mean" else total
    return [im.map(node.output[0], args, fn)]


@lowering("Gelu")
def _gelu(im: Importer, node) -> list[Value]:
    x = im.value(node.input[0])
    if _attr(node, "approximate", "none") == "tanh":
        return [im.map(node.output[0], [x], lambda a: f"gelu({a})")]
    return [im.map(node.output[0], [x], lambda a: f"0.5 * {a} * (1 + erf({a} * "
                                                  f"{_number(1 / math.sqrt(2))}))")]


def _leaky_relu(im: Importer, node) -> Callable[[str], str]:
    alpha = _number(_attr(node, "alpha", 0.01))
    return lambda a: f"where({a} >= 0, {a}, {alpha} * {a})"


def _elu(im: Importer, node) -> Callable[[str], str]:
    alpha = _number(_attr(node, "alpha", 1.0))
    return lambda a: f"where({a} > 0, {a}, {alpha} * elu({a}))"


def _selu(im: Importer, node) -> Callable[[str], str]:
    alpha = _number(_attr(node, "alpha", 1.67326319217681884765625))
    gamma = _number(_attr(node, "gamma", 1.05070102214813232421875))
    return lambda a: f"{gamma} * where({a} > 0, {a}, {alpha} * elu({a}))"


def _hard_sigmoid(im: Importer, node) -> Callable[[str], str]:
    alpha, beta = _number(_attr(node, "alpha", 0.2)), _number(_attr(node, "beta", 0.5))
    return lambda a: f"max(0, min(1, {alpha} * {a} + {beta}))"


def _clip(im: Importer, node) -> Callable[[str], str]:
    lo = _number(_clip_bound(im, node, 1, "min", -math.inf))
    hi = _number(_clip_bound(im, node, 2, "max", math.inf))
    return lambda a: f"min(max({a}, {lo}), {hi})"


_PARAMETRIC = {"LeakyRelu": _leaky_relu, "Elu": _elu, "Selu": _selu,
               "HardSigmoid": _hard_sigmoid, "Clip": _clip}


@lowering(*_PARAMETRIC)
def _with_parameters(im: Importer, node) -> list[Value]:
    """Elementwise operators whose attributes (or constant inputs) fix their parameters."""
    fn = _PARAMETRIC[node.op_type](im, node)
    return [im.map(node.output[0], [im.value(node.input[0])], fn)]


def _clip_bound(im: Importer, node, index: int, name: str, default: float) -> float:
    if len(node.input) > index and node.input[index]:
        return float(im.const(node.input[index], f"Clip's {name}"))
    return float(_attr(node, name, default))


@lowering("Identity", "Dropout", "Cast", "CastLike")
def _identity(im: Importer, node) -> list[Value]:
    x = im.value(node.input[0])
    if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2] and \
            bool(im.const(node.input[2], "training_mode")):
        raise im.error("Dropout in training mode draws random numbers; import the model "
                       "for inference")
    to = _attr(node, "to", 1) if node.op_type == "Cast" else \
        im.elem_types.get(node.input[1], 1) if node.op_type == "CastLike" else 1
    if to == 9:  # to bool: nonzero is true
        return [im.map(node.output[0], [x], lambda a: f"{a} != 0")]
    if to not in _NUMBERS:
        raise im.error(f"a cast to ONNX element type {to} (a format of under 16 bits or not a "
                       f"number) is not supported: bbrules computes in float32")
    return [x]  # float32 holds f16/bf16 values and the integers a model casts to


@lowering("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(im: Importer, node) -> list[Value]:
    x = im.value(node.input[0])
    shape = list(x.shape)
    r = len(shape)
    match node.op_type:
        case "Reshape":
            want = im.const(node.input[1], "the new shape").reshape(-1).tolist()
            if not _attr(node, "allowzero", 0):
                want = [shape[i] if n == 0 else n for i, n in enumerate(want)]
            if -1 in want:
                known = math.prod(n for n in want if n != -1)
                want[want.index(-1)] = math.prod(shape) // known if known else 0
        case "Flatten":
            axis = _attr(node, "axis", 1)
            axis = axis + r if axis < 0 else axis
            want = [math.prod(shape[:axis]), math.prod(shape[axis:])]
        case "Squeeze":
            axes = im.axes_of(node, r) or [i for i, n in enumerate(shape) if n == 1]
            want = [n for i, n in enumerate(shape) if i not in axes]
        case _:
            given = _attr(node, "axes", None)
            if given is None:
                given = im.const(node.input[1], "axes").reshape(-1).tolist()
            rank = r + len(given)
            want = list(shape)
            for a in sorted(int(a) % rank for a in given):
                want.insert(a, 1)
    return [im.reshape(x, want)]


@lowering("Transpose")
def _transpose(im: Importer, node) -> list[Value]:
    x = im.value(node.input[0])
    perm = _attr(node, "perm", None) or list(range(len(x.shape)))[::-1]
    return [im.transpose(x, perm)]


def gather_parts(im: Importer, hint: str, parts: Sequence[tuple[Value, int]], axis: int,
                 length: int, kept: Sequence[tuple[Value, int, int]] = ()) -> Value:
    """`length` elements along `axis` assembled from slices of `parts`: part (x, at) places
    x's elements from position `at` of the result (negative: x is cut off before it), and
    each of `kept`, (y, lo, hi), y's own elements at positions lo .. hi - 1 (y has the
    result's shape: a concatenation puts a slice of y back where it was).

    No statement can shift an index, so each part is read through a view that cuts `axis`
    into chunks of g elements (g divides every boundary) and chosen by a one-hot sum over its
    chunks: y[q, i] = sum over p of where(p == q + offset, x[p, i], 0).  Block skipping visits
    only the blocks of chunks whose predicate may hold (one chunk per block where the chunks are
    few, so then no more data moves than the selection holds).  A kept piece needs no shift:
    it is a selection by the chunk's position, elementwise, which forwarding can take into
    the reader (GPT-NeoX's query and key heads, a quarter rotated and concatenated back to
    the other three: two kernels of their own each)."""
    shape = (parts or kept)[0][0].shape
    g = math.gcd(length, *(n for x, at in parts for n in (x.shape[axis], at)),
                 *(b for _, lo, hi in kept for b in (lo, hi)))
    outer = tuple(shape[:axis]) + (length // g, g) + tuple(shape[axis + 1:])
    r = len(outer)
    dims = [*outer, *(x.shape[axis] // g for x, _ in parts)]
    operands: list[Operand] = []
    for k, (x, _) in enumerate(parts):
        viewed = im.reshape(x, x.shape[:axis] + (x.shape[axis] // g, g) + x.shape[axis + 1:])
        where = list(range(r))
        where[axis] = r + k
        operands.append((viewed, [d if viewed.shape[j] == dims[d] else None
                                  for j, d in enumerate(where)]))
    for y, _, _ in kept:
        viewed = im.reshape(y, outer)
        operands.append((viewed, [d if n == outer[d] else None
                                  for d, n in enumerate(viewed.shape)]))

    def expr(refs: list[str], ix: _Index) -> str:
        terms = []
        for k, (ref, (_, at)) in enumerate(zip(refs, parts)):
            hit = f"{ix.position(r + k)} == {ix.position(axis)} - {at // g}" if at >= 0 else \
                f"{ix.position(r + k)} == {ix.position(axis)} + {-at // g}"
            terms.append(reduce_expr("sum", ix.axes([r + k]), f"where({hit}, {ref}, 0)"))
        q = ix.position(axis)
        for ref, (_, lo, hi) in zip(refs[len(parts):], kept):
            terms.append(f"where({q} >= {lo // g} and {q} < {hi // g}, {ref}, 0)")
        return " + ".join(terms)
    y = im.statement(hint, dims, range(r), operands, expr)
    return im.reshape(y, tuple(shape[:axis]) + (length,) + tuple(shape[axis + 1:]))


def _slice(im: Importer, hint: str, x: Value, axis: int, start: int, stop: int) -> Value:
    if (start, stop) == (0, x.shape[axis]):
        return x
    y = gather_parts(im, hint, [(x, -start)], axis, stop - start)
    im.sliced[y] = (x, axis, start)
    return y


@lowering("Slice")
def _slice_node(im: Importer, node) -> list[Value]:
    x = im.value(node.input[0])
    r = len(x.shape)
    starts = im.const(node.input[1], "the starts").reshape(-1).tolist()
    ends = im.const(node.input[2], "the ends").reshape(-1).tolist()
    axes = im.axes_of(node, r, index=3, default=list(range(len(starts))))
    steps = im.const(node.input[4], "the steps").reshape(-1).tolist() \
        if len(node.input) > 4 and node.input[4] else [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        n = x.shape[axis]
        if step < 1 or n % step:
            raise im.error(f"a Slice with step {step} of an extent {n} it does not divide "
                           f"(or a negative step) is not supported")
        lo = min(max(start + n if start < 0 else start, 0), n)
        hi = min(max(end + n if end < 0 else end, 0), n)
        count = len(range(lo, hi, step))
        if count == 0:
            raise im.error(f"the slice {start}:{end} of extent {n} is empty")
        if step == 1:
            x = _slice(im, node.output[0], x, axis, lo, hi)
            continue
        # every step-th element: the axis read as (n / step, step), one column of it
        outer, inner = x.shape[:axis], x.shape[axis + 1:]
        x = im.reshape(x, outer + (n // step, step) + inner)
        x = _slice(im, node.output[0], x, axis + 1, lo % step, lo % step + 1)
        x = _slice(im, node.output[0], x, axis, lo // step, lo // step + count)
        x = im.reshape(x, outer + (count,) + inner)
    return [x]


@lowering("Pad")
def _pad(im: Importer, node) -> list[Value]:
    """Constant padding: per axis, negative pads crop (a slice) and positive ones place the
    values at an offset in a longer axis (`gather_parts`, whose empty positions are 0); a pad
    value other than 0 (or one known only at run time) is selected by position, so that -inf
    (a mask's) stays exact.  The pads set the shape: they must be known at import."""
    x = im.value(node.input[0])
    r = len(x.shape)
    mode = _attr(node, "mode", "constant")
    if mode != "constant":
        raise im.error(f"Pad mode '{mode}' is not supported (only 'constant')")
    if im.opset < 11:
        pads = _attr(node, "pads", [0] * 2 * r)
        value = Value((), number=float(_attr(node, "value", 0.0)))
    else:
        pads = im.const(node.input[1], "the pads").reshape(-1).tolist()
        value = Value((), number=0.0)
        if len(node.input) > 2 and node.input[2]:
            value = im.value(node.input[2])
            value = im.reshape(value, (1,) * len(value.shape))
    axes = im.axes_of(node, r, index=3, default=list(range(r)))
    placed: list[tuple[int, int, int]] = []  # (axis, first, stop) of the values
    for axis, begin, end in zip(axes, pads[:len(axes)], pads[len(axes):]):
        n = x.shape[axis]
        if n + begin + end <= 0:
            raise im.error(f"pads {begin}, {end} leave nothing of extent {n}")
        x = _slice(im, node.output[0], x, axis, max(-begin, 0), n - max(-end, 0))
        begin, end, n = max(begin, 0), max(end, 0), x.shape[axis]
        if begin or end:
            x = gather_parts(im, node.output[0], [(x, begin)], axis, begin + n + end)
            placed.append((axis, begin, begin + n))
    if value.number == 0.0 or not placed:
        return [x]

    def expr(refs: list[str], ix: _Index) -> str:
        inside = " and ".join(f"{ix.position(a)} >= {lo} and {ix.position(a)} < {hi}"
                              for a, lo, hi in placed)
        return f"where({inside}, {refs[0]}, {refs[1]})"
    return [im.statement(node.output[0], x.shape, range(r),
                         [(x, list(range(r))), (value, [None] * len(value.shape))], expr)]


@lowering("Gather")
def _gather(im: Importer, node) -> list[Value]:
    """y[..., j..., ...] = x[..., i[j...], ...] along `axis`.

    Indices known at import that pick one position or a run of consecutive ones are a slice
    (a view where it can be one).  Others are a one-hot matmul over the axis, as an embedding
    lookup by a one-hot vector is: y = sum[p] where(i[j] == p, 1, 0) * x[p]; an index that
    is out of range matches nothing and reads 0.  Indices known only at run time may be
    negative (counted from the end), so they match p - extent too."""
    x = im.value(node.input[0])
    r = len(x.shape)
    axis = _attr(node, "axis", 0) % r
    n, outer, inner = x.shape[axis], x.shape[:axis], x.shape[axis + 1:]
    at_run_time = node.input[1] not in im.consts
    if not at_run_time:
        idx = np.asarray(im.const(node.input[1], "the indices")).astype(np.int64)
        if np.any((idx < -n) | (idx >= n)):
            raise im.error(f"an index of {idx.reshape(-1).tolist()} is out of range for "
                           f"extent {n}")
        idx = np.where(idx < 0, idx + n, idx)
        flat = idx.reshape(-1)
        if flat.size and np.all(flat == flat[0]):  # one position, repeated
            y = _slice(im, node.output[0], x, axis, int(flat[0]), int(flat[0]) + 1)
            y = im.reshape(y, outer + (1,) * idx.ndim + inner)
            return [im.expand(y, outer + idx.shape + inner)]
        if np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):
            y = _slice(im, node.output[0], x, axis, int(flat[0]), int(flat[0]) + flat.size)
            return [im.reshape(y, outer + idx.shape + inner)]
        i = im.declare(node.input[1], idx.shape, "f32", idx)
    else:
        i = im.value(node.input[1])
    q = len(i.shape)
    dims = [*outer, *i.shape, *inner, n]
    p = len(dims) - 1
    operands: list[Operand] = [
        (x, [*range(axis), p, *range(axis + q, axis + q + len(inner))]),
        (i, list(range(axis, axis + q)))]

    def expr(refs: list[str], ix: _Index) -> str:
        at = ix.position(p)
        hit = f"{refs[1]} == {at} or {refs[1]} == {at} - {n}" if at_run_time else \
            f"{refs[1]} == {at}"
        return reduce_expr("sum", ix.axes([p]), f"where({hit}, 1, 0) * {refs[0]}")
    return [im.statement(node.output[0], dims, range(p), operands, expr)]


@lowering("Split")
def _split(im: Importer, node) -> list[Value]:
    x = im.value(node.input[0])
    axis = _attr(node, "axis", 0) % len(x.shape)
    n = x.shape[axis]
    sizes = _attr(node, "split", None)
    if sizes is None and len(node.input) > 1 and node.input[1]:
        sizes = im.const(node.input[1], "the split sizes").reshape(-1).tolist()
    if sizes is None:
        count = _attr(node, "num_outputs", len(node.output))
        chunk = -(-n // count)
        sizes = [min(chunk, n - i * chunk) for i in range(count)]
    outs, at = [], 0
    for name, size in zip(node.output, sizes):
        if size == 0:  # nothing: a Concat drops it; any other use is refused as empty
            outs.append(Value(x.shape[:axis] + (0,) + x.shape[axis + 1:], number=0.0))
        else:
            outs.append(_slice(im, name, x, axis, at, at + size))
        at += size
    return outs


@lowering("Concat")
def _concat(im: Importer, node) -> list[Value]:
    xs = [im.value(n) for n in node.input if n]
    axis = _attr(node, "axis", 0) % len(xs[0].shape)
    xs = [x for x in xs if x.shape[axis] > 0]
    if len(xs) == 1:
        return xs
    length = sum(x.shape[axis] for x in xs)
    shape = xs[0].shape[:axis] + (length,) + xs[0].shape[axis + 1:]
    parts, kept, at = [], [], 0
    for x in xs:
        source = im.sliced.get(x)
        if source is not None and source[1:] == (axis, at) and source[0].shape == shape:
            kept.append((source[0], at, at + x.shape[axis]))  # back where it was sliced from
        else:
            parts.append((x, at))
        at += x.shape[axis]
    return [gather_parts(im, node.output[0], parts, axis, length, kept)]


@lowering("Conv")
def _conv(im: Importer, node) -> list[Value]:
    """A convolution: each output position sums the kernel's taps over input positions picked
    by a one-hot sum,
    y[n, m, o] = b[m] + sum[k, c] w[m, c, k] * sum[s] where(s == o * stride + k * dilation -
    pad, 1, 0) * x[n, c, s].  Positions outside the input match nothing: zero padding for free.

    Both sums are contractions whose tiles span few axes: the one-hot is a factor of its own
    (a [o, k, s] tile times x's [c, s]), not a selection from x (an [o, k, c, s] tile), and the
    channels, the longer axis, are contracted innermost, with the taps looped around them, as
    an implicit GEMM does.

    With `group` g > 1 (a depthwise convolution: one channel a group), the channels are read
    as (group, channel in the group), input and output alike, and each group is a convolution
    of its own: y[n, g, m, o] = b[g, m] + sum[k, c] w[g, m, c, k] * (x[n, g, c, s] picked),
    read back as [n, g * m, o]."""
    x, w, b = im.value(node.input[0]), im.value(node.input[1]), im.input(node, 2)
    r = len(x.shape) - 2
    kernel, spatial = w.shape[2:], x.shape[2:]
    n, c, m, g = x.shape[0], x.shape[1], w.shape[0], _attr(node, "group", 1)
    if g < 1 or c % g or m % g or w.shape[1] * g != c:
        raise im.error(f"{g} group(s) do not fit {c} input channels, {m} output channels and "
                       f"a kernel of {w.shape[1]} input channels")
    strides, dilations, begin, _, out = _window(node, spatial, kernel)
    channels = [g, m // g] if g > 1 else [m]  # the output's channel dims
    if g > 1:
        x = im.reshape(x, (n, g, c // g, *spatial))
        w = im.reshape(w, (g, m // g, c // g, *kernel))
        b = None if b is None else im.reshape(b, (g, m // g))
    # the spatial dimensions whose input positions a one-hot picks: not those of one tap,
    # unstrided and unpadded (a pointwise convolution's), where the output position is the
    # input's
    picks = [i for i in range(r) if (kernel[i], strides[i], begin[i], out[i]) != (1, 1, 0,
                                                                              spatial[i])]
    # statement dims: n, the output's channels, o..., then the reduced c, k..., s... (picked)
    lead = 1 + len(channels)
    o_dims = list(range(lead, lead + r))
    c_dim = lead + r
    k_dims = list(range(c_dim + 1, c_dim + 1 + r))
    s_dims = list(range(c_dim + 1 + r, c_dim + 1 + r + len(picks)))
    dims = [n, *channels, *out, c // g, *kernel, *(spatial[i] for i in picks)]
    positions = [o_dims[i] for i in range(r)]  # x's, by the output's or a picked one
    for i, s_dim in zip(picks, s_dims):
        positions[i] = s_dim
    groups = list(range(1, lead - 1))  # the group dim, where there are groups
    operands: list[Operand] = [(x, [0, *groups, c_dim, *positions]),
                               (w, [*range(1, lead), c_dim, *k_dims])]
    if b is not None:
        operands.append((b, list(range(1, lead))))

    def expr(refs: list[str], ix: _Index) -> str:
        at = [f"{ix.position(o_dims[i])} * {strides[i]} + {ix.position(k_dims[i])} * "
              f"{dilations[i]} - {begin[i]}" for i in picks]
        picked = _picked(ix, s_dims, at, refs[0])
        total = reduce_expr("sum", ix.axes([*k_dims, c_dim]), f"{refs[1]} * {picked}")
        return f"{total} + {refs[2]}" if b is not None else total
    y = im.statement(node.output[0], dims, range(lead + r), operands, expr)
    return [im.reshape(y, (n, m, *out)) if g > 1 else y]


def _picked(ix: _Index, s_dims: Sequence[int], at: Sequence[str], ref: str) -> str:
    """`ref` (over input positions `s_dims`) at positions `at`, one expression of the output
    position and tap per spatial dimension: a one-hot sum per dimension, the last innermost.
    The shifts are separable, so each one-hot is an [o, k, s] tile of one dimension: one sum
    over every dimension at once would compare [o..., k..., s...] (a 16 x 16 image's 2-D
    one-hot alone, 256 KiB at whole blocks, beside a partial pick of a MiB: no blocks that
    a 512 KiB local memory allows)."""
    for s, a in reversed(list(zip(s_dims, at))):
        ref = reduce_expr("sum", ix.axes([s]), f"where({ix.position(s)} == {a}, 1, 0) * {ref}")
    return ref


def _window(node, spatial: Sequence[int], kernel: Sequence[int]
            ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """A convolution's or a pool's strides, dilations, padding before and after each spatial
    dimension and output extents, from its attributes (`pads`, or `auto_pad`; a pool's
    `ceil_mode` rounds the extents up, the last window starting inside the input or the
    padding before it)."""
    r = len(spatial)
    strides = _attr(node, "strides", [1] * r)
    dilations = _attr(node, "dilations", [1] * r)
    auto = _attr(node, "auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        total = [max((-(-n // st) - 1) * st + (k - 1) * dl + 1 - n, 0)
                 for n, k, st, dl in zip(spatial, kernel, strides, dilations)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
        end = [t - lo for t, lo in zip(total, begin)]
    else:
        pads = _attr(node, "pads", [0] * 2 * r) if auto == "NOTSET" else [0] * 2 * r
        begin, end = pads[:r], pads[r:]
    ceil = bool(_attr(node, "ceil_mode", 0))
    out = []
    for n, lo, hi, k, st, dl in zip(spatial, begin, end, kernel, strides, dilations):
        span = n + lo + hi - dl * (k - 1) - 1
        extent = (-(-span // st) if ceil else span // st) + 1
        if ceil and (extent - 1) * st >= n + lo:
            extent -= 1
        out.append(extent)
    return strides, dilations, begin, end, out


@lowering("MaxPool", "AveragePool")
def _pool(im: Importer, node) -> list[Value]:
    """A pool, as a convolution picks its taps (`_conv`): each output position takes the max
    (the mean) over the kernel's taps of the input position each picks by a one-hot sum,
    y[n, c, o] = max[k] where(o * stride + k * dilation - pad inside the input,
    sum[s] where(s == o * stride + k * dilation - pad, 1, 0) * x[n, c, s], -inf).  A tap in
    the padding is -inf to a max; to a mean it counts where `count_include_pad` says so (a
    tap past the padding, which `ceil_mode` windows reach, never)."""
    x = im.value(node.input[0])
    r = len(x.shape) - 2
    kernel, spatial = list(_attr(node, "kernel_shape", [])), x.shape[2:]
    if len(kernel) != r or any(k < 1 for k in kernel):
        raise im.error(f"kernel_shape {kernel} does not fit an input of shape {list(x.shape)}")
    if len(node.output) > 1 and node.output[1]:
        raise im.error("MaxPool's Indices output is not supported")
    strides, dilations, begin, end, out = _window(node, spatial, kernel)
    o_dims = list(range(2, 2 + r))
    k_dims = list(range(2 + r, 2 + 2 * r))
    s_dims = list(range(2 + 2 * r, 2 + 3 * r))
    dims = [x.shape[0], x.shape[1], *out, *kernel, *spatial]
    mean = node.op_type == "AveragePool"
    padded = mean and _attr(node, "count_include_pad", 0)

    def expr(refs: list[str], ix: _Index) -> str:
        at = [f"({ix.position(o)} * {st} + {ix.position(k)} * {dl} - {lo})"
              for o, k, st, dl, lo in zip(o_dims, k_dims, strides, dilations, begin)]
        inside = " and ".join(f"{a} >= 0 and {a} < {n}" for a, n in zip(at, spatial))
        picked = _picked(ix, s_dims, at, refs[0])
        taps = ix.axes(k_dims)
        if not mean:
            return reduce_expr("max", taps, f"where({inside}, {picked}, -inf)")
        if padded:  # the padding counts, not what `ceil_mode` reads past it
            inside = " and ".join(f"{a} >= {-lo} and {a} < {n + hi}"
                                  for a, n, lo, hi in zip(at, spatial, begin, end))
        count = reduce_expr("sum", taps, f"where({inside}, 1, 0)")
        return f"{reduce_expr('sum', taps, picked)} / {count}"
    return [im.statement(node.output[0], dims, range(2 + r), [(x, [0, 1, *s_dims])], expr)]


@lowering("Expand")
def _expand(im: Importer, node) -> list[Value]:
    shape = im.const(node.input[1], "the shape").reshape(-1).tolist()
    return [im.expand(im.value(node.input[0]), shape)]


@lowering("Tile")
def _tile(im: Importer, node) -> list[Value]:
    """`x` repeated `repeats[d]` times along each dimension d: a dimension of one element is
    broadcast (no data moves; torch's `repeat_interleave`, grouped-query attention's K and V
    heads, tiles a unit dimension); a longer one is read as (1, n), broadcast to (r, n) and
    merged, which stores the copies."""
    x = im.value(node.input[0])
    repeats = [int(r) for r in im.const(node.input[1], "the repeats").reshape(-1).tolist()]
    if len(repeats) != len(x.shape) or any(r < 1 for r in repeats):
        raise im.error(f"repeats {repeats} do not fit an input of shape {list(x.shape)} (one "
                       f"count of at least 1 per dimension)")
    for d, r in enumerate(repeats):
        n, before, after = x.shape[d], x.shape[:d], x.shape[d + 1:]
        if r == 1:
            continue
        if n == 1:
            x = im.expand(x, (*before, r, *after))
        else:
            x = im.expand(im.reshape(x, (*before, 1, n, *after)), (*before, r, n, *after))
            x = im.reshape(x, (*before, r * n, *after))
    return [x]


_REDUCTIONS = {"ReduceSum": ("sum", lambda a: a), "ReduceMean": ("mean", lambda a: a),
               "ReduceMax": ("max", lambda a: a), "ReduceMin": ("min", lambda a: a),
               "ReduceSumSquare": ("sum", lambda a: f"square({a})"),
               "ReduceL2": ("sum", lambda a: f"square({a})"),
               "ReduceLogSumExp": ("sum", lambda a: f"exp({a})"),
               "GlobalMaxPool": ("max", lambda a: a), "GlobalAveragePool": ("mean", lambda a: a)}


@lowering(*_REDUCTIONS)
def _reduction(im: Importer, node) -> list[Value]:
    x = im.value(node.input[0])
    r = len(x.shape)
    op, body = _REDUCTIONS[node.op_type]
    if node.op_type.startswith("Global"):
        axes, keep = list(range(2, r)), True
    else:
        axes = im.axes_of(node, r)
        keep = bool(_attr(node, "keepdims", 1))
        if axes is None or axes == []:
            if _attr(node, "noop_with_empty_axes", 0):
                return [x]
            axes = list(range(r))
    if node.op_type == "ReduceLogSumExp":
        m = im.reduce(f"{node.output[0]}_max", x, axes, "max", keepdims=True)
        s = im.reduce(f"{node.output[0]}_sum", x, axes, "sum",
                      lambda a, b: f"exp({a} - {b})", keepdims=keep, extra=[m])
        mk = m if keep else im.reshape(m, s.shape)
        return [im.map(node.output[0], [s, mk], lambda a, b: f"log({a}) + {b}")]
    out = im.reduce(node.output[0], x, axes, op, body, keepdims=keep)
    if node.op_type == "ReduceL2":
        out = im.map(f"{node.output[0]}_root", [out], lambda a: f"sqrt({a})")
    return [out]


@lowering("Softmax", "LogSoftmax")
def _softmax(im: Importer, node) -> list[Value]:
    x = im.value(node.input[0])
    r = len(x.shape)
    axis = _attr(node, "axis", -1 if im.opset >= 13 else 1) % max(r, 1)
    axes = [axis] if im.opset >= 13 else list(range(axis, r))
    name = node.output[0]
    m = im.reduce(f"{name}_max", x, axes, "max")
    if node.op_type == "Softmax":
        e = im.map(f"{name}_exp", [x, m], lambda a, b: f"exp({a} - {b})")
        s = im.reduce(f"{name}_sum", e, axes, "sum")
        return [im.map(name, [e, s], lambda a, b: f"{a} / {b}")]
    s = im.reduce(f"{name}_sum", x, axes, "sum", lambda a, b: f"exp({a} - {b})", extra=[m])
    return [im.map(name, [x, m, s], lambda a, b, c: f"{a} - {b} - log({c})")]


@lowering("LayerNormalization", "RMSNormalization", "InstanceNormalization")
def _normalization(im: Importer, node) -> list[Value]:
    """Normalised over the axes from `axis` on (over the spatial axes, each channel scaled
    and shifted by its own, for InstanceNormalization: torch's GroupNorm exports as one)."""
    x = im.value(node.input[0])
    r = len(x.shape)
    axes = list(range(_attr(node, "axis", -1) % r, r))
    eps = _number(_attr(node, "epsilon", 1e-5))
    scale, bias = im.input(node, 1), im.input(node, 2)
    if node.op_type == "InstanceNormalization":
        if r < 3:
            raise im.error(f"an input of shape {list(x.shape)} has no spatial axes")
        axes = list(range(2, r))
        scale, bias = (im.reshape(v, (x.shape[1],) + (1,) * (r - 2)) for v in (scale, bias))
    name = node.output[0]
    if node.op_type == "RMSNormalization":
        ms = im.reduce(f"{name}_ms", x, axes, "mean", lambda a: f"square({a})")
        args, fn = [x, ms], lambda a, b: f"{a} * rsqrt({b} + {eps})"
    else:
        mu = im.reduce(f"{name}_mean", x, axes, "mean")
        var = im.reduce(f"{name}_var", x, axes, "mean", lambda a, b: f"square({a} - {b})",
                        extra=[mu])
        args, fn = [x, mu, var], lambda a, b, c: f"({a} - {b}) * rsqrt({c} + {eps})"
    n_norm = len(args)
    for extra in (scale, bias):
        if extra is not None:
            args.append(extra)

    def full(*refs: str) -> str:
        out = fn(*refs[:n_norm])
        if scale is not None:
            out = f"{out} * {refs[n_norm]}"
        if bias is not None:
            out = f"{out} + {refs[-1]}"
        return out
    outs = [im.map(name, args, full)]
    if node.op_type == "LayerNormalization" and len(node.output) > 1:
        outs.append(mu)
        if len(node.output) > 2:
            outs.append(im.map(node.output[2], [var], lambda c: f"rsqrt({c} + {eps})"))
    return outs


@lowering("BatchNormalization")
def _batch_normalization(im: Importer, node) -> list[Value]:
    """Inference's batch normalisation: each channel (axis 1) by the statistics given,
    scale * (x - mean) * rsqrt(var + eps) + bias."""
    if _attr(node, "training_mode", 0):
        raise im.error("training_mode is not supported (inference's statistics only)")
    if len(node.output) > 1 and any(node.output[1:]):
        raise im.error("the running statistics' outputs are not supported")
    x = im.value(node.input[0])
    r = len(x.shape)
    if r < 2:
        raise im.error(f"an input of shape {list(x.shape)} has no channel axis")
    eps = _number(_attr(node, "epsilon", 1e-5))
    per_channel = [im.reshape(im.value(n), (x.shape[1],) + (1,) * (r - 2))
                   for n in node.input[1:5]]
    return [im.map(node.output[0], [x, *per_channel],
                   lambda a, g, b, m, v: f"({a} - {m}) * rsqrt({v} + {eps}) * {g} + {b}")]


@lowering("MatMul", "Gemm")
def _matmul(im: Importer, node) -> list[Value]:
    a, b = im.value(node.input[0]), im.value(node.input[1])
    alpha, beta, c = 1.0, 1.0, None
    if node.op_type == "Gemm":
        if _attr(node, "transA", 0):
            a = im.transpose(a, [1, 0])
        if _attr(node, "transB", 0):
            b = im.transpose(b, [1, 0])
        alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
        c = im.input(node, 2)
    return [contract(im, node.output[0], a, b, alpha=alpha, bias=c, beta=beta)]


@lowering("Einsum")
def _einsum(im: Importer, node) -> list[Value]:
    """An einsum is index notation already: one statement dimension per letter, the letters
    the output does not name summed, `bhqk = sum[d] Q[b, h, q, d] * K[b, h, k, d]`.  An
    ellipsis stands for the same trailing dimensions in every operand (broadcast where one has
    extent 1); without `->` the output is the ellipsis, then the letters used once, in
    alphabetical order.  A letter twice in one operand (a diagonal) is refused."""
    equation = str(_attr(node, "equation", "")).replace(" ", "")
    values = [im.value(n) for n in node.input]
    given, arrow, result = equation.partition("->")
    terms = given.split(",")
    if len(terms) != len(values) or not all(re.fullmatch(r"[A-Za-z]*(\.\.\.)?[A-Za-z]*", t)
                                             for t in [*terms, result]):
        raise im.error(f"equation '{equation}' does not fit {len(values)} operand(s)")
    spread = max((len(v.shape) - len(t) + 3 for t, v in zip(terms, values) if "..." in t),
                 default=0)

    def letters(term: str, rank: int | None) -> list[str]:
        """The term's letters, its ellipsis as one name per dimension it stands for
        (right-aligned: `.0` is the last)."""
        before, dots, after = term.partition("...")
        n = (rank - len(before) - len(after)) if rank is not None else spread
        if dots and n < 0 or not dots and rank is not None and len(term) != rank:
            raise im.error(f"'{term}' in equation '{equation}' does not fit an operand of "
                           f"{rank} dimension(s)")
        return [*before, *(f".{i}" for i in reversed(range(n if dots else 0))), *after]

    named = [letters(t, len(v.shape)) for t, v in zip(terms, values)]
    extents: dict[str, int] = {}
    for term, v in zip(named, values):
        if len(set(term)) != len(term):
            raise im.error(f"equation '{equation}' repeats a letter in one operand (a "
                           f"diagonal): not supported")
        for name, n in zip(term, v.shape):
            if extents.get(name, 1) not in (1, n) and n != 1:
                raise im.error(f"equation '{equation}': '{name}' has extents "
                               f"{extents[name]} and {n}")
            extents[name] = max(extents.get(name, 1), n)
    if arrow:
        out = letters(result, None)
        if len(set(out)) != len(out) or any(name not in extents for name in out):
            raise im.error(f"equation '{equation}': its output names a letter twice or one "
                           f"no operand has")
    else:
        used = [name for term in named for name in term]
        out = sorted({n for n in used if n.startswith(".")}, key=lambda n: -int(n[1:])) + \
            sorted(n for n in set(used) if not n.startswith(".") and used.count(n) == 1)
    order = out + [n for n in extents if n not in out]
    dims = [extents[n] for n in order]
    operands: list[Operand] = [
        (v, [order.index(name) if n == extents[name] else None
             for name, n in zip(term, v.shape)]) for term, v in zip(named, values)]
    summed = [order.index(n) for n in order if n not in out]

    def expr(refs: list[str], ix: _Index) -> str:
        return reduce_expr("sum", ix.axes(summed), " * ".join(refs))
    return [im.statement(node.output[0], dims, range(len(out)), operands, expr)]


def contract(im: Importer, hint: str, a: Value, b: Value, alpha: float = 1.0,
             bias: Value | None = None, beta: float = 1.0,
             epilogue: Callable[[str], str] | None = None) -> Value:
    """numpy's `matmul(a, b)` (batch dimensions broadcast), times alpha, plus beta * bias."""
    a_vec, b_vec = len(a.shape) == 1, len(b.shape) == 1
    ash = (1,) + a.shape if a_vec else a.shape
    bsh = b.shape + (1,) if b_vec else b.shape
    if ash[-1] != bsh[-2]:
        im_err = f"MatMul of {list(a.shape)} and {list(b.shape)}: inner extents differ"
        raise im.error(im_err)
    batch = im.broadcast([ash[:-2], bsh[:-2]])
    nb = len(batch)
    m, n, k = nb, nb + 1, nb + 2
    dims = [*batch, ash[-2], bsh[-1], ash[-1]]

    def batch_map(shape: tuple[int, ...]) -> list[int | None]:
        lead = nb - (len(shape) - 2)
        return [lead + j if shape[j] == batch[lead + j] else None for j in range(len(shape) - 2)]
    wa = batch_map(ash) + [m, k]
    wb = batch_map(bsh) + [k, n]
    operands: list[Operand] = [(a, wa[1:] if a_vec else wa), (b, wb[:-1] if b_vec else wb)]
    out = [*range(nb), *([] if a_vec else [m]), *([] if b_vec else [n])]
    if bias is not None:
        oshape = tuple(dims[d] for d in out)
        operands.append((bias, [out[len(out) - len(bias.shape) + j]
                                if bias.shape[j] == oshape[len(out) - len(bias.shape) + j]
                                else None for j in range(len(bias.shape))]))

    def expr(refs: list[str], ix: _Index) -> str:
        body = reduce_expr("sum", ix.axes([k]), f"{refs[0]} * {refs[1]}")
        if alpha != 1:
            body = f"{_number(alpha)} * {body}"
        if bias is not None:
            body = f"{body} + {refs[2]}" if beta == 1 else f"{body} + {_number(beta)} * {refs[2]}"
        return epilogue(body) if epilogue else body
    return im.statement(hint, dims, out, operands, expr)


def import_onnx(path: str | Path, dims: dict[str, tuple[int, int | None]] | None = None
                ) -> Imported:
    """Read an ONNX model and lower it to a `.bbp` program (see the module docstring)."""
    try:
        import onnx
    except ImportError:
        raise UsageError("importing ONNX needs the onnx package: pip install 'bbrules[onnx]'") \
            from None
    try:
        model = onnx.load(str(path))
    except Exception as err:  # protobuf's DecodeError and friends: not a model
        raise UsageError(f"{path}: not an ONNX model ({type(err).__name__}: {err})") from None
    return Importer(model, str(path), dims or {}).run()
