"""Reading the saturated e-graph back: e-classes of e-nodes, for extraction."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

from egglog.bindings import EGraph

from ..ir import Node, children
from ..options import Meter
from .compile import CompiledPack
from .terms import TERM_CONSTRUCTORS, ENode, decode, enode_key


@dataclass(frozen=True)
class Firing:
    """One recorded application of a rule direction (egglog ruleset `ruleset`): the e-class
    its left side matched, its variables' values (e-class ids for value variables, strings
    for axes, monoids and stored loads' tensors and axes, floats for constants) and the
    iteration it first happened in."""

    ruleset: str
    root: int
    values: dict[str, object]
    iteration: int


class Recorded:
    """The firings the rules recorded (the rows of `when`), decoded when first asked for.

    Only explanations need them whole, and an explosive pack records many times more firings
    than there are e-nodes: decoding GPT-2's MLP block's 98,000 took a second, as long as its
    extraction, in every fusion.  So the rows are kept as egglog gave them and decoded on
    demand, until the time or memory budget of the `meter` given runs out (`stop` says which
    did: "complete" when all were read, "not read" before).  Counting them per rule needs only
    each row's first column, and is cheap."""

    def __init__(self, egraph: EGraph, rows: list, compiled: CompiledPack,
                 cid: Callable[[object], int]):
        self.egraph = egraph
        self.rows = rows
        self.compiled = compiled
        self.cid = cid
        self.stop = "not read"
        self._firings: tuple[Firing, ...] = ()

    def applications(self) -> dict[str, int]:
        """How many firings each egglog ruleset recorded."""
        by_index = list(self.compiled.provenance.values())
        counts = Counter(self.egraph.value_to_i64(row.inputs[0]) for row in self.rows)
        return {by_index[i].ruleset: n for i, n in counts.items()}

    def firings(self, meter: Meter | None = None) -> tuple[Firing, ...]:
        """The firings, decoded once (a read cut short by `meter` is not tried again)."""
        if self.stop != "not read":
            return self._firings
        by_index = list(self.compiled.provenance.values())
        egraph, monoids = self.egraph, self.compiled.monoids
        read = {"Term": self.cid, "String": egraph.value_to_string, "f64": egraph.value_to_f64}
        slots = [tuple((name, read[sort], at) for name, sort, at in p.slots(self.compiled.widths))
                 for p in by_index]
        firings = []
        self.stop = "complete"
        for n, row in enumerate(self.rows):
            if meter is not None and n % 1024 == 0 and (spent := meter.over()) is not None:
                self.stop = spent
                break
            index = egraph.value_to_i64(row.inputs[0])
            prov, inputs = by_index[index], row.inputs
            values = {name: reader(inputs[at]) for name, reader, at in slots[index]}
            values.update((v, monoids[values[v]]) for v in prov.monoid_vars)
            firings.append(Firing(prov.ruleset, self.cid(row.inputs[1]), values,
                                  egraph.value_to_i64(row.output)))
        self._firings = tuple(firings)
        return self._firings


@dataclass
class ClassGraph:
    """A frozen e-graph: e-classes (ids from 0, in a deterministic order) and their e-nodes,
    and the firings its rules recorded if it was read back with them."""

    classes: dict[int, tuple[ENode, ...]]
    named: dict[str, int]  # e-class of every term added by name (roots, check terms)
    recorded: Recorded | None = field(default=None, repr=False, compare=False)
    index: dict[tuple, int] = field(init=False, repr=False)
    # Terms looked up so far, by identity (node, class): a structurally equal term built
    # separately is looked up on its own rather than compared with the one seen (a comparison
    # walks both terms, so a term compared at every level of itself would be quadratic).
    found: dict[int, tuple[Node, int | None]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # An e-node (kind, attrs, child classes) lives in exactly one e-class.  A load is
        # identified by tensor and axes alone: the value it carries follows from them.
        self.index = {}
        self.found = {}
        for c, nodes in self.classes.items():
            for n in nodes:
                kids = () if n.kind == "Load" else n.children
                self.index[(n.kind, n.attrs, kids)] = c

    def firings(self, meter: Meter | None = None) -> tuple[Firing, ...]:
        """The recorded firings (none if read back without them), read within `meter`'s
        budget the first time they are asked for."""
        return () if self.recorded is None else self.recorded.firings(meter)

    @property
    def stop(self) -> str:
        """How reading the firings went: "complete", "not read" (not asked for yet), or the
        budget that cut it short."""
        return "complete" if self.recorded is None else self.recorded.stop

    @property
    def n_nodes(self) -> int:
        return sum(len(ns) for ns in self.classes.values())

    def enode_of(self, n: Node) -> ENode | None:
        """The e-node representing IR node `n`, if its whole term is in the graph."""
        cls = self.lookup(n)
        if cls is None:
            return None
        kind, attrs = enode_key(n)
        kids = tuple(self.lookup(c) for c in children(n))
        return next(e for e in self.classes[cls] if (e.kind, e.attrs) == (kind, attrs)
                    and (kind == "Load" or e.children == kids))

    def lookup(self, root: Node) -> int | None:
        """The e-class of IR term `root`, or None if the term is not represented.

        Bottom-up over the subterms not looked up before (an explicit stack: any depth)."""
        found = self.found
        stack = [root]
        while stack:
            n = stack[-1]
            if id(n) in found:
                stack.pop()
                continue
            pending = [c for c in children(n) if id(c) not in found]
            if pending:
                stack += pending
                continue
            stack.pop()
            kind, attrs = enode_key(n)
            kids = tuple(found[id(c)][1] for c in children(n))
            found[id(n)] = n, (None if None in kids else self.index.get(
                (kind, attrs, () if kind == "Load" else kids)))
        return found[id(root)][1]


def graph_size(egraph: EGraph) -> tuple[int, int]:
    """(e-nodes, e-classes) of the Term constructors, counted without decoding the rows (a
    read-back after every stage would cost more than the stage itself on a large graph)."""
    functions = egraph.freeze().functions  # each access to the attribute converts them all
    rows = [row for name in TERM_CONSTRUCTORS if (fn := functions.get(name)) is not None
            for row in fn.rows if not row.subsumed]
    return len(rows), len({row.output for row in rows})


def read_back(egraph: EGraph, roots: Mapping[str, str], compiled: CompiledPack,
              provenance: bool = False) -> ClassGraph:
    """The e-graph's e-classes and roots (monoid names read as `compiled`'s monoids), and with
    `provenance` the firings its rules recorded (`Recorded`: decoded when asked for).

    The classes are read whole (extraction needs them all; the node budget bounds them)."""
    functions = egraph.freeze().functions  # each access to the attribute converts them all
    ids: dict[object, int] = {}

    def cid(v: object) -> int:
        return ids.setdefault(v, len(ids))

    classes: dict[int, list[ENode]] = {}
    for name in TERM_CONSTRUCTORS:
        fn = functions.get(name)
        if fn is None:
            continue
        for row in fn.rows:
            if row.subsumed:
                continue
            node = decode(egraph, name, row.inputs, cid, compiled.monoids)
            classes.setdefault(cid(row.output), []).append(node)
    named = {}
    for key, g in roots.items():
        fn = functions[g]
        named[key] = cid(fn.rows[0].output)
    recorded = Recorded(egraph, functions["when"].rows, compiled, cid) if provenance else None
    return ClassGraph({c: tuple(dict.fromkeys(ns)) for c, ns in classes.items()}, named,
                      recorded)
