"""Celery glue for a replica: a task strategy that buffers, a consumer bootstep.

A task's Strategy is what Celery calls for every received message. Ours parses
the job and hands it to the replica's buffer; the replica's own thread forms
batches. The bootstep owns the replica: it starts it with the consumer, lets it
gate when the consumer pulls from the queue, and on a warm shutdown drains it
(runs what is buffered) before the connection closes. Anything the replica's
thread asks of the consumer goes through the consumer's thread-safe call_soon.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from celery import Celery, Task, bootsteps
from celery.utils.nodenames import default_nodename, host_format
from celery.worker import control as celery_control
from celery.worker.control import control_command, inspect_command
from pydantic import ValidationError

from control.core import protocol as p
from control.core.clock import BrokerClock, SystemClock
from control.core.lifecycle import IllegalTransition
from control.core.memory import freeze_startup_objects
from control.core.settings import Settings
from tasks.celery import celery_internals, kombu_internals
from tasks.engine.contract import Engine
from tasks.policy.collector import CollectorConfig, Pending
from tasks.replica.broker import FallbackReplies
from tasks.replica.config import ReplicaConfig
from tasks.replica.intake import held
from tasks.replica.replica import Replica

log = logging.getLogger(__name__)


@dataclass
class ReplicaSpec:
    model: str
    settings: Settings
    engine: Engine
    load_engine: Callable[[str], Engine] | None = None  # another model's engine, for a move


def replica_config(s: Settings, name: str, model: str, engine: Engine) -> ReplicaConfig:
    """A replica's config from the settings; its collector starts from the engine's batch time."""
    collector = CollectorConfig(
        max_batch=s.max_batch,
        max_wait_ms=s.max_wait_ms,
        batch_ms=engine.expected_batch_ms(),
        paid_boost_ms=s.paid_boost_ms,
        margin_ms=s.deadline_margin_ms,
    )
    return ReplicaConfig(
        name,
        model,
        collector,
        pull_lead_ms=s.pull_lead_ms,
        pull_early=s.pull_early,
        heartbeat_s=s.heartbeat_s,
        ttl_s=s.replica_ttl_s,
        lease_ms=s.lease_ms,
        pulse_ms=s.pulse_ms,
        stall_ms=s.stall_ms,
        max_clock_error_ms=s.max_clock_error_ms,
        hand_back=s.hand_back_pulls,
        hand_back_rest=s.hand_back_rest,
        single_listener=s.single_listener and s.collector == "native",
        lead_yields=s.lead_yields,
        host=s.host,
        hedge=s.hedge,
        hedge_idle=s.hedge_idle,
    )


class BatchedTask(Task):
    Strategy = "tasks.replica.worker:batching_strategy"
    ignore_result = True


def batching_strategy(task: Task, app: Celery, consumer: Any, **_: Any) -> Any:
    eventer = consumer.event_dispatcher

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **_: Any) -> None:
        try:
            args, _kwargs, _embed = message.decode()
            job = p.Job.model_validate(args[0])
            job.behind = p.is_behind(message.properties.get("priority"))
        except (ValueError, TypeError, IndexError, ValidationError):
            log.warning("rejecting a malformed job message")
            return
        kept = consumer.keybatch_replica.submit(job)
        # One handed back is received by the replica that runs it.
        if kept and celery_internals.task_events_on(eventer):
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

    def _send(self, kind: str, group: list[Pending], **fields: Any) -> None:
        if not celery_internals.task_events_on(self.consumer.event_dispatcher):
            return
        send = self.consumer.event_dispatcher.send

        def emit() -> None:
            for pending in group:
                send(kind, uuid=pending.id, **fields)

        self.consumer.call_soon(emit)

    def started(self, batch: list[Pending]) -> None:
        """Not sent: Flower lists a request from its received event (name, worker) and its
        end (state, runtime); a started event per request was a third of the events' bytes
        in the broker (docs/decisions/0023)."""

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
            from control.broker.envelope import TaskMessages
            from control.core import connect

            fallback = _other_cells(s)
            # With other cells to answer through, a call the broker does not answer ends
            # within the request path's bound, not 2 s: a stalled broker must not hold the
            # loop (and the batch it has finished) past the requests' budgets.
            bound_s = 2 * s.broker_timeout_ms / 1000.0 if fallback is not None else 2.0
            client = connect.client(s.state_url, socket_timeout=bound_s, socket_connect_timeout=bound_s)
            self.replica = Replica(
                replica_config(s, c.hostname, spec.model, spec.engine),
                spec.engine,
                client,
                BrokerClock(client, SystemClock(s.clock_skew_ms)),
                events=CeleryEvents(c),
                wake=lambda: c.call_soon(_noop),
                envelope=TaskMessages(c.app),
                fallback=fallback,
            )
            if s.collector == "chord":
                from tasks.replica import chord

                chord.attach(self.replica, c.app)
            self.replica.load_engine = spec.load_engine
            self.replica.switch_queue = partial(_switch_queue, c)
            self.replica.is_polling = partial(kombu_internals.is_polling, c.task_consumer.channel)
            self.replica.start()
            celery_internals.reconnect_quickly(c)
            _gate_consumer(c, self.replica)
            celery_internals.pace_events(c, s.event_flush_ms / 1000.0, buffer_limit=s.max_batch)
            if s.task_events == "watched":
                celery_internals.expire_task_events(c, s.task_events_kept_s, _events_asked)
            freeze_startup_objects()
            log.info("replica %s serving %s with %s", c.hostname, spec.model, spec.engine.name)
        c.keybatch_replica = self.replica

    def stop(self, c: Any) -> None:
        """Warm shutdown (or a lost connection): run what is buffered, then leave."""
        if self.replica is not None:
            self.replica.stop()
            self.replica = None


# -- task events while watched ---------------------------------------------------------


def _events_asked(c: Any) -> float:
    """When a monitor last asked this worker for task events (monotonic seconds; 0: never)."""
    return float(getattr(c, "keybatch_events_asked", 0.0))


@control_command()
def enable_events(state: Any) -> Any:
    """Celery's own `enable_events`, which Flower broadcasts every few seconds, and the time
    it was asked: a replica whose task events are `watched` sends them only while a
    monitor keeps asking (`celery_internals.expire_task_events`); one whose task events are
    `off` refuses it."""
    if state.consumer.app.keybatch_spec.settings.task_events == "off":
        return {"error": "task events are off on this replica (KEYBATCH_TASK_EVENTS=off)"}
    state.consumer.keybatch_events_asked = time.monotonic()
    return celery_control.enable_events(state)


# -- remote control: the operator's commands (control/fleet/operator.py), run on the consumer's thread --


def _act(state: Any, action: Callable[[Replica], object]) -> dict[str, Any]:
    replica: Replica | None = getattr(state.consumer, "keybatch_replica", None)
    if replica is None:
        return {"ok": False, "error": "the replica has not started"}
    try:
        action(replica)
    except (IllegalTransition, ValueError) as exc:
        return {"ok": False, "error": str(exc), "state": replica.state.label, "model": replica.model}
    return {"ok": True, **replica.report()}


@control_command()
def kb_drain(state: Any) -> dict[str, Any]:
    """keybatch: take no new work, finish what is held, then report drained."""
    return _act(state, lambda r: r.drain())


@control_command()
def kb_resume(state: Any) -> dict[str, Any]:
    """keybatch: serve again after a drain."""
    return _act(state, lambda r: r.resume())


@control_command(args=[("model", str)], signature="<model>")
def kb_move(state: Any, model: str) -> dict[str, Any]:
    """keybatch: drain, load another model and serve its queue."""
    if model not in state.consumer.app.keybatch_spec.settings.models:
        return {"ok": False, "error": f"unknown model {model!r}"}
    return _act(state, lambda r: r.move(model))


@inspect_command()
def kb_replica(state: Any) -> dict[str, Any]:
    """keybatch: the replica's state, model, load: what it publishes in the registry."""
    return _act(state, lambda r: None)


