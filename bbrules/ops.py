"""Elementwise operators: one table that every stage reads.

Each operator has its numpy implementation (used by the dense evaluator, the reference
interpreter and the numpy backend), a flop count per element (used by the cost model), of
which `special` are special-function evaluations (exp, log, sqrt, rsqrt, reciprocal, tanh:
what a GPU's special-function units compute, priced at the target's `special_rate`; `div`
is vector work, an IEEE division being a reciprocal refined by fused multiply-adds), and a
CUDA C expression template over float operands `{x}` / `{y}` (used by the CUDA backend), and,
for the operators rules may fold on constants, its egglog f64 spelling (used by the engine).
Adding an operator here makes it known to the whole pipeline.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class OpInfo:
    name: str
    numpy: Callable[..., np.ndarray]
    flops: int
    cuda: str
    f64: str = ""  # egglog f64 arithmetic over `{x}` / `{y}`, for folding constants in rules
    special: int = 0  # of `flops`, the special-function evaluations per element


def _sigmoid(x: np.ndarray) -> np.ndarray:
    t = np.tanh(np.multiply(x, 0.5))
    if not isinstance(t, np.ndarray):  # a scalar
        return 0.5 * (1.0 + t)
    t += 1.0  # in place: one temporary, not four (the same roundings in the same order)
    t *= 0.5
    return t


# numpy has no erf: Abramowitz and Stegun's 7.1.26, absolute error below 1.5e-7 (about one
# float32 rounding of results near 1); CUDA uses its own erff.
def _erf(x: np.ndarray) -> np.ndarray:
    dtype = np.result_type(x, np.float32)
    x = np.asarray(x, dtype=np.float64)
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (
        -1.453152027 + t * 1.061405429))))
    return (np.sign(x) * (1.0 - poly * np.exp(-x * x))).astype(dtype)


def _gelu(x: np.ndarray) -> np.ndarray:
    # tanh approximation, as in GPT-2 and most inference stacks
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def _unary(name: str, fn: Callable[[np.ndarray], np.ndarray], flops: int, cuda: str,
           f64: str = "", special: int = 0) -> OpInfo:
    return OpInfo(name, fn, flops, cuda, f64, special)


def _predicate(name: str, fn: Callable[..., np.ndarray], c: str, truth: bool = False
               ) -> OpInfo:
    """A comparison or logical operator: 1.0 where it holds, else 0.0 (`truth`: its operands
    are truth values, nonzero meaning true, as in C)."""
    test = "((({x}) != 0.0f) {c} (({y}) != 0.0f))" if truth else "(({x}) {c} ({y}))"
    return OpInfo(name, lambda x, y: np.asarray(fn(x, y), dtype=np.float32), 1,
                  f"({test.replace('{c}', c)} ? 1.0f : 0.0f)")


UNARY: dict[str, OpInfo] = {
    op.name: op
    for op in (
        _unary("exp", np.exp, 1, "expf({x})", "(exp {x})", special=1),
        _unary("log", np.log, 1, "logf({x})", "(log {x})", special=1),
        _unary("sqrt", np.sqrt, 1, "sqrtf({x})", "(sqrt {x})", special=1),
        _unary("rsqrt", lambda x: 1.0 / np.sqrt(x), 1, "rsqrtf({x})",
               "(/ 1.0 (sqrt {x}))", special=1),
        _unary("recip", lambda x: 1.0 / x, 1, "(1.0f / ({x}))", "(/ 1.0 {x})",
               special=1),
        _unary("abs", np.abs, 1, "fabsf({x})", "(abs {x})"),
        _unary("neg", np.negative, 1, "(-({x}))", "(neg {x})"),
        _unary("square", np.square, 1, "(({x}) * ({x}))", "(* {x} {x})"),
        _unary("relu", lambda x: np.maximum(x, 0.0), 1, "fmaxf({x}, 0.0f)"),
        _unary("sigmoid", _sigmoid, 4, "(1.0f / (1.0f + expf(-({x}))))",
               special=1),
        _unary("silu", lambda x: x * _sigmoid(x), 5, "(({x}) / (1.0f + expf(-({x}))))",
               special=1),
        _unary("gelu", _gelu, 8,
               "(0.5f * ({x}) * (1.0f + tanhf(0.7978845608f * (({x}) + 0.044715f * ({x}) * ({x}) * ({x})))))",
               special=1),
        _unary("tanh", np.tanh, 1, "tanhf({x})", special=1),
        _unary("erf", _erf, 1, "erff({x})", special=1),
        _unary("cos", np.cos, 1, "cosf({x})", "(cos {x})", special=1),
        _unary("sin", np.sin, 1, "sinf({x})", "(sin {x})", special=1),
        _unary("exp2", np.exp2, 1, "exp2f({x})", special=1),
        _unary("softplus", lambda x: np.logaddexp(0.0, x), 3,
               "((({x}) > 20.0f) ? ({x}) : log1pf(expf({x})))", special=2),
        _unary("elu", lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0.0))), 2,
               "((({x}) > 0.0f) ? ({x}) : expm1f({x}))", special=1),
        _unary("not", lambda x: np.asarray(x == 0, dtype=np.float32), 1,
               "((({x}) == 0.0f) ? 1.0f : 0.0f)"),
    )
}

BINARY: dict[str, OpInfo] = {
    op.name: op
    for op in (
        OpInfo("add", np.add, 1, "(({x}) + ({y}))", "(+ {x} {y})"),
        OpInfo("sub", np.subtract, 1, "(({x}) - ({y}))", "(- {x} {y})"),
        OpInfo("mul", np.multiply, 1, "(({x}) * ({y}))", "(* {x} {y})"),
        OpInfo("div", np.divide, 1, "(({x}) / ({y}))", "(/ {x} {y})"),
        OpInfo("max", np.maximum, 1, "fmaxf({x}, {y})", "(max {x} {y})"),
        OpInfo("min", np.minimum, 1, "fminf({x}, {y})", "(min {x} {y})"),
        OpInfo("pow", np.power, 2, "powf({x}, {y})", special=2),
        *(_predicate(name, fn, c) for name, fn, c in (
            ("lt", np.less, "<"), ("le", np.less_equal, "<="), ("gt", np.greater, ">"),
            ("ge", np.greater_equal, ">="), ("eq", np.equal, "=="),
            ("ne", np.not_equal, "!="))),
        _predicate("and", lambda x, y: np.logical_and(x != 0, y != 0), "&&", truth=True),
        _predicate("or", lambda x, y: np.logical_or(x != 0, y != 0), "||", truth=True),
    )
}

# The comparison (or logical) operator each predicate is written with in programs.
PREDICATES: dict[str, str] = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==",
                              "ne": "!=", "and": "and", "or": "or"}

def _where(c: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x where c is nonzero, else y; laid out in memory as x (else y) is.

    Where its operands' memory orders disagree, `np.where` writes its result in C order,
    reading the others across the grain: the numpy backend's attention scores are computed
    column-major (`codegen.numpy_gen`), and a causal mask (a C-order block of positions)
    over them took 2.3 times as long and left every later step on the scores working on the
    transposed layout.  Permuting every operand so that the value's largest strides come
    first makes its layout C order, which `np.where` keeps; the inverse permutation gives the
    result back its axes."""
    like = x if isinstance(x, np.ndarray) and x.ndim > 1 else y
    if not isinstance(like, np.ndarray) or like.ndim < 2 or like.flags.c_contiguous or \
            max(np.ndim(c), np.ndim(x), np.ndim(y)) > like.ndim:
        return np.where(c != 0, x, y)
    order = sorted(range(like.ndim), key=lambda i: -abs(like.strides[i]))

    def permuted(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a)
        return a if a.ndim == 0 else a.reshape((1,) * (like.ndim - a.ndim) + a.shape
                                               ).transpose(order)

    out = np.where(permuted(c) != 0, permuted(x), permuted(y))
    return out.transpose(np.argsort(order))


