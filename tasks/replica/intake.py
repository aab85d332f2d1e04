"""Requests coming in: buffered for the loop, handed back, or recorded as held.

The Celery consumer hands each request to `Intake.submit` (through the replica). The
recorder thread writes what arrived into the replica's held hash, so that a sweep can
re-queue it if this replica dies.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from control.core import protocol as p
from control.core.lifecycle import ReplicaState, transition
from tasks.policy.collector import Pending
from tasks.replica.broker import BrokerError

if TYPE_CHECKING:
    from tasks.replica.core import ReplicaCore

log = logging.getLogger(__name__)

RECORD_MS = 3.0  # arrivals are written to the held hash in groups gathered this long


@dataclass
class Held:
    """What the replica keeps for a buffered request besides the policy fields."""

    job: p.Job
    message: str | None = None  # the queue message as taken, for requests popped at a launch
    copy: bool = False  # a second copy (a hedge) of a request another replica runs
    member: str = ""  # its entry in the model's running set, while hedging is on


def held(pending: Pending) -> Held:
    return pending.payload


class Intake:
    def __init__(self, replica: ReplicaCore) -> None:
        self.replica = replica
        self._arrivals = threading.Condition()
        self._unrecorded: list[p.Job] = []  # taken from the queue, not yet in the held hash
        # Buffered requests may be copied into another host's batch (the loop's policy hedges):
        # the recorder adds them to the model's running set.
        self.copyable = False
        self.recorder = threading.Thread(target=self._record, name=f"held-{replica.name}", daemon=True)

    def pending(self, job: p.Job, message: str | None = None) -> Pending:
        r = self.replica
        return Pending(
            job.id,
            job.tier,
            job.received_ms,
            job.deadline_ms,
            Held(job, message),
            r.clock.now_ms(),
            behind=job.behind,
            forwarded=job.forwarded,
            stranded=job.stranded,
        )

    def submit(self, job: p.Job) -> bool:
        """Buffer one request (called from the consumer's thread, right after it took the
        message from the queue); the recorder thread writes it into the held hash within
        `RECORD_MS`. False: handed back to the queue instead (`_hands_back`)."""
        r = self.replica
        if self._hands_back(job):
            return False
        pending = self.pending(job)
        if r.engine.continuous:
            # A continuous engine takes requests one by one, tens a second: the record
            # is written right here, in the consumer's thread, before the request is
            # buffered. The recorder thread's grouping would leave it unrecorded while
            # the engine's step holds the interpreter, a window a kill falls into.
            r.broker.record_held([job])
        with r.cond:
            if r.state == ReplicaState.DRAINED:  # a pull sent just before the drain: run it
                r.state = transition(r.state, ReplicaState.DRAINING)
            r.collector.add(pending)
            r.cond.notify()
        if not r.engine.continuous:
            self.hold([job])
        return True

    def _hands_back(self, job: p.Job) -> bool:
        """A pull sent before the gate shut (`kombu_internals.gate_pulls` lets it finish)
        brought a request this replica would not have pulled now: it is busy and not yet in
        its lead (or, with PULL_EARLY, a peer frees first), or its buffer is full. Here it
        would wait for a batch to end; it goes back to the front of its queue instead, for
        the consumer that asks next (each consumer hands back at most the one message its
        last pull brings, so it does not circle). A replica
        that is draining keeps it and runs it; one that is stopping hands it back whatever
        `hand_back` says (its loop may have run its last batch, and a request kept then
        would wait for its deadline)."""
        r = self.replica
        if r.stopping:  # a stopping replica's gate is shut: taken while shut, and handed back
            r.stats.num_taken_shut += 1
            return self._push_back(job)
        if not r.is_taking() or r.wants_messages():
            return False
        r.stats.num_taken_shut += 1
        return r.config.hand_back and self._push_back(job)

    def _push_back(self, job: p.Job) -> bool:
        try:
            self.replica.broker.push_back(job)
        except BrokerError:  # it runs here, a batch later; if the push did land (a timed-out
            return False  # reply), the claim at launch lets only one of the two copies run
        self.replica.stats.num_handed_back += 1
        return True

    def hold(self, jobs: list[p.Job]) -> None:
        """Hand requests to the recorder thread."""
        if not jobs:
            return
        with self._arrivals:
            first = not self._unrecorded  # later ones ride the group the recorder gathers now
            self._unrecorded.extend(jobs)
            if first:
                self._arrivals.notify()

    def _record(self) -> None:
        """Write arrivals into the held hash (and, where copies of them may be made, the
        model's running set): one RECORD script call for what arrived within
        `RECORD_MS` of the first, so the consumer never waits for it and a pulled batch (a
        burst of messages) costs a few round trips, not one each."""
        stopped = self.replica.stopped
        while True:
            with self._arrivals:
                while not self._unrecorded and not stopped.is_set():
                    self._arrivals.wait(0.5)
                if not self._unrecorded:
                    return
            stopped.wait(RECORD_MS / 1000.0)
            with self._arrivals:
                jobs, self._unrecorded = self._unrecorded, []
            r = self.replica
            r.broker.record_held(jobs, r.host() if self.copyable else None)
