"""Node kinds are declared once: every generic path derived from the declarations covers every
kind, and every pass with per-kind semantics has an implementation for each.

A new kind that lacks a backend implementation, a syntax that reads back, or an e-graph
encoding fails here, before any program needs it.
"""

from __future__ import annotations

import importlib
import shutil

import numpy as np
import pytest

from bbrules import interp
from bbrules.blockfile import parse_block_program
from bbrules.codegen import cuda_gen, numpy_gen, triton_gen
from bbrules.engine import CONSTRUCTORS, Saturator, compile_pack
from bbrules.inputs import random_inputs
from bbrules.ir import (KINDS, KindTable, attrs, children, kind_of, map_attrs, postorder,
                        rebuild, show_program)
from bbrules.ir.kinds import Sort
from bbrules.rule import RulePack
from bbrules.targets import get_target
from cuda_emu import emulate
from test_blockfile import every_node

cost = importlib.import_module("bbrules.cost")  # `bbrules.cost` is the API function

PASSES = [interp, cost, numpy_gen, cuda_gen, triton_gen]


def _nodes_of(program) -> set:
    """Every node of a program, its monoids' expressions included."""
    roots = [k.value for k in program.stores]
    for m in program.monoids.values():
        roots += [*m.identity, *m.combine, *m.finalize]
    return {n for r in roots for n in postorder(r)}


@pytest.mark.parametrize("module", PASSES, ids=lambda m: m.__name__)
def test_every_pass_implements_every_kind(module) -> None:
    tables = [v for v in vars(module).values() if isinstance(v, KindTable)]
    assert tables, f"{module.__name__} dispatches on node kinds through no KindTable"
    for table in tables:
        assert table.missing() == [], f"{table.name} lacks {table.missing()}"


def test_the_every_node_program_holds_every_kind() -> None:
    """So the round trips below exercise each declaration."""
    assert {type(n) for n in _nodes_of(every_node())} == set(KINDS)


def test_every_kind_prints_and_reads_back() -> None:
    program = every_node()
    assert parse_block_program(show_program(program)).program == program


def test_every_kind_rebuilds_from_its_children_and_attributes() -> None:
    for n in _nodes_of(every_node()):
        assert rebuild(n, children(n)) == n
        renamed = map_attrs(n, Sort.AXIS, str.upper, children(n))
        axes = [a for f in kind_of(n).attr_fields if kind_of(n).sort_of(f) is Sort.AXIS
                for a in [getattr(renamed, f)]]
        assert all(a.isupper() for a in axes)


def test_every_term_kind_goes_through_the_egraph_and_back() -> None:
    program = every_node()
    egg_kinds = {c.kind.name for c in KINDS if c.kind.egg is not None}
    assert {k.name for k, _ in CONSTRUCTORS.values()} == egg_kinds
    sat = Saturator(compile_pack(RulePack("none", monoids=list(program.monoids.values()))),
                    {d.name: (d.extent, d.block) for d in program.dims.values()})
    sat.add_terms({k.tensor: k.value for k in program.stores})
    graph = sat.freeze()
    for k in program.stores:
        assert graph.lookup(k.value) == graph.named[k.tensor]
        for n in postorder(k.value):
            node = graph.enode_of(n)
            assert node is not None and node.attrs == attrs(n)
            assert node.build(children(n)) == n


def test_every_kind_runs_alike_in_every_backend() -> None:
    """The program with every kind: the interpreter, the numpy backend and the CUDA kernels
    (emulated) compute the same values, and the cost model prices it."""
    program = every_node()
    inputs = random_inputs(program, seed=3)
    want = interp.run(program, inputs)
    got = {"numpy": numpy_gen.run(program, inputs)}
    if shutil.which("g++"):
        got["cuda"] = emulate(cuda_gen.generate(program), inputs)
    for backend, out in got.items():
        for name in program.outputs:
            np.testing.assert_allclose(out[name], want[name], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{backend}: {name}")
    assert cost.cost_program(program, get_target("h100")).flops > 0
