"""Mutation fuzzing of the CLI at scale: thousands of mutants of every example, rule file, a
fused block file, the A100 target, an array file of values and two ONNX models (the test suite
runs a few hundred: tests/test_fuzz.py).

    PYTHONPATH=. python benchmarks/fuzz_cli.py --mutants 200 --seed 1

prints, per kind of file, the mutants and command runs made, the time taken and every problem
found: a traceback, an exit status outside {0, 1, 2}, or an exit 2 that does not say where in
the file the mistake is.
Exits 1 if any was found.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fuzzing import Corpus, fuzz  # noqa: E402

KINDS = ("bbp", "bbr", "bbk", "toml", "npz", "onnx")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=200, help="mutants per input file")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kind", action="append", choices=KINDS,
                        help="fuzz only these kinds of file (repeatable; default all)")
    args = parser.parse_args()
    found = 0
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Corpus(Path(tmp))
        for kind in args.kind or KINDS:
            files = len(corpus.of_kind(kind))
            start = time.perf_counter()
            runs, problems = fuzz(corpus, kind, args.mutants, args.seed)
            print(f"{kind:5} {files * args.mutants:6} mutants of {files} file(s), {runs:6} runs, "
                  f"{time.perf_counter() - start:7.1f} s: {len(problems)} problems", flush=True)
            for p in problems:
                print(f"  {p}\n")
            found += len(problems)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
