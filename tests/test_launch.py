"""Kernels with several stores and map loops, as extraction launches them (`bbrules.grouping`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.codegen import numpy_gen
from bbrules.cost import cost_program
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.grouping import _loaded, _mergeable, group_kernels
from bbrules.inputs import random_inputs
from bbrules.ir import Kernel
from bbrules.lower import lower
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.plan import kernel_uses
from bbrules.targets import get_target

EXAMPLES = Path(__file__).parent.parent / "examples"
H100 = get_target("h100")
F32 = 4


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


def fused(source, pack, dims=None, **kw):
    """`source` fused at full size (the launches depend on it; test_verdict runs every example
    fused at a small size against the dense evaluation)."""
    ast = load_program(source, dims) if isinstance(source, Path) else source
    return fuse(lower(ast), pack, H100, **kw)


def assert_computes_the_source(source, pack, dims, **kw) -> None:
    """Fused at the small `dims`, both the interpreter and the numpy backend compute what the
    source's dense evaluation does."""
    ast = load_program(source, dims) if isinstance(source, Path) else parse_program(source)
    r = fuse(lower(ast), pack, H100, **kw)
    assert any(len(k.stores) > 1 or k.grid != k.stores[0].axes for k in r.program.kernels)
    inputs = random_inputs(ast, seed=0)
    want = dense.evaluate(ast, inputs)
    for got in (interp.run(r.program, inputs), numpy_gen.run(r.program, inputs)):
        for o in ast.outputs:
            np.testing.assert_allclose(got[o], want[o], rtol=2e-4, atol=2e-4)


def nbytes(r, tensor: str) -> int:
    t = r.program.tensors[tensor]
    return F32 * int(np.prod([r.program.extent(a) for a in t.axes]))


def test_the_papers_first_figure_is_one_kernel_reading_b_once(pack):
    r = fused(EXAMPLES / "rowsum_add.bbp", pack)
    (kernel,) = r.program.kernels
    assert kernel.grid == ("i",) and set(kernel.tensors) == {"c", "d"}
    assert r.after.bytes_read == nbytes(r, "a") + nbytes(r, "b")
    assert r.after.traffic == r.after.compulsory
    assert r.before.n_kernels == 2


@pytest.mark.parametrize("dims, objective", [({"r": (4096, 16)}, "time"), (None, "traffic")])
def test_softmax_over_a_blocked_row_is_one_kernel_reading_x_twice(pack, dims, objective):
    r = fused(EXAMPLES / "softmax.bbp", pack, dims, objective=objective)
    (kernel,) = r.program.kernels
    assert kernel.grid == ("r",) and kernel.tensors == ("Y",)
    assert set(r.program.tensors) == {"X", "Y"}  # no statistic stored
    assert r.after.bytes_read == 2 * nbytes(r, "X")  # statistics pass, then normalise pass
    # exp runs in both passes; statistics recomputed per output block would be 16x theirs
    assert r.after.flops < 2 * r.before.flops


LAYERNORM = """
dim r = 2048 / 8
dim c = 4096 / 512
input X[r, c], G[c], B[c] : f32
MU[r]   = sum[c] X[r, c] * 0.000244140625
VAR[r]  = sum[c] square(X[r, c] - MU[r]) * 0.000244140625
Y[r, c] = (X[r, c] - MU[r]) * rsqrt(VAR[r] + 1e-5) * G[c] + B[c]
output Y
"""


def test_layernorm_over_a_blocked_row_is_one_kernel_reading_x_at_most_twice(pack):
    r = fused(parse_program(LAYERNORM, "layernorm.bbp"), pack)
    (kernel,) = r.program.kernels
    assert kernel.grid == ("r",) and set(r.program.tensors) == {"X", "G", "B", "Y"}
    x = nbytes(r, "X")
    assert r.after.bytes_read <= 2 * x + 2 * r.program.blocks("r") * nbytes(r, "G")


@pytest.mark.parametrize("source, dims, objective", [
    (EXAMPLES / "rowsum_add.bbp", {"i": (64, 16), "j": (256, 64)}, "time"),
    (EXAMPLES / "softmax.bbp", {"r": (64, 16), "c": (512, 128)}, "traffic"),
    (EXAMPLES / "residual_rmsnorm.bbp", {"t": (64, 16), "e": (512, 128)}, "traffic"),
    (EXAMPLES / "rmsnorm_qkv.bbp", {"t": (64, 16), "e": (128, 32), "q": (128, 32),
                                   "k": (64, 32)}, "traffic"),
    (LAYERNORM.replace("2048 / 8", "64 / 16").replace("4096 / 512", "256 / 64"), None, "traffic"),
])
def test_fused_launches_compute_the_source(pack, source, dims, objective):
    assert_computes_the_source(source, pack, dims, objective=objective)


def test_residual_add_and_rmsnorm_write_both_outputs_from_one_kernel(pack):
    r = fused(EXAMPLES / "residual_rmsnorm.bbp", pack)
    (kernel,) = r.program.kernels
    assert set(kernel.tensors) == {"H", "Y"} and kernel.grid == ("t",)
    assert r.after.time < r.before.time and r.after.traffic < r.before.traffic


