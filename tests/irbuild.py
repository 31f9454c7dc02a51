"""Building block-IR programs by hand, shared by the test files.

Tests that check a backend or an analysis on programs no frontend writes (hand-fused kernels,
monoids that are not in any rule pack) build them from these pieces: operator shorthands, a
`BlockProgram` builder that declares the stored tensors from their kernels, the two classic
multi-component monoids (online softmax and Welford) with the folds that use them, a
hand-fused Flash Attention, and the plain-numpy references the results are checked against.

A reduction holds its monoid, so a test may define a variant of the online softmax under the
same name as another without the two meeting.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from bbrules.ir import (SUM, Binary, BlockProgram, BlockReduce, Const, Dim, Dot, Load, Monoid, Node,
                        Reduce, Store, TensorDecl, Tuple, Unary, Var)


def add(x: Node, y: Node) -> Binary:
    return Binary("add", x, y)


def sub(x: Node, y: Node) -> Binary:
    return Binary("sub", x, y)


def mul(x: Node, y: Node) -> Binary:
    return Binary("mul", x, y)


def div(x: Node, y: Node) -> Binary:
    return Binary("div", x, y)


def matmul(a: Node, b: Node, axis: str) -> Reduce:
    """The contraction of `a` and `b` over every block of `axis`."""
    return Reduce(axis, SUM, Dot(axis, a, b))


def program(dims: dict[str, tuple[int, int]], inputs: dict[str, tuple[str, ...]],
            kernels: list[Store], outputs: tuple[str, ...] | None = None,
            dtype: str = "f32") -> BlockProgram:
    """A block program whose stored tensors are declared by their kernels.

    `dims` maps each axis to (extent, block) and `inputs` each input to its axes.  A stored
    tensor is an output if `outputs` names it, a temporary otherwise; without `outputs` the
    last kernel's tensor is the one output.  Every tensor has element type `dtype`.
    """
    outputs = (kernels[-1].tensor,) if outputs is None else outputs
    tensors = {n: TensorDecl(n, axes, dtype, "input") for n, axes in inputs.items()}
    for k in kernels:
        tensors[k.tensor] = TensorDecl(k.tensor, k.axes, dtype,
                                       "output" if k.tensor in outputs else "temp")
    return BlockProgram.of_stores({n: Dim(n, e, b) for n, (e, b) in dims.items()}, tensors,
                                  tuple(kernels), outputs)


def rand(*shape: int, seed: int = 0, loc: float = 0.0) -> np.ndarray:
    """Standard normal float32 values around `loc`, the same for the same seed."""
    return (np.random.default_rng(seed).standard_normal(shape) + loc).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Online softmax: attention in one loop over key blocks, without the N x N score matrix.


def online_softmax(name: str,
                   finalize: tuple[Node, ...] = (div(Var("o"), Var("l")),)) -> Monoid:
    """State (running max m, denominator l, numerator o), identity (-inf, 0, 0).

    Combining rescales both sides' l and o by exp(side.m - max(a.m, b.m)), so the sums stay
    those of exp(s - the maximum so far).  `finalize` gives the results over Var("m"),
    Var("l") and Var("o"); by default the one result o / l, the softmax-weighted average.
    """
    new_m = Binary("max", Var("a.m"), Var("b.m"))
    scale_a = Unary("exp", sub(Var("a.m"), new_m))
    scale_b = Unary("exp", sub(Var("b.m"), new_m))

    def rescaled(c: str) -> Binary:
        return add(mul(Var(f"a.{c}"), scale_a), mul(Var(f"b.{c}"), scale_b))

    return Monoid(name, ("m", "l", "o"), (Const(float("-inf")), Const(0.0), Const(0.0)),
                  (new_m, rescaled("l"), rescaled("o")), finalize)


def softmax_fold(monoid: Monoid, s: Node, v: Node) -> Reduce:
    """The loop over key blocks (axis k) of an online-softmax monoid: each block of scores `s`
    contributes its row max, its denominator sum(exp(s - max)) and its numerator
    exp(s - max) @ v."""
    block_max = BlockReduce("max", "k", s)
    e = Unary("exp", sub(s, block_max))
    return Reduce("k", monoid, Tuple((block_max, BlockReduce("sum", "k", e), Dot("k", e, v))))


ATTENTION_INPUTS = {"Q": ("q", "d"), "K": ("k", "d"), "V": ("k", "d")}


def flash_attention(n_q: int, b_q: int, n_k: int, b_k: int, d: int, monoid: Monoid,
                    readout: Callable[[Reduce], Node] = lambda fold: fold) -> BlockProgram:
    """Flash Attention as the rules derive it: one kernel, a grid over query blocks and one
    loop over key blocks, scores scaled by 1 / sqrt(d), d one block.  `readout` turns the fold
    into the stored O; the default suits a monoid whose one result is the attention output."""
    s = mul(Dot("d", Load("Q", ("q", "d")), Load("K", ("k", "d"))), Const(d ** -0.5))
    out = readout(softmax_fold(monoid, s, Load("V", ("k", "d"))))
    return program({"q": (n_q, b_q), "k": (n_k, b_k), "d": (d, d)}, ATTENTION_INPUTS,
                   [Store("O", ("q", "d"), out)])


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                        scale: float | None = None) -> np.ndarray:
    """softmax(scale * q @ k^T) @ v in float64; the scale is 1 / sqrt(d) unless given."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ k.T * (q.shape[1] ** -0.5 if scale is None else scale)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)) @ v


# --------------------------------------------------------------------------------------------
# Welford: mean and variance in one numerically stable loop.

# State (count n, mean, sum of squared deviations m2); results mean and population variance.
# Combining adds the counts and corrects m2 by delta^2 * a.n * b.n / n, delta = b.mean - a.mean,
# so no sum of squares of large values is ever formed.
_N = add(Var("a.n"), Var("b.n"))
_DELTA = sub(Var("b.mean"), Var("a.mean"))
WELFORD = Monoid(
    "test_welford", ("n", "mean", "m2"), (Const(0.0), Const(0.0), Const(0.0)),
    (_N,
     add(Var("a.mean"), div(mul(_DELTA, Var("b.n")), _N)),
     add(add(Var("a.m2"), Var("b.m2")),
         div(mul(mul(Unary("square", _DELTA), Var("a.n")), Var("b.n")), _N))),
    (Var("mean"), div(Var("m2"), Var("n"))))


def welford_stats(x: Node, axis: str, block: int) -> Reduce:
    """(mean, variance) of `x` along `axis` in one loop over its blocks with `WELFORD`: each
    block contributes its count, its own mean and its own sum of squared deviations."""
    block_mean = mul(BlockReduce("sum", axis, x), Const(1.0 / block))
    m2 = BlockReduce("sum", axis, Unary("square", sub(x, block_mean)))
    return Reduce(axis, WELFORD, Tuple((Const(float(block)), block_mean, m2)))


def reshaped_dims(program) -> set[str]:
    """The dims a view of `program` splits or merges (`X[t, (h, d)]`: e, h and d): a test
    shrinking an example keeps their sizes, whose products the views fix."""
    out: set[str] = set()
    for t in program.tensors.values():
        if t.role == "view":
            out |= set(t.axes) ^ set(program.tensors[t.base].axes)
    return out
