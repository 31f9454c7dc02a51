"""How the models of tests/test_torch_exports.py were made: seventeen transformer blocks, a
decode step, and five blocks over images and convolutions (Swin, Stable Diffusion's
attention, ConvNeXt, Conformer's convolution module, EfficientNet's MBConv) written as model
code usually is, exported by torch's TorchScript exporter (torch 2.13, opset 17) with their
inputs and torch's own outputs for them (`NAME_io.npz`).  Not run by the suite (torch is no
dependency):

    python tests/models/export.py      # in an environment with torch and onnx

`benchmarks/torch_blocks.py` exports the same blocks at a model's size (`--tokens 128
--width 768 ...`, each file named `NAME-TOKENS-WIDTH`) into a folder of its own (`--out`).
"""

import argparse
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

T, D, H, KV, FF = 16, 32, 4, 2, 64
WINDOW = T // 2  # Mistral's sliding window: a query sees itself and WINDOW - 1 keys before


class GPT2(nn.Module):
    """Pre-LayerNorm, one QKV projection with bias split three ways, causal softmax attention
    by a buffer mask, a tanh-GELU MLP."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        b = x.shape[0]
        q, k, v = (t.view(b, T, H, D // H).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(D, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // H))
        att = F.softmax(att.masked_fill(self.mask == 0, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).contiguous().view(b, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Llama(nn.Module):
    """RMSNorm, rotate-half RoPE, grouped-query heads repeated by `repeat_interleave` (ONNX
    Tile), an additive causal mask, a SwiGLU MLP."""

    def __init__(self):
        super().__init__()
        hd = D // H
        self.w1, self.w2 = nn.Parameter(torch.rand(D) + 0.5), nn.Parameter(torch.rand(D) + 0.5)
        self.q, self.o = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.k, self.v = nn.Linear(D, KV * hd, bias=False), nn.Linear(D, KV * hd, bias=False)
        self.g, self.u = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.d = nn.Linear(FF, D, bias=False)
        freqs = torch.outer(torch.arange(T).float(),
                            1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
        emb = torch.cat((freqs, freqs), -1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())
        self.register_buffer("mask", torch.full((T, T), float("-inf")).triu(1))

    @staticmethod
    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rope(self, x):
        a, b = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat((-b, a), dim=-1) * self.sin

    @staticmethod
    def repeat(t):
        """Each key/value head once for each query head it serves."""
        return t.repeat_interleave(H // KV, dim=1)

    def attend(self, q, k, v):
        """Softmax attention of the query heads over the key/value heads repeated for them."""
        k, v = self.repeat(k), self.repeat(v)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // H) + self.mask, dim=-1)
        return a @ v

    def forward(self, x):
        b, hd = x.shape[0], D // H
        h = self.norm(x, self.w1)
        q = self.rope(self.q(h).view(b, T, H, hd).transpose(1, 2))
        k = self.rope(self.k(h).view(b, T, KV, hd).transpose(1, 2))
        v = self.v(h).view(b, T, KV, hd).transpose(1, 2)
        x = x + self.o(self.attend(q, k, v).transpose(1, 2).reshape(b, T, D))
        h = self.norm(x, self.w2)
        return x + self.d(F.silu(self.g(h)) * self.u(h))


class Mistral(Llama):
    """LLaMA's weights with interleaved (GPT-J) RoPE on even and odd features, grouped-query
    heads repeated by `expand` and `reshape`, and a sliding-window causal mask."""

    def __init__(self):
        super().__init__()
        hd = D // H
        freqs = torch.outer(torch.arange(T).float(),
                            1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
        self.cos, self.sin = freqs.cos(), freqs.sin()  # (buffers, assigned anew)
        i = torch.arange(T)
        seen = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < WINDOW)
        self.mask = torch.zeros(T, T).masked_fill(~seen, float("-inf"))

    def rope(self, x):
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * self.cos - b * self.sin, a * self.sin + b * self.cos),
                           -1).flatten(-2)

    @staticmethod
    def repeat(t):
        b, hd = t.shape[0], D // H
        return t[:, :, None].expand(b, KV, H // KV, T, hd).reshape(b, H, T, hd)


class Bert(nn.Module):
    """Post-LayerNorm, a padding mask given as an input (1 keeps a key) made additive, an
    erf-GELU MLP."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.f1, self.f2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x, m):
        b, hd = x.shape[0], D // H
        q, k, v = self.qkv(x).view(b, T, 3, H, hd).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd) + (1.0 - m[:, None, None, :]) * -1e4
        y = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, T, D)
        x = self.ln1(x + self.out(y))
        return self.ln2(x + self.f2(F.gelu(self.f1(x))))


