"""The `.bbp` frontend: text -> checked `Program`.

Two passes.  Lark (LALR, grammar `grammar/bbp.lark`) parses the text and `_ToAst` turns the
tree into declarations and `bbrules.program` expressions, each carrying its `Span`.  `_Checker`
then walks the declarations in file order, resolving names against what is declared so far,
so that every mistake is reported at the first place it can be seen, as a `SourceError` with
the line and column of the offending token.

Dimension overrides (`--dim q=256/64` on the command line) replace a declared extent and block
before any check runs, so a program can be evaluated at small sizes without editing it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Union

import numpy as np
from lark import Lark, Token, v_args
from lark.tree import Meta
from lark.exceptions import UnexpectedInput, VisitError
from lark.visitors import Transformer_NonRecursive

from .errors import SourceError, Span, UsageError, read_source, syntax_error
from .ir import DTYPE_BYTES, WHOLE_DTYPES, AxisSet, Dim, DimError, TensorDecl, checked_dim
from .ops import ELEMENTWISE, PREDICATES, UNARY
from .program import Apply, Expr, Number, Position, Program, Reduction, Ref, Statement, fold

DimOverrides = dict[str, tuple[int, int | None]]

# Functions callable by name, with their arity.  Infix arithmetic (`add`, `sub`, ...) is not
# callable: it has its own syntax.
FUNCTIONS: dict[str, int] = {**{name: 1 for name in UNARY if name != "not"}, "max": 2,
                             "min": 2, "pow": 2, "where": 3}
REDUCTIONS = ("sum", "max", "min", "mean")
# A comparison's operator name by its spelling.
COMPARISONS: dict[str, str] = {c: name for name, c in PREDICATES.items()}


@cache
def _parser() -> Lark:
    grammar = files("bbrules.grammar").joinpath("bbp.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True)


# --------------------------------------------------------------------------------------------
# Syntax: declarations as written, before names are resolved.


@dataclass(frozen=True)
class _Name:
    """An identifier with its position."""

    name: str
    span: Span


@dataclass(frozen=True)
class _DimDecl:
    name: _Name
    extent: float
    block: float | None  # None: declared without a block size, the whole extent is one block
    extent_span: Span
    block_span: Span


@dataclass(frozen=True)
class _TensorSyntax:
    name: _Name
    axes: tuple[_Name, ...]


@dataclass(frozen=True)
class _InputDecl:
    tensors: tuple[_TensorSyntax, ...]
    dtype: _Name


@dataclass(frozen=True)
class _OutputDecl:
    names: tuple[_Name, ...]
    dtype: _Name | None  # None: the inputs' dtype


@dataclass(frozen=True)
class _Shifted:
    """`i + 32` in a reference: the dimension read at positions offset from axis i's."""

    axis: _Name
    offset: float
    offset_span: Span


@dataclass(frozen=True)
class _ViewRef:
    """A reference that reads some dimensions of its tensor as several (`X[t, (h, d)]`) or
    as a slice (`X[t, i + 32]`), until the checker resolves it into a `Ref` of a view tensor
    (and, for a slice, a one-hot sum choosing the slice's chunk of it)."""

    name: _Name
    axes: tuple[_Name | tuple[_Name, ...] | _Shifted, ...]


@dataclass(frozen=True)
class _ConstDecl:
    name: _Name
    value: Expr


_Item = Union[_DimDecl, _InputDecl, _ConstDecl, _OutputDecl, Statement]


