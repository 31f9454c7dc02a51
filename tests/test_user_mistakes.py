"""Hostile input: every user mistake is `file:line:col: error: ...` or a usage error, exit 2.

One test per family of mistakes found by mutating the examples, rule files, block files and
targets (issue 8); each ran into a Python traceback before it was handled.
"""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from bbrules.blockfile import parse_block_program
from bbrules.cli import main
from bbrules.frontend import load_program
from bbrules.ir import Binary, BlockProgram, Const, Dim, Load, Store, TensorDecl, show_program
from bbrules.lower import lower
from bbrules.memory import run_bytes

ROOT = Path(__file__).resolve().parent.parent
SOFTMAX = """\
dim r = 8 / 4
dim c = 16 / 8
input X[r, c] : f32
M[r]    = max[c] X[r, c]
E[r, c] = exp(X[r, c] - M[r])
L[r]    = sum[c] E[r, c]
Y[r, c] = E[r, c] / L[r]
output Y
"""


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def assert_positioned(capsys, path: Path, line: int, fragment: str, *argv: object) -> str:
    """The command fails with exit 2 and `path:line:col: error:` naming `fragment`."""
    status, _, err = run_cli(capsys, *argv)
    assert status == 2, err
    assert re.search(rf"{re.escape(str(path))}:{line}:\d+: error: .*{re.escape(fragment)}", err), err
    return err


def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# Bytes that are not UTF-8 ----------------------------------------------------------------------


def test_non_utf8_bytes_are_a_positioned_error_in_every_kind_of_file(tmp_path, capsys):
    prog = write(tmp_path / "p.bbp", SOFTMAX.replace("max[c]", "max[c] \xff").encode("latin-1"))
    assert_positioned(capsys, prog, 4, "byte 0xff is not UTF-8", "show", prog)
    bbk = tmp_path / "p.bbk"
    assert main(["apply", str(write(tmp_path / "q.bbp", SOFTMAX)), "-o", str(bbk)]) == 0
    write(bbk, bbk.read_bytes() + b"\n\x80junk\n")
    capsys.readouterr()
    line = bbk.read_bytes().count(b"\n")
    assert_positioned(capsys, bbk, line, "byte 0x80", "cost", bbk)
    pack = tmp_path / "pack"
    pack.mkdir()
    rules = write(pack / "r.bbr", b"rule r: ?x * 1.0 => ?x # \xfe\n")
    assert_positioned(capsys, rules, 1, "byte 0xfe", "check", pack, "--trials", 1)
    target = write(tmp_path / "t.toml", (ROOT / "targets/a100.toml").read_bytes() + b"#\xc3\n")
    line = target.read_bytes().count(b"\n")
    assert_positioned(capsys, target, line, "byte 0xc3", "cost", prog.with_name("q.bbp"),
                      "--target", target)


# Numbers that overflow or are not finite -------------------------------------------------------


@pytest.mark.parametrize("line, replacement", [
    (1, "dim r = 1e999 / 1"),
    (1, "dim r = 8 / 1e999"),
    (2, "dim c = 1e300"),
])
def test_sizes_that_overflow_in_a_block_file(tmp_path, capsys, line, replacement):
    bbk = tmp_path / "p.bbk"
    assert main(["apply", str(write(tmp_path / "p.bbp", SOFTMAX)), "-o", str(bbk)]) == 0
    lines = bbk.read_text().splitlines()
    at = [i for i, s in enumerate(lines) if s.startswith("dim ")][line - 1]
    lines[at] = replacement
    write(bbk, "\n".join(lines) + "\n")
    capsys.readouterr()
    assert_positioned(capsys, bbk, at + 1, "must be at most 2**53", "show", bbk)


@pytest.mark.parametrize("text, fragment", [
    ("rule r: ?x * 1.0 => ?x\ncheck r: load(X[i]) * 1.0 => load(X[i]) with i = 1e999 / 1", "2**53"),
    ("ruleset s\nrule r: ?x * 1.0 => ?x\nstage st: s iterations 1e999", "iterations must be"),
])
def test_numbers_that_overflow_in_a_rule_file(tmp_path, capsys, text, fragment):
    pack = tmp_path / "pack"
    pack.mkdir()
    rules = write(pack / "r.bbr", text + "\n")
    assert_positioned(capsys, rules, text.count("\n") + 1, fragment, "check", pack,
                      "--trials", 1)


