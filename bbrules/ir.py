"""The block-program IR: values in a global tier (tensors) and a local tier (tiles).

A *tile* is the block of a tensor-valued expression that one processor holds.  Every value
node has a type: the axes its tile spans (its *shape*) and the axes whose block index selects
it (its *dependencies*).  Shape is always a subset of dependencies.  A `Reduce` is a sequential
loop over the blocks of one axis that folds its body with a `Monoid`; it removes that axis from
the dependencies.  A `Store` materialises a value for every block of its axes: one kernel.

Nodes are frozen dataclasses, so structurally equal terms are equal and hash alike; a program
is a DAG by sharing.  Types are computed by `type_of`, cached per node.

Axis names are plain strings; their extents and block sizes live in the program's `Dim` table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Iterator, Union

from .ops import BINARY, UNARY

Axis = str
AxisSet = frozenset[str]

# --------------------------------------------------------------------------------------------
# Program-level declarations


@dataclass(frozen=True)
class Dim:
    """An axis of the iteration space: `extent` elements in blocks of `block`."""

    name: str
    extent: int
    block: int

    @property
    def blocks(self) -> int:
        return self.extent // self.block


class DimError(ValueError):
    """Sizes that make no dimension; `part` ("extent" or "block") is the number at fault."""

    def __init__(self, part: str, message: str):
        super().__init__(message)
        self.part = part


def checked_dim(name: str, extent: float, block: float | None, of: str | None = None) -> Dim:
    """Dimension `name`: `extent` elements in blocks of `block` (one block when None).

    Every way of writing sizes (a program's `dim`, a block program's, a check's `with`, the
    command line's `--dim`) comes here, so they all accept the same sizes: positive integers,
    the block dividing the extent.  `of` names the dimension in the message for a block that
    does not divide (default "dimension 'name'").
    """
    for part, what, v in (("extent", "a dimension's extent", extent),
                          ("block", "a block size", block)):
        if v is not None and v != int(v):
            raise DimError(part, f"{what} must be a positive integer, got '{v:g}'")
        if v is not None and v < 1:
            raise DimError(part, f"{what} must be positive, got {v:g}")
    whole = int(extent)
    size = whole if block is None else int(block)
    if whole % size:
        raise DimError("block", f"block size {size} does not divide the extent {whole} of "
                                f"{of or f'dimension {name!r}'}")
    return Dim(name, whole, size)


DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


@dataclass(frozen=True)
class TensorDecl:
    """A global tensor.  `role` is `input`, `output` or `temp` (a materialised intermediate)."""

    name: str
    axes: tuple[Axis, ...]
    dtype: str = "f32"
    role: str = "temp"

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]


# --------------------------------------------------------------------------------------------
# Value nodes


def _cached_hash(self: object) -> int:
    """A node's hash, computed once.  Nodes form DAGs: the generated dataclass hash would walk
    every shared subterm again on each dict or set operation, which made extraction quadratic."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash((type(self).__name__, *(self.__dict__[f] for f in self.__dataclass_fields__)))
        object.__setattr__(self, "_hash", h)
    return h


def _is_node(x: object) -> bool:
    return getattr(type(x), "__hash__", None) is _cached_hash


def _dag_eq(self: object, other: object) -> bool:
    """Structural equality in time linear in the DAGs' sizes.

    The generated dataclass equality compares two equal DAGs built separately as trees,
    revisiting every shared subterm once per path to it: exponential in the depth of a fused
    program.  Here each pair of subterms is compared once.
    """
    if self is other:
        return True
    seen: set[tuple[int, int]] = set()
    stack = [(self, other)]
    while stack:
        a, b = stack.pop()
        if a is b or (id(a), id(b)) in seen:
            continue
        if type(a) is not type(b) or hash(a) != hash(b):
            return False
        seen.add((id(a), id(b)))
        for f in a.__dataclass_fields__:
            x, y = a.__dict__[f], b.__dict__[f]
            if isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y):
                pairs = zip(x, y)
            else:
                pairs = ((x, y),)
            for u, v in pairs:
                if _is_node(u) and _is_node(v):
                    stack.append((u, v))
                elif u != v:
                    return False
    return True