def _switch_queue(c: Any, old: str, new: str, timeout_s: float = 10.0) -> None:
    """Consume `new` instead of `old` (Celery's cancel_consumer/add_consumer), on the
    consumer's own thread; called by a drained replica, whose gate is shut and whose
    consumer has no pull in flight."""
    done: list[BaseException | None] = []
    finished = threading.Event()

    def switch() -> None:
        try:
            if old != new:
                c.cancel_task_queue(old)
                c.add_task_queue(new)
            done.append(None)
        except BaseException as exc:  # handed to the waiting thread
            done.append(exc)
        finished.set()

    c.call_soon(switch)
    if not finished.wait(timeout_s):
        raise TimeoutError(f"the consumer did not switch from {old} to {new} within {timeout_s:.0f} s")
    if done[0] is not None:
        raise done[0]


def _other_cells(s: Settings) -> FallbackReplies | None:
    """The other cells to answer through, where CELLS names them (its own REDIS_URL among them)."""
    others = [url for url in s.cells if url != s.state_url]
    if not others or len(others) == len(s.cells):
        return None
    from control.core import connect

    bound_s = 2 * s.broker_timeout_ms / 1000.0
    return FallbackReplies(
        [connect.client(url, socket_timeout=bound_s, socket_connect_timeout=bound_s) for url in others]
    )


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
    kombu_internals.bound_pulls(c.task_consumer.channel, p.PULL_WAIT_S)


