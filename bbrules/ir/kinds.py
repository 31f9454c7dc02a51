"""How a node kind is declared, and everything generic derived from the declaration.

A node kind is a frozen dataclass decorated with `@node(...)`.  Each field says what it holds
(its `Sort`): an attribute (a tensor or operator name, an axis, a tuple of axes, a number, a
component index, a monoid) or a child (one value, or a tuple of values).  From that one
declaration this module derives what every pass needs without knowing the kinds:

- `children(n)` and `rebuild(n, kids)`;
- `attrs(n)`, the attribute values in field order (with the kind, a node's key in an e-graph);
- `map_attrs(n, sort, f, kids)`, which renames axes or substitutes pattern variables;
- `postorder(root)`, each distinct node once, children first, without recursion;
- the surface syntax (`Kind.call`, the function name in `.bbk` and `.bbr` text), the egglog
  constructor (`Kind.egg`) and the type rule (the class's `infer` method), which the printer,
  the expression resolver, the engine and `type_of` read.

Passes with real per-kind semantics (the interpreter, flops, each code generator) register one
implementation per kind in a `KindTable`; a test fails when a table lacks a kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from functools import cached_property
from operator import attrgetter
from typing import Any, Callable, Iterator, Mapping

from .types import IRError


class Sort(Enum):
    """What a field of a node holds."""

    TENSOR = "tensor"        # the name of a global tensor
    AXES = "axes"            # a tuple of axis names (a load's tile axes)
    AXIS = "axis"            # one axis the node works along (a pattern may hold a variable)
    OP = "op"                # an operator name from the kind's operator table
    NUMBER = "number"        # a float constant
    INDEX = "index"          # a tuple component index
    NAME = "name"            # a variable name inside a monoid's expressions
    MONOID = "monoid"        # a `Monoid` (a pattern may hold a variable)
    CHILD = "child"          # one value node
    CHILDREN = "children"    # a tuple of value nodes

    @property
    def is_child(self) -> bool:
        return self in (Sort.CHILD, Sort.CHILDREN)


def attr(sort: Sort, ops: Mapping[str, Any] | None = None) -> Any:
    """Declare an attribute field; `ops` is the table an OP field's names come from."""
    return field(metadata={"sort": sort, "ops": ops})


def child() -> Any:
    return field(metadata={"sort": Sort.CHILD})


def children_field() -> Any:
    return field(metadata={"sort": Sort.CHILDREN})


@dataclass(frozen=True)
class Kind:
    """The declaration of one node kind, as the generic passes read it.

    `call` is the function name in block syntax; `{op}` in it is replaced by the OP field
    (`b{op}` gives bsum, bmax, bmin).  None marks a kind with a syntax of its own (loads,
    numbers, variables).  `egg` is the egglog constructor, None for kinds that never enter the
    e-graph.  `loop` marks a kind whose AXIS field is a sequential loop: the node no longer
    depends on that axis.  `elementwise` kinds may appear in a monoid's expressions; each
    applies one operator of `ops` to its children (named by its OP field, or by its call when
    the kind has none), so the passes treat them all alike through `operator`.
    """

    cls: type
    name: str
    fields: tuple[tuple[str, Sort], ...]
    call: str | None
    egg: str | None
    loop: bool
    elementwise: bool
    ops: Mapping[str, Any] | None

    # Derived once per kind: the generic operations below run on every node of every pass.

    @cached_property
    def attr_fields(self) -> tuple[str, ...]:
        return tuple(f for f, s in self.fields if not s.is_child)

    @cached_property
    def child_fields(self) -> tuple[tuple[str, Sort], ...]:
        return tuple((f, s) for f, s in self.fields if s.is_child)

    @cached_property
    def variadic(self) -> bool:
        """Whether the children are one tuple field (a `Tuple`)."""
        return any(s is Sort.CHILDREN for _, s in self.fields)

    @cached_property
    def child_getter(self) -> Callable[[Any], tuple[Any, ...]]:
        """A node's children as a tuple, read as directly as the declaration allows."""
        names = [f for f, _ in self.child_fields]
        if self.variadic:
            return attrgetter(names[0])
        if len(names) == 1:
            return lambda n, f=names[0]: (n.__dict__[f],)
        return attrgetter(*names) if names else lambda n: ()

    @cached_property
    def sorts(self) -> dict[str, Sort]:
        return dict(self.fields)

    def sort_of(self, name: str) -> Sort:
        return self.sorts[name]

    @property
    def params(self) -> tuple[str, ...]:
        """The parameters of the call syntax: attributes but the operator, then children."""
        return (tuple(f for f, s in self.fields if not s.is_child and s is not Sort.OP)
                + tuple(f for f, _ in self.child_fields))

    def calls(self) -> Iterator[tuple[str, str | None]]:
        """(function name, operator) for every spelling of this kind in block syntax."""
        if self.call is None:
            return
        if "{op}" in self.call:
            for op in self.ops or ():
                yield self.call.format(op=op), op
        else:
            yield self.call, None


