"""Instantiating a rule on concrete tiles: fresh axes, fresh input tensors, random constants.

Two checks need a rule's sides as ordinary IR terms.  The rule parser asks whether both sides
have the same shape and dependencies (`ir.type_of`) wherever the left side is well formed; the
soundness checker runs both sides through the reference interpreter and compares the numbers.
Both bind each axis variable to a fresh axis, each value variable `?x` to a block of a fresh
input tensor over a random subset of the axes (sometimes reduced in-tile along another axis, so
that its dependencies exceed its shape, sometimes a tuple), each `const(?c)` to a random
constant, and keep the random choices under which the left side type-checks and the guards
hold.  Random search is enough because rule patterns are small; the soundness checker reports
a rule whose left side no random choice satisfies, where the parser's type check has nothing to
say about it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Mapping

from .ir import (BUILTIN_MONOIDS, BlockReduce, Dim, Load, Monoid, Node, Store, TensorDecl,
                 TileType, Tuple, attrs, children, show_node)
from .patterns import Binding, NotInstantiable, checked_type
from .rule import AxisSize, CExpr, ConstCmp, PAxis, Pattern, PConst, PMonoid, PVar, Rule, Stored

def flipped(rule: Rule) -> Rule:
    """The right-to-left direction of a two-way rule, as a rule of its own."""
    return replace(rule, lhs=rule.rhs, rhs=rule.lhs)


def subpatterns(p: Pattern) -> Iterator[Pattern]:
    """`p` and every pattern below it (including CExpr arguments and axis sizes), parents
    first, left to right."""
    stack = [p]
    while stack:
        q = stack.pop()
        yield q
        match q:
            case Stored(v):
                stack.append(v)
            case CExpr(_, args):
                stack += reversed(args)
            case _:
                stack += reversed(children(q))


def variables(p: Pattern) -> dict[str, str]:
    """The pattern variables of `p`, each with its kind: value, axis, monoid or constant."""
    kinds: dict[str, str] = {}
    for s in subpatterns(p):
        match s:
            case PVar(name):
                kinds[name] = "value"
            case PConst(name):
                kinds[name] = "constant"
            case AxisSize(_, axis):
                kinds[axis] = "axis"
            case _ if hasattr(type(s), "kind"):
                for a in attrs(s):
                    if isinstance(a, PAxis):
                        kinds[a.name] = "axis"
                    elif isinstance(a, PMonoid):
                        kinds[a.name] = "monoid"
    return kinds


@dataclass
class Instance(Binding):
    """One binding of a rule's variables, with the dims and input tensors it introduces."""

    dims: dict[str, Dim] = field(default_factory=dict)
    inputs: dict[str, TensorDecl] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{v} = {a} ({self.dims[a].extent}/{self.dims[a].block})"
                 for v, a in self.axes.items()]
        parts += [f"{v} = {m.name}" for v, m in self.monoids.items()]
        parts += [f"{v} = {show_node(n)}" for v, n in self.values.items()]
        parts += [f"{v} = {c!r}" for v, c in self.consts.items()]
        return ", ".join(parts)

    def build(self, p: Pattern, stored: dict[Node, Store]) -> Node:
        """The IR term `p` stands for.  `load(store(v))` becomes a load of a tensor that a
        kernel in `stored` (shared by both sides of a rule) writes."""
        return super().build(p, lambda value: self.stored(value, stored))

    @staticmethod
    def stored(value: Node, stored: dict[Node, Store]) -> Node:
        t = checked_type(value)
        if not isinstance(t, TileType) or t.shape != t.deps:
            raise NotInstantiable("only a value whose shape equals its deps can be stored")
        if value not in stored:
            stored[value] = Store(f"st{len(stored)}", tuple(sorted(t.shape)), value)
        k = stored[value]
        return Load(k.tensor, k.axes)