class ViT(nn.Module):
    """Pre-LayerNorm, torch's `scaled_dot_product_attention` with no mask, an erf-GELU MLP,
    LayerScale on both residual branches."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D, eps=1e-6), nn.LayerNorm(D, eps=1e-6)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        self.g1, self.g2 = nn.Parameter(torch.rand(D) * 0.5), nn.Parameter(torch.rand(D) * 0.5)

    def forward(self, x):
        b = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).reshape(b, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, T, D)
        x = x + self.g1 * self.proj(y)
        return x + self.g2 * self.fc2(F.gelu(self.fc1(self.ln2(x))))


class NeoX(nn.Module):
    """GPT-NeoX's parallel residual (attention and MLP both read the block's input), rotary
    embedding on a quarter of each head, `scaled_dot_product_attention(is_causal=True)`."""

    def __init__(self):
        super().__init__()
        self.rotary = D // H // 4
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        freqs = torch.outer(torch.arange(T).float(), 1.0 / (
            10000 ** (torch.arange(0, self.rotary, 2).float() / self.rotary)))
        emb = torch.cat((freqs, freqs), -1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())

    def rope(self, x):
        r, rest = x[..., :self.rotary], x[..., self.rotary:]
        a, b = r.chunk(2, dim=-1)
        return torch.cat((r * self.cos + torch.cat((-b, a), -1) * self.sin, rest), -1)

    def forward(self, x):
        b = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(b, T, H, 3 * (D // H)).transpose(1, 2).chunk(3, -1)
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        a = self.proj(y.transpose(1, 2).reshape(b, T, D))
        return x + a + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class T5(nn.Module):
    """T5's RMSNorm, a relative position bias (a buffer here) added to unscaled scores, a
    gated tanh-GELU MLP."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.rand(D) + 0.5), nn.Parameter(torch.rand(D) + 0.5)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.wi0, self.wi1 = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.wo = nn.Linear(FF, D, bias=False)
        self.register_buffer("bias", torch.randn(1, H, T, T))

    def forward(self, x):
        b, hd = x.shape[0], D // H
        h = Llama.norm(x, self.w1)
        q, k, v = (f(h).view(b, T, H, hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) + self.bias, dim=-1)
        x = x + self.o((a @ v).transpose(1, 2).reshape(b, T, D))
        h = Llama.norm(x, self.w2)
        return x + self.wo(F.gelu(self.wi0(h), approximate="tanh") * self.wi1(h))


