"""The Celery app, shared by the gateway (to send) and the replicas (to receive)."""

from __future__ import annotations

import base64
import json
import uuid

from celery import Celery
from kombu import Exchange, Queue

from control import protocol as p
from control.settings import Settings


def transport_options() -> dict[str, object]:
    # Two priority lists per model queue: paid (0) is popped before free (9).
    return {
        "priority_steps": p.PRIORITY_STEPS,
        "sep": p.PRIORITY_SEP,
        "queue_order_strategy": "priority",
    }


def make_celery(settings: Settings) -> Celery:
    app = Celery("keybatch", broker=settings.broker, set_as_current=False)
    app.conf.update(
        broker_transport_options=transport_options(),
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        result_backend=None,
        # Published to the default exchange with the queue as routing key:
        # no binding lookup in Redis on the request path.
        # Consumed without broker acks: a request is worthless after its deadline,
        # so kombu's visibility-timeout redelivery (an hour) cannot help; losing
        # a replica is handled by the fleet (docs/decisions/0002).
        task_queues=[
            Queue(p.queue_name(m), Exchange(""), routing_key=p.queue_name(m), no_ack=True) for m in settings.models
        ],
        task_create_missing_queues=True,
        # One running batch plus a full next batch are held unacknowledged.
        worker_prefetch_multiplier=2 * settings.max_batch,
        worker_send_task_events=settings.task_events,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    from tasks.worker import BatchedTask

    app.task(name=p.TASK_NAME, base=BatchedTask, bind=True)(_never_called)
    return app


def _never_called(self: object, job: dict) -> None:
    raise RuntimeError("keybatch.complete runs through the batching strategy, not the pool")


def task_message(app: Celery, job: p.Job) -> str:
    """The message `send_task` would LPUSH for this job, as kombu's Redis transport stores it.

    Celery builds the task message (protocol 2); the envelope is what kombu's
    virtual channel adds (`prepare_message` and `_inplace_augment_message`).
    The gateway pushes it in the same Lua call that admits the request, which
    saves the publish round trip and most of `send_task`'s cost per request.
    tests/test_serving.py runs it through a real worker.
    """
    queue = p.queue_name(job.model)
    msg = app.amqp.as_task_v2(
        job.id,
        p.TASK_NAME,
        args=[job.model_dump(mode="json")],
        kwargs={},
        argsrepr=f"({job.model!r}, {job.tier!r})",
        kwargsrepr="{}",
        ignore_result=True,
    )
    body = base64.b64encode(json.dumps(msg.body).encode()).decode()
    properties = {
        **msg.properties,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": p.priority_of(job.tier),
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    envelope = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": msg.headers,
        "properties": properties,
    }
    return json.dumps(envelope)


def job_from_message(raw: bytes | str) -> p.Job:
    """The job inside a message as `task_message` (or `send_task`) stored it."""
    envelope = json.loads(raw)
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = json.loads(body)
    return p.Job.model_validate(args[0])
