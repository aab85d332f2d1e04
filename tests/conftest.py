"""Real parts: an embedded Valkey, real replica processes and the real gateway over HTTP."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import pytest
import redis
import requests

from control.broker import keys
from control.core.procs import free_port
from control.core.settings import Settings
from control.fleet.up import Plan, System

PAID_KEY, FREE_KEY = "test-paid", "test-free"
MODEL = "kb-small"


def until(check: Callable[[], object], timeout_s: float = 10.0, every_s: float = 0.05) -> bool:
    """Poll `check` until it is true or `timeout_s` has passed: a state, not a sleep."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return False


def alive(pids: list[int]) -> list[int]:
    """The processes among `pids` still running (a zombie is not)."""
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def drop_kept_logs(stderr: str) -> list[str]:
    """Delete the logs a failed chaos or ops run kept (it names them on stderr, never in
    its JSON); their paths."""
    paths = [path for line in stderr.splitlines() if line.startswith("logs kept: ") for path in line[11:].split(", ")]
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)
    return paths


@dataclass
class Deployment:
    system: System
    url: str

    def post(self, body: dict | None = None, key: str | None = FREE_KEY, **headers: str) -> requests.Response:
        if key:
            headers["Authorization"] = f"Bearer {key}"
        body = body if body is not None else {"model": MODEL, "prompt": "def add(a, b):\n    "}
        return requests.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        text = requests.get(f"{self.url}/metrics", timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                inner = series[len(name) :].strip("{}")
                if ",".join(sorted(inner.split(","))) == want or (not want and not inner):
                    return float(value)
        return 0.0


@contextmanager
def deployment(
    workers: int = 2,
    backend: str = "fixed",
    policy: str = "static",
    model: str = MODEL,
    models: tuple[str, ...] = (),
    **env: str,
) -> Iterator[Deployment]:
    """Start a whole keybatch (broker, replicas, gateway) with the given KEYBATCH_ settings;
    `models` (default: `model` alone) get the workers round robin."""
    saved = dict(os.environ)
    os.environ["KEYBATCH_API_KEYS"] = json.dumps({PAID_KEY: "paid", FREE_KEY: "free"})
    os.environ.pop("KEYBATCH_REDIS_URL", None)
    for key, value in env.items():
        os.environ[f"KEYBATCH_{key.upper()}"] = value
    try:
        served = list(models or (model,))
        plan = Plan(
            workers=workers,
            backend=backend,
            policy=policy,
            models=served,
            port=free_port(),
            quiet=not os.environ.get("KEYBATCH_TEST_VERBOSE"),
        )
        system = System(Settings(), plan)
        system.start()
        try:
            d = Deployment(system, system.url)
            # Readiness is not warmth: the first batches after a start run slow
            # (first connections, first imports); one request per replica first.
            for _ in range(workers):
                d.post()
            yield d
        finally:
            system.stop()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def kb() -> Iterator[Deployment]:
    with deployment() as d:
        yield d


def held_counts(kb: Deployment) -> dict[str, int]:
    """Requests each replica holds now, by held-hash key."""
    state = redis.Redis.from_url(kb.system.redis_url)
    return {k.decode(): state.hlen(k) for k in state.keys(keys.held_key("*"))}


def replica_for(kb: Deployment, pid: int) -> str:
    """The registered name of the replica process `pid`."""
    state = redis.Redis.from_url(kb.system.redis_url)
    for name in state.smembers(keys.REPLICAS_KEY):
        if state.hget(keys.replica_key(name.decode()), "pid") == str(pid).encode():
            return name.decode()
    raise AssertionError(f"no replica with pid {pid}")
