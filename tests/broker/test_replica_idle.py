"""A replica is idle whenever its engine holds nothing, whatever emptied it: here a batch
whose one request another live replica claimed first (a re-queued copy), on a real Valkey
without Celery, for both policies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from control.broker import keys
from control.core import protocol as p
from control.core.clock import BrokerClock
from control.fleet.valkey import EmbeddedBroker
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


def _job(state: redis.Redis, now_ms: float) -> p.Job:
    state.set(keys.owner_key("t:r0"), f"gw|{keys.waiting_key(MODEL, 'free')}|t|a0", px=20_000)
    return p.Job(
        id="a0", key="t:r0", model=MODEL, prompt="x", gateway="gw", received_ms=now_ms, deadline_ms=now_ms + 10_000
    )


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "static"])
def test_a_batch_lost_to_another_replicas_claim_leaves_the_replica_idle(state: redis.Redis, continuous: bool) -> None:
    engine = FixedLatencyEngine(max_batch=4, batch_ms=100.0, continuous=continuous)
    clock = BrokerClock(state)
    config = CollectorConfig(max_batch=4, max_wait_ms=0.0, batch_ms=100.0)
    replica = Replica(ReplicaConfig("r-idle", MODEL, config, lease_ms=1000.0, stall_ms=50.0), engine, state, clock)
    state.set(keys.lease_key("r-other"), 1, px=20_000)  # a live peer runs a0 already
    state.set(keys.claim_key("a0"), "r-other", px=20_000)
    replica.start()
    try:
        launched = state.zscore(keys.launch_key(MODEL), "r-idle")
        replica.submit(_job(state, clock.now_ms()))
        assert until(lambda: state.zscore(keys.launch_key(MODEL), "r-idle") != launched, 5, 0.002)  # it tried
        assert until(lambda: not replica.busy, 2, 0.005)
        assert until(lambda: state.zscore(keys.idle_key(MODEL), "r-idle") is not None, 2, 0.005)  # peers see it idle
        assert not replica.is_stalled()
        assert not engine.has_unfinished()
    finally:
        replica.stop()