@v_args(meta=True)
class _ToAst(Transformer_NonRecursive):
    """One method per grammar rule: parse tree -> declarations and program expressions."""

    def __init__(self, path: str, text: str):
        super().__init__()
        self.path = path
        self.text = text

    def _span(self, where: Token | Meta) -> Span:
        return Span(self.path, where.line, where.column)

    def _name(self, tok: Token) -> _Name:
        return _Name(str(tok), self._span(tok))

    def start(self, meta: Meta, items: list[_Item]) -> list[_Item]:
        return items

    def dim_decl(self, meta: Meta, children: list[Token]) -> _DimDecl:
        name, extent, *block = children
        return _DimDecl(self._name(name), float(extent), float(block[0]) if block else None,
                        self._span(extent), self._span(block[0] if block else extent))

    def input_decl(self, meta: Meta, children: list) -> _InputDecl:
        *tensors, dtype = children
        return _InputDecl(tuple(tensors), self._name(dtype))

    def tensor_decl(self, meta: Meta, children: list) -> _TensorSyntax:
        name, axes = children
        return _TensorSyntax(self._name(name), axes or ())

    def const_decl(self, meta: Meta, children: list) -> _ConstDecl:
        name, value = children
        return _ConstDecl(self._name(name), value)

    def output_decl(self, meta: Meta, children: list) -> _OutputDecl:
        *names, dtype = children
        return _OutputDecl(tuple(self._name(n) for n in names),
                           None if dtype is None else self._name(dtype))

    def statement(self, meta: Meta, children: list) -> Statement:
        name, axes, expr = children
        axes = axes or ()
        return Statement(str(name), tuple(a.name for a in axes), expr, self._span(name),
                         tuple(a.span for a in axes))

    def axes(self, meta: Meta, names: list[Token]) -> tuple[_Name, ...]:
        return tuple(self._name(n) for n in names)

    def _apply(self, op: str, meta: Meta, args: list[Expr]) -> Apply:
        return Apply(op, tuple(args), self._span(meta))

    def add(self, meta: Meta, args: list[Expr]) -> Apply:
        return self._apply("add", meta, args)

    def sub(self, meta: Meta, args: list[Expr]) -> Apply:
        return self._apply("sub", meta, args)

    def mul(self, meta: Meta, args: list[Expr]) -> Apply:
        return self._apply("mul", meta, args)

    def div(self, meta: Meta, args: list[Expr]) -> Apply:
        return self._apply("div", meta, args)

    def neg(self, meta: Meta, args: list[Expr]) -> Apply:
        return self._apply("neg", meta, args)

    def or_(self, meta: Meta, args: list[Expr]) -> Apply:
        return self._apply("or", meta, args)

    def and_(self, meta: Meta, args: list[Expr]) -> Apply:
        return self._apply("and", meta, args)

    def not_(self, meta: Meta, args: list[Expr]) -> Apply:
        return self._apply("not", meta, args)

    def compare(self, meta: Meta, children: list) -> Apply:
        x, op, y = children
        return self._apply(COMPARISONS[str(op)], meta, [x, y])

    def number(self, meta: Meta, children: list[Token]) -> Number:
        return Number(float(children[0]), self._span(meta))

    def position(self, meta: Meta, children: list[Token]) -> Position:
        return Position(str(children[0]), self._span(children[0]))

    def pow(self, meta: Meta, args: list[Expr]) -> Apply:
        return self._apply("pow", meta, args)

    def ref_axes(self, meta: Meta, items: list) -> tuple[_Name | tuple[_Name, ...], ...]:
        return tuple(self._name(a) if isinstance(a, Token) else a for a in items)

    def group(self, meta: Meta, names: list[Token]) -> tuple[_Name, ...]:
        return tuple(self._name(n) for n in names)

    def shifted(self, meta: Meta, children: list[Token]) -> _Shifted:
        name, offset = children
        return _Shifted(self._name(name), float(offset), self._span(offset))

    def ref(self, meta: Meta, children: list) -> Ref | _ViewRef:
        name, axes = children
        axes = axes or ()
        if any(isinstance(a, (tuple, _Shifted)) for a in axes):
            return _ViewRef(self._name(name), axes)
        return Ref(str(name), tuple(a.name for a in axes), self._span(name),
                   tuple(a.span for a in axes))

    def call(self, meta: Meta, children: list) -> Apply:
        name, *args = children
        fn = str(name)
        if fn == "concat":
            return self.concat(name, args)
        if fn not in FUNCTIONS:
            hint = f" (reduce with {fn}[axis] ...)" if fn == "sum" else ""
            raise SourceError(self._span(name), f"unknown function '{fn}'{hint}; known: "
                              f"{', '.join(sorted([*FUNCTIONS, 'concat']))}", self.text)
        want = FUNCTIONS[fn]
        if len(args) != want:
            plural = "s" if want > 1 else ""
            raise SourceError(self._span(name), f"function '{fn}' takes {want} argument{plural},"
                              f" got {len(args)}", self.text)
        return self._apply(fn, meta, args)

    def concat(self, name: Token, args: list[Expr]) -> Apply:
        """`concat(e, X1, X2, ...)` stays an `Apply` until the checker, which knows the
        extents, writes it as one-hot sums (`_Checker.concat`)."""
        if len(args) < 3 or not isinstance(args[0], Position):
            raise SourceError(self._span(name), "concat joins two or more pieces along an axis "
                              "of the result, each read along an axis of its own: "
                              "concat(e, A[t, a], B[t, b])", self.text)
        return Apply("concat", tuple(args), self._span(name))

    def reduction(self, meta: Meta, children: list) -> Reduction:
        """`sum[c, p] x` is `sum[c] sum[p] x`."""
        op, axes, body = children
        for a in reversed(axes):
            body = Reduction(str(op), a.name, body, self._span(op), a.span)
        return body


