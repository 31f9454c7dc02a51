"""Native elementwise groups (`bbrules.codegen.native`): each operator's C against its numpy
definition, groups called on views, broadcasts and their own operands, whole programs (the
examples unfused and fused, on one thread and in parts) against the reference interpreter,
and what happens without a compiler.  CI has one (gcc), so these run there."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bbrules import dense, interp
from bbrules.blockfile import parse_block_program
from bbrules.cli import main
from bbrules.codegen import native, native_matmul, numpy_gen, numpy_timing
from bbrules.frontend import load_program, parse_program
from bbrules.fuse import fuse
from bbrules.inputs import random_inputs
from bbrules.lower import lower
from bbrules.ops import ELEMENTWISE, TERNARY, UNARY
from bbrules.packs import load_packs
from bbrules.targets import get_target

from test_numpy_backend import EXAMPLES, SEVERAL_BLOCKS, assert_close, small_dims

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch) -> Path:
    """One cache folder for the session's compiled groups, never the user's."""
    folder = tmp_path_factory.getbasetemp() / "native-cache"
    monkeypatch.setenv("BBRULES_CACHE", str(folder))
    return folder / "native"


# Operands with the values where C and numpy are likeliest to part: signed zeros, infinities,
# NaN, exp's and tanh's ranges' ends, the subnormal results of exp.
SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, np.inf, -np.inf, np.nan, 1e-30, 100.0, -100.0,
                    88.0, -87.0, -87.5, -88.0, 9.5, -9.5, 20.5, 3.0, -3.0], np.float32)


def operands(arity: int) -> list[np.ndarray]:
    """Every pair (triple) of special values, then random ones of several magnitudes."""
    rng = np.random.default_rng(7)
    grids = np.meshgrid(*[SPECIAL] * min(arity, 2), indexing="ij")
    special = [g.ravel() for g in grids] + ([np.resize(SPECIAL, grids[0].size)] * (arity - 2))
    rand = [(rng.standard_normal(4096) * rng.choice([0.1, 3, 30], 4096)).astype(np.float32)
            for _ in range(arity)]
    return [np.concatenate([s, r]).astype(np.float32) for s, r in zip(special, rand)]


# How far each operator's C may be from numpy's definition: glibc's functions against numpy's
# own (a few units in the last place), numpy's erf being a 1.5e-7 approximation, and exp's
# subnormal results flushed to zero.
ATOL = {"erf": 3e-7, "exp": 1.2e-38}


def test_every_operator_matches_its_numpy_definition():
    names = sorted(native.C_OPS)
    assert set(names) == set(ELEMENTWISE)
    arity = {name: 1 if name in UNARY else 3 if name in TERNARY else 2 for name in names}
    groups = []
    for name in names:
        args = {v: f"l{i}" for i, v in enumerate("xyz"[:arity[name]])}
        size = operands(arity[name])[0].size
        groups.append(native.Group(f"op_{name}", (size,), ((size,),) * arity[name],
                                   (f"out = {native.C_OPS[name].format(**args)};",)))
    lib = native.compiled(native.source(groups))
    assert lib.vector_math  # glibc's vector functions were found: the loops are vectorised
    for name, g in zip(names, groups):
        xs = operands(arity[name])
        got = lib.function(g.name, g.dims, g.leaves)(None, *xs)
        with np.errstate(all="ignore"):
            want = np.asarray(ELEMENTWISE[name].numpy(*xs), np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=ATOL.get(name, 1e-6),
                                   equal_nan=True, err_msg=name)


def test_exp_of_a_masked_score_is_zero_and_keeps_nan():
    """libmvec's expf sends -inf and results below float's smallest normal down a scalar
    path; `bb_expf` clamps them and selects 0 (a NaN stays NaN)."""
    g = native.Group("e", (5,), ((5,),), ("out = bb_expf(l0);",))
    x = np.array([-np.inf, -87.5, -87.0, np.nan, 1.0], np.float32)
    got = native.compiled(native.source([g])).function("e", g.dims, g.leaves)(None, x)
    assert got[0] == 0.0 and got[1] == 0.0 and np.isnan(got[3])
    np.testing.assert_allclose(got[[2, 4]], np.exp(x[[2, 4]]), rtol=3e-7)


FMA = native.Group("mul_add", (6, 1, 40), ((6, 1, 40), (1, 1, 40), (6, 1, 1)),
                   ("const float v0 = l0 * l1;", "out = v0 + l2;"))


@pytest.fixture()
def fma():
    return native.compiled(native.source([FMA])).function(FMA.name, FMA.dims, FMA.leaves)


def test_a_group_reads_views_broadcasts_and_converts_what_is_not_float32(fma):
    """Contiguous rows, a transposed view (walked by columns, its result laid out as it is),
    a stride inside rows (element by element), other dtypes and numpy scalars."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 1, 40)).astype(np.float32)
    row = rng.standard_normal((1, 1, 40)).astype(np.float32)
    column = rng.standard_normal((6, 1, 1)).astype(np.float32)
    want = x * row + column
    np.testing.assert_array_equal(fma(None, x, row, column), want)
    transposed = np.ascontiguousarray(x.transpose(2, 1, 0)).transpose(2, 1, 0)  # strided
    assert not transposed.flags.c_contiguous
    got = fma(None, transposed, row, column)  # by columns, into an array laid out alike
    np.testing.assert_array_equal(got, want)
    assert got.strides == transposed.strides
    every_other = np.repeat(x, 2, axis=2)[:, :, ::2]  # a stride of two elements inside
    np.testing.assert_array_equal(fma(None, every_other, row, column), want)
    np.testing.assert_array_equal(fma(None, x.astype(np.float64), row, column), want)
    np.testing.assert_array_equal(fma(None, x, row, np.float32(2.0)[()]), x * row + 2)
    with pytest.raises(ValueError, match="shapes"):
        fma(None, x[:3], row, column)