class Gemma(nn.Module):
    """RMSNorm scaled by 1 + w, multi-query attention (one key/value head, split from one
    projection), scores soft-capped by tanh, a causal mask by `masked_fill`, GeGLU."""

    def __init__(self):
        super().__init__()
        hd = D // H
        self.w1, self.w2 = nn.Parameter(torch.rand(D) - 0.5), nn.Parameter(torch.rand(D) - 0.5)
        self.q, self.o = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.kv = nn.Linear(D, 2 * hd, bias=False)
        self.g, self.u = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.d = nn.Linear(FF, D, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    def forward(self, x):
        b, hd = x.shape[0], D // H
        h = Llama.norm(x, 1 + self.w1)
        q = self.q(h).view(b, T, H, hd).transpose(1, 2)
        k, v = self.kv(h).view(b, T, 1, 2 * hd).transpose(1, 2).split(hd, -1)
        scores = torch.tanh((q @ k.transpose(-1, -2)) * hd ** -0.5 / 50.0) * 50.0
        a = torch.softmax(scores.masked_fill(~self.causal, float("-inf")), dim=-1)
        x = x + self.o((a @ v).transpose(1, 2).reshape(b, T, D))
        h = Llama.norm(x, 1 + self.w2)
        return x + self.d(F.gelu(self.g(h), approximate="tanh") * self.u(h))


class Qwen(Llama):
    """LLaMA's weights with biases on Q, K and V, RMSNorm computed in float32 between casts (as
    Hugging Face writes it), and `scaled_dot_product_attention` given a boolean causal mask,
    which the exporter follows by zeroing NaN rows (`Where(IsNaN(p), 0, p)`)."""

    def __init__(self):
        super().__init__()
        hd = D // H
        self.q.bias = nn.Parameter(torch.randn(D) * 0.1)
        self.k.bias = nn.Parameter(torch.randn(KV * hd) * 0.1)
        self.v.bias = nn.Parameter(torch.randn(KV * hd) * 0.1)
        self.register_buffer("causal", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    @staticmethod
    def norm(x, w):
        kind = x.dtype
        x = x.to(torch.float32)
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(kind)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, self.repeat(k), self.repeat(v),
                                              attn_mask=self.causal)


class Bloom(nn.Module):
    """LayerNorm, one QKV projection with bias, an ALiBi bias (a slope per head times the
    keys' distance, built from `arange` in the graph), a causal mask by `masked_fill` with
    float's lowest value, an erf-GELU MLP."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)])
        self.register_buffer("slopes", slopes.view(1, H, 1, 1))

    def forward(self, x):
        b, hd = x.shape[0], D // H
        q, k, v = self.qkv(self.ln1(x)).view(b, T, H, 3, hd).permute(3, 0, 2, 1, 4)
        pos = torch.arange(T)
        s = q @ k.transpose(-1, -2) / math.sqrt(hd) + \
            self.slopes * (pos[None, :] - pos[:, None]).float()
        s = s.masked_fill(pos[None, :] > pos[:, None], torch.finfo(s.dtype).min)
        x = x + self.o((torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPTJ(nn.Module):
    """GPT-J's rotary embedding on interleaved pairs of the first half of each head
    (`rotate_every_two`, by strided slices and `stack`), attention and MLP in parallel from one
    LayerNorm, causal `scaled_dot_product_attention`."""

    def __init__(self):
        super().__init__()
        self.rotary = D // H // 2
        self.ln = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        freqs = torch.outer(torch.arange(T).float(), 1.0 / (
            10000 ** (torch.arange(0, self.rotary, 2).float() / self.rotary)))
        self.register_buffer("cos", freqs.cos().repeat_interleave(2, -1))
        self.register_buffer("sin", freqs.sin().repeat_interleave(2, -1))

    def rope(self, x):
        r, rest = x[..., :self.rotary], x[..., self.rotary:]
        turned = torch.stack((-r[..., 1::2], r[..., ::2]), -1).flatten(-2)
        return torch.cat((r * self.cos + turned * self.sin, rest), -1)

    def forward(self, x):
        b, hd = x.shape[0], D // H
        h = self.ln(x)
        q, k, v = (f(h).view(b, T, H, hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, T, D)) + \
            self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class Phi3(Llama):
    """LLaMA's block with Phi-3's fused projections: one QKV projection split by sizes, and
    one gate-and-up projection split in two by `chunk`."""

    def __init__(self):
        super().__init__()
        hd = D // H
        del self.q, self.k, self.v, self.g, self.u  # (replaced by the fused projections)
        self.qkv = nn.Linear(D, D + 2 * KV * hd, bias=False)
        self.gate_up = nn.Linear(D, 2 * FF, bias=False)

    def forward(self, x):
        b, hd = x.shape[0], D // H
        q, k, v = self.qkv(self.norm(x, self.w1)).split([D, KV * hd, KV * hd], -1)
        q = self.rope(q.view(b, T, H, hd).transpose(1, 2))
        k = self.rope(k.view(b, T, KV, hd).transpose(1, 2))
        v = v.view(b, T, KV, hd).transpose(1, 2)
        x = x + self.o(self.attend(q, k, v).transpose(1, 2).reshape(b, T, D))
        gate, up = self.gate_up(self.norm(x, self.w2)).chunk(2, -1)
        return x + self.d(F.silu(gate) * up)


class Cross(nn.Module):
    """A decoder's cross-attention (BART's, post-LayerNorm): queries of T tokens over an
    encoder's S states of half the width, with a padding mask over the encoder's positions,
    then a ReLU MLP."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(D, D), nn.Linear(D, D)
        self.k, self.v = nn.Linear(D // 2, D), nn.Linear(D // 2, D)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x, enc, keep):
        b, s, hd = x.shape[0], enc.shape[1], D // H
        q = self.q(x).view(b, T, H, hd).transpose(1, 2)
        k, v = (f(enc).view(b, s, H, hd).transpose(1, 2) for f in (self.k, self.v))
        scores = q @ k.transpose(-1, -2) * hd ** -0.5 + (1.0 - keep[:, None, None, :]) * -1e9
        x = self.ln1(x + self.o((torch.softmax(scores, -1) @ v).transpose(1, 2)
                                .reshape(b, T, D)))
        return self.ln2(x + self.fc2(F.relu(self.fc1(x))))


class Falcon(nn.Module):
    """Falcon's multi-query attention (one key/value head, from the same projection as the
    queries, broadcast to every head by `expand`), attention and MLP in parallel from one
    LayerNorm, causal `scaled_dot_product_attention`, an erf-GELU MLP."""

    def __init__(self):
        super().__init__()
        hd = D // H
        self.ln = nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, D + 2 * hd, bias=False), nn.Linear(D, D, bias=False)
        self.fc1, self.fc2 = nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)

    def forward(self, x):
        b, hd = x.shape[0], D // H
        h = self.ln(x)
        q, k, v = self.qkv(h).split([D, hd, hd], -1)
        q = q.view(b, T, H, hd).transpose(1, 2)
        k, v = (t.view(b, T, 1, hd).transpose(1, 2).expand(b, H, T, hd) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, T, D)) + self.fc2(F.gelu(self.fc1(h)))


