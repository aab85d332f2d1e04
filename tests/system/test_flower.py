"""Flower on the same broker: requests show as tasks with their replica and runtime; on
loopback it answers only with a generated password, off loopback it will not start
without credentials."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator

import pytest
import requests

from control.core.procs import free_port
from control.core.settings import Settings
from tests.support.deploy import Deployment, deployment
from tests.support.waiting import until


@pytest.fixture(scope="module")
def fleet() -> Iterator[Deployment]:
    with deployment(workers=2) as d:
        yield d


def test_flower_lists_the_replicas_and_each_request_as_a_task(fleet: Deployment) -> None:
    port = free_port()
    # No broker URL given: Flower acts with the operator's credentials that `up` left for
    # the deployment on this gateway port, and guards itself with a generated password.
    env = {k: v for k, v in os.environ.items() if k not in ("KEYBATCH_REDIS_URL", "FLOWER_BASIC_AUTH")}
    gateway_port = fleet.url.rsplit(":", 1)[1]
    flower = subprocess.Popen(
        [sys.executable, "-m", "control", "flower", "--flower-port", str(port), "--port", gateway_port],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    secret = Settings().secrets_dir / f"flower-{port}.auth"
    try:
        assert until(secret.exists, 30)
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        user, _, password = secret.read_text().strip().partition(":")

        def status(auth: tuple[str, str] | None) -> int:
            try:
                return requests.get(f"{base}/api/workers", auth=auth, timeout=5).status_code
            except requests.RequestException:
                return 0

        assert until(lambda: status(None) != 0, 30)
        assert status(None) == 401 and status((user, "guess")) == 401

        def workers() -> dict:
            try:
                params = {"refresh": "true"}
                return requests.get(f"{base}/api/workers", params=params, auth=(user, password), timeout=5).json()
            except (requests.RequestException, ValueError):
                return {}

        assert until(lambda: len(workers()) == 2, 30), workers()
        ids = []
        for i in range(4):
            answer = fleet.post({"model": "kb-small", "prompt": f"def flower_{i}():\n"})
            assert answer.status_code == 200
            ids.append(answer.headers["X-Request-Id"])

        def tasks() -> dict:
            try:
                return requests.get(f"{base}/api/tasks", auth=(user, password), timeout=5).json()
            except (requests.RequestException, ValueError):
                return {}

        def succeeded() -> list[dict]:
            return [t for t in tasks().values() if t.get("state") == "SUCCESS" and t.get("runtime")]

        assert until(lambda: len(succeeded()) >= 4, 20), tasks()
        seen = succeeded()
        assert {t["name"] for t in seen} == {"keybatch.complete"}
        assert {t["worker"] for t in seen} <= set(workers())
    finally:
        flower.terminate()
        flower.wait(10)
        secret.unlink(missing_ok=True)


def test_flower_off_loopback_needs_credentials() -> None:
    env = {**os.environ, "KEYBATCH_REDIS_URL": "redis://127.0.0.1:1/0"}
    env.pop("FLOWER_BASIC_AUTH", None)
    refused = subprocess.run(
        [sys.executable, "-m", "control", "flower", "--address", "0.0.0.0", "--flower-port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2
    assert "without credentials" in refused.stderr