class _Sampler:
    """Random bindings for one rule's variables.

    A monoid variable is bound to any of `monoids` (the builtins and the rule's pack's); the
    type check then keeps the ones whose arity fits.  A value variable is a tuple at random,
    or exactly when it is in `tuples` if that is given (so a caller can cover every layout).
    """

    BLOCKS = (1, 2, 3, 4)      # block sizes
    TRIPS = (1, 1, 2, 3)       # blocks per axis: a single block is a case of its own
    CONSTANTS = (0.0, 1.0, -1.0, 2.0, 0.5, -0.25)

    def __init__(self, rule: Rule, rng: random.Random, monoids: Mapping[str, Monoid],
                 tuples: frozenset[str] | None = None):
        self.rng = rng
        self.tuples = tuples
        self.monoids = [monoids[name] for name in sorted(monoids)]
        self.kinds = variables(rule.lhs)
        self.fixed = {g.var: g.value for g in rule.guards
                      if isinstance(g, ConstCmp) and g.op == "=="}

    def sample(self) -> Instance:
        rng = self.rng
        by_kind = {k: sorted(v for v, kind in self.kinds.items() if kind == k)
                   for k in ("axis", "monoid", "value", "constant")}
        pool = [f"i{j}" for j in range(len(by_kind["axis"]) + rng.randint(1, 2))]
        inst = Instance({a: self.dim(a) for a in pool})
        chosen = (rng.sample(pool, len(by_kind["axis"])) if rng.random() < 0.8
                  else rng.choices(pool, k=len(by_kind["axis"])))
        inst.axes = dict(zip(by_kind["axis"], chosen))
        inst.monoids = {v: rng.choice(self.monoids) for v in by_kind["monoid"]}
        for v in by_kind["value"]:
            inst.values[v] = self.value(v[1:], pool, inst)
        for v in by_kind["constant"]:
            inst.consts[v] = (rng.choice(self.CONSTANTS) if rng.random() < 0.5
                              else round(rng.uniform(-3.0, 3.0), 3))
        for v, value in self.fixed.items():
            inst.consts[v] = inst.constant(value)
        return inst

    def dim(self, name: str) -> Dim:
        block = self.rng.choice(self.BLOCKS)
        return Dim(name, block * self.rng.choice(self.TRIPS), block)

    def value(self, stem: str, pool: list[str], inst: Instance) -> Node:
        as_tuple = self.rng.random() < 0.15 if self.tuples is None else \
            f"?{stem}" in self.tuples
        if as_tuple:
            n = self.rng.randint(2, 3)
            return Tuple(tuple(self.tile(f"{stem}_{i}", pool, inst) for i in range(n)))
        return self.tile(stem, pool, inst)

    def tile(self, stem: str, pool: list[str], inst: Instance) -> Node:
        """A block of a fresh input; reduced in-tile along extra axes, so deps can exceed shape."""
        rng = self.rng
        shape = [a for a in pool if rng.random() < 0.5]
        extra = [a for a in pool if a not in shape and rng.random() < 0.2]
        name = f"in_{stem}"
        inst.inputs[name] = TensorDecl(name, tuple(shape + extra), "f32", "input")
        node: Node = Load(name, tuple(shape + extra))
        for a in extra:
            node = BlockReduce(rng.choice(("sum", "max")), a, node)
        return node


def value_variables(rule: Rule) -> list[str]:
    """The value variables `?x` of the rule's left side, sorted."""
    return sorted(v for v, kind in variables(rule.lhs).items() if kind == "value")


def instances(rule: Rule, rng: random.Random, tries: int,
              monoids: Mapping[str, Monoid] = BUILTIN_MONOIDS,
              tuples: frozenset[str] | None = None) -> Iterator[Instance]:
    """Random bindings (out of `tries` attempts) under which the guards hold and the left side
    is well formed; monoid variables range over `monoids`; the value variables in `tuples`
    (if given) are tuples and the others single tiles."""
    sampler = _Sampler(rule, rng, monoids, tuples)
    for _ in range(tries):
        inst = sampler.sample()
        try:
            if all(inst.holds(g) for g in rule.guards):
                checked_type(inst.build(rule.lhs, {}))
                yield inst
        except NotInstantiable:
            continue
