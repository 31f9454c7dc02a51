"""Malformed programs: every mistake is a SourceError at the exact line and column."""

from __future__ import annotations

import pytest

from bbrules.cli import main
from bbrules.errors import SourceError
from bbrules.frontend import parse_program
from bbrules.lower import lower
from bbrules.program import Apply, Number, Program, Ref, Statement

HEADER = """\
dim m = 16 / 4
dim e = 8 / 2
dim n = 8
input A[m, e], W[e, n], B[n] : f32
"""

# (name, program text after HEADER, line, column, message fragment)
CASES = [
    ("dangling operator", "Y[m, n] = B[n] +\noutput Y", 5, 17,
     "unexpected end of line; expected one of '(', '-', 'inf', 'max', 'mean', 'min', 'sum', "
     "a name, a number"),
    ("missing comma", "Y[m, n] = A[m e]\noutput Y", 5, 15, "unexpected 'e'; expected one of '+', ',', ']'"),
    ("bad character", "Y[m, n] = B[n] @ B[n]\noutput Y", 5, 16, "unexpected character '@'"),
    ("missing equals", "Y[m, n] B[n]\noutput Y", 5, 9, "unexpected 'B'; expected '='"),
    ("unknown tensor", "Y[m, n] = sum[e] A[m, e] * V[e, n]\noutput Y", 5, 28,
     "unknown tensor 'V'"),
    ("unknown axis", "Y[m, n] = sum[e] A[m, e] * W[e, z]\noutput Y", 5, 33, "unknown axis 'z'"),
    ("unknown reduction axis", "Y[m, n] = sum[z] A[m, e]\noutput Y", 5, 15,
     "unknown axis 'z'"),
    ("too many indices", "Y[m, n] = B[m, n]\noutput Y", 5, 11,
     "'B' has 1 axes (B[n]), this reference gives 2"),
    ("too few indices", "Y[m, e] = A[m]\noutput Y", 5, 11,
     "'A' has 2 axes (A[m, e]), this reference gives 1"),
    ("duplicate tensor", "Y[n] = B[n]\nY[n] = B[n] * 2\noutput Y", 6, 1,
     "'Y' is already defined (line 5)"),
    ("duplicate input", "input B[m] : f32\nY[n] = B[n]\noutput Y", 5, 7,
     "'B' is already defined (line 4)"),
    ("duplicate dim", "dim e = 4\nY[n] = B[n]\noutput Y", 5, 5,
     "dimension 'e' is already declared"),
    ("block larger than the extent", "dim k = 10 / 16\nY[n] = B[n]\noutput Y", 5, 14,
     "block size 16 is larger than the extent 10 of dimension 'k'"),
    ("block size zero", "dim k = 8 / 0\nY[n] = B[n]\noutput Y", 5, 13,
     "a block size must be positive, got 0"),
    ("fractional extent", "dim k = 8.5\nY[n] = B[n]\noutput Y", 5, 9,
     "a dimension's extent must be a positive integer, got '8.5'"),
    ("reduction over a missing axis", "Y[n] = sum[m] B[n]\noutput Y", 5, 12,
     "sum[m] reduces over an axis its operand does not have (its axes: n)"),
    ("free axis not in target", "Y[m] = sum[e] A[m, e] + B[n]\noutput Y", 5, 27,
     "axis 'n' is neither reduced nor an axis of the target Y[m]"),
    ("target axis not produced", "Y[m, n] = sum[e] A[m, e]\noutput Y", 5, 6,
     "target axis 'n' does not occur on the right-hand side"),
    ("assign to input", "B[n] = B[n] * 2\noutput B", 5, 1, "cannot assign to input 'B'"),
    ("used before defined", "Y[n] = T[n]\nT[n] = B[n]\noutput Y", 5, 8,
     "'T' is used before it is defined (line 6)"),
    ("output never defined", "Y[n] = B[n]\noutput Y, Z", 6, 11, "output 'Z' is never defined"),
    ("input as output", "Y[n] = B[n]\noutput Y, B", 6, 11, "input 'B' cannot be an output"),
    ("no outputs", "Y[n] = B[n]", 1, 1, "the program declares no outputs"),
    ("rename to other extent", "Y[m] = sum[e] A[m, e] * B[e]\noutput Y", 5, 27,
     "cannot rename axis 'n' of 'B' (8/8) to 'e' (8/2): extent and block must match"),
    ("unknown function", "Y[n] = swish(B[n])\noutput Y", 5, 8, "unknown function 'swish'"),
    ("sum called as a function", "Y[n] = sum(B[n])\noutput Y", 5, 8,
     "unknown function 'sum' (reduce with sum[axis] ...)"),
    ("wrong arity, unary", "Y[n] = exp(B[n], B[n])\noutput Y", 5, 8,
     "function 'exp' takes 1 argument, got 2"),
    ("wrong arity, binary", "Y[n] = max(B[n])\noutput Y", 5, 8,
     "function 'max' takes 2 arguments, got 1"),
    ("unknown dtype", "input C[m] : f64\nY[n] = B[n]\noutput Y", 5, 14,
     "unknown dtype 'f64' (expected one of bf16, f16, f32, i32)"),
    ("repeated axis in a reference", "Y[m] = sum[e] A[m, m]\noutput Y", 5, 20,
     "axis 'm' appears twice"),
    ("repeated target axis", "Y[n, n] = B[n]\noutput Y", 5, 6, "axis 'n' appears twice"),
    ("repeated output", "Y[n] = B[n]\noutput Y, Y", 6, 11, "'Y' is already listed as an output"),
    ("unknown axis in an input", "input C[k] : f32\nY[n] = B[n]\noutput Y", 5, 9,
     "unknown axis 'k'"),
    ("unclosed parenthesis", "Y[n] = (B[n] + 1\noutput Y", 5, 17,
     "unexpected end of line; expected one of ')', 'or'"),
    ("unknown name", "Y[m, n] = where(x <= m, B[n], 0.0)\noutput Y", 5, 17,
     "unknown name 'x': neither a dimension"),
    ("tensor without axes", "Y[m, n] = where(n <= m, B, 0.0)\noutput Y", 5, 25,
     "tensor 'B' is used without its axes (write B[n])"),
    ("where with two arguments", "Y[m, n] = where(n <= m, B[n])\noutput Y", 5, 11,
     "function 'where' takes 3 arguments, got 2"),
    ("chained comparison", "Y[m, n] = B[n] < m < n\noutput Y", 5, 20, "unexpected '<'"),
    ("position of an axis the target lacks", "Y[n] = where(n <= m, B[n], 0.0)\noutput Y", 5, 19,
     "axis 'm' is neither reduced nor an axis of the target Y[n]"),
    ("not is not a function", "Y[n] = not(B[n], B[n])\noutput Y", 5, 16, "unexpected ','"),
    ("unknown reduction", "Y[m] = softmax[e] A[m, e]\noutput Y", 5, 8,
     "unknown reduction 'softmax' (the reductions are sum, max, min, mean)"),
    ("constant from a tensor", "c = B[n] * 2\nY[n] = B[n] * c\noutput Y", 5, 5,
     "the value of constant 'c' must be numbers and earlier constants"),
    ("constant named like a dimension", "e = 2\nY[n] = B[n]\noutput Y", 5, 1,
     "'e' is already a dimension"),
    ("constant named like a tensor", "B = 2\nY[n] = B[n]\noutput Y", 5, 1,
     "'B' is already defined (line 4)"),
    ("unknown output dtype", "Y[n] = B[n]\noutput Y : f64", 6, 12, "unknown dtype 'f64'"),
    ("whole-number output", "Y[n] = B[n]\noutput Y : i32", 6, 12,
     "outputs cannot be i32: values are computed in f32"),
    ("scalar used with axes", "T[] = sum[n] B[n]\nY[n] = B[n] * T[n]\noutput Y", 6, 15,
     "'T' has 0 axes (T[]), this reference gives 1"),
    ("view that does not multiply out", "dim h = 2\ndim d = 3\nY[m, h, d] = A[m, (h, d)]\n"
     "output Y", 7, 20, "h (2) x d (3) is 6 elements, 'e' of 'A' has 8"),
    ("slice off the chunks", "dim i = 4\nY[m, i] = A[m, i + 2]\noutput Y", 6, 20,
     "must start at a multiple of i's extent 4"),
    ("slice past the end", "dim i = 4\nY[m, i] = A[m, i + 8]\noutput Y", 6, 20,
     "runs past its extent 8"),
    ("concatenation of the wrong length", "dim c = 12\nY[m, c] = concat(c, A[m, e], B[n])\n"
     "output Y", 6, 11, "are 8 + 8 = 16 elements along 'c', which has 12"),
    ("concatenated piece with no axis of its own", "dim c = 16\n"
     "Y[m, c] = concat(c, A[m, e], A[m, c])\noutput Y", 6, 30,
     "piece 2 of concat(c, ...) has no axis of its own"),
]


