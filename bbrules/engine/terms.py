"""The term encoding: IR nodes as egglog `Term` constructors, written and read back.

One datatype `Term` has a constructor per IR node.  Axes, monoids and operator names are
Strings, constants f64.  A load of a program input is `(Ld tensor "a,b")`; a load of a stored
intermediate is `(LdS tensor "a,b" value)`, carrying the value its kernel stores (renamed to
the load's axes), so store-to-load forwarding is an ordinary rule `load(store(?v)) => ?v`.
Tuples are `Tup2`..`TupN` (egglog constructors have a fixed arity).

Writing (`node_text`, `TermWriter`) and reading back (`decode`, `ENode.build`, `enode_key`)
live together here, so the two directions of the encoding cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from egglog.bindings import EGraph

from ..axes import rename_axes
from ..ir import (Binary, BlockReduce, Const, Dot, Get, Load, Node, Reduce, Tuple, Unary, Var)
from ..rule import Pattern

MIN_TUPLE = 2
MAX_TUPLE = 8


@dataclass(frozen=True)
class ENode:
    """One e-node: an IR node whose children are e-class ids.

    `kind` is the IR class name (`Load`, `Const`, `Unary`, ...).  `attrs` are its non-child
    fields in IR order: (tensor, axes) for a load, (value,) for a constant, (op,) for unary and
    binary, (op, axis) for `BlockReduce`, (axis,) for `Dot`, (axis, monoid) for `Reduce`,
    (index,) for `Get`, () for `Tuple`.  A load of a stored intermediate has its carried value's
    class as its only child.
    """

    kind: str
    attrs: tuple
    children: tuple[int, ...]

    def build(self, kids: tuple[Node, ...]) -> Node:
        """The IR node with the given child terms (a stored load ignores its carried value)."""
        match self.kind:
            case "Load":
                return Load(self.attrs[0], self.attrs[1])
            case "Const":
                return Const(self.attrs[0])
            case "Unary":
                return Unary(self.attrs[0], kids[0])
            case "Binary":
                return Binary(self.attrs[0], kids[0], kids[1])
            case "BlockReduce":
                return BlockReduce(self.attrs[0], self.attrs[1], kids[0])
            case "Dot":
                return Dot(self.attrs[0], kids[0], kids[1])
            case "Reduce":
                return Reduce(self.attrs[0], self.attrs[1], kids[0])
            case "Tuple":
                return Tuple(kids)
            case "Get":
                return Get(self.attrs[0], kids[0])
        raise ValueError(f"unknown e-node kind {self.kind}")


def enode_key(n: Node) -> tuple[str, tuple]:
    """(kind, attrs) of an IR node, as its e-node has them."""
    match n:
        case Load(t, axes):
            return "Load", (t, axes)
        case Const(v):
            return "Const", (v,)
        case Unary(op, _) | Binary(op, _, _):
            return type(n).__name__, (op,)
        case BlockReduce(op, a, _):
            return "BlockReduce", (op, a)
        case Dot(a, _, _):
            return "Dot", (a,)
        case Reduce(a, m, _):
            return "Reduce", (a, m)
        case Get(i, _):
            return "Get", (i,)
        case Tuple():
            return "Tuple", ()
    raise ValueError(f"not a term node: {n!r}")



def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _f64(v: float) -> str:
    return repr(float(v))


def _axis(a: str) -> str:
    return a if a.startswith("?") else _q(a)


def _set(axes: Iterable[str]) -> str:
    items = sorted(set(axes))
    return f"(set-of {' '.join(map(_q, items))})" if items else "(set-empty)"



def node_text(p: Pattern, sub: Callable[[Pattern], str]) -> str:
    """One constructor application in egglog syntax, its children written by `sub`."""
    match p:
        case Load(t, axes):
            return f"(Ld {_q(t)} {_q(','.join(axes))})"
        case Const(v):
            return f"(Cst {_f64(v)})"
        case Unary(op, x):
            return f"(Un {_q(op)} {sub(x)})"
        case Binary(op, x, y):
            return f"(Bin {_q(op)} {sub(x)} {sub(y)})"
        case BlockReduce(op, a, x):
            return f"(BRed {_q(op)} {_axis(a)} {sub(x)})"
        case Dot(a, x, y):
            return f"(Dot {_axis(a)} {sub(x)} {sub(y)})"
        case Reduce(a, m, x):
            return f"(Red {_axis(a)} {_axis(m)} {sub(x)})"
        case Tuple(items):
            if not MIN_TUPLE <= len(items) <= MAX_TUPLE:
                raise ValueError(f"tuples have {MIN_TUPLE} to {MAX_TUPLE} components")
            return f"(Tup{len(items)} {' '.join(sub(i) for i in items)})"
        case Get(i, x):
            return f"(Get {i} {sub(x)})"
    raise ValueError(f"not a node: {p!r}")



TERM_DATATYPE = f"""
(datatype Term
  (Ld String String)
  (LdS String String Term)
  (Cst f64)
  (Un String Term)
  (Bin String Term Term)
  (BRed String String Term)
  (Dot String Term Term)
  (Red String String Term)
  {' '.join(f"(Tup{n} {' '.join(['Term'] * n)})" for n in range(MIN_TUPLE, MAX_TUPLE + 1))}
  (Get i64 Term))