@pytest.mark.parametrize("key, value", [
    ("local_capacity", "1" + "0" * 400),
    ("global_bandwidth", "inf"),
    ("peak_flops", "nan"),
    ("launch_cost", "1e-320"),
    ("launch_cost", "inf"),
    ("peak_flops_f16", "1e308"),
])
def test_target_numbers_must_be_finite_and_in_range(tmp_path, capsys, key, value):
    text = (ROOT / "targets/a100.toml").read_text()
    text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s.startswith(key))
    target = write(tmp_path / "t.toml", text)
    prog = write(tmp_path / "p.bbp", SOFTMAX)
    assert_positioned(capsys, target, line, f"'{key}' must be", "apply", prog,
                      "--target", target)


# Block files: their source, and empty ones ---------------------------------------------------


def applied(tmp_path: Path, text: str = SOFTMAX, name: str = "p", *options: str) -> Path:
    """`apply -o` of `text`: a fused block file recording its source."""
    bbk = tmp_path / f"{name}.bbk"
    assert main(["apply", str(write(tmp_path / f"{name}.bbp", text)), "-o", str(bbk),
                 *options]) == 0
    return bbk


def test_a_bad_escape_in_the_source_string(tmp_path, capsys):
    bbk = applied(tmp_path)
    write(bbk, bbk.read_text().replace('source "', 'source "\\q'))
    capsys.readouterr()
    assert_positioned(capsys, bbk, 2, "bad string: Invalid \\escape", "show", bbk)


def test_a_block_file_copied_away_from_its_source_still_compares(tmp_path, capsys):
    bbk = applied(tmp_path)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    copy = write(moved / "p.bbk", bbk.read_text())
    (tmp_path / "p.bbp").unlink()
    capsys.readouterr()
    status, out, err = run_cli(capsys, "run", copy)
    assert status == 0, err
    assert "Y: norm-wise error" in out and out.splitlines()[0].endswith(": ok")


def test_a_block_file_whose_source_is_another_program(tmp_path, capsys):
    bbk = applied(tmp_path)
    lines = [s for s in bbk.read_text().splitlines() if not s.startswith("|")]
    other = write(tmp_path / "other.bbp", SOFTMAX.replace("X", "Z"))
    lines[1] = f'source "{other.name}"'
    write(bbk, "\n".join(lines) + "\n")
    capsys.readouterr()
    assert_positioned(capsys, bbk, 2, "input X is not defined with the same shape by the "
                                      "source program", "run", bbk)


def test_a_mistake_in_the_embedded_source_is_placed_in_the_block_file(tmp_path, capsys):
    bbk = applied(tmp_path)
    lines = bbk.read_text().splitlines()
    at = next(i for i, s in enumerate(lines) if s.startswith("| E[r, c]"))
    lines[at] = lines[at].replace("M[r]", "N[r]")
    write(bbk, "\n".join(lines) + "\n")
    capsys.readouterr()
    err = assert_positioned(capsys, bbk, at + 1, "embedded source program: unknown tensor 'N'",
                            "run", bbk)
    assert f"{bbk}:{at + 1}:{lines[at].index('N[r]') + 1}:" in err


def test_a_block_file_whose_source_path_moved_says_nothing_is_compared(tmp_path, capsys):
    bbk = applied(tmp_path)
    write(bbk, "\n".join(s for s in bbk.read_text().splitlines() if not s.startswith("|")))
    (tmp_path / "p.bbp").unlink()
    capsys.readouterr()
    status, out, err = run_cli(capsys, "run", bbk)
    assert status == 0
    assert f"{bbk}:2:8: warning: the source program" in err and "nothing was compared" in out


@pytest.mark.parametrize("command", ["show", "cost", "apply", "run"])
@pytest.mark.parametrize("text", ["", "# nothing\n", "dim r = 8 / 4\ninput X[r] : f32\n"])
def test_an_empty_block_file(tmp_path, capsys, command, text):
    bbk = write(tmp_path / "e.bbk", text)
    assert_positioned(capsys, bbk, max(text.count("\n"), 1), "declares no outputs", command, bbk)