@dataclass(frozen=True)
class Load:
    """G -> L: the current block of global tensor `tensor`, its dimensions named `axes`.

    `axes` are the names this use gives the tensor's dimensions, in the tensor's order; they
    differ from the declared axes when a tensor is reused under other names (self-attention
    loading X[s, d] as X[k, d]).
    """

    __hash__ = _cached_hash
    __eq__ = _dag_eq

    tensor: str
    axes: tuple[Axis, ...]


@dataclass(frozen=True)
class Const:
    __hash__ = _cached_hash
    __eq__ = _dag_eq

    value: float


@dataclass(frozen=True)
class Var:
    """A named operand inside a monoid's combine/finalize expressions (`a.m`, `b.m`, `m`)."""

    __hash__ = _cached_hash
    __eq__ = _dag_eq

    name: str


@dataclass(frozen=True)
class Unary:
    __hash__ = _cached_hash
    __eq__ = _dag_eq

    op: str
    x: Node


@dataclass(frozen=True)
class Binary:
    __hash__ = _cached_hash
    __eq__ = _dag_eq

    op: str
    x: Node
    y: Node


@dataclass(frozen=True)
class BlockReduce:
    """Reduce inside the tile along `axis` (`bsum`, `bmax`, `bmin`)."""

    __hash__ = _cached_hash
    __eq__ = _dag_eq

    op: str
    axis: Axis
    x: Node


@dataclass(frozen=True)
class Dot:
    """Tile contraction over `axis`: sum over the axis of x * y (a block matmul)."""

    __hash__ = _cached_hash
    __eq__ = _dag_eq

    axis: Axis
    x: Node
    y: Node


@dataclass(frozen=True)
class Reduce:
    """Sequential loop over the blocks of `axis`, folding `x` with monoid `monoid`.

    For a monoid with one state component `x` is a tile; with n components it is a `Tuple` of
    n tiles.  The value is the monoid's finalize applied to the final state: a tile when the
    monoid finalizes to one value, otherwise a tuple read with `Get`.
    """

    __hash__ = _cached_hash
    __eq__ = _dag_eq

    axis: Axis
    monoid: str
    x: Node


@dataclass(frozen=True)
class Tuple:
    __hash__ = _cached_hash
    __eq__ = _dag_eq

    items: tuple[Node, ...]


@dataclass(frozen=True)
class Get:
    __hash__ = _cached_hash
    __eq__ = _dag_eq

    index: int
    x: Node


Node = Union[Load, Const, Var, Unary, Binary, BlockReduce, Dot, Reduce, Tuple, Get]

# Every value-node kind, in declaration order.  Passes with per-kind semantics register one
# implementation per kind in a `KindTable`; a test fails when a table lacks a kind.
KINDS: tuple[type, ...] = (Load, Const, Var, Unary, Binary, BlockReduce, Dot, Reduce, Tuple, Get)


class KindTable:
    """One pass's semantics, one implementation per node kind (`@table.on(Unary)`).

    `table(node, *args)` calls the implementation registered for the node's kind; `missing()`
    names the kinds without one, which the coverage test reports.  `exempt` lists kinds that
    cannot reach this pass, with the reason.
    """

    def __init__(self, name: str, exempt: dict[type, str] | None = None):
        self.name = name
        self.impl: dict[type, Callable[..., Any]] = {}
        self.exempt = dict(exempt or {})

    def on(self, *kinds: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            for k in kinds:
                self.impl[k] = fn
            return fn
        return register

    def __call__(self, n: Node, *args: Any, **kwargs: Any) -> Any:
        fn = self.impl.get(type(n))
        if fn is None:
            raise IRError(f"{self.name}: no implementation for {type(n).__name__} nodes")
        return fn(n, *args, **kwargs)

    def missing(self) -> list[str]:
        return [k.__name__ for k in KINDS if k not in self.impl and k not in self.exempt]


@dataclass(frozen=True)
class Store:
    """L -> G: materialise `value` into `tensor` for every block of `axes`.  One kernel."""

    __hash__ = _cached_hash
    __eq__ = _dag_eq

    tensor: str
    axes: tuple[Axis, ...]
    value: Node


def children(n: Node) -> tuple[Node, ...]:
    match n:
        case Unary(_, x) | BlockReduce(_, _, x) | Reduce(_, _, x) | Get(_, x):
            return (x,)
        case Binary(_, x, y) | Dot(_, x, y):
            return (x, y)
        case Tuple(items):
            return items
    return ()


def postorder(root: Node) -> Iterator[Node]:
    """Each distinct node of the DAG under `root` once, children before parents."""
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            yield node
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children(node)))


