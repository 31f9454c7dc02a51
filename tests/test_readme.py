"""The README's two commands stay true: CI runs exactly its test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert block, "the README must open with a ```sh block holding its two commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_the_main_job_and_the_test_command():
    main, tests = _readme_commands()
    assert "bbrules apply examples/" in main
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in [line.strip() for line in ci]
