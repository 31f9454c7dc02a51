"""The kernel plan is the one truth about local memory: the cost model's footprint is the bytes a
generated CUDA kernel allocates, a kernel priced legal is never refused by the generator (and one
priced illegal always is), the plan's placement never lets two live buffers share a byte, and
every backend's per-kind table covers every node kind."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from bbrules import interp
from bbrules.codegen.cuda_gen import generate
from bbrules.cost import cost_kernel, cost_program
from bbrules.errors import UsageError
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import MAX, BlockProgram, BlockReduce, Const, Dot, Load, Reduce, Store, Unary
from bbrules.lower import lower
from bbrules.packs import load_packs
from bbrules.plan import ALIGN, KernelPlan, plan_for
from bbrules.targets import get_target

from cuda_emu import emulate
from irbuild import add, matmul, mul, program
from strategies import programs
from test_cuda_backend import assert_matches, small_example

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.bbp"))
H100 = get_target("h100")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None,
                               reason="g++ is not installed: the kernels cannot be emulated")


def assert_placement_is_sound(plan: KernelPlan) -> None:
    """Every buffer lies inside the footprint, and no two buffers live at the same point
    overlap in memory."""
    bufs = plan.buffers
    assert plan.footprint == max((b.offset + b.aligned_bytes for b in bufs), default=0)
    for b in bufs:
        assert b.offset % ALIGN == 0 and b.first <= b.last
    for i, a in enumerate(bufs):
        for b in bufs[i + 1:]:
            if a.first <= b.last and b.first <= a.last:
                assert (a.offset + a.aligned_bytes <= b.offset
                        or b.offset + b.aligned_bytes <= a.offset), (a, b)


def assert_model_is_what_cuda_allocates(p: BlockProgram, target=H100) -> None:
    module = generate(p, target)
    for info, kernel in zip(module.kernels, p.kernels):
        cost = cost_kernel(p, kernel, target)
        assert cost.legal
        assert info.shared_bytes == cost.footprint, kernel.name
        plan = plan_for(p, kernel, target.local_capacity)
        assert info.threads == plan.threads
        assert_placement_is_sound(plan)


def fused(p: BlockProgram) -> BlockProgram:
    return fuse(p, load_packs([]), H100).program


@pytest.mark.parametrize("size", ["small", "full"])
@pytest.mark.parametrize("form", ["unfused", "fused"])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_examples_modeled_footprint_is_what_its_cuda_kernels_allocate(path, form, size):
    p = small_example(path) if size == "small" else lower(load_program(path))
    assert_model_is_what_cuda_allocates(fused(p) if form == "fused" else p)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_modeled_footprint_is_what_their_cuda_kernels_allocate(source):
    assert_model_is_what_cuda_allocates(lower(parse_program(source, "<random>")))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_fused_random_programs_modeled_footprint_is_what_cuda_allocates(source):
    assert_model_is_what_cuda_allocates(fused(lower(parse_program(source, "<random>"))))


def _capacities(p: BlockProgram) -> list[int]:
    """Local capacities around every kernel's footprint: at it, and one byte short."""
    out = set()
    for kernel in p.kernels:
        fp = cost_kernel(p, kernel, H100).footprint
        out |= {fp, fp - 1}
    return sorted(out)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_a_kernel_priced_legal_is_generated_and_one_priced_illegal_is_refused(path):
    p = fused(lower(load_program(path)))
    seen = set()
    for capacity in _capacities(p):
        target = dataclasses.replace(H100, local_capacity=capacity)
        cost = cost_program(p, target)
        seen.add(cost.legal)
        if cost.legal:
            assert len(generate(p, target).kernels) == len(p.kernels)
        else:
            with pytest.raises(UsageError, match="shared memory"):
                generate(p, target)
    assert seen == {True, False}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_kernels_are_refused_exactly_when_priced_illegal(source):
    p = lower(parse_program(source, "<random>"))
    for capacity in _capacities(p):
        target = dataclasses.replace(H100, local_capacity=capacity)
        if cost_program(p, target).legal:
            generate(p, target)
        else:
            with pytest.raises(UsageError):
                generate(p, target)


def test_fused_attention_and_softmax_footprints_are_generated_as_modeled():
    # Fused at full size: attention split over keys, softmax one kernel of its own blocks.
    for stem in ("attention", "softmax"):
        p = fused(lower(load_program(next(e for e in EXAMPLES if e.stem == stem))))
        infos = generate(p).kernels
        assert len(infos) == len(p.kernels)
        for info, kernel in zip(infos, p.kernels):
            assert info.tensors == kernel.tensors
            assert info.shared_bytes == cost_kernel(p, kernel, H100).footprint


