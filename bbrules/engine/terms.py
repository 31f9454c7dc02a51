"""The term encoding: IR nodes as egglog `Term` constructors, written and read back.

One datatype `Term` has a constructor per IR node kind, derived from the kinds' declarations
(`ir.kinds`): attributes by their sort (axes, monoids by name, operator names as Strings;
numbers f64; component indices i64), then the children.  A load of a program input is `(Ld tensor "a,b")`; a load of a stored
intermediate is `(LdS tensor "a,b" value)`, carrying the value its kernel stores (renamed to
the load's axes), so store-to-load forwarding is an ordinary rule `load(store(?v)) => ?v`.
Tuples are `Tup2`..`TupN` (egglog constructors have a fixed arity).

Writing (`node_text`, `TermWriter`) and reading back (`decode`, `ENode.build`, `enode_key`)
live together here, so the two directions of the encoding cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from egglog.bindings import EGraph

from ..ir import KINDS, Kind, Load, Monoid, Node, Sort, Var, attrs, build, children, rename_axes
from ..rule import PAxis, Pattern, PMonoid

MIN_TUPLE = 2
MAX_TUPLE = 8


@dataclass(frozen=True)
class ENode:
    """One e-node: an IR node whose children are e-class ids.

    `kind` is the IR class name (`Load`, `Const`, `Unary`, ...).  `attrs` are its attribute
    fields in declaration order (`ir.attrs`), a reduction's monoid as the `Monoid` itself.  A
    load of a stored intermediate has its carried value's class as its only child.
    """

    kind: str
    attrs: tuple
    children: tuple[int, ...]

    def build(self, kids: tuple[Node, ...]) -> Node:
        """The IR node with the given child terms (a stored load ignores its carried value)."""
        return build(KIND_BY_NAME[self.kind], self.attrs, kids)


def enode_key(n: Node) -> tuple[str, tuple]:
    """(kind, attrs) of an IR node, as its e-node has them."""
    return type(n).__name__, attrs(n)


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _f64(v: float) -> str:
    """`v` as an egglog f64 literal: Python's spelling, but for NaN, which egglog spells
    `NaN` (`nan` is an unbound name to it)."""
    v = float(v)
    return "NaN" if math.isnan(v) else repr(v)


def _attr_text(value: object, sort: Sort) -> str:
    """An attribute as an egglog literal (or a pattern variable), by what its field holds."""
    match value:
        case PAxis(name) | PMonoid(name):
            return name
    match sort:
        case Sort.AXES:
            return _q(",".join(value))  # type: ignore[arg-type]
        case Sort.NUMBER:
            return _f64(value)  # type: ignore[arg-type]
        case Sort.INDEX:
            return str(int(value))  # type: ignore[call-overload]
        case Sort.MONOID:
            return _q(value.name)  # type: ignore[attr-defined]
    return _q(str(value))


def _set(axes: Iterable[str]) -> str:
    items = sorted(set(axes))
    return f"(set-of {' '.join(map(_q, items))})" if items else "(set-empty)"



def node_text(p: Pattern, sub: Callable[[Pattern], str]) -> str:
    """One constructor application in egglog syntax, its children written by `sub`."""
    kind = getattr(type(p), "kind", None)
    if kind is None or kind.egg is None:
        raise ValueError(f"not a term node: {p!r}")
    args = [_attr_text(getattr(p, f), kind.sort_of(f)) for f in kind.attr_fields]
    kids = [sub(c) for c in children(p)]
    egg = kind.egg
    if any(s is Sort.CHILDREN for _, s in kind.fields):
        if not MIN_TUPLE <= len(kids) <= MAX_TUPLE:
            raise ValueError(f"tuples have {MIN_TUPLE} to {MAX_TUPLE} components")
        egg += str(len(kids))
    return f"({' '.join([egg, *args, *kids])})"


_EGG_SORT = {Sort.NUMBER: "f64", Sort.INDEX: "i64", Sort.CHILD: "Term"}


def _constructors() -> dict[str, tuple[Kind, tuple[str, ...]]]:
    """Every Term constructor: its kind and its argument sorts.  A tuple has one constructor
    per arity (egglog constructors have a fixed arity); a load of a stored intermediate
    (`LdS`) carries the value it reads as one more argument."""
    out = {}
    for cls in KINDS:
        kind = cls.kind
        if kind.egg is None:
            continue
        sorts = tuple(_EGG_SORT.get(s, "String") for f, s in kind.fields if not s.is_child)
        kids = tuple("Term" for _, s in kind.child_fields if s is Sort.CHILD)
        if any(s is Sort.CHILDREN for _, s in kind.fields):
            for n in range(MIN_TUPLE, MAX_TUPLE + 1):
                out[f"{kind.egg}{n}"] = (kind, sorts + ("Term",) * n)
        else:
            out[kind.egg] = (kind, sorts + kids)
        if cls is Load:
            out["LdS"] = (kind, sorts + ("Term",))
    return out


CONSTRUCTORS = _constructors()
TERM_CONSTRUCTORS = tuple(CONSTRUCTORS)
KIND_BY_NAME = {cls.__name__: cls.kind for cls in KINDS}

TERM_DATATYPE = f"""
(datatype Term
  {' '.join(f"({' '.join((name, *sorts))})" for name, (_, sorts) in CONSTRUCTORS.items())})
