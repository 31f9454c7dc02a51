"""Rule packs: directories of `.bbr` files, installed with bbrules or by third parties.

The standard pack is the `bbrules.rules` package.  Any installed distribution can add a pack by
declaring an entry point in the `bbrules.rulepacks` group whose value is a module or package:
the directory holding it holds the pack's `.bbr` files.  Discovery reads installed metadata
only, so a pack costs nothing until it is loaded.

Packs load in order (standard, then installed ones by name, then extra directories), each on
top of the ones before it: a later pack may use an earlier pack's monoids, name its rulesets in
its stages, add its own rulesets to an earlier pack's stage (`stage fuse += mine`) and name its
rules in its checks, and may not redefine its rules or stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import reduce
from importlib.metadata import entry_points
from importlib.resources import files
from pathlib import Path

from .errors import UsageError
from .rule import RulePack
from .rulefile import load_pack

GROUP = "bbrules.rulepacks"
STANDARD = "standard"


def _package_dir(module: str) -> Path:
    """The directory of an installed module or package (of the package, for a package)."""
    try:
        return Path(str(files(module)))
    except ModuleNotFoundError:
        raise UsageError(f"rule pack module '{module}' is not installed") from None


def standard_pack_dir() -> Path:
    """The installed standard pack (`bbrules.rules`)."""
    return _package_dir("bbrules.rules")


def discover_packs() -> dict[str, Path]:
    """Every installed pack by name: the standard pack first, then entry points by name.

    bbrules declares its own standard pack as an entry point too; it is listed once.
    """
    packs = {STANDARD: standard_pack_dir()}
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        directory = _package_dir(ep.module)
        if directory not in packs.values():
            packs[ep.name] = directory
    return packs


def pack_directories(extra_dirs: list[Path], include_installed: bool = True) -> dict[Path, str]:
    """The directories to load, in order, with the name of each pack: the installed packs
    (unless `include_installed` is false), then `extra_dirs` (each directory once)."""
    named: dict[Path, str] = {}
    if include_installed:
        named = {d.resolve(): name for name, d in discover_packs().items()}
    for d in map(Path, extra_dirs):
        if not d.is_dir():
            raise UsageError(f"{d}: not a rule pack directory")
        if not any(d.glob("*.bbr")):
            raise UsageError(f"{d}: no .bbr files in this rule pack directory")
        named.setdefault(d.resolve(), d.name)
    return named


def load_each(directories: Mapping[Path, str]) -> list[RulePack]:
    """The pack of each directory, each loaded on top of the ones before it."""
    packs: list[RulePack] = []
    merged: RulePack | None = None
    for directory, name in directories.items():
        pack = load_pack(directory, base=merged, name=name)
        packs.append(pack)
        merged = pack if merged is None else merged.merge(pack)
    return packs


def merge_all(packs: list[RulePack]) -> RulePack:
    """Packs loaded by `load_each`, as one pack."""
    return reduce(RulePack.merge, packs) if packs else RulePack("none")


def load_packs(extra_dirs: list[Path], include_installed: bool = True) -> RulePack:
    """The installed packs (unless `include_installed` is false) and `extra_dirs`, as one pack."""
    return merge_all(load_each(pack_directories(extra_dirs, include_installed)))
