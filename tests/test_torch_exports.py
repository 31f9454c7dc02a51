"""Transformer blocks as torch exports them (`tests/models/export.py`: GPT-2, LLaMA, BERT,
Mistral, ViT, GPT-NeoX, T5, Gemma, Qwen, BLOOM, GPT-J, Phi-3, cross-attention, Falcon, Gemma 2,
OPT and CLIP blocks, a LLaMA decode step with a KV cache, and Swin, Stable Diffusion's
attention, ConvNeXt, Conformer's convolution module and EfficientNet's MBConv over images and
sequences, at width 32, opset 17), imported,
fused and called as onnxruntime calls a model, against torch's own outputs.  Exporters write
graphs no one writes by hand (a QKV split, a buffer mask through Where, `repeat_interleave`
as Tile, a mask input made additive, RoPE on interleaved feature pairs, a sliding-window
mask, attention by `scaled_dot_product_attention`, a cache grown by Concat), and the fusions
differ by target and objective: each model runs where it once went wrong, or on a target and
objective the others leave out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import bbrules
from bbrules.cli import main

onnx = pytest.importorskip("onnx")

MODELS = Path(__file__).parent / "models"


@pytest.mark.parametrize("name, target, objective, dims", [
    # LayerNorm's Welford statistics in blocks of 8, which the cpu target's coarser loop steps
    # once walked in blocks of 32 (the output off by 17% of its scale)
    ("gpt2", "cpu", "traffic", {"d32": "32/8"}),
    ("llama", "h100", "time", {}),
    ("bert", "cpu", "time", {}),
    # an interleaved RoPE's feature pairs, contracted one pair at a time as written, needed
    # more local memory than the cpu target has at a model's width (768)
    ("mistral", "cpu", "time", {}),
    # SDPA as the exporter writes it, unmasked and causal; a bias buffer on the scores;
    # soft-capped scores and one key/value head
    ("vit", "h100", "time", {}),
    ("neox", "cpu", "time", {}),
    ("t5", "cpu", "traffic", {}),
    ("gemma", "h100", "time", {}),
    # SDPA given a boolean mask: the exporter zeroes NaN rows through IsNaN
    ("qwen", "cpu", "time", {}),
    # a KV cache of 15 tokens and the new one's key and value concatenated to it: no chunk
    # longer than one element divides both
    ("decode", "cpu", "time", {}),
    ("decode", "h100", "traffic", {}),
    # The six below were written after everything above worked: programs the rules and the
    # generator were not shaped after.  At this width each imported, fused and ran right on
    # every target and objective the first time; at a model's (768), Phi-3's query heads
    # and its repeated key heads factored the heads two ways, which the importer refused
    # until it regrouped one (`Importer.regrouped`).  ALiBi's bias from `arange` positions
    # and a mask by float's lowest value
    ("bloom", "cpu", "time", {}),
    # a rotary embedding on strided slices of half of each head, parallel attention and MLP
    ("gptj", "h100", "time", {}),
    # fused QKV and gate-and-up projections split by `split` and `chunk`
    ("phi3", "cpu", "traffic", {}),
    # keys and values of another length and width, a padding mask on the encoder's side
    ("cross", "cpu", "time", {}),
    # one key/value head broadcast by `expand`
    ("falcon", "h100", "traffic", {}),
    # RMSNorms after attention and the MLP, a window through `torch.where`
    ("gemma2", "cpu", "time", {}),
    # Seven more, written after those: a causal mask of float's lowest value and a clamp at
    # it; quick GELU
    ("opt", "h100", "traffic", {}),
    ("clip", "cpu", "time", {}),
    # rolled, shifted windows of an image with a gathered relative position bias
    ("swin", "cpu", "traffic", {}),
    # GroupNorm over an image whose positions are the tokens
    ("diffusion", "h100", "time", {}),
    # grouped convolutions were refused; a 2-D one-hot over both spatial dimensions did not
    # fit local memory at a model's size (a 16 x 16 image)
    ("convnext", "h100", "time", {}),
    ("conformer", "cpu", "time", {}),
    # fused for h100 by time, it computed a wrong result until the e-graph's analysis gave a
    # position its axis (test_fusion.py's squeeze-and-excitation)
    ("mbconv", "h100", "time", {}),
])
def test_an_exported_block_fused_computes_what_torch_does(name, target, objective, dims):
    saved = np.load(MODELS / f"{name}_io.npz")
    inputs = [i.name for i in onnx.load(MODELS / f"{name}.onnx").graph.input]
    model = bbrules.load(MODELS / f"{name}.onnx", dims=dims)
    fused = bbrules.fuse(model, target=target, objective=objective, seconds=10)
    assert len(fused.model.program.kernels) < len(model.program.kernels)
    got = bbrules.compile(fused)(**{n: saved[n] for n in inputs})
    assert set(got) == set(saved.files) - set(inputs)
    for n, y in got.items():
        assert y.shape == saved[n].shape
        np.testing.assert_allclose(y, saved[n], rtol=1e-5, atol=1e-5 * np.abs(saved[n]).max(),
                                   err_msg=n)


def test_run_takes_a_models_inputs_in_its_own_shapes(tmp_path, capsys):
    """`bbrules run model.onnx --values` reads the arrays the model takes (x[1, 16, 32]) as
    well as the program's (x[16, 32]); a wrong shape is told in the model's terms."""
    x = np.load(MODELS / "gpt2_io.npz")["x"]
    for given, status in ((x, 0), (x[0], 0), (x[:, :8], 2)):
        np.savez(tmp_path / "x.npz", x=given)
        assert main(["run", str(MODELS / "gpt2.onnx"), "--values", str(tmp_path / "x.npz"),
                     "--no-fuse"]) == status
        out, err = capsys.readouterr()
        assert ("y: norm-wise error" in out) == (status == 0), out + err
    assert "'x' has shape [1, 8, 32], the model takes [1, 16, 32]" in err
