"""Mutation fuzzing of the CLI's input files, shared by tests/test_fuzz.py and
benchmarks/fuzz_cli.py.

A mutant is a valid input file changed the way hostile or careless edits change files: a byte
flipped, bytes deleted, a line duplicated or deleted, a huge number or junk bytes inserted, the
file truncated.  An ONNX model is binary, so its mutants are mostly changed fields, the way a
broken exporter or a hand edit changes them (`mutate_model`).  `Corpus` writes the files (the
examples at tiny sizes, the standard pack, a block file written by `apply -o`, the A100 target,
an array file of input values, two small ONNX models) and `Outcome` runs one CLI command on a
mutant in-process and says what is wrong with how it ended, if anything: an exception escaping
`main` (a traceback), an exit status outside {0, 1, 2}, or an exit 2 for a mistake in the file
that does not say where: `path:line:col:` in a text file, `path:` and then the node or value
in a binary one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import random
import re
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from bbrules.cli import main

ROOT = Path(__file__).resolve().parent.parent

# Sizes that keep every example tiny, so that `run` takes milliseconds.
_TINY_DIM = re.compile(r"^dim (\w+) = (\d+)( / \d+)?", re.M)

HUGE = [b"1e999", b"1" + b"0" * 400, b"4294967296", b"-0", b"nan", b"inf", b"1e-320", b"9" * 30]
JUNK = [b"\xff", b"\x00", b"\x80\x81", b"\xc3", b"\xe2\x82", b"(", b")", b"[", b"?", b"\n", b"#",
        b"=", b'"', b"\\", b"\t", b"let", b"kernel", b"rule", b"monoid", b"dim", b"sum"]


def _tiny(text: str) -> str:
    """Every `dim` of a program at extent 8 in blocks of 4; a dim of one block keeps its size
    up to 64 (views fix products of such sizes: a head's 64 features read as 2 x 32), else 4."""
    def tiny(m: re.Match) -> str:
        if m[3]:
            return f"dim {m[1]} = 8 / 4"
        return m[0] if int(m[2]) <= 64 else f"dim {m[1]} = 4"
    return _TINY_DIM.sub(tiny, text)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to three random edits of `data`."""
    for _ in range(rng.choice((1, 1, 2, 3))):
        data = rng.choice(_EDITS)(data, rng)
    return data


def _flip(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return data
    i = rng.randrange(len(data))
    return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]


def _delete(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + data[i + rng.randint(1, 12):]


def _lines(data: bytes, rng: random.Random, edit: Callable[[list[bytes], int], None]) -> bytes:
    lines = data.split(b"\n")
    edit(lines, rng.randrange(len(lines)))
    return b"\n".join(lines)


def _duplicate_line(data: bytes, rng: random.Random) -> bytes:
    return _lines(data, rng, lambda lines, i: lines.insert(i, lines[i]))


def _delete_line(data: bytes, rng: random.Random) -> bytes:
    return _lines(data, rng, lambda lines, i: lines.pop(i))


def _replace_number(data: bytes, rng: random.Random) -> bytes:
    numbers = list(re.finditer(rb"\d+(\.\d*)?", data))
    if not numbers:
        return _insert(data, rng, HUGE)
    m = rng.choice(numbers)
    return data[:m.start()] + rng.choice(HUGE) + data[m.end():]


def _insert(data: bytes, rng: random.Random, pool: list[bytes] = JUNK) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + rng.choice(pool) + data[i:]


def _truncate(data: bytes, rng: random.Random) -> bytes:
    return data[:rng.randrange(len(data) + 1)]


_EDITS = [_flip, _delete, _duplicate_line, _delete_line, _replace_number, _insert, _truncate]


# ONNX models ------------------------------------------------------------------------------

INTS = [0, -1, 1, 2, 3, -2, 7, 2**31, -2**31, 2**62, -2**63]
FLOATS = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e38, 1e-45]
OPS = ["MatMul", "Add", "Mul", "Softmax", "Reshape", "Transpose", "Gather", "Slice", "Concat",
       "Split", "ReduceMean", "Sqrt", "Loop", "Bogus", ""]


def mutate_model(data: bytes, rng: random.Random) -> bytes:
    """One to three random edits of the fields of the ONNX model `data`; one mutant in six
    then has bits flipped in its bytes as well."""
    import onnx
    model = onnx.ModelProto.FromString(data)
    for _ in range(rng.choice((1, 1, 2, 3))):
        rng.choice(_MODEL_EDITS)(model, rng)
    data = model.SerializeToString()
    return _flip(_flip(data, rng), rng) if rng.random() < 1 / 6 else data


def _attribute(model, rng: random.Random) -> None:
    """An attribute's value out of range, or an attribute the operator may not have."""
    import onnx
    nodes = list(model.graph.node)
    if not nodes:
        return
    node = rng.choice(nodes)
    if not node.attribute:
        name = rng.choice(["axis", "perm", "keepdims", "alpha", "axes", "transA"])
        node.attribute.append(onnx.helper.make_attribute(name, rng.choice(INTS)))
        return
    a = rng.choice(list(node.attribute))
    if a.type == onnx.AttributeProto.INT:
        a.i = rng.choice(INTS)
    elif a.type == onnx.AttributeProto.INTS and a.ints:
        a.ints[rng.randrange(len(a.ints))] = rng.choice(INTS)
    elif a.type == onnx.AttributeProto.FLOAT:
        a.f = rng.choice(FLOATS)
    elif a.type == onnx.AttributeProto.STRING:
        a.s = rng.choice([b"", b"\xff", b"bogus"])


def _dimension(model, rng: random.Random) -> None:
    """A graph input's or output's dimension changed, made symbolic, or added."""
    infos = [*model.graph.input, *model.graph.output]
    if not infos:
        return
    dims = rng.choice(infos).type.tensor_type.shape.dim
    if not dims:
        dims.add().dim_value = rng.choice(INTS)
    elif rng.random() < 0.3:
        dims[rng.randrange(len(dims))].dim_param = rng.choice(["N", "", "1x"])
    else:
        dims[rng.randrange(len(dims))].dim_value = rng.choice(INTS)


def _element_type(model, rng: random.Random) -> None:
    """A value's element type: another number type, a string, bool, or no type at all."""
    g = model.graph
    values = [*g.input, *g.output, *g.initializer]
    if values:
        v, t = rng.choice(values), rng.choice([0, 2, 3, 6, 7, 8, 9, 10, 11, 16, 99])
        if hasattr(v, "data_type"):
            v.data_type = t
        else:
            v.type.tensor_type.elem_type = t


def _rewire(model, rng: random.Random) -> None:
    """A node's input or output renamed: to nothing, to an unknown value, to itself."""
    nodes = list(model.graph.node)
    if not nodes:
        return
    node = rng.choice(nodes)
    ports = node.input if rng.random() < 0.6 or not node.output else node.output
    if ports:
        ports[rng.randrange(len(ports))] = rng.choice(["", "nowhere", node.output[0] if
                                                       node.output else "x"])
    else:
        ports.append("extra")


def _nodes(model, rng: random.Random) -> None:
    """A node deleted, duplicated, or made another operator."""
    nodes = list(model.graph.node)
    if not nodes:
        return
    node, edit = rng.choice(nodes), rng.randrange(3)
    if edit == 0:
        model.graph.node.remove(node)
    elif edit == 1:
        model.graph.node.append(node)
    else:
        node.op_type = rng.choice(OPS)


def _initializer(model, rng: random.Random) -> None:
    """An initializer's dimensions no longer match its data, or its data cut short."""
    if not model.graph.initializer:
        return
    t = rng.choice(list(model.graph.initializer))
    if t.dims and rng.random() < 0.5:
        t.dims[rng.randrange(len(t.dims))] = rng.choice(INTS)
    elif t.raw_data:
        t.raw_data = t.raw_data[:rng.randrange(len(t.raw_data) + 1)]
    else:
        t.dims.append(rng.choice([0, 2, 5]))


def _graph(model, rng: random.Random) -> None:
    """The opset changed, or the graph's first output renamed or removed."""
    g, edit = model.graph, rng.randrange(3)
    if edit == 0 and model.opset_import:
        model.opset_import[0].version = rng.choice([0, 1, 6, 99, 2**40])
    elif edit == 1 and g.output:
        g.output[0].name = rng.choice(["nowhere", g.input[0].name if g.input else "x"])
    elif g.output:
        g.output.remove(g.output[0])


_MODEL_EDITS = [_attribute, _dimension, _element_type, _rewire, _nodes, _initializer, _graph]


def _onnx_models(tmp: Path) -> list[Path]:
    """Two small models that import and run: attention over an RMS-normalised input
    (reshapes, transposes, a softmax, constant shapes), and an embedding whose rows are
    sliced, rotated and concatenated (integer inputs, Slice, Split, Concat)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def weight(name: str, array) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(array), name)

    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    node = helper.make_node
    attention = helper.make_graph(
        [node("Mul", ["x", "x"], ["sq"]),
         node("ReduceMean", ["sq", "last"], ["ms"], keepdims=1),
         node("Add", ["ms", "eps"], ["mse"]),
         node("Sqrt", ["mse"], ["rms"]),
         node("Div", ["x", "rms"], ["xn"]),
         *(node("MatMul", ["xn", f"w{p}"], [p]) for p in "qkv"),
         *(node("Reshape", [p, "heads"], [f"{p}h"]) for p in "qkv"),
         node("Transpose", ["qh"], ["qt"], perm=[0, 2, 1, 3]),
         node("Transpose", ["kh"], ["kt"], perm=[0, 2, 3, 1]),
         node("Transpose", ["vh"], ["vt"], perm=[0, 2, 1, 3]),
         node("MatMul", ["qt", "kt"], ["s"]),
         node("Mul", ["s", "scale"], ["ss"]),
         node("Softmax", ["ss"], ["pr"], axis=-1),
         node("MatMul", ["pr", "vt"], ["o"]),
         node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
         node("Reshape", ["ot", "flat"], ["y"])],
        "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 16])],
        [weight("last", np.array([-1], np.int64)), weight("eps", np.float32(1e-5)),
         *(weight(f"w{p}", f32(16, 16)) for p in "qkv"),
         weight("heads", np.array([2, 8, 2, 8], np.int64)),
         weight("scale", np.float32(8 ** -0.5)), weight("flat", np.array([2, 8, 16], np.int64))])
    embedding = helper.make_graph(
        [node("Gather", ["table", "ids"], ["e"]),
         node("Slice", ["e", "zero", "half", "last"], ["lo"]),
         node("Slice", ["e", "half", "end", "last"], ["hi"]),
         node("Neg", ["hi"], ["nhi"]),
         node("Concat", ["nhi", "lo"], ["rot"], axis=-1),
         node("Split", ["rot", "halves"], ["a", "b"], axis=-1),
         node("Mul", ["a", "b"], ["ab"]),
         node("Add", ["ab", "e1"], ["y"])],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 4])],
        [weight("table", f32(10, 8)), weight("zero", np.array([0], np.int64)),
         weight("half", np.array([4], np.int64)), weight("end", np.array([8], np.int64)),
         weight("last", np.array([-1], np.int64)), weight("halves", np.array([4, 4], np.int64)),
         weight("e1", f32(4))])
    paths = []
    for graph in (attention, embedding):
        path = tmp / f"{graph.name}.onnx"
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        onnx.checker.check_model(model)
        onnx.save(model, str(path))
        paths.append(path)
    return paths


# Where a mistake in a file is said to be, after its path: a line and column in a text file;
# in a binary file (a model, an array file), words that name a node or value.
LINE_COL = r"[^:\n]*:\d+:\d+: error: "
IN_BINARY = r"(: | \(imported\):\d+:\d+: error: )"  # or in the program a model imports to


@dataclass(frozen=True)
class Input:
    """A valid file to mutate, and the CLI commands to run on a mutant (`{}` is its path)."""

    kind: str
    path: Path  # where the mutant is written; the original is its content now
    commands: tuple[tuple[str, ...], ...]
    scope: Path | None = None  # where its mistakes may be reported (default: `path`); a
    # mutant rule file may break the pack elsewhere (a stage naming its rulesets)
    mutate: Callable[[bytes, random.Random], bytes] = mutate
    position: str = LINE_COL  # how an exit 2 says where, after the path


class Corpus:
    """The valid inputs, written under `tmp`: every example at tiny sizes, every file of the
    standard pack (mutated inside a copy of the pack), a fused block file, the A100 target."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.inputs: list[Input] = []
        tiny = tmp / "tiny.bbp"
        tiny.write_text("dim r = 8 / 4\ninput X[r] : f32\nY[r] = X[r] * 2 + 1\noutput Y\n")
        for example in sorted((ROOT / "examples").glob("*.bbp")):
            path = tmp / "examples" / example.name
            path.parent.mkdir(exist_ok=True)
            path.write_text(_tiny(example.read_text()))
            self.inputs.append(Input("bbp", path, (("show", "{}"), ("cost", "{}"),
                                                   ("run", "{}", "--no-fuse"))))
        pack = tmp / "pack"
        shutil.copytree(ROOT / "rules", pack, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        for rules in sorted(pack.glob("*.bbr")):
            self.inputs.append(Input("bbr", rules, (
                ("apply", str(tiny), "--rules", str(pack), "--no-installed", "--iterations", "2"),),
                pack))
        bbk = tmp / "softmax.bbk"
        softmax = tmp / "examples" / "softmax.bbp"
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["apply", str(softmax), "-o", str(bbk)]) == 0
        self.inputs.append(Input("bbk", bbk, (("show", "{}"), ("cost", "{}"), ("run", "{}"),
                                              ("run", "{}", "--backend", "numpy"))))
        target = tmp / "a100.toml"
        shutil.copy(ROOT / "targets" / "a100.toml", target)
        self.inputs.append(Input("toml", target, (("cost", str(tiny), "--target", "{}"),)))
        values = tmp / "values.npz"
        np.savez_compressed(values, X=np.arange(8, dtype=np.float32))
        self.inputs.append(Input("npz", values, (("run", str(tiny), "--values", "{}",
                                                  "--no-fuse"),), position=IN_BINARY))
        imported = tmp / "imported.bbp"
        for model in _onnx_models(tmp) if importlib.util.find_spec("onnx") else []:
            self.inputs.append(Input("onnx", model, (("import", "{}", "-o", str(imported)),
                                                     ("run", "{}", "--no-fuse")),
                                     mutate=mutate_model, position=IN_BINARY))

    def of_kind(self, kind: str) -> list[Input]:
        return [i for i in self.inputs if i.kind == kind]


# Usage errors (no file position) that a mutant may rightly cause: a block file whose dims a
# mutant made too large to run, a pack whose rules a mutant removed entirely.
ALLOWED_USAGE = ("of memory, more than", "no .bbr files", "no fused program")


@dataclass(frozen=True)
class Outcome:
    """How one command ended on one mutant."""

    argv: tuple[str, ...]
    status: int | None
    stderr: str
    exception: str | None

    @staticmethod
    def of(argv: tuple[str, ...]) -> Outcome:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = main(list(argv))
        except BaseException:  # a traceback: what the fuzzing looks for
            return Outcome(argv, None, err.getvalue(), traceback.format_exc())
        return Outcome(argv, status, err.getvalue(), None)

    def problem(self, path: Path, position: str = LINE_COL) -> str | None:
        """What is wrong, if anything, for a mutant whose mistakes are reported in `path` (a
        file, or any file in a directory), followed by `position`."""
        if self.exception is not None:
            return f"traceback:\n{self.exception}"
        if self.status not in (0, 1, 2):
            return f"exit status {self.status}"
        if self.status == 2:
            positioned = re.search(re.escape(str(path)) + position, self.stderr)
            if not positioned and not any(u in self.stderr for u in ALLOWED_USAGE):
                return f"exit 2 without saying where in {path}: {self.stderr.strip()[:300]}"
        return None


def fuzz(corpus: Corpus, kind: str, mutants: int, seed: int) -> tuple[int, list[str]]:
    """Run `mutants` mutants of each input of `kind`: (runs, problems found, each with the
    mutant's bytes)."""
    runs, problems = 0, []
    for source in corpus.of_kind(kind):
        original = source.path.read_bytes()
        rng = random.Random(f"{seed}:{source.path.name}")
        try:
            for _ in range(mutants):
                mutant = source.mutate(original, rng)
                source.path.write_bytes(mutant)
                for command in source.commands:
                    argv = tuple(a.replace("{}", str(source.path)) for a in command)
                    runs += 1
                    problem = Outcome.of(argv).problem(source.scope or source.path,
                                                       source.position)
                    if problem:
                        problems.append(f"{' '.join(argv)} on {mutant!r}: {problem}")
        finally:
            source.path.write_bytes(original)
    return runs, problems
