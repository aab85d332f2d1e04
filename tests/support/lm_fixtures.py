"""Fixtures for tests that need a real model: import them by name
(`from tests.support.lm_fixtures import quick_model`)."""

from __future__ import annotations

from pathlib import Path

import pytest

QUICK_STEPS = 5
QUICK_SEED = 0
_built: dict[str, Path] = {}  # a fixture imported into two test modules is two fixtures: build once for both


@pytest.fixture(scope="session")
def quick_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `kb-small` built with QUICK_STEPS training steps into a temporary models folder,
    once per test run (a few seconds): real files and shapes, barely trained weights."""
    if "kb-small" not in _built:
        from tasks.lm.train.build import build

        models_dir = tmp_path_factory.mktemp("models")
        _built["kb-small"] = build(models_dir, "kb-small", steps=QUICK_STEPS, seed=QUICK_SEED, progress=False)
    return _built["kb-small"]
