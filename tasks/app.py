"""The Celery app, shared by the gateway (to send) and the replicas (to receive)."""

from __future__ import annotations

import base64
import json

import orjson
from celery import Celery
from kombu import Exchange, Queue

from control import connect
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
    broker, broker_options = connect.kombu_broker(settings.broker)
    app = Celery("keybatch", broker=broker, set_as_current=False)
    app.conf.update(
        broker_transport_options={**transport_options(), **broker_options},
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


class TaskMessages:
    """The message `send_task` would LPUSH for a job, as kombu's Redis transport stores it.

    Celery builds the task message (protocol 2) once, as a template; per request
    only the id, the argument and the routing change. The envelope is what
    kombu's virtual channel adds (`prepare_message` and `_inplace_augment_message`),
    with the body kept as JSON text (`body_encoding` None, which kombu reads as is)
    rather than base64. The gateway pushes it in the same Lua call that admits
    the request, which saves the publish round trip and most of `send_task`'s
    cost per request. tests/test_serving.py runs it through a real worker.
    """

    def __init__(self, app: Celery) -> None:
        template = app.amqp.as_task_v2(
            "-", p.TASK_NAME, args=[], kwargs={}, argsrepr="", kwargsrepr="{}", ignore_result=True
        )
        self._headers = dict(template.headers)
        self._properties = dict(template.properties)
        _args, kwargs, embed = template.body
        self._body_tail = f", {json.dumps(kwargs)}, {json.dumps(embed)}]"

    def __call__(self, job: p.Job) -> str:
        headers = {**self._headers, "id": job.id, "root_id": job.id, "argsrepr": f"({job.model!r}, {job.tier!r})"}
        properties = {
            **self._properties,
            "correlation_id": job.id,
            "delivery_info": {"exchange": "", "routing_key": p.queue_name(job.model)},
            "priority": p.priority_of(job.tier),
            "body_encoding": None,
            "delivery_tag": job.id,  # unique while in flight; no acks are tracked (no_ack queues)
        }
        envelope = {
            "body": f"[[{job.model_dump_json()}]{self._body_tail}",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": properties,
        }
        return orjson.dumps(envelope).decode()


def job_from_message(raw: bytes | str) -> p.Job:
    """The job inside a message as `TaskMessages` (or `send_task`) stored it."""
    envelope = json.loads(raw)
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = json.loads(body)
    return p.Job.model_validate(args[0])
