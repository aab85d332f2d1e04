"""kombu's Redis transport internals a replica relies on: the one module that reaches
into them (the queue message's envelope is `control/broker/envelope.py`).

An upgrade of kombu that moves what this touches fails `tests/broker/test_adapters.py`,
which drives a real kombu channel on a real Valkey through it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any


def gate_pulls(channel: Any, wants: Callable[[], bool], on_shut: Callable[[], None]) -> None:
    """Ask `wants()` before every pull from the queue on `channel`.

    The same hook Celery's own `worker_disable_prefetch` uses: the Redis transport
    asks `qos.can_consume()` before every BRPOP. When `wants()` says no, `on_shut()`
    runs (to set a timer that wakes the loop when the gate may open again). A BRPOP
    already sent is let finish (one message at most): kombu's pausing of a pending
    BRPOP does not resume reliably on the event loop.
    """
    qos = channel.qos

    def can_consume(_self: Any) -> bool:
        if wants():
            return True
        on_shut()
        return is_polling(channel)

    qos.can_consume = MethodType(can_consume, qos)


def bound_pulls(channel: Any, wait_s: float) -> None:
    """Each pull (BRPOP) on `channel` waits at most `wait_s` on the broker before it is
    sent again (the Redis transport's `brpop_timeout`, 1 s by default). Set on the channel,
    not through the `polling_interval` transport option, which would also make every
    synchronous `drain_events` sleep that long after an empty poll."""
    channel.brpop_timeout = wait_s


def is_polling(channel: Any) -> bool:
    """Has the channel a pull (BRPOP) in flight, whose message may still arrive?"""
    return bool(channel._in_poll)
