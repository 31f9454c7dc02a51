"""Block-program files: `show_program` output reads back to the same program; mistakes are
reported at their exact position."""

from __future__ import annotations

import pytest

from bbrules.blockfile import load_block_program, parse_block_program
from bbrules.errors import SourceError
from bbrules.ir import (MAX, MIN, SUM, Binary, BlockProgram, BlockReduce, Const, Dim, Dot, Get, Load,
                        Monoid, Pos, Reduce, Store, TensorDecl, Tuple, Unary, Var, Where, postorder,
                        show_program)

# Online softmax with the output accumulator in the state: (running max, denominator, numerator).
_m, _l, _o = (Var(f"{s}.{c}") for s in "a" for c in "mlo")
_bm, _bl, _bo = (Var(f"b.{c}") for c in "mlo")
_new_m = Binary("max", _m, _bm)


def _rescaled(acc: Var, part: Var) -> Binary:
    return Binary("add", Binary("mul", acc, Unary("exp", Binary("sub", _m, _new_m))),
                  Binary("mul", part, Unary("exp", Binary("sub", _bm, _new_m))))


ONLINE = Monoid("online_blockfile_test", ("m", "l", "o"),
                (Const(float("-inf")), Const(0.0), Const(0.0)),
                (_new_m, _rescaled(_l, _bl), _rescaled(_o, _bo)),
                (Binary("div", Var("o"), Var("l")),), doc="online softmax")

# Two sums in one loop, both results kept.
PAIR = Monoid("pair_sum_blockfile_test", ("s", "t"), (Const(0.0), Const(0.0)),
              (Binary("add", Var("a.s"), Var("b.s")), Binary("add", Var("a.t"), Var("b.t"))),
              (Var("s"), Var("t")))


def _dims(**sizes: tuple[int, int]) -> dict[str, Dim]:
    return {n: Dim(n, e, b) for n, (e, b) in sizes.items()}


def _tensors(*decls: tuple[str, tuple[str, ...], str]) -> dict[str, TensorDecl]:
    return {n: TensorDecl(n, axes, "f32", role) for n, axes, role in decls}


def flash_attention() -> BlockProgram:
    """One kernel: scores, the online-softmax loop over k with a 3-component monoid."""
    s = Binary("mul", Reduce("d", SUM, Dot("d", Load("Q", ("q", "d")), Load("K", ("k", "d")))),
               Const(0.125))
    m = BlockReduce("max", "k", s)
    p = Unary("exp", Binary("sub", s, m))
    body = Tuple((m, BlockReduce("sum", "k", p), Dot("k", p, Load("V", ("k", "d")))))
    return BlockProgram.of_stores(
        _dims(q=(8, 4), k=(12, 4), d=(4, 4)),
        _tensors(("Q", ("q", "d"), "input"), ("K", ("k", "d"), "input"),
                 ("V", ("k", "d"), "input"), ("O", ("q", "d"), "output")),
        (Store("O", ("q", "d"), Reduce("k", ONLINE, body)),),
        ("O",))


def every_node() -> BlockProgram:
    """Several kernels using every node kind, a renamed load, a temp, negative and tiny
    constants, infinities, and a tuple read back with get."""
    x = Load("X", ("s", "e"))
    xk = Load("X", ("k", "e"))  # the same tensor, its first axis renamed
    row_max = Reduce("e", MAX, BlockReduce("max", "e", x))
    centred = Binary("sub", x, row_max)
    pair = Reduce("e", PAIR, Tuple((BlockReduce("sum", "e", centred),
                                     BlockReduce("sum", "e", Unary("square", centred)))))
    var = Binary("div", Get(1, pair), Const(16.0))
    norm = Binary("mul", centred, Unary("rsqrt", Binary("add", var, Const(1e-05))))
    clipped = Binary("min", Binary("max", norm, Const(float("-inf"))), Const(float("inf")))
    scores = Reduce("e", SUM, Dot("e", Load("Y", ("s", "e")), xk))
    causal = Where(Binary("le", Pos("k"), Pos("s")), scores, Const(float("inf")))
    low = Reduce("k", MIN, BlockReduce("min", "k", causal))
    return BlockProgram.of_stores(
        _dims(s=(8, 4), k=(8, 4), e=(16, 8)),
        _tensors(("X", ("s", "e"), "input"), ("Y", ("s", "e"), "temp"),
                 ("Z", ("s",), "output")),
        (Store("Y", ("s", "e"), Binary("sub", Unary("neg", clipped),
                                       Where(Binary("sub", norm, Const(0.5)), x, Const(-2.5)))),
         Store("Z", ("s",), Binary("add", low,
                                   Binary("mul", Const(-1.0), Get(0, pair))))),
        ("Z",))


@pytest.mark.parametrize("build", [flash_attention, every_node])
def test_round_trip(build) -> None:
    program = build()
    text = show_program(program)
    parsed = parse_block_program(text, "p.bbk")
    assert parsed.program == program
    assert parsed.source is None
    assert show_program(parsed.program) == text


def test_round_trip_through_a_file_with_its_source(tmp_path) -> None:
    program = flash_attention()
    path = tmp_path / "fa.bbk"
    path.write_text(show_program(program, source="../examples/attention.bbp"))
    read = load_block_program(path)
    assert read.program == program
    assert read.source == "../examples/attention.bbp"


def test_a_declared_monoid_travels_with_the_program() -> None:
    text = show_program(flash_attention()).replace(ONLINE.name, "online_blockfile_fresh")
    program = parse_block_program(text).program
    assert program.monoids["online_blockfile_fresh"].combine == ONLINE.combine
    [reduce] = [n for k in program.stores for n in postorder(k.value)
                if isinstance(n, Reduce) and n.axis == "k"]
    assert reduce.monoid is program.monoids["online_blockfile_fresh"]


