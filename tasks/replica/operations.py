"""The operator's actions on a replica: drain, resume, move (states: control/core/lifecycle.py)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from control.core import protocol as p
from control.core.lifecycle import IllegalTransition, ReplicaState, can_transition
from tasks.replica.broker import BrokerError
from tasks.replica.lease import monotonic_ms

if TYPE_CHECKING:
    from tasks.replica.core import ReplicaCore

log = logging.getLogger(__name__)

QUIET_MS = 20.0  # a draining replica is drained once it held nothing twice this far apart


class Operations:
    def __init__(self, replica: ReplicaCore) -> None:
        self.replica = replica

    def drain(self) -> ReplicaState:
        """Take no new work; finish what is held; then report drained. Idempotent."""
        r = self.replica
        if r.state in (ReplicaState.DRAINING, ReplicaState.DRAINED):
            return r.state
        r.set_state(ReplicaState.DRAINING)
        try:  # peers must not count on this replica for the next batch
            r.broker.leave_idle(r.model)
        except BrokerError:
            log.warning("could not leave the idle and launch lists")
        return r.state

    def resume(self) -> ReplicaState:
        """Serve again (a drain is called off). Idempotent."""
        r = self.replica
        if r.state == ReplicaState.MOVING:
            raise ValueError("a moving replica serves again once its new model is loaded")
        if r.state != ReplicaState.SERVING:
            r.moving_to = ""
            r.set_state(ReplicaState.SERVING)
            r.rejoin_idle()
            r.wake()  # the consumer asks the gate again
        return r.state

    def move(self, model: str) -> ReplicaState:
        """Drain, then load `model`, consume its queue instead and serve it."""
        r = self.replica
        if r.load_engine is None:
            raise IllegalTransition(r.state, ReplicaState.MOVING)
        if model == r.model and r.state == ReplicaState.SERVING:
            return r.state
        if r.state == ReplicaState.MOVING or not (
            r.state == ReplicaState.DRAINED or can_transition(r.state, ReplicaState.DRAINING)
        ):
            raise IllegalTransition(r.state, ReplicaState.MOVING)
        r.moving_to = model
        state = self.drain()
        self.check_drained()
        return state

    def check_drained(self) -> None:
        """A draining replica that holds nothing, and whose consumer has no pull in
        flight, twice in a row at least `QUIET_MS` apart (a pull decided just before the
        gate shut may start a moment later), is drained; a drained one with a move to make
        makes it."""
        r = self.replica
        if r.state == ReplicaState.DRAINED and r.moving_to:
            self._start_move()
            return
        if r.state != ReplicaState.DRAINING:
            return
        with r.cond:
            quiet = not r.collector and not r.busy and not r.joined and not r.is_polling()
            now = monotonic_ms()
            if not quiet:
                r.quiet_since = None
                return
            if r.quiet_since is None:
                r.quiet_since = now
                return
            if now - r.quiet_since < QUIET_MS:
                return
        if r.set_state(ReplicaState.DRAINED, only_from=ReplicaState.DRAINING):
            log.info("replica %s drained", r.name)
            if r.moving_to:
                self._start_move()

    def _start_move(self) -> None:
        r = self.replica
        if not r.moving_to or not r.set_state(ReplicaState.MOVING, only_from=ReplicaState.DRAINED):
            return
        threading.Thread(target=self._move, name=f"move-{r.name}", daemon=True).start()

    def _move(self) -> None:
        """Load the other model (seconds for a real one: off the batching loop), switch
        the consumer to its queue, and serve it."""
        r = self.replica
        old, new = r.model, r.moving_to
        try:
            assert r.load_engine is not None
            engine = r.load_engine(new) if new != old else r.engine
            self._finish_old_model()
            r.switch_queue(p.queue_name(old), p.queue_name(new))
        except Exception:
            log.exception("could not move %s to %s; it stays drained on %s", r.name, new, old)
            r.moving_to = ""
            r.set_state(ReplicaState.DRAINED, only_from=ReplicaState.MOVING)
            return
        with r.cond:
            r.engine, r.model = engine, new
            r.collector.config.batch_ms = engine.expected_batch_ms()
            r.gate.peers(idle=True, launches=[])
        r.moving_to = ""
        try:
            r.broker.record_move(old, new)
        except BrokerError:
            log.warning("could not record the move of %s to %s", r.name, new)
        r.set_state(ReplicaState.SERVING, only_from=ReplicaState.MOVING)
        r.rejoin_idle()
        log.info("replica %s moved from %s to %s", r.name, old, new)
        r.wake()

    def _finish_old_model(self, timeout_s: float = 30.0) -> None:
        """Run anything of the old model still here before its engine goes (none, unless a
        pull slipped past the drained check): the loop runs it, as the replica takes no work."""
        r = self.replica
        deadline = monotonic_ms() + timeout_s * 1000
        while r.collector or r.busy or r.joined:
            if monotonic_ms() > deadline:
                raise TimeoutError("requests of the old model still running")
            r.stopped.wait(0.01)
