"""The replica's heartbeat: its registry entry, the broker's clock, the stall watchdog; and
its pulse, a key that lapses soon after the process stops."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from control.core.lifecycle import ReplicaState, can_transition, transition
from tasks.replica.broker import BrokerError
from tasks.replica.lease import monotonic_ms

if TYPE_CHECKING:
    from tasks.replica.core import ReplicaCore

log = logging.getLogger(__name__)

STALLED_BEATS = 2  # beats in a row that find the engine stalled before the replica gives up
PULSE_EVERY = 0.4  # the pulse is renewed at this share of its lifetime


def beat(replica: ReplicaCore) -> None:
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


def pulse(replica: ReplicaCore) -> None:
    """The pulse thread (PULSE_MS > 0): until the replica stops. A replica stopped without a
    word (its host gone) may have a pull outstanding that takes a request it never records;
    the pulse lapses within PULSE_MS, and the gateways put such requests back in line then,
    not a lease and a sweep later (RESCUE)."""
    ttl_ms = replica.config.pulse_ms
    while not replica.stopped.wait(ttl_ms * PULSE_EVERY / 1000.0):
        try:
            replica.broker.pulse(ttl_ms)
        except BrokerError:
            pass  # the next one tries again; a lapse only costs the gateways a RESCUE call


def give_up_stalled(replica: ReplicaCore) -> None:
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
