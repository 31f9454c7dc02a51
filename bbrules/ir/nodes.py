"""The value-node kinds of the block IR, each declared once.

A *tile* is the block of a tensor-valued expression that one processor holds.  Every value
node has a type (`types.TileType`): the axes its tile spans and the axes whose block index
selects it.  A `Reduce` is a sequential loop over the blocks of one axis that folds its body
with a `Monoid`; it removes that axis from the dependencies.  A `Store` materialises a value
for every block of its axes: one kernel.

Each class below is the whole declaration of its kind (see `kinds.node`): its fields and what
they hold, its block syntax (`call`), its egglog constructor (`egg`) and its type rule
(`infer`, given the types of its children in order).  Adding a kind is: a class here, its
semantics in each pass's `KindTable`, and its rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from ..ops import BINARY, TERNARY, TILE_REDUCE, UNARY
from .kinds import KINDS, Sort, attr, child, children_field, node
from .types import SCALAR, Axis, IRError, TileType, Type, union

if TYPE_CHECKING:
    from .monoid import Monoid


def _shown(n: object) -> str:
    from .show import show_node
    return show_node(n)  # type: ignore[arg-type]


def _tile(t: Type, what: object) -> TileType:
    if not isinstance(t, TileType):
        raise IRError(f"expected a tile, found a tuple: {_shown(what)}")
    return t


@node(egg="Ld")
class Load:
    """G -> L: the current block of global tensor `tensor`, its dimensions named `axes`.

    `axes` are the names this use gives the tensor's dimensions, in the tensor's order; they
    differ from the declared axes when a tensor is reused under other names (self-attention
    loading X[s, d] as X[k, d]).
    """

    tensor: str = attr(Sort.TENSOR)
    axes: tuple[Axis, ...] = attr(Sort.AXES)

    def infer(self, kids: tuple[Type, ...]) -> Type:
        s = frozenset(self.axes)
        if len(s) != len(self.axes):
            raise IRError(f"repeated axis in {_shown(self)}")
        return TileType(s, s)


@node(egg="Cst")
class Const:
    value: float = attr(Sort.NUMBER)

    def infer(self, kids: tuple[Type, ...]) -> Type:
        return SCALAR


@node()
class Var:
    """A named operand inside a monoid's combine/finalize expressions (`a.m`, `b.m`, `m`)."""

    name: str = attr(Sort.NAME)

    def infer(self, kids: tuple[Type, ...]) -> Type:
        return SCALAR


@node(call="pos", egg="Pos")
class Pos:
    """The position of each element along `axis` (0 ... extent - 1, as f32): an axis name used
    as a value (`where(k <= q, ...)`).  A tile over the axis that, like a load of it, depends on
    which block it is; it reads no memory."""

    axis: Axis = attr(Sort.AXIS)

    def infer(self, kids: tuple[Type, ...]) -> Type:
        s = frozenset((self.axis,))
        return TileType(s, s)


@node(call="{op}", egg="Un", elementwise=True)
class Unary:
    op: str = attr(Sort.OP, UNARY)
    x: Node = child()

    def infer(self, kids: tuple[Type, ...]) -> Type:
        if self.op not in UNARY:
            raise IRError(f"unknown unary operator '{self.op}'")
        return _tile(kids[0], self.x)


@node(call="{op}", egg="Bin", elementwise=True)
class Binary:
    op: str = attr(Sort.OP, BINARY)
    x: Node = child()
    y: Node = child()

    def infer(self, kids: tuple[Type, ...]) -> Type:
        if self.op not in BINARY:
            raise IRError(f"unknown binary operator '{self.op}'")
        return union(_tile(kids[0], self.x), _tile(kids[1], self.y))


@node(call="b{op}", egg="BRed")
class BlockReduce:
    """Reduce inside the tile along `axis` (`bsum`, `bmax`, `bmin`)."""

    op: str = attr(Sort.OP, TILE_REDUCE)
    axis: Axis = attr(Sort.AXIS)
    x: Node = child()

    def infer(self, kids: tuple[Type, ...]) -> Type:
        if self.op not in TILE_REDUCE:
            raise IRError(f"unknown in-tile reduction 'b{self.op}'")
        t = _tile(kids[0], self.x)
        if self.axis not in t.shape:
            raise IRError(f"b{self.op} over '{self.axis}', which the tile does not span: "
                          f"{_shown(self)}")
        return TileType(t.shape - {self.axis}, t.deps)