# --------------------------------------------------------------------------------------------
# Syntax errors


_TOKEN_WORDS = {"NAME": "a name", "NUMBER": "a number", "COMPARE": "a comparison",
                "_NL": "end of line", "$END": "end of file"}


# --------------------------------------------------------------------------------------------
# Names, axes and roles


class _Checker:
    """Resolves declarations in file order and builds the `Program`."""

    def __init__(self, path: str, text: str, overrides: DimOverrides):
        self.path = path
        self.text = text
        self.overrides = overrides
        self.dims: dict[str, Dim] = {}
        self.inputs: dict[str, TensorDecl] = {}
        self.defined: dict[str, Span] = {}
        self.axes_of: dict[str, tuple[str, ...]] = {}
        self.statements: list[Statement] = []
        self.outputs: dict[str, Span] = {}
        self.output_dtypes: dict[str, str] = {}
        self.constants: dict[str, float] = {}
        self.views: dict[str, str] = {}  # view tensor -> the tensor it reads
        self.targets: dict[str, Span] = {}

    def error(self, span: Span, message: str) -> SourceError:
        return SourceError(span, message, self.text)

    def run(self, items: list[_Item]) -> Program:
        for item in items:
            if isinstance(item, Statement):
                self.targets.setdefault(item.target, item.span)
        for item in items:
            match item:
                case _DimDecl():
                    self.dim(item)
                case _InputDecl():
                    self.input(item)
                case _ConstDecl():
                    self.constant(item)
                case Statement():
                    self.statement(item)
                case _OutputDecl():
                    self.output(item)
        unknown = sorted(set(self.overrides) - set(self.dims))
        if unknown:
            raise UsageError(f"dimension override for '{unknown[0]}': {self.path} declares no "
                             f"dimension '{unknown[0]}' (it has {', '.join(self.dims) or 'none'})")
        return self.program()

    def program(self) -> Program:
        if not self.outputs:
            raise self.error(Span(self.path, 1, 1), "the program declares no outputs "
                             "(add a line `output NAME`)")
        for name, span in self.outputs.items():
            if name in self.inputs:
                raise self.error(span, f"input '{name}' cannot be an output; outputs are "
                                 f"computed by statements")
            if name not in self.defined:
                raise self.error(span, f"output '{name}' is never defined")
        # outputs are stored as the first input of real numbers is, unless declared otherwise
        out_dtype = next((t.dtype for t in self.inputs.values() if t.dtype not in WHOLE_DTYPES),
                         "f32")
        tensors = dict(self.inputs)
        for s in self.statements:
            role = "output" if s.target in self.outputs else "temp"
            dtype = self.output_dtypes.get(s.target, out_dtype) if role == "output" else "f32"
            tensors[s.target] = TensorDecl(s.target, s.axes, dtype, role)
        for name, base in self.views.items():
            tensors[name] = TensorDecl(name, self.axes_of[name], tensors[base].dtype, "view",
                                       base)
        return Program(self.path, dict(self.dims), tensors, tuple(self.statements),
                       tuple(self.outputs), self.text)

    # declarations ---------------------------------------------------------------------------

    def dim(self, d: _DimDecl) -> None:
        """The declared sizes are checked even where an override replaces them; a problem with
        the overridden sizes is reported at the dimension's name."""
        name = d.name.name
        if name in self.dims:
            raise self.error(d.name.span, f"dimension '{name}' is already declared")
        try:
            dim = checked_dim(name, d.extent, d.block)
        except DimError as e:
            raise self.error(d.extent_span if e.part == "extent" else d.block_span,
                             str(e)) from None
        if name in self.overrides:
            extent, block = self.overrides[name]
            block = dim.block if block is None and d.block is not None else block
            try:
                dim = checked_dim(name, extent, block,
                                  of=f"dimension '{name}' (as overridden)")
            except DimError as e:
                raise self.error(d.name.span, str(e)) from None
        self.dims[name] = dim

    def axes(self, names: tuple[_Name, ...]) -> None:
        """Each axis of a declaration or target is a declared dimension, used once."""
        seen: set[str] = set()
        for a in names:
            if a.name not in self.dims:
                raise self.error(a.span, f"unknown axis '{a.name}' (declare it with "
                                 f"`dim {a.name} = EXTENT / BLOCK`)")
            if a.name in seen:
                raise self.error(a.span, f"axis '{a.name}' appears twice")
            seen.add(a.name)

    def new_tensor(self, name: _Name) -> None:
        if name.name in self.defined:
            where = self.defined[name.name]
            raise self.error(name.span, f"'{name.name}' is already defined (line {where.line})")

    def input(self, decl: _InputDecl) -> None:
        dtype = self.dtype(decl.dtype)
        for t in decl.tensors:
            self.new_tensor(t.name)
            self.axes(t.axes)
            axes = tuple(a.name for a in t.axes)
            self.inputs[t.name.name] = TensorDecl(t.name.name, axes, dtype, "input")
            self.defined[t.name.name] = t.name.span
            self.axes_of[t.name.name] = axes

    def dtype(self, name: _Name) -> str:
        if name.name not in DTYPE_BYTES:
            raise self.error(name.span, f"unknown dtype '{name.name}' (expected one of "
                             f"{', '.join(sorted(DTYPE_BYTES))})")
        return name.name

    def output(self, decl: _OutputDecl) -> None:
        dtype = None if decl.dtype is None else self.dtype(decl.dtype)
        if dtype in WHOLE_DTYPES:
            raise self.error(decl.dtype.span, f"outputs cannot be {dtype}: values are computed "
                             f"in f32, and only inputs may declare whole numbers")
        for n in decl.names:
            if n.name in self.outputs:
                raise self.error(n.span, f"'{n.name}' is already listed as an output")
            self.outputs[n.name] = n.span
            if dtype is not None:
                self.output_dtypes[n.name] = dtype

    def constant(self, decl: _ConstDecl) -> None:
        """`scale = 1 / 8`: a number, or arithmetic on numbers and earlier constants."""
        name = decl.name
        if name.name in self.dims:
            raise self.error(name.span, f"'{name.name}' is already a dimension")
        if name.name in self.constants:
            raise self.error(name.span, f"constant '{name.name}' is already defined")
        self.new_tensor(name)
        value = self.desugared(decl.value)

        def number(e: Expr, parts: list[float]) -> float:
            match e:
                case Number(v):
                    return v
                case Apply(op, _) if op in ELEMENTWISE and op != "where":
                    with np.errstate(all="ignore"):
                        return float(ELEMENTWISE[op].numpy(*map(np.float64, parts)))
            raise self.error(e.span, f"the value of constant '{name.name}' must be "
                             f"numbers and earlier constants, not a tensor, an axis or a "
                             f"reduction")

        self.constants[name.name] = fold(value, number)
        self.defined[name.name] = name.span

    def view(self, r: _ViewRef) -> Expr:
        """`X[t, (h, d)]` as a reference to the view of X whose dimensions are (t, h, d): a
        grouped dimension's extent must be the product of its group's.  A slice `X[t, i + c]`
        reads X's dimension d as chunks of i's extent, `(d__i, i)`, and picks chunk c / n(i)
        with a one-hot sum over them, `sum[d__i] where(d__i == c / n(i), X[t, (d__i, i)], 0)`:
        the chunk axis has blocks of one chunk, so block skipping reads only the slice."""
        declared = self.axes_of.get(r.name.name)
        if declared is None:
            raise self.unknown_tensor(r.name.name, r.name.span)
        if len(r.axes) != len(declared):
            raise self.error(r.name.span, f"'{r.name.name}' has {len(declared)} axes "
                             f"({r.name.name}[{', '.join(declared)}]), this reference gives "
                             f"{len(r.axes)}")
        flat: list[_Name] = []
        picks: list[tuple[_Name, int]] = []  # chunk axes and the chunk each slice reads
        for dim, used in zip(declared, r.axes):
            if isinstance(used, _Shifted):
                chunks, chunk = self.slice_chunks(r.name.name, dim, used)
                picks.append((chunks, chunk))
                used = (chunks, used.axis)
            group = used if isinstance(used, tuple) else (used,)
            self.axes(group)
            extents = [self.dims[a.name].extent for a in group]
            if math.prod(extents) != self.dims[dim].extent:
                shown = " x ".join(f"{a.name} ({n})" for a, n in zip(group, extents))
                raise self.error(group[0].span, f"{shown} is {math.prod(extents)} elements, "
                                 f"'{dim}' of '{r.name.name}' has {self.dims[dim].extent}")
            if len(group) > 1 and any(self.dims[a].ragged for a in (dim, *(g.name for g in group))):
                raise self.error(group[0].span, f"a view of the ragged axis '{dim}' (its last "
                                 f"block is partial)")
            flat += group
        # a ragged axis is laid out padded, so a view's elements would not be its base's
        ragged = next((a for a in (*declared, *(f.name for f in flat)) if self.dims[a].ragged),
                      None)
        if ragged is not None:
            raise self.error(r.name.span, f"a view of '{r.name.name}', whose axis '{ragged}' "
                             f"is ragged (its last block is partial): give '{ragged}' a block "
                             f"that divides its extent")
        axes = tuple(a.name for a in flat)
        self.axes(tuple(flat))
        name = f"{r.name.name}__{'_'.join(axes)}"
        self.views[name] = r.name.name
        self.axes_of[name] = axes
        out: Expr = Ref(name, axes, r.name.span, tuple(a.span for a in flat))
        for chunks, chunk in picks:
            span = chunks.span
            hit = Apply("eq", (Position(chunks.name, span), Number(chunk, span)), span)
            out = Reduction("sum", chunks.name, Apply("where", (hit, out, Number(0.0, span)),
                                                      span), span, span)
        return out

    def slice_chunks(self, tensor: str, dim: str, s: _Shifted) -> tuple[_Name, int]:
        """The chunk axis of slice `s` of `tensor`'s dimension `dim` (declared on first use:
        extent(dim) / extent(axis) chunks, one per block) and the chunk the slice reads."""
        self.axes((s.axis,))
        n, total = self.dims[s.axis.name].extent, self.dims[dim].extent
        offset = s.offset
        if self.dims[dim].ragged or self.dims[s.axis.name].ragged:
            raise self.error(s.offset_span, f"a slice of the ragged axis "
                             f"'{dim if self.dims[dim].ragged else s.axis.name}'")
        if not offset.is_integer() or offset % n or total % n:
            raise self.error(s.offset_span, f"the slice {s.axis.name} + {offset:g} of '{dim}' "
                             f"of '{tensor}' ({total}) must start at a multiple of "
                             f"{s.axis.name}'s extent {n}, which must divide {total}: a slice "
                             f"reads whole chunks of the dimension")
        if offset + n > total:
            raise self.error(s.offset_span, f"the slice {s.axis.name} + {offset:g} of '{dim}' "
                             f"of '{tensor}' runs past its extent {total}")
        name = f"{dim}__{s.axis.name}"
        chunks = checked_dim(name, total // n, 1)
        if self.dims.setdefault(name, chunks) != chunks:
            raise self.error(s.offset_span, f"'{name}' is a dimension of the program, and the "
                             f"name of this slice's chunks")
        return _Name(name, s.axis.span), int(offset) // n

    def desugared(self, e: Expr, target: tuple[str, ...] = ()) -> Expr:
        """`e` (a statement's value, of axes `target`) with named constants replaced by their
        values, each `mean[a] x` by `sum[a] x * (1 / extent of a)`, each grouped reference by
        one of a view, and each concatenation by one-hot sums (`concat`)."""
        context = {*target, *fold(e, lambda x, parts: frozenset().union(
            *parts, [x.axis] if isinstance(x, Reduction) else []))}

        def rewrite(x: Expr, parts: list[Expr]) -> Expr:
            match x:
                case _ViewRef():
                    return self.view(x)
                case Position(name, span) if name in self.constants:
                    return Number(self.constants[name], span)
                case Apply("concat", _, span):
                    return self.concat(parts, span, context)
                case Apply(op, _, span):
                    return Apply(op, tuple(parts), span)
                case Reduction("mean", axis, _, span, axis_span) if axis in self.dims:
                    total = Reduction("sum", axis, parts[0], span, axis_span)
                    return Apply("mul", (total, Number(1 / self.dims[axis].extent, span)), span)
                case Reduction(op, axis, _, span, axis_span):
                    return Reduction(op, axis, parts[0], span, axis_span)
            return x
        return fold(e, rewrite)

    def concat(self, parts: list[Expr], span: Span, context: set[str]) -> Expr:
        """`concat(e, X1, X2, ...)` as a sum of one-hot selections: piece i, read along an
        axis of its own a_i, fills the positions of e after the earlier pieces',
        `sum[a_i] where(a_i == e - offset_i, X_i, 0)`.  A piece's own axis is its one axis that
        is neither the statement's target's, nor reduced in the statement, nor e.  Block
        skipping visits, for each block of e, only the blocks of the pieces that fill it."""
        axis, *pieces = parts
        e = _Name(axis.axis, axis.span)
        self.axes((e,))
        if self.dims[e.name].ragged:
            raise self.error(e.span, f"a concatenation along the ragged axis '{e.name}' (its "
                             f"last block is partial)")
        terms, extents = [], []
        for k, piece in enumerate(pieces, 1):
            own = [(a, sp) for a, sp in _free_occurrences(piece)
                   if a not in context and a != e.name]
            names = list(dict.fromkeys(a for a, _ in own))
            if len(names) != 1:
                why = (f"has {len(names)} axes that are neither the target's nor reduced "
                       f"({', '.join(names)}), so which one lies along '{e.name}' is ambiguous"
                       if names else f"has no axis of its own to lay along '{e.name}': read it "
                       f"along one, as in A[t, a] with `dim a = ...`")
                raise self.error(getattr(piece, "span", span), f"piece {k} of "
                                 f"concat({e.name}, ...) {why}")
            a = _Name(*own[0])
            self.axes((a,))
            if self.dims[a.name].ragged:
                raise self.error(a.span, f"a concatenation of the ragged axis '{a.name}' (its "
                                 f"last block is partial)")
            at, here = sum(extents), a.span
            start = Position(e.name, here)
            if at:
                start = Apply("sub", (start, Number(float(at), here)), here)
            hit = Apply("eq", (Position(a.name, here), start), here)
            terms.append(Reduction("sum", a.name, Apply("where", (hit, piece, Number(0.0, here)),
                                                        here), here, here))
            extents.append(self.dims[a.name].extent)
        if sum(extents) != self.dims[e.name].extent:
            raise self.error(span, f"the pieces of concat({e.name}, ...) are "
                             f"{' + '.join(map(str, extents))} = {sum(extents)} elements along "
                             f"'{e.name}', which has {self.dims[e.name].extent}")
        out = terms[0]
        for t in terms[1:]:
            out = Apply("add", (out, t), span)
        return out

    def statement(self, s: Statement) -> None:
        s = Statement(s.target, s.axes, self.desugared(s.expr, s.axes), s.span, s.axis_spans)
        target = _Name(s.target, s.span)
        if s.target in self.inputs:
            raise self.error(s.span, f"cannot assign to input '{s.target}'")
        self.new_tensor(target)
        self.axes(tuple(_Name(a, sp) for a, sp in zip(s.axes, s.axis_spans)))
        produced = self.expr(s.expr)
        extra = [a for a in _free_occurrences(s.expr) if a[0] not in s.axes]
        if extra:
            axis, span = extra[0]
            raise self.error(span, f"axis '{axis}' is neither reduced nor an axis of the "
                             f"target {s.target}[{', '.join(s.axes)}]")
        for a, span in zip(s.axes, s.axis_spans):
            if a not in produced:
                raise self.error(span, f"target axis '{a}' does not occur on the right-hand "
                                 f"side (broadcasting to a new axis is not supported)")
        self.defined[s.target] = s.span
        self.axes_of[s.target] = s.axes
        self.statements.append(s)

    # expressions ----------------------------------------------------------------------------

    def expr(self, e: Expr) -> AxisSet:
        """Check an expression, operands before the operator (the first mistake in source
        order is reported); return its free axes."""
        return fold(e, self.checked)

    def checked(self, e: Expr, parts: list[AxisSet]) -> AxisSet:
        match e:
            case Ref():
                self.ref(e)
                return frozenset(e.axes)
            case Position(axis):
                self.position(e)
                return frozenset((axis,))
            case Apply():
                return frozenset().union(*parts)
            case Reduction(op, axis):
                if axis not in self.dims:
                    raise self.error(e.axis_span, f"unknown axis '{axis}'")
                if axis not in parts[0]:
                    have = ", ".join(sorted(parts[0])) or "none"
                    raise self.error(e.axis_span, f"{op}[{axis}] reduces over an axis its "
                                     f"operand does not have (its axes: {have})")
                return parts[0] - {axis}
        return frozenset()

    def position(self, e: Position) -> None:
        if e.axis in self.dims:
            return
        if e.axis in self.axes_of:
            axes = ", ".join(self.axes_of[e.axis])
            raise self.error(e.span, f"tensor '{e.axis}' is used without its axes (write "
                             f"{e.axis}[{axes}])")
        raise self.error(e.span, f"unknown name '{e.axis}': neither a dimension (whose name "
                         f"as a value is the position along it) nor a tensor")

    def unknown_tensor(self, name: str, span: Span) -> SourceError:
        if name in self.targets:
            return self.error(span, f"'{name}' is used before it is defined "
                              f"(line {self.targets[name].line})")
        return self.error(span, f"unknown tensor '{name}'")

    def ref(self, r: Ref) -> None:
        declared_axes = self.axes_of.get(r.tensor)
        if declared_axes is None:
            raise self.unknown_tensor(r.tensor, r.span)
        if len(r.axes) != len(declared_axes):
            raise self.error(r.span, f"'{r.tensor}' has {len(declared_axes)} axes "
                             f"({r.tensor}[{', '.join(declared_axes)}]), this reference gives "
                             f"{len(r.axes)}")
        self.axes(tuple(_Name(a, sp) for a, sp in zip(r.axes, r.axis_spans)))
        for declared, used, span in zip(declared_axes, r.axes, r.axis_spans):
            a, b = self.dims[declared], self.dims[used]
            if (a.extent, a.block) != (b.extent, b.block):
                hint = f" (a slice of it is `{used} + OFFSET`)" if b.extent < a.extent else ""
                raise self.error(span, f"cannot rename axis '{declared}' of '{r.tensor}' "
                                 f"({a.extent}/{a.block}) to '{used}' ({b.extent}/{b.block}): "
                                 f"extent and block must match{hint}")


def _free_occurrences(e: Expr) -> list[tuple[str, Span]]:
    """Every axis use in `e` that no enclosing reduction binds, in source order."""
    out: list[tuple[str, Span]] = []
    stack: list[tuple[Expr, frozenset[str]]] = [(e, frozenset())]
    while stack:
        x, bound = stack.pop()
        match x:
            case Ref(_, axes, _, spans):
                out += [(a, sp) for a, sp in zip(axes, spans) if a not in bound]
            case Position(axis, span) if axis not in bound:
                out.append((axis, span))
            case Apply(_, args):
                stack += [(a, bound) for a in reversed(args)]
            case Reduction(_, axis, body):
                stack.append((body, bound | {axis}))
    return out


# --------------------------------------------------------------------------------------------
# Entry points


def parse_program(text: str, path: str = "<string>",
                  dims: DimOverrides | None = None) -> Program:
    """Parse and check a `.bbp` program.  `dims` overrides declared dimensions:
    name -> (extent, block), where block None keeps the declared blocking (see
    `parse_dim_override`)."""
    source = text if text.endswith("\n") else text + "\n"
    try:
        tree = _parser().parse(source)
    except UnexpectedInput as err:
        unknown = _unknown_reduction(err, source, path)
        if unknown is not None:
            raise unknown from None
        raise syntax_error(err, _parser(), source, path, _TOKEN_WORDS,
                           character="character {!r}") from None
    try:
        items = _ToAst(path, text).transform(tree)
    except VisitError as err:
        if isinstance(err.orig_exc, SourceError):
            raise err.orig_exc from None
        raise
    return _Checker(path, text, dims or {}).run(items)


_BRACKETED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\[[^\[\]\n]*\]\s*$")


def _unknown_reduction(err: UnexpectedInput, text: str, path: str) -> SourceError | None:
    """`softmax[k] X[q, k]`: an operand right after `name[axes]` is a reduction by a name
    that is not one; say so at the name rather than "unexpected 'X'"."""
    token = getattr(err, "token", None)
    if token is None or token.type not in ("NAME", "NUMBER", "LPAR", "INF"):
        return None
    m = _BRACKETED.search(text[:token.start_pos])
    line_start = text.rfind("\n", 0, token.start_pos) + 1
    if m is None or m.group(1) in REDUCTIONS or "=" not in text[line_start:m.start(1)]:
        return None  # not inside an expression (`Y[m] B[m]` lacks its `=`)
    line = text.count("\n", 0, m.start(1)) + 1
    column = m.start(1) - line_start + 1
    return SourceError(Span(path, line, column), f"unknown reduction '{m.group(1)}' (the "
                       f"reductions are {', '.join(REDUCTIONS)}), or an operator missing "
                       f"before {str(token)!r}", text)


def load_program(path: str | Path, dims: DimOverrides | None = None) -> Program:
    """Read and check a `.bbp` file."""
    return parse_program(read_source(path), str(path), dims)


_OVERRIDE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)\s*(?:/\s*(\d+)\s*)?")


def parse_dim_override(s: str) -> tuple[str, int, int | None]:
    """`q=256/64` -> ("q", 256, 64); `q=256` -> ("q", 256, None): keep the declared block
    (the program check then requires it to divide 256), or one block where the program
    declares one block (`dim d = 64`)."""
    m = _OVERRIDE.fullmatch(s)
    if m is None:
        raise UsageError(f"bad dimension override '{s}': expected NAME=EXTENT or "
                         f"NAME=EXTENT/BLOCK, e.g. q=256/64")
    name, extent = m.group(1), int(m.group(2))
    block = None if m.group(3) is None else int(m.group(3))
    try:
        checked_dim(name, extent, block)
    except DimError as e:
        raise UsageError(f"bad dimension override '{s}': {e}") from None
    return name, extent, block
