"""The block-expression syntax shared by block-program files (.bbk) and rule files (.bbr).

Parsing happens in two steps.  The lark grammar (`grammar/expr.lark`) and `ExprTransformer`
turn text into a small *syntax tree* (`Num`, `Name`, `PatVar`, `Call`, ...) that records where
each piece came from.  A `Resolver` then turns syntax into IR nodes or rule patterns, knowing
what the surrounding declaration allows: local `let` names in a kernel, `a.m`/`b.m` variables in
a monoid, `?x` variables and `const(...)` in a rule.  Keeping the grammar generic and the
meaning here is what lets every mistake be reported as "unknown function 'foo'" or "bsum takes 2
arguments" at its own position, instead of as an unexpected token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from importlib.resources import files
from typing import Mapping, Union

from lark import Lark, Token, Transformer, Tree, UnexpectedInput, v_args
from lark.exceptions import VisitError
from lark.visitors import Transformer_NonRecursive, merge_transformers

from .errors import SourceError, Span, syntax_error
from .ir import (BUILTIN_MONOIDS, KINDS, MAX_COMPONENTS, Binary, Const, Dim, DimError, Kind,
                 Load, Monoid, Node, Sort, TensorDecl, Unary, Var, checked_dim)
from .ops import UNARY
from .program import fold
from .rule import AxisSize, CExpr, PAxis, Pattern, PConst, PMonoid, PVar, Stored

# --------------------------------------------------------------------------------------------
# Syntax trees


@dataclass(frozen=True)
class Num:
    value: float
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Name:
    name: str
    span: Span = field(compare=False)


@dataclass(frozen=True)
class PatVar:
    """`?x`: `name` includes the question mark, as pattern fields store it."""

    name: str
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple[Expr, ...]
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Indexed:
    """`Q[q, d]`: a tensor with the names its dimensions get in this use."""

    tensor: str
    axes: tuple[Name, ...]
    span: Span = field(compare=False)


@dataclass(frozen=True)
class BinOp:
    op: str  # add, sub, mul, div
    x: Expr
    y: Expr
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Neg:
    x: Expr
    span: Span = field(compare=False)


Expr = Union[Num, Name, PatVar, Call, Indexed, BinOp, Neg]


@dataclass(frozen=True)
class ExprList:
    """A parenthesised list of expressions (one per monoid state component)."""

    items: tuple[Expr, ...]
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Size:
    """`q = 4096 / 64` or `d = 64`: an axis's extent and block size."""

    name: Name
    extent: Num
    block: Num | None
    span: Span = field(compare=False)

    def dim(self, text: str, of: str | None = None) -> Dim:
        """The dimension these sizes declare (`ir.checked_dim`), or a `SourceError` at the
        number at fault."""
        try:
            return checked_dim(self.name.name, self.extent.value,
                               None if self.block is None else self.block.value, of)
        except DimError as e:
            at = self.extent if e.part == "extent" else self.block
            raise SourceError(at.span, str(e), text) from None


@dataclass(frozen=True)
class MonoidDecl:
    name: Name
    state: tuple[Name, ...]
    identity: ExprList
    combine: ExprList
    finalize: ExprList
    span: Span = field(compare=False)


# --------------------------------------------------------------------------------------------
# Parse trees -> syntax trees