"""

TERM_CONSTRUCTORS = ("Ld", "LdS", "Cst", "Un", "Bin", "BRed", "Dot", "Red", "Get",
                     *(f"Tup{n}" for n in range(MIN_TUPLE, MAX_TUPLE + 1)))


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

    def name(self, n: Node) -> str:
        if n in self.names:
            return self.names[n]
        match n:
            case Load(t, axes) if t in self.stored:
                decl_axes, value = self.stored[t]
                carried = rename_axes(value, dict(zip(decl_axes, axes)))
                text = (f"(LdS {_q(t)} {_q(','.join(axes))} {self.name(carried)})"
                        if carried is not None else f"(Ld {_q(t)} {_q(','.join(axes))})")
            case Load(t, axes):
                text = f"(Ld {_q(t)} {_q(','.join(axes))})"
            case Var(v):
                raise ValueError(f"free variable '{v}' in a term")
            case _:
                text = node_text(n, self.name)
        g = f"${self.prefix}{len(self.names)}"
        self.names[n] = g
        self.lines.append(f"(let {g} {text})")
        if isinstance(n, Load):
            axes = _set(n.axes)
            self.lines.append(f"(set (shape {g}) {axes})")
            self.lines.append(f"(set (deps {g}) {axes})")
        return g



def decode(egraph: EGraph, name: str, inputs: list, cid: Callable[[object], int]) -> ENode:
    s = egraph.value_to_string
    match name:
        case "Ld":
            return ENode("Load", (s(inputs[0]), _axes(s(inputs[1]))), ())
        case "LdS":
            return ENode("Load", (s(inputs[0]), _axes(s(inputs[1]))), (cid(inputs[2]),))
        case "Cst":
            return ENode("Const", (egraph.value_to_f64(inputs[0]),), ())
        case "Un":
            return ENode("Unary", (s(inputs[0]),), (cid(inputs[1]),))
        case "Bin":
            return ENode("Binary", (s(inputs[0]),), (cid(inputs[1]), cid(inputs[2])))
        case "BRed":
            return ENode("BlockReduce", (s(inputs[0]), s(inputs[1])), (cid(inputs[2]),))
        case "Dot":
            return ENode("Dot", (s(inputs[0]),), (cid(inputs[1]), cid(inputs[2])))
        case "Red":
            return ENode("Reduce", (s(inputs[0]), s(inputs[1])), (cid(inputs[2]),))
        case "Get":
            return ENode("Get", (egraph.value_to_i64(inputs[0]),), (cid(inputs[1]),))
    return ENode("Tuple", (), tuple(cid(v) for v in inputs))


def _axes(text: str) -> tuple[str, ...]:
    return tuple(text.split(",")) if text else ()