@node(call="dot", egg="Dot")
class Dot:
    """Tile contraction over `axis`: sum over the axis of x * y (a block matmul)."""

    axis: Axis = attr(Sort.AXIS)
    x: Node = child()
    y: Node = child()

    def infer(self, kids: tuple[Type, ...]) -> Type:
        tx, ty = _tile(kids[0], self.x), _tile(kids[1], self.y)
        if self.axis not in tx.shape or self.axis not in ty.shape:
            raise IRError(f"dot over '{self.axis}', which an operand does not span: "
                          f"{_shown(self)}")
        return TileType((tx.shape | ty.shape) - {self.axis}, tx.deps | ty.deps)


@node(call="reduce", egg="Red", loop=True)
class Reduce:
    """Sequential loop over the blocks of `axis`, folding `x` with `monoid`.

    For a monoid with one state component `x` is a tile; with n components it is a `Tuple` of
    n tiles.  The value is the monoid's finalize applied to the final state: a tile when the
    monoid finalizes to one value, otherwise a tuple read with `Get`.  The node holds the
    monoid itself, so a program carries the definitions it uses and two packs may define a
    monoid of the same name differently.
    """

    axis: Axis = attr(Sort.AXIS)
    monoid: Monoid = attr(Sort.MONOID)
    x: Node = child()

    def infer(self, kids: tuple[Type, ...]) -> Type:
        m, a = self.monoid, self.axis
        parts = (kids[0],) if isinstance(kids[0], TileType) else kids[0]
        if len(parts) != m.arity:
            raise IRError(f"monoid '{m.name}' folds {m.arity} values, got {len(parts)}: "
                          f"{_shown(self)}")
        for p in parts:
            if a in p.shape:
                raise IRError(f"reduce over '{a}' of a tile that still spans '{a}' "
                              f"(reduce it in-tile first): {_shown(self)}")
        out = m.result_types(tuple(TileType(p.shape, p.deps - {a}) for p in parts))
        return out[0] if len(out) == 1 else out


@node(call="where", egg="Sel", elementwise=True, ops=TERNARY)
class Where:
    """Select elementwise: `x` where the condition `c` is nonzero, else `y`."""

    c: Node = child()
    x: Node = child()
    y: Node = child()

    def infer(self, kids: tuple[Type, ...]) -> Type:
        return union(*(_tile(t, k) for t, k in zip(kids, (self.c, self.x, self.y))))


# The most components a tuple (a monoid's state, its results) may have: the e-graph declares
# one constructor per tuple size, Tup2 to Tup8.
MAX_COMPONENTS = 8


@node(call="tuple", egg="Tup")
class Tuple:
    items: tuple[Node, ...] = children_field()

    def infer(self, kids: tuple[Type, ...]) -> Type:
        if len(self.items) > MAX_COMPONENTS:
            raise IRError(f"a tuple has at most {MAX_COMPONENTS} components, this one "
                          f"{len(self.items)}")
        return tuple(_tile(t, i) for t, i in zip(kids, self.items))


@node(call="get", egg="Get")
class Get:
    index: int = attr(Sort.INDEX)
    x: Node = child()

    def infer(self, kids: tuple[Type, ...]) -> Type:
        t = kids[0]
        if isinstance(t, TileType) or not 0 <= self.index < len(t):
            raise IRError(f"get({self.index}) of a value with no component {self.index}: "
                          f"{_shown(self)}")
        return t[self.index]


Node = Union[Load, Pos, Const, Var, Unary, Binary, BlockReduce, Dot, Reduce, Where, Tuple, Get]

# The kinds that apply one operator elementwise (`kinds.operator`): every pass treats them alike.
ELEMENTWISE_KINDS: tuple[type, ...] = tuple(k for k in KINDS if k.kind.elementwise)
