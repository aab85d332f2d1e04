"""The continuous loop on a real Valkey without Celery: requests join and leave between
steps, and a cancelled request leaves at the next step, freeing its slot."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from control.broker import keys
from control.core.clock import BrokerClock
from control.fleet.valkey import EmbeddedBroker
from tasks.engine.fixed import FixedLatencyEngine
from tasks.policy.collector import CollectorConfig
from tasks.replica.config import ReplicaConfig
from tasks.replica.replica import Replica
from tests.support.deploy import MODEL
from tests.support.jobs import admitted_job
from tests.support.replies import take_items
from tests.support.waiting import until


@pytest.fixture
def state() -> Iterator[redis.Redis]:
    with EmbeddedBroker() as broker:
        yield redis.Redis.from_url(broker.url)


def _replica(state: redis.Redis, max_batch: int, batch_ms: float) -> tuple[Replica, BrokerClock]:
    engine = FixedLatencyEngine(max_batch=max_batch, batch_ms=batch_ms, continuous=True)
    clock = BrokerClock(state)
    config = CollectorConfig(max_batch=max_batch, max_wait_ms=0.0, batch_ms=batch_ms)
    replica = Replica(ReplicaConfig("r-cont", MODEL, config, lease_ms=1000.0), engine, state, clock)
    replica.start()
    return replica, clock


def _collect(state: redis.Redis, items: dict[str, dict]) -> int:
    for item in take_items(state):
        items[item["id"]] = item
    time.sleep(0.01)
    return len(items)


def test_a_request_joins_as_soon_as_a_slot_frees_not_when_the_batch_ends(state: redis.Redis) -> None:
    replica, clock = _replica(state, max_batch=2, batch_ms=300.0)
    items: dict[str, dict] = {}
    try:
        replica.submit(admitted_job(state, 0, clock.now_ms()))
        time.sleep(0.15)  # a0 is half way through when a1 and a2 arrive
        now = clock.now_ms()
        replica.submit(admitted_job(state, 1, now))
        replica.submit(admitted_job(state, 2, now))
        assert until(lambda: _collect(state, items) >= 3, 5)
    finally:
        replica.stop()
    assert {item["kind"] for item in items.values()} == {"result"}
    # a1 joined the running a0 at once; a2 took a0's slot when a0 finished, before a1 did.
    assert items["a1"]["batch_start_ms"] < items["a0"]["batch_end_ms"]
    assert items["a0"]["batch_end_ms"] <= items["a2"]["batch_start_ms"] < items["a1"]["batch_end_ms"]


def test_a_cancelled_running_request_frees_its_slot_within_a_step(state: redis.Redis) -> None:
    replica, clock = _replica(state, max_batch=1, batch_ms=2_000.0)
    items: dict[str, dict] = {}
    try:
        replica.submit(admitted_job(state, 0, clock.now_ms()))
        assert until(lambda: replica.engine.has_unfinished(), 5)
        replica.submit(admitted_job(state, 1, clock.now_ms()))
        cancelled_at = clock.now_ms()
        state.set(keys.cancel_key("a0"), "cancelled", px=10_000)
        assert until(lambda: _collect(state, items) >= 2, 5)
    finally:
        replica.stop()
    assert items["a0"]["kind"] == "dropped" and items["a0"]["reason"] == "cancelled"
    assert items["a1"]["kind"] == "result"
    step_ms = FixedLatencyEngine.STEP_MS
    assert items["a1"]["batch_start_ms"] - cancelled_at < 3 * step_ms  # the next step, not 2 s later