# --------------------------------------------------------------------------------------------
# Monoids are data: the interpreter, cost model and code generators read these definitions.


@dataclass(frozen=True)
class Monoid:
    """A fold over blocks.

    `state` names the components.  `identity` gives one expression per component (constants).
    `combine` gives the new state from two states, whose components are `Var("a.<c>")` (the
    accumulator) and `Var("b.<c>")` (the contribution of one block).  `finalize` gives the
    reduction's results from the final state, over `Var("<c>")`.  All three are elementwise.
    """

    name: str
    state: tuple[str, ...]
    identity: tuple[Node, ...]
    combine: tuple[Node, ...]
    finalize: tuple[Node, ...]
    doc: str = field(default="", compare=False)

    @property
    def arity(self) -> int:
        return len(self.state)


def _simple(name: str, op: str, identity: float, doc: str) -> Monoid:
    return Monoid(name, ("s",), (Const(identity),), (Binary(op, Var("a.s"), Var("b.s")),),
                  (Var("s"),), doc)


BUILTIN_MONOIDS: dict[str, Monoid] = {
    m.name: m
    for m in (
        _simple("sum", "add", 0.0, "addition"),
        _simple("max", "max", float("-inf"), "maximum"),
        _simple("min", "min", float("inf"), "minimum"),
    )
}


# --------------------------------------------------------------------------------------------
# Types


@dataclass(frozen=True)
class TileType:
    shape: AxisSet
    deps: AxisSet


Type = Union[TileType, tuple[TileType, ...]]

SCALAR = TileType(frozenset(), frozenset())


class IRError(Exception):
    """An ill-formed block-IR term (a bug in whatever built it, or in a user's .bbk file)."""


def _union(*types: TileType) -> TileType:
    return TileType(frozenset().union(*(t.shape for t in types)),
                    frozenset().union(*(t.deps for t in types)))


def _tile(t: Type, what: Node) -> TileType:
    if not isinstance(t, TileType):
        raise IRError(f"expected a tile, found a tuple: {show_node(what)}")
    return t


def _var_names(e: Node) -> set[str]:
    return {n.name for n in postorder(e) if isinstance(n, Var)}


def finalize_types(monoid: Monoid, state: tuple[TileType, ...]) -> tuple[TileType, ...]:
    """Types of a monoid's results given its state types: elementwise, so unions."""
    env = dict(zip(monoid.state, state))
    return tuple(_union(SCALAR, *(env[v] for v in _var_names(f))) for f in monoid.finalize)


def coupled_state_types(monoid: Monoid, state: tuple[TileType, ...]) -> tuple[TileType, ...]:
    """Widen each state component by the components its combine reads, to a fixed point.

    A rescaled monoid couples its accumulators to the running max (`l` is multiplied by
    `exp(a.m - max(a.m, b.m))`), so `l` spans and depends on whatever `m` does.
    """
    reads = [{v.split(".", 1)[-1] for v in _var_names(c)} for c in monoid.combine]
    types = dict(zip(monoid.state, state))
    changed = True
    while changed:
        changed = False
        for name, used in zip(monoid.state, reads):
            widened = _union(types[name], *(types[u] for u in used))
            if widened != types[name]:
                types[name], changed = widened, True
    return tuple(types[name] for name in monoid.state)


# The monoid table type_of consults.  Rule packs register theirs with `register_monoid`.
MONOIDS: dict[str, Monoid] = dict(BUILTIN_MONOIDS)


