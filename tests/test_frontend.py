"""The .bbp frontend: what a program parses to, dimension overrides, roles and dtypes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bbrules.blockfile import parse_block_program
from bbrules.errors import SourceError, Span, UsageError
from bbrules.frontend import load_program, parse_dim_override, parse_program
from bbrules.ir import Dim, TensorDecl
from bbrules.program import Apply, Number, Reduction, Ref, free_axes
from bbrules.rulefile import parse_rules

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HERE = Span("<test>", 1, 1)  # spans take no part in equality


def ref(tensor: str, *axes: str) -> Ref:
    return Ref(tensor, axes, HERE)


def app(op: str, *args) -> Apply:
    return Apply(op, args, HERE)


def num(v: float) -> Number:
    return Number(v, HERE)


def red(op: str, axis: str, body) -> Reduction:
    return Reduction(op, axis, body, HERE)


HEADER = """\
dim m = 16 / 4
dim e = 8 / 2
dim n = 8
input A[m, e], W[e, n], B[n] : f16
"""


def rhs(expr_text: str, target: str = "Y[m, n]") -> object:
    """The parsed right-hand side of one statement over HEADER's tensors."""
    name = target.split("[")[0]
    p = parse_program(HEADER + f"{target} = {expr_text}\noutput {name}\n")
    return p.statements[0].expr


def test_attention_example_parses_to_the_design_program():
    p = load_program(EXAMPLES / "attention.bbp")
    assert p.dims == {"q": Dim("q", 4096, 64), "k": Dim("k", 4096, 64), "d": Dim("d", 64, 64)}
    assert [(s.target, s.axes) for s in p.statements] == [
        ("S", ("q", "k")), ("M", ("q",)), ("E", ("q", "k")), ("L", ("q",)), ("P", ("q", "k")),
        ("O", ("q", "d"))]
    assert p.statements[0].expr == red("sum", "d", app("mul", app("mul", ref("Q", "q", "d"),
                                                                    ref("K", "k", "d")),
                                                     num(0.125)))
    assert p.statements[2].expr == app("exp", app("sub", ref("S", "q", "k"), ref("M", "q")))
    assert p.outputs == ("O",)
    assert p.inputs == ("Q", "K", "V")
    assert p.tensors["O"] == TensorDecl("O", ("q", "d"), "f32", "output")
    assert p.tensors["S"].role == "temp"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.bbp")))
def test_every_example_parses(name):
    p = load_program(EXAMPLES / name)
    assert p.outputs and p.statements
    assert all(free_axes(s.expr) == frozenset(s.axes) for s in p.statements)


def test_a_reduction_takes_the_multiplicative_term_that_follows():
    assert rhs("sum[e] A[m, e] * W[e, n] + B[n]") == app(
        "add", red("sum", "e", app("mul", ref("A", "m", "e"), ref("W", "e", "n"))),
        ref("B", "n"))
    assert rhs("2 * sum[e] A[m, e] / W[e, n]") == app(
        "mul", num(2.0), red("sum", "e", app("div", ref("A", "m", "e"), ref("W", "e", "n"))))
    assert rhs("-sum[e] (A[m, e] + 1) * W[e, n]") == app(
        "neg", red("sum", "e", app("mul", app("add", ref("A", "m", "e"), num(1.0)),
                                   ref("W", "e", "n"))))


def test_nested_reductions_and_binary_functions():
    expr = rhs("max[e] sum[m] A[m, e] * W[e, n]", target="Y[n]")
    assert expr == red("max", "e", red("sum", "m", app("mul", ref("A", "m", "e"),
                                                       ref("W", "e", "n"))))
    assert rhs("max(B[n], min(A[m, e], 1e-5))", target="Y[m, e, n]") == app(
        "max", ref("B", "n"), app("min", ref("A", "m", "e"), num(1e-5)))


def test_precedence_of_arithmetic_and_unary_minus():
    assert rhs("B[n] - A[m, e] * 2 / 4 + -B[n]", target="Y[m, e, n]") == app(
        "add", app("sub", ref("B", "n"), app("div", app("mul", ref("A", "m", "e"), num(2.0)),
                                             num(4.0))),
        app("neg", ref("B", "n")))


def test_renamed_reference_keeps_its_use_axes():
    p = parse_program("""\
dim s = 8 / 4
dim t = 8 / 4
dim d = 4
input X[s, d] : f32
G[s, t] = sum[d] X[s, d] * X[t, d]
output G
""")
    assert p.statements[0].expr == red("sum", "d", app("mul", ref("X", "s", "d"),
                                                       ref("X", "t", "d")))


def test_roles_and_dtypes():
    p = parse_program(HEADER + "T[m, e] = A[m, e] * 2\nY[m, n] = sum[e] T[m, e] * W[e, n]\n"
                      "output Y\n")
    assert [(t.name, t.role, t.dtype) for t in p.tensors.values()] == [
        ("A", "input", "f16"), ("W", "input", "f16"), ("B", "input", "f16"),
        ("T", "temp", "f32"), ("Y", "output", "f16")]


