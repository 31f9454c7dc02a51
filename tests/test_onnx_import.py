"""ONNX import: onnx's own backend test cases agree after import (and after fusion), real
graphs regroup heads without copies, and what cannot be imported is refused clearly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from bbrules import interp  # noqa: E402
from bbrules.codegen import numpy_gen  # noqa: E402
from bbrules.fuse import fuse  # noqa: E402
from bbrules.onnx_conformance import backend_cases, run_case  # noqa: E402
from bbrules.errors import UsageError  # noqa: E402
from bbrules.frontend import parse_dim_override  # noqa: E402
from bbrules.onnx_import import OnnxError, import_onnx  # noqa: E402
from bbrules.packs import load_packs  # noqa: E402
from bbrules.targets import get_target  # noqa: E402

# Every case of these operators runs through import and the reference interpreter.
SUBSET = ["Add", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Tanh", "Erf", "Gelu", "MatMul",
          "Gemm", "Softmax", "LogSoftmax", "ReduceSum", "ReduceMean", "ReduceMax",
          "LayerNormalization", "RMSNormalization", "Attention", "Transpose", "Reshape",
          "Squeeze", "Unsqueeze", "Expand", "Where", "Equal", "Less", "Identity", "Slice",
          "Concat", "Split", "RotaryEmbedding", "Conv", "Gather", "MaxPool", "AveragePool",
          "Tile", "InstanceNormalization", "BatchNormalization", "Trilu", "Einsum", "IsNaN"]

# ... and these must be among the passes (each a kind of attention or norm a model uses).
MUST_PASS = ["test_attention_4d", "test_attention_4d_causal", "test_attention_4d_gqa",
             "test_attention_4d_softcap", "test_attention_4d_attn_mask_bool",
             "test_attention_4d_diff_heads_sizes", "test_attention_4d_scaled",
             "test_layer_normalization_4d_axis1", "test_rms_normalization_4d_axis1",
             "test_softmax_axis_1", "test_logsoftmax_axis_1", "test_gemm_all_attributes",
             "test_matmul_4d", "test_matmul_1d_3d", "test_gelu_default_1", "test_gelu_tanh_1",
             "test_reshape_negative_extended_dims", "test_unsqueeze_unsorted_axes",
             "test_slice", "test_slice_negative_axes", "test_concat_3d_axis_1",
             "test_split_variable_parts_2d_opset13", "test_rotary_embedding_no_position_ids",
             "test_rotary_embedding_no_position_ids_interleaved",
             "test_basic_conv_with_padding", "test_conv_with_strides_and_asymmetric_padding",
             "test_gather_negative_indices", "test_gather_2d_indices",
             "test_rotary_embedding", "test_rotary_embedding_3d_input", "test_tile",
             "test_maxpool_2d_pads", "test_maxpool_2d_same_lower", "test_maxpool_1d_default",
             "test_averagepool_2d_pads", "test_averagepool_2d_pads_count_include_pad",
             "test_averagepool_2d_strides", "test_maxpool_2d_ceil",
             "test_maxpool_2d_ceil_output_size_reduce_by_one",
             "test_averagepool_2d_ceil_last_window_starts_on_pad", "test_instancenorm_epsilon",
             "test_batchnorm_epsilon", "test_tril_neg", "test_triu_square_neg",
             "test_einsum_batch_matmul", "test_einsum_transpose", "test_einsum_inner_prod"]


# Run by the numpy backend, which gathers a window's taps: the interpreter builds each one-hot
# tile whole (a 3-D pool's, 29 GiB).  The 3-D pools of 32^3 inputs take 15 s each there;
# `benchmarks/onnx_conformance.py` runs them.
GATHERED = {"MaxPool", "AveragePool"}
SLOW = {"test_maxpool_3d_default", "test_averagepool_3d_default"}


@pytest.mark.parametrize("op", SUBSET)
def test_backend_cases_agree_or_are_refused(op):
    run = numpy_gen.run if op in GATHERED else interp.run
    outcomes = [run_case(case, run) for case in backend_cases([op]) if case.name not in SLOW]
    failed = [f"{o.case}: {o.detail}" for o in outcomes if o.status == "failed"]
    assert not failed, failed
    assert Counter(o.status for o in outcomes)["passed"] > 0
    for o in outcomes:
        if o.case in MUST_PASS:
            assert o.status == "passed", (o.case, o.detail)


FUSED = ["test_attention_4d_causal", "test_attention_4d_gqa_expanded",
         "test_layer_normalization_4d_axis1", "test_softmax_axis_1", "test_gemm_all_attributes",
         "test_rotary_embedding_no_position_ids", "test_concat_3d_axis_1"]


@pytest.mark.parametrize("name", FUSED)
def test_fused_cases_agree_through_numpy(name):
    pack, target = load_packs([]), get_target("h100")
    ops = ["Attention", "LayerNormalization", "Softmax", "Gemm", "RotaryEmbedding", "Concat"]
    case = next(c for c in backend_cases(ops) if c.name == name)
    outcome = run_case(case, lambda p, x: numpy_gen.run(fuse(p, pack, target).program, x))
    assert outcome.status == "passed", outcome.detail


def transformer_block(path, batch: str | int = "batch", s: int = 64, e: int = 64, h: int = 4):
    """LayerNorm, Q/K/V projections, heads split by Reshape + Transpose, softmax attention,
    heads merged back, output projection and a residual add: an exporter's graph."""
    rng = np.random.default_rng(0)
    d = e // h

    def weight(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.1, name)
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["xn"], axis=-1)]
    for n, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [helper.make_node("MatMul", ["xn", f"w{n}"], [n]),
                  helper.make_node("Reshape", [n, "heads"], [f"{n}4"]),
                  helper.make_node("Transpose", [f"{n}4"], [f"{n}t"], perm=perm)]
    nodes += [helper.make_node("MatMul", ["qt", "kt"], ["s0"]),
              helper.make_node("Div", ["s0", "root"], ["s"]),
              helper.make_node("Softmax", ["s"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vt"], ["o4"]),
              helper.make_node("Transpose", ["o4"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "merged"], ["o"]),
              helper.make_node("MatMul", ["o", "wo"], ["y0"]),
              helper.make_node("Add", ["y0", "x"], ["y"])]
    inits = [weight("g", e), weight("b", e), weight("wq", e, e), weight("wk", e, e),
             weight("wv", e, e), weight("wo", e, e),
             numpy_helper.from_array(np.array([0, 0, h, d], np.int64), "heads"),
             numpy_helper.from_array(np.array([0, 0, e], np.int64), "merged"),
             numpy_helper.from_array(np.array(np.sqrt(d), np.float32), "root")]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [batch, s, e])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [batch, s, e])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return model