KINDS: list[type] = []  # every node kind, in declaration order (filled by @node)


def _cached_hash(self: object) -> int:
    """A node's hash, computed once.  Nodes form DAGs: the generated dataclass hash would walk
    every shared subterm again on each dict or set operation, which made extraction quadratic.
    The subterms not hashed yet are hashed first, children before parents, so that hashing a
    term thousands of levels deep does not recurse."""
    h = self.__dict__.get("_hash")
    if h is None:
        stack, order, seen = [self], [], set()
        while stack:
            n = stack.pop()
            if "_hash" not in n.__dict__ and id(n) not in seen:
                seen.add(id(n))
                order.append(n)
                stack += [c for c in children(n) if is_node(c)]
        for n in reversed(order):
            if "_hash" not in n.__dict__:
                object.__setattr__(n, "_hash", hash((type(n).__name__, *(
                    n.__dict__[f] for f in n.__dataclass_fields__))))
        h = self.__dict__["_hash"]
    return h


def is_node(x: object) -> bool:
    return getattr(type(x), "__hash__", None) is _cached_hash


def _representative(n: object) -> object:
    """The node `n` was last proven equal to, followed to the end (see `_dag_eq`)."""
    while (m := n.__dict__.get("_equal")) is not None:
        n = m
    return n


def _dag_eq(self: object, other: object) -> bool:
    """Structural equality in time linear in the DAGs' sizes, and constant once proven.

    The generated dataclass equality compares two equal DAGs built separately as trees,
    revisiting every shared subterm once per path to it: exponential in the depth of a fused
    program.  Here each pair of subterms is compared once, and every pair found equal is
    remembered (each points at one representative) so that comparing subterms of the same two
    programs again costs nothing: a program loaded twice, whose nodes meet in a cache filled
    from the first load, would otherwise be compared in full at every lookup.
    """
    if self is other:
        return True
    if type(self) is not type(other) or hash(self) != hash(other):
        return False
    mine, theirs = self.__dict__, other.__dict__
    for f in self.__dataclass_fields__:  # the usual case: children shared, so one level
        x, y = mine[f], theirs[f]
        if x is y:
            continue
        if is_node(x) or isinstance(x, tuple):
            break
        if x != y:
            return False
    else:
        return True
    if _representative(self) is _representative(other):
        return True
    seen: set[tuple[int, int]] = set()
    equal: list[tuple[object, object]] = []
    stack = [(self, other)]
    while stack:
        a, b = stack.pop()
        if a is b or (id(a), id(b)) in seen:
            continue
        if type(a) is not type(b) or hash(a) != hash(b):
            return False
        seen.add((id(a), id(b)))
        ra, rb = _representative(a), _representative(b)
        if ra is rb:
            continue
        equal.append((ra, rb))
        for f in a.__dataclass_fields__:
            x, y = a.__dict__[f], b.__dict__[f]
            if isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y):
                pairs = zip(x, y)
            else:
                pairs = ((x, y),)
            for u, v in pairs:
                if u is v:
                    continue
                if is_node(u) and is_node(v):
                    stack.append((u, v))
                elif u != v:
                    return False
    for a, b in equal:
        a, b = _representative(a), _representative(b)
        if a is not b:
            object.__setattr__(b, "_equal", a)
    return True


def node(*, call: str | None = None, egg: str | None = None, loop: bool = False,
         elementwise: bool = False, ops: Mapping[str, Any] | None = None
         ) -> Callable[[type], type]:
    """Declare a node kind: make the class a frozen dataclass with DAG-friendly hashing and
    equality, and record its `Kind` (as `cls.kind`) in `KINDS`."""
    def declare(cls: type) -> type:
        cls.__hash__ = _cached_hash  # type: ignore[method-assign]
        cls.__eq__ = _dag_eq  # type: ignore[method-assign]
        cls = dataclass(frozen=True, eq=False)(cls)
        declared = tuple((f.name, f.metadata["sort"]) for f in fields(cls))
        sorts = [s.is_child for _, s in declared]
        if sorts != sorted(sorts):
            raise TypeError(f"{cls.__name__}: declare attributes before children")
        table = next((f.metadata.get("ops") for f in fields(cls)
                      if f.metadata["sort"] is Sort.OP), ops)
        cls.kind = Kind(cls, cls.__name__, declared, call, egg, loop, elementwise, table)
        KINDS.append(cls)
        return cls
    return declare


