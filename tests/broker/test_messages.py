"""The message the gateway builds for a job is the one Celery's `send_task` pushes, less
the headers a consumer does not read, on a real Valkey: an upgrade of Celery or kombu
that changes the envelope fails here."""

from __future__ import annotations

import json

from control.broker import keys
from control.broker.envelope import KEPT_HEADERS, TaskMessages, job_from_message
from control.core import protocol as p
from control.core.settings import Settings
from control.fleet.valkey import EmbeddedBroker
from tasks.celery.app import make_celery

# Fields that differ by design: ids and the delivery tag are per message, the body is
# kept as JSON text rather than base64, and no result is ever sent back through Celery
# (answers travel on the gateway's own reply list), so nothing names a reply queue.
PER_MESSAGE = {
    "id",
    "root_id",
    "parent_id",
    "origin",
    "argsrepr",
    "delivery_tag",
    "correlation_id",
    "body_encoding",
    "reply_to",
}


def _job() -> p.Job:
    return p.Job(
        id="0123456789abcdef",
        key="t:r1",
        model="kb-small",
        prompt="def f():\n    ",
        tier="paid",
        gateway="gw",
        received_ms=1.0,
        deadline_ms=601.0,
    )


def test_the_gateway_message_matches_what_send_task_pushes() -> None:
    with EmbeddedBroker() as broker:
        app = make_celery(Settings(redis_url=broker.url, models={"kb-small": "kb-small"}))
        job = _job()
        app.send_task(
            p.TASK_NAME,
            args=[job.model_dump(mode="json")],
            queue=p.queue_name(job.model),
            routing_key=p.queue_name(job.model),
            priority=p.priority_of(job.tier),
            ignore_result=True,
        )
        with app.connection_for_write() as conn:
            conn.ensure_connection()
            client = conn.default_channel.client
            raw = client.rpop(keys.queue_key(job.model, job.tier))
        app.close()
    assert raw is not None, "send_task pushed nowhere near where the gateway pushes"
    theirs = json.loads(raw)
    ours = json.loads(TaskMessages(app)(job))
    assert set(ours) == set(theirs)
    assert set(ours["headers"]) == set(KEPT_HEADERS) <= set(theirs["headers"])
    assert _strip(ours["headers"]) == {k: v for k, v in _strip(theirs["headers"]).items() if k in KEPT_HEADERS}
    assert ours["headers"]["id"] == job.id
    assert _strip(ours["properties"]) == _strip(theirs["properties"])
    assert job_from_message(raw) == job_from_message(TaskMessages(app)(job)) == job


def _strip(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if k not in PER_MESSAGE}