@pytest.mark.parametrize("name, body, line, column, fragment", CASES, ids=[c[0] for c in CASES])
def test_malformed_program(name, body, line, column, fragment):
    text = HEADER + body + "\n"
    with pytest.raises(SourceError) as info:
        parse_program(text, "bad.bbp")
    err = info.value
    assert fragment in err.message
    assert (err.span.path, err.span.line, err.span.column) == ("bad.bbp", line, column)
    head, source_line, caret = str(err).split("\n")
    assert head == f"bad.bbp:{line}:{column}: error: {err.message}"
    assert source_line.strip() == text.splitlines()[line - 1].strip()
    assert caret.index("^") == column + 1  # two spaces of indent, columns count from 1


def test_error_on_the_last_line_without_a_newline():
    with pytest.raises(SourceError) as info:
        parse_program(HEADER + "Y[n] = B[n] *", "bad.bbp")
    assert (info.value.span.line, info.value.span.column) == (5, 14)


def test_lowering_a_statement_that_is_not_expressible():
    """A hand-built Program whose statement stores a value missing a target axis."""
    good = parse_program(HEADER + "Y[m, n] = sum[e] A[m, e] * W[e, n]\noutput Y\n", "p.bbp")
    s = good.statements[0]
    broken = Statement("Y", ("m", "n"), Apply("max", (Ref("B", ("n",), s.span),
                                                        Number(1.0, s.span)), s.span), s.span)
    program = Program(good.path, good.dims, good.tensors, (broken,), good.outputs, good.source)
    with pytest.raises(SourceError) as info:
        lower(program)
    assert "statement 'Y' cannot be lowered" in info.value.message
    assert (info.value.span.line, info.value.span.column) == (5, 1)


@pytest.mark.parametrize("name, body, line, column, fragment", CASES, ids=[c[0] for c in CASES])
def test_the_cli_reports_the_position_and_exits_2(name, body, line, column, fragment, tmp_path,
                                                  capsys):
    path = tmp_path / "bad.bbp"
    path.write_text(HEADER + body + "\n")
    assert main(["cost", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:{line}:{column}: error: ") and fragment in err
    assert "Traceback" not in err