# Command-line values ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["run", "{p}", "--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    (["check", "--trials", "0"], "argument --trials: must be at least 1, got 0"),
    (["check", "--trials", "10001"], "argument --trials: must be at most 10000, got 10001"),
    (["run", "{p}", "--backend", "numpy", "--profile", "99999999999999999999"],
     "argument --profile: must be at most 10000"),
    (["apply", "{p}", "--nodes", "-5"], "argument --nodes: must be at least 1"),
    (["apply", "{p}", "--iterations", "-1"], "argument --iterations: must be at least 1"),
    (["apply", "{p}", "--max-kernels", "0"], "argument --max-kernels: must be at least 1"),
    (["apply", "{p}", "--seconds", "-1"], "argument --seconds: must be a finite positive"),
    (["apply", "{p}", "--seconds", "nan"], "argument --seconds: must be a finite positive"),
    (["run", "{p}", "--seconds", "inf"], "argument --seconds: must be a finite positive"),
    (["apply", "{p}", "--seconds", "soon"], "argument --seconds: expected a number"),
    (["apply", "{p}", "--nodes", "1e5"], "argument --nodes: expected an integer"),
])
def test_command_line_values_out_of_range_are_usage_errors(tmp_path, capsys, argv, message):
    prog = write(tmp_path / "p.bbp", SOFTMAX)
    status, out, err = run_cli(capsys, *(a.format(p=prog) for a in argv))
    assert status == 2 and message in err and not out


LOOKUP = ("dim t = 8\ndim v = 40\ndim e = 4\ninput IDS[t] : i32\ninput E[v, e] : f32\n"
          "X[t, e] = sum[v] where(IDS[t] == v, 1, 0) * E[v, e]\noutput X\n")


@pytest.mark.parametrize("ids, message", [
    (np.arange(8) + 0.5, "'IDS' is declared i32 but holds 0.5 at [0]"),
    (np.full(8, 2 ** 24 + 1), "'IDS' is declared i32 but holds 16777217 at [0]"),
    (np.array(["a"] * 8), "'IDS' holds <U1 values, not real numbers"),
    (np.zeros(8, complex), "'IDS' holds complex128 values, not real numbers"),
])
@pytest.mark.parametrize("backend", ["interp", "numpy"])
def test_values_an_input_cannot_hold_are_usage_errors(tmp_path, capsys, ids, message, backend):
    """`run --values`: ids that are not whole or that f32 would round to another id, and
    arrays of anything but real numbers, are refused before any backend runs."""
    prog = write(tmp_path / "p.bbp", LOOKUP)
    np.savez(tmp_path / "v.npz", IDS=ids, E=np.ones((40, 4), np.float32))
    status, out, err = run_cli(capsys, "run", prog, "--values", tmp_path / "v.npz",
                               "--backend", backend)
    assert status == 2 and message in err and not out


@pytest.mark.parametrize("damage", [
    lambda data: data[:100],  # cut short: no central directory
    lambda data: data[:70] + bytes([data[70] ^ 0xFF]) + data[71:],  # compressed bytes changed
    lambda data: data.replace(b"PK\x03\x04", b"PK\x03\x05", 1),  # a member's header
])
def test_a_damaged_values_file_is_a_usage_error(tmp_path, capsys, damage):
    """Found by fuzzing: zip and zlib errors escaped as tracebacks."""
    prog = write(tmp_path / "p.bbp", LOOKUP)
    np.savez_compressed(tmp_path / "v.npz", IDS=np.arange(8), E=np.ones((40, 4), np.float32))
    path = tmp_path / "v.npz"
    path.write_bytes(damage(path.read_bytes()))
    status, out, err = run_cli(capsys, "run", prog, "--values", path)
    assert status == 2 and f"--values {path}: not a readable .npz file" in err and not out


# Output paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["apply", "codegen"])
@pytest.mark.parametrize("output, message", [
    ("{tmp}/missing/x.bbk", "directory {tmp}/missing does not exist"),
    ("{tmp}", "is a directory"),
    ("{tmp}/p.bbp", "is the program being read"),
])
def test_output_paths_are_checked_before_any_work(tmp_path, capsys, monkeypatch, command,
                                                  output, message):
    prog = write(tmp_path / "p.bbp", SOFTMAX)
    monkeypatch.setattr("bbrules.cli.fuse", lambda *a, **k: pytest.fail("fused first"))
    status, _, err = run_cli(capsys, command, prog, "-o", output.format(tmp=tmp_path))
    assert status == 2 and message.format(tmp=tmp_path) in err
    assert prog.read_text() == SOFTMAX


