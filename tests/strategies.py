"""Hypothesis strategies for random valid `.bbp` programs, shared by the test files.

`programs()` draws the source text of a program the frontend accepts: 2 to 4 dimensions
(extent <= 64, several blocks per axis, blocks of different sizes on different axes, and
sometimes a twin dimension so that references can rename an axis), 1 to 3 inputs, and 1 to 4
statements mixing elementwise operators, sums of products (contractions), max/min reductions
and reductions nested inside expressions.

Values stay tame, so float32 results can be compared at about 1e-4: log, sqrt, rsqrt and recip
only see `square(x) + 1`, exp only sees `tanh(x)`, divisors are `square(x) + 1`, and every sum
is a mean (its product is scaled by 1/extent).  No value spans more than three axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hypothesis import strategies as st

MAX_AXES = 3
AXIS_NAMES = "ijkl"
TWIN = "t"

SAFE_UNARY = ("tanh", "sigmoid", "relu", "abs", "neg", "silu", "gelu")
GUARDED_UNARY = ("sqrt(square({x}) + 1)", "log(square({x}) + 1)", "rsqrt(square({x}) + 1)",
                 "recip(square({x}) + 1)", "exp(tanh({x}))", "(-{x})")
CONSTANTS = ("0.5", "2", "1.5", "1e-1", "3")


@dataclass(frozen=True)
class Term:
    """Source text that is an operand as it stands (a reference, a call or parenthesised)."""

    text: str
    axes: frozenset[str]


@dataclass
class _Generator:
    """Draws expressions over the tensors defined so far."""

    draw: Callable[[st.SearchStrategy[Any]], Any]
    dims: dict[str, tuple[int, int]]
    twins: dict[str, str]
    tensors: dict[str, tuple[str, ...]]

    def refs(self) -> list[Term]:
        """Every way to reference a defined tensor: as declared, or with one axis renamed."""
        out = []
        for name, axes in self.tensors.items():
            variants = [axes] + [tuple(self.twins[a] if b == a else b for b in axes)
                                 for a in axes if a in self.twins and self.twins[a] not in axes]
            out += [Term(f"{name}[{', '.join(v)}]", frozenset(v)) for v in variants]
        return out

    def leaf(self) -> Term:
        return self.draw(st.sampled_from(self.refs()))

    def mean_factor(self, axis: str) -> str:
        return repr(1.0 / self.dims[axis][0])

    def expr(self, depth: int) -> Term:
        kind = "leaf" if depth == 0 else self.draw(st.sampled_from(
            ("leaf", "unary", "guarded", "binary", "scalar", "sum", "extreme", "contraction")))
        return self.leaf() if kind == "leaf" else getattr(self, kind)(depth)

    def unary(self, depth: int) -> Term:
        x = self.expr(depth - 1)
        return Term(f"{self.draw(st.sampled_from(SAFE_UNARY))}({x.text})", x.axes)

    def guarded(self, depth: int) -> Term:
        x = self.expr(depth - 1)
        return Term(self.draw(st.sampled_from(GUARDED_UNARY)).format(x=x.text), x.axes)

    def binary(self, depth: int) -> Term:
        x, y = self.expr(depth - 1), self.expr(depth - 1)
        axes = x.axes | y.axes
        if len(axes) > MAX_AXES:
            return x
        op = self.draw(st.sampled_from(("+", "-", "*", "/", "max", "min")))
        if op in ("max", "min"):
            return Term(f"{op}({x.text}, {y.text})", axes)
        if op == "/":
            return Term(f"({x.text} / (square({y.text}) + 1))", axes)
        return Term(f"({x.text} {op} {y.text})", axes)

    def scalar(self, depth: int) -> Term:
        x = self.expr(depth - 1)
        c = self.draw(st.sampled_from(CONSTANTS))
        form = self.draw(st.sampled_from(("({x} * {c})", "({c} - {x})", "({x} + {c})")))
        return Term(form.format(x=x.text, c=c), x.axes)

    def sum(self, depth: int) -> Term:
        fs = [self.expr(depth - 1) for _ in range(self.draw(st.integers(1, 3)))]
        axes = frozenset().union(*(f.axes for f in fs))
        if not axes:
            return fs[0]
        a = self.draw(st.sampled_from(sorted(axes)))
        if len(axes - {a}) > MAX_AXES:
            return fs[0]
        body = " * ".join(f.text for f in fs)
        return Term(f"(sum[{a}] {body} * {self.mean_factor(a)})", axes - {a})

    def extreme(self, depth: int) -> Term:
        x = self.expr(depth - 1)
        if not x.axes:
            return x
        a = self.draw(st.sampled_from(sorted(x.axes)))
        op = self.draw(st.sampled_from(("max", "min")))
        return Term(f"({op}[{a}] {x.text})", x.axes - {a})

    def contraction(self, depth: int) -> Term:
        """`sum[a] X * Y` over references sharing `a`: a block matmul once lowered."""
        refs = self.refs()
        a = self.draw(st.sampled_from(sorted(frozenset().union(*(r.axes for r in refs)))))
        with_a = [r for r in refs if a in r.axes]
        x, y = self.draw(st.sampled_from(with_a)), self.draw(st.sampled_from(with_a))
        if len((x.axes | y.axes) - {a}) > MAX_AXES:
            return x
        if depth > 1 and self.draw(st.booleans()):
            x = Term(f"{self.draw(st.sampled_from(SAFE_UNARY))}({x.text})", x.axes)
        return Term(f"(sum[{a}] {x.text} * {y.text} * {self.mean_factor(a)})",
                    (x.axes | y.axes) - {a})


def _dims(draw: Callable[[st.SearchStrategy[Any]], Any]) -> dict[str, tuple[int, int]]:
    """2 to 4 dimensions; the more there are, the smaller, so no tensor exceeds ~14k elements."""
    n = draw(st.integers(2, 4))
    cap = {2: 64, 3: 24, 4: 12}[n]
    dims = {}
    for name in AXIS_NAMES[:n]:
        block = draw(st.sampled_from([b for b in (1, 2, 3, 4, 8, 16) if b <= cap]))
        count = draw(st.integers(1, min(4, cap // block)))
        dims[name] = (block * count, block)
    return dims


@st.composite
def programs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> str:
    """Source text of a random valid program (see the module docstring)."""
    dims = _dims(draw)
    twins: dict[str, str] = {}
    if draw(st.booleans()):
        twin_of = draw(st.sampled_from(sorted(dims)))
        dims[TWIN] = dims[twin_of]
        twins = {twin_of: TWIN, TWIN: twin_of}
    declared = [d for d in dims if d != TWIN]
    tensors: dict[str, tuple[str, ...]] = {}
    for name in "ABC"[:draw(st.integers(1, 3))]:
        rank = draw(st.integers(1, min(2, len(declared))))
        tensors[name] = tuple(draw(st.permutations(declared))[:rank])
    lines = [f"dim {d} = {e} / {b}" for d, (e, b) in dims.items()]
    lines.append("input " + ", ".join(f"{t}[{', '.join(a)}]" for t, a in tensors.items())
                 + " : f32")

    gen = _Generator(draw, dims, twins, tensors)
    targets = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(("expr", "sum", "extreme", "contraction")))
        depth = draw(st.integers(1, 3))
        rhs = gen.expr(depth) if kind == "expr" else getattr(gen, kind)(depth)
        if not rhs.axes:
            leaf = gen.leaf()
            rhs = Term(f"({rhs.text} + {leaf.text})", leaf.axes)
        axes = tuple(draw(st.permutations(sorted(rhs.axes))))
        target = f"T{i}"
        lines.append(f"{target}[{', '.join(axes)}] = {rhs.text}")
        tensors[target] = axes
        targets.append(target)
    outputs = [t for t in targets[:-1] if draw(st.booleans())] + [targets[-1]]
    lines.append(f"output {', '.join(outputs)}")
    return "\n".join(lines) + "\n"


COMPARE = ("==", "!=", "<=", ">=", "<", ">")


@st.composite
def selecting_programs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> str:
    """Source text of a program that selects by the position along a short axis `c` (2 to 4
    chunks, in blocks of one or all in one), as slices, concatenations and RoPE do: sums,
    maxima and contractions over c under predicates of c's position, that may hold on every
    chunk, some or none, a map over c, and a one-hot pick of one chunk; and rows of `V`
    shifted along a longer axis `s`, with a row of `Y` added where a predicate of s's
    position holds, as a KV cache grown by a token is."""
    chunks = draw(st.integers(2, 4))
    block = draw(st.sampled_from([1, chunks]))

    def predicate() -> str:
        atoms = [f"c {draw(st.sampled_from(COMPARE))} {draw(st.integers(-1, chunks))}"
                 for _ in range(draw(st.integers(1, 2)))]
        return f" {draw(st.sampled_from(('and', 'or')))} ".join(atoms)

    pick = draw(st.integers(0, chunks - 1))
    width = draw(st.sampled_from(["8", "16 / 8"]))
    longer = draw(st.sampled_from(["33", "33 / 11", "34 / 17"]))
    shift, grown = draw(st.integers(0, 2)), draw(st.integers(0, 34))
    lines = [f"dim t = 32 / 16\ndim c = {chunks} / {block}\ndim d = {width}\ndim n = 16 / 8",
             f"dim s = {longer}",
             "input X[t, c, d], W[c, d, n], V[t, d], U[d, n], Y[d] : f32",
             f"A[t, d] = sum[c] where({predicate()}, X[t, c, d], 0)",
             f"B[t, c, d] = where({predicate()}, X[t, c, d], V[t, d]) * (c + 1)",
             f"G[t, n] = sum[c, d] where({predicate()}, X[t, c, d], 0) * W[c, d, n]",
             f"M[t, d] = max[c] where({predicate()}, B[t, c, d], -inf)",
             f"H[t, n] = sum[d] A[t, d] * U[d, n] + G[t, n] + "
             f"sum[c] where(c == {pick}, 1, 0) * sum[d] B[t, c, d] * W[c, d, n]",
             f"K[s, d] = (sum[t] where(t == s - {shift}, V[t, d], 0)) + "
             f"where(s {draw(st.sampled_from(COMPARE))} {grown}, Y[d], 0)"]
    outputs = draw(st.lists(st.sampled_from("ABGMHK"), min_size=1, max_size=3, unique=True))
    lines.append(f"output {', '.join(outputs)}")
    return "\n".join(lines) + "\n"