def register_monoid(m: Monoid) -> None:
    """Make a monoid known to the IR.  Redefining a name with a different definition is an error."""
    old = MONOIDS.get(m.name)
    if old is not None and old != m:
        raise IRError(f"monoid '{m.name}' is already defined differently")
    MONOIDS[m.name] = m
    type_of.cache_clear()
    sched_deps.cache_clear()


def monoid_of(r: Reduce) -> Monoid:
    """The monoid a reduction folds with."""
    return monoid(r.monoid)


def monoid(name: str) -> Monoid:
    try:
        return MONOIDS[name]
    except KeyError:
        raise IRError(f"unknown monoid '{name}'") from None


@cache
def type_of(n: Node) -> Type:
    """Shape and dependencies of a node (per component for tuples), checking well-formedness.

    Load types need no program context: a load's tile spans and depends on its axes.
    """
    match n:
        case Load(_, axes):
            s = frozenset(axes)
            if len(s) != len(axes):
                raise IRError(f"repeated axis in {show_node(n)}")
            return TileType(s, s)
        case Const() | Var():
            return SCALAR
        case Unary(op, x):
            if op not in UNARY:
                raise IRError(f"unknown unary operator '{op}'")
            return _tile(type_of(x), x)
        case Binary(op, x, y):
            if op not in BINARY:
                raise IRError(f"unknown binary operator '{op}'")
            return _union(_tile(type_of(x), x), _tile(type_of(y), y))
        case BlockReduce(op, a, x):
            if op not in ("sum", "max", "min"):
                raise IRError(f"unknown in-tile reduction 'b{op}'")
            t = _tile(type_of(x), x)
            if a not in t.shape:
                raise IRError(f"b{op} over '{a}', which the tile does not span: {show_node(n)}")
            return TileType(t.shape - {a}, t.deps)
        case Dot(a, x, y):
            tx, ty = _tile(type_of(x), x), _tile(type_of(y), y)
            if a not in tx.shape or a not in ty.shape:
                raise IRError(f"dot over '{a}', which an operand does not span: {show_node(n)}")
            return TileType((tx.shape | ty.shape) - {a}, tx.deps | ty.deps)
        case Reduce(a, name, x):
            m = monoid(name)
            tx = type_of(x)
            parts = (tx,) if isinstance(tx, TileType) else tx
            if len(parts) != m.arity:
                raise IRError(f"monoid '{name}' folds {m.arity} values, got {len(parts)}: "
                              f"{show_node(n)}")
            for p in parts:
                if a in p.shape:
                    raise IRError(f"reduce over '{a}' of a tile that still spans '{a}' "
                                  f"(reduce it in-tile first): {show_node(n)}")
            state = coupled_state_types(m, tuple(TileType(p.shape, p.deps - {a}) for p in parts))
            out = finalize_types(m, state)
            return out[0] if len(out) == 1 else out
        case Tuple(items):
            return tuple(_tile(type_of(i), i) for i in items)
        case Get(i, x):
            t = type_of(x)
            if isinstance(t, TileType) or not 0 <= i < len(t):
                raise IRError(f"get({i}) of a value with no component {i}: {show_node(n)}")
            return t[i]
    raise IRError(f"not an IR node: {n!r}")


def tile_type(n: Node) -> TileType:
    return _tile(type_of(n), n)


def shape(n: Node) -> AxisSet:
    return tile_type(n).shape


def deps(n: Node) -> AxisSet:
    return tile_type(n).deps


@cache
def sched_deps(n: Node) -> AxisSet:
    """The axes a node's computation needs: like deps, but a tuple needs all its components.

    This is what scheduling uses: a reduction that carries several accumulators runs where all
    of them can be computed, even if one result alone would depend on fewer axes.
    """
    match n:
        case Load(_, axes):
            return frozenset(axes)
        case Reduce(a, _, x):
            return sched_deps(x) - {a}
    return frozenset().union(*(sched_deps(c) for c in children(n)))


# --------------------------------------------------------------------------------------------
# Programs


