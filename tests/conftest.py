"""Suite-wide settings: soundness verdicts are cached in a directory of the test session, never
in the user's cache; the numpy backend runs numpy code alone unless a test asks for native
groups (the suite checks that code, often bit for bit; tests/test_native.py checks the C);
and fixtures that several test files use."""

from __future__ import annotations

import pytest

from bbrules.codegen import numpy_plan
from bbrules.soundness import CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def _soundness_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("bbrules-cache")))
        mp.setenv("BBRULES_NATIVE", "0")
        yield


@pytest.fixture
def split_small(monkeypatch):
    """Let kernels of any work split, so small programs exercise the numpy backend's parts:
    parts cost nothing to start, and each numpy call of a part has work enough."""
    monkeypatch.setattr(numpy_plan, "PARTS_START_NS", -float("inf"))
    monkeypatch.setattr(numpy_plan, "MIN_CALL_FLOPS", 1)


@pytest.fixture
def walked_folds(monkeypatch):
    """Folds walked in their blocks whatever their tiles, as attention over long sequences is,
    not in one block of the whole axis where the tiles are small (`WHOLE_FOLD_TILE`)."""
    monkeypatch.setattr(numpy_plan, "WHOLE_FOLD_TILE", 0)
