"""Rules as data: what a `.bbr` file means once parsed and validated.

A pattern is an IR term (`bbrules.ir` node classes) in which
- a child may be a `PVar` (`?x`), matching any value;
- an axis field (`Reduce.axis`, `Dot.axis`, `BlockReduce.axis`) may be a `PAxis` (`?a`) and a
  monoid field a `PMonoid` (`?m`), matching any axis / monoid;
- a constant may be a `PConst` (`?c`), matching any constant (so rules can fold constants).

Every variable keeps its `?` in its name, as the rule text writes it.

The parser (`bbrules.rulefile`) builds these; the engine (`bbrules.engine.compile`) compiles
them to egglog; the soundness checker (`bbrules.soundness`) instantiates them on random tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

from .errors import Span
from .ir import Const, Monoid, Node


@dataclass(frozen=True)
class PVar:
    """A pattern variable standing for any value (`?x`)."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class PConst:
    """A pattern variable standing for any constant (`?c` in a constant position)."""

    name: str

    def __str__(self) -> str:
        return f"const({self.name})"


@dataclass(frozen=True)
class PAxis:
    """A pattern variable standing for any axis, in an axis field (`?a`)."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class PMonoid:
    """A pattern variable standing for any monoid, in a monoid field (`?m`)."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Stored:
    """`load(store(?v))`: reading back a block that a kernel of this program stored.

    In the e-graph a load of an intermediate tensor carries the value its kernel stores (with
    axes renamed to the load's), so store-to-load forwarding is an ordinary rule over it.
    """

    value: Pattern

    def __str__(self) -> str:
        from .ir import show_node
        return f"load(store({show_node(self.value)}))"


@dataclass(frozen=True)
class AxisSize:
    """`block(?a)`, `extent(?a)` or `trips(?a)`: a size of the axis bound to `?a`, as a constant."""

    kind: str  # "block", "extent" or "trips"
    axis: str  # the axis variable's name


@dataclass(frozen=True)
class CExpr:
    """Arithmetic on constant variables in a right-hand side: `const(?c * ?d)` folds constants."""

    op: str  # a binary or unary operator name from bbrules.ops, over PConst / Const args
    args: tuple[PConst | Const | AxisSize | CExpr, ...]


Pattern = Union[Node, PVar, PConst, Stored, CExpr, AxisSize]


def pattern_var(x: object) -> str | None:
    """The name of the pattern variable `x` stands for in an axis or monoid field, else None."""
    return x.name if isinstance(x, (PAxis, PMonoid)) else None


# Guards -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AxisIn:
    """`?a in shape(?x)` / `?a not in deps(?x)`: membership of an axis in an analysis."""

    axis: str
    analysis: str  # "shape" or "deps"
    var: str
    negated: bool = False


@dataclass(frozen=True)
class AxisEq:
    """`?a == ?b` / `?a != ?b`: two axis variables bound to the same (different) axis."""

    left: str
    right: str
    negated: bool = False


@dataclass(frozen=True)
class TripsEq:
    """`trips(?a) == trips(?b)`: the two axes have the same number of blocks."""

    left: str
    right: str


@dataclass(frozen=True)
class ConstCmp:
    """`?c > 0` or `?c == 1 / extent(?e)`: a comparison on a constant variable."""

    var: str
    op: str  # one of < <= > >= == !=
    value: Const | AxisSize | CExpr


Guard = Union[AxisIn, AxisEq, TripsEq, ConstCmp]


@dataclass(frozen=True)
class Rule:
    """`rule name: lhs => rhs when guards` (one-way) or `<=>` (two-way)."""

    name: str
    lhs: Pattern
    rhs: Pattern
    guards: tuple[Guard, ...] = ()
    bidirectional: bool = False
    ruleset: str = "default"
    doc: str = ""
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Check:
    """A check case: `term` must (or must not, when `negated`) rewrite to `expect`.

    Terms are ground IR terms over loads of tensors declared in the check's `dims`/`tensors`
    header (see the rule-language docs); `expect` is None for a bare "must not change" check.
    `stored` gives the tensors that `load(store(v))` in the terms reads: name -> (its axes,
    the value stored), as a program's kernels would store them.
    """

    rule: str
    term: Node
    expect: Node | None
    negated: bool = False
    dims: dict[str, tuple[int, int]] = field(default_factory=dict)
    span: Span | None = field(default=None, compare=False)
    stored: dict[str, tuple[tuple[str, ...], Node]] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """Rulesets run together, iteration by iteration, until the stage saturates, hits its
    iteration cap or a budget; stages run in order of declaration.

    A later declaration `stage NAME += RULESET` (`RulePack.joins`) adds rulesets to a stage:
    the stage keeps its place and its cap, and the added rulesets run in every iteration of it.
    """

    name: str
    rulesets: tuple[str, ...]
    iterations: int | None = None

    def joined(self, rulesets: tuple[str, ...]) -> Stage:
        """This stage with `rulesets` added to it."""
        return replace(self, rulesets=self.rulesets + rulesets)


@dataclass
class RulePack:
    """Everything one pack (a directory of .bbr files) declares."""

    name: str
    rules: list[Rule] = field(default_factory=list)
    monoids: list[Monoid] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    stages: list[Stage] = field(default_factory=list)
    tolerances: dict[str, float] = field(default_factory=dict)
    joins: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Rulesets this pack adds to stages of packs loaded before it, by stage name."""

    def merge(self, other: RulePack) -> RulePack:
        """`other` loaded on top of this pack: its joins go into this pack's stages, and
        joins into stages neither pack declares stay joins of the result."""
        mine = {s.name for s in self.stages}
        joins = dict(self.joins)
        for stage, rulesets in other.joins.items():
            if stage not in mine:
                joins[stage] = joins.get(stage, ()) + rulesets
        stages = [s.joined(other.joins.get(s.name, ())) for s in self.stages]
        return RulePack(f"{self.name}+{other.name}", self.rules + other.rules,
                        self.monoids + other.monoids, self.checks + other.checks,
                        stages + other.stages, {**self.tolerances, **other.tolerances}, joins)