def test_heads_split_and_merged_without_copies(tmp_path):
    transformer_block(tmp_path / "block.onnx")
    imported = import_onnx(tmp_path / "block.onnx")
    statements = [line for line in imported.text.splitlines() if "] = " in line]
    # LN (3), 3 projections, scores, scale, softmax (4), PV, out, residual: no copy
    assert len(statements) == 15, imported.text
    assert not any("_copy" in line for line in statements)
    assert "(d4, d16)" in imported.text  # Q, K and V read per head through a view


@pytest.mark.parametrize("batch", [1, 3])
def test_imported_block_matches_onnx_reference_fused(tmp_path, batch):
    model = transformer_block(tmp_path / "block.onnx")
    imported = import_onnx(tmp_path / "block.onnx", {"batch": (batch, None)})
    x = np.random.default_rng(1).standard_normal((batch, 64, 64)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    program = lower(parse_program(imported.text))
    fused = fuse(program, load_packs([]), get_target("h100")).program
    assert len(fused.kernels) < len(program.kernels)
    got = imported.onnx_outputs(numpy_gen.run(fused, imported.bbp_inputs({"x": x})))["y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_imported_causal_attention_is_one_online_pass_over_the_keys(tmp_path):
    """ONNX's `Attention` function guards its softmax with a `Where` whose condition folds to
    a constant false; with that select folded away (rules/constants.bbr `where_false`), the
    online-softmax rules see the softmax, so the fused kernel walks the keys once."""
    from bbrules.frontend import parse_program
    from bbrules.ir import Reduce, postorder
    from bbrules.lower import lower
    shape, kv = [1, 4, 256, 16], [1, 2, 256, 16]  # grouped-query heads, as LLaMA's
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=1)
    graph = helper.make_graph([node], "attention", [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, shape if n == "Q" else kv)
        for n in "QKV"], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    onnx.save(model, str(tmp_path / "attention.onnx"))
    imported = import_onnx(tmp_path / "attention.onnx")
    fused = fuse(lower(parse_program(imported.text)), load_packs([]), get_target("h100")).program
    monoids = {n.monoid.name for k in fused.stores for n in postorder(k.value)
               if isinstance(n, Reduce)}
    # one fold carries the maximum, the sum and the output (not a pass for the maximum first)
    assert "softmax" in monoids and "max" not in monoids, monoids
    rng = np.random.default_rng(2)
    feed = {n: rng.standard_normal(shape if n == "Q" else kv, dtype=np.float32) for n in "QKV"}
    want = ReferenceEvaluator(model).run(None, feed)[0]
    got = imported.onnx_outputs(numpy_gen.run(fused, imported.bbp_inputs(feed)))["Y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _attention_model(causal: bool) -> onnx.ModelProto:
    shape = [1, 2, 512, 32]
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=int(causal))
    graph = helper.make_graph([node], "attention", [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "QKV"],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_a_folded_causal_mask_becomes_positions_and_fused_attention_skips_blocks(tmp_path):
    """ONNX's `Attention` builds its causal mask from constants; folded, it is a matrix of 0
    and -inf.  Imported as the predicate it is (not a weight), fusion sees positions, and the
    fused kernel visits only the key blocks at or below the diagonal."""
    from bbrules.cost import cost_program
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    flops = {}
    for causal in (False, True):
        model = _attention_model(causal)
        onnx.save(model, str(tmp_path / "attention.onnx"))
        imported = import_onnx(tmp_path / "attention.onnx")
        assert set(imported.weights) == set(), imported.weights.keys()
        assert ("<=" in imported.text) == causal
        fused = fuse(lower(parse_program(imported.text)), load_packs([]),
                     get_target("h100")).program
        flops[causal] = cost_program(fused, get_target("h100")).flops
        rng = np.random.default_rng(5)
        feed = {n: rng.standard_normal([1, 2, 512, 32], dtype=np.float32) for n in "QKV"}
        want = ReferenceEvaluator(model).run(None, feed)[0]
        got = imported.onnx_outputs(numpy_gen.run(fused, imported.bbp_inputs(feed)))["Y"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # 8 query blocks of 64 visit 36 of 64 key blocks
    assert flops[True] <= 0.6 * flops[False], flops


def test_a_sliding_window_mask_given_to_attention_becomes_positions(tmp_path):
    """A window of 64 keys before each query as an additive mask initializer: imported as
    `k >= q - 63 and k <= q + 0`, fused attention visits only the blocks of the band."""
    from bbrules.cost import cost_program
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    n = 512
    offset = np.subtract.outer(np.arange(n), np.arange(n))  # q - k
    mask = np.where((offset >= 0) & (offset < 64), 0.0, -np.inf).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["M"], value=numpy_helper.from_array(mask)),
             helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y"])]
    graph = helper.make_graph(nodes, "window", [
        helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 2, n, 32]) for x in "QKV"],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 2, n, 32])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    onnx.save(model, str(tmp_path / "window.onnx"))
    imported = import_onnx(tmp_path / "window.onnx")
    assert not imported.weights and " - 63" in imported.text, imported.text
    fused = fuse(lower(parse_program(imported.text)), load_packs([]), get_target("h100")).program
    rng = np.random.default_rng(8)
    feed = {x: rng.standard_normal([1, 2, n, 32], dtype=np.float32) for x in "QKV"}
    want = ReferenceEvaluator(model).run(None, feed)[0]
    got = imported.onnx_outputs(numpy_gen.run(fused, imported.bbp_inputs(feed)))["Y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # 8 query blocks of 64 visit 2 key blocks each (1 for the first) of 8: 15 of 64
    full = 2 * 4 * n * n * 32  # two heads' scores and output, 2 flops a product
    assert cost_program(fused, get_target("h100")).flops < 0.35 * full


@pytest.mark.parametrize("matrix, band", [
    (np.where(np.tril(np.ones((4, 6))) > 0, 0.0, -np.inf), (0.0, -np.inf, None, 0)),
    (np.tril(np.ones((1, 1, 5, 5)), -1), (1.0, 0.0, None, -1)),
    (np.triu(np.ones((5, 5))), (1.0, 0.0, 0, None)),
    (np.where(np.abs(np.subtract.outer(np.arange(6), np.arange(6))) <= 2, 0.0, -1e9),
     (0.0, -1e9, -2, 2)),
])
def test_band_of_reads_diagonal_bands(matrix, band):
    from bbrules.onnx_import import Band, band_of
    assert band_of(matrix) == Band(*band)
    lo, hi = band[2], band[3]
    n, m = matrix.shape[-2:]
    offset = np.arange(m)[None, :] - np.arange(n)[:, None]
    inside = (offset >= (lo if lo is not None else -n)) & (offset <= (hi if hi is not None else m))
    np.testing.assert_array_equal(matrix.reshape(n, m), np.where(inside, band[0], band[1]))


@pytest.mark.parametrize("matrix", [
    np.random.default_rng(0).integers(0, 2, (5, 5)).astype(float),  # two values, no band
    np.add.outer(np.arange(5), np.arange(5)) % 2.0,  # a checkerboard
    np.tril(np.ones((5, 5))) - np.eye(5, k=-2),  # a triangle with a gap in its rows
    np.arange(9.0).reshape(3, 3),  # many values
    np.tril(np.ones((2, 3, 3))),  # three axes
])
def test_band_of_refuses_what_is_not_a_band(matrix):
    from bbrules.onnx_import import band_of
    assert band_of(matrix) is None


@pytest.mark.parametrize("arr, ramp", [
    (np.arange(257), (0, 0.0, 1.0)),
    (np.arange(5.0).reshape(1, 5, 1) * 2 + 3, (1, 3.0, 2.0)),
    (np.arange(4, 0, -1), (0, 4.0, -1.0)),
])
def test_ramp_of_reads_positions(arr, ramp):
    from bbrules.onnx_import import Ramp, ramp_of
    assert ramp_of(arr) == Ramp(*ramp)


@pytest.mark.parametrize("arr", [
    np.arange(6).reshape(2, 3),  # two varying axes
    np.array([0, 1, 3]),  # not one step
    np.arange(5) * 0.5,  # a fractional step
    np.arange(5) + 0.25,  # a fractional start
    np.array([7.0]),  # nothing varies
    np.arange(3) * 2.0**23 + 2.0**23,  # past 2^24, where float32 rounds
])
def test_ramp_of_refuses_what_is_not_a_ramp(arr):
    from bbrules.onnx_import import ramp_of
    assert ramp_of(arr) is None


def _byte_embedding(rng: np.random.Generator) -> onnx.ModelProto:
    """magika's byte embedding: Equal(bytes, [0 .. 256]) cast to floats, times a table."""
    table = numpy_helper.from_array(rng.standard_normal((257, 16)).astype(np.float32), "table")
    classes = numpy_helper.from_array(np.arange(257, dtype=np.int32), "classes")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    graph = helper.make_graph(
        [helper.make_node("Unsqueeze", ["ids", "axes"], ["column"]),
         helper.make_node("Equal", ["column", "classes"], ["hot"]),
         helper.make_node("Cast", ["hot"], ["onehot"], to=TensorProto.FLOAT),
         helper.make_node("MatMul", ["onehot", "table"], ["y"])], "embed",
        [helper.make_tensor_value_info("ids", TensorProto.INT32, [64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 16])],
        [table, classes, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_one_hot_against_a_constant_range_is_a_gather(tmp_path):
    # The constant range is the position the ids are compared with, so the product is a
    # lookup of rows.
    rng = np.random.default_rng(4)
    model = _byte_embedding(rng)
    onnx.save(model, str(tmp_path / "embed.onnx"))
    imported = import_onnx(tmp_path / "embed.onnx")
    assert re.search(r"^input classes\[", imported.text, re.M) is None, imported.text
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    fused = fuse(lower(parse_program(imported.text)), load_packs([]), get_target("h100")).program
    code = numpy_gen.generate(fused)
    assert "gather_one_hot(" in code and "np.matmul" not in code, code
    ids = rng.integers(0, 257, 64).astype(np.int32)
    ids[:2] = [0, 256]
    want = ReferenceEvaluator(model).run(None, {"ids": ids})[0]
    got = imported.onnx_outputs(numpy_gen.run(fused, imported.bbp_inputs({"ids": ids})))["y"]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_wide_convolution_fits_local_memory_and_fuses_with_its_activation(tmp_path):
    # magika's layer at a quarter of its width: 128 channels, 256 positions, 5 taps.  A tile
    # over output positions, taps, channels and input positions at once would not fit h100's
    # 227 KiB; the shift is a contraction of its own and the taps loop around the channels.
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((128, 128, 5)).astype(np.float32) / 20, "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[5]),
         helper.make_node("Tanh", ["c"], ["y"])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128, 252])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(tmp_path / "conv.onnx"))
    imported = import_onnx(tmp_path / "conv.onnx")
    from bbrules.cost import cost_program
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    program = lower(parse_program(imported.text))
    assert cost_program(program, get_target("h100")).legal
    fused = fuse(program, load_packs([]), get_target("h100")).program
    assert len(fused.kernels) == 1
    x = rng.standard_normal((1, 128, 256)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    # the weights are constants, read-only: the numpy backend keeps their copies in other
    # layouts from one call to the next (`relaid`)
    assert imported.weights and not any(w.flags.writeable for w in imported.weights.values())
    module = numpy_gen.load(fused, threads=1)
    for _ in range(2):
        got = imported.onnx_outputs(module.run(**imported.bbp_inputs({"x": x})))["y"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((1, 8, 20), (8, 1, 15), dict(group=8, pads=[7, 7])),            # depthwise (Conformer's)
    ((2, 6, 9, 9), (12, 1, 3, 3), dict(group=6, strides=[2, 2],      # depthwise, 2 per channel
                                       pads=[1, 1, 1, 1])),
    ((1, 4, 7, 8), (6, 2, 3, 2), dict(group=2, dilations=[2, 1])),   # two groups of two
], ids=["depthwise-1d", "multiplier-2d", "groups-2d"])
def test_grouped_convolutions_agree_with_onnx(tmp_path, x_shape, w_shape, attrs):
    """Each group convolves its own channels: the channels read as (group, channel in the
    group), exact against onnx's reference evaluator, unfused and fused for the cpu target
    (through the numpy backend, which gathers the taps: the interpreter would walk these
    blocks of one a tap and a position at a time)."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=list(w_shape[2:]),
                          **attrs),
         helper.make_node("Sigmoid", ["c"], ["y"])], "grouped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(tmp_path / "grouped.onnx"))
    imported = import_onnx(tmp_path / "grouped.onnx")
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    program = lower(parse_program(imported.text))
    x = rng.standard_normal(x_shape).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    inputs = imported.bbp_inputs({"x": x})
    for p in (program, fuse(program, load_packs([]), get_target("cpu")).program):
        got = imported.onnx_outputs(numpy_gen.run(p, inputs))["y"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _depthwise(tmp_path, w: np.ndarray, shape: tuple[int, ...], attrs: dict,
               then: str | None = None):
    """A depthwise 2-D convolution of weight `w` over an image of `shape` (channels first;
    `attrs`: its pads, strides, dilations), then a unary operator `then` where given, saved
    and imported: (the model, the import)."""
    taps = list(w.shape[2:])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c" if then else "y"], kernel_shape=taps,
                              group=shape[0], **attrs)]
    nodes += [helper.make_node(then, ["c"], ["y"])] if then else []
    graph = helper.make_graph(
        nodes, "depthwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, *shape])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(tmp_path / "depthwise.onnx"))
    return model, import_onnx(tmp_path / "depthwise.onnx")


def test_a_2d_window_picks_each_dimension_by_its_own_one_hot(tmp_path):
    """ConvNeXt's depthwise 7 x 7 on a 16 x 16 image of 64 channels: one one-hot over both
    dimensions was a [16, 16, 16, 16] tile beside a partial pick of 1 MiB, which no blocks
    fit in the cpu target's 512 KiB.  Picked a dimension at a time it fits as imported."""
    rng = np.random.default_rng(12)
    w = rng.standard_normal((64, 1, 7, 7)).astype(np.float32) / 7
    model, imported = _depthwise(tmp_path, w, (64, 16, 16), {"pads": [3] * 4})
    from bbrules.cost import cost_program
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    program = lower(parse_program(imported.text))
    assert cost_program(program, get_target("cpu")).legal
    x = rng.standard_normal((1, 64, 16, 16)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = imported.onnx_outputs(numpy_gen.run(program, imported.bbp_inputs({"x": x})))["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, taps, attrs", [
    ((32, 10, 12), 3, {"pads": [1] * 4}),
    ((32, 11, 9), 3, {"pads": [1] * 4, "strides": [2, 2]}),
    ((16, 12, 12), 3, {"pads": [2] * 4, "dilations": [2, 2]}),
    ((16, 9, 9), 5, {"pads": [2, 1, 2, 1]}),
    ((16, 8, 8), 3, {"pads": [0] * 4})], ids=["padded", "strided", "dilated", "uneven", "valid"])
def test_depthwise_2d_convolutions_are_window_products_that_agree_with_onnx(
        tmp_path, shape, taps, attrs):
    """A depthwise 2-D convolution (and a ReLU) in a native module, unfused and fused for
    cpu: its window, read in place, is a window product (`native_matmul.window_product`),
    padded, strided, dilated or unevenly padded, against onnx's reference evaluator."""
    rng = np.random.default_rng(14)
    _assert_window_products(tmp_path, rng.standard_normal(
        (shape[0], 1, taps, taps)).astype(np.float32), shape, attrs, "Relu", rng)


def test_a_depthwise_1d_convolution_over_many_channels_is_a_window_product(tmp_path):
    """Conformer's depthwise convolution, 15 taps over 40 positions of 64 channels: a product
    of one row per channel, which the native product leaves to numpy (Conformer's 768
    channels took 450 µs so), is one window product, unfused and fused, against onnx's
    reference evaluator."""
    rng = np.random.default_rng(15)
    _assert_window_products(tmp_path, rng.standard_normal((64, 1, 15)).astype(np.float32),
                            (64, 40), {"pads": [7, 7]}, "Sigmoid", rng)


def _assert_window_products(tmp_path, w: np.ndarray, shape: tuple[int, ...], attrs: dict,
                            then: str, rng: np.random.Generator) -> None:
    """`_depthwise`'s convolution then `then`, in native modules unfused and fused for cpu:
    each a window product, each agreeing with onnx's reference evaluator."""
    from bbrules.codegen import native
    if not native.available():
        pytest.skip("no C compiler")
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    model, imported = _depthwise(tmp_path, w, shape, attrs, then=then)
    program = lower(parse_program(imported.text))
    x = rng.standard_normal((1, *shape)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    for p in (program, fuse(program, load_packs([]), get_target("cpu")).program):
        source = numpy_gen.generate_module(p, threads=2, split=False, native=True).source
        assert "window_product(" in source
        module = numpy_gen.module_from_source(source)
        got = imported.onnx_outputs(module.run(**imported.bbp_inputs({"x": x})))["y"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_pointwise_convolution_is_a_product_over_channels(tmp_path):
    """One tap, unstrided and unpadded (MobileNet's and Conformer's pointwise convolutions): the
    output position is the input's, so nothing picks it, and the convolution is a product over
    the channels alone; a strided one still picks its positions."""
    rng = np.random.default_rng(13)
    for strides, picks in (([1, 1], False), ([2, 2], True)):
        graph = helper.make_graph(
            [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[1, 1], strides=strides)],
            "pointwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(rng.standard_normal((5, 8, 1, 1)).astype(np.float32), "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        onnx.save(model, str(tmp_path / "pointwise.onnx"))
        imported = import_onnx(tmp_path / "pointwise.onnx")
        assert ("where(" in imported.text) == picks, imported.text
        from bbrules.frontend import parse_program
        from bbrules.lower import lower
        x = rng.standard_normal((1, 8, 6, 6)).astype(np.float32)
        program = lower(parse_program(imported.text))
        got = imported.onnx_outputs(interp.run(program, imported.bbp_inputs({"x": x})))["y"]
        np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)


def test_groups_that_do_not_divide_the_channels_are_refused(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3], group=3)], "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((3, 1, 3), np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
              str(tmp_path / "bad.onnx"))
    with pytest.raises(OnnxError, match=r"node 0 .*3 group\(s\) do not fit 4 input channels"):
        import_onnx(tmp_path / "bad.onnx")