def test_outputs_may_be_listed_first_and_several_at_once():
    p = parse_program(HEADER.replace("input", "output Y, T\ninput") +
                      "T[m, e] = A[m, e]\nY[m, n] = sum[e] T[m, e] * W[e, n]\n")
    assert p.outputs == ("Y", "T")
    assert p.tensors["T"].role == p.tensors["Y"].role == "output"


def test_comments_blank_lines_and_a_missing_final_newline():
    p = parse_program("# a comment\n\ndim m = 4  # one block\n\n"
                      "input A[m] : bf16   # trailing\nY[m] = exp(A[m])\noutput Y")
    assert p.dims == {"m": Dim("m", 4, 4)}
    assert p.statements[0].expr == app("exp", ref("A", "m"))


def test_numbers():
    assert rhs("A[m, e] * 0.125 + 1e-5 + 8 + .5 + 2.5E+2", "Y[m, e]") == app(
        "add", app("add", app("add", app("add", app("mul", ref("A", "m", "e"), num(0.125)),
                                         num(1e-5)), num(8.0)), num(0.5)), num(250.0))


def test_spans_point_at_tokens():
    p = parse_program(HEADER + "Y[m, n] = sum[e] A[m, e] * W[e, n]\noutput Y\n", "f.bbp")
    s = p.statements[0]
    assert s.span == Span("f.bbp", 5, 1)
    assert s.axis_spans == (Span("f.bbp", 5, 3), Span("f.bbp", 5, 6))
    assert s.expr.span == Span("f.bbp", 5, 11)
    assert s.expr.axis_span == Span("f.bbp", 5, 15)
    a = s.expr.body.args[0]
    assert (a.span, a.axis_spans) == (Span("f.bbp", 5, 18), (Span("f.bbp", 5, 20),
                                                              Span("f.bbp", 5, 23)))


# Dimension overrides --------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("q=256/64", ("q", 256, 64)),
    ("q=256", ("q", 256, None)),
    (" k = 12 / 3 ", ("k", 12, 3)),
])
def test_parse_dim_override(text, want):
    assert parse_dim_override(text) == want


@pytest.mark.parametrize("text, fragment", [
    ("q", "expected NAME=EXTENT"),
    ("q=1.5", "expected NAME=EXTENT"),
    ("q=0", "a dimension's extent must be positive, got 0"),
    ("q=64/0", "a block size must be positive, got 0"),
    ("q=100/128", "block size 128 is larger than the extent 100 of dimension 'q'"),
])
def test_bad_dim_override(text, fragment):
    with pytest.raises(UsageError, match=fragment):
        parse_dim_override(text)


def test_overrides_replace_extent_and_block():
    p = load_program(EXAMPLES / "attention.bbp", {"q": (128, 32), "k": (256, None),
                                                  "d": (16, None)})
    assert p.dims == {"q": Dim("q", 128, 32), "k": Dim("k", 256, 64), "d": Dim("d", 16, 16)}


def test_override_keeping_a_block_larger_than_the_extent():
    with pytest.raises(SourceError) as err:
        load_program(EXAMPLES / "attention.bbp", {"q": (48, None)})
    assert "block size 64 is larger than the extent 48 of dimension 'q' (as overridden)" in \
        str(err.value)
    assert (err.value.span.line, err.value.span.column) == (2, 5)


def test_override_of_an_unknown_dimension():
    with pytest.raises(UsageError, match="declares no dimension 'z'"):
        load_program(EXAMPLES / "attention.bbp", {"z": (8, 8)})


def test_override_making_a_renaming_inconsistent_is_reported_at_the_use():
    with pytest.raises(SourceError, match="cannot rename axis 's' of 'X'"):
        load_program(EXAMPLES / "self_attention.bbp", {"s": (128, 64)})


def test_missing_file():
    with pytest.raises(UsageError, match="cannot read"):
        load_program(EXAMPLES / "no_such_program.bbp")


@pytest.mark.parametrize("sizes, message", [
    ("8 / 9", "block size 9 is larger than the extent 8"),
    ("8 / 0", "a block size must be positive, got 0"),
    ("0", "a dimension's extent must be positive, got 0"),
    ("8.5", "a dimension's extent must be a positive integer, got '8.5'"),
])
def test_every_way_of_writing_sizes_is_checked_alike(sizes, message):
    # A program's dim, a block program's dim, a check's `with` and the command line's --dim.
    def raised(parse) -> str:
        with pytest.raises((SourceError, UsageError)) as err:
            parse()
        return str(err.value)

    program = f"dim q = {sizes}\ninput A[q] : f32\nB[q] = A[q]\noutput B\n"
    rules = f"rule r: ?x => ?x\ncheck r: load(A[q]) with q = {sizes}\n"
    found = [raised(lambda: parse_program(program, "p.bbp")),
             raised(lambda: parse_block_program(f"dim q = {sizes}\n", "p.bbk")),
             raised(lambda: parse_rules(rules, "r.bbr"))]
    if "." not in sizes:
        found.append(raised(lambda: parse_dim_override("q=" + sizes.replace(" ", ""))))
    assert all(message in f for f in found), found
