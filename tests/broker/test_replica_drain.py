"""Drain and move on one replica, on a real Valkey without Celery: what it holds is
answered, a message that slips in after drained is run, a move swaps the engine, switches
the queue and is remembered; the life cycle refuses what it does not allow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from control.broker import keys
from control.core import protocol as p
from control.core.clock import BrokerClock
from control.core.lifecycle import IllegalTransition, ReplicaState
from control.fleet.valkey import EmbeddedBroker
from tasks.engine.contract import Engine
from tasks.engine.fixed import FixedLatencyEngine
from tasks.policy.collector import CollectorConfig
from tasks.replica.config import ReplicaConfig
from tasks.replica.replica import Replica
from tests.support.deploy import MODEL
from tests.support.jobs import admitted_job
from tests.support.waiting import until

OTHER = "kb-large"


@pytest.fixture
def state() -> Iterator[redis.Redis]:
    with EmbeddedBroker() as broker:
        yield redis.Redis.from_url(broker.url)


@pytest.fixture
def replica(state: redis.Redis) -> Iterator[Replica]:
    config = CollectorConfig(max_batch=8, max_wait_ms=50.0, batch_ms=50.0)
    r = Replica(
        ReplicaConfig("r-test", MODEL, config, lease_ms=1000.0), FixedLatencyEngine(8, 50.0), state, BrokerClock(state)
    )
    r.start()
    yield r
    r.stop()


def answered(state: redis.Redis) -> set[str]:
    ids = set()
    for raw in state.lrange(keys.reply_key("gw"), 0, -1):
        ids |= {item.id for item in p.Reply.model_validate_json(raw).items}
    return ids


def test_a_drain_answers_what_is_held_and_runs_a_message_that_slips_in_after(
    state: redis.Redis, replica: Replica
) -> None:
    now = replica.clock.now_ms()
    for i in range(3):
        replica.submit(admitted_job(state, i, now))
    assert replica.drain() == ReplicaState.DRAINING
    assert not replica.wants_messages()  # the consumer's gate stays shut
    assert until(lambda: replica.state == ReplicaState.DRAINED, 3)
    assert answered(state) == {"a0", "a1", "a2"}
    assert state.hget(keys.replica_key("r-test"), "state") == b"drained"
    assert replica.drain() == ReplicaState.DRAINED  # idempotent
    replica.submit(admitted_job(state, 3, replica.clock.now_ms()))  # a pull sent just before the gate shut
    assert replica.state == ReplicaState.DRAINING
    assert until(lambda: replica.state == ReplicaState.DRAINED and "a3" in answered(state), 3)
    assert replica.resume() == ReplicaState.SERVING and replica.wants_messages()


def test_a_move_swaps_the_engine_switches_the_queue_and_is_remembered(state: redis.Redis, replica: Replica) -> None:
    with pytest.raises(IllegalTransition):  # a replica that cannot load another model does not move
        replica.move(OTHER)
    loaded: list[str] = []
    switched: list[tuple[str, str]] = []

    def load(model: str) -> Engine:
        loaded.append(model)
        return FixedLatencyEngine(8, 20.0)

    replica.load_engine = load
    replica.switch_queue = lambda old, new: switched.append((old, new))
    replica.submit(admitted_job(state, 0, replica.clock.now_ms()))
    assert replica.move(OTHER) == ReplicaState.DRAINING
    assert until(lambda: replica.state == ReplicaState.SERVING, 3)
    assert (replica.model, loaded, switched) == (OTHER, [OTHER], [(p.queue_name(MODEL), p.queue_name(OTHER))])
    assert answered(state) == {"a0"}  # answered by the old model before it went
    assert state.get(keys.assignment_key("r-test")) == OTHER.encode()
    assert state.hget(keys.replica_key("r-test"), "model") == OTHER.encode()


def test_a_move_that_cannot_load_the_other_model_leaves_the_replica_drained(
    state: redis.Redis, replica: Replica
) -> None:
    def fail(model: str) -> Engine:
        raise OSError(f"no model folder for {model}")

    replica.load_engine = fail
    replica.move(OTHER)
    assert until(lambda: replica.state == ReplicaState.DRAINED, 3)
    assert replica.model == MODEL and replica.moving_to == ""
    assert replica.resume() == ReplicaState.SERVING