class ExprTransformer(Transformer_NonRecursive):
    """One method per rule of expr.lark.  File transformers subclass it (see `make_transformer`).

    Non-recursive: an expression thousands of terms long is a parse tree as deep, and lark's
    plain `Transformer` recurses once per level.  A method raising `SourceError` reports a
    mistake; `parse` unwraps it from lark's `VisitError`."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def span(self, at: Token | Tree | object) -> Span:
        if isinstance(at, Token):
            return Span(self.path, at.line, at.column)
        meta = at.meta if isinstance(at, Tree) else at
        return Span(self.path, meta.line, meta.column)

    def _name(self, tok: Token) -> Name:
        return Name(str(tok), self.span(tok))

    def _num(self, tok: Token) -> Num:
        return Num(float(tok), self.span(tok))

    def _binop(self, op: str, meta: object, children: list) -> BinOp:
        return BinOp(op, children[0], children[1], self.span(meta))

    @v_args(meta=True)
    def add(self, meta, children) -> BinOp:
        return self._binop("add", meta, children)

    @v_args(meta=True)
    def sub(self, meta, children) -> BinOp:
        return self._binop("sub", meta, children)

    @v_args(meta=True)
    def mul(self, meta, children) -> BinOp:
        return self._binop("mul", meta, children)

    @v_args(meta=True)
    def div(self, meta, children) -> BinOp:
        return self._binop("div", meta, children)

    @v_args(meta=True)
    def neg(self, meta, children) -> Neg:
        return Neg(children[0], self.span(meta))

    def number(self, children) -> Num:
        return self._num(children[0])

    def name(self, children) -> Name:
        return self._name(children[0])

    def pvar(self, children) -> PatVar:
        return PatVar(str(children[0]), self.span(children[0]))

    def call(self, children) -> Call:
        func, *args = children
        return Call(str(func), tuple(args), self.span(func))

    def indexed(self, children) -> Indexed:
        tensor, axes = children
        return Indexed(str(tensor), axes, self.span(tensor))

    def axes(self, children) -> tuple[Name, ...]:
        return tuple(self._name(t) for t in children if t is not None)

    @v_args(meta=True)
    def size(self, meta, children) -> Size:
        name, extent, block = children
        return Size(self._name(name), self._num(extent),
                    None if block is None else self._num(block), self.span(meta))

    @v_args(meta=True)
    def exprs(self, meta, children) -> ExprList:
        return ExprList(tuple(children), self.span(meta))

    @v_args(meta=True)
    def monoid(self, meta, children) -> MonoidDecl:
        name, *state, identity, combine, finalize = children
        return MonoidDecl(self._name(name), tuple(self._name(t) for t in state),
                          identity, combine, finalize, self.span(meta))


def make_transformer(transformer: ExprTransformer) -> Transformer:
    """`transformer` extended to the expression rules, which lark names `expr__<rule>`.

    The rules a grammar imports by name from expr.lark (`axes`, `monoid`, ...) keep their names
    and are served by the subclass's inherited methods; the rest live in the `expr` namespace.
    """
    return merge_transformers(transformer, expr=ExprTransformer(transformer.path))


# --------------------------------------------------------------------------------------------
# Grammars and syntax errors


def _grammar_source(_base_path: object, grammar_path: str) -> tuple[str, str]:
    """lark import hook: `%import expr` reads expr.lark from the installed grammar package."""
    text = files("bbrules.grammar").joinpath(grammar_path).read_text()
    return f"bbrules.grammar/{grammar_path}", text


@cache
def grammar(name: str) -> Lark:
    """The LALR parser for `grammar/<name>` (loaded once per process)."""
    text = files("bbrules.grammar").joinpath(name).read_text()
    return Lark(text, parser="lalr", propagate_positions=True, maybe_placeholders=True,
                import_paths=[_grammar_source])


_TOKEN_WORDS = {
    "NAME": "a name", "NUMBER": "a number", "PVAR": "a pattern variable like ?x",
    "STRING": "a quoted string", "ARROW": "an arrow (=>, <=>, !=>)",
    "ROLE": "a tensor role (input, temp, output)",
    "CMP": "a comparison (==, !=, <, <=, >, >=)", "$END": "the end of the file",
}


def parse(grammar_name: str, text: str, path: str, transformer: ExprTransformer) -> object:
    """Parse `text` and transform it; a syntax error becomes a `SourceError` with a caret.

    The message names what the parser could have accepted at that point ("expected ...").
    """
    parser = grammar(grammar_name)
    try:
        tree = parser.parse(text)
    except UnexpectedInput as e:
        raise syntax_error(e, parser, text, path, _TOKEN_WORDS) from None
    try:
        return make_transformer(transformer).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, SourceError):
            raise e.orig_exc from None
        raise


# --------------------------------------------------------------------------------------------
# Syntax trees -> IR nodes and patterns

# Call syntax: every spelling a node kind declares (`kinds.Kind.calls`), plus the forms that
# are not a node of their own: `load(T[axes])` (or `load(store(?v))` in a rule) and `const(...)`.
_CALLS: dict[str, tuple[Kind, str | None]] = {
    name: (k.kind, op) for k in KINDS for name, op in k.kind.calls()}
_SPECIAL: dict[str, str] = {"load": "T[axes]", "const": "constant"}
_SIZES = ("block", "extent", "trips")


@dataclass
class Scope:
    """What names mean where an expression is resolved.

    `locals`: `let` names of a kernel.  `variables`: the `Var` names a monoid part may use.
    `dims` / `tensors`: declared axes and tensors, when known, for early errors.  `monoids`:
    the monoids `reduce` may name (the builtins and those declared where the text is).  `patterns`: `?x` and `const(?c)` allowed (a rule side).
    `rhs`: constant arithmetic allowed inside `const(...)`.  `elementwise`: only constants,
    variables and elementwise operators (a monoid's parts).  `kinds` records, per pattern
    variable, whether it stands for a value, axis, monoid or constant, and where it first
    appeared.
    """

    text: str
    monoids: Mapping[str, Monoid] = field(default_factory=lambda: dict(BUILTIN_MONOIDS))
    locals: dict[str, Node] = field(default_factory=dict)
    variables: frozenset[str] = frozenset()
    dims: frozenset[str] | None = None
    tensors: dict[str, TensorDecl] | None = None
    patterns: bool = False
    rhs: bool = False
    elementwise: bool = False
    kinds: dict[str, tuple[str, Span]] = field(default_factory=dict)


class Resolver:
    """Turns syntax trees into IR nodes / patterns under one `Scope`, raising `SourceError`."""

    def __init__(self, scope: Scope):
        self.scope = scope
        self._attrs: dict[int, dict[str, object]] = {}  # a call's attributes, by id, until built

    def error(self, span: Span, message: str) -> SourceError:
        return SourceError(span, message, self.scope.text)

    def use(self, var: PatVar, kind: str) -> str:
        """Record that `var` stands for a `kind`; a variable has one kind throughout a rule."""
        if not self.scope.patterns:
            raise self.error(var.span, f"pattern variable {var.name} outside a rule")
        seen = self.scope.kinds.setdefault(var.name, (kind, var.span))
        if seen[0] != kind:
            raise self.error(var.span, f"{var.name} is used as {article(kind)} here but as "
                                       f"{article(seen[0])} at {seen[1]}")
        return var.name

    def value(self, root: Expr) -> Pattern:
        """A value: an IR node, or in a rule a pattern.

        Built bottom-up by `fold` (no recursion: a block file's expression may be thousands of
        terms deep); a call's own mistakes (unknown function, arity) are reported before its
        arguments are looked at.
        """
        return fold(root, self._node, self._operands)

    def _operands(self, e: Expr) -> tuple[Expr, ...]:
        """The subexpressions whose values `e` is built from."""
        if (operands := _arithmetic(e)) is not None:
            return operands
        match e:
            case Call():
                kind, _ = self._callee(e)
                if kind is None:
                    return ()
                # Attributes (axes, monoids, indices) are resolved now, in the order written,
                # so a variable's first use is the one a mistake is reported against.
                fields = list(zip(self._fields(kind, e), e.args))
                self._attrs[id(e)] = {f: self._resolvers[sort](self, a) for (f, sort), a in fields
                                      if sort not in (Sort.CHILD, Sort.CHILDREN)}
                return tuple(a for (_, sort), a in fields if sort in (Sort.CHILD, Sort.CHILDREN))
        return ()

    def _node(self, e: Expr, kids: list[Pattern]) -> Pattern:
        """`e` as a node (or pattern) whose operands are `kids`."""
        match e:
            case Num(v):
                return Const(v)
            case Neg(Num(v)):
                return Const(-v)
            case Neg():
                return Unary("neg", kids[0])
            case BinOp(op):
                return Binary(op, *kids)
            case PatVar():
                return PVar(self.use(e, "value"))
            case Name(name) if name in self.scope.locals:
                return self.scope.locals[name]
            case Name(name) if name in self.scope.variables:
                return Var(name)
            case Name(name):
                hint = " (pattern variables start with '?')" if self.scope.patterns else ""
                raise self.error(e.span, f"unknown name '{name}'{hint}")
            case Indexed(tensor):
                raise self.error(e.span, f"{tensor}[...] is a tensor: read a block of it with "
                                         f"load({tensor}[...])")
            case Call():
                return self.call(e, kids)
        raise AssertionError(e)

    def _callee(self, e: Call) -> tuple[Kind | None, str | None]:
        """The kind and operator a call names (None for `load`/`const`), its arity checked."""
        if e.func in _SPECIAL:
            self.arity(e, 1, _SPECIAL[e.func])
            self.not_elementwise(e)
            return None, None
        if e.func not in _CALLS:
            raise self.error(e.span, f"unknown function '{e.func}'")
        kind, op = _CALLS[e.func]
        if not kind.elementwise:
            self.not_elementwise(e)
        variadic = any(s is Sort.CHILDREN for _, s in kind.fields)
        if variadic and not e.args:
            raise self.error(e.span, f"{e.func} takes at least one argument")
        if not variadic:
            self.arity(e, len(kind.params), ", ".join(kind.params))
        return kind, op

    @staticmethod
    def _fields(kind: Kind, e: Call) -> list[tuple[str, Sort]]:
        """The field each argument of `e` fills, in order (a variadic field takes the rest)."""
        fields = [(f, s) for f, s in kind.fields if s is not Sort.OP]
        if fields and fields[-1][1] is Sort.CHILDREN:
            fields[-1:] = [fields[-1]] * (len(e.args) - len(fields) + 1)
        return fields

    def call(self, e: Call, kids: list[Pattern]) -> Pattern:
        """A function call: a node kind's declared spelling, `load(...)` or `const(...)`.

        Each argument is resolved by what the kind's field holds (an axis, a monoid, a
        component index, a value, already resolved in `kids`), so a new kind needs no code
        here."""
        kind, op = self._callee(e)
        if kind is None:
            return self.load(e.args[0]) if e.func == "load" else self.const(e.args[0])
        values: dict[str, object] = {f: op for f, s in kind.fields if s is Sort.OP}
        values.update(self._attrs.pop(id(e)))
        operands = iter(kids)
        for f, sort in self._fields(kind, e):
            if sort is Sort.CHILDREN:
                values[f] = values.get(f, ()) + (next(operands),)  # type: ignore[operator]
            elif sort is Sort.CHILD:
                values[f] = next(operands)
        return kind.cls(**values)

    def arity(self, e: Call, n: int, params: str) -> None:
        if len(e.args) != n:
            raise self.error(e.span, f"{e.func} takes {n} argument{'s' * (n > 1)} ({params}), "
                                     f"got {len(e.args)}")

    def not_elementwise(self, e: Call) -> None:
        if self.scope.elementwise:
            raise self.error(e.span, f"a monoid's parts are elementwise: '{e.func}' is not "
                                     f"allowed here")

    def axis(self, e: Expr) -> str | PAxis:
        if isinstance(e, PatVar):
            return PAxis(self.use(e, "axis"))
        if not isinstance(e, Name):
            raise self.error(e.span, "expected an axis name")
        if self.scope.patterns:
            raise self.error(e.span, f"an axis in a rule is a variable like ?{e.name}")
        if self.scope.dims is not None and e.name not in self.scope.dims:
            raise self.error(e.span, f"unknown axis '{e.name}' (not declared with dim)")
        return e.name

    def monoid(self, e: Expr) -> Monoid | PMonoid:
        if isinstance(e, PatVar):
            return PMonoid(self.use(e, "monoid"))
        if not isinstance(e, Name):
            raise self.error(e.span, "expected a monoid name")
        if e.name not in self.scope.monoids:
            known = ", ".join(sorted(self.scope.monoids))
            raise self.error(e.span, f"unknown monoid '{e.name}' (known: {known})")
        return self.scope.monoids[e.name]

    def index(self, e: Expr) -> int:
        if not (isinstance(e, Num) and float(e.value).is_integer() and e.value >= 0):
            raise self.error(e.span, "expected a component index (0, 1, ...)")
        return int(e.value)

    def load(self, e: Expr) -> Pattern:
        if self.scope.patterns:
            if isinstance(e, Call) and e.func == "store" and len(e.args) == 1:
                return Stored(self.value(e.args[0]))
            raise self.error(e.span, "a rule reads a block back only as load(store(?v))")
        if not isinstance(e, Indexed):
            raise self.error(e.span, "expected a tensor block like load(T[a, b])")
        tensors = self.scope.tensors
        if tensors is not None and e.tensor not in tensors:
            raise self.error(e.span, f"unknown tensor '{e.tensor}'")
        axes = tuple(self.axis(a) for a in e.axes)
        if tensors is not None and len(axes) != len(tensors[e.tensor].axes):
            raise self.error(e.span, f"'{e.tensor}' has {len(tensors[e.tensor].axes)} axes, "
                                     f"this load names {len(axes)}")
        return Load(e.tensor, axes)

    def const(self, e: Expr) -> Pattern:
        """The argument of `const(...)`: `?c` on a left side, constant arithmetic on a right."""
        if not self.scope.patterns:
            raise self.error(e.span, "const(...) is for rules; write the number itself")
        if isinstance(e, PatVar):
            return PConst(self.use(e, "constant"))
        value = self.cexpr(e)
        if not self.scope.rhs and not isinstance(value, Const):
            raise self.error(e.span, "constant arithmetic belongs on the right-hand side; "
                                       "match a constant with const(?c)")
        return value

    def cexpr(self, root: Expr) -> Const | PConst | AxisSize | CExpr:
        """Arithmetic over constant variables, numbers and axis sizes (folded when applied)."""
        return fold(root, self._constant, self._constant_operands)

    def _constant_operands(self, e: Expr) -> tuple[Expr, ...]:
        if (operands := _arithmetic(e)) is not None:
            return operands
        match e:
            case Call(f, (PatVar(),)) if f in _SIZES:
                return ()
            case Call(f, args) if (f in UNARY and len(args) == 1
                                   or f in ("max", "min") and len(args) == 2):
                return args
        return ()

    def _constant(self, e: Expr, kids: list) -> Const | PConst | AxisSize | CExpr:
        match e:
            case Num(v):
                return Const(v)
            case Neg(Num(v)):
                return Const(-v)
            case Neg():
                return CExpr("neg", tuple(kids))
            case PatVar():
                return PConst(self.use(e, "constant"))
            case BinOp(op):
                return CExpr(op, tuple(kids))
            case Call(f, (PatVar() as a,)) if f in _SIZES:
                return AxisSize(f, self.use(a, "axis"))
            case Call(f) if kids:
                return CExpr(f, tuple(kids))
        raise self.error(e.span, "expected constant arithmetic over ?c, numbers, block(?a), "
                                   "extent(?a) and trips(?a)")


def _arithmetic(e: Expr) -> tuple[Expr, ...] | None:
    """The operands of a negation or of infix arithmetic (a negated number is a constant of
    its own); None for any other expression."""
    match e:
        case Neg(Num()):
            return ()
        case Neg(x):
            return (x,)
        case BinOp(_, x, y):
            return (x, y)
    return None


Resolver._resolvers = {
    Sort.AXIS: Resolver.axis, Sort.MONOID: Resolver.monoid, Sort.INDEX: Resolver.index,
    Sort.CHILD: Resolver.value,
}


def article(kind: str) -> str:
    """`kind` with its indefinite article, for messages ("an axis", "a value")."""
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def resolve_monoid(decl: MonoidDecl, text: str, doc: str = "") -> Monoid:
    """A monoid declaration as an `ir.Monoid`, checking each part's arity and variables."""
    state = tuple(n.name for n in decl.state)
    for part, names in (("state", decl.state), ("finalize", decl.finalize.items)):
        if len(names) > MAX_COMPONENTS:
            raise SourceError(names[MAX_COMPONENTS].span, f"a monoid's {part} has at most "
                              f"{MAX_COMPONENTS} components (the e-graph's largest tuple), "
                              f"this one {len(names)}", text)
    for i, n in enumerate(decl.state):
        if n.name in state[:i]:
            raise SourceError(n.span, f"state component '{n.name}' is declared twice", text)
    for part, exprs in (("identity", decl.identity), ("combine", decl.combine)):
        if len(exprs.items) != len(state):
            raise SourceError(exprs.span, f"{part} gives {len(exprs.items)} expression"
                                          f"{'s' * (len(exprs.items) != 1)}, the state "
                                          f"({', '.join(state)}) has {len(state)}", text)

    def part(exprs: ExprList, variables: frozenset[str]) -> tuple[Node, ...]:
        resolver = Resolver(Scope(text, variables=variables, elementwise=True))
        return tuple(resolver.value(x) for x in exprs.items)

    return Monoid(decl.name.name, state,
                  part(decl.identity, frozenset()),
                  part(decl.combine, frozenset(f"{s}.{c}" for s in "ab" for c in state)),
                  part(decl.finalize, frozenset(state)), doc)
