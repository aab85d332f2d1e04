"""The replica on a real Valkey without Celery: an engine that raises for a whole batch
fails only the request that makes it raise."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis

from control.broker import keys
from control.core import protocol as p
from control.core.clock import BrokerClock
from control.fleet.valkey import EmbeddedBroker
from tasks.engine.contract import StepOutput
from tasks.engine.fixed import FixedLatencyEngine
from tasks.policy.collector import CollectorConfig
from tasks.replica.config import ReplicaConfig
from tasks.replica.replica import Replica
from tests.support.deploy import MODEL
from tests.support.replies import take_items
from tests.support.waiting import until


class RaisingEngine(FixedLatencyEngine):
    """A batch holding the poison raises as a whole (as a forward pass would)."""

    def __init__(self) -> None:
        super().__init__(max_batch=8, batch_ms=20.0)
        self.runs: list[int] = []  # the size of each batch at its first step
        self._fresh = False

    def add_request(self, job: p.Job) -> None:
        self._fresh = self._fresh or not self.running
        super().add_request(job)

    def step(self) -> list[StepOutput]:
        if self._fresh:
            self.runs.append(len(self.running))
            self._fresh = False
        if any("POISON" in r.job.prompt for r in self.running.values()):
            raise RuntimeError("shape mismatch")
        return super().step()


@pytest.fixture
def state() -> Iterator[redis.Redis]:
    with EmbeddedBroker() as broker:
        yield redis.Redis.from_url(broker.url)


def _job(i: int, prompt: str, now_ms: float) -> p.Job:
    return p.Job(
        id=f"a{i}",
        key=f"t:r{i}",
        model=MODEL,
        prompt=prompt,
        gateway="gw",
        received_ms=now_ms,
        deadline_ms=now_ms + 5_000,
    )


def test_a_batch_the_engine_raises_for_is_halved_until_the_culprit_fails_alone(state: redis.Redis) -> None:
    engine = RaisingEngine()
    clock = BrokerClock(state)
    config = CollectorConfig(max_batch=8, max_wait_ms=50.0, batch_ms=20.0)
    replica = Replica(ReplicaConfig("r-test", MODEL, config, lease_ms=1000.0), engine, state, clock)
    replica.start()
    try:
        now = clock.now_ms()
        prompts = [f"ok {i}" for i in range(7)] + ["POISON"]
        for i in range(len(prompts)):  # admitted: each has an owner pointing at "gw"
            state.set(keys.owner_key(f"t:r{i}"), f"gw|{keys.waiting_key(MODEL, 'free')}|t|a{i}", px=10_000)
        for i, prompt in enumerate(prompts):
            replica.submit(_job(i, prompt, now))
        items: list[dict] = []
        assert until(lambda: _collect(state, items) >= 8, 5)
    finally:
        replica.stop()
    kinds = {item["id"]: item["kind"] for item in items}
    assert kinds == {**{f"a{i}": "result" for i in range(7)}, "a7": "failed"}
    assert [item for item in items if item["kind"] == "failed"][0]["per_request"] is True
    assert engine.runs[0] == 8 and len(engine.runs) <= 1 + 2 * 3  # halved, not one by one


def _collect(state: redis.Redis, items: list[dict]) -> int:
    items.extend(take_items(state))
    time.sleep(0.01)
    return len(items)


def test_a_request_a_pull_brings_after_the_gate_shut_goes_back_to_the_front_of_its_queue(
    state: redis.Redis,
) -> None:
    clock = BrokerClock(state)
    engine = FixedLatencyEngine(max_batch=4, batch_ms=20.0)
    config = CollectorConfig(max_batch=4, batch_ms=20.0, max_wait_ms=60_000.0)  # no batch starts by itself
    replica = Replica(ReplicaConfig("r-test", MODEL, config), engine, state, clock)
    replica.start()
    try:
        now = clock.now_ms()
        queue = keys.queue_key(MODEL, "free")
        state.lpush(queue, "older")  # waiting in the queue already
        replica.gate.start(now, 10_000.0)  # busy for long, and a peer is idle: the gate is shut
        replica.gate.peers(idle=True)
        assert not replica.wants_messages()
        first = _job(1, "x", now)
        assert not replica.submit(first)  # as if a BRPOP sent before the gate shut had brought it
        assert len(replica.collector) == 0
        assert state.lrange(queue, 0, -1) == [b"older", first.model_dump_json().encode()]  # next to be popped
        replica.config = replace(replica.config, hand_back=False)  # KEYBATCH_HAND_BACK_PULLS=0: it waits for a batch
        assert replica.submit(_job(2, "y", now))
        assert replica.collector.ids() == ["a2"]
        assert (replica.stats.num_taken_shut, replica.stats.num_handed_back) == (2, 1)
        replica.gate.finish()  # an open gate: what a pull brings stays
        replica.submit(_job(3, "z", now))
        assert replica.collector.ids() == ["a2", "a3"]
    finally:
        replica.stop()


def test_a_request_a_stopped_replica_is_brought_goes_back_to_its_queue(state: redis.Redis) -> None:
    clock = BrokerClock(state)
    engine = FixedLatencyEngine(max_batch=4, batch_ms=20.0)
    config = ReplicaConfig("r-test", MODEL, CollectorConfig(max_batch=4, batch_ms=20.0), hand_back=False)
    replica = Replica(config, engine, state, clock)  # without hand_back even so: nothing would run it here
    replica.start()
    replica.stop()
    job = _job(1, "x", clock.now_ms())
    assert not replica.submit(job)  # the consumer's last pull, answered after the stop
    assert len(replica.collector) == 0
    assert state.lrange(keys.queue_key(MODEL, "free"), 0, -1) == [job.model_dump_json().encode()]


def test_what_a_batch_leaves_goes_back_to_the_queue_where_a_peer_starts_sooner(state: redis.Redis) -> None:
    clock = BrokerClock(state)
    engine = FixedLatencyEngine(max_batch=4, batch_ms=200.0)
    config = CollectorConfig(max_batch=4, batch_ms=200.0, max_wait_ms=60_000.0)
    replica = Replica(ReplicaConfig("r-test", MODEL, config, hand_back_rest=True), engine, state, clock)
    now = clock.now_ms()
    state.zadd(keys.launch_key(MODEL), {"r-peer": now})  # a peer started just now: it starts again sooner
    for i in range(6):
        state.set(keys.owner_key(f"t:r{i}"), f"gw|{keys.waiting_key(MODEL, 'free')}|t|a{i}", px=10_000)
    jobs = [_job(i, "x", now).model_copy(update={"deadline_ms": now + 5_000 + i}) for i in range(6)]
    replica.start()
    try:
        for job in jobs:
            replica.submit(job)
        queue = keys.queue_key(MODEL, "free")
        assert until(lambda: state.llen(queue) == 2, 5)
        items: list[dict] = []
        assert until(lambda: _collect(state, items) >= 4, 5)
    finally:
        replica.stop()
    assert sorted(item["id"] for item in items) == ["a0", "a1", "a2", "a3"]
    # The earliest deadline is popped first (BRPOP takes from the right).
    assert [p.Job.model_validate_json(raw).id for raw in state.lrange(queue, 0, -1)] == ["a5", "a4"]
    assert not state.hexists(keys.held_key("r-test"), "a4") and not state.hexists(keys.held_key("r-test"), "a5")
    assert replica.stats.rest_handed_back == 2
