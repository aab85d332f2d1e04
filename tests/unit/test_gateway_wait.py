"""A connection's wait: what ends it decides the answer (the gateway's own logic, on an
unreachable broker: nothing here reaches one)."""

from __future__ import annotations

import gevent.event
import redis

from api.gateway import Gateway, Waiter
from control.core import protocol as p
from control.core.clock import ManualClock
from control.core.settings import Settings
from tasks.celery.app import make_celery


def _gateway(clock: ManualClock) -> tuple[Gateway, list[str]]:
    settings = Settings(redis_url="redis://127.0.0.1:1")
    gateway = Gateway(settings, redis.Redis.from_url(settings.redis_url), make_celery(settings), clock)
    given_up: list[str] = []
    gateway._give_up = lambda waiter, reason: given_up.append(reason)  # type: ignore[method-assign]
    return gateway, given_up


def _waiter(deadline_ms: float) -> Waiter:
    job = p.Job(id="a" * 32, key="t:b", model="m", prompt="x", gateway="g", received_ms=0, deadline_ms=deadline_ms)
    return Waiter(job, "r")


def test_a_wait_that_ends_before_the_clock_reads_the_deadline_waits_again_then_is_a_504() -> None:
    # The wait's timer ends when the clock (here held still) has not reached the deadline:
    # the client is still there; it waits again, and is told its deadline passed, not that
    # it left.
    gateway, given_up = _gateway(ManualClock(0.0))
    waiter = _waiter(30.0)
    hangup = gevent.event.Event()
    assert gateway._await(waiter, gevent.event.Event(), hangup) is False  # the server's events are gevent's
    assert isinstance(waiter.item, p.Dropped) and waiter.item.reason == "expired", waiter.item
    assert given_up == ["expired"]


def test_a_client_that_hangs_up_is_given_up_as_gone() -> None:
    gateway, given_up = _gateway(ManualClock(0.0))
    waiter = _waiter(5_000.0)
    hangup = gevent.event.Event()
    gevent.spawn_later(0.01, hangup.set)
    assert gateway._await(waiter, gevent.event.Event(), hangup) is False  # the server's events are gevent's
    assert isinstance(waiter.item, p.Cancelled) and waiter.item.reason == "gone", waiter.item
    assert given_up == ["gone"]


def test_an_answer_that_comes_while_a_wait_ended_early_waits_again_is_delivered() -> None:
    gateway, given_up = _gateway(ManualClock(0.0))
    waiter = _waiter(30.0)
    event = gevent.event.Event()
    gevent.spawn_later(0.045, event.set)  # after the first 30 ms wait, within the next
    assert gateway._await(waiter, event, gevent.event.Event()) is True
    assert waiter.item is None and given_up == []