"""


class TermWriter:
    """Writes IR terms into egglog text as `let` bindings, sharing equal subterms.

    `stored` maps an intermediate tensor to (its declared axes, the value its kernel stores):
    a load of it becomes `LdS` carrying that value renamed to the load's axes.
    """

    def __init__(self, prefix: str = "n",
                 stored: Mapping[str, tuple[tuple[str, ...], Node]] | None = None):
        self.prefix = prefix
        self.stored = dict(stored or {})
        self.names: dict[Node, str] = {}
        self.lines: list[str] = []

    def name(self, root: Node) -> str:
        """The global naming `root`, binding it and every subterm not yet bound, children
        first (an explicit stack: terms of any depth)."""
        stack: list[tuple[Node, bool]] = [(root, False)]
        carried: dict[Node, Node | None] = {}
        while stack:
            n, ready = stack.pop()
            if n in self.names:
                continue
            if isinstance(n, Load) and n.tensor in self.stored and n not in carried:
                decl_axes, value = self.stored[n.tensor]
                carried[n] = rename_axes(value, dict(zip(decl_axes, n.axes)))
            needs = ([carried[n]] if carried.get(n) is not None
                     else [] if isinstance(n, Load) else list(children(n)))
            if not ready:
                stack.append((n, True))
                stack.extend((c, False) for c in reversed(needs) if c not in self.names)
                continue
            match n:
                case Load(t, axes) if carried.get(n) is not None:
                    text = f"(LdS {_q(t)} {_q(','.join(axes))} {self.names[carried[n]]})"
                case Load(t, axes):
                    text = f"(Ld {_q(t)} {_q(','.join(axes))})"
                case Var(v):
                    raise ValueError(f"free variable '{v}' in a term")
                case _:
                    text = node_text(n, self.names.__getitem__)
            self._bind(n, text)
        return self.names[root]

    def _bind(self, n: Node, text: str) -> None:
        g = f"${self.prefix}{len(self.names)}"
        self.names[n] = g
        self.lines.append(f"(let {g} {text})")
        if isinstance(n, Load):
            axes = _set(n.axes)
            self.lines.append(f"(set (shape {g}) {axes})")
            self.lines.append(f"(set (deps {g}) {axes})")


def decode(egraph: EGraph, name: str, inputs: list, cid: Callable[[object], int],
           monoids: Mapping[str, Monoid]) -> ENode:
    """One row of a Term constructor as an e-node, attributes decoded by their sorts."""
    kind = CONSTRUCTORS[name][0]
    values = [decode_attr(egraph, kind.sort_of(f), v, monoids)
              for f, v in zip(kind.attr_fields, inputs)]
    kids = tuple(cid(v) for v in inputs[len(kind.attr_fields):])
    return ENode(kind.name, tuple(values), kids)


def decode_attr(egraph: EGraph, sort: Sort, value: object, monoids: Mapping[str, Monoid]
                ) -> object:
    """One attribute value read back, by the sort of its field."""
    match sort:
        case Sort.NUMBER:
            return egraph.value_to_f64(value)
        case Sort.INDEX:
            return egraph.value_to_i64(value)
        case Sort.AXES:
            return _axes(egraph.value_to_string(value))
        case Sort.MONOID:
            return monoids[egraph.value_to_string(value)]
    return egraph.value_to_string(value)


def _axes(text: str) -> tuple[str, ...]:
    return tuple(text.split(",")) if text else ()
