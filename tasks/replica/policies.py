"""What the two batching policies do differently within the loop's phases (loop.py).

- static: a batch is popped when the collector says it is due, and runs to its end
  (`run_batch`); the replica is busy from the pop to the answer.
- continuous: requests are popped into the engine's free slots at every turn and join
  it between steps; each turn runs one step and answers what finished.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from control.core import protocol as p
from tasks.engine.contract import RequestStatus, StepOutput, run_batch
from tasks.policy.collector import Pending
from tasks.replica.broker import BrokerError
from tasks.replica.device import Device, StepDevice, Stepped
from tasks.replica.intake import held
from tasks.replica.lease import monotonic_ms

if TYPE_CHECKING:
    from tasks.replica.core import ReplicaCore

log = logging.getLogger(__name__)

MIN_LEAD_MS = 5.0  # the next static batch is taken at least this long before the engine frees
PREP_SAMPLES = 15

Finished = tuple[Pending, StepOutput, float]


class Phases(Protocol):
    """The loop's shared phases a policy calls (loop.py)."""

    in_hand: list[Pending]

    def deliver(self, finished: list[Finished], batch_size: int, end: float, ends_batch: bool) -> None: ...

    def result(self, job: p.Job, out: StepOutput, batch_size: int, start: float, end: float) -> p.Result | p.Failed: ...


class Policy(Protocol):
    def wait(self) -> bool | None:
        """Block until a turn is due: True to take work, False only to renew the lease;
        None once stopping with nothing left."""
        ...

    def room(self) -> tuple[int, int, int]:
        """Under the lock: how many paid (and free in line) requests a take may bring in
        place of buffered free ones (behind), and how many of any tier for empty seats."""
        ...

    def pop(self, now_ms: float) -> list[Pending]:
        """Under the lock: the requests this turn takes from the buffer."""
        ...

    def pop_rest(self, batch: list[Pending]) -> list[Pending]:
        """Under the lock, after `pop`: what the batch leaves in the buffer that goes back
        to the front of the queue, for a peer's start (`Collector.pop_rest`)."""
        ...

    def record(self, jobs: list[p.Job]) -> None:
        """Record late paid requests that stay buffered as held."""
        ...

    def spreads(self) -> bool:
        """Does a take read the peers' launches, to spread this replica's starts from theirs?"""
        ...

    def run(self, batch: list[Pending], turn_started_ms: float) -> None: ...

    def takes(self) -> bool:
        """Is a take due now (a turn may be due only to answer a finished batch)?"""
        ...

    def batch_ms(self) -> float:
        """From a take to a request's answer at the most, the take aside: what the buffer's
        deadline rule (`Collector.finish_cutoff_ms`) allows for."""
        ...

    def finish(self) -> None:
        """Answer what the engine finished since the last turn."""
        ...

    def running(self) -> bool:
        """Does the engine hold (or is it about to run) work of this policy's own?"""
        ...

    def abort(self, attempts: list[str]) -> None:
        """Running requests that leave the engine before its next step."""
        ...

    def close(self) -> None:
        """The loop has ended."""
        ...

    def hedge_finish_ms(self, now_ms: float) -> float | None:
        """Under no lock: when a batch taken now ends, if its empty slots may carry second
        copies of requests running or buffered elsewhere (free-slot hedging); None where a
        slot is not free."""
        ...


