"""The soundness gate: every fusing command refuses a pack with an unsound rule, naming the
rule and its counterexample; verdicts are cached by content; `check` and `apply` judge a rule
the same way whatever it is called."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bbrules import soundness
from bbrules.cli import main
from bbrules.soundness import CACHE_ENV, cache_dir

ROOT = Path(__file__).parent.parent
UNSOUND = ROOT / "tests" / "packs" / "unsound"
NEG_SUB = ROOT / "tests" / "packs" / "neg_sub"
PROGRAM = str(ROOT / "examples" / "softmax.bbp")
SMALL = ["--dim", "r=8/4", "--dim", "c=8/4"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _counted(monkeypatch) -> list[int]:
    """Count the soundness checks that actually run."""
    calls: list[int] = []
    real = soundness.check_soundness

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(soundness, "check_soundness", counting)
    return calls


@pytest.mark.parametrize("command", [
    ["apply"], ["run", "--backend", "numpy"], ["codegen", "--backend", "numpy"]])
def test_every_fusing_command_refuses_an_unsound_pack(command, cache, capsys):
    assert main([command[0], PROGRAM, *SMALL, *command[1:], "--rules", str(UNSOUND),
                 "--no-installed"]) == 2
    err = capsys.readouterr().err
    assert "2 unsound rules" in err
    for rule, line in (("sum_absorbs_term", 7), ("exp_of_sum", 10)):
        assert f"bad.bbr:{line}:6: error: rule {rule}: sides differ" in err
    assert err.count("; lhs = ") == 2 and err.count("; rhs = ") == 2  # the counterexamples


def test_apply_and_check_report_the_same_unsound_rules(cache, capsys):
    assert main(["check", str(UNSOUND)]) == 1
    checked = capsys.readouterr().out.splitlines()[:-1]
    assert main(["apply", PROGRAM, *SMALL, "--rules", str(UNSOUND)]) == 2
    refused = [line.strip() for line in capsys.readouterr().err.splitlines()[1:]]
    assert refused == [line.strip() for line in checked]


def test_the_verdict_is_cached_by_content(cache, tmp_path, monkeypatch, capsys):
    pack = tmp_path / "mine"
    shutil.copytree(NEG_SUB, pack)
    calls = _counted(monkeypatch)
    assert main(["apply", PROGRAM, *SMALL, "--rules", str(pack)]) == 0
    assert len(calls) == 2  # the standard pack, then ours on top of it
    assert cache_dir() == cache and len(list((cache / "soundness").iterdir())) == 2
    assert main(["apply", PROGRAM, *SMALL, "--rules", str(pack)]) == 0
    assert len(calls) == 2  # both verdicts came from the cache
    bbr = next(pack.glob("*.bbr"))
    bbr.write_text(bbr.read_text() + "\n# edited\n")
    assert main(["apply", PROGRAM, *SMALL, "--rules", str(pack)]) == 0
    assert len(calls) == 3  # only the edited pack is checked again


def test_a_cached_unsound_verdict_still_refuses(cache, monkeypatch, capsys):
    argv = ["apply", PROGRAM, *SMALL, "--rules", str(UNSOUND), "--no-installed"]
    assert main(argv) == 2
    first = capsys.readouterr().err
    calls = _counted(monkeypatch)
    assert main(argv) == 2
    assert capsys.readouterr().err == first and not calls


def test_an_unwritable_cache_costs_time_not_correctness(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # below a file: cannot be created
    assert main(["apply", PROGRAM, *SMALL, "--rules", str(UNSOUND), "--no-installed"]) == 2
    assert "2 unsound rules" in capsys.readouterr().err


def test_cache_dir_follows_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "bbrules"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "bbrules"


@pytest.mark.parametrize("name", ["a", "b", "c", "d", "e", "f", "g", "h", "times_one"])
def test_a_rule_is_judged_the_same_whatever_its_name(name, tmp_path, cache, capsys):
    """`?x => ?x * 1.0` is ill-formed when ?x is a tuple: rejected at load by every command
    (it used to pass or fail depending on the random seed its name gave)."""
    pack = tmp_path / "p"
    pack.mkdir()
    (pack / "r.bbr").write_text(f"rule {name}: ?x => ?x * 1.0\n")
    for argv in (["check", str(pack)], ["apply", PROGRAM, *SMALL, "--rules", str(pack)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"r.bbr:1:{len(name) + 11}: error: the right-hand side is ill-formed" in err
        assert "expected a tile, found a tuple" in err


def test_a_cached_verdict_names_the_pack_where_it_now_is(cache, tmp_path, capsys):
    """The verdict is cached by content, but its report names the files of the pack being
    used: a copy of an unsound pack elsewhere is reported at the copy, not at a directory
    that may no longer exist."""
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(UNSOUND, first)
    shutil.copytree(UNSOUND, second)
    for pack in (first, second):
        assert main(["apply", PROGRAM, *SMALL, "--rules", str(pack), "--no-installed"]) == 2
        err = capsys.readouterr().err
        assert f"{pack / 'bad.bbr'}:7:6: error: rule sum_absorbs_term" in err
        assert str(first if pack == second else second) not in err
    assert len(list((cache / "soundness").iterdir())) == 1  # one verdict for both