# Operators of three operands; the CUDA template reads them as {x}, {y}, {z}.
TERNARY: dict[str, OpInfo] = {
    "where": OpInfo("where", _where, 1, "((({x}) != 0.0f) ? ({y}) : ({z}))"),
}

# Every elementwise operator by name (the names of the tables above are distinct).
ELEMENTWISE: dict[str, OpInfo] = {**UNARY, **BINARY, **TERNARY}

# Rows up to this long are reduced to their largest (smallest) element through the element's
# index (`_extreme`); past it numpy's own reduction is as fast.
ROWS_BY_INDEX = 2048


def _extreme(reduce: Callable[..., np.ndarray], index: Callable[..., np.ndarray]
             ) -> Callable[..., np.ndarray]:
    """`reduce` (np.max or np.min), computed as the element at `index` (np.argmax or
    np.argmin) where it reduces the contiguous rows of a float array.

    numpy's max over a row in memory order is not vectorised across rows: on (512, 128) f32
    scores, a softmax's shape, it took 47 µs against argmax's 15 (argmax + a gather: 2x at
    rows of 256, 1.3x at 2048, even at 4096; x86 with AVX-512, numpy 2.5).  Rows apart in
    memory (a block of a wider matrix's columns) gain less: 430 µs against 544 for blocks of
    128 columns of 4096.  Both agree on every float: argmax's first NaN is the NaN the max
    propagates, and equal elements are one value (the sign of a zero aside)."""
    def extreme(x: np.ndarray, axis: int | None = None, keepdims: bool = False) -> np.ndarray:
        x = np.asarray(x)
        if axis is None or x.ndim == 0 or x.dtype.kind != "f" or x.strides[-1] != x.itemsize \
                or axis % x.ndim != x.ndim - 1 or not 1 < x.shape[-1] <= ROWS_BY_INDEX \
                or x.size < ROWS_BY_INDEX:
            return reduce(x, axis=axis, keepdims=keepdims)
        if not x.flags.c_contiguous:
            picked = np.take_along_axis(x, index(x, axis=-1, keepdims=True), axis=-1)
            return picked if keepdims else picked[..., 0]
        rows = x.reshape(-1, x.shape[-1])
        picked = rows[np.arange(len(rows)), index(rows, axis=1)]
        return picked.reshape(x.shape[:-1] + (1,) * keepdims)
    extreme.__name__ = f"tile_{reduce.__name__}"
    return extreme


# In-tile reductions: numpy reducer and CUDA combine template.
TILE_REDUCE: dict[str, OpInfo] = {
    "sum": OpInfo("sum", np.sum, 1, "(({x}) + ({y}))"),
    "max": OpInfo("max", _extreme(np.max, np.argmax), 1, "fmaxf({x}, {y})"),
    "min": OpInfo("min", _extreme(np.min, np.argmin), 1, "fminf({x}, {y})"),
}


# Comparisons a rule's guard may make on constants: Python's operator and egglog's spelling.
COMPARE: dict[str, tuple[Callable[[float, float], bool], str]] = {
    "<": (operator.lt, "<"), "<=": (operator.le, "<="), ">": (operator.gt, ">"),
    ">=": (operator.ge, ">="), "==": (operator.eq, "="), "!=": (operator.ne, "!="),
}
