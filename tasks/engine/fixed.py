"""The fixed-latency backend: a *simulation* of an accelerator.

Any batch up to `max_batch` takes `batch_ms`, and the text is derived from the prompt
so tests can check it.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field

from control.core.protocol import Job
from control.core.vocab import FinishReason
from tasks.engine.contract import RequestStatus, StepOutput

SIMULATED = "fixed (simulated accelerator)"

_FRAGMENTS = (
    "return",
    " result",
    " =",
    " self",
    ".",
    "value",
    "(",
    ")",
    ":",
    "\n    ",
    " if",
    " not",
    " None",
    " for",
    " item",
    " in",
    " items",
    ",",
    " x",
    " + 1",
)


def simulated_text(job: Job) -> tuple[str, FinishReason]:
    """Deterministic completion for a prompt: (text, finish_reason)."""
    seed = f"{job.prompt}\x00{job.suffix or ''}".encode()
    digest = hashlib.shake_256(seed).digest(job.max_tokens)
    pieces = [_FRAGMENTS[b % len(_FRAGMENTS)] for b in digest]
    text = "".join(pieces)
    for stop in job.stop:
        cut = text.find(stop)
        if cut >= 0:
            return text[:cut], "stop"
    return text, "length"


def count_tokens(text: str) -> int:
    return max(1, len(text.split())) if text else 0


@dataclass
class _Simulated:
    job: Job
    steps_left: int


@dataclass
class FixedLatencyEngine:
    """Every request takes `batch_ms` from its join, in steps of `STEP_MS`, whatever the
    batch holds. Under the static policy that is the statement's accelerator: any batch
    up to `max_batch` takes `batch_ms`."""

    max_batch: int
    batch_ms: float
    poison: str | None = None  # fault injection: a prompt containing this fails in the engine
    hang: str | None = None  # fault injection: a step holding a prompt containing this never ends
    continuous: bool = False
    name: str = SIMULATED
    running: dict[str, _Simulated] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _step_due: float = 0.0  # monotonic s the last step ended on the accelerator's own clock

    STEP_MS = 50.0  # the simulated accelerator reports between steps of this length
    QUEUED = 0.2  # a step asked for within this share of a step after the last one ended was queued behind it

    def expected_batch_ms(self) -> float:
        return self.batch_ms

    def expected_step_ms(self) -> float:
        return min(self.STEP_MS, self.batch_ms)

    def add_request(self, job: Job) -> None:
        if len(self.running) >= self.max_batch:
            raise ValueError(f"the engine already runs {self.max_batch} requests")
        steps = max(1, round(self.batch_ms / self.expected_step_ms()))
        if not self.running:  # a batch starts (or an idle engine takes work): when it is asked to
            self._step_due = 0.0
        self.running[job.id] = _Simulated(job, steps)

    def abort_request(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def free_slots(self) -> int:
        if not self.continuous and self.running:
            return 0
        return self.max_batch - len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def frees_after_step(self) -> int:
        """Running requests that the next step finishes: slots free for the step after it."""
        return sum(1 for request in self.running.values() if request.steps_left <= 1)

    def step(self) -> list[StepOutput]:
        if self.hang and any(self.hang in r.job.prompt for r in self.running.values()):
            self._stop.wait()  # hung: no step ends, nobody is told
        self._stop.wait(self._step_wait_s())
        done = []
        for request in self.running.values():
            request.steps_left -= 1
            if request.steps_left <= 0:
                done.append(self._output(request.job))
        for out in done:
            del self.running[out.id]
        return done

    def _step_wait_s(self) -> float:
        """The simulated accelerator is busy for one step (an Event wait rather than a bare
        sleep so a hard stop can interrupt it). Like a real one it keeps its own clock: a
        step asked for right after the last (the host's work between steps, a few ms) was
        queued behind it and starts when that one ended, so back-to-back steps take
        `STEP_MS` each and a static batch `batch_ms`, whatever the host does in between."""
        now = time.monotonic()
        step_s = self.expected_step_ms() / 1000.0
        start = self._step_due if 0.0 <= now - self._step_due <= self.QUEUED * step_s else now
        self._step_due = start + step_s
        return max(0.0, self._step_due - now)

    def _output(self, job: Job) -> StepOutput:
        if self.poison and self.poison in job.prompt:
            return StepOutput(
                job.id, RequestStatus.FINISHED_ERROR, error="the simulated accelerator failed on this prompt"
            )
        text, reason = simulated_text(job)
        status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
        return StepOutput(job.id, status, text, text, count_tokens(job.prompt), count_tokens(text))

    def close(self) -> None:
        self._stop.set()
