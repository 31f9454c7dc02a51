"""Mutation fuzzing of the CLI's input files, shared by tests/test_fuzz.py and
benchmarks/fuzz_cli.py.

A mutant is a valid input file changed the way hostile or careless edits change files: a byte
flipped, bytes deleted, a line duplicated or deleted, a huge number or junk bytes inserted, the
file truncated.  `Corpus` writes the files (the examples at tiny sizes, the standard pack, a
block file written by `apply -o`, the A100 target) and `Outcome` runs one CLI command on a
mutant in-process and says what is wrong with how it ended, if anything: an exception escaping
`main` (a traceback), an exit status outside {0, 1, 2}, or an exit 2 for a mistake in the file
that does not print `path:line:col:`.
"""

from __future__ import annotations

import contextlib
import io
import random
import re
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


@dataclass(frozen=True)
class Input:
    """A valid file to mutate, and the CLI commands to run on a mutant (`{}` is its path)."""

    kind: str
    path: Path  # where the mutant is written; the original is its content now
    commands: tuple[tuple[str, ...], ...]
    scope: Path | None = None  # where its mistakes may be reported (default: `path`); a
    # mutant rule file may break the pack elsewhere (a stage naming its rulesets)


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

    def problem(self, path: Path) -> str | None:
        """What is wrong, if anything, for a mutant whose mistakes are reported in `path` (a
        file, or any file in a directory)."""
        if self.exception is not None:
            return f"traceback:\n{self.exception}"
        if self.status not in (0, 1, 2):
            return f"exit status {self.status}"
        if self.status == 2:
            positioned = re.search(rf"{re.escape(str(path))}[^:\n]*:\d+:\d+: error: ",
                                   self.stderr)
            if not positioned and not any(u in self.stderr for u in ALLOWED_USAGE):
                return f"exit 2 without {path}:line:col: {self.stderr.strip()[:300]}"
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
                mutant = mutate(original, rng)
                source.path.write_bytes(mutant)
                for command in source.commands:
                    argv = tuple(a.replace("{}", str(source.path)) for a in command)
                    runs += 1
                    problem = Outcome.of(argv).problem(source.scope or source.path)
                    if problem:
                        problems.append(f"{' '.join(argv)} on {mutant!r}: {problem}")
        finally:
            source.path.write_bytes(original)
    return runs, problems