def test_groups_are_builtins_and_a_module_written_before_them_calls_through_ctypes():
    """A group's function is a builtin (`exported`: no ctypes on the way); the C of a module
    written before that, which has no `bb_functions`, is still called, through ctypes; both
    compute the same.  A builtin given the wrong number of arguments raises TypeError."""
    x = np.arange(240, dtype=np.float32).reshape(6, 1, 40) / 7
    row, column = x[:1] * 0.5, x[:, :, :1] - 1
    text = native.source([FMA])
    current = native.compiled(text).function(FMA.name, FMA.dims, FMA.leaves)
    assert type(current.fn).__name__ == "builtin_function_or_method"
    older = text[:text.index("static PyObject *bb_call_")]
    assert "bb_functions" not in older
    before = native.compiled(older).function(FMA.name, FMA.dims, FMA.leaves)
    assert type(before.fn).__name__ == "_FuncPtr"
    for fn in (current, before):
        np.testing.assert_array_equal(fn(None, x, row, column), x * row + column)
    with pytest.raises(TypeError, match="takes 4 arrays and the threads, 3 arguments"):
        current.fn(x, x, row)


@pytest.mark.parametrize("written", ["now", "before"])
def test_a_group_writes_into_its_operand_unless_another_shares_its_memory(written):
    """The C tests whether the array written shares memory with a leaf not laid out as it
    is; a module whose C was written before it did is tested in Python."""
    text = native.source([FMA])
    if written == "before":
        text = text.replace("const int bb_checks_overlap = 1;", "").replace(
            "if (bb_overlaps(count, written, views, nd)) {", "if (0) {")
    fma = native.compiled(text).function(FMA.name, FMA.dims, FMA.leaves)
    assert fma.checks_overlap == (written == "now")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 1, 40)).astype(np.float32)
    row = rng.standard_normal((1, 1, 40)).astype(np.float32)
    want = x * row + x[:, :, :1]
    into = x.copy()
    assert fma(into, into, row, np.ascontiguousarray(into[:, :, :1])) is into
    np.testing.assert_array_equal(into, want)
    shared = x.copy()
    got = fma(shared, shared, row, shared[:, :, :1])  # its column is read after it is written
    assert got is not shared
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(shared, x)


@pytest.mark.parametrize("keeps", [False, True], ids=["reduced", "kept"])
@pytest.mark.parametrize("op", sorted(native.REDUCTIONS))
def test_a_group_ends_in_a_reduction_along_rows_columns_or_strides(op, keeps):
    """exp(x - m) reduced over its innermost dimension: rows contiguous (partial results in
    lanes), rows strided with contiguous columns (a transposed view: whole columns folded at
    once), and neither; a NaN in a row is that row's max and min, as in numpy.  A group that
    keeps its values returns them beside their reduction."""
    g = native.Group(f"reduce_{op}_{keeps}", (4, 1, 24, 37), ((4, 1, 24, 37), (4, 1, 24, 1)),
                     ("const float v0 = l0 - l1;", "out = bb_expf(v0);"), (op, 3), keeps)
    fn = native.compiled(native.source([g])).function(g.name, g.dims, g.leaves, g.reduce,
                                                      g.keeps)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 1, 24, 37)).astype(np.float32)
    x[1, 0, 5, 30] = np.nan
    m = rng.standard_normal((4, 1, 24, 1)).astype(np.float32)
    want = {"sum": np.sum, "max": np.max, "min": np.min}[op](np.exp(x - m), axis=3,
                                                             keepdims=True)
    columns = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    strided = np.ascontiguousarray(x.transpose(3, 1, 2, 0)).transpose(3, 1, 2, 0)
    for view in (x, columns, strided):
        got = fn(None, view, m)
        if keeps:
            values, got = got
            np.testing.assert_allclose(values, np.exp(x - m), rtol=3e-7, equal_nan=True)
        assert got.shape == (4, 1, 24, 1)
        np.testing.assert_allclose(got, want, rtol=1e-6, equal_nan=True)
        assert np.isnan(got[1, 0, 5, 0])


@pytest.mark.parametrize("reduce", [None, ("sum", 1), ("max", 1)], ids=["map", "sum", "max"])
def test_a_rows_last_elements_past_whole_vectors_are_computed_as_one_vector(reduce):
    """Rows of 3 to 33 elements: the elements past the last whole vector (`LANES`) are
    computed in a vector of lanes filled past the row (`_tail`; a row shorter than a vector
    one element at a time), and only the row's are
    written or reduced: the memory beside the rows keeps its sentinels, a NaN in a tail is
    its row's maximum, log(x) of positive x (where a lane of 0 would be -inf) matches
    float64, and every element of a row of one value has one result."""
    for m in (3, 5, 15, 16, 17, 31, 33):
        g = native.Group(f"tail_{m}_{bool(reduce)}", (3, m), ((3, m), (3, 1)),
                         ("const float v0 = logf(l0) * l1;", "out = tanhf(v0);"), reduce,
                         reduce is not None)
        fn = native.compiled(native.source([g])).function(g.name, g.dims, g.leaves, g.reduce,
                                                          g.keeps)
        rng = np.random.default_rng(m)
        x = rng.uniform(0.1, 3.0, (3, m)).astype(np.float32)
        x[2, -1] = np.nan
        scale = rng.standard_normal((3, 1)).astype(np.float32)
        want = np.tanh(np.log(x.astype(np.float64)) * scale)
        memory = np.full((3, m + 40), 7.0, np.float32)
        out = memory[:, 20:20 + m]
        got = fn(out, x, scale)
        values = got[0] if reduce else got
        assert values is out
        np.testing.assert_allclose(values, want, rtol=2e-6, atol=1e-6, equal_nan=True)
        assert (memory[:, :20] == 7.0).all() and (memory[:, 20 + m:] == 7.0).all()
        if reduce:
            total = {"sum": np.sum, "max": np.max}[reduce[0]](want, axis=1, keepdims=True)
            np.testing.assert_allclose(got[1], total, rtol=2e-6, atol=1e-5, equal_nan=True)
            assert np.isnan(got[1][2, 0])
    # the tail's lanes call the vector function the whole vectors call: a row of one value
    # gives one result, bit for bit (glibc's scalar tanhf differs from it in the last place)
    g = native.Group("tail_alike", (400, 21), ((400, 21), (400, 1)),
                     ("const float v0 = l0 * l1;", "out = tanhf(v0);"), None, False)
    fn = native.compiled(native.source([g])).function(g.name, g.dims, g.leaves)
    rows = np.random.default_rng(0).uniform(-3.0, 3.0, (400, 1)).astype(np.float32)
    got = fn(None, np.repeat(rows, 21, axis=1), np.ones((400, 1), np.float32))
    np.testing.assert_array_equal(got, np.repeat(got[:, :1], 21, axis=1))


