"""The engine interface a replica drives, and the fixed-latency simulated backend.

An engine runs one batch of jobs. It is given a `BatchControl` so that it can
ask, between steps, which requests were cancelled (and stop spending work on
them) and push partial text back to the waiting client (streaming). The fixed
backend is a *simulation* of an accelerator: any batch up to `max_batch` takes
`batch_ms`, and the text is derived from the prompt so tests can check it.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from control.protocol import Job

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


@dataclass
class Output:
    id: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # the engine could not run this request; the rest of the batch ran


class BatchControl(Protocol):
    """What an engine may ask of the replica while a batch runs."""

    def cancelled(self) -> set[str]:
        """Ids in this batch whose clients have gone (checked between steps)."""
        ...

    def emit(self, request_id: str, text: str) -> None:
        """Send partial text of one request to its waiting client."""
        ...

    def keep_alive(self) -> None:
        """Called between steps: renews the replica's lease (an engine that hangs loses it)."""
        ...


class Engine(Protocol):
    name: str
    max_batch: int

    def expected_batch_ms(self) -> float:
        """Expected time of the next batch, for the collector and admission."""
        ...

    def run(self, jobs: list[Job], control: BatchControl) -> list[Output]:
        """Run one batch; one output per job, in order."""
        ...


def simulated_text(job: Job) -> tuple[str, str]:
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


class FixedLatencyEngine:
    """Every batch up to `max_batch` takes `batch_ms`, whatever its contents."""

    name = SIMULATED

    STEP_MS = 50.0  # the simulated accelerator reports between steps of this length

    def __init__(self, max_batch: int, batch_ms: float, poison: str | None = None, hang: str | None = None) -> None:
        self.max_batch = max_batch
        self.batch_ms = batch_ms
        self.poison = poison  # fault injection: a prompt containing this fails in the engine
        self.hang = hang  # fault injection: a batch with a prompt containing this never ends
        self._stop = threading.Event()

    def expected_batch_ms(self) -> float:
        return self.batch_ms

    def run(self, jobs: list[Job], control: BatchControl) -> list[Output]:
        if len(jobs) > self.max_batch:
            raise ValueError(f"batch of {len(jobs)} exceeds max_batch {self.max_batch}")
        if self.hang and any(self.hang in job.prompt for job in jobs):
            self._stop.wait()  # hung: no step ends, nobody is told
        # The simulated accelerator is busy for the batch time, in steps (an Event wait
        # rather than a bare sleep so a hard stop can interrupt it).
        end = time.monotonic() + self.batch_ms / 1000.0
        while (left := end - time.monotonic()) > 0 and not self._stop.wait(min(left, self.STEP_MS / 1000.0)):
            control.keep_alive()
        return [self._output(job) for job in jobs]

    def _output(self, job: Job) -> Output:
        if self.poison and self.poison in job.prompt:
            return Output(job.id, "", "error", 0, 0, error="the simulated accelerator failed on this prompt")
        text, reason = simulated_text(job)
        return Output(job.id, text, reason, count_tokens(job.prompt), count_tokens(text))

    def close(self) -> None:
        self._stop.set()
