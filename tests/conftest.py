"""Fixtures only: the session's deployment. The helpers are in tests/support."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.deploy import Deployment, deployment


@pytest.fixture(scope="session")
def kb() -> Iterator[Deployment]:
    with deployment() as d:
        yield d