class StaticPolicy:
    """Static batches, overlapped: the loop takes, settles and claims the next batch while
    the engine runs this one (device.py), and answers a finished batch while the next runs."""

    def __init__(self, replica: ReplicaCore, loop: Phases, hold: Callable[[list[p.Job]], None]) -> None:
        self.replica = replica
        self.loop = loop
        self.hold = hold  # the intake's recorder thread
        self.device = Device(replica, self._run_engine)
        self._prep_ms: deque[float] = deque(maxlen=PREP_SAMPLES)  # a take and settle, start to staged
        self._measured_lead_ms = 0.0  # twice their median, set as each is measured
        self._hands_back = False  # the last urgent mark looked only as far as a peer's start

    def lead_ms(self) -> float:
        """How long before the engine frees the next batch is taken: twice the measured take
        and settle (at most a tenth of a batch), so it is staged when the engine is free."""
        return min(max(MIN_LEAD_MS, self._measured_lead_ms), self.replica.engine.expected_batch_ms() / 10)

    def _engine_in_ms(self, now_ms: float, start_ms: float | None = None) -> float | None:
        """Under the lock: how long until a batch taken now is due on the engine (0: now);
        None while one is staged already. `start_ms`: `_start_at(now_ms)`, if known."""
        if self.device.staged is not None:
            return None
        start = self._start_at(now_ms) if start_ms is None else start_ms
        return max(0.0, start - now_ms - self.lead_ms())

    def _start_at(self, now_ms: float) -> float:
        """Under the lock: when the next batch starts, the engine free and the starts spread
        (and so whether the gate holds back, `PullGate.holding`)."""
        r = self.replica
        frees_at = now_ms + self.device.frees_in_ms(monotonic_ms())
        start = r.collector.staggered_start_ms(frees_at, r.gate.peer_launches, self._slot_ms())
        r.gate.holding = start > frees_at
        return start

    def _slot_ms(self) -> float:
        """One batch slot of this replica: its measured cycle, never less than its batch."""
        return max(self.replica.engine.expected_batch_ms(), self.replica.perf.cycle_ms())

    def _due(self, now_ms: float, start_ms: float | None = None) -> bool:
        return self._is_due(self.replica.collector.wait_ms(now_ms), self._engine_in_ms(now_ms, start_ms))

    def _is_due(self, wait: float | None, engine_in: float | None) -> bool:
        """A batch is due (the collector's `wait`) and the engine takes it soon (`engine_in`)."""
        return (wait == 0 or (wait is not None and self.replica.is_flushing())) and engine_in == 0

    def wait(self) -> bool | None:
        r = self.replica
        with r.cond:
            while True:
                if self.device.done:
                    return True
                now = r.clock.now_ms()
                wait = r.collector.wait_ms(now)
                if wait is None and r.stopping and self.device.idle():
                    return None
                engine_in = self._engine_in_ms(now)
                if self._is_due(wait, engine_in):
                    return True
                renew_in = r.lease.due_in_ms()
                if renew_in <= 0:
                    return False
                timeout = renew_in
                if wait is not None and engine_in is not None:
                    timeout = min(timeout, max(0.0 if r.is_flushing() else wait, engine_in))
                r.cond.wait(max(timeout, 0.1) / 1000.0)

    def takes(self) -> bool:
        r = self.replica
        with r.cond:
            return self._due(r.clock.now_ms())

    def batch_ms(self) -> float:
        return self.replica.engine.expected_batch_ms()

    def running(self) -> bool:
        with self.replica.cond:
            return not self.device.idle()

    def room(self) -> tuple[int, int, int]:
        c = self.replica.collector
        self._mark_urgent(self.replica.clock.now_ms())
        return c.num_free(), c.num_behind(), max(0, c.config.max_batch - len(c))

    def _mark_urgent(self, now_ms: float, start_ms: float | None = None) -> None:
        """Under the lock: what must ride the batch taken now is what cannot wait for this
        replica's batch after it, one measured slot after this one starts; or, where what
        the batch leaves goes back to the queue for a peer's start, what cannot wait for
        that (`Collector.urgent_horizon_ms`)."""
        r = self.replica
        start = max(now_ms, self._start_at(now_ms) if start_ms is None else start_ms)
        slot = self._slot_ms()
        horizon = r.collector.urgent_horizon_ms(start, r.gate.peer_launches, slot) if r.config.hand_back_rest else slot
        self._hands_back = horizon < slot
        r.collector.urgent_before_ms = start + horizon

    def pop(self, now_ms: float) -> list[Pending]:
        r = self.replica
        start = self._start_at(now_ms)  # once: the urgent mark and the due check both read it
        self._mark_urgent(now_ms, start)
        batch = r.collector.pop_batch() if self._due(now_ms, start) else []
        if batch:  # it starts when the engine frees
            r.start_batch(now_ms + self.device.frees_in_ms(monotonic_ms()), r.engine.expected_batch_ms())
            r.batch_started = monotonic_ms()
        return batch

    def pop_rest(self, batch: list[Pending]) -> list[Pending]:
        c = self.replica.collector
        if not batch or not self._hands_back or not c.waiting:
            return []
        return c.pop_rest({pending.id for pending in batch})

    def record(self, jobs: list[p.Job]) -> None:
        self.hold(jobs)

    def spreads(self) -> bool:
        """The next batch is taken before the last one is answered (overlapped), so the
        launches an answer brings are a batch old: a take reads them afresh (one command in
        its round trip), and a batch that is not full waits for its phase there
        (`Collector.stagger_from`)."""
        return True

    def run(self, batch: list[Pending], took_ms: float) -> None:
        """Stage the batch for the engine, which starts it the moment it is free (`took_ms`:
        when the take that brought it began)."""
        if not batch:
            return
        r = self.replica
        r.events.started(batch)
        r.stats.last_batch_size = len(batch)  # shown while it runs
        with r.cond:
            self.device.stage(batch)
        self.loop.in_hand = []  # the engine's now: `finish` answers them
        if not all(held(pending).copy for pending in batch):  # a batch of copies is no take's
            self._prep_ms.append(monotonic_ms() - took_ms)
            self._measured_lead_ms = 2 * statistics.median(self._prep_ms)

    def finish(self) -> None:
        """Answer the batches the engine finished (one delivery each), in order."""
        r = self.replica
        while True:
            with r.cond:
                if not self.device.done:
                    return
                ran = self.device.done.popleft()
                last = self.device.idle()  # only this thread stages: it stays so until it answers
            self.loop.in_hand = ran.batch
            finished = [(pending, out, ran.start_ms) for pending, out in zip(ran.batch, ran.outputs, strict=True)]
            self.loop.deliver(finished, len(ran.batch), ran.end_ms, ends_batch=last)
            self.loop.in_hand = []
            if last:
                r.busy = False
            r.wake()
            r.events.succeeded(ran.batch, (ran.end_ms - ran.start_ms) / 1000.0)

    def abort(self, attempts: list[str]) -> None:
        """A static batch aborts its own requests between steps (`BatchRun.cancelled`)."""

    def hedge_finish_ms(self, now_ms: float) -> float | None:
        """A static batch costs the same however full: its empty slots are free."""
        with self.replica.cond:
            frees_in = self.device.frees_in_ms(monotonic_ms())
        return now_ms + frees_in + self.replica.engine.expected_batch_ms()

    def close(self) -> None:
        with self.replica.cond:
            self.device.close()

    def _run_engine(self, batch: list[Pending]) -> list[StepOutput]:
        """On the engine's thread: one batch to its end."""
        r = self.replica
        jobs = [held(pending).job for pending in batch]
        with r.watchdog.engine_running():
            return self._run_isolating(jobs, BatchRun(r, batch))

    def _run_isolating(self, jobs: list[p.Job], control: BatchRun) -> list[StepOutput]:
        """Run a batch; if the engine raises, find the request that makes it raise by
        halving, so that it fails alone and the rest of the batch is answered."""
        try:
            return run_batch(self.replica.engine, jobs, control)
        except Exception as exc:
            if len(jobs) == 1:
                log.warning("request %s failed in the engine: %r", jobs[0].id, exc)
                message = f"the engine failed on this request: {exc!r}"
                return [StepOutput(jobs[0].id, RequestStatus.FINISHED_ERROR, error=message)]
            log.warning("a batch of %d failed in the engine (%r); running it in halves", len(jobs), exc)
            mid = len(jobs) // 2
            return self._run_isolating(jobs[:mid], control) + self._run_isolating(jobs[mid:], control)


