"""Printing.  The syntax is the one `bbrules.blockfile` reads back and `.bbr` rules are
written in; everything but loads, numbers, variables and infix arithmetic is printed from the
kinds' declared call syntax."""

from __future__ import annotations

import json
from typing import Any

from .kinds import Sort, children, is_node, kind_of, postorder
from .monoid import Monoid
from .nodes import Binary, Const, Load, Node, Var
from .program import BlockProgram, Kernel

INFIX = {"add": ("+", 1), "sub": ("-", 1), "mul": ("*", 2), "div": ("/", 2)}


def fmt_number(v: float) -> str:
    if v != v:
        return "nan"  # a constant folded from a rule (rsqrt(-1.0)), in a counterexample
    if v == float("inf"):
        return "inf"
    if v == float("-inf"):
        return "-inf"
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v)}.0"
    return repr(float(v))


def _attr_text(v: Any) -> str:
    """An attribute as block syntax: a monoid by its name, a pattern variable by its own."""
    if isinstance(v, Monoid):
        return v.name
    return str(v)


def show_node(n: Any, names: dict[Node, str] | None = None, prec: int = 0) -> str:
    """One expression in block syntax; nodes in `names` print as those names.  A pattern
    (with variables) prints as the rule language writes it.

    Text is produced left to right from an explicit stack of pieces, so an expression of any
    depth prints in time and stack space linear in its size.
    """
    out: list[str] = []
    stack: list[str | tuple[Any, int]] = [(n, prec)]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        else:
            stack.extend(reversed(_pieces(*item, names)))
    return "".join(out)


Piece = str | tuple[Any, int]  # text, or a subterm to print at a precedence


def _pieces(n: Any, prec: int, names: dict[Node, str] | None) -> list[Piece]:
    """`n` printed at precedence `prec`, one level deep: its own text and its subterms."""
    if names and n in names:
        return [names[n]]
    if not is_node(n) or not hasattr(type(n), "kind"):
        return [str(n)]
    match n:
        case Load(t, axes):
            return [f"load({t}[{', '.join(map(str, axes))}])"]
        case Const(v):
            s = fmt_number(v)
            return [f"({s})" if s.startswith("-") and prec > 0 else s]
        case Var(name):
            return [name]
        case Binary(op, x, y) if op in INFIX:
            sym, p = INFIX[op]
            inner: list[Piece] = [(x, p), f" {sym} ", (y, p + 1)]
            return ["(", *inner, ")"] if p < prec else inner
    kind = kind_of(n)
    op = next((n.__dict__[f] for f, s in kind.fields if s is Sort.OP), None)
    args: list[Piece] = [_attr_text(n.__dict__[f]) for f, s in kind.fields
                         if not s.is_child and s is not Sort.OP]
    args += [(c, 0) for c in children(n)]
    pieces: list[Piece] = [f"{kind.call.format(op=op)}("]
    for i, a in enumerate(args):
        pieces += [", ", a] if i else [a]
    return [*pieces, ")"]


def _shared_nodes(roots: tuple[Node, ...]) -> list[Node]:
    """Non-leaf nodes used more than once under the roots, in post-order: they get a local
    name."""
    uses: dict[Node, int] = {}
    for root in roots:
        for n in postorder(root):
            for c in children(n):
                uses[c] = uses.get(c, 0) + 1
    for root in roots:  # a root another root also uses is shared too
        if root in uses:
            uses[root] += 1
    return [n for n in dict.fromkeys(m for root in roots for m in postorder(root))
            if uses.get(n, 0) > 1 and children(n)]


def show_kernel(k: Kernel) -> str:
    """A kernel as `let` bindings for shared subterms followed by its stores.

    The header names the store and its axes when the kernel is one store over its own axes
    (`kernel Y[r, c]:`), and otherwise only the grid (`kernel [r]:`): the stores' other axes
    are its map loops.  The kernel's own block sizes follow (`kernel [r] with r / 16:`)."""
    names: dict[Node, str] = {}
    own = f" with {', '.join(f'{a} / {b}' for a, b in k.blocks)}" if k.blocks else ""
    if len(k.stores) == 1 and k.grid == k.stores[0].axes:
        lines = [f"kernel {k.stores[0].tensor}[{', '.join(k.grid)}]{own}:"]
    else:
        lines = [f"kernel [{', '.join(k.grid)}]{own}:"]
    for i, n in enumerate(_shared_nodes(tuple(s.value for s in k.stores))):
        lines.append(f"  let t{i} = {show_node(n, names)}")
        names[n] = f"t{i}"
    for s in k.stores:
        lines.append(f"  {s.tensor}[{', '.join(s.axes)}] = {show_node(s.value, names)}")
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


def show_program(p: BlockProgram, source: str | None = None,
                 source_text: str | None = None) -> str:
    """The whole program in the block-file syntax (what `bbrules show` prints and `-o` writes).

    `source` records the path of the program this one was fused from, and `source_text` (with
    a `source`) its text, each line after "| ": a tool reading the file back compares the two
    programs without depending on where the source file is now.
    """
    out = ["# bbrules block program"]
    if source is not None:
        out.append(f"source {json.dumps(source)}")
        out += [f"| {line}".rstrip() for line in (source_text or "").splitlines()]
    for d in p.dims.values():
        out.append(f"dim {d.name} = {d.extent} / {d.block}")
    for role in ("input", "temp", "output"):
        for t in p.tensors.values():
            if t.role == role:
                out.append(f"{role} {t.name}[{', '.join(t.axes)}] : {t.dtype}")
    for t in p.tensors.values():
        if t.role == "view":
            out.append(f"view {t.name}[{', '.join(t.axes)}] : {t.dtype} = {t.base}")
    for m in p.monoids.values():
        out.append(show_monoid(m))
    for k in p.kernels:
        out.append("")
        out.append(show_kernel(k))
    return "\n".join(out) + "\n"