class Gemma2(nn.Module):
    """Gemma 2's sandwich of RMSNorms (scaled by 1 + w) around attention and the MLP, queries
    scaled before their product, scores soft-capped by tanh, a sliding window of T / 4 by a
    boolean mask through `torch.where`, GeGLU."""

    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.rand(D) - 0.5) for _ in range(4))
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.g, self.u = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.d = nn.Linear(FF, D, bias=False)
        i = torch.arange(T)
        self.register_buffer("allowed", (i[None, :] <= i[:, None])
                             & (i[:, None] - i[None, :] < max(T // 4, 1)))

    def forward(self, x):
        b, hd = x.shape[0], D // H
        h = Llama.norm(x, 1 + self.ws[0])
        q, k, v = (f(h).view(b, T, H, hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        s = torch.tanh((q * hd ** -0.5) @ k.transpose(-1, -2) / 30.0) * 30.0
        s = torch.where(self.allowed, s, torch.tensor(float("-inf")))
        a = self.o((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, T, D))
        x = x + Llama.norm(a, 1 + self.ws[1])
        h = Llama.norm(x, 1 + self.ws[2])
        return x + Llama.norm(self.d(F.gelu(self.g(h), approximate="tanh") * self.u(h)),
                              1 + self.ws[3])


# The blocks below read an image (or tokens of one) of SIDE x SIDE positions: the largest even
# side whose square is at most T.
SIDE = 4


class Swin(nn.Module):
    """Swin's shifted-window attention: the tokens of a SIDE x SIDE image rolled by half a
    window, cut into windows of SIDE / 2, a relative position bias gathered from a table by a
    constant index, the shift's mask between regions, windows put back and rolled back; an
    erf-GELU MLP."""

    def __init__(self):
        super().__init__()
        w = SIDE // 2
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        self.table = nn.Parameter(torch.randn((2 * w - 1) ** 2, H) * 0.5)
        at = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij"))
        rel = (at.flatten(1)[:, :, None] - at.flatten(1)[:, None, :]).permute(1, 2, 0) + w - 1
        self.register_buffer("index", rel[..., 0] * (2 * w - 1) + rel[..., 1])
        self.shift = w // 2
        regions = torch.zeros(SIDE, SIDE)
        cuts = (slice(0, -w), slice(-w, -self.shift), slice(-self.shift, None))
        for n, (a, b) in enumerate((a, b) for a in cuts for b in cuts):
            regions[a, b] = n
        regions = self.windows(regions[None, :, :, None]).squeeze(-1)
        apart = regions[:, None, :] != regions[:, :, None]
        self.register_buffer("mask", torch.zeros(apart.shape).masked_fill(apart, -100.0))

    @staticmethod
    def windows(x):
        """(1, SIDE, SIDE, C) -> (windows, positions in a window, C)."""
        w, c = SIDE // 2, x.shape[-1]
        return x.view(1, 2, w, 2, w, c).permute(0, 1, 3, 2, 4, 5).reshape(4, w * w, c)

    def forward(self, x):
        w, hd = SIDE // 2, D // H
        h = torch.roll(self.ln1(x).view(1, SIDE, SIDE, D), (-self.shift, -self.shift), (1, 2))
        q, k, v = self.qkv(self.windows(h)).reshape(4, w * w, 3, H, hd).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index.view(-1)].view(w * w, w * w, H).permute(2, 0, 1)
        s = (q * hd ** -0.5) @ k.transpose(-2, -1) + bias[None] + self.mask[:, None]
        y = self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(4, w * w, D))
        y = y.view(1, 2, 2, w, w, D).permute(0, 1, 3, 2, 4, 5).reshape(1, SIDE, SIDE, D)
        x = x + torch.roll(y, (self.shift, self.shift), (1, 2)).reshape(1, SIDE * SIDE, D)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ConvNeXt(nn.Module):
    """ConvNeXt's block on an image (channels first): a depthwise 7 x 7 convolution, a
    LayerNorm over the channels laid last, an inverted MLP (erf-GELU), layer scale."""

    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(D, D, 7, padding=3, groups=D)
        self.ln = nn.LayerNorm(D, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        self.gamma = nn.Parameter(torch.rand(D) * 0.5)

    def forward(self, x):
        h = self.ln(self.dw(x).permute(0, 2, 3, 1))
        return x + (self.gamma * self.fc2(F.gelu(self.fc1(h)))).permute(0, 3, 1, 2)


class Conformer(nn.Module):
    """Conformer's convolution module: LayerNorm, a pointwise convolution to twice the width,
    GLU, a depthwise convolution of 15 taps, batch norm (running statistics), SiLU, a
    pointwise convolution back, the residual."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.pw1, self.pw2 = nn.Conv1d(D, 2 * D, 1), nn.Conv1d(D, D, 1)
        self.dw = nn.Conv1d(D, D, 15, padding=7, groups=D)
        self.bn = nn.BatchNorm1d(D)
        for t, lo, hi in ((self.bn.running_mean, -0.5, 0.5), (self.bn.running_var, 0.5, 1.5),
                          (self.bn.weight, 0.5, 1.5), (self.bn.bias, -0.5, 0.5)):
            t.data.uniform_(lo, hi)

    def forward(self, x):
        h = F.glu(self.pw1(self.ln(x).transpose(1, 2)), dim=1)
        return x + self.pw2(F.silu(self.bn(self.dw(h)))).transpose(1, 2)


class DiffusionAttention(nn.Module):
    """Stable Diffusion's spatial self-attention: GroupNorm of 8 groups over an image, its
    positions as tokens, heads by `scaled_dot_product_attention`, the residual on the
    image."""

    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(8, D, eps=1e-6)
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o = nn.Linear(D, D)

    def forward(self, x):
        n, hd = SIDE * SIDE, D // H
        h = self.gn(x).view(1, D, n).transpose(1, 2)
        q, k, v = (f(h).view(1, n, H, hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, n, D)
        return x + self.o(y).transpose(1, 2).view(1, D, SIDE, SIDE)


class OPT(nn.Module):
    """OPT's decoder block: pre-LayerNorm, queries scaled before their product, a causal
    mask of float's lowest value added and the scores clamped at it, a ReLU MLP."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        lowest = torch.finfo(torch.float32).min
        self.register_buffer("mask", torch.full((T, T), lowest).triu(1))
        self.register_buffer("lowest", torch.tensor(lowest))

    def forward(self, x):
        b, hd = x.shape[0], D // H
        h = self.ln1(x)
        q = (self.q(h) * hd ** -0.5).view(b, T, H, hd).transpose(1, 2)
        k, v = (f(h).view(b, T, H, hd).transpose(1, 2) for f in (self.k, self.v))
        s = torch.max(q @ k.transpose(-1, -2) + self.mask, self.lowest)
        x = x + self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, T, D))
        return x + self.fc2(F.relu(self.fc1(self.ln2(x))))


class CLIP(nn.Module):
    """CLIP's text block: pre-LayerNorm, causal `scaled_dot_product_attention`, quick GELU
    (x sigmoid(1.702 x))."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        b, hd = x.shape[0], D // H
        q, k, v = self.qkv(self.ln1(x)).view(b, T, 3, H, hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, T, D))
        h = self.fc1(self.ln2(x))
        return x + self.fc2(h * torch.sigmoid(1.702 * h))


class MBConv(nn.Module):
    """EfficientNet's inverted bottleneck: a pointwise expansion, batch norm, SiLU, a depthwise
    3 x 3 convolution, batch norm, SiLU, squeeze-and-excitation (a mean over the image, two
    pointwise convolutions, a sigmoid gate), a pointwise projection, batch norm, the
    residual.  The exporter folds each batch norm into its convolution."""

    def __init__(self):
        super().__init__()
        wide = FF
        self.expand = nn.Conv2d(D, wide, 1, bias=False)
        self.dw = nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False)
        self.project = nn.Conv2d(wide, D, 1, bias=False)
        self.bns = nn.ModuleList([nn.BatchNorm2d(wide), nn.BatchNorm2d(wide), nn.BatchNorm2d(D)])
        for bn in self.bns:
            bn.running_mean.data.uniform_(-0.5, 0.5)
            bn.running_var.data.uniform_(0.5, 1.5)
        self.squeeze, self.excite = nn.Conv2d(wide, D // 4, 1), nn.Conv2d(D // 4, wide, 1)

    def forward(self, x):
        h = F.silu(self.bns[0](self.expand(x)))
        h = F.silu(self.bns[1](self.dw(h)))
        gate = torch.sigmoid(self.excite(F.silu(self.squeeze(h.mean((2, 3), keepdim=True)))))
        return x + self.bns[2](self.project(h * gate))


class Decode(Llama):
    """One step of LLaMA's decoding: one new token at position T - 1, the keys and values of
    the T - 1 tokens before it given as inputs (a KV cache), the new token's appended by
    `torch.cat`, and the grown cache returned beside y."""

    def __init__(self):
        super().__init__()
        self.cos, self.sin = self.cos[-1:], self.sin[-1:]  # RoPE at the new token's position

    def forward(self, x, pk, pv):
        b, hd = x.shape[0], D // H
        h = self.norm(x, self.w1)
        q = self.rope(self.q(h).view(b, 1, H, hd).transpose(1, 2))
        k = torch.cat((pk, self.rope(self.k(h).view(b, 1, KV, hd).transpose(1, 2))), 2)
        v = torch.cat((pv, self.v(h).view(b, 1, KV, hd).transpose(1, 2)), 2)
        a = torch.softmax(q @ self.repeat(k).transpose(-1, -2) / math.sqrt(hd), dim=-1)
        x = x + self.o((a @ self.repeat(v)).transpose(1, 2).reshape(b, 1, D))
        h = self.norm(x, self.w2)
        return x + self.d(F.silu(self.g(h)) * self.u(h)), k, v


def main() -> None:
    global T, D, H, KV, FF, WINDOW, SIDE
    ap = argparse.ArgumentParser(description="export the transformer blocks")
    ap.add_argument("--tokens", type=int, default=T)
    ap.add_argument("--width", type=int, default=D)
    ap.add_argument("--heads", type=int, default=H)
    ap.add_argument("--kv-heads", type=int, default=KV)
    ap.add_argument("--hidden", type=int, default=FF)
    ap.add_argument("--out", type=Path, help="the folder to write into (default: here, the "
                                             "suite's names)")
    args = ap.parse_args()
    T, D, H, KV, FF = args.tokens, args.width, args.heads, args.kv_heads, args.hidden
    WINDOW = T // 2
    SIDE = math.isqrt(T) // 2 * 2
    out, suffix = (args.out, f"-{T}-{D}") if args.out else (Path("."), "")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    x = torch.randn(1, T, D)
    keep = (torch.rand(1, T) > 0.2).float()
    models = [("gpt2", GPT2(), {"x": x}), ("llama", Llama(), {"x": x}),
              ("bert", Bert(), {"x": x, "m": keep}), ("mistral", Mistral(), {"x": x}),
              ("vit", ViT(), {"x": x}), ("neox", NeoX(), {"x": x}), ("t5", T5(), {"x": x}),
              ("gemma", Gemma(), {"x": x}), ("qwen", Qwen(), {"x": x})]
    decode = Decode()
    past = {n: torch.randn(1, KV, T - 1, D // H) for n in ("pk", "pv")}
    models.append(("decode", decode, {"x": x[:, -1:], **past}))
    states = T + T // 2  # the encoder's, which Cross attends to
    encoded = {"enc": torch.randn(1, states, D // 2),
               "keep": (torch.rand(1, states) > 0.25).float()}
    models += [("bloom", Bloom(), {"x": x}), ("gptj", GPTJ(), {"x": x}),
               ("phi3", Phi3(), {"x": x}), ("cross", Cross(), {"x": x, **encoded}),
               ("falcon", Falcon(), {"x": x}), ("gemma2", Gemma2(), {"x": x})]
    image = torch.randn(1, D, SIDE, SIDE)  # channels first; Swin takes its positions as tokens
    models += [("opt", OPT(), {"x": x}), ("clip", CLIP(), {"x": x}),
               ("swin", Swin(), {"x": image.flatten(2).transpose(1, 2).contiguous()}),
               ("diffusion", DiffusionAttention(), {"x": image}),
               ("convnext", ConvNeXt(), {"x": image}), ("conformer", Conformer(), {"x": x}),
               ("mbconv", MBConv(), {"x": image})]
    for name, model, inputs in models:
        model = model.eval()
        outputs = ["y", "k", "v"] if isinstance(model, Decode) else ["y"]
        torch.onnx.export(model, tuple(inputs.values()), str(out / f"{name}{suffix}.onnx"),
                          input_names=list(inputs), output_names=outputs, opset_version=17,
                          dynamo=False)
        with torch.no_grad():
            ys = model(*inputs.values())
        ys = ys if isinstance(ys, tuple) else (ys,)
        np.savez(out / f"{name}{suffix}_io.npz", **{n: a.numpy() for n, a in inputs.items()},
                 **{n: a.numpy() for n, a in zip(outputs, ys)})

if __name__ == "__main__":
    main()