# Printing NaN ----------------------------------------------------------------------------------


def test_check_of_a_rule_folding_to_nan(tmp_path, capsys):
    pack = tmp_path / "pack"
    pack.mkdir()
    write(pack / "r.bbr", "rule r: rsqrt(const(?c)) => const(rsqrt(?c))\n")
    status, out, err = run_cli(capsys, "check", pack, "--no-installed", "--trials", 20)
    assert status == 0, out + err
    assert "1 rules, 0 checks: 0 checks failed, 0 rules unsound" in out


def test_a_nan_constant_prints_and_reads_back():
    program = BlockProgram.of_stores({"r": Dim("r", 8, 4)},
                                     {"X": TensorDecl("X", ("r",), "f32", "input"),
                                      "Y": TensorDecl("Y", ("r",), "f32", "output")},
                                     (Store("Y", ("r",), Binary("add", Load("X", ("r",)),
                                                               Const(float("nan")))),), ("Y",))
    text = show_program(program)
    assert "+ nan" in text
    back = parse_block_program(text).program.stores[0].value
    assert isinstance(back.y, Const) and back.y.value != back.y.value


# Tuples larger than the e-graph's ----------------------------------------------------------------


def wide_monoid(n: int) -> str:
    state = [f"s{i}" for i in range(n)]
    return (f"monoid wide({', '.join(state)})\n"
            f"  identity = ({', '.join('0.0' for _ in state)})\n"
            f"  combine  = ({', '.join(f'a.{s} + b.{s}' for s in state)})\n"
            f"  finalize = ({' + '.join(state)})\n")


@pytest.mark.parametrize("n", [9, 12])
def test_a_monoid_with_more_components_than_the_engine_has(tmp_path, capsys, n):
    pack = tmp_path / "pack"
    pack.mkdir()
    rules = write(pack / "m.bbr", wide_monoid(n) + "rule r: ?x * 1.0 => ?x\n")
    err = assert_positioned(capsys, rules, 1, "a monoid's state has at most 8 components",
                            "check", pack, "--trials", 1)
    assert f"{rules}:1:{len('monoid wide(s0, s1, s2, s3, s4, s5, s6, s7, ') + 1}:" in err


def test_eight_components_are_accepted(tmp_path, capsys):
    pack = tmp_path / "pack"
    pack.mkdir()
    write(pack / "m.bbr", wide_monoid(8) + "rule r: ?x * 1.0 => ?x\n")
    status, out, err = run_cli(capsys, "check", pack, "--trials", 1)
    assert status == 0, out + err


def test_a_block_file_tuple_with_more_components_than_the_engine_has(tmp_path, capsys):
    bbk = applied(tmp_path)
    text = bbk.read_text()
    wide = "tuple(" + ", ".join(["load(X[r, c])"] * 9) + ")"
    lines = text.splitlines()
    at = next(i for i, s in enumerate(lines) if s.startswith("kernel"))
    lines.insert(at + 1, f"  let w = get(0, {wide})")
    lines[-1] += " + w"
    write(bbk, "\n".join(lines) + "\n")
    capsys.readouterr()
    assert_positioned(capsys, bbk, at + 1, "a tuple has at most 8 components", "apply", bbk)


# Names that generated code uses ----------------------------------------------------------------


@pytest.mark.parametrize("names", [
    ("range", "len", "np"), ("run", "inputs", "f32"), ("unary_rsqrt", "_input", "kernel_np"),
    ("print", "abs", "exec"), ("exp", "float", "UNARY"),
])
def test_tensors_named_like_python_or_numpy_names_run_in_the_numpy_backend(tmp_path, capsys,
                                                                           names):
    a, b, c = names
    text = (f"dim r = 8 / 4\ndim c = 16 / 4\ninput {a}[r, c], {b}[c] : f32\n"
            f"{c}[r] = sum[c] rsqrt(1 + {a}[r, c] * {a}[r, c]) * {b}[c]\noutput {c}\n")
    prog = write(tmp_path / "p.bbp", text)
    for extra in ([], ["--no-fuse"]):
        status, out, err = run_cli(capsys, "run", prog, "--backend", "numpy", *extra)
        assert status == 0, out + err
        assert f"{c}: norm-wise error" in out and ": ok" in out