@pytest.mark.parametrize("indices, sliced", [
    (np.array(2), True),                     # one row: a slice that drops the axis
    (np.array([[3, 3], [3, 3]]), True),      # one row, repeated: a broadcast slice
    (np.array([1, 2, 3]), True),             # consecutive rows: a slice
    (np.array([4, -1, 0, 2]), False)])       # any rows (-1: the last): a one-hot matmul
def test_gather_with_constant_indices(tmp_path, indices, sliced):
    data = np.random.default_rng(5).standard_normal((2, 6, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["g"], axis=1),
         helper.make_node("Mul", ["g", "g"], ["y"])], "gather",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(indices.astype(np.int64), "i")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(tmp_path / "gather.onnx"))
    imported = import_onnx(tmp_path / "gather.onnx")
    # a slice picks rows by position; other indices are a weight the one-hot compares with
    assert (re.search(r"^input i\[", imported.text, re.M) is None) == sliced, imported.text
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    program = lower(parse_program(imported.text))
    got = imported.onnx_outputs(interp.run(program, imported.bbp_inputs({"x": data})))["y"]
    want = ReferenceEvaluator(model).run(None, {"x": data})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)



def regrouped_and_reference(tmp_path, nodes, consts: dict[str, list[int]], x: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray]:
    """A graph of `nodes` over input x and int64 constants `consts`, imported (it must store
    a regrouped copy) and run by the interpreter, beside onnx's reference evaluation."""
    shape = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "regrouped", [shape("x", TensorProto.FLOAT, list(x.shape))],
        [shape("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(tmp_path / "regrouped.onnx"))
    imported = import_onnx(tmp_path / "regrouped.onnx")
    assert "_regrouped[" in imported.text, imported.text
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    program = lower(parse_program(imported.text))
    got = imported.onnx_outputs(interp.run(program, imported.bbp_inputs({"x": x})))["y"]
    return got, ReferenceEvaluator(model).run(None, {"x": x})[0]


def test_operands_that_factor_a_dimension_two_ways_are_read_through_one_regrouped(tmp_path):
    """Phi-3's grouped-query heads: 6 query heads sliced from a fused projection (12 of its 20
    features, in thirds of 4) and viewed as heads of 2 are (3, 2); 2 key heads repeated 3
    times by Tile are (2, 3).  Their product had been refused ("operands factor a dimension
    in incompatible ways"); one operand is stored again with its heads one axis, and the
    result is the reference's."""
    got, want = regrouped_and_reference(tmp_path, [
        helper.make_node("Split", ["x", "sizes"], ["q", "k", "v"], axis=1),
        helper.make_node("Reshape", ["q", "heads"], ["qh"]),
        helper.make_node("Reshape", ["k", "kv"], ["kh"]),
        helper.make_node("Unsqueeze", ["kh", "axis"], ["k1"]),
        helper.make_node("Tile", ["k1", "repeats"], ["kt"]),
        helper.make_node("Reshape", ["kt", "heads"], ["kr"]),
        helper.make_node("Mul", ["qh", "kr"], ["y"])],
        {"sizes": [12, 4, 4], "heads": [4, 6, 2], "kv": [4, 2, 2], "axis": [2],
         "repeats": [1, 1, 3, 1]},
        np.random.default_rng(6).standard_normal((4, 20)).astype(np.float32))
    np.testing.assert_array_equal(got, want)


def test_a_rolled_axis_read_in_windows_its_pieces_do_not_refine(tmp_path):
    """Swin's roll of a 10-row image by 2 (a Slice and a Concat: the rows in pieces of 5 x 2)
    read as 2 windows of 5 rows: no view joins the two cuts, so the rolled image is stored
    again with its rows one axis, and the result is the reference's."""
    got, want = regrouped_and_reference(tmp_path, [
        helper.make_node("Slice", ["x", "lo", "hi", "axis"], ["tail"]),
        helper.make_node("Slice", ["x", "zero", "two", "axis"], ["head"]),
        helper.make_node("Concat", ["tail", "head"], ["rolled"], axis=0),
        helper.make_node("Reshape", ["rolled", "windows"], ["w"]),
        helper.make_node("ReduceSum", ["w", "axis"], ["y"], keepdims=0)],
        {"lo": [2], "hi": [10], "zero": [0], "two": [2], "axis": [0], "windows": [2, 5, 3]},
        np.random.default_rng(7).standard_normal((10, 3)).astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_gather_index_out_of_range_is_refused(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["y"])], "gather",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([0, 4], np.int64), "i")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
              str(tmp_path / "gather.onnx"))
    with pytest.raises(OnnxError, match=r"node 0 .*Gather.*out of range for extent 4"):
        import_onnx(tmp_path / "gather.onnx")