# --------------------------------------------------------------------------------------------
# What the plan decides


def _plan(p: BlockProgram, capacity: int = H100.local_capacity) -> KernelPlan:
    (kernel,) = p.kernels
    return plan_for(p, kernel, capacity)


def test_an_elementwise_chain_has_no_buffer_of_its_own():
    # Y[m] = bsum_e exp(X) + bmax_e (X * 2): exp(X), X * 2 and the sum are computed in the
    # passes that read them; the X tile and the two row results are buffers.
    x = Load("X", ("m", "e"))
    y = add(BlockReduce("sum", "e", Unary("exp", x)),
            BlockReduce("max", "e", mul(x, Const(2.0))))
    plan = _plan(program({"m": (32, 8), "e": (16, 16)}, {"X": ("m", "e")},
                         [Store("Y", ("m",), y)], ("Y",)))
    elementwise = [v.mode for v in plan.values if v.kind == "elementwise"]
    assert elementwise == ["inline"] * 3
    tiles = sorted((b.order, b.elements) for b in plan.buffers if b.role == "tile")
    assert tiles == [(("m",), 8), (("m",), 8), (("m", "e"), 8 * 16)]


def test_a_dot_folded_into_a_sum_accumulates_in_place_and_one_into_a_max_does_not():
    dims = {"m": (32, 8), "e": (64, 16), "n": (48, 4)}
    a, w = Load("A", ("m", "e")), Load("W", ("e", "n"))
    inputs = {"A": ("m", "e"), "W": ("e", "n")}
    summed = _plan(program(dims, inputs, [Store("Y", ("m", "n"), matmul(a, w, "e"))], ("Y",)))
    maxed = _plan(program(dims, inputs, [Store("Y", ("m", "n"),
                                               Reduce("e", MAX, Dot("e", a, w)))], ("Y",)))
    (dot,) = [v for v in summed.values if v.kind == "dot"]
    assert dot.mode == "accumulate" and dot.buffer is None
    assert [b.role for b in summed.buffers if b.order == ("m", "n")] == ["accumulator"]
    (dot,) = [v for v in maxed.values if v.kind == "dot"]
    assert dot.mode == "local"
    assert sorted(b.role for b in maxed.buffers if b.order == ("m", "n")) == \
        ["accumulator", "tile"]


def ffn_like() -> BlockProgram:
    """Y[m, n] = sum_h (sum_e G[e] X[m, e] W1[e, h]) W2[h, n]: G and X sit in the loop over e
    inside the loop over h, which they do not depend on."""
    dims = {"m": (16, 8), "e": (64, 16), "h": (48, 16), "n": (32, 16)}
    g, x = Load("G", ("e",)), Load("X", ("m", "e"))
    hidden = matmul(mul(g, x), Load("W1", ("e", "h")), "e")
    y = matmul(hidden, Load("W2", ("h", "n")), "h")
    inputs = {"G": ("e",), "X": ("m", "e"), "W1": ("e", "h"), "W2": ("h", "n")}
    return program(dims, inputs, [Store("Y", ("m", "n"), y)], ("Y",))


def test_resident_slabs_are_buffers_for_the_whole_kernel_and_read_once():
    p = ffn_like()
    plan = _plan(p)
    assert [n.tensor for n in plan.resident] == ["G", "X"]
    slabs = [b for b in plan.buffers if b.role == "slab"]
    assert [(b.order, b.sizes) for b in slabs] == [(("e",), (64,)), (("m", "e"), (8, 64))]
    end = max(w.site.seq for w in plan.writes) + 1  # the plan's last point
    assert all(b.first == 0 and b.last == end for b in slabs)
    assert {v.mode for v in plan.values if v.kind == "load" and v.node.tensor in "GX"} == \
        {"resident"}
    assert_model_is_what_cuda_allocates(p)


@needs_cxx
def test_resident_slabs_compute_what_the_interpreter_computes():
    p = ffn_like()
    inputs = random_inputs(p, seed=3)
    want = interp.run(p, inputs)
    module = generate(p)
    for threads in (None, 48):
        assert_matches(emulate(module, inputs, threads=threads), want)


def test_a_buffer_read_in_a_loop_lives_to_the_loops_end():
    p = ffn_like()
    plan = _plan(p, capacity=1000)  # no room for slabs: G and X are tiles
    assert plan.resident == ()
    (outer,) = [op for op in plan.loops if op.axis == "h"]
    (inner,) = [op for op in plan.loops if op.axis == "e"]
    (acc,) = inner.accs
    assert acc.states[0].last >= inner.end  # the (m, h) accumulator, read after the loop
    assert all(b.last <= outer.end for b in plan.buffers if b.path[:1] == (outer.id,))