@pytest.mark.parametrize("reduce", [None, ("max", 2)], ids=["map", "max"])
def test_column_major_scores_beside_a_row_major_mask_are_walked_by_columns(reduce):
    """Scores computed column-major (the product's result transposed) beside a mask laid out
    by rows: the outputs, laid out as the scores, are walked a column at a time, the mask read
    at its strides (element by element, this took LLaMA's causal attention at 2048 tokens from
    48 to 65 ms)."""
    g = native.Group(f"mixed_{bool(reduce)}", (2, 40, 24), ((2, 40, 24), (2, 40, 24)),
                     ("const float v0 = l0 - l1;", "out = v0 * 0.5f;"), reduce, False)
    text = native.source([g])
    assert "j * c1" in text
    fn = native.compiled(text).function(g.name, g.dims, g.leaves, g.reduce, g.keeps)
    rng = np.random.default_rng(12)
    scores = np.ascontiguousarray(rng.standard_normal((2, 24, 40)).astype(np.float32)
                                  ).transpose(0, 2, 1)
    mask = rng.standard_normal((2, 40, 24)).astype(np.float32)
    want = (scores - mask) * np.float32(0.5)
    got = fn(None, scores, mask)
    if reduce is None:
        assert got.strides == scores.strides  # laid out as the scores
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_array_equal(got, want.max(axis=2, keepdims=True))