def bbrules(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "bbrules", *args], capture_output=True,
                          text=True, cwd=cwd)


def test_cli_import_writes_program_and_weights_and_runs(tmp_path):
    transformer_block(tmp_path / "block.onnx")
    r = bbrules("import", str(tmp_path / "block.onnx"), "-o", str(tmp_path / "block.bbp"))
    assert r.returncode == 0, r.stderr
    weights = np.load(tmp_path / "block.npz")
    assert set(weights.files) >= {"wq", "wk", "wv", "wo"}
    r = bbrules("run", str(tmp_path / "block.bbp"), "--values", str(tmp_path / "block.npz"),
                "--no-fuse")
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    r = bbrules("cost", str(tmp_path / "block.onnx"), "--dim", "batch=2", "--json")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("override, message", [
    ("heads=4", "has no symbolic dimension 'heads' (it has batch) and the program imported "
                "from it no dimension 'heads'"),
    ("d64=128/32", "the imported dimension has extent 64; only its block can be set "
                   "(d64=64/BLOCK)"),
])
def test_a_dimension_override_the_model_has_no_use_for_is_refused(tmp_path, override,
                                                                   message):
    """As for a .bbp program: an override that would be ignored is a mistake."""
    transformer_block(tmp_path / "block.onnx")
    name, extent, block = parse_dim_override(override)
    with pytest.raises(UsageError, match=re.escape(message)):
        import_onnx(tmp_path / "block.onnx", {"batch": (2, None), name: (extent, block)})
    r = bbrules("cost", str(tmp_path / "block.onnx"), "--dim", override)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    text = import_onnx(tmp_path / "block.onnx", {"d64": (64, 32)}).text
    assert "dim d64 = 64 / 32" in text, text


