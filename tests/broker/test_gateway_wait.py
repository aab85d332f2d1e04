"""A connection's wait: what ends it decides the answer, and the request is given up on a
real Valkey (the gateway's cancel there marks the attempt with the reason)."""

from __future__ import annotations

from collections.abc import Iterator

import gevent
import gevent.event
import pytest
import redis

from api.gateway import Gateway, Waiter
from control.broker import keys
from control.broker.scripts import Admit
from control.core import protocol as p
from control.core.clock import ManualClock
from control.core.settings import Settings
from control.fleet.valkey import EmbeddedBroker
from tasks.celery.app import make_celery

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
