"""One model replica: its core (core.py) and the parts that do its jobs, with their threads.

No Celery here: the Celery consumer hands each request to `Replica.submit`. The parts:
the intake and its recorder thread (intake.py), the batching loop and its phases (loop.py,
policies.py), the operator's actions (operations.py), the heartbeat and the pulse
(heartbeat.py); every
broker call is broker.py's.
"""

from __future__ import annotations

import logging
import threading
import time

from control.core import protocol as p
from control.core.lifecycle import ReplicaState, can_transition, transition
from tasks.replica import heartbeat
from tasks.replica.broker import BrokerError
from tasks.replica.core import ReplicaCore
from tasks.replica.intake import Intake
from tasks.replica.listener import Listener
from tasks.replica.loop import Loop
from tasks.replica.operations import Operations

log = logging.getLogger(__name__)


class Replica(ReplicaCore):
    def _assemble(self) -> None:
        self.intake = Intake(self)
        self.ops = Operations(self)
        self.loop = Loop(self, self.intake, self.ops)
        self._batching = threading.Thread(target=self.loop.run, name=f"batching-{self.name}", daemon=True)
        self.loop_thread = self._batching
        self._beat = threading.Thread(target=heartbeat.beat, args=(self,), name=f"heartbeat-{self.name}", daemon=True)
        self._pulse = threading.Thread(target=heartbeat.pulse, args=(self,), name=f"pulse-{self.name}", daemon=True)
        self.listener = Listener(self)

    def start(self) -> None:
        self._take_over_name()
        self.sync_clock(samples=5)
        self.state = transition(self.state, ReplicaState.SERVING)  # ready unless `why_not_ready`
        self.broker.renew_lease(self.lease_ms())
        self.publish_state()
        self._batching.start()
        self._beat.start()
        if self.config.pulse_ms > 0:
            self.broker.pulse(self.config.pulse_ms)
            self._pulse.start()
        self.intake.recorder.start()
        self.listener.start()

    def _take_over_name(self) -> None:
        """A replica restarted under its old name first re-queues what the old one held
        (after its lease lapses), so the two never share a held hash."""
        pttl = self.broker.lease_left_ms()
        if pttl > 0:
            time.sleep(pttl / 1000.0)
        requeued, expired = self.broker.release_held(self.min_run_ms())
        if requeued or expired:
            log.warning("took over %s: re-queued %d held requests, %d expired", self.name, requeued, expired)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop taking work, run what is buffered, leave the registry."""
        if can_transition(self.state, ReplicaState.STOPPING):
            self.state = transition(self.state, ReplicaState.STOPPING)
        with self.cond:
            self.stopping = True
            self.gate.stopping = True
            self.cond.notify_all()
        self._batching.join(timeout_s)
        self.stopped.set()
        self.listener.stop(timeout_s)
        self._beat.join(timeout_s)
        if self._pulse.is_alive():
            self._pulse.join(timeout_s)
        self.intake.recorder.join(timeout_s)
        try:
            self.broker.leave(self.model)
        except BrokerError:
            log.warning("could not leave the replica registry")

    def submit(self, job: p.Job) -> bool:
        """Buffer one request; False: handed back to the queue instead (intake.py)."""
        return self.intake.submit(job)

    def drain(self) -> ReplicaState:
        return self.ops.drain()

    def resume(self) -> ReplicaState:
        return self.ops.resume()

    def move(self, model: str) -> ReplicaState:
        return self.ops.move(model)
