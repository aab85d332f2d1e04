"""The Celery app, shared by the gateway (to send) and the replicas (to receive).

The task itself is registered by the worker side (tasks/replica/worker.py), so a gateway that
makes the app imports neither the replica nor the engine."""

from __future__ import annotations

from celery import Celery
from kombu import Exchange, Queue

from control.core import connect
from control.core import protocol as p
from control.core.settings import Settings


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
        worker_send_task_events=settings.task_events == "always",
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    return app