def kind_of(n: object) -> Kind:
    return type(n).kind  # type: ignore[attr-defined]


def is_elementwise(n: object) -> bool:
    kind = getattr(type(n), "kind", None)
    return kind is not None and kind.elementwise


def operator(n: Any) -> Any:
    """The operator (an `ops.OpInfo`) an elementwise node applies to its children."""
    kind = kind_of(n)
    op = next((n.__dict__[f] for f, s in kind.fields if s is Sort.OP), kind.call)
    return kind.ops[op]


# --------------------------------------------------------------------------------------------
# Generic structure


def children(n: object) -> tuple[Any, ...]:
    """The child values of a node, in field order (none for a pattern variable)."""
    kind = getattr(type(n), "kind", None)
    if kind is None:
        return ()
    return kind.child_getter(n)


def attrs(n: object) -> tuple[Any, ...]:
    """The attribute values of a node, in field order."""
    d = n.__dict__
    return tuple(d[f] for f in kind_of(n).attr_fields)


def rebuild(n: Any, kids: tuple[Any, ...]) -> Any:
    """`n` with its children replaced by `kids` (in the order `children` gives them)."""
    if not kids and not kind_of(n).child_fields:
        return n
    return build(kind_of(n), attrs(n), kids)


def build(kind: Kind, attr_values: tuple[Any, ...], kids: tuple[Any, ...]) -> Any:
    """A node of `kind` from its attribute values and its children, each in field order."""
    if kind.variadic:
        return kind.cls(*attr_values, tuple(kids))
    return kind.cls(*attr_values, *kids[:len(kind.child_fields)])


def map_attrs(n: Any, sort: Sort, f: Callable[[Any], Any], kids: tuple[Any, ...]) -> Any:
    """`n` rebuilt over `kids` with every attribute of `sort` passed through `f` (AXIS fields
    and each axis of AXES fields for `Sort.AXIS`)."""
    kind = kind_of(n)
    values = []
    for name in kind.attr_fields:
        v, s = n.__dict__[name], kind.sort_of(name)
        if s is sort or (sort is Sort.AXIS and s is Sort.AXES):
            v = tuple(map(f, v)) if s is Sort.AXES else f(v)
        values.append(v)
    return build(kind, tuple(values), kids)


def postorder(root: Any) -> Iterator[Any]:
    """Each distinct node of the DAG under `root` once, children before parents."""
    seen: set[Any] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        n, expanded = stack.pop()
        if expanded:
            yield n
            continue
        if n in seen:
            continue
        seen.add(n)
        stack.append((n, True))
        stack.extend((c, False) for c in reversed(children(n)) if is_node(c))


def transform(root: Any, f: Callable[[Any, tuple[Any, ...]], Any]) -> Any:
    """Rebuild the DAG under `root` bottom-up: `f(node, new_children)` gives each new node.

    Shared subterms are transformed once; no recursion, so depth is unbounded.
    """
    memo: dict[Any, Any] = {}
    for n in postorder(root):
        memo[n] = f(n, tuple(memo[c] if is_node(c) else c for c in children(n)))
    return memo[root]


# --------------------------------------------------------------------------------------------
# Per-kind semantics


class KindTable:
    """One pass's semantics, one implementation per node kind (`@table.on(Unary)`).

    `table(node, *args)` calls the implementation registered for the node's kind; `missing()`
    names the kinds without one, which the coverage test reports.  `exempt` lists kinds that
    cannot reach this pass, each with the reason.
    """

    def __init__(self, name: str, exempt: Mapping[type, str] | None = None):
        self.name = name
        self.impl: dict[type, Callable[..., Any]] = {}
        self.exempt = dict(exempt or {})

    def on(self, *kinds: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            for k in kinds:
                self.impl[k] = fn
            return fn
        return register

    def __call__(self, n: Any, *args: Any, **kwargs: Any) -> Any:
        fn = self.impl.get(type(n))
        if fn is None:
            raise IRError(f"{self.name}: no implementation for {type(n).__name__} nodes")
        return fn(n, *args, **kwargs)

    def missing(self) -> list[str]:
        return [k.__name__ for k in KINDS if k not in self.impl and k not in self.exempt]