@pytest.mark.parametrize("layout", ["rows", "columns", "mixed", "strided"])
@pytest.mark.parametrize("reduce", [None, ("sum", 2)], ids=["map", "sum"])
def test_a_groups_rows_on_several_threads_give_the_same_result(layout, reduce):
    """A group's rows, in runs shared by the native product's threads (`bb_rows`): what one
    thread computes, whatever the walk.  A row is never split, so rows give the same bits;
    columns cut into runs may put an element in a vector loop's remainder, where libmvec's
    vector tanhf and glibc's scalar one differ in the last place."""
    g = native.Group(f"shared_{layout}_{bool(reduce)}", (3, 300, 200),
                     ((3, 300, 200), (3, 300, 200), (1, 300, 1)),
                     ("const float v0 = l0 * l2 - l1;", "out = tanhf(v0);"), reduce, False)
    fn = native.compiled(native.source([g])).function(g.name, g.dims, g.leaves, g.reduce)
    rng = np.random.default_rng(13)
    x, y = (rng.standard_normal((3, 300, 200)).astype(np.float32) for _ in range(2))
    z = rng.standard_normal((1, 300, 1)).astype(np.float32)
    if layout in ("columns", "mixed"):
        x = np.ascontiguousarray(x.transpose(0, 2, 1)).transpose(0, 2, 1)
        if layout == "columns":
            y = np.ascontiguousarray(y.transpose(0, 2, 1)).transpose(0, 2, 1)
    if layout == "strided":
        x = np.ascontiguousarray(x.transpose(2, 1, 0)).transpose(2, 1, 0)
    alone = fn(None, x, y, z)
    for threads in (2, 3):
        shared = fn(None, x, y, z, threads=threads)
        if layout == "rows":
            np.testing.assert_array_equal(shared, alone)
        np.testing.assert_allclose(shared, alone, rtol=3e-7, atol=1e-5 if reduce else 0)
    want = np.tanh(x * z - y)
    want = want if reduce is None else want.sum(axis=2, keepdims=True)
    np.testing.assert_allclose(alone, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("added", [(6, 64, 4, 16), (6, 64, 1, 1)],
                         ids=["alike", "per-channel"])
@pytest.mark.parametrize("reduce", [None, ("sum", 3)], ids=["map", "sum"])
def test_dimensions_merged_into_others_leave_the_innermost_to_be_walked(reduce, added):
    """Channels by tokens of a transposed product, (6, 64) x (4, 16) as a kernel splits them:
    the channels merge into one dimension and, for a map, the tokens into another, each merge
    leaving an extent of 1 between them (`bb_merge` moves those outermost, so that the last
    two dimensions walked are channels and tokens, unless a leaf added per channel spans the
    channels but not the dimension whose place they would take).  A sum along the tokens'
    last dimension keeps it last."""
    g = native.Group(f"merged_{bool(reduce)}_{len(set(added))}", (6, 64, 4, 16),
                     ((6, 64, 4, 16), (6, 64, 4, 16), added),
                     ("const float v0 = l0 * l1;", "out = v0 + l2;"), reduce, False)
    fn = native.compiled(native.source([g])).function(g.name, g.dims, g.leaves, g.reduce)
    rng = np.random.default_rng(15)
    x, y, z = (np.ascontiguousarray(rng.standard_normal((64, 384)).astype(np.float32)
                                    ).T.reshape(6, 64, 4, 16) for _ in range(3))
    z = z[..., :added[2], :added[3]]
    want = x * y + z
    want = want if reduce is None else want.sum(axis=3, keepdims=True)
    for threads in (1, 2):
        np.testing.assert_allclose(fn(None, x, y, z, threads=threads), want, rtol=1e-5,
                                   atol=1e-5)


def test_a_map_merged_into_one_row_is_cut_into_pieces_for_the_threads():
    """Contiguous arrays merge into one row; a map group cuts it into whole pieces (1 << 17
    elements: 8 pieces on 2 threads) that the threads share, with the same bits."""
    g = native.Group("pieces", (512, 256), ((512, 256), (512, 256)),
                     ("const float v0 = l0 * l1;", "out = v0 + 1.0f;"))
    text = native.source([g])
    assert "bb_split(2, 3, x.n, &x.s[0][0], threads);" in text
    fn = native.compiled(text).function(g.name, g.dims, g.leaves)
    rng = np.random.default_rng(14)
    x, y = (rng.standard_normal((512, 256)).astype(np.float32) for _ in range(2))
    np.testing.assert_array_equal(fn(None, x, y, threads=2), x * y + np.float32(1))


def run_both(p, inputs, **kw):
    """`p` run with native groups (checking it has some) and through the interpreter."""
    source = numpy_gen.generate(p, native=True, **kw)
    module = numpy_gen.module_from_source(source)
    return source, module.run(**inputs), interp.run(p, inputs)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_every_example_matches_the_interpreter(fused, monkeypatch):
    """Every example's groups, and every product through the native product (no size floor
    for either), against the interpreter and the float64 dense evaluation."""
    monkeypatch.setattr(numpy_gen, "NATIVE_ELEMENTS", 1)  # the small shapes' groups too
    monkeypatch.setattr(native_matmul, "MIN_MACS", 1)
    monkeypatch.setattr(native_matmul, "MIN_ROWS", 1)
    grouped = multiplied = 0
    for path in EXAMPLES:
        ast = load_program(path, dims=small_dims(path, SEVERAL_BLOCKS))
        p = lower(ast)
        if fused:
            p = fuse(p, load_packs([]), get_target("h100")).program
        inputs = random_inputs(ast, seed=5)
        source, got, want = run_both(p, inputs)
        grouped += "NATIVE = compiled(" in source
        multiplied += "matmul = compiled_matmul()" in source
        dense_want = dense.evaluate(ast, inputs, dtype=np.float64)
        for name in got:
            assert_close(got[name], want[name], f"{path.stem}: {name} vs interpreter")
            if name in dense_want:
                assert_close(got[name], dense_want[name], f"{path.stem}: {name} vs dense")
    assert grouped >= len(EXAMPLES) // 2, grouped
    assert multiplied >= len(EXAMPLES) // 2, multiplied


@pytest.mark.usefixtures("split_small")
def test_parts_on_two_threads_each_call_a_group():
    """A kernel split into parts: every part's function calls its group (the C releases the
    GIL, so the threads run them at once) on its own thread, and the parts together match the
    interpreter; run whole, the kernel's group shares its rows between the threads."""
    ast = parse_program("dim r = 512 / 16\ndim c = 256 / 64\ninput X[r, c] : f32\n"
                        "input B[c] : f32\n"
                        "Y[r, c] = gelu(X[r, c] + B[c]) * sigmoid(X[r, c])\noutput Y\n")
    p = lower(ast)
    inputs = random_inputs(ast, seed=6)
    generated = numpy_gen.generate_module(p, threads=2, split=True, native=True)
    assert max(generated.parts) > 1
    (functions,) = generated.functions
    for fn in functions:
        body = generated.source[generated.source.index(f"def {fn}("):]
        body = body[:body.index("\ndef ")]
        # (a part's group writes its block of Y where the caller's array holds it)
        assert re.search(r"native_\d+\(Y\[r_start:", body) and "threads=" not in body, body
    got = numpy_gen.module_from_source(generated.source).run(**inputs)["Y"]
    assert_close(got, interp.run(p, inputs)["Y"], "parts vs interpreter")
    whole = numpy_gen.generate_module(p, threads=2, split=False, native=True).source
    assert re.search(r"= native_\d+\(.*, threads=2\)", whole), whole
    got = numpy_gen.module_from_source(whole).run(**inputs)["Y"]
    assert_close(got, interp.run(p, inputs)["Y"], "whole vs interpreter")


def test_a_chain_is_one_call_and_a_stored_or_shared_tile_ends_it():
    """GELU of a biased input is one call; a tile another kernel reads (stored) is computed
    on its own, and a tile of fewer than `NATIVE_ELEMENTS` stays numpy code unless its chain
    is `NATIVE_CHAIN` operators long."""
    ast = parse_program("dim r = 256 / 16\ndim c = 128 / 64\ninput X[r, c] : f32\n"
                        "input B[c] : f32\nH[r, c] = X[r, c] + B[c]\n"
                        "Y[r, c] = gelu(H[r, c]) * H[r, c]\n"
                        "Z[r] = sum[c] exp(X[r, c] - 1) * 2\n"
                        "output H\noutput Y\noutput Z\n")
    p = fuse(lower(ast), load_packs([]), get_target("h100")).program
    inputs = random_inputs(ast, seed=8)
    source, got, want = run_both(p, inputs)
    for name in got:
        assert_close(got[name], want[name], f"{name} vs interpreter")
    body = source[source.index("def kernel_"):source.index("def _input")]
    calls = re.findall(r"(native_\d+)\(", body)
    assert len(calls) == 2, body  # gelu(H) * H (into Y's block), and exp(X - 1) before the sum
    assert "tanh" not in body and "elementwise_gelu" not in body, body
    assert re.search(r"= t\d+_X \+ t\d+_B\n", body), body  # H, stored, on its own
    small = lower(parse_program("dim r = 16 / 16\ndim c = 64 / 64\ninput X[r, c] : f32\n"
                                "Y[r, c] = exp(X[r, c] - 1) * 2\noutput Y\n"))
    assert "native_" not in numpy_gen.generate(small, native=True)
    assert numpy_gen.NATIVE_CHAIN == 4  # the chain below is that long
    chain = parse_program("dim r = 16 / 16\ndim c = 64 / 64\ninput X[r, c] : f32\n"
                          "Y[r, c] = exp(X[r, c] - 1) * 2 + X[r, c]\noutput Y\n")
    source, got, want = run_both(lower(chain), random_inputs(chain, seed=8))
    assert_close(got["Y"], want["Y"], "Y vs interpreter")
    body = source[source.index("def kernel_"):source.index("def _input")]
    assert len(re.findall(r"native_\d+\(", body)) == 1 and "np.exp" not in body, body


def test_a_norms_scale_a_row_is_computed_in_the_group_that_applies_it():
    """RMSNorm: rsqrt(mean + eps), one value a row, joins the group multiplying the row by it
    (one call, no numpy rsqrt), and its C reads the row's value once, before the row's loop;
    against the interpreter."""
    ast = parse_program("dim r = 256 / 256\ndim c = 128 / 128\ninput X[r, c] : f32\n"
                        "S[r] = mean[c] square(X[r, c])\n"
                        "Y[r, c] = X[r, c] * rsqrt(S[r] + 1e-5)\n"
                        "output Y\n")
    p = fuse(lower(ast), load_packs([]), get_target("h100")).program
    inputs = random_inputs(ast, seed=9)
    source, got, want = run_both(p, inputs)
    assert_close(got["Y"], want["Y"], "Y vs interpreter")
    kernel = source[source.index("def kernel_Y"):source.index("def _input")]
    assert "rsqrt" not in kernel, kernel
    assert len(re.findall(r"native_\d+\(", kernel)) == 2, kernel  # the sum, then the map
    c = source[source.index('NATIVE = compiled(r"""'):source.index('""")')]
    assert "1.0f / sqrtf" in c, c
    assert re.search(r"const float l\d+ = q\d+\[0\];\n\s*#pragma omp simd", c), c  # hoisted


def test_a_lone_operator_reading_a_value_a_row_is_one_call():
    """Attention's output divided by its rows' sums: one operator, but its divisor is
    broadcast along the row, which numpy walks slowly; the C divides.  A lone operator over
    two whole tiles, or by a scalar, stays numpy code below `NATIVE_ALONE_ELEMENTS`."""
    ast = parse_program("dim r = 128 / 128\ndim c = 128 / 128\ninput X[r, c] : f32\n"
                        "input L[r] : f32\ninput Z[r, c] : f32\n"
                        "Y[r, c] = X[r, c] / L[r]\nW[r, c] = X[r, c] / Z[r, c]\n"
                        "V[r, c] = X[r, c] * 3\noutput Y\noutput W\noutput V\n")
    assert 128 * 128 < numpy_gen.NATIVE_ALONE_ELEMENTS
    p = lower(ast)
    inputs = random_inputs(ast, seed=10)
    inputs["L"] = inputs["L"] + 2.0
    inputs["Z"] = inputs["Z"] + 2.0
    source, got, want = run_both(p, inputs)
    for name in got:
        assert_close(got[name], want[name], f"{name} vs interpreter")
    kernels = {k: source[source.index(f"def kernel_{k}("):].split("\n\n\n")[0] for k in "YWV"}
    assert re.search(r"= native_\d+\(", kernels["Y"]) and "np.divide" not in kernels["Y"]
    assert "native_" not in kernels["W"] and "native_" not in kernels["V"], kernels


def test_a_lone_operator_over_a_large_tile_is_one_call_unless_a_product_adds_it():
    """From `NATIVE_ALONE_ELEMENTS` elements a lone operator is a native call on every core
    (numpy's runs on one): GPT-2's causal mask by `where` over its scores, a bias added to a
    chunk of the QKV projection.  A sum of a product and a tile stays the product's addend,
    which costs no pass at all."""
    ast = parse_program("dim r = 256 / 256\ndim c = 256 / 256\ndim k = 64\n"
                        "input X[r, c] : f32\ninput Z[r, c] : f32\ninput A[r, k] : f32\n"
                        "input B[k, c] : f32\n"
                        "W[r, c] = where(Z[r, c] > 0, X[r, c], -1e4)\n"
                        "P[r, c] = sum[k] A[r, k] * B[k, c] + X[r, c]\noutput W\noutput P\n")
    assert 256 * 256 >= numpy_gen.NATIVE_ALONE_ELEMENTS
    p = lower(ast)
    inputs = random_inputs(ast, seed=11)
    source, got, want = run_both(p, inputs)
    for name in got:
        assert_close(got[name], want[name], f"{name} vs interpreter")
    dense_want = dense.evaluate(ast, inputs, dtype=np.float64)
    assert_close(got["P"], dense_want["P"], "P vs dense")
    kernels = {k: source[source.index(f"def kernel_{k}("):].split("\n\n\n")[0] for k in "WP"}
    assert re.search(r"= native_\d+\(", kernels["W"]) and "where(" not in kernels["W"], kernels
    assert "native_" not in kernels["P"] and "matmul(" in kernels["P"], kernels


def test_a_masked_maximum_over_padded_positions_is_one_call():
    """magika's GELU before its max over 508 positions padded to 512: the bias, the GELU,
    the padding's mask and the max are one call (the mask a tile of positions computed
    once), and a sum over a transposed view of rows folds columns."""
    ast = parse_program("dim f = 256 / 64\ndim c = 508 / 128\ndim k = 512 / 128\n"
                        "input X[f, c] : f32\ninput B[f] : f32\ninput T[k, f] : f32\n"
                        "Y[f] = max[c] gelu(X[f, c] + B[f])\n"
                        "S[f] = sum[k] exp(T[k, f] * 0.5)\noutput Y\noutput S\n")
    p = lower(ast)
    inputs = random_inputs(ast, seed=12)
    source, got, want = run_both(p, inputs)
    kernel = source[source.index("def kernel_Y"):source.index("def kernel_S")]
    assert len(re.findall(r"= native_\d+\(", kernel)) == 1, kernel
    assert "tile_reduce_max" not in kernel and "gelu" not in kernel and "] = f32(" not in kernel
    kernel = source[source.index("def kernel_S"):source.index("def _input")]
    assert len(re.findall(r"= native_\d+\(", kernel)) == 1 and "np.sum" not in kernel, kernel
    for name in got:
        assert_close(got[name], want[name], f"{name} vs interpreter")


def test_a_softmaxs_exponentials_and_their_sum_are_one_call(walked_folds):
    """Fused attention's exp(S - M) is read by the product with V and by its sum: one call
    computes both.  The scores are multiplied row by row, not column-major as numpy code
    multiplies them: the C reduces a row fastest where it is contiguous (4 x 1024 x 256
    scores' exp and sum: 830 µs column-major, 290 by rows)."""
    ast = load_program(EXAMPLES[0].parent / "attention.bbp",
                       dims={"q": (256, 64), "k": (512, 128), "d": (64, 64)})
    p = fuse(lower(ast), load_packs([]), get_target("cpu"), "traffic").program
    inputs = random_inputs(ast, seed=14)
    source, got, want = run_both(p, inputs)
    assert re.search(r"t\d+_exp, t\d+_bsum = native_\d+\(", source), source
    assert "np.sum(" not in source[source.index("def kernel_"):], source
    assert "for k0 in" in source and ".swapaxes(-1, -2)" not in source, source
    for name in got:
        assert_close(got[name], want[name], f"{name} vs interpreter")


def test_an_online_softmaxs_rescaled_output_is_one_call(walked_folds):
    """Flash attention's combine rescales the output so far and adds the block's: o * a +
    pv * b, one C pass into pv's dying buffer where numpy makes three; the factors, one per
    row, stay numpy's.  The first block's o is still the identity, a number."""
    ast = load_program(EXAMPLES[0].parent / "attention.bbp",
                       dims={"q": (256, 64), "k": (512, 128), "d": (64, 64)})
    p = fuse(lower(ast), load_packs([]), get_target("cpu"), "traffic").program
    inputs = random_inputs(ast, seed=16)
    source, got, want = run_both(p, inputs)
    loop = source[source.index("for k0 in"):source.index("def _input")]
    assert re.search(r"(t\d+_dot) = native_\d+\(\1, t\d+_o, ", loop), loop
    assert "out=" not in loop, loop
    assert_close(got["O"], want["O"], "O vs interpreter")
    assert_close(got["O"], dense.evaluate(ast, inputs, dtype=np.float64)["O"], "O vs float64")


ROTATE_HALF = """dim d2 = 2 / 1
dim d4 = 4 / 1
dim d32 = 32
dim d128 = 128 / 64
dim d256 = 256 / 64
input Q[d128, d256], SIN[d128, d256] : f32
X1[d4, d128, d32] = (sum[d2] where(d2 == 0, Q[d128, (d4, d2, d32)], 0))
X2[d4, d128, d32] = (sum[d2] where(d2 == 1, Q[d128, (d4, d2, d32)], 0))
R[d4, d128, d2, d32] = (where(0 == d2, -X2[d4, d128, d32], 0) + where(0 == d2 - 1, X1[d4, d128, d32], 0)) * SIN[d128, (d4, d2, d32)]
output R
"""


def test_a_selection_by_a_known_position_is_read_through():
    """RoPE's rotate-half, its halves' blocks written one at a time (`ungridded`): on each,
    a selection by the known position is the operand it selects, or 0, and an addition of 0
    is its other operand.  The groups' C reads through them, a 0 as a literal: one call a
    block, no tile of zeros broadcast (in LLaMA's layer at 128 tokens, np.broadcast_to, a
    Python function, and a numpy pass subtracting from its zeros took 18 of 30 µs)."""
    ast = parse_program(ROTATE_HALF)
    p = lower(ast)
    inputs = random_inputs(ast, seed=17)
    source, got, want = run_both(p, inputs)
    kernel = source[source.index("def kernel_R"):source.index("def _input")]
    assert len(re.findall(r"native_\d+\(", kernel)) == 2 and "broadcast_to" not in kernel, kernel
    assert_close(got["R"], want["R"], "R vs interpreter")
    assert_close(got["R"], dense.evaluate(ast, inputs, dtype=np.float64)["R"], "R vs float64")


# Scores of grouped-query attention (three query heads g to each key head h) over an
# interleaved RoPE's pairs p of feature halves (`where(p == 0, even, 0) + where(p == 1, odd,
# 0)`), as an imported Mistral block fuses them, their maximum guarded as a softmax's is.
INTERLEAVED_PAIRS = """# bbrules block program
dim h = 2 / 1
dim g = 3 / 1
dim q = 64 / 64
dim k = 128 / 64
dim i = 32
dim p = 2 / 1
input A[h, g, q, i] : f32
input B[h, g, q, i] : f32
input C[h, k, i] : f32
input D[h, k, i] : f32
output M[h, g, q] : f32

kernel M[h, g, q]:
  let even = eq(0.0, pos(p))
  let odd = eq(0.0, pos(p) - 1.0)
  let repeat = 0.0 * pos(g)
  let query = where(even, load(A[h, g, q, i]), 0.0) + where(odd, load(B[h, g, q, i]), 0.0)
  let key = where(even, load(C[h, k, i]) + repeat, repeat) + where(odd, load(D[h, k, i]), 0.0)
  let t = reduce(p, sum, bsum(p, reduce(i, sum, dot(i, query, key))))
  let m = bmax(k, t)
  M[h, g, q] = reduce(k, max, where(eq(m, -inf), 0.0, m)){extra}
"""


def interleaved_pairs(extra: str = "") -> tuple[str, dict[str, np.ndarray]]:
    """`INTERLEAVED_PAIRS` (plus `extra` on M's value) run natively, the kernel's source, and
    checked against the interpreter."""
    p = parse_block_program(INTERLEAVED_PAIRS.format(extra=extra)).program
    rng = np.random.default_rng(31)
    inputs = {n: rng.standard_normal([p.extent(a) for a in t.axes]).astype(np.float32)
              for n, t in p.tensors.items() if t.role == "input"}
    source, got, want = run_both(p, inputs)
    assert_close(got["M"], want["M"], "M vs interpreter")
    return source[source.index("def kernel_M"):source.index("def _input")]


def test_an_interleaved_pair_is_contracted_where_it_lies():
    """The guard `bmax(scores) == -inf` reads the query head's position only through the key
    head repeated for it (`C + 0 * pos(g)`): it selects by data, not by g, so g stays in the
    vectorised grid (`numpy_plan.selected_by_position`) instead of being walked one head at a
    time.  The pairs are unrolled, and on each the contraction reads the half its selections
    pick as it lies in memory: no native call builds an operand, and no position is compared
    at run time (Mistral's attention at 128 tokens, width 768: 1.43 -> 0.89 ms)."""
    kernel = interleaved_pairs()
    assert "loop over g" not in kernel and "for p0 in (1,):" in kernel, kernel
    assert "elementwise_eq(f32(0.0)" not in kernel, kernel
    for x, y in (("A", "C"), ("B", "D")):
        assert re.search(rf"matmul\(t\d+_{x}\.reshape\(2, 192, 32\), t\d+_{y}\.", kernel), kernel


def test_a_pair_inside_an_unrolled_loop_is_unrolled_too():
    """Where the query head does select (a term by `pos(g) == 0`), g is walked one block at a
    time with its position known, and the pairs inside are unrolled too: six copies of their
    body, within `UNROLLED_BLOCKS`."""
    kernel = interleaved_pairs(" + where(eq(pos(g), 0.0), 1.0, 0.0)")
    assert "for g0 in (2,):" in kernel and "for p0_ in (1,):" in kernel, kernel
    assert "range(0, 2, 1)" not in kernel and "elementwise_eq(f32(0.0)" not in kernel, kernel


def test_a_native_block_is_written_where_it_is_stored_and_a_selected_chunk_is_not_copied():
    """Each block of R is computed by its group's call straight into R's block, viewed in the
    kernel layout, not into a temporary the store copies; X1 and X2 (a one-hot sum over the
    unrolled chunks of d2) are the chunk the one block it selects holds, with no accumulator
    of zeros added to (LLaMA's layer at 128 tokens, modules alternating: 1.031 -> 1.017 ms
    for the folds, with the lookup by ids; 1.058 -> 1.029 ms for the stores).  Stores whose
    block numpy cannot view in the layout copy (`_writable_view`)."""
    ast = parse_program(ROTATE_HALF)
    p = lower(ast)
    inputs = random_inputs(ast, seed=23)
    source, got, want = run_both(p, inputs)
    kernel = source[source.index("def kernel_R"):source.index("def _input")]
    views = np.lib.NumpyVersion(np.__version__) >= "2.1.0"  # (reshape's copy=False)
    writes = re.findall(r"native_\d+\(R\[:, :, d20:d20 \+ 1\]\.reshape\(", kernel)
    assert len(writes) == (2 if views else 0), kernel
    assert ("R[:, :, d20:d20 + 1] =" in kernel) != views, kernel
    for half in ("X1", "X2"):
        kernel = source[source.index(f"def kernel_{half}"):source.index("def kernel_R")]
        assert "f32(0.0)" not in kernel and re.search(r"t\d+_s = t\d+_Q\w*\n", kernel), kernel
    for name in ("X1", "X2", "R"):
        assert_close(got[name], want[name], f"{name} vs interpreter")
    assert_close(got["R"], dense.evaluate(ast, inputs, dtype=np.float64)["R"], "R vs float64")
    write = numpy_gen._writable_view
    assert write("R[:, :, d:d + 1].reshape(4, 1, 2, 64, 1, 32, 1)", "R", (4, 128, 2, 32),
                 ["d"]) == views
    assert write("R[:, d:d + 64].transpose(1, 0, 2, 3)", "R", (4, 128, 2, 32), ["d"])
    assert not write("R[:, :, d:d + 1].reshape(4, 128 * 32)", "R", (4, 128, 2, 32), ["d"])
    assert not write("R[:, d:d + 64].transpose(1, 0, 2, 3).reshape(256, 64)", "R",
                     (4, 128, 2, 32), ["d"])


@pytest.mark.parametrize("op", ["max", "min", "sum"])
def test_a_reduction_of_a_loaded_tile_is_one_call(op):
    """A softmax's max over stored scores reads no operator of its kernel: the C reduces the
    loaded tile itself (numpy's reduction over rows of 128 took 44 µs of LLaMA's attention at
    128 tokens, the C 17).  A sum over a contraction stays one matmul."""
    ast = parse_program(f"dim i = 64 / 16\ndim j = 128\ninput S[i, j] : f32\n"
                        f"M[i] = {op}[j] S[i, j]\noutput M\n")
    p = lower(ast)
    inputs = random_inputs(ast, seed=15)
    inputs["S"][3, 7] = np.nan
    source, got, want = run_both(p, inputs)
    kernel = source[source.index("def kernel_"):source.index("def _input")]
    assert re.search(r" = native_\d+\(None, t\d+_S", kernel), kernel
    assert kernel.count("native_") == 1 and f"np.{op}" not in kernel, kernel
    assert np.isnan(got["M"][3]) and np.isnan(want["M"][3])
    assert_close(got["M"], want["M"], f"{op} vs interpreter")
    dense_want = {"max": np.max, "min": np.min, "sum": np.sum}[op](
        inputs["S"].astype(np.float64), axis=1)
    magnitude = np.nansum(np.abs(inputs["S"]), axis=1).max()  # a sum's terms cancel
    np.testing.assert_allclose(got["M"], dense_want, rtol=0, atol=1e-6 * magnitude,
                               equal_nan=True)
    ast = parse_program("dim i = 64 / 16\ndim j = 128\ndim n = 64\ninput A[i, j] : f32\n"
                        "input B[j, n] : f32\nC[i, n] = sum[j] A[i, j] * B[j, n]\noutput C\n")
    assert "matmul(" in numpy_gen.generate(lower(ast), native=True)


def test_without_a_compiler_the_module_is_numpy_code(monkeypatch):
    ast = parse_program("dim r = 128 / 16\ndim c = 128 / 64\ninput X[r, c] : f32\n"
                        "Y[r, c] = tanh(X[r, c] * 3 + 1) - 0.25\noutput Y\n")
    p = lower(ast)
    inputs = random_inputs(ast, seed=9)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert not native.available() and not numpy_gen.default_native()
    native.compiled.cache_clear()
    with pytest.warns(UserWarning, match="without native groups"):
        module = numpy_gen.load(p, native=True)
    assert not hasattr(module, "NATIVE")
    np.testing.assert_array_equal(module.run(**inputs)["Y"],
                                  numpy_gen.load(p, native=False).run(**inputs)["Y"])
    with pytest.warns(UserWarning, match="without native groups"):  # `bbrules run --profile`
        assert numpy_timing.profile(p, inputs, runs=1, native=True).runs == 1


def test_a_compiled_source_is_kept_and_reused(cache, monkeypatch):
    g = native.Group("kept", (64,), ((64,),), ("out = l0 * 7.0f;",))
    text = native.source([g])
    native.compiled.cache_clear()
    native.compiled(text)
    built = set(cache.glob("*.so"))
    assert built

    def no_compiler(*args, **kw):
        raise AssertionError("compiled again")
    monkeypatch.setattr(subprocess, "run", no_compiler)
    native.compiled.cache_clear()
    x = np.arange(64, dtype=np.float32)
    np.testing.assert_array_equal(native.compiled(text).function("kept", (64,), ((64,),))(
        None, x), x * 7)
    assert set(cache.glob("*.so")) == built


GELU_BIAS = """\
dim r = 256 / 64
dim c = 128 / 128
input X[r, c], B[c] : f32
Y[r, c] = gelu(X[r, c] + B[c]) * 2
output Y
"""


def test_the_command_line_writes_and_runs_native_groups(tmp_path, capsys):
    program = tmp_path / "gelu.bbp"
    program.write_text(GELU_BIAS)
    out = tmp_path / "gelu.py"
    assert main(["codegen", str(program), "--native", "-o", str(out)]) == 0
    module = numpy_gen.module_from_source(out.read_text())
    assert hasattr(module, "NATIVE")
    inputs = random_inputs(parse_program(GELU_BIAS), seed=13)
    assert_close(module.run(**inputs)["Y"], interp.run(lower(parse_program(GELU_BIAS)),
                                                       inputs)["Y"], "codegen --native")
    assert main(["run", str(program), "--backend", "numpy", "--native", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and set(report["outputs"]) == {"Y"}, report
    assert main(["run", str(program), "--native"]) == 2  # the interpreter has no C loops
    assert "--backend numpy" in capsys.readouterr().err
    plain = tmp_path / "plain.py"
    assert main(["codegen", str(program), "-o", str(plain)]) == 0  # numpy code unless asked
    assert "NATIVE" not in plain.read_text()


def test_modules_run_with_native_groups_unless_turned_off(monkeypatch):
    """`load` (and so `run`, `bbrules run`, `bbrules.compile`) uses native groups where a
    compiler is found; `$BBRULES_NATIVE=0` turns them off (as this suite does elsewhere)."""
    p = lower(parse_program(GELU_BIAS))
    monkeypatch.delenv("BBRULES_NATIVE")
    assert numpy_gen.default_native() and hasattr(numpy_gen.load(p), "NATIVE")
    assert not hasattr(numpy_gen.load(p, native=False), "NATIVE")
    monkeypatch.setenv("BBRULES_NATIVE", "0")
    assert not numpy_gen.default_native() and not hasattr(numpy_gen.load(p), "NATIVE")


def test_a_chain_longer_than_a_group_is_left_to_numpy(monkeypatch):
    """A group has at most `NATIVE_OPERATORS` operators: a program's expressions may be deep,
    and compiling time grows with them."""
    monkeypatch.setattr(numpy_gen, "NATIVE_OPERATORS", 8)

    def chain(depth: int):
        expr = "X[r, c]"
        for _ in range(depth):
            expr = f"tanh({expr} * 2)"
        return lower(parse_program("dim r = 128 / 16\ndim c = 128 / 64\ninput X[r, c] : f32\n"
                                   f"Y[r, c] = {expr}\noutput Y\n"))
    assert "= native_" in numpy_gen.generate(chain(4), native=True)  # 8 operators
    assert "= native_" not in numpy_gen.generate(chain(5), native=True)



SLIDING_WINDOW = """dim h = 2 / 1
dim q = 256 / 16
dim k = 256 / 16
dim d = 16
input Q[h, q, d], K[h, k, d], V[h, k, d] : f32
S[h, q, k] = where(k <= q and q - k < 64, sum[d] Q[h, q, d] * K[h, k, d] * 0.25, -inf)
M[h, q]    = max[k] S[h, q, k]
E[h, q, k] = exp(S[h, q, k] - M[h, q])
L[h, q]    = sum[k] E[h, q, k]
O[h, q, d] = sum[k] E[h, q, k] * V[h, k, d] / L[h, q]
output O
"""


@pytest.mark.usefixtures("split_small")
def test_a_block_max_of_a_selection_known_to_hold_reads_what_it_selects(monkeypatch):
    """Sliding-window attention, fused, in parts: on the key blocks inside every query's window
    the mask is known to hold, and the scores' block max, a call of its own, reads the scores
    the selection passes through (it read the selection, which no step computes there)."""
    monkeypatch.setattr(numpy_gen, "NATIVE_ELEMENTS", 1)
    ast = parse_program(SLIDING_WINDOW)
    p = fuse(lower(ast), load_packs([]), get_target("h100")).program
    assert len(p.kernels) == 1
    inputs = random_inputs(ast, seed=3)
    generated = numpy_gen.generate_module(p, threads=2, split=True, native=True)
    assert max(generated.parts) > 1 and "native_" in generated.source
    got = numpy_gen.module_from_source(generated.source).run(**inputs)["O"]
    assert_close(got, interp.run(p, inputs)["O"], "parts vs interpreter")
    assert_close(got, dense.evaluate(ast, inputs, dtype=np.float64)["O"], "parts vs dense")
