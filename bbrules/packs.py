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

from collections import OrderedDict
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


# Packs loaded lately, by what they were loaded from: the directories, their names and every
# `.bbr` file's bytes.  Loading the standard pack parses and type-checks every rule (about half
# a second); a program fused again, an API caller fusing many programs, or the test suite's
# hundreds of fusions would each pay it.  The packs are shared, never to be changed.
_LOADED: OrderedDict[tuple, list[RulePack]] = OrderedDict()
_KEEP = 8


def load_each(directories: Mapping[Path, str]) -> list[RulePack]:
    """The pack of each directory, each loaded on top of the ones before it (shared with
    earlier calls on the same files: a pack is not to be changed)."""
    try:
        key = tuple((directory, name, tuple((p.name, p.read_bytes())
                                             for p in sorted(directory.glob("*.bbr"))))
                    for directory, name in directories.items())
    except OSError:  # (loading says which file cannot be read)
        return _load_each(directories)
    if key in _LOADED:
        _LOADED.move_to_end(key)
        return list(_LOADED[key])
    packs = _load_each(directories)
    _LOADED[key] = packs
    if len(_LOADED) > _KEEP:
        _LOADED.popitem(last=False)
    return list(packs)


def _load_each(directories: Mapping[Path, str]) -> list[RulePack]:
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