# Memory ----------------------------------------------------------------------------------------


def test_run_refuses_a_program_larger_than_its_memory_budget(tmp_path, capsys):
    bbk = applied(tmp_path)
    write(bbk, bbk.read_text().replace("dim r = 8 / 4", "dim r = 4294967296 / 4294967296"))
    capsys.readouterr()
    status, out, err = run_cli(capsys, "run", bbk)
    assert status == 2 and not out
    assert "needs about" in err and "GiB of memory, more than the" in err
    status, _, err = run_cli(capsys, "run", tmp_path / "p.bbp", "--memory", "1K")
    assert status == 2 and "more than the 1.00 KiB allowed (--memory)" in err
    assert run_cli(capsys, "run", tmp_path / "p.bbp", "--memory", "0")[0] == 2


SMALL = {"attention.bbp": ["q=64/16", "k=64/16"], "softmax.bbp": ["r=64/16", "c=256/64"],
         "gated_mlp.bbp": ["m=32/16", "e=64/32", "f=64/32"]}


@pytest.mark.parametrize("example", sorted(SMALL))
@pytest.mark.parametrize("backend", ["interp", "numpy"])
def test_the_memory_estimate_bounds_what_run_allocates(capsys, example, backend):
    path = ROOT / "examples" / example
    dims = [a for d in SMALL[example] for a in ("--dim", d)]
    program = load_program(path, {n: (int(e), int(b)) for n, e, b in
                                  (re.split("[=/]", d) for d in SMALL[example])})
    fused = main(["run", str(path), *dims, "--backend", backend])
    assert fused in (0, 1)
    capsys.readouterr()
    tracemalloc.start()
    main(["run", str(path), *dims, "--backend", backend, "--no-fuse"])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak <= run_bytes(lower(program), program)


def test_a_convolution_is_estimated_by_the_tiles_it_makes(tmp_path, capsys):
    """A convolution as models import it (magika's shape): the sum over input positions of a
    one-hot window times the input, inside the sum over taps and channels.  Estimated as if
    one tile spanned the output and every summed axis at once it needed 85 GB, and `run`
    refused it; its nodes' tiles are what a backend holds, and the run stays under them."""
    conv = write(tmp_path / "conv.bbp", (
        "dim o = 508 / 64\ndim s = 5\ndim j = 512 / 64\ndim c = 256 / 64\ndim m = 512 / 64\n"
        "input X[j, c], W[m, c, s] : f32\n"
        "Y[o, m] = sum[s, c] W[m, c, s] * sum[j] where(j == o + s, 1, 0) * X[j, c]\n"
        "output Y\n"))
    program = load_program(conv)
    estimate = run_bytes(lower(program), program)
    assert estimate < 256 << 20
    tracemalloc.start()
    status = main(["run", str(conv), "--no-fuse", "--memory", "256M"])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert status == 0 and "Y: norm-wise error" in capsys.readouterr().out
    assert peak <= estimate


# Long expressions ------------------------------------------------------------------------------
# No pass recurses once per level of an expression, so a program thousands of terms deep goes
# through every command (Python's default recursion limit is 1,000 frames).

DEPTH = 3000


def long_program(body: str) -> str:
    return f"dim r = 8 / 4\ndim c = 8 / 4\ninput X[r, c], Z[r] : f32\nY[r] = {body}\noutput Y\n"


def runs_everywhere(capsys, tmp_path: Path, prog: Path) -> None:
    """show, cost and run (both backends) on `prog`; fused by apply, the block file it writes
    through show, run and both code generators; and apply's explanation."""
    bbk, cu = tmp_path / "fused.bbk", tmp_path / "fused.cu"
    for argv in (["show", prog], ["cost", prog], ["run", prog, "--no-fuse"],
                 ["run", prog, "--no-fuse", "--backend", "numpy"],
                 ["apply", prog, "--seconds", "3", "-o", bbk], ["show", bbk],
                 ["run", bbk, "--backend", "numpy"], ["run", bbk, "--backend", "interp"],
                 ["codegen", bbk, "--backend", "cuda", "-o", cu],
                 ["codegen", bbk, "--backend", "numpy"],
                 ["apply", prog, "--seconds", "3", "--explain", "--json"]):
        status, out, err = run_cli(capsys, *argv)
        assert status == 0, (argv, err[-2000:])


