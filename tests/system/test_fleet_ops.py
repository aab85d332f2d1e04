"""Operator actions on a real deployment (Valkey, three replica processes of two models,
the gateway): drain under load loses nothing, resume serves again, move switches the
model and serves the other queue; `keybatch fleet --json` shows the fleet."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests

from control.broker import keys
from control.broker.traffic import TierTraffic
from control.core.clock import SystemClock
from control.core.lifecycle import ReplicaState
from control.core.settings import Settings
from control.fleet.operator import ActionResult, Operator, OperatorError
from control.policy.rebalance import RebalanceConfig, RebalancePolicy
from tests.support import ROOT
from tests.support.deploy import PAID_KEY, Deployment, deployment
from tests.support.waiting import until

SMALL, LARGE = "kb-small", "kb-large"


@pytest.fixture(scope="module")
def two_models() -> Iterator[Deployment]:
    # Round robin: kb-small-1, kb-large-2, kb-small-3.
    with deployment(workers=3, models=(SMALL, LARGE), BATCH_MS="100", MAX_BATCH="8") as d:
        for _ in range(3):
            d.post({"model": LARGE, "prompt": "warm"})
        yield d


def operator(d: Deployment) -> Operator:
    return Operator(Settings(redis_url=d.system.redis_url, models={SMALL: SMALL, LARGE: LARGE}))


def name(d: Deployment, prefix: str) -> str:
    return next(r.name for r in operator(d).snapshot().replicas if r.name.startswith(prefix))


def state(op: Operator, replica: str) -> tuple[ReplicaState | None, str]:
    info = op.resolve(replica)
    return info.state, info.model


def replicas_serving(d: Deployment, model: str, n: int) -> Counter[str]:
    """Which replicas answered `n` concurrent requests for `model` (all must be 200)."""
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: d.post({"model": model, "prompt": f"p{i}"}, key=PAID_KEY), range(n)))
    assert [a.status_code for a in answers] == [200] * n, [a.text for a in answers if a.status_code != 200]
    return Counter(a.json()["keybatch"]["replica"] for a in answers)


def test_fleet_json_lists_every_replica(two_models: Deployment) -> None:
    env = {**os.environ, "KEYBATCH_REDIS_URL": str(two_models.system.redis_url)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "control", "fleet", "--json"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    fleet = json.loads(done.stdout)
    replicas = fleet["replicas"]
    assert sorted(r["model"] for r in replicas) == [LARGE, SMALL, SMALL]
    shown = {"id", "host", "pid", "model", "state", "held", "batch_fill", "utilization", "heartbeat_age_ms"}
    for r in replicas:
        assert shown <= set(r)
        assert r["state"] == "serving" and r["ready"] is True
        assert r["pid"] in [w.pid for w in two_models.system.workers]
        assert 0 <= r["heartbeat_age_ms"] < 3_000
    small_free = next(t for t in fleet["traffic"] if t["model"] == SMALL and t["tier"] == "free")
    assert set(small_free) >= {"num_queued", "oldest_ms", "arrival_rate", "completion_rate", "p50_ms", "p99_ms"}
    assert took < 10  # generous on 2 shared cores; the command itself is one Redis round trip or two
    print(f"keybatch fleet --json took {took:.2f} s")
    rebalance = subprocess.run(
        [sys.executable, "-m", "control", "rebalance", "--json"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert rebalance.returncode == 0, rebalance.stderr
    decisions = [json.loads(line) for line in rebalance.stdout.splitlines()]
    assert decisions and all(d["reason"] and not d["replica"] for d in decisions)  # idle: nothing to move
    live = operator(two_models).live()  # each replica answers over remote control too
    assert {n: a["state"] for n, a in live.items()} == {r["id"]: "serving" for r in replicas}
    assert {n: a["pid"] for n, a in live.items()} == {r["id"]: r["pid"] for r in replicas}


def test_drain_under_load_fails_nothing_then_resume_serves_again(two_models: Deployment) -> None:
    op = operator(two_models)
    target = name(two_models, "kb-small-1")
    with steady_load(two_models, {"model": SMALL, "prompt": "load"}) as codes:
        assert until(lambda: op.resolve(target).num_held > 0, 10)  # it holds work as the drain begins
        started = time.monotonic()
        result = op.drain(target)
        assert time.monotonic() - started < 2.0
        assert result.ok and result.state == "draining", result
        assert until(lambda: state(op, target)[0] == ReplicaState.DRAINED, 10)  # the load goes on meanwhile
    assert set(codes) == {200}, codes  # nothing failed, before, during or after the drain
    info = op.resolve(target)
    assert info.num_held == 0 and not info.is_ready
    assert until(lambda: two_models.system.redis_url is not None and not _held(op, target), 2)
    served_by = replicas_serving(two_models, SMALL, 16)
    assert target not in served_by  # the other replica took it all

    assert op.resume(target).state == "serving"
    assert until(lambda: target in replicas_serving(two_models, SMALL, 16), 10)
    # The deployment-wide traffic saw it (whole seconds only): arrivals, completions and
    # latency per tier, the paid requests of the last few seconds among them.
    assert until(lambda: _traffic(op, SMALL, "paid").completion_rate > 0, 3)
    free, paid = _traffic(op, SMALL, "free"), _traffic(op, SMALL, "paid")
    assert free.arrival_rate > 0 and free.completion_rate > 0 and paid.arrival_rate > 0
    assert free.p50_ms is not None and paid.p99_ms is not None and 100 <= paid.p99_ms <= 5_000


def _traffic(op: Operator, model: str, tier: str) -> TierTraffic:
    return next(t for t in op.snapshot().traffic if (t.model, t.tier) == (model, tier))


def test_the_last_serving_replica_of_a_model_is_not_drained_without_force(two_models: Deployment) -> None:
    op = operator(two_models)
    with pytest.raises(OperatorError, match="last serving replica of kb-large"):
        op.drain(name(two_models, "kb-large-2"))
    with pytest.raises(OperatorError, match="no replica named"):
        op.drain("nobody")


def test_rebalance_moves_a_replica_to_the_busy_model_which_then_serves_its_queue(two_models: Deployment) -> None:
    op = operator(two_models)
    mover, large = name(two_models, "kb-small-3"), name(two_models, "kb-large-2")
    # Paid kb-large traffic, none for kb-small: with a large paid headroom, kb-large wants
    # more replicas than it has and kb-small can spare one.
    policy = RebalancePolicy(RebalanceConfig(paid_headroom=50.0, hold_ms=0.0, cooldown_ms=0.0), SystemClock())
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(_paid_load, two_models, LARGE, stop)
        try:
            made: list[ActionResult] = []
            assert until(lambda: made.extend(op.rebalance_once(policy, window_s=2)[1]) or made, 15)
        finally:
            stop.set()
        assert load.result() > 0
    assert [(r.replica, r.ok) for r in made] == [(mover, True)]
    assert until(lambda: state(op, mover) == (ReplicaState.SERVING, LARGE), 15)
    # Both kb-large replicas answer kb-large's queue now; kb-small is served by its other one.
    assert until(lambda: set(replicas_serving(two_models, LARGE, 24)) == {mover, large}, 10)
    assert set(replicas_serving(two_models, SMALL, 8)) == {name(two_models, "kb-small-1")}
    ready = requests.get(f"{two_models.url}/readyz", timeout=5).json()
    assert ready == {"status": "ready", "replicas": {SMALL: 1, LARGE: 2}}  # no host, pid or process id


def test_a_moved_replica_restarted_by_the_supervisor_serves_what_it_was_moved_to(two_models: Deployment) -> None:
    op = operator(two_models)
    mover = name(two_models, "kb-small-3")
    assert state(op, mover)[1] == LARGE
    system = two_models.system
    index = next(c.index for c in system.children if c.name == mover)
    old_pid = system.workers[index].pid
    system.workers[index].send_signal(signal.SIGKILL)
    assert until(lambda: system.heal() or op.resolve(mover).pid not in (0, old_pid), 30)
    assert state(op, mover) == (ReplicaState.SERVING, LARGE)
    # It registers as its consumer starts, and listens for commands a moment later.
    assert until(lambda: mover in op.live(), 10)
    # And moved back by hand.
    result = op.move(mover, SMALL, wait_s=15)
    assert result.ok and (result.state, result.model) == ("serving", SMALL), result
    assert until(lambda: mover in replicas_serving(two_models, SMALL, 24), 10)


def _paid_load(d: Deployment, model: str, stop: threading.Event) -> int:
    sent = 0
    while not stop.is_set():
        assert d.post({"model": model, "prompt": f"busy {sent}"}, key=PAID_KEY).status_code == 200
        sent += 1
    return sent


@contextmanager
def steady_load(d: Deployment, body: dict, num_clients: int = 16) -> Iterator[Counter[int]]:
    """Clients posting `body` back to back until the block ends; the status codes they got."""
    codes: Counter[int] = Counter()
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            codes[d.post(body).status_code] += 1

    with ThreadPoolExecutor(num_clients) as pool:
        clients = [pool.submit(client) for _ in range(num_clients)]
        try:
            yield codes
        finally:
            stop.set()
            for c in clients:
                c.result()


def _held(op: Operator, replica: str) -> int:
    return int(op.redis.hlen(keys.held_key(replica)))


def test_drain_on_the_continuous_engine_finishes_the_running_requests() -> None:
    with deployment(workers=2, policy="continuous", BATCH_MS="100", MAX_BATCH="8") as d:
        op = operator(d)
        target = name(d, "kb-small-1")
        with steady_load(d, {"model": SMALL, "prompt": "load", "max_tokens": 8}) as codes:
            assert until(lambda: op.resolve(target).num_held > 0, 10)  # it holds work as the drain begins
            assert op.drain(target).state == "draining"
            assert until(lambda: state(op, target)[0] == ReplicaState.DRAINED, 10)
        assert set(codes) == {200}, codes  # nothing failed, before, during or after the drain
        assert target not in replicas_serving(d, SMALL, 16)
        assert op.resume(target).state == "serving"
