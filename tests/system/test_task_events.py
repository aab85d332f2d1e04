"""Task events while a monitor watches: a fleet nobody watches publishes no event per
request; Celery's `enable_events` (what Flower broadcasts every 5 s) turns them on, and
they stop again once nobody has asked for `KEYBATCH_TASK_EVENTS_KEPT_S`."""

from __future__ import annotations

import time

import redis

from control.core.settings import Settings
from tasks.celery.app import make_celery
from tests.support.deploy import MODEL, Deployment, deployment
from tests.support.waiting import until


def _task_channels(listener: redis.client.PubSub, within_s: float) -> list[str]:
    """The event channels of task events published within `within_s` (worker heartbeats aside)."""
    seen: list[str] = []
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        message = listener.get_message(timeout=left)
        if message and message["type"] == "pmessage" and b"celeryev/task" in message["channel"]:
            seen.append(message["channel"].decode())
    return seen


def _served(kb: Deployment, n: int = 3) -> None:
    for _ in range(n):
        assert kb.post().status_code == 200


def test_task_events_go_out_only_while_a_monitor_asks_for_them() -> None:
    with deployment(workers=1, task_events_kept_s="2") as kb:
        listener = redis.Redis.from_url(kb.system.redis_url).pubsub()
        listener.psubscribe("*celeryev*")
        listener.get_message(timeout=1)  # the subscription's confirmation
        _served(kb)
        assert _task_channels(listener, 1.0) == [], "task events with nobody watching"

        app = make_celery(Settings(redis_url=kb.system.redis_url, models={MODEL: MODEL}))
        try:
            app.control.enable_events()  # what Flower broadcasts while it runs

            def events_flow() -> bool:
                _served(kb, 1)
                return bool(_task_channels(listener, 0.5))

            assert until(events_flow, 10), "no task events after enable_events"
        finally:
            app.close()
        time.sleep(4)  # past the 2 s kept, and a check of the consumer's timer (every 2/3 s)
        _task_channels(listener, 0.3)  # what was still buffered
        _served(kb)
        assert _task_channels(listener, 1.0) == [], "task events went on with nobody asking"
        listener.close()


def test_task_events_set_off_stay_off_when_a_monitor_asks() -> None:
    with deployment(workers=1, task_events="off") as kb:
        listener = redis.Redis.from_url(kb.system.redis_url).pubsub()
        listener.psubscribe("*celeryev*")
        listener.get_message(timeout=1)
        app = make_celery(Settings(redis_url=kb.system.redis_url, models={MODEL: MODEL}))
        try:
            replies = app.control.broadcast("enable_events", reply=True, timeout=2)
        finally:
            app.close()
        assert replies and all("error" in next(iter(r.values())) for r in replies), replies
        _served(kb)
        assert _task_channels(listener, 1.0) == [], "task events though set off"
        listener.close()