@dataclass(frozen=True)
class BlockProgram:
    """Kernels (stores) in execution order, over declared dims and tensors.

    `monoids` holds the definitions of every non-builtin monoid the kernels use, so that a
    program is self-contained when written to a file.
    """

    dims: dict[str, Dim]
    tensors: dict[str, TensorDecl]
    kernels: tuple[Store, ...]
    outputs: tuple[str, ...]
    monoids: dict[str, Monoid] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.kernels)

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors.values() if t.role == "input")

    def blocks(self, axis: Axis) -> int:
        return self.dims[axis].blocks

    def block(self, axis: Axis) -> int:
        return self.dims[axis].block

    def extent(self, axis: Axis) -> int:
        return self.dims[axis].extent

    def tensor_axes_dim(self, load: Load) -> Iterator[tuple[Axis, Axis]]:
        """(declared axis, use axis) pairs of a load."""
        return zip(self.tensors[load.tensor].axes, load.axes)


def validate(p: BlockProgram) -> None:
    """Check every invariant of a block program; raise IRError naming the first violation.

    Run on every program the tool produces: a bug in a rule or in extraction must never reach
    a code generator.
    """
    for m in p.monoids.values():
        register_monoid(m)
    written: set[str] = set()
    for k in p.kernels:
        decl = p.tensors.get(k.tensor)
        if decl is None:
            raise IRError(f"store into undeclared tensor '{k.tensor}'")
        if decl.role == "input":
            raise IRError(f"store into input tensor '{k.tensor}'")
        if k.axes != decl.axes:
            raise IRError(f"store {k.tensor}{list(k.axes)} does not match its declaration "
                          f"{k.tensor}{list(decl.axes)}")
        t = type_of(k.value)
        if not isinstance(t, TileType):
            raise IRError(f"kernel {k.tensor}: cannot store a tuple")
        want = frozenset(k.axes)
        if t.shape != want or t.deps != want:
            raise IRError(f"kernel {k.tensor}: a store needs shape == deps == {sorted(want)}, "
                          f"the value has shape {sorted(t.shape)}, deps {sorted(t.deps)}")
        if not sched_deps(k.value) <= want:
            raise IRError(f"kernel {k.tensor}: a loop in it needs axes "
                          f"{sorted(sched_deps(k.value) - want)} that the kernel does not "
                          f"iterate over")
        for n in postorder(k.value):
            _check_node(p, n, written, k.tensor)
        written.add(k.tensor)
    for o in p.outputs:
        if o not in written:
            raise IRError(f"output '{o}' is never stored")


def _check_node(p: BlockProgram, n: Node, written: set[str], kernel: str) -> None:
    for a in tile_type(n).deps if isinstance(type_of(n), TileType) else ():
        if a not in p.dims:
            raise IRError(f"kernel {kernel}: unknown axis '{a}' in {show_node(n)}")
    match n:
        case Load(name, axes):
            decl = p.tensors.get(name)
            if decl is None:
                raise IRError(f"kernel {kernel}: load of undeclared tensor '{name}'")
            if len(axes) != len(decl.axes):
                raise IRError(f"kernel {kernel}: {show_node(n)} has {len(axes)} axes, "
                              f"'{name}' has {len(decl.axes)}")
            for declared, used in zip(decl.axes, axes):
                a, b = p.dims[declared], p.dims[used]
                if (a.extent, a.block) != (b.extent, b.block):
                    raise IRError(f"kernel {kernel}: {show_node(n)} renames '{declared}' "
                                  f"({a.extent}/{a.block}) to '{used}' ({b.extent}/{b.block})")
            if decl.role != "input" and name not in written:
                raise IRError(f"kernel {kernel}: loads '{name}' before any kernel stores it")
        case Var(name):
            raise IRError(f"kernel {kernel}: free variable '{name}'")
        case Reduce(a, _, _) | BlockReduce(_, a, _) | Dot(a, _, _) if a not in p.dims:
            raise IRError(f"kernel {kernel}: unknown axis '{a}' in {show_node(n)}")


