"""Mutation fuzzing (bounded, seeded): no mutant of a valid input file makes the CLI raise,
exit outside {0, 1, 2}, or exit 2 for a mistake in the file without `path:line:col:`.

A few hundred mutants per run; `benchmarks/fuzz_cli.py` runs thousands.  The seed is fixed,
so a failure reproduces; `BBRULES_FUZZ_SEED` picks other mutants.
"""

from __future__ import annotations

import os

import pytest

from fuzzing import Corpus, Outcome, fuzz

SEED = int(os.environ.get("BBRULES_FUZZ_SEED", "0"))
# Mutants per input file, by kind: each example, each rule file, 1 block file, 1 target, 1 array
# file of values, 2 ONNX models.  A rule
# file's mutant costs an `apply` with the soundness check of a changed pack (about 2.5 s).
MUTANTS = {"bbp": 30, "bbr": 3, "bbk": 80, "toml": 60, "npz": 200, "onnx": 60}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    return Corpus(tmp_path_factory.mktemp("fuzz"))


def test_every_command_succeeds_on_the_unmutated_inputs(corpus):
    """Otherwise the mutants would test nothing but the first error."""
    for source in corpus.inputs:
        for command in source.commands:
            outcome = Outcome.of(tuple(a.replace("{}", str(source.path)) for a in command))
            assert outcome.status == 0, (outcome.argv, outcome.stderr, outcome.exception)


@pytest.mark.parametrize("kind", sorted(MUTANTS))
def test_mutants_end_without_a_traceback_and_with_a_position(corpus, kind):
    runs, problems = fuzz(corpus, kind, MUTANTS[kind], SEED)
    assert runs >= MUTANTS[kind]
    assert not problems, f"{len(problems)} of {runs} runs:\n" + "\n\n".join(problems[:5])