def test_run_draws_the_ids_of_a_lookup_as_ids(tmp_path):
    """`bbrules run model.onnx` draws its own inputs: the byte ids, which the one-hot compares
    with positions 0 .. 256, are drawn as whole numbers below 257, so the lookup picks rows
    and the check compares real numbers (drawn as real numbers, no id would equal a position,
    every output would be 0 and the check would hold vacuously)."""
    onnx.save(_byte_embedding(np.random.default_rng(4)), str(tmp_path / "embed.onnx"))
    r = bbrules("run", str(tmp_path / "embed.onnx"), "--no-fuse", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["ok"] and result["outputs"]["y"]["worst"]["expected"] != 0, result


def test_integer_inputs_are_declared_i32_and_checked(tmp_path):
    """A graph input of integers is imported as `i32` (the outputs stay f32), and
    `bbp_inputs` refuses an id that f32 would round to another (2^24 + 1)."""
    from bbrules.frontend import parse_program
    onnx.save(_byte_embedding(np.random.default_rng(4)), str(tmp_path / "embed.onnx"))
    imported = import_onnx(tmp_path / "embed.onnx")
    assert re.search(r"^input ids\[\w+\] : i32$", imported.text, re.MULTILINE)
    assert parse_program(imported.text).tensors["y"].dtype == "f32"
    ids = np.arange(64, dtype=np.int32)
    assert np.array_equal(imported.bbp_inputs({"ids": ids})["ids"], ids.astype(np.float32))
    with pytest.raises(UsageError, match=r"input 'ids' is declared i32 but holds 16777217"):
        imported.bbp_inputs({"ids": np.full(64, 2 ** 24 + 1, np.int64)})


def test_unsupported_operator_names_node_and_position(tmp_path):
    node = helper.make_node("GatherElements", ["r", "idx"], ["y"], name="gather0", axis=1)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([[3, 1], [0, 2]], np.int64), "idx")])
    onnx.save(helper.make_model(graph), str(tmp_path / "gather.onnx"))
    with pytest.raises(OnnxError, match=r"node 1 'gather0' \(GatherElements\): operator GatherElements is not"):
        import_onnx(tmp_path / "gather.onnx")
    r = bbrules("import", str(tmp_path / "gather.onnx"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "GatherElements" in r.stderr


def test_junk_file_is_refused(tmp_path):
    (tmp_path / "junk.onnx").write_bytes(b"\x00\xff not a model \x13" * 50)
    r = bbrules("apply", str(tmp_path / "junk.onnx"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


def _slice_model(perm=(1, 0), name="x"):
    """x[2, 8] sliced to its first 4 columns and transposed: the model the refusals below
    break one field at a time."""
    ends = numpy_helper.from_array(np.array([4], np.int64), "ends")
    graph = helper.make_graph(
        [helper.make_node("Slice", [name, "starts", "ends", "axes"], ["s"]),
         helper.make_node("Transpose", ["s"], ["y"], perm=list(perm))], "g",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([0], np.int64), "starts"), ends,
         numpy_helper.from_array(np.array([1], np.int64), "axes")])
    return helper.make_model(graph)


@pytest.mark.parametrize("break_it, message", [
    (lambda m: m.graph.initializer[1].dims.__setitem__(0, 3),
     r"initializer 'ends' \(dims \[3\], element type 7\) cannot be read"),
    (lambda m: setattr(m.graph.initializer[1], "raw_data", m.graph.initializer[1].raw_data[:5]),
     r"initializer 'ends' .* cannot be read"),
    (lambda m: m.graph.initializer[1].dims.__setitem__(0, -1),
     r"initializer 'ends' has a negative dimension: \[-1\]"),
    (lambda m: m.graph.input[0].type.tensor_type.shape.dim[1].__setattr__("dim_value", -2 ** 63),
     r"'x' is declared with a negative dimension"),
    (lambda m: m.graph.node[1].attribute[0].ints.__setitem__(0, -2),
     r"node 1 'y' \(Transpose\): perm \[-2, 0\] is not a permutation of the value's 2 dim"),
])
def test_malformed_fields_are_refused_with_what_is_wrong(tmp_path, break_it, message):
    """Fields a broken exporter or a hand edit gets wrong, each found by fuzzing
    (tests/fuzzing.py) as a traceback, or (negative dimensions) as the whole process aborted
    inside ONNX's shape inference."""
    model = _slice_model()
    model.graph.initializer[1].raw_data = numpy_helper.to_array(
        model.graph.initializer[1]).tobytes()
    del model.graph.initializer[1].int64_data[:]
    break_it(model)
    path = tmp_path / "broken.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(OnnxError, match=message):
        import_onnx(path)
    r = bbrules("import", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and str(path) in r.stderr, r.stderr


def test_a_node_without_outputs_and_a_name_that_is_not_utf8_are_reported(tmp_path):
    model = _slice_model(perm=(0, 0))
    del model.graph.node[1].output[:]
    path = tmp_path / "no_output.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(OnnxError, match=r"node 1 '' \(Transpose\): perm \[0, 0\]"):
        import_onnx(path)
    data = _slice_model(name="xx").SerializeToString().replace(b"xx", b"x\xf4")
    (tmp_path / "latin.onnx").write_bytes(data)
    imported = import_onnx(tmp_path / "latin.onnx")  # the name keeps what it can
    assert re.search(r"^input x\[d2, d8\] : f32$", imported.text, re.M), imported.text
    r = bbrules("run", str(tmp_path / "latin.onnx"), "--no-fuse")
    assert r.returncode == 0, r.stderr


def test_a_shape_too_large_for_numpy_is_imported_and_priced_but_not_run(tmp_path):
    """numpy refuses to broadcast shapes of 2^63 bytes or more; the importer's broadcast does
    not, so such a model is costed and fused like any other and only `run` refuses it, for
    its memory."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "b"], ["y"])],
        "huge", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2 ** 40, 2 ** 30])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones(1, np.float32), "b")])
    path = tmp_path / "huge.onnx"
    onnx.save(helper.make_model(graph), str(path))
    imported = import_onnx(path)
    assert "dim d1099511627776 = 1099511627776 / 64" in imported.text, imported.text
    assert bbrules("cost", str(path)).returncode == 0
    r = bbrules("run", str(path), "--no-fuse")
    assert r.returncode == 2 and "GiB of memory, more than" in r.stderr, r.stderr


def test_a_dimension_read_through_a_view_gets_a_block_that_divides_it(tmp_path):
    """A KV cache of 255 past tokens whose heads are split in halves (rotate-half RoPE): 255
    in blocks of 64 would leave a ragged last block under a view, which the frontend refuses
    (it once reached lowering and a traceback).  The import gives it blocks of 51."""
    rng = np.random.default_rng(6)
    shape = numpy_helper.from_array(np.array([255, 2, 32], np.int64), "shape")
    scale = numpy_helper.from_array(rng.standard_normal((2, 32)).astype(np.float32), "scale")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["k", "shape"], ["halves"]),
         helper.make_node("Mul", ["halves", "scale"], ["y"])], "cache",
        [helper.make_tensor_value_info("k", TensorProto.FLOAT, [255, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [255, 2, 32])], [shape, scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(tmp_path / "cache.onnx"))
    imported = import_onnx(tmp_path / "cache.onnx")
    assert re.search(r"^dim d255 = 255 / 51$", imported.text, re.M), imported.text
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    fused = fuse(lower(parse_program(imported.text)), load_packs([]), get_target("cpu")).program
    k = rng.standard_normal((255, 64)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"k": k})[0]
    got = imported.onnx_outputs(numpy_gen.run(fused, imported.bbp_inputs({"k": k})))["y"]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_slice_concatenated_back_where_it_was_is_read_from_its_source(tmp_path):
    """GPT-NeoX's partial rotary: a quarter of each head rotated, the rest sliced off and
    concatenated back after it.  The concatenation reads the rest from the head itself, a
    selection by the chunk's position (elementwise: forwarding takes it into its readers),
    and the slice it no longer reads is not written at all, unless another reader needs it: a
    concatenation that moves it (z) gathers it as before.  Numbers: ONNX's reference
    evaluator."""
    rng = np.random.default_rng(9)
    consts = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("zero", [0]), ("rot", [16]), ("end", [64]), ("axis", [1]))]
    nodes = [helper.make_node("Slice", ["x", "zero", "rot", "axis"], ["head"]),
             helper.make_node("Slice", ["x", "rot", "end", "axis"], ["rest"]),
             helper.make_node("Neg", ["head"], ["rotated"]),
             helper.make_node("Concat", ["rotated", "rest"], ["y"], axis=1),
             helper.make_node("Concat", ["rest", "head"], ["z"], axis=1)]
    x = rng.standard_normal((8, 64)).astype(np.float32)
    from bbrules.frontend import parse_program
    from bbrules.lower import lower
    for outputs in ("y", "yz"):
        graph = helper.make_graph(
            nodes[:3 + len(outputs)], "partial",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, [8, 64]) for n in outputs],
            consts)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        onnx.save(model, str(tmp_path / "partial.onnx"))
        imported = import_onnx(tmp_path / "partial.onnx")
        lines = {line.split("[")[0]: line for line in imported.text.splitlines()
                 if "] = " in line}
        assert "sum[" not in lines["y"], imported.text
        assert re.search(r"where\(\(\w+\) >= 1 and \(\w+\) < 4, x\[", lines["y"]), lines["y"]
        assert ("rest" in lines) == ("z" in outputs), imported.text
        if "z" in outputs:
            assert "sum[" in lines["z"] and "rest[" in lines["z"], lines["z"]
        want = ReferenceEvaluator(model).run(None, {"x": x})
        program = lower(parse_program(imported.text))
        got = imported.onnx_outputs(numpy_gen.run(program, imported.bbp_inputs({"x": x})))
        for name, expected in zip(outputs, want):
            np.testing.assert_array_equal(got[name], expected)
