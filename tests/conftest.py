"""Suite-wide settings: soundness verdicts are cached in a directory of the test session, never
in the user's cache."""

from __future__ import annotations

import pytest

from bbrules.soundness import CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def _soundness_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("bbrules-cache")))
        yield
