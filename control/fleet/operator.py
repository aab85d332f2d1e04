"""The operator's API: see the fleet, drain, resume, move, rebalance.

One place shared by the `keybatch` commands and the dashboard. Reading is Redis only
(`snapshot`: four round trips, cheap enough to poll every second); acting goes through
Celery's remote control to the replica itself (`kb_drain`, `kb_resume`, `kb_move`,
defined in tasks/replica/worker.py), which changes its state through control/core/lifecycle.py.
The caller needs the broker's operator credentials: the data path's (the gateway's, a
replica's) may not send remote-control commands (control/fleet/credentials.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from control.broker.registry import ReplicaInfo, read_fleet
from control.broker.traffic import TierTraffic, read_traffic
from control.core import connect
from control.core.clock import Clock, SystemClock
from control.core.lifecycle import ReplicaState
from control.core.settings import Settings
from control.core.vocab import PAID
from control.policy.rebalance import Decision, ModelDemand, RebalanceConfig, RebalancePolicy, ReplicaSlot, Snapshot

log = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 1.0  # a live replica answers a command in milliseconds


class OperatorError(ValueError):
    """A command that cannot be carried out (unknown replica, last replica of a model...)."""


@dataclass(frozen=True)
class FleetSnapshot:
    """Everything the fleet view and the dashboard show, read at one moment."""

    replicas: list[ReplicaInfo]
    traffic: list[TierTraffic]
    read_at: float = field(default_factory=time.time)

    def serving(self, model: str) -> list[ReplicaInfo]:
        return [r for r in self.replicas if r.model == model and r.state == ReplicaState.SERVING]

    def as_json(self) -> dict[str, Any]:
        return {
            "read_at": self.read_at,
            "replicas": [replica_json(r) for r in self.replicas],
            "traffic": [asdict(t) for t in self.traffic],
        }


def replica_json(r: ReplicaInfo) -> dict[str, Any]:
    return {
        "id": r.name,
        "host": r.host,
        "pid": r.pid,
        "cell": r.cell,
        "model": r.model,
        "state": r.state_label,
        "ready": r.is_ready,
        "why_not_ready": r.why_not_ready,
        "moving_to": r.moving_to,
        "backend": r.backend,
        "held": r.num_held,
        "max_batch": r.max_batch,
        "batch_fill": round(r.batch_fill, 3),
        "utilization": r.utilization,
        "duty_cycle": r.utilization,
        "cycle_ms": r.cycle_ms,
        "batch_p50_ms": r.batch_p50_ms,
        "batch_p99_ms": r.batch_p99_ms,
        "heartbeat_age_ms": round(r.heartbeat_age_ms, 1),
        "num_batches": r.num_batches,
        "num_requests": r.num_requests,
        "taken_shut": r.taken_shut,
        "handed_back": r.handed_back,
        "hedged": r.hedged,
        "hedge_wins": r.hedge_wins,
        "hedge_wasted": r.hedge_wasted,
        "engine": r.engine,
    }


@dataclass(frozen=True)
class ActionResult:
    replica: str
    action: str
    ok: bool
    state: str = ""
    model: str = ""
    message: str = ""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class Operator:
    """The operator's actions on every cell of a deployment (a replica is acted on through
    its own cell's broker)."""

    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        self.clients = (
            [client]
            if client is not None
            else [connect.client(url, socket_timeout=2, socket_connect_timeout=2) for url in settings.cell_urls]
        )
        self.redis = self.clients[0]
        self._celery: dict[int, Any] = {}

    def read_fleet(self) -> list[ReplicaInfo]:
        return [rep for cell, client in enumerate(self.clients) for rep in read_fleet(client, cell)]

    # -- reading --------------------------------------------------------------------

    def snapshot(self, window_s: int = 10) -> FleetSnapshot:
        replicas = self.read_fleet()
        models = sorted(set(self.settings.models) | {r.model for r in replicas})
        return FleetSnapshot(replicas, read_traffic(self.clients, models, window_s))

    def live(self) -> dict[str, dict[str, Any]]:
        """What each replica answers itself over remote control within 1 s: the fields of
        its registry hash, as of now rather than its last heartbeat (a replica missing here
        is not listening)."""
        live: dict[str, dict[str, Any]] = {}
        for cell in range(len(self.clients)):
            replies = self._app(cell).control.broadcast("kb_replica", reply=True, timeout=REPLY_TIMEOUT_S)
            live.update({name: answer for reply in replies or [] for name, answer in reply.items()})
        return live

    def resolve(self, name: str, replicas: list[ReplicaInfo] | None = None) -> ReplicaInfo:
        """A replica by its full name, or by the part before '@' when that is unique."""
        replicas = replicas if replicas is not None else self.read_fleet()
        exact = [r for r in replicas if r.name == name]
        found = exact or [r for r in replicas if r.name.split("@")[0] == name]
        if len(found) == 1:
            return found[0]
        names = ", ".join(r.name for r in replicas) or "none"
        raise OperatorError(f"{'no' if not found else 'more than one'} replica named {name!r} (replicas: {names})")

    # -- acting ---------------------------------------------------------------------

    def drain(self, name: str, force: bool = False, wait_s: float = 0.0) -> ActionResult:
        """Stop `name` taking work; it finishes what it holds and reports drained. The last
        serving replica of a model is refused unless `force` (its model would answer 503)."""
        snap = self.snapshot()
        replica = self.resolve(name, snap.replicas)
        self._keep_one(snap, replica, force, "drain")
        return self._wait_for(self._command(replica, "kb_drain"), {ReplicaState.DRAINED}, wait_s)

    def resume(self, name: str) -> ActionResult:
        return self._command(self.resolve(name), "kb_resume")

    def move(self, name: str, model: str, force: bool = False, wait_s: float = 0.0) -> ActionResult:
        """Drain `name`, load `model` there and serve its queue."""
        if model not in self.settings.models:
            raise OperatorError(f"unknown model {model!r}; configured: {', '.join(self.settings.models)}")
        snap = self.snapshot()
        replica = self.resolve(name, snap.replicas)
        if replica.model != model:
            self._keep_one(snap, replica, force, "move")
        result = self._command(replica, "kb_move", model=model)
        return self._wait_for(result, {ReplicaState.SERVING}, wait_s, model)

    def _keep_one(self, snap: FleetSnapshot, replica: ReplicaInfo, force: bool, action: str) -> None:
        others = [r for r in snap.serving(replica.model) if r.name != replica.name]
        if replica.state == ReplicaState.SERVING and not others and not force:
            raise OperatorError(
                f"{replica.name} is the last serving replica of {replica.model}: {action} it and "
                f"{replica.model} answers 503 (--force to do it anyway)"
            )

    def _command(self, replica: ReplicaInfo, command: str, **arguments: Any) -> ActionResult:
        action = command.removeprefix("kb_")
        from kombu.exceptions import OperationalError

        try:
            replies = self._app(replica.cell).control.broadcast(
                command,
                arguments=arguments,
                destination=[replica.name],
                reply=True,
                timeout=REPLY_TIMEOUT_S,
                limit=1,
            )
        except (redis.exceptions.NoPermissionError, OperationalError) as exc:
            if "permission" not in str(exc).lower():
                raise
            raise OperatorError(f"the broker refused {action} ({exc}): it needs the operator's credentials") from exc
        answer = next((r[replica.name] for r in replies or [] if replica.name in r), None)
        if answer is None:
            # A replica registers as its consumer starts and answers commands a moment later.
            why = "no answer within 1 s (a replica that just started listens a moment after it registers)"
            return ActionResult(replica.name, action, False, replica.state_label, replica.model, why)
        return ActionResult(
            replica.name,
            action,
            bool(answer.get("ok")),
            str(answer.get("state", "")),
            str(answer.get("model", "")),
            str(answer.get("error", "")),
        )

    def _wait_for(
        self, result: ActionResult, states: set[ReplicaState], wait_s: float, model: str | None = None
    ) -> ActionResult:
        deadline = time.monotonic() + wait_s
        while result.ok and time.monotonic() < deadline:
            try:
                info = self.resolve(result.replica)
            except OperatorError:
                break
            if info.state in states and (model is None or info.model == model):
                return ActionResult(result.replica, result.action, True, info.state_label, info.model)
            time.sleep(0.05)
        return result

    def _app(self, cell: int = 0) -> Any:
        """The Celery app on a cell's broker (remote control reaches that cell's replicas)."""
        if cell not in self._celery:
            from tasks.celery.app import make_celery

            url = self.settings.cell_urls[cell] if len(self.clients) > 1 else self.settings.broker
            self._celery[cell] = make_celery(self.settings.model_copy(update={"broker_url": url, "cells": []}))
        return self._celery[cell]

    # -- rebalancing --------------------------------------------------------------------

    def demand_snapshot(self, window_s: int = 10) -> Snapshot:
        """What the rebalance policy decides on: demand over the last `window_s` seconds."""
        snap = self.snapshot(window_s)
        slots = [
            ReplicaSlot(r.name, r.model, r.state, r.max_batch * 1000.0 / r.batch_ms if r.batch_ms else 0.0)
            for r in snap.replicas
        ]
        demand: dict[str, ModelDemand] = {}
        for model in sorted(self.settings.models):
            rows = [t for t in snap.traffic if t.model == model]
            demand[model] = ModelDemand(
                model,
                arrival_rate=sum(t.arrival_rate for t in rows),
                paid_rate=sum(t.arrival_rate for t in rows if t.tier == PAID),
                oldest_ms=max((t.oldest_ms for t in rows), default=0.0),
            )
        return Snapshot(slots, demand)

    def rebalance_once(self, policy: RebalancePolicy, window_s: int = 10) -> tuple[list[Decision], list[ActionResult]]:
        decisions = policy.decide(self.demand_snapshot(window_s))
        results = [self.move(d.replica, d.to_model) for d in decisions if d.is_move]
        return decisions, results

    def rebalance(
        self,
        auto: bool = False,
        config: RebalanceConfig | None = None,
        clock: Clock | None = None,
        every_s: float = 2.0,
        stop: threading.Event | None = None,
    ) -> Iterator[tuple[list[Decision], list[ActionResult]]]:
        """Once (a policy that acts on what it sees now: no waiting to confirm), or, with
        `auto`, every `every_s` until `stop` is set, with the configured hysteresis."""
        if not auto:
            once = RebalancePolicy(config or RebalanceConfig(hold_ms=0.0, cooldown_ms=0.0), clock or SystemClock())
            yield self.rebalance_once(once)
            return
        policy = RebalancePolicy(config or RebalanceConfig(), clock or SystemClock())
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                yield self.rebalance_once(policy)
            except (redis.RedisError, OperatorError) as exc:
                log.warning("rebalance: %s", exc)
            stop.wait(every_s)
