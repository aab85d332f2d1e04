"""The accelerator's own thread for static batches.

The loop stages the next batch while the present one runs (take, settle and claim), and
delivers a finished batch while the next one runs; this thread starts a staged batch the
moment the engine is free. So the engine's cycle is its batch time, not the batch time
plus the broker's round trips around it. All its state is read and written under the
replica's lock; it waits on `engine_cond` and notifies the loop's `cond` when a batch starts and ends.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from control.core.protocol import Job
from tasks.engine.contract import RequestError, RequestStatus, StepOutput, refused
from tasks.policy.collector import Pending
from tasks.replica.lease import monotonic_ms

if TYPE_CHECKING:
    from tasks.replica.core import ReplicaCore

log = logging.getLogger(__name__)

BACK_TO_BACK = 0.2  # a start within this share of a batch after the last end followed it at once


@dataclass(frozen=True)
class Ran:
    """A batch the engine finished, for the loop to answer."""

    batch: list[Pending]
    outputs: list[StepOutput]
    start_ms: float  # the replica's clock (epoch ms)
    end_ms: float


class _EngineThread:
    """What both engine threads share: started at the first work staged, woken on
    `engine_cond`, closed once the loop ends, and the time of each run on the engine."""

    def __init__(self, replica: ReplicaCore) -> None:
        self.replica = replica
        self.closed = False
        self._last_end: float | None = None  # monotonic ms the last run ended
        self._thread: threading.Thread | None = None

    def _wake(self) -> None:
        """Under the lock: work was staged."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"engine-{self.replica.name}", daemon=True)
            self._thread.start()
        self.replica.engine_cond.notify()

    def close(self) -> None:
        self.closed = True
        self.replica.engine_cond.notify()

    def _serve(self) -> None:
        raise NotImplementedError

    def _timed(self, began: float, ended: float) -> float:
        """Record a run's time on the engine; returns its slot's time: the run plus the wait
        before it, where it followed the last run at once."""
        self.replica.perf.add(began, ended)
        run_ms = ended - began
        gap = began - self._last_end if self._last_end is not None else None
        self._last_end = ended
        return run_ms + (gap if gap is not None and gap < BACK_TO_BACK * run_ms else 0.0)


class Device(_EngineThread):
    def __init__(self, replica: ReplicaCore, run: Callable[[list[Pending]], list[StepOutput]]) -> None:
        super().__init__(replica)
        self.run = run  # runs one batch on the engine to its end
        self.staged: list[Pending] | None = None  # claimed, waiting for the engine
        self.running: list[Pending] | None = None
        self.running_since = 0.0  # monotonic ms
        self.done: deque[Ran] = deque()

    # -- under the replica's condition --------------------------------------------

    def idle(self) -> bool:
        """Nothing staged, running or left to answer."""
        return self.staged is None and self.running is None and not self.done

    def frees_in_ms(self, now_mono_ms: float) -> float:
        """How long until the engine is expected to be free (0: it is)."""
        if self.running is None:
            return 0.0
        return max(0.0, self.running_since + self.replica.engine.expected_batch_ms() - now_mono_ms)

    def stage(self, batch: list[Pending]) -> None:
        if self.staged is not None:
            raise RuntimeError("a batch is staged already")
        self.staged = batch
        self._wake()

    # -- the engine's thread -----------------------------------------------------------

    def _serve(self) -> None:
        r = self.replica
        while True:
            with r.cond:
                while self.staged is None and not self.closed:
                    r.engine_cond.wait()
                if self.staged is None:
                    return
                batch, self.staged = self.staged, None
                self.running, self.running_since = batch, monotonic_ms()
                r.cond.notify_all()  # the loop times the next take from this start
            start = r.clock.now_ms()
            began = monotonic_ms()
            try:
                outputs = self.run(batch)
            except Exception as exc:  # `run` isolates a failing request; this is anything else
                log.exception("a batch of %d failed on the engine", len(batch))
                message = f"the engine failed on this batch: {exc!r}"
                outputs = [StepOutput(pd.id, RequestStatus.FINISHED_ERROR, error=message) for pd in batch]
            ended = monotonic_ms()
            with r.cond:
                r.perf.cycle(self._timed(began, ended))
                self.running = None
                self.done.append(Ran(batch, outputs, start, r.clock.now_ms()))
                r.cond.notify_all()


