"""SINGLE_LISTENER: at most one idle replica of a model waits on the model's queue.

Idle replicas that all wait on the queue share its arrivals in turn (the broker hands
each to the consumer that has waited longest). Each starts a small batch `max_wait` after
its first request, and they start and end together (docs/decisions/0033). Here an idle
replica with nothing gathered pulls only while it holds its model's listener token. The
holder keeps the token while it gathers, so every arrival reaches it. It hands the token
on when its batch starts, and one idle replica blocked on the turn list takes it. Busy
replicas pull from their lead (`PullGate`), with LEAD_YIELDS only while no idle replica
holds the token: this thread reads it every `WAIT_S` from a busy replica's lead on.

A holder that dies loses the token when it expires (`TOKEN_MS`); the waiting replicas
try to take it every `WAIT_S`. While no one holds it, arrivals wait for the next holder
or for a busy replica's lead.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from tasks.replica.broker import BrokerError

if TYPE_CHECKING:
    from tasks.replica.core import ReplicaCore

log = logging.getLogger(__name__)

TOKEN_MS = 80  # the token lapses this long after its holder's last renewal
RENEW_S = 0.025  # how often the holder renews it
WAIT_S = 0.04  # how long a waiting replica blocks on the turn list before it tries the token again
AWAY_S = 0.5  # after a broker error, or while the replica takes no work


class Listener:
    """The thread that takes, keeps and hands on the replica's turn to listen."""

    def __init__(self, replica: ReplicaCore) -> None:
        self.replica = replica
        self.enabled = replica.config.single_listener and not replica.engine.continuous
        replica.gate.listens = not self.enabled
        replica.gate.lead_yields = self.enabled and replica.config.lead_yields
        self.changed = replica.turn  # busy or state changed, or the replica stops
        self._held = ""  # the model whose token this replica holds
        self.thread = threading.Thread(target=self._run, name=f"listener-{replica.name}", daemon=True)

    def start(self) -> None:
        if self.enabled:
            self.thread.start()

    def stop(self, timeout_s: float) -> None:
        if self.enabled:
            self.changed.set()
            self.thread.join(timeout_s)

    def _run(self) -> None:
        r = self.replica
        failures = 0
        while not r.stopped.is_set() and not r.stopping:
            self.changed.clear()
            try:
                self._turn()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any one turn
                if isinstance(exc, BrokerError):
                    log.warning("listener token: the broker did not answer")
                else:
                    log.exception("listener token")
                self._lost()
                failures += 1
                # One blip (every idle replica sees it at once) costs a retry's wait, not AWAY_S.
                self.changed.wait(WAIT_S if failures == 1 else AWAY_S)
        self._hand_on()

    def _turn(self) -> None:
        """One step: hand the token on (a batch started, the model changed, the replica
        takes no work), keep it, or wait for it."""
        r = self.replica
        full = len(r.collector) >= r.collector.config.max_batch  # read without the lock: a hint
        if self._held and (r.busy or full or self._held != r.model or not r.is_taking()):
            self._hand_on()  # full: a holder waiting out its stagger pulls no more
            return
        if r.busy and r.is_taking() and r.gate.lead_yields:
            self._watch_lead()
            return
        if not r.is_taking() or r.busy:
            self.changed.wait(AWAY_S if not r.is_taking() else 1.0)
            return
        if full:
            self.changed.wait(WAIT_S)
            return
        if self._held:
            if not r.broker.renew_listener(self._held, TOKEN_MS):
                self._lost()
                return
            self.changed.wait(RENEW_S)
            return
        model = r.model
        if r.broker.take_listener(model, TOKEN_MS):
            self._held = model
            r.gate.listens = True
            r.wake()  # the consumer asks the gate again
            return
        r.broker.await_listener(model, WAIT_S)

    def _watch_lead(self) -> None:
        """Busy (LEAD_YIELDS): from its lead on, read every `WAIT_S` whether another
        replica holds the model's listener token; the consumer pulls in the lead only
        while none does, and is woken when the token is gone."""
        r = self.replica
        batch_end = r.gate.ends_at_ms  # which batch's lead this read is for
        until_lead_s = (r.gate.pull_at_ms - r.clock.now_ms()) / 1000.0
        if until_lead_s > 0:
            self.changed.wait(min(until_lead_s, 1.0))
            return
        try:
            elsewhere = r.broker.listener_holder(r.model) not in ("", r.name)
        except BrokerError:
            elsewhere = False  # unknown: pull in the lead, as without the rule
            log.warning("listener token: the broker did not answer a busy replica's read")
        if r.gate.ends_at_ms != batch_end:
            return  # a batch started meanwhile: its own lead reads again
        was = r.gate.listener_elsewhere
        r.gate.listener_elsewhere = elsewhere
        if was and not elsewhere:
            r.wake()  # the consumer asks the gate again
        self.changed.wait(WAIT_S)

    def _hand_on(self) -> None:
        held, self._held = self._held, ""
        self.replica.gate.listens = False
        if not held:
            return
        try:
            self.replica.broker.hand_on_listener(held)
        except BrokerError:
            log.warning("could not hand the listener token on: it lapses in %d ms", TOKEN_MS)

    def _lost(self) -> None:
        self._held = ""
        self.replica.gate.listens = False
