"""The replica's heartbeat: its registry entry, the broker's clock, the stall watchdog."""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

from redis.typing import EncodableT

from control.broker.registry import ENGINE_PREFIX
from control.core.lifecycle import ReplicaState, can_transition, transition
from tasks.replica.broker import BrokerError
from tasks.replica.lease import monotonic_ms

if TYPE_CHECKING:
    from tasks.replica.replica import Replica

log = logging.getLogger(__name__)

STALLED_BEATS = 2  # beats in a row that find the engine stalled before the replica gives up


def beat(replica: Replica) -> None:
    """The heartbeat thread: until the replica stops, every `heartbeat_s`."""
    config = replica.config
    stalled_beats = 0
    last = monotonic_ms()
    while not replica.stopped.wait(config.heartbeat_s):
        now = monotonic_ms()
        if now - last > config.ttl_s * 1000 * 2 / 3:
            log.warning("heartbeat %.0f ms late: the registry may have dropped this replica", now - last)
        last = now
        stalled_beats = stalled_beats + 1 if replica.is_stalled() else 0
        if stalled_beats >= STALLED_BEATS:
            give_up_stalled(replica)
        try:
            replica.sync_clock()
            replica.publish_state()
        except BrokerError:
            log.warning("heartbeat failed")


def give_up_stalled(replica: Replica) -> None:
    """Say so, then exit: the lease lapses, the held requests are re-queued
    elsewhere, and the supervisor starts a fresh replica."""
    log.error(
        "batch running %.0f ms (expected %.0f): restarting",
        replica.watchdog.running_ms(),
        replica.engine.expected_batch_ms(),
    )
    if can_transition(replica.state, ReplicaState.STALLED):
        replica.state = transition(replica.state, ReplicaState.STALLED)
    try:
        replica.publish_state()
    finally:
        os._exit(3)


def report(replica: Replica) -> dict[str, EncodableT]:
    """What the replica publishes in the registry (and answers over remote control)."""
    r = replica
    with r.cond:
        buffered = len(r.collector)
    return {
        "model": r.model,
        "state": r.state.label,
        "held": buffered + r.num_running(),
        "moving_to": r.moving_to,
        "backend": r.engine.name,
        "max_batch": r.engine.max_batch,
        "batch_ms": r.engine.expected_batch_ms(),
        "buffered": buffered,
        "busy": int(r.busy),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "seen_ms": r.clock.now_ms(),
        "why_not_ready": r.why_not_ready,
        "clock_offset_ms": round(getattr(r.clock, "offset_ms", 0.0), 1),
        **r.stats.as_fields(),
        **r.perf.as_fields(monotonic_ms()),
        **_engine_fields(r),
    }


def _engine_fields(replica: Replica) -> dict[str, float]:
    stats = getattr(replica.engine, "stats", None)
    if stats is None:
        return {}
    fields = {f"{ENGINE_PREFIX}{k}": round(v, 3) for k, v in _numeric(stats()).items()}
    if replica.engine.continuous:  # the loop around the steps: take, step, deliver
        fields[f"{ENGINE_PREFIX}total_loop_ms"], fields[f"{ENGINE_PREFIX}total_loops"] = replica.loop_times
    return fields


def _numeric(stats: dict[str, object]) -> dict[str, float]:
    return {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and not isinstance(v, bool)}
