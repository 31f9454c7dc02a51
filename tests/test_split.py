"""Split folds (`bbrules.splitting`): a reduction that leaves processors idle runs in chunks
whose unfinalized states a second kernel combines."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.blockfile import parse_block_program
from bbrules.codegen import cuda_gen, numpy_gen
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.ir import IRError, Reduce, TensorDecl, postorder, show_program, validate
from bbrules.lower import lower
from bbrules.options import Options
from bbrules.packs import load_packs
from bbrules.targets import get_target
from cuda_emu import emulate

EXAMPLES = Path(__file__).parent.parent / "examples"
DECODE = EXAMPLES / "decode_attention.bbp"
H100 = get_target("h100")
F32 = 4


@pytest.fixture(scope="module")
def pack():
    return load_packs([])


def chunk_axes(p) -> set[str]:
    """The chunk axes of split folds: dims of one-element blocks that a view cuts out."""
    return {a for t in p.tensors.values() if t.role == "view" for a in t.axes
            if a not in p.tensors[t.base].axes and p.dims[a].block == 1}


@pytest.mark.parametrize("heads, keys", [(8, 1024), (32, 32768)])
def test_decode_attention_splits_over_keys_reading_k_and_v_once(pack, heads, keys):
    ast = load_program(DECODE, {"h": (heads, 1), "k": (keys, 64)})
    r = fuse(lower(ast), pack, H100)
    p = r.program
    assert not any(len(t.axes) == 2 and set(t.axes) == {"h", "k"}
                   for t in p.tensors.values() if t.role != "view")  # no scores stored
    (chunk,) = chunk_axes(p)
    assert chunk in p.kernels[0].grid  # the chunks are grid points
    kv = 2 * heads * keys * 128 * F32
    q_o = 2 * heads * 128 * F32
    states = r.after.bytes_written - heads * 128 * F32
    assert r.after.bytes_read <= kv + q_o + 2 * states  # K and V read once; states read once
    unsplit = fuse(lower(ast), pack, H100, options=Options(split_folds=False))
    assert r.after.time < unsplit.after.time
    assert r.after.time < r.before.time


def test_a_split_program_computes_the_source_in_every_backend(pack):
    ast = load_program(DECODE, {"h": (4, 1), "k": (1024, 64)})
    p = fuse(lower(ast), pack, H100).program
    assert chunk_axes(p)
    assert parse_block_program(show_program(p)).program.kernels == p.kernels
    inputs = random_inputs(ast, seed=1)
    want = dense.evaluate(ast, inputs)["O"]
    for run in (interp.run, numpy_gen.run):
        np.testing.assert_allclose(run(p, inputs)["O"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to emulate CUDA")
def test_split_kernels_run_in_the_cuda_emulator_for_any_thread_count(pack):
    ast = load_program(DECODE, {"h": (4, 1), "k": (1024, 64)})
    p = fuse(lower(ast), pack, H100).program
    module = cuda_gen.generate(p)
    assert len(module.kernels) == 2 and not any("_k" in t for t in module.tensors)  # no views
    inputs = random_inputs(ast, seed=3)
    want = dense.evaluate(ast, inputs)["O"]
    for threads in (None, 32, 48):
        np.testing.assert_allclose(emulate(module, inputs, threads=threads)["O"], want,
                                   rtol=1e-5, atol=1e-6)
    if shutil.which("nvcc"):
        assert set(cuda_gen.compile_check(module.source)) == {k.name for k in module.kernels}


def test_attention_at_4096_on_h100_splits_over_keys_like_flash_decoding(pack):
    """Query blocks of 128 read K and V half as often as the program's 64, and 32 of them
    fill under a quarter of 132 SMs: chunks of keys per query block fill it.  K and V are read
    once per query block, as by Flash Attention in one kernel; Q once per chunk; the states
    add chunks x (O + its row statistics), written and read back."""
    def attention(**options):
        return fuse(lower(load_program(EXAMPLES / "attention.bbp")), pack, H100,
                    options=Options(**options))

    r = attention()
    whole = attention(split_folds=False, reblock=False)
    reblocked = attention(split_folds=False)
    assert whole.after.n_kernels == reblocked.after.n_kernels == 1
    # Coarser query blocks read less, in a time the model cannot tell from the whole one's.
    assert reblocked.after.traffic < whole.after.traffic
    assert reblocked.after.time <= whole.after.time * (1 + H100.resolution)
    assert r.after.time < reblocked.after.time
    p = r.program
    (chunk,) = chunk_axes(p)
    chunks = p.dims[chunk].extent
    assert chunks > 1 and r.after.n_kernels == 2
    query_blocks = p.in_kernel(p.kernels[0]).blocks("q")
    assert query_blocks * chunks >= H100.processors / 2
    mib = 1 << 20
    q = k = v = o = 1 * mib
    states = chunks * (o + 2 * 4096 * F32)
    assert r.after.traffic == chunks * q + o + query_blocks * (k + v) + 2 * states
    assert r.after.traffic < 2 * q + o + 64 * (k + v) + 2 * 2 * (o + 2 * 4096 * F32)
    assert r.after.time < 0.7 * whole.after.time
    # without splitting, the one kernel of before split reductions existed, at its traffic
    assert whole.after.traffic <= q + o + 64 * (k + v)


def test_split_k_of_a_skinny_matmul_is_generic_over_monoids(pack):
    """A sum (split-K) and a max split alike: the second kernel folds the chunks' states with
    the fold's own monoid."""
    source = """
dim m = 64 / 64
dim n = 128 / 64
dim k = 65536 / 64
input A[m, k], B[k, n] : f32
C[m, n] = sum[k] A[m, k] * B[k, n]
D[m]    = max[k] A[m, k]
output C
output D
"""
    ast = parse_program(source, "skinny.bbp")
    r = fuse(lower(ast), pack, H100)
    folds = {n.monoid.name for k in r.program.kernels for s in k.stores
             for n in postorder(s.value) if isinstance(n, Reduce) and n.axis.startswith("k_c")}
    assert folds == {"sum", "max"}
    assert r.after.time < fuse(lower(ast), pack, H100,
                               options=Options(split_folds=False)).after.time
    small = parse_program(source.replace("65536 / 64", "1024 / 64"), "skinny.bbp")
    p = fuse(lower(small), pack, H100).program
    assert chunk_axes(p)
    inputs = random_inputs(small, seed=2)
    want = dense.evaluate(small, inputs)
    for run in (interp.run, numpy_gen.run):
        got = run(p, inputs)
        for o in ("C", "D"):
            np.testing.assert_allclose(got[o], want[o], rtol=1e-4, atol=1e-4)


def test_a_machine_filled_by_the_grid_is_not_split(pack):
    r = fuse(lower(load_program(EXAMPLES / "softmax.bbp")), pack, H100)
    assert not chunk_axes(r.program)


def test_a_view_must_be_a_reshape_of_its_base():
    p = parse_block_program("""
dim h = 4 / 1
dim k = 256 / 32
dim c = 2 / 1
dim i = 128 / 32
input K[h, k] : f32
output Y[h, c] : f32
view K2[h, c, i] : f32 = K

kernel Y[h, c]:
  Y[h, c] = reduce(i, sum, bsum(i, load(K2[h, c, i])))
""").program
    validate(p)
    bad = dict(p.tensors, K2=TensorDecl("K2", ("h", "i"), "f32", "view", "K"))
    with pytest.raises(IRError, match="not a reshape"):
        validate(type(p)(p.dims, bad, p.kernels, p.outputs))
    with pytest.raises(Exception, match="not a reshape"):
        parse_block_program(show_program(p).replace("K2[h, c, i] : f32 = K",
                                                     "K2[h, i] : f32 = K"))