@pytest.mark.parametrize("dims, objective", [({"t": (16384, 64)}, "time"), (None, "traffic")])
def test_rmsnorm_then_q_k_v_stores_no_norm_and_k_and_v_share_each_input_tile(pack, dims,
                                                                             objective):
    r = fused(EXAMPLES / "rmsnorm_qkv.bbp", pack, dims, objective=objective)
    p = r.program
    assert set(p.tensors) == {"X", "G", "WQ", "WK", "WV", "Q", "K", "V"}  # nothing stored
    assert ("K", "V") in [k.tensors for k in p.kernels] and all(k.grid[0] == "t"
                                                                for k in p.kernels)
    # A row of X (64 x 4096) does not fit local memory, so each projection's column block
    # reads the row's tiles again; K and V walk the same column blocks in one loop, so they
    # read each tile once between them, and each kernel's statistics pass costs at most one
    # read more.  The weights are read once per row block of the kernel that loads them:
    # the projections take row blocks of 128 (coarser than the program's 64, which halves
    # those reads) where one kernel of all three would not fit its tiles.
    weights = sum(p.in_kernel(k).blocks("t") * nbytes(r, w)
                  for k in p.kernels for w in kernel_uses(k)[1] & {"WQ", "WK", "WV", "G"})
    x_reads = (r.after.bytes_read - weights) / nbytes(r, "X")
    assert x_reads <= p.blocks("q") + p.blocks("k") + len(p.kernels)
    fixed = fused(EXAMPLES / "rmsnorm_qkv.bbp", pack, dims, objective=objective,
                  options=Options(reblock=False))
    assert r.after.traffic < fixed.after.traffic and r.after.time <= fixed.after.time


def test_where_a_row_fits_one_kernel_reads_the_input_once_per_row_block(pack):
    # At width 256 a row block of X (64 x 256) fits local memory beside the projections'
    # tiles, and 256 row blocks fill the chip: Q, K and V share one kernel over the rows,
    # which reads each row block of X once and the weights once per row block.
    dims = {"t": (16384, 64), "e": (256, 64), "q": (256, 128), "k": (128, 128)}
    r = fused(EXAMPLES / "rmsnorm_qkv.bbp", pack, dims)
    (kernel,) = r.program.kernels
    assert set(kernel.tensors) == {"Q", "K", "V"} and kernel.grid == ("t",)
    rows = r.program.in_kernel(kernel).blocks("t")
    weights = rows * sum(nbytes(r, w) for w in ("G", "WQ", "WK", "WV"))
    assert r.after.bytes_read == nbytes(r, "X") + weights


def test_at_the_example_size_q_stays_apart_for_parallelism(pack):
    # 64 row blocks would fill under half of the 132 processors: Q, whose weights are 4x the
    # others', keeps a grid over its columns; K and V still share one launch.
    r = fused(EXAMPLES / "rmsnorm_qkv.bbp", pack)
    assert sorted(k.tensors for k in r.program.kernels) == [("K", "V"), ("Q",)]
    assert r.runner_up is not None


def test_grouping_only_ever_lowers_the_key():
    p = lower(load_program(EXAMPLES / "rowsum_add.bbp", {"i": (64, 64)}))  # one row block
    priced = []

    def price(q):
        priced.append(q)
        return cost_program(q, H100)

    grouped = group_kernels(p, price)
    assert grouped.kernels == p.kernels  # one processor for everything would be slower
    assert len(priced) == 2  # the program, and the one merge there is to try
    assert priced[1].kernels == (Kernel(("i",), p.stores),)


def test_a_kernel_never_moves_above_what_it_reads():
    p = lower(parse_program("""
dim i = 64 / 16
dim j = 64 / 16
input a[i, j] : f32
t[i, j] = a[i, j] * 2
u[i]    = sum[j] t[i, j]
v[i, j] = a[i, j] + u[i]
output v
""", "chain.bbp"))
    seen = []
    group_kernels(p, lambda q: seen.append(q) or cost_program(q, H100))
    for q in seen:
        for k in q.kernels:
            assert not ({"t", "u"} <= set(k.tensors) or {"u", "v"} <= set(k.tensors))


def mergeable_by_definition(p) -> list[tuple[int, int]]:
    """Every pair i < j, in order, that reads a tensor in common (by storage), whose j reads
    nothing kernels i .. j - 1 store, and whose blocks agree."""
    ks = p.kernels
    reads = [{p.tensors[t].storage for t in _loaded(k)} for k in ks]
    return [(i, j) for i in range(len(ks)) for j in range(i + 1, len(ks))
            if reads[i] & reads[j] and ks[i].blocks == ks[j].blocks
            and not any(reads[j] & set(ks[m].tensors) for m in range(i, j))]


def fan_out(n: int) -> str:
    """n kernels that read X or W, every fifth also the kernel before it."""
    lines = ["dim r = 64 / 32", "dim c = 64 / 32", "input X[r, c], W[r, c] : f32",
             "Y0[r, c] = X[r, c] + W[r, c]"]
    for i in range(1, n):
        src = "X" if i % 3 else "W"
        lines.append(f"Y{i}[r] = sum[c] {src}[r, c] * Y{i - 1}[r, c]" if i % 5 == 0 else
                     f"Y{i}[r, c] = {src}[r, c] * {i + 1}")
    return "\n".join(lines) + "\noutput " + ", ".join(f"Y{i}" for i in range(n)) + "\n"


@pytest.mark.parametrize("source", [EXAMPLES / "decoder_layer.bbp",
                                    EXAMPLES / "rmsnorm_qkv.bbp", fan_out(40)])
def test_the_launches_that_may_merge_are_those_the_definition_gives(source):
    """`_mergeable` looks only past the last kernel that stores what j reads; every pair looked
    at cost `apply` about 8 s on a chain of 3,000 kernels."""
    p = lower(load_program(source) if isinstance(source, Path) else parse_program(source))
    pairs = _mergeable(p)
    assert pairs and pairs == mergeable_by_definition(p)
