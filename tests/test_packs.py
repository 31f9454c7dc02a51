"""Rule packs: the standard pack, installed third-party packs, extra directories."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bbrules.rules
from bbrules.errors import SourceError, UsageError
from bbrules.packs import discover_packs, load_packs, standard_pack_dir

PACKS = Path(__file__).parent / "packs"


def test_standard_pack_is_the_installed_rules_package() -> None:
    directory = standard_pack_dir()
    assert directory == Path(bbrules.rules.__file__).parent
    assert discover_packs()["standard"] == directory


def _install_demo_pack(tmp_path: Path) -> Path:
    """pip-install the demo pack into a private directory (not the shared environment, which
    other test runs may be reading) and return that directory."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not available in this environment")
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("installing without build isolation needs setuptools in this environment")
    source = tmp_path / "demo_pack"
    shutil.copytree(PACKS / "demo_pack", source)  # building writes into the source tree
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--target", str(target), str(source)],
        capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return target


def test_installed_pack_is_discovered_and_loads(tmp_path: Path, monkeypatch) -> None:
    site = _install_demo_pack(tmp_path)
    assert "demo" not in discover_packs()
    monkeypatch.syspath_prepend(str(site))
    packs = discover_packs()
    assert packs["demo"] == site / "bbrules_demo_pack"
    assert list(packs)[0] == "standard"
    assert list(packs).count("standard") == 1  # bbrules' own entry point is not listed twice
    pack = load_packs([], include_installed=True)
    demo = [r for r in pack.rules if r.ruleset == "demo"]
    assert [r.name for r in demo] == ["demo_double", "demo_sqrt_square"]
    assert demo[0].doc == "Doubling is adding a value to itself."
    assert [c.rule for c in pack.checks if c.rule.startswith("demo_")] == \
        ["demo_double", "demo_sqrt_square", "demo_sqrt_square"]


def test_extra_directories_load_on_top_of_each_other(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "m.bbr").write_text("monoid prod_packs_test(p)\n  identity = (1.0)\n"
                                "  combine = (a.p * b.p)\n  finalize = (p)\nruleset base\n"
                                "rule b: ?x => ?x\n")
    later = tmp_path / "later"
    later.mkdir()
    (later / "l.bbr").write_text("rule l: reduce(?a, prod_packs_test, ?x) => "
                                 "reduce(?a, prod_packs_test, ?x)\nstage s: base\n")
    pack = load_packs([base, later, base], include_installed=False)
    assert [r.name for r in pack.rules] == ["b", "l"]
    assert [m.name for m in pack.monoids] == ["prod_packs_test"]
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    with pytest.raises(SourceError, match="rule 'b' is declared twice"):
        load_packs([base, copy], include_installed=False)


def test_bad_extra_directories_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a rule pack directory"):
        load_packs([tmp_path / "missing"], include_installed=False)
    with pytest.raises(UsageError, match="no .bbr files"):
        load_packs([tmp_path], include_installed=False)


def test_a_pack_loaded_again_is_shared_until_a_file_of_it_changes(tmp_path: Path) -> None:
    """Loading parses and checks every rule; the same files load once, and any change to
    them (a rule edited, a file added) loads them again."""
    pack = tmp_path / "p"
    pack.mkdir()
    (pack / "a.bbr").write_text("ruleset mine\nrule r1: ?x + 0.0 => ?x\n")
    first = load_packs([pack], include_installed=False)
    assert load_packs([pack], include_installed=False).rules[0] is first.rules[0]
    (pack / "a.bbr").write_text("ruleset mine\nrule r2: ?x * 1.0 => ?x\n")
    assert [r.name for r in load_packs([pack], include_installed=False).rules] == ["r2"]
    (pack / "b.bbr").write_text("ruleset mine\nrule r3: ?x - 0.0 => ?x\n")
    assert [r.name for r in load_packs([pack], include_installed=False).rules] == ["r2", "r3"]
    (pack / "b.bbr").write_bytes(b"rule r4: \xff => ?x\n")
    with pytest.raises(SourceError, match="not UTF-8"):
        load_packs([pack], include_installed=False)
