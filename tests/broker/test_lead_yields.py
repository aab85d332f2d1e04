"""LEAD_YIELDS on a real Valkey, one replica and no Celery: a busy replica's listener
thread reads the model's listener token in its lead, and its pull gate follows."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from control.broker import keys
from control.broker.envelope import TaskMessages
from control.core import protocol as p
from control.core.clock import BrokerClock
from control.core.settings import Settings
from control.fleet.valkey import EmbeddedBroker
from tasks.celery.app import make_celery
from tasks.engine.fixed import FixedLatencyEngine
from tasks.policy.collector import CollectorConfig
from tasks.replica.config import ReplicaConfig
from tasks.replica.replica import Replica
from tests.support.deploy import MODEL
from tests.support.waiting import until


@pytest.fixture
def state() -> Iterator[redis.Redis]:
    with EmbeddedBroker() as broker:
        yield redis.Redis.from_url(broker.url)


def _admit(state: redis.Redis, messages: TaskMessages, now_ms: float) -> p.Job:
    """As admission leaves it: an owner that keeps the queue message."""
    job = p.Job(id="a1", key="t:r1", model=MODEL, prompt="x1", gateway="gw", received_ms=now_ms,
                deadline_ms=now_ms + 8_000, tier="free")  # fmt: skip
    waiting = keys.waiting_key(MODEL, "free")
    state.set(keys.owner_key(job.key), f"gw|{waiting}|t|{job.id}||{messages(job)}", px=20_000)
    return job


def test_a_busy_replica_reads_in_its_lead_whether_an_idle_replica_listens(state: redis.Redis) -> None:
    """LEAD_YIELDS: a busy replica's listener thread reads the model's listener token from
    its lead on (every 40 ms). While another replica holds it, the replica does not pull in
    its lead (its gate says so); once the token is gone, it may, and its consumer is woken."""
    messages = TaskMessages(make_celery(Settings(redis_url="redis://127.0.0.1:1")))
    engine = FixedLatencyEngine(max_batch=4, batch_ms=4_000.0)
    collector = CollectorConfig(max_batch=4, max_wait_ms=5.0, batch_ms=4_000.0)
    config = ReplicaConfig(
        "r-busy", MODEL, collector, pull_lead_ms=3_000.0, lease_ms=6_000.0, single_listener=True, lead_yields=True
    )
    woken: list[float] = []
    replica = Replica(config, engine, state, BrokerClock(state), wake=lambda: woken.append(time.monotonic()))
    replica.start()
    try:
        assert until(lambda: replica.gate.listens, 5)  # idle: it holds the token
        replica.submit(_admit(state, messages, BrokerClock(state).now_ms()))
        assert until(lambda: replica.busy, 5)
        assert until(lambda: state.get(keys.listener_key(MODEL)) is None, 2)  # handed on at the start
        state.set(keys.listener_key(MODEL), "r-other", px=20_000)  # an idle replica took it
        lead_at = replica.gate.pull_at_ms
        assert replica.gate.lead_yields and replica.gate.listener_elsewhere  # assumed until read
        assert until(lambda: replica.clock.now_ms() > lead_at + 200.0, 3)
        assert replica.gate.listener_elsewhere  # read: another holds it
        assert not replica.gate.wants(replica.clock.now_ms(), 0, 4_000.0)
        woken.clear()
        state.delete(keys.listener_key(MODEL))
        assert until(lambda: not replica.gate.listener_elsewhere, 1)
        assert until(lambda: len(woken) >= 1, 1)  # the consumer is asked to pull again
        assert replica.busy and replica.gate.wants(replica.clock.now_ms(), 0, 4_000.0)
        # A read of the token, not the assumption: set again, it is seen again in the lead.
        state.set(keys.listener_key(MODEL), "r-other", px=20_000)
        assert until(lambda: replica.gate.listener_elsewhere, 1)
    finally:
        replica.stop()
