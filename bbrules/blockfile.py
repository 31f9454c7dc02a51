"""Block-program files (.bbk): read back exactly what `bbrules.ir.show_program` writes.

A fused program is worth keeping: `bbrules apply -o out.bbk` writes one, and `show`, `cost` and
`run` read it back without fusing again.  The file is self-contained: its dims, tensors, the
monoids its reductions use, and one `kernel` block per kernel (its grid and its stores).  An
optional `source "x.bbp"` line records the program it was fused from (relative to the .bbk
file), followed by that program's text (`| ` lines), so the CLI can compare the two wherever the
file is copied.  Everything read
is validated; a mistake is a `SourceError` at its position.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from lark import v_args

from .errors import SourceError, Span, read_source
from .exprsyntax import (Expr, ExprTransformer, MonoidDecl, Name, Num, Resolver, Scope, Size,
                         parse, resolve_monoid)
from .ir import (BUILTIN_MONOIDS, DTYPE_BYTES, BlockProgram, Dim, DimError, IRError, Kernel,
                 Monoid, Store, TensorDecl, check_view, checked_dim, validate)


@dataclass(frozen=True)
class BlockFile:
    """A parsed block-program file: the program, and the source it records, if any: its path
    (`source`), where the path is written (`source_span`), and its text as embedded
    (`source_text`, None in files written without it; its first line is line
    `source_span.line + 1` of the block file, each line shifted by the 2 columns of "| ")."""

    program: BlockProgram
    source: str | None
    source_span: Span | None = None
    source_text: str | None = None


# Declarations as parsed, before resolution ---------------------------------------------------


@dataclass(frozen=True)
class _Source:
    path: str
    span: Span
    text: str | None


@dataclass(frozen=True)
class _Tensor:
    role: str
    name: Name
    axes: tuple[Name, ...]
    dtype: Name
    span: Span
    base: Name | None = None  # a view's base tensor


@dataclass(frozen=True)
class _Let:
    name: Name
    value: Expr


@dataclass(frozen=True)
class _Store:
    target: Name
    axes: tuple[Name, ...]
    value: Expr


@dataclass(frozen=True)
class _Block:
    axis: Name
    size: Num


@dataclass(frozen=True)
class _Kernel:
    name: Name | None  # the store named in a one-store header (`kernel Y[r, c]:`)
    grid: tuple[Name, ...]
    blocks: tuple[_Block, ...]
    lets: tuple[_Let, ...]
    stores: tuple[_Store, ...]
    span: Span


class _BlockTransformer(ExprTransformer):
    """One method per rule of bbk.lark."""

    def start(self, children: list) -> list:
        return children

    def source(self, children: list) -> _Source:
        string, *lines = children
        try:
            path = json.loads(string)
        except json.JSONDecodeError as e:
            raise SourceError(Span(self.path, string.line, string.column + e.pos),
                              f"bad string: {e.msg}") from None
        text = "".join(f"{line[2:] if line.startswith('| ') else line[1:]}\n"
                       for line in lines) if lines else None
        return _Source(path, self.span(string), text)

    def dim(self, children: list) -> Size:
        return children[0]

    def tensor(self, children: list) -> _Tensor:
        role, name, axes, dtype = children
        return _Tensor(str(role), self._name(name), axes,
                       self._name(dtype), self.span(role))

    @v_args(meta=True)
    def view(self, meta, children: list) -> _Tensor:
        name, axes, dtype, base = children
        return _Tensor("view", self._name(name), axes, self._name(dtype), self.span(meta),
                       self._name(base))

    def let(self, children: list) -> _Let:
        name, value = children
        return _Let(self._name(name), value)

    def store(self, children: list) -> _Store:
        target, axes, value = children
        return _Store(self._name(target), axes, value)

    def block(self, children: list) -> _Block:
        axis, size = children
        return _Block(self._name(axis), self._num(size))

    def blocking(self, children: list) -> tuple[_Block, ...]:
        return tuple(children)

    @v_args(meta=True)
    def kernel(self, meta, children: list) -> _Kernel:
        name = self._name(children.pop(0)) if not isinstance(children[0], tuple) else None
        grid, *rest = children
        blocks = next((c for c in rest if isinstance(c, tuple)), ())
        lets = tuple(c for c in rest if isinstance(c, _Let))
        stores = tuple(c for c in rest if isinstance(c, _Store))
        return _Kernel(name, grid, blocks, lets, stores, name.span if name else self.span(meta))


# Resolution ------------------------------------------------------------------------------------


class _Builder:
    """Turns the parsed declarations of one file into a validated `BlockProgram`."""

    def __init__(self, text: str, path: str):
        self.text = text
        self.path = path
        self.dims: dict[str, Dim] = {}
        self.tensors: dict[str, TensorDecl] = {}
        self.tensor_spans: dict[str, Span] = {}
        self.monoids: dict[str, Monoid] = {}

    def error(self, span: Span, message: str) -> SourceError:
        return SourceError(span, message, self.text)

    def build(self, decls: list) -> BlockFile:
        for d in decls:
            if isinstance(d, Size):
                self.dim(d)
        for d in decls:
            if isinstance(d, _Tensor):
                self.tensor(d)
        for d in decls:
            if isinstance(d, MonoidDecl):
                self.monoid(d)
        kernels = [d for d in decls if isinstance(d, _Kernel)]
        built = tuple(self.kernel(k) for k in kernels)
        outputs = tuple(t.name for t in self.tensors.values() if t.role == "output")
        if not outputs:
            lines = self.text.rstrip().split("\n")
            raise self.error(Span(self.path, len(lines), len(lines[-1]) + 1),
                             "the block program declares no outputs (`output Y[axes] : f32` "
                             "and a kernel storing Y)")
        program = BlockProgram(self.dims, self.tensors, built, outputs)
        self.validate(program, kernels)
        if decls and isinstance(decls[0], _Source):
            return BlockFile(program, decls[0].path, decls[0].span, decls[0].text)
        return BlockFile(program, None)

    def dim(self, d: Size) -> None:
        name = d.name.name
        if name in self.dims:
            raise self.error(d.name.span, f"dimension '{name}' is declared twice")
        self.dims[name] = d.dim(self.text, of=f"'{name}'")

    def tensor(self, t: _Tensor) -> None:
        name = t.name.name
        if name in self.tensors:
            raise self.error(t.name.span, f"tensor '{name}' is declared twice")
        for i, a in enumerate(t.axes):
            if a.name not in self.dims:
                raise self.error(a.span, f"unknown axis '{a.name}' (not declared with dim)")
            if a.name in (b.name for b in t.axes[:i]):
                raise self.error(a.span, f"axis '{a.name}' appears twice in '{name}'")
        if t.dtype.name not in DTYPE_BYTES:
            raise self.error(t.dtype.span, f"unknown dtype '{t.dtype.name}' "
                                           f"(known: {', '.join(DTYPE_BYTES)})")
        decl = TensorDecl(name, tuple(a.name for a in t.axes), t.dtype.name, t.role,
                          t.base.name if t.base else "")
        if t.base is not None:
            try:
                check_view(self.dims, self.tensors, decl)
            except IRError as e:
                raise self.error(t.base.span, str(e)) from None
        self.tensors[name] = decl
        self.tensor_spans[name] = t.span

    def monoid(self, d: MonoidDecl) -> None:
        name = d.name.name
        if name in self.monoids:
            raise self.error(d.name.span, f"monoid '{name}' is declared twice")
        if name in BUILTIN_MONOIDS:
            raise self.error(d.name.span, f"'{name}' is a built-in monoid")
        self.monoids[name] = resolve_monoid(d, self.text)

    def kernel(self, k: _Kernel) -> Kernel:
        if k.name is not None:
            header = (k.name.name, [a.name for a in k.grid])
            (first, *more) = k.stores
            if more or (first.target.name, [a.name for a in first.axes]) != header:
                raise self.error(first.target.span,
                                 f"kernel {k.name.name}[{_axes(k.grid)}] must store exactly "
                                 f"{k.name.name}[{_axes(k.grid)}] (a kernel of several stores "
                                 f"names only its grid: `kernel [{_axes(k.grid)}]:`)")
        for a in k.grid + tuple(b.axis for b in k.blocks):
            if a.name not in self.dims:
                raise self.error(a.span, f"unknown axis '{a.name}' (not declared with dim)")
        blocks = []
        for b in k.blocks:
            try:
                checked_dim(b.axis.name, self.dims[b.axis.name].extent, b.size.value)
            except DimError as e:
                raise self.error(b.size.span, str(e)) from None
            blocks.append((b.axis.name, int(b.size.value)))
        scope = Scope(self.text, monoids={**BUILTIN_MONOIDS, **self.monoids},
                      dims=frozenset(self.dims), tensors=self.tensors)
        resolver = Resolver(scope)
        for let in k.lets:
            if let.name.name in scope.locals:
                raise self.error(let.name.span, f"'{let.name.name}' is already bound")
            scope.locals[let.name.name] = resolver.value(let.value)
        return Kernel(tuple(a.name for a in k.grid),
                      tuple(Store(s.target.name, tuple(a.name for a in s.axes),
                                  resolver.value(s.value)) for s in k.stores), tuple(blocks))

    def validate(self, program: BlockProgram, kernels: list[_Kernel]) -> None:
        """`ir.validate`, kernel by kernel, so an error points at the kernel that causes it."""
        for i, k in enumerate(kernels):
            try:
                validate(replace(program, kernels=program.kernels[:i + 1], outputs=()))
            except IRError as e:
                raise self.error(k.span, str(e)) from None
        stored = {s.tensor for s in program.stores}
        for o in program.outputs:
            if o not in stored:
                raise self.error(self.tensor_spans[o], f"output '{o}' is never stored")


def _axes(axes: tuple[Name, ...]) -> str:
    return ", ".join(a.name for a in axes)


def parse_block_program(text: str, path: str = "<string>") -> BlockFile:
    """Parse and validate a block program written in the syntax of `ir.show_program`."""
    decls = parse("bbk.lark", text, path, _BlockTransformer(path))
    return _Builder(text, path).build(decls)


def load_block_program(path: str | Path) -> BlockFile:
    """Read a `.bbk` file (see `parse_block_program`)."""
    return parse_block_program(read_source(path), str(path))