class BatchRun:
    """The `BatchControl` of one running static batch."""

    def __init__(self, replica: ReplicaCore, batch: list[Pending]) -> None:
        self.replica = replica
        self.jobs = {pending.id: held(pending).job for pending in batch}

    def cancelled(self) -> set[str]:
        """The batch's requests cancelled so far; a broker that does not answer cancels
        nothing (its failure is not the engine's: the batch runs on, its answers go
        through another cell where there is one)."""
        try:
            return set(self.replica.cancelled(self.jobs))
        except BrokerError:
            return set()

    def emit(self, request_id: str, text: str) -> None:
        self.replica.streams.add(self.jobs[request_id], text)

    def end_step(self) -> None:
        self.replica.watchdog.stepped()
        self.replica.streams.flush()
        self.replica.renew_lease_if_due()


class ContinuousPolicy:
    """Continuous batching, overlapped: the engine's thread (device.py) steps back to back;
    between its steps the loop's joins and aborts go in, and the loop answers what a step
    finished while the next one runs."""

    def __init__(self, replica: ReplicaCore, loop: Phases) -> None:
        self.replica = replica
        self.loop = loop
        self.device = StepDevice(replica)

    def joins_left(self) -> int:
        """Under the lock: how many more may be staged to join at the next step. A step
        takes at most its share of a batch (`max_batch` over a request's steps) and the
        urgent ones beyond it: the engine's slots then free a step's share at every step,
        not in cohorts, and a queued request waits a step for a slot, not a batch."""
        r = self.replica
        seats = r.free_seats()  # a slot a step frees is filled at the next one, no later
        steps = max(1.0, r.engine.expected_batch_ms() / max(r.engine.expected_step_ms(), 1e-3))
        left = math.ceil(r.engine.max_batch / steps) - len(self.device.joins)
        if left >= seats:  # the share does not bind: the urgent ones need no count
            return seats
        urgent = sum(1 for pending in r.collector.waiting if r.collector.is_urgent(pending))
        return min(seats, max(left, urgent))

    def wait(self) -> bool | None:
        r = self.replica
        with r.cond:
            while True:
                if self.device.done:
                    return True
                if len(r.collector) > 0 and self.joins_left() > 0:
                    return True
                if r.stopping and not r.collector and not r.joined and self.device.idle():
                    return None
                renew_in = r.lease.due_in_ms()
                if renew_in <= 0:
                    return True
                r.cond.wait(renew_in / 1000.0)

    def takes(self) -> bool:
        return True

    def batch_ms(self) -> float:
        """A request joins when the running step ends, then runs a batch's steps."""
        return self.replica.engine.expected_batch_ms() + self.replica.engine.expected_step_ms()

    def room(self) -> tuple[int, int, int]:
        c = self.replica.collector
        self._mark_urgent(self.replica.clock.now_ms())
        free = self.joins_left()
        return min(c.num_free(), free), 0, max(0, free - len(c))

    def _mark_urgent(self, now_ms: float) -> None:
        """Under the lock: a request that could not wait half a batch more joins first (slots
        free in cohorts: the next ones may be that far)."""
        self.replica.collector.urgent_before_ms = now_ms + self.replica.engine.expected_batch_ms() / 2

    def pop(self, now_ms: float) -> list[Pending]:
        r = self.replica
        self._mark_urgent(now_ms)
        batch = r.collector.pop_batch(limit=self.joins_left())
        if batch:
            r.busy = True
        return batch

    def pop_rest(self, batch: list[Pending]) -> list[Pending]:
        """What a step does not take waits for the next step, a step away."""
        return []

    def record(self, jobs: list[p.Job]) -> None:
        self.replica.broker.record_held(jobs)

    def spreads(self) -> bool:
        return False  # requests join at every step: no phase to keep

    def running(self) -> bool:
        return False  # what runs is in the replica's `joined`

    def abort(self, attempts: list[str]) -> None:
        with self.replica.cond:
            self.device.stage(aborts=attempts)

    def close(self) -> None:
        with self.replica.cond:
            self.device.close()

    def hedge_finish_ms(self, now_ms: float) -> float | None:
        """A continuous engine's row is not free: no hedging here (not measured yet)."""
        return None

    def run(self, batch: list[Pending], turn_started_ms: float) -> None:
        """Stage the batch's requests to join the engine before its next step."""
        r = self.replica
        now = r.clock.now_ms()
        jobs = []
        for pending in batch:
            job = held(pending).job
            if job.id in r.joined:  # a second copy of a running request (a rescue raced
                continue  # its record): it runs once; copies in one batch: `Collector.pop_batch`
            r.joined[job.id] = (pending, now)
            jobs.append(job)
        if jobs:
            with r.cond:
                self.device.stage(joins=jobs)
            r.events.started([pending for pending in batch if pending.id in r.joined])
        self.loop.in_hand = []  # the engine's now: `finish` answers them
        self._idle_if_empty()

    def finish(self) -> None:
        """Stream and answer what the engine's steps gave since the last turn."""
        r = self.replica
        while True:
            with r.cond:
                if not self.device.done:
                    break
                stepped = self.device.done.popleft()
            self._answer(stepped)
        self._idle_if_empty()

    def _answer(self, stepped: Stepped) -> None:
        r = self.replica
        finished: list[Finished] = []
        for request_id in stepped.joined:  # running from now: its start, for its answer and its waste
            if (entry := r.joined.get(request_id)) is not None:
                r.joined[request_id] = (entry[0], stepped.joined_ms)
        for out in stepped.refused + stepped.outputs:
            entry = r.joined.get(out.id)
            if entry is None:  # aborted, or answered already
                continue
            if out.is_finished:
                pending, joined_ms = r.joined.pop(out.id)
                finished.append((pending, out, joined_ms))
            else:
                r.streams.add(held(entry[0]).job, out.delta)
        r.streams.flush()
        if finished:
            end = stepped.end_ms
            self.loop.deliver(finished, max(1, stepped.running), end, ends_batch=False)
            r.events.succeeded([pd for pd, _out, _start in finished], (end - finished[0][0].arrived_ms) / 1000.0)
        r.wake()

    def _idle_if_empty(self) -> None:
        """The engine holds nothing, whatever emptied it (the last request finished, was
        cancelled or expired, lost its claim or was refused): the replica is idle."""
        r = self.replica
        if not r.busy or r.joined:
            return
        with r.cond:
            if not self.device.idle():
                return
            r.busy = False
        r.broker.mark_idle(r.model, r.idle_until_ms())
