"""What the two batching policies do differently within the loop's phases (loop.py).

- static: a batch is popped when the collector says it is due, and runs to its end
  (`run_batch`); the replica is busy from the pop to the answer.
- continuous: requests are popped into the engine's free slots at every turn and join
  it between steps; each turn runs one step and answers what finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from control.core import protocol as p
from tasks.engine.contract import RequestError, RequestStatus, StepOutput, refused, run_batch
from tasks.policy.collector import Pending
from tasks.replica.intake import held
from tasks.replica.lease import monotonic_ms

if TYPE_CHECKING:
    from tasks.replica.core import ReplicaCore

log = logging.getLogger(__name__)

Finished = tuple[Pending, StepOutput, float]  # a request, its final output, when its batch (or it) started


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

    def room(self) -> tuple[int, int]:
        """Under the lock: how many paid (and free behind) requests a take may bring."""
        ...

    def pop(self, now_ms: float) -> list[Pending]:
        """Under the lock: the requests this turn takes from the buffer."""
        ...

    def record(self, jobs: list[p.Job]) -> None:
        """Record late paid requests that stay buffered as held."""
        ...

    def run(self, batch: list[Pending], turn_started_ms: float) -> None: ...


class StaticPolicy:
    def __init__(self, replica: ReplicaCore, loop: Phases, hold: Callable[[list[p.Job]], None]) -> None:
        self.replica = replica
        self.loop = loop
        self.hold = hold  # the intake's recorder thread

    def wait(self) -> bool | None:
        r = self.replica
        with r.cond:
            while True:
                wait = r.collector.wait_ms(r.clock.now_ms())
                if wait is None and r.stopping:
                    return None
                if wait == 0 or (wait is not None and r.is_flushing()):
                    return True
                renew_in = r.lease.due_in_ms()
                if renew_in <= 0:
                    return False
                r.cond.wait(min(renew_in, wait if wait is not None else renew_in) / 1000.0)

    def room(self) -> tuple[int, int]:
        return self.replica.collector.num_free(), self.replica.collector.num_behind()

    def pop(self, now_ms: float) -> list[Pending]:
        r = self.replica
        due = r.collector.wait_ms(now_ms) == 0 or r.is_flushing()
        batch = r.collector.pop_batch() if due else []
        if batch:
            r.gate.start(now_ms, r.engine.expected_batch_ms())
            r.batch_started = monotonic_ms()
        return batch

    def record(self, jobs: list[p.Job]) -> None:
        self.hold(jobs)

    def run(self, batch: list[Pending], turn_started_ms: float) -> None:
        if not batch:
            return
        r = self.replica
        jobs = [held(pending).job for pending in batch]
        r.events.started(batch)
        r.stats.last_batch_size = len(batch)  # shown while it runs
        start = r.clock.now_ms()
        with r.watchdog.engine_running():
            outputs = self._run_isolating(jobs, BatchRun(r, batch))
        end = r.clock.now_ms()
        r.perf.add(r.batch_started, monotonic_ms())
        finished = [(pending, out, start) for pending, out in zip(batch, outputs, strict=True)]
        self.loop.deliver(finished, len(batch), end, ends_batch=True)
        r.perf.cycle(monotonic_ms() - r.batch_started)
        r.busy = False
        r.wake()
        r.events.succeeded(batch, (end - start) / 1000.0)

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
        return set(self.replica.cancelled(self.jobs))

    def emit(self, request_id: str, text: str) -> None:
        self.replica.streams.add(self.jobs[request_id], text)

    def end_step(self) -> None:
        self.replica.watchdog.stepped()
        self.replica.streams.flush()
        self.replica.renew_lease_if_due()


class ContinuousPolicy:
    def __init__(self, replica: ReplicaCore, loop: Phases) -> None:
        self.replica = replica
        self.loop = loop

    def wait(self) -> bool | None:
        r = self.replica
        with r.cond:
            while True:
                running = r.engine.has_unfinished()
                can_join = len(r.collector) > 0 and r.engine.free_slots() > 0
                if running or can_join:
                    return True
                if r.stopping and not r.collector:
                    return None
                renew_in = r.lease.due_in_ms()
                if renew_in <= 0:
                    return True
                r.cond.wait(renew_in / 1000.0)

    def room(self) -> tuple[int, int]:
        return min(self.replica.collector.num_free(), self.replica.engine.free_slots()), 0

    def pop(self, now_ms: float) -> list[Pending]:
        r = self.replica
        batch = r.collector.pop_batch(limit=r.engine.free_slots())
        if batch:
            r.busy = True
        return batch

    def record(self, jobs: list[p.Job]) -> None:
        self.replica.broker.record_held(jobs)

    def run(self, batch: list[Pending], turn_started_ms: float) -> None:
        r = self.replica
        self._join(batch)
        self.loop.in_hand = []  # in the engine now, or answered
        if r.engine.has_unfinished():
            self._step()
            turn_ms = monotonic_ms() - turn_started_ms
            r.loop_times[0] += turn_ms
            r.loop_times[1] += 1
            # A request's slot is held for the engine's steps per request, each a turn long.
            r.perf.cycle(turn_ms * r.engine.expected_batch_ms() / r.engine.expected_step_ms())
        self._idle_if_empty()

    def _join(self, batch: list[Pending]) -> None:
        r = self.replica
        refusals: list[tuple[p.Job, p.Result | p.Failed]] = []
        now = r.clock.now_ms()
        for pending in batch:
            job = held(pending).job
            if job.id in r.joined:  # a second copy of a running request (a rescue raced
                continue  # its record): it runs once; copies in one batch: `Collector.pop_batch`
            try:
                r.engine.add_request(job)
            except RequestError as err:
                refusals.append((job, self.loop.result(job, refused(job.id, err), 1, now, now)))
                continue
            r.joined[job.id] = (pending, now)
        if refusals:
            r.broker.reply([item for _job, item in refusals], [job for job, _item in refusals])
        if batch:
            r.events.started([pending for pending in batch if pending.id in r.joined])

    def _step(self) -> None:
        r = self.replica
        r.batch_started = monotonic_ms()
        num_running = len(r.joined)
        with r.watchdog.engine_running():
            outputs = r.engine.step()
        r.perf.add(r.batch_started, monotonic_ms())
        finished: list[Finished] = []
        for out in outputs:
            entry = r.joined.get(out.id)
            if entry is None:
                continue
            if out.is_finished:
                pending, joined_ms = r.joined.pop(out.id)
                finished.append((pending, out, joined_ms))
            else:
                r.streams.add(held(entry[0]).job, out.delta)
        r.streams.flush()
        if finished:
            end = r.clock.now_ms()
            self.loop.deliver(finished, num_running, end, ends_batch=False)
            r.events.succeeded([pd for pd, _out, _start in finished], (end - finished[0][0].arrived_ms) / 1000.0)
        r.wake()

    def _idle_if_empty(self) -> None:
        """The engine holds nothing, whatever emptied it (the last request finished, was
        cancelled or expired, lost its claim or was refused): the replica is idle."""
        r = self.replica
        if not r.busy or r.engine.has_unfinished() or r.joined:
            return
        with r.cond:
            r.busy = False
        r.broker.mark_idle(r.model, r.idle_until_ms())