@dataclass(frozen=True)
class Stepped:
    """What one step of a continuous engine gave, for the loop to stream and answer."""

    outputs: list[StepOutput]
    refused: list[StepOutput]  # requests the engine would not take (`refused`)
    running: int  # requests in the engine during the step
    joined: list[str]  # requests that joined the engine right before the step
    joined_ms: float  # when (the replica's clock)
    end_ms: float  # when the step ended (the replica's clock)


class StepDevice(_EngineThread):
    """A continuous engine's own thread: it runs steps back to back while the engine holds
    work, taking in between the joins and aborts the loop staged. The loop's take, claim,
    streaming and delivery overlap the steps; the engine is only ever called from here."""

    def __init__(self, replica: ReplicaCore) -> None:
        super().__init__(replica)
        self.joins: list[Job] = []  # staged: they join before the next step
        self.aborts: list[str] = []
        self.done: deque[Stepped] = deque()
        self.stepping = False  # the engine holds work (or a step runs)

    # -- under the replica's lock ---------------------------------------------------

    def idle(self) -> bool:
        return not self.joins and not self.aborts and not self.stepping and not self.done

    def stage(self, joins: Sequence[Job] = (), aborts: Sequence[str] = ()) -> None:
        self.joins.extend(joins)
        self.aborts.extend(aborts)
        self._wake()

    # -- the engine's thread -----------------------------------------------------------

    def _serve(self) -> None:
        r = self.replica
        while True:
            with r.cond:
                while not (self.joins or self.aborts or self.stepping) and not self.closed:
                    r.engine_cond.wait()
                if self.closed and not (self.joins or self.aborts or self.stepping):
                    return
                joins, self.joins = self.joins, []
                aborts, self.aborts = self.aborts, []
                self.stepping = True
            joined_ms = r.clock.now_ms()
            refused_outputs, joined = self._apply(joins, aborts)
            outputs: list[StepOutput] = []
            running = 0
            if r.engine.has_unfinished():
                running = r.engine.max_batch - r.engine.free_slots()
                began = monotonic_ms()
                try:
                    with r.watchdog.engine_running():
                        outputs = r.engine.step()
                except Exception as exc:
                    log.exception("a step failed on the engine")
                    outputs = self._fail_all(exc)
                self._count(began, monotonic_ms())
            with r.cond:
                self.stepping = r.engine.has_unfinished()
                r.frees_next = r.engine.frees_after_step() if self.stepping else 0
                if running or refused_outputs:  # every step: the loop checks cancels between steps
                    self.done.append(Stepped(outputs, refused_outputs, running, joined, joined_ms, r.clock.now_ms()))
                r.cond.notify_all()

    def _apply(self, joins: list[Job], aborts: list[str]) -> tuple[list[StepOutput], list[str]]:
        """Between steps: aborts leave, then staged requests join while the engine has free
        slots; the rest stay staged for the next step (the loop stages a few more than the
        free slots, so a slot freed by a step is filled at the next one)."""
        engine = self.replica.engine
        gone = set(aborts)
        for request_id in aborts:
            engine.abort_request(request_id)
        refusals, joined = [], []
        waiting = [job for job in joins if job.id not in gone]
        while waiting and engine.free_slots() > 0:
            job = waiting.pop(0)
            try:
                engine.add_request(job)
                joined.append(job.id)
            except RequestError as err:
                refusals.append(refused(job.id, err))
        if waiting:
            with self.replica.cond:
                self.joins[:0] = waiting
        return refusals, joined

    def _fail_all(self, exc: Exception) -> list[StepOutput]:
        """A step that raised: every request in the engine ends with the error, and leaves it."""
        r = self.replica
        with r.cond:
            ids = list(r.joined)
        for request_id in ids:
            r.engine.abort_request(request_id)
        message = f"the engine failed a step: {exc!r}"
        return [StepOutput(request_id, RequestStatus.FINISHED_ERROR, error=message) for request_id in ids]

    def _count(self, began: float, ended: float) -> None:
        """The step's time on the engine; its slot's cycle is a request's steps, each the
        step's time plus the wait before it where it followed the last step at once."""
        r = self.replica
        turn = self._timed(began, ended)
        r.perf.cycle(turn * r.engine.expected_batch_ms() / max(r.engine.expected_step_ms(), 1e-3))
        r.loop_times[0] += turn
        r.loop_times[1] += 1