def test_hand_written_file() -> None:
    text = """
    # comments and free layout are fine
    dim q = 8    # one block
    input A[q] : f16
    output B[q] : f32
    kernel B[q]: let t0 = exp(load(A[q])) B[q] = t0 * t0 - 2 * -load(A[q])
    """
    program = parse_block_program(text).program
    assert program.dims == {"q": Dim("q", 8, 8)}
    assert program.tensors["A"] == TensorDecl("A", ("q",), "f16", "input")
    a = Load("A", ("q",))
    assert program.stores[0].value == Binary(
        "sub", Binary("mul", Unary("exp", a), Unary("exp", a)),
        Binary("mul", Const(2.0), Unary("neg", a)))


_HEAD = """dim q = 8 / 4
dim k = 8 / 2
input A[q, k] : f32
output B[q] : f32
"""


@pytest.mark.parametrize("text, line, column, message", [
    (_HEAD + "kernel B[q]:\n  B[q] = reduce(k, sum, bsum(k, load(A[q, k]))) +\n",
     6, 50, "unexpected end of file; expected one of '(', '-', a name, a number"),
    (_HEAD + "kernel B[q]:\n  B[q] = reduce(k, sum, bsum(k, load(A[q, k])) $ 2)\n",
     6, 48, "unexpected '$'; expected one of ')', '*', '+', ',', '-', '/'"),
    (_HEAD + "kernel B[q]:\n  B[q] = reduce(k, avg, bsum(k, load(A[q, k])))\n",
     6, 20, "unknown monoid 'avg'"),
    (_HEAD + "kernel B[q]:\n  B[q] = reduce(k, sum, bsum(k, load(A[q, k]), 1))\n",
     6, 25, "bsum takes 2 arguments (axis, x), got 3"),
    (_HEAD + "kernel B[q]:\n  B[q] = reduce(k, sum, bsum(k, lod(A[q, k])))\n",
     6, 33, "unknown function 'lod'"),
    (_HEAD + "kernel B[q]:\n  B[q] = reduce(k, sum, bsum(k, load(A[q, j])))\n",
     6, 43, "unknown axis 'j'"),
    (_HEAD + "kernel B[q]:\n  B[q] = reduce(k, sum, bsum(k, load(C[q, k])))\n",
     6, 38, "unknown tensor 'C'"),
    (_HEAD + "kernel B[q]:\n  B[q] = bsum(k, load(A[q, k]))\n",
     5, 8, "kernel B: a store needs shape == deps == ['q']"),
    (_HEAD + "kernel B[q]:\n  C[q] = load(A[q, k])\n",
     6, 3, "kernel B[q] must store exactly B[q]"),
    (_HEAD + "kernel B[q]:\n  B[q] = load(A[q, k])\n  C[q] = load(A[q, k])\n",
     6, 3, "a kernel of several stores names only its grid: `kernel [q]:`"),
    (_HEAD + "kernel [q, z]:\n  B[q] = bsum(k, load(A[q, k]))\n",
     5, 12, "unknown axis 'z'"),
    (_HEAD + "output C[q, k] : f32\nkernel [q]:\n  B[q] = reduce(k, sum, bsum(k, load(A[q, k])))\n"
     "  C[q, k] = load(B[q]) + load(A[q, k])\n",
     6, 1, "kernel B_C: C reads 'B', which the same kernel stores"),
    (_HEAD + "kernel B[q]:\n  let t = load(A[q, k])\n  let t = t\n  B[q] = t\n",
     7, 7, "'t' is already bound"),
    (_HEAD + "kernel B[q]:\n  B[q] = reduce(k, sum, bsum(k, ?x))\n",
     6, 33, "pattern variable ?x outside a rule"),
    ("dim q = 8 / 16\n", 1, 13, "block size 16 is larger than the extent 8 of 'q'"),
    ("dim q = 8\ninput A[q, p] : f32\n", 2, 12, "unknown axis 'p'"),
    ("dim q = 8\ninput A[q] : f64\n", 2, 14, "unknown dtype 'f64'"),
    ("dim q = 8\ninput A[q] : i32\noutput B[q] : i32\nkernel B[q]:\n  B[q] = load(A[q])\n",
     4, 8, "output 'B' is i32: only inputs hold whole numbers"),
    ("dim q = 8\ninput A[q] f32\n", 2, 12, "unexpected 'f32'; expected ':'"),
    ("dim q = 8\noutput A[q] : f32\n", 2, 1, "output 'A' is never stored"),
    ("dim q = 8\nmonoid two(m, l)\n  identity = (0.0)\n  combine = (a.m, b.l)\n"
     "  finalize = (m)\n", 3, 14, "identity gives 1 expression, the state (m, l) has 2"),
    ("dim q = 8\nmonoid two(m, l)\n  identity = (0.0, 0.0)\n  combine = (a.m, c.l)\n"
     "  finalize = (m)\n", 4, 19, "unknown name 'c.l'"),
    ("dim q = 8\nmonoid two(m)\n  identity = (0.0)\n  combine = (bsum(q, a.m))\n"
     "  finalize = (m)\n", 4, 14, "a monoid's parts are elementwise: 'bsum'"),
])
def test_malformed(text: str, line: int, column: int, message: str) -> None:
    with pytest.raises(SourceError) as err:
        parse_block_program(text, "bad.bbk")
    e = err.value
    assert (e.span.path, e.span.line, e.span.column) == ("bad.bbk", line, column)
    assert message in e.message
    caret_line = str(e).splitlines()[-1]
    assert caret_line.index("^") == column + 1  # two spaces of indent, columns count from 1