@pytest.mark.parametrize("body", [
    " + ".join(["Z[r]"] * DEPTH),
    "tanh(" * DEPTH + "Z[r]" + ")" * DEPTH,
    "sum[c] X[r, c]" + " * 1.0" * DEPTH,
    "-" * (DEPTH + 1) + "Z[r]",
])
def test_a_program_thousands_of_terms_deep_runs_everywhere(tmp_path, capsys, body):
    runs_everywhere(capsys, tmp_path, write(tmp_path / "p.bbp", long_program(body)))


def test_a_block_file_expression_thousands_of_terms_deep(tmp_path, capsys):
    bbk = applied(tmp_path)
    lines = bbk.read_text().splitlines()
    lines[-1] += " * 1.0" * DEPTH + " + 0.0" * DEPTH
    write(bbk, "\n".join(lines) + "\n")
    capsys.readouterr()
    for argv in (["show"], ["cost"], ["run"], ["run", "--backend", "numpy"],
                 ["codegen", "--backend", "numpy"], ["codegen", "--backend", "cuda"]):
        status, out, err = run_cli(capsys, argv[0], bbk, *argv[1:])
        assert status == 0, (argv, err[-2000:])


def deep_pack(n: int) -> str:
    """A sound pack whose rule, check and monoid are each `n` operations deep."""
    return f"""ruleset deep
monoid deep_online(m, s)
  identity = (-inf, 0.0)
  combine  = (max(a.m, b.m), a.s * exp(a.m - max(a.m, b.m)) + b.s * exp(b.m - max(a.m, b.m)){" + 0.0" * n})
  finalize = (s{" * 1.0" * n})

# x * 1 * ... * 1 = x
rule deep_one: ?x{" * 1.0" * n} => ?x
# the online sum is the same fold, written with a deeper monoid
rule deep_fold: reduce(?a, online, ?x) => reduce(?a, deep_online, ?x)

check deep_one: load(X[m, e]){" * 1.0" * n} => load(X[m, e])
check deep_fold: reduce(e, online, tuple(bmax(e, load(X[m, e])), bsum(e, load(X[m, e])))) => reduce(e, deep_online, tuple(bmax(e, load(X[m, e])), bsum(e, load(X[m, e])))) with e = 4 / 2

stage deep_stage: deep
"""


def test_rules_checks_and_monoids_hundreds_of_operations_deep(tmp_path, capsys):
    pack = tmp_path / "pack"
    pack.mkdir()
    write(pack / "deep.bbr", deep_pack(600))
    status, out, err = run_cli(capsys, "check", pack)
    assert status == 0 and "0 rules unsound" in out, err[-2000:]
    status, out, err = run_cli(capsys, "apply", write(tmp_path / "p.bbp", SOFTMAX),
                               "--rules", pack)
    assert status == 0, err[-2000:]


def test_a_block_file_monoid_thousands_of_operations_deep(tmp_path, capsys):
    # At the program's blocks the fused softmax folds its 2 column blocks with the online
    # monoid (in one block of 16 it needs none).
    bbk = applied(tmp_path, SOFTMAX, "p", "--fixed-blocks")
    text = bbk.read_text()
    assert "finalize = (s)" in text
    text = text.replace("finalize = (s)", "finalize = (s" + " * 1.0" * DEPTH + ")")
    write(bbk, text.replace("b.m)))\n", "b.m))" + " + 0.0" * DEPTH + ")\n", 1))
    capsys.readouterr()
    for argv in (["show"], ["run"], ["run", "--backend", "numpy"],
                 ["codegen", "--backend", "numpy"], ["codegen", "--backend", "cuda"]):
        status, out, err = run_cli(capsys, argv[0], bbk, *argv[1:])
        assert status == 0, (argv, err[-2000:])
        assert argv != ["show"] or "* 1.0 * 1.0" in out