def run_worker(
    settings: Settings,
    model: str,
    engine: Engine,
    name: str,
    loglevel: str = "INFO",
    load_engine: Callable[[str], Engine] | None = None,
) -> int:
    """Run one replica in the foreground until shutdown, and return its exit code;
    `load_engine` makes another model's engine when the operator moves the replica."""
    from tasks.celery.app import make_celery

    exit_when_orphaned()

    app = make_celery(settings)
    app.task(name=p.TASK_NAME, base=BatchedTask, bind=True)(_never_called)
    app.keybatch_spec = ReplicaSpec(model, settings, engine, load_engine)
    app.steps["consumer"].add(ReplicaStep)
    pool, concurrency, queues = "solo", 1, p.queue_name(model)
    if settings.collector == "chord":  # docs/decisions/0001: a batch runs as a Celery chord
        from tasks.replica import chord

        chord.configure(app, settings, name)
        pool, concurrency, queues = "threads", chord.POOL_THREADS, f"{chord.chord_queue(name)},{queues}"
    # What `celery worker` builds, without its command line: that imports every Celery
    # command and their plugins (Flower's among them), which doubled a replica's boot.
    worker = app.Worker(
        hostname=host_format(default_nodename(name)),
        pool_cls=pool,
        concurrency=concurrency,
        queues=queues,
        without_gossip=True,
        without_mingle=True,
        loglevel=loglevel,
        quiet=True,  # no banner: `keybatch up` prints each replica's own line when it serves
        task_events=settings.task_events == "always",  # `watched`: off until a monitor asks
    )
    worker.start()
    return worker.exitcode if isinstance(worker.exitcode, int) else 1 if worker.exitcode else 0


# What Celery imports only when a worker is built and started (its bootsteps, the Redis
# transport, the pool): a standby imports them while it waits, not after its takeover.
WORKER_MODULES = (
    "celery.apps.worker",
    "celery.app.amqp",
    "celery.app.control",
    "celery.app.events",
    "celery.app.log",
    "celery.app.routes",
    "celery.loaders.app",
    "celery.backends.base",
    "celery.fixups.django",
    "celery.concurrency.solo",
    "celery.events.dispatcher",
    "celery.events.receiver",
    "celery.worker.autoscale",
    "celery.worker.components",
    "celery.worker.consumer",
    "celery.worker.heartbeat",
    "celery.worker.loops",
    "celery.worker.pidbox",
    "celery.worker.strategy",
    "kombu.mixins",
    "kombu.pidbox",
    "kombu.transport.redis",
    "tasks.celery.app",
)


def import_worker_modules() -> None:
    """Import what building and starting a worker would (a module a Celery release no
    longer has is skipped: the worker imports what it needs when it starts anyway)."""
    for name in WORKER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            log.debug("no module %s to import ahead", name)


ORPHAN_GRACE_S = 5.0  # a replica whose supervisor died has this long to stop on its own


def exit_when_orphaned(grace_s: float = ORPHAN_GRACE_S, every_s: float = 0.5) -> threading.Thread | None:
    """Exit the process once its parent has been gone `grace_s`. A supervisor's death
    sends SIGTERM (PR_SET_PDEATHSIG), but a warm shutdown can hang when the broker died
    with it (kombu retries a publish to it without end, in the main thread), which would
    leave the replica running with no one to stop it. A process started by init (no
    supervisor) is left alone."""
    parent = os.getppid()
    if parent == 1:
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        time.sleep(grace_s)  # still here: the shutdown hangs
        log.error("the supervisor (pid %d) is gone and the shutdown did not end: exiting", parent)
        logging.shutdown()
        os._exit(1)

    thread = threading.Thread(target=watch, name="orphan-watch", daemon=True)
    thread.start()
    return thread


def _never_called(self: object, job: dict) -> None:
    raise RuntimeError("keybatch.complete runs through the batching strategy, not the pool")


__all__ = [
    "BatchedTask",
    "ReplicaSpec",
    "ReplicaStep",
    "batching_strategy",
    "exit_when_orphaned",
    "held",
    "replica_config",
    "run_worker",
]
