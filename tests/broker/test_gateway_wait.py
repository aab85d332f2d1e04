"""A connection's wait: what ends it decides the answer, and the request is given up on a
real Valkey (the gateway's cancel there marks the attempt with the reason)."""

from __future__ import annotations

from collections.abc import Iterator

import gevent
import gevent.event
import pytest
import redis

from api.errors import ApiError
from api.gateway import Gateway, Waiter
from control.broker import keys, records
from control.broker.scripts import Admit
from control.core import protocol as p
from control.core.clock import ManualClock
from control.core.settings import Settings
from control.fleet.valkey import EmbeddedBroker
from control.policy.cells import cell_order
from tasks.celery.app import make_celery
from tests.support.waiting import until

ATTEMPT = "a" * 32
JOB = {"key": "t:b", "model": "m", "prompt": "x", "received_ms": 0}


@pytest.fixture(scope="module")
def broker() -> Iterator[str]:
    with EmbeddedBroker() as server:
        yield server.url


def _waiting(url: str, deadline_ms: float) -> tuple[Gateway, Waiter, redis.Redis]:
    """A gateway (its clock held still at 0) and one request it admitted and waits for."""
    state = redis.Redis.from_url(url)
    state.flushall()
    settings = Settings(redis_url=url)
    gateway = Gateway(settings, redis.Redis.from_url(url), make_celery(settings), ManualClock(0.0))
    job = p.Job(id=ATTEMPT, gateway=gateway.id, deadline_ms=deadline_ms, **JOB)
    lane = keys.lane_keys(job.model, job.tier)
    Admit(state)(
        owner_key=keys.owner_key(job.key), waiting_paid=lane.waiting_paid, waiting_free=lane.waiting_free,
        queue=lane.queue, session=None, fingerprint="", ttl_ms=60_000, deadline_ms=deadline_ms, attempt=ATTEMPT,
        tier=job.tier, deepest=100, now_ms=0, message="{}", keeps_answer=False, gateway=gateway.id,
        tenant=None,
    )  # fmt: skip
    return gateway, Waiter(job, "r"), state


@pytest.mark.parametrize(
    ("hang_up", "answer", "reason"),
    [
        # The wait's timer ends when the clock (held still) has not reached the deadline: the
        # client is still there; it waits again, and is told its deadline passed, not that
        # it left.
        (False, p.Dropped, "expired"),
        (True, p.Cancelled, "gone"),  # the client's socket says it went
    ],
)
def test_what_ends_a_wait_decides_its_answer(broker: str, hang_up: bool, answer: type, reason: str) -> None:
    gateway, waiter, state = _waiting(broker, 30.0)
    hangup = gevent.event.Event()
    if hang_up:
        gevent.spawn_later(0.01, hangup.set)
    assert gateway._await(waiter, gevent.event.Event(), hangup) is False  # the server's events are gevent's
    assert isinstance(waiter.item, answer) and waiter.item.reason == reason, waiter.item
    assert state.get(keys.cancel_key(ATTEMPT)) == reason.encode()  # given up where it waits


def test_an_answer_that_comes_while_a_wait_ended_early_waits_again_is_delivered(broker: str) -> None:
    gateway, waiter, state = _waiting(broker, 30.0)
    event = gevent.event.Event()
    gevent.spawn_later(0.045, event.set)  # after the first 30 ms wait, within the next
    assert gateway._await(waiter, event, gevent.event.Event()) is True
    assert waiter.item is None and state.get(keys.cancel_key(ATTEMPT)) is None


def _register(state: redis.Redis, name: str = "r1") -> None:
    """A replica of model m serving in the registry, as its heartbeat leaves it."""
    entry = records.pack_replica_entry(
        model="m", state="serving", held=0, moving_to="", backend="fixed", max_batch=16, batch_ms=250.0,
        join_ms=0.0, buffered=0, busy=False, host="h", pid=7, seen_ms=0.0, why_not_ready="", clock_offset_ms=0.0,
        counters={}, engine={},
    )  # fmt: skip
    state.hset(keys.replica_key(name), mapping=entry)
    state.sadd(keys.REPLICAS_KEY, name)
    state.set(keys.lease_key(name), "1", px=60_000)


def test_a_request_its_broker_lost_by_restarting_empty_is_enqueued_again(broker: str) -> None:
    # A restart between two of the health loop's probes is never seen as an outage: only
    # the keyspace's epoch, which the sweep names, tells the gateway its requests are gone.
    state = redis.Redis.from_url(broker)
    state.flushall()
    _register(state)
    settings = Settings(redis_url=broker)
    gateway = Gateway(settings, redis.Redis.from_url(broker), make_celery(settings), ManualClock(0.0))
    job = p.Job(id=ATTEMPT, gateway=gateway.id, deadline_ms=60_000, **JOB)
    waiter = gateway.submit(job, "r", None)
    try:
        queue = keys.lane_keys("m", job.tier).queue
        assert state.llen(queue) == 1
        assert until(lambda: gateway.cells[0].epoch, 5.0)
        state.flushall()
        _register(state)
        assert until(lambda: state.llen(queue) == 1, 5.0)
        # the round that sent it again ends (it enqueues, then keeps what is left to send)
        assert until(lambda: gateway._lost[0] == [], 5.0)
        assert state.llen(queue) == 1 and state.exists(keys.owner_key(job.key)) and waiter.item is None
    finally:  # its health loop runs on: nothing of this gateway's may wait in the next test's broker
        waiter.resolve(p.Dropped(id=ATTEMPT, reason="expired", replica=""))


@pytest.fixture(scope="module")
def second_broker() -> Iterator[str]:
    with EmbeddedBroker() as server:
        yield server.url


def test_a_request_its_cell_has_no_room_for_is_taken_by_the_next_cell_and_a_second_full_one_refuses(
    broker: str, second_broker: str
) -> None:
    urls = [broker, second_broker]
    states = [redis.Redis.from_url(url) for url in urls]
    for state in states:
        state.flushall()
        _register(state)
    settings = Settings(cells=urls)
    gateway = Gateway(settings, [redis.Redis.from_url(u) for u in urls], make_celery(settings), ManualClock(0.0))
    job = p.Job(id=ATTEMPT, gateway=gateway.id, deadline_ms=600, **JOB)
    home, other = cell_order(job.key, 2)
    lane = keys.lane_keys("m", job.tier)

    def fill(cell: int) -> None:  # more waiting than a batch of 16 can take within the budget
        states[cell].zadd(lane.waiting_free, {f"w{i}": 60_000 for i in range(200)})

    fill(home)
    waiter = gateway.submit(job, "r", None)
    waiter.resolve(p.Dropped(id=ATTEMPT, reason="expired", replica=""))  # (the gateway's loops run on)
    assert waiter.cell == other
    assert states[other].llen(lane.queue) == 1 and states[home].llen(lane.queue) == 0

    fill(other)
    second = p.Job(id="b" * 32, gateway=gateway.id, deadline_ms=600, **{**JOB, "key": job.key + "2"})
    with pytest.raises(ApiError) as refused:
        gateway.submit(second, "r2", None)
    assert (refused.value.status, refused.value.code) == (429, "overloaded")
