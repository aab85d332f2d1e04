"""Celery glue for a replica: a task strategy that buffers, a consumer bootstep.

A task's Strategy is what Celery calls for every received message. Ours parses
the job and hands it to the replica's buffer; the replica's own thread forms
batches. The bootstep owns the replica: it starts it with the consumer, lets it
gate when the consumer pulls from the queue, and on a warm shutdown drains it
(runs what is buffered) before the connection closes. Anything the replica's
thread asks of the consumer goes through the consumer's thread-safe call_soon.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from celery import Celery, Task, bootsteps
from pydantic import ValidationError

from control import protocol as p
from control.clock import BrokerClock, SystemClock
from control.memory import freeze_startup_objects
from control.settings import Settings
from tasks import celery_internals, kombu_internals
from tasks.collector import CollectorConfig, Pending
from tasks.engine import Engine
from tasks.replica import Replica, held

log = logging.getLogger(__name__)


@dataclass
class ReplicaSpec:
    model: str
    settings: Settings
    engine: Engine


class BatchedTask(Task):
    Strategy = "tasks.worker:batching_strategy"
    ignore_result = True


def batching_strategy(task: Task, app: Celery, consumer: Any, **_: Any) -> Any:
    eventer = consumer.event_dispatcher
    send_events = bool(eventer and eventer.enabled)

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **_: Any) -> None:
        try:
            args, _kwargs, _embed = message.decode()
            job = p.Job.model_validate(args[0])
        except (ValueError, TypeError, IndexError, ValidationError):
            log.warning("rejecting a malformed job message")
            return
        consumer.keybatch_replica.submit(job)
        if send_events:
            eventer.send(
                "task-received",
                uuid=job.id,
                name=p.TASK_NAME,
                args=f"({job.model!r}, {job.tier!r})",
                kwargs="{}",
                retries=0,
                eta=None,
                expires=None,
            )

    return on_message


class CeleryEvents:
    """Task events for Flower, sent from the consumer's own thread."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        eventer = consumer.event_dispatcher
        self.enabled = bool(eventer and eventer.enabled)

    def _send(self, kind: str, group: list[Pending], **fields: Any) -> None:
        if not self.enabled:
            return
        send = self.consumer.event_dispatcher.send

        def emit() -> None:
            for pending in group:
                send(kind, uuid=pending.id, **fields)

        self.consumer.call_soon(emit)

    def started(self, batch: list[Pending]) -> None:
        self._send("task-started", batch)

    def succeeded(self, batch: list[Pending], runtime_s: float) -> None:
        self._send("task-succeeded", batch, result=f"batch of {len(batch)}", runtime=runtime_s)

    def failed(self, batch: list[Pending], error: str) -> None:
        self._send("task-failed", batch, exception=error, traceback="")

    def revoked(self, dropped: list[Pending], reason: str) -> None:
        self._send("task-revoked", dropped, terminated=False, signum=None, expired=reason == "expired")


class ReplicaStep(bootsteps.StartStopStep):
    """Owns the replica for the life of the consumer."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.replica: Replica | None = None

    def start(self, c: Any) -> None:
        if self.replica is None:
            spec: ReplicaSpec = c.app.keybatch_spec
            s = spec.settings
            config = CollectorConfig(
                max_batch=s.max_batch,
                max_wait_ms=s.max_wait_ms,
                batch_ms=spec.engine.expected_batch_ms(),
                paid_boost_ms=s.paid_boost_ms,
                margin_ms=s.deadline_margin_ms,
            )
            from control import connect
            from tasks.messages import TaskMessages

            client = connect.client(s.state_url, socket_timeout=2, socket_connect_timeout=2)
            self.replica = Replica(
                c.hostname,
                spec.model,
                spec.engine,
                config,
                client,
                BrokerClock(client, SystemClock(s.clock_skew_ms)),
                events=CeleryEvents(c),
                wake=lambda: c.call_soon(_noop),
                pull_lead_ms=s.pull_lead_ms,
                heartbeat_s=s.heartbeat_s,
                ttl_s=s.replica_ttl_s,
                envelope=TaskMessages(c.app),
                lease_ms=s.lease_ms,
                stall_ms=s.stall_ms,
                max_clock_error_ms=s.max_clock_error_ms,
            )
            self.replica.start()
            celery_internals.reconnect_quickly(c)
            _gate_consumer(c, self.replica)
            celery_internals.pace_events(c, s.event_flush_ms / 1000.0, buffer_limit=s.max_batch)
            freeze_startup_objects()
            log.info("replica %s serving %s with %s", c.hostname, spec.model, spec.engine.name)
        c.keybatch_replica = self.replica

    def stop(self, c: Any) -> None:
        """Warm shutdown (or a lost connection): run what is buffered, then leave."""
        if self.replica is not None:
            self.replica.stop()
            self.replica = None


def _noop() -> None:
    """Scheduled only to wake the consumer's loop so it asks the gate again."""


def _gate_consumer(c: Any, replica: Replica) -> None:
    """Let the replica decide when the consumer pulls from the queue (`PullGate`).
    When the gate shuts, a timer on the consumer's own loop reopens it at the
    replica's pull time, so the loop does not sleep through it."""
    timer_at = [0.0]

    def reopen_timer() -> None:
        reopen_ms = replica.reopens_at_ms()
        if reopen_ms is not None and reopen_ms != timer_at[0]:
            timer_at[0] = reopen_ms
            delay_s = max(0.0, reopen_ms - replica.clock.now_ms()) / 1000.0 + 0.001
            c.hub.call_later(delay_s, _noop)

    kombu_internals.gate_pulls(c.task_consumer.channel, replica.wants_messages, reopen_timer)


def run_worker(settings: Settings, model: str, engine: Engine, name: str, loglevel: str = "INFO") -> None:
    """Run one replica in the foreground (blocks until shutdown)."""
    from tasks.app import make_celery

    app = make_celery(settings)
    app.task(name=p.TASK_NAME, base=BatchedTask, bind=True)(_never_called)
    app.keybatch_spec = ReplicaSpec(model, settings, engine)
    app.steps["consumer"].add(ReplicaStep)
    argv = [
        "worker",
        "--pool",
        "solo",
        "--concurrency",
        "1",
        "--queues",
        p.queue_name(model),
        "--hostname",
        name,
        "--without-gossip",
        "--without-mingle",
        "--loglevel",
        loglevel,
    ]
    if settings.task_events:
        argv.append("--task-events")
    app.worker_main(argv)


def _never_called(self: object, job: dict) -> None:
    raise RuntimeError("keybatch.complete runs through the batching strategy, not the pool")


__all__ = ["BatchedTask", "ReplicaSpec", "ReplicaStep", "batching_strategy", "held", "run_worker"]
