"""A replica's state and what its parts share (tasks/replica/replica.py puts them together).

The parts (intake, loop and policies, operations, heartbeat) each take this core; none
imports another's module but the loop, which drives the intake and the operations.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace

from control.broker import records
from control.core import protocol as p
from control.core.clock import BrokerClock, Clock
from control.core.lifecycle import ReplicaState, transition
from tasks.engine.contract import Engine
from tasks.policy.collector import Collector, Pending
from tasks.policy.pullgate import PullGate
from tasks.replica.broker import BrokerError, Client, FallbackReplies, Fields, ReplicaBroker
from tasks.replica.config import ReplicaConfig
from tasks.replica.events import EventSink, NoEvents
from tasks.replica.lease import BrokerDoubt, LeaseClock, monotonic_ms
from tasks.replica.perf import BatchTimes
from tasks.replica.stats import Stats
from tasks.replica.streaming import Streams
from tasks.replica.watchdog import Watchdog

log = logging.getLogger(__name__)


class ReplicaCore:
    def __init__(
        self,
        config: ReplicaConfig,
        engine: Engine,
        client: Client,
        clock: Clock,
        events: EventSink | None = None,
        wake: Callable[[], object] | None = None,
        envelope: Callable[[p.Job], str] | None = None,
        fallback: FallbackReplies | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.model = config.model
        self.engine = engine
        self.collector = Collector(replace(config.collector))
        self.clock = clock
        self.events = events or NoEvents()
        self.wake = wake or (lambda: None)
        self.broker = ReplicaBroker(client, config.name, envelope or (lambda job: job.model_dump_json()))
        self.fallback = fallback  # the other cells, where the replica's own broker does not take its answers
        self.gate = PullGate(config.collector.max_batch, config.pull_lead_ms, early=config.pull_early)
        self.stats = Stats()
        self.perf = BatchTimes()
        self.lease = LeaseClock(config.lease_ms)
        self.doubt = BrokerDoubt()
        self.watchdog = Watchdog(config.stall_ms)
        self.streams = Streams(self.broker)
        self.state = ReplicaState.STARTING  # changed only through control/core/lifecycle.py
        self.why_not_ready = ""
        self.load_engine: Callable[[str], Engine] | None = None  # set by the worker: what a move needs
        self.switch_queue: Callable[[str, str], None] = lambda old, new: None
        self.is_polling: Callable[[], bool] = lambda: False  # the consumer has a pull outstanding
        self.quiet_since: float | None = None  # monotonic ms since a draining replica held nothing
        self.joined: dict[str, tuple[Pending, float]] = {}  # continuous: running requests, when each joined
        self.frees_next = 0  # continuous: running requests the step under way finishes (set by its thread)
        self.loop_times = [0.0, 0]  # continuous: ms spent in turns of the loop that stepped, and those turns
        self.moving_to = ""  # the model a move loads once the replica is drained
        self.batch_started = 0.0  # monotonic ms of the running batch's (or step's) start
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)  # the loop's: work arrived, a batch ended, a state changed
        self.engine_cond = threading.Condition(self.lock)  # the engine's thread's: a batch is staged
        self.stopping = False
        self.stopped = threading.Event()
        self.turn = threading.Event()  # busy or state changed: the listener's turn may change (listener.py)
        self.loop_thread: threading.Thread | None = None  # set once the loop runs
        self._assemble()

    def _assemble(self) -> None:
        """The parts that take the core (the replica's loop, intake and operations)."""

    def host(self) -> str:
        return self.config.host or socket.gethostname()

    def min_run_ms(self) -> float:
        return self.engine.expected_batch_ms() + self.collector.config.margin_ms

    def sync_clock(self, samples: int = 1) -> None:
        """Read the broker's clock; a replica that cannot read it closely is not ready."""
        if not isinstance(self.clock, BrokerClock):
            return
        for _ in range(samples):
            self.clock.sync()
        error, limit = self.clock.error_ms, self.config.max_clock_error_ms
        self.why_not_ready = (
            f"clock: offset to the broker known only to {error:.0f} ms (limit {limit:.0f})" if error > limit else ""
        )

    # -- what the consumer asks ------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.gate.busy

    @busy.setter
    def busy(self, value: bool) -> None:
        if self.gate.busy != value:  # however it ended (a batch claimed elsewhere, a failed take)
            self.turn.set()
        self.gate.busy = value

    def start_batch(self, at_ms: float, batch_ms: float) -> None:
        """A batch starts at `at_ms` and runs `batch_ms` (`PullGate.start`): busy, as the
        `busy` setter would say it, so the listener hands its turn on."""
        if not self.gate.busy:
            self.turn.set()
        self.gate.start(at_ms, batch_ms)

    def wants_messages(self) -> bool:
        """May the consumer pull another request from the shared queue now (`PullGate`)?
        Read without the lock: a stale answer costs one message at most."""
        if not self.is_taking():
            return False
        if self.engine.continuous:
            return self.gate.wants_continuous(len(self.collector), self.free_seats())
        return self.gate.wants(self.clock.now_ms(), len(self.collector), self.engine.expected_batch_ms())

    def free_seats(self) -> int:
        """Continuous: requests that may be staged to join, the engine's slots not running
        nor staged and as many more as the step under way finishes (`Engine.frees_after_step`),
        which join at the step after it."""
        return max(0, self.engine.max_batch + self.frees_next - len(self.joined))

    def reopens_at_ms(self) -> float | None:
        """When a shut gate opens again by itself (None: not before work leaves)."""
        if self.engine.continuous or not self.is_taking():
            return None
        return self.gate.reopens_at(self.clock.now_ms(), len(self.collector), self.engine.expected_batch_ms())

    # -- shared by the parts -----------------------------------------------------

    def is_taking(self) -> bool:
        return not self.stopping and self.state.takes_work

    def is_flushing(self) -> bool:
        """Run what is buffered now, without waiting to fill a batch."""
        return self.stopping or not self.state.takes_work

    def num_running(self) -> int:
        if self.engine.continuous:
            return len(self.joined)
        return self.stats.last_batch_size if self.busy else 0

    def is_stalled(self) -> bool:
        return self.watchdog.is_stalled(self.engine.expected_batch_ms())

    def cancelled(self, ids: Iterable[str]) -> list[str]:
        """Which of `ids` their clients cancelled (one MGET); none while the broker is doubted."""
        if self.doubt.skips():
            return []
        try:
            reasons = self.broker.cancels_and_paid(self.model, list(ids), 0)[0]
        except BrokerError:
            self.doubt.failed()
            raise
        self.doubt.answered()
        return list(reasons)

    def lease_ms(self) -> float:
        """The lease a renewal sent now sets (the next one is timed from now)."""
        return self.lease.renewal_ms(self.engine.expected_step_ms())

    def renew_lease_if_due(self) -> None:
        """Called by the engine between steps: a batch longer than the lease keeps it.
        A broker that is away is not the engine's failure: the batch goes on, and once
        the broker failed twice in a row the renewals leave it alone for a while too."""
        if self.lease.is_due() and not self.doubt.is_sure():
            try:
                self.broker.renew_lease(self.lease_ms())
            except BrokerError:
                self.doubt.failed()
                log.warning("could not renew the lease")
            else:
                self.doubt.answered()

    def idle_until_ms(self) -> float:
        """Until when an idle entry written now holds: peers drop a stale one."""
        return self.clock.now_ms() + self.config.ttl_s * 1000

    def rejoin_idle(self) -> None:
        """Back in the model's idle list (a heartbeat only refreshes an entry), so peers
        leave new work to it as to any idle replica."""
        if self.busy:
            return
        try:
            self.broker.mark_idle(self.model, self.idle_until_ms())
        except BrokerError:
            log.warning("could not rejoin the idle list")

    def set_state(self, wanted: ReplicaState, only_from: ReplicaState | None = None) -> bool:
        """Move to `wanted` (IllegalTransition if the table forbids it); with `only_from`,
        only if the replica is in that state now (else False: another thread moved it)."""
        with self.cond:
            if only_from is not None and self.state != only_from:
                return False
            self.state = transition(self.state, wanted)
            self.quiet_since = None
            self.cond.notify_all()
        self.turn.set()  # drained, resumed or moved: the listener's turn may change
        try:
            self.publish_state()
        except BrokerError:
            log.warning("could not publish the state %s", wanted.label)
        return True

    def report(self) -> Fields:
        """What the replica publishes in the registry (and answers over remote control)."""
        with self.cond:
            buffered = len(self.collector)
        return records.pack_replica_entry(
            model=self.model,
            state=self.state.label,
            held=buffered + self.num_running(),
            moving_to=self.moving_to,
            backend=self.engine.name,
            max_batch=self.engine.max_batch,
            batch_ms=self.engine.expected_batch_ms(),
            join_ms=self.engine.expected_step_ms() if self.engine.continuous else 0.0,
            buffered=buffered,
            busy=self.busy,
            host=self.host(),
            pid=os.getpid(),
            seen_ms=self.clock.now_ms(),
            why_not_ready=self.why_not_ready,
            clock_offset_ms=round(getattr(self.clock, "offset_ms", 0.0), 1),
            counters={**self.stats.as_fields(), **self.perf.as_fields(monotonic_ms())},
            engine=self._engine_fields(),
        )

    def _engine_fields(self) -> dict[str, float]:
        """The engine's own figures (the registry entry stores them under a prefix)."""
        stats = getattr(self.engine, "stats", None)
        if stats is None:
            return {}
        fields = {k: round(v, 3) for k, v in _numeric(stats()).items()}
        if self.engine.continuous:  # the loop around the steps: take, step, deliver
            fields["total_loop_ms"], fields["total_loops"] = self.loop_times
        return fields

    def publish_state(self) -> None:
        fields = self.report()
        idle = None
        if not self.busy and self.state.takes_work:  # a heartbeat racing a batch start only refreshes
            refresh_only = self.loop_thread is not None and self.loop_thread.is_alive()
            idle = (self.model, self.idle_until_ms(), refresh_only)
        self.broker.publish(fields, self.config.ttl_s, idle)


def _numeric(stats: dict[str, object]) -> dict[str, float]:
    return {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and not isinstance(v, bool)}
