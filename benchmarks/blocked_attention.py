"""Hand-written blocked attention in plain numpy: the ceiling for the numpy backend.

This is what a person would write for a one-pass (Flash-Attention-style) attention on the CPU
with numpy: the queries scaled once, every query block at once as one matrix, a Python loop over key
blocks, the score block overwritten in place, and the online-softmax state (running max,
running denominator, running numerator) rescaled per block.
It never allocates an N x N array, so its peak memory is O(N * block).  The generated fused
attention is measured against it: same algorithm, same block size, so any difference is
overhead of the generated code.
"""

from __future__ import annotations

import numpy as np


def blocked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, block: int = 256,
                      scale: float | None = None) -> np.ndarray:
    """softmax(q k^T * scale) v, computed one block of `block` keys at a time, in float32."""
    f32 = np.float32
    n, d = q.shape
    if k.shape[0] % block:
        raise ValueError(f"block {block} does not divide the {k.shape[0]} keys")
    q = q * f32(1.0 / np.sqrt(d) if scale is None else scale)  # once, not once per key block
    m = np.full((n, 1), -np.inf, f32)
    l = np.zeros((n, 1), f32)
    o = np.zeros((n, v.shape[1]), f32)
    for j in range(0, k.shape[0], block):
        s = q @ k[j:j + block].T
        m_new = np.maximum(m, s.max(axis=1, keepdims=True))
        s -= m_new
        p = np.exp(s, out=s)
        alpha = np.exp(m - m_new)
        l = l * alpha + p.sum(axis=1, keepdims=True)
        o = o * alpha + p @ v[j:j + block]
        m = m_new
    return o / l