# --------------------------------------------------------------------------------------------
# Printing.  The syntax is the one `bbrules.blockfile` reads back and `.bbr` rules are written in.

_INFIX = {"add": ("+", 1), "sub": ("-", 1), "mul": ("*", 2), "div": ("/", 2)}


def fmt_number(v: float) -> str:
    if v == float("inf"):
        return "inf"
    if v == float("-inf"):
        return "-inf"
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v)}.0"
    return repr(float(v))


def show_node(n: Node, names: dict[Node, str] | None = None, prec: int = 0) -> str:
    """One expression in block syntax; nodes in `names` print as those names."""
    if names and n in names:
        return names[n]

    def sub(x: Node, p: int = 0) -> str:
        return show_node(x, names, p)

    match n:
        case Load(t, axes):
            return f"load({t}[{', '.join(axes)}])"
        case Const(v):
            s = fmt_number(v)
            return f"({s})" if s.startswith("-") and prec > 0 else s
        case Var(name):
            return name
        case Unary(op, x):
            return f"{op}({sub(x)})"
        case Binary(op, x, y) if op in _INFIX:
            sym, p = _INFIX[op]
            s = f"{sub(x, p)} {sym} {sub(y, p + 1)}"
            return f"({s})" if p < prec else s
        case Binary(op, x, y):
            return f"{op}({sub(x)}, {sub(y)})"
        case BlockReduce(op, a, x):
            return f"b{op}({a}, {sub(x)})"
        case Dot(a, x, y):
            return f"dot({a}, {sub(x)}, {sub(y)})"
        case Reduce(a, m, x):
            return f"reduce({a}, {m}, {sub(x)})"
        case Tuple(items):
            return f"tuple({', '.join(sub(i) for i in items)})"
        case Get(i, x):
            return f"get({i}, {sub(x)})"
    raise IRError(f"not an IR node: {n!r}")


def _shared_nodes(root: Node) -> list[Node]:
    """Non-leaf nodes used more than once under root, in post-order: they get a local name."""
    uses: dict[Node, int] = {}
    for n in postorder(root):
        for c in children(n):
            uses[c] = uses.get(c, 0) + 1
    return [n for n in postorder(root)
            if uses.get(n, 0) > 1 and not isinstance(n, (Load, Const, Var))]


def show_kernel(k: Store) -> str:
    """A kernel as `let` bindings for shared subterms followed by its store."""
    names: dict[Node, str] = {}
    lines = [f"kernel {k.tensor}[{', '.join(k.axes)}]:"]
    for i, n in enumerate(_shared_nodes(k.value)):
        lines.append(f"  let t{i} = {show_node(n, names)}")
        names[n] = f"t{i}"
    lines.append(f"  {k.tensor}[{', '.join(k.axes)}] = {show_node(k.value, names)}")
    return "\n".join(lines)


def show_monoid(m: Monoid) -> str:
    def tup(es: tuple[Node, ...]) -> str:
        return "(" + ", ".join(show_node(e) for e in es) + ")"

    return "\n".join([
        f"monoid {m.name}({', '.join(m.state)})",
        f"  identity = {tup(m.identity)}",
        f"  combine  = {tup(m.combine)}",
        f"  finalize = {tup(m.finalize)}",
    ])


def show_program(p: BlockProgram, source: str | None = None) -> str:
    """The whole program in the block-file syntax (what `bbrules show` prints and `-o` writes).

    `source` records the path of the program this one was fused from, so that a tool reading
    the file back can find it.
    """
    out = ["# bbrules block program"]
    if source is not None:
        out.append(f"source {json.dumps(source)}")
    for d in p.dims.values():
        out.append(f"dim {d.name} = {d.extent} / {d.block}")
    for role in ("input", "temp", "output"):
        for t in p.tensors.values():
            if t.role == role:
                out.append(f"{role} {t.name}[{', '.join(t.axes)}] : {t.dtype}")
    for m in p.monoids.values():
        out.append(show_monoid(m))
    for k in p.kernels:
        out.append("")
        out.append(show_kernel(k))
    return "\n".join(out) + "\n"
