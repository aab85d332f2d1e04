"""Celery worker internals a replica relies on: the one module that reaches into them.

An upgrade of Celery or kombu that moves what this touches fails
`tests/broker/test_adapters.py`, which checks each hook against the real classes and a real
Valkey.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

RECONNECT_EVERY_S = (0.25, 0.25, 1.0)  # first retry, step, most between retries


def pace_events(c: Any, interval_s: float, buffer_limit: int) -> None:
    """Publish buffered task events at most every `interval_s`, not once per loop pass.

    With an event loop Celery buffers task events and flushes them on the next
    pass, which for a replica means one Redis PUBLISH (a round trip, and a new
    client object in kombu's fanout) for nearly every message, a large share of
    a replica's CPU (docs/decisions/0002). Flushed on a timer instead, the events
    of a whole batch go out in a few `task.multi` messages, which Flower reads
    the same way (and a full buffer, `buffer_limit`, still flushes at once).
    """
    dispatcher = c.event_dispatcher
    if dispatcher and dispatcher.enabled:
        pace_dispatcher(dispatcher, c.hub.call_later, interval_s, buffer_limit)


def pace_dispatcher(dispatcher: Any, call_later: Any, interval_s: float, buffer_limit: int) -> None:
    dispatcher.buffer_limit = max(dispatcher.buffer_limit or 0, buffer_limit)
    scheduled = [False]

    def flush() -> None:
        scheduled[0] = False
        dispatcher.flush()

    def on_send_buffered() -> None:
        if not scheduled[0]:
            scheduled[0] = True
            call_later(interval_s, flush)

    dispatcher.on_send_buffered = on_send_buffered


def task_events_on(dispatcher: Any) -> bool:
    """Does the worker send task events now? Celery's dispatcher sends every group when it
    has none listed, else only the listed ones; a remote `enable_events` adds `task`,
    `disable_events` takes it out."""
    if dispatcher is None or not dispatcher.enabled:
        return False
    return not dispatcher.groups or "task" in dispatcher.groups


def expire_task_events(c: Any, kept_s: float, asked: Any) -> None:
    """Task events only while a monitor asks for them: Flower broadcasts `enable_events`
    every 5 s while it runs, and Celery's worker then sends them for good. A timer on the
    consumer's loop takes the `task` group out again once `asked(c)` (monotonic seconds)
    is more than `kept_s` old, so a fleet nobody watches publishes no event per request."""

    def check() -> None:
        dispatcher = c.event_dispatcher
        if dispatcher is None or "task" not in dispatcher.groups:
            return
        if time.monotonic() - asked(c) > kept_s:
            dispatcher.groups.discard("task")

    c.hub.call_repeatedly(min(5.0, kept_s / 3), check)


def reconnect_quickly(c: Any) -> None:
    """After a lost broker, retry the connection every 0.25-1 s rather than kombu's
    default 2, 4, 6 ... s, which Celery's consumer does not let one configure: a broker
    that is back in a second (restarted, or a Sentinel failover) serves again in about
    one, not in up to six."""
    start, step, most = RECONNECT_EVERY_S
    ensure_connected = type(c).ensure_connected

    def quick(conn: Any) -> Any:
        conn.ensure_connection = partial(
            conn.ensure_connection, interval_start=start, interval_step=step, interval_max=most
        )
        return ensure_connected(c, conn)

    c.ensure_connected = quick
