"""A whole keybatch for a test (broker, replicas, gateway), over the deployment harness,
and what tests read of it: an HTTP client with the test keys, metrics, held requests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import psutil
import redis
import requests

from control.bench.harness import in_process
from control.broker import keys
from control.core.procs import free_port
from control.core.vocab import Backend, Policy
from control.fleet.up import Plan, System

Collector = Literal["native", "chord"]

PAID_KEY, FREE_KEY = "test-paid", "test-free"
MODEL = "kb-small"


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

    def metric_becomes(self, name: str, want: float, timeout_s: float = 2.0, **labels: str) -> float:
        """Poll /metrics until the series reads `want` (a replica reports a drop when it next
        forms a batch) or `timeout_s` passes; what it read last."""
        deadline = time.monotonic() + timeout_s
        while (seen := self.metric(name, **labels)) != want and time.monotonic() <= deadline:
            time.sleep(0.05)
        return seen


@contextmanager
def deployment(
    workers: int = 2,
    backend: Backend = "fixed",
    policy: Policy = "static",
    model: str = MODEL,
    models: tuple[str, ...] = (),
    collector: Collector | None = None,
    replicas_per_host: int = 0,
    **env: str,
) -> Iterator[Deployment]:
    """Start a whole keybatch (broker, replicas, gateway) with the given KEYBATCH_ settings;
    `models` (default: `model` alone) get the workers round robin; `collector` is
    KEYBATCH_COLLECTOR (chord: docs/decisions/0001; None: the environment's, or native);
    `replicas_per_host` groups the replicas into simulated hosts (`keybatch up`)."""
    if collector is not None:
        env = {**env, "collector": collector}
    plan = Plan(
        workers=workers,
        backend=backend,
        policy=policy,
        models=list(models or (model,)),
        port=free_port(),
        quiet=not os.environ.get("KEYBATCH_TEST_VERBOSE"),
        replicas_per_host=replicas_per_host,
    )
    with in_process(plan, {PAID_KEY: "paid", FREE_KEY: "free"}, env) as system:
        d = Deployment(system, system.url)
        # Readiness is not warmth: the first batches after a start run slow
        # (first connections, first imports); one request per replica first.
        for _ in range(workers):
            d.post()
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


def stop_after_its_pull(kb: Deployment, victim: subprocess.Popen[bytes]) -> None:
    """SIGSTOP an idle replica right after it sent a pull (BRPOP), seen with MONITOR by the
    port of one of its own connections: that pull is then out for its whole wait. Stopped
    at any other moment it may be between two pulls, or its last one may have timed out
    before the next arrival. An idle replica pulls while it holds the listener token, or
    always with SINGLE_LISTENER=false."""
    ports = {str(c.laddr.port) for c in psutil.Process(victim.pid).net_connections(kind="tcp") if c.laddr}
    state = redis.Redis.from_url(kb.system.redis_url, socket_timeout=5)
    give_up = time.monotonic() + 10  # no pull of its seen: fail, not hang
    with state.monitor() as monitor:
        for command in monitor.listen():
            if str(command["command"]).upper().startswith("BRPOP") and command["client_port"] in ports:
                victim.send_signal(signal.SIGSTOP)
                return
            assert time.monotonic() < give_up, "the replica sent no pull"
