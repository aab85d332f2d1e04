"""The engine interface a replica drives, and the fixed-latency simulated backend.

The contract has the shape of vLLM's engine core: the replica adds requests, aborts
them, and calls `step()`; each step runs one iteration of the model over the requests
it holds and returns what each produced (new text, finished or not). Two batching
policies sit behind it:

- static: requests join only an empty engine and the batch runs until its last
  request finishes (`run_batch` drives one such batch to its end);
- continuous: requests join and leave between steps (`free_slots` says how many
  more it takes now).

The fixed backend is a *simulation* of an accelerator: any batch up to `max_batch`
takes `batch_ms`, and the text is derived from the prompt so tests can check it.
Nothing here imports torch; the torch engine lives in tasks/lm/.
"""

from __future__ import annotations

import enum
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from control.core.protocol import Job

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


class RequestStatus(enum.IntEnum):
    """Where a request is in an engine; the finished states come last."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # a stop sequence or the end-of-text token
    FINISHED_LENGTH = 3  # max_tokens, or the model's context
    FINISHED_ABORTED = 4  # the replica aborted it (cancelled, superseded, gone, expired)
    FINISHED_ERROR = 5  # the engine cannot run this request

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class RequestError(ValueError):
    """A request the engine can never run, whatever the load (for example a prompt
    longer than the model's context). `status` is the HTTP status its client gets."""

    def __init__(self, message: str, code: str = "invalid_request", status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status


@dataclass
class StepOutput:
    """What one step produced for one request."""

    id: str
    status: RequestStatus
    delta: str = ""  # text new since this request's last output (safe to stream: no stop can cut it)
    text: str = ""  # the whole completion so far; final once finished
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    code: str | None = None  # with `error`: a short machine-readable reason
    http_status: int | None = None  # with `error`: what the client gets (default 422)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)


@dataclass
class Output:
    """The final answer of one request of a static batch (see `run_batch`)."""

    id: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # the engine could not run this request; the rest of the batch ran
    code: str | None = None
    http_status: int | None = None

    @classmethod
    def of(cls, out: StepOutput) -> Output:
        return cls(
            out.id,
            out.text,
            out.finish_reason or "length",
            out.prompt_tokens,
            out.completion_tokens,
            out.error,
            out.code,
            out.http_status,
        )


class BatchControl(Protocol):
    """What an engine loop may ask of the replica while requests run."""

    def cancelled(self) -> set[str]:
        """Ids of running requests whose clients have gone (checked between steps)."""
        ...

    def emit(self, request_id: str, text: str) -> None:
        """Stream new text of one request to its waiting client (sent at `end_step`)."""
        ...

    def end_step(self) -> None:
        """Called after each step: sends the step's streamed text and renews the replica's
        lease (an engine that hangs loses it)."""
        ...


class Engine(Protocol):
    """An engine core: requests in, one iteration per `step()`, outputs back."""

    name: str
    max_batch: int  # the most requests it runs at once (slots)
    continuous: bool  # requests may join while others run

    def expected_batch_ms(self) -> float:
        """Expected time from a request's join to its finish, for the collector and admission."""
        ...

    def expected_step_ms(self) -> float:
        """Expected time of the next step at the present load."""
        ...

    def add_request(self, job: Job) -> None:
        """Take one request; raises `RequestError` for one it can never run."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Drop a request: its slot is free for the next step, and it yields no more output."""
        ...

    def free_slots(self) -> int:
        """How many more requests `add_request` takes now (static: none while a batch runs)."""
        ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[StepOutput]:
        """Run one iteration; an output for each request that produced something or finished."""
        ...

    def close(self) -> None: ...


def run_batch(engine: Engine, jobs: list[Job], control: BatchControl) -> list[Output]:
    """Run a static batch to its end: one output per job, in order.

    Between steps it renews the lease, streams new text and aborts requests whose
    clients have gone. If a step raises, every request of the batch is aborted
    before the error goes up, so the engine is empty for whoever retries.
    """
    outputs: dict[str, Output] = {}
    for job in jobs:
        try:
            engine.add_request(job)
        except RequestError as err:
            outputs[job.id] = Output(job.id, "", "error", 0, 0, err.message, err.code, err.status)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.is_finished:
                    outputs[out.id] = Output.of(out)
                elif out.delta:  # a finished request's text goes with its answer
                    control.emit(out.id, out.delta)
            control.end_step()
            for request_id in control.cancelled():
                if request_id not in outputs:
                    engine.abort_request(request_id)
                    outputs[request_id] = Output(request_id, "", "abort", 0, 0)
    except BaseException:
        for job in jobs:
            engine.abort_request(job.id)
        raise
    return [outputs[job.id] for job in jobs]


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

    STEP_MS = 50.0  # the simulated accelerator reports between steps of this length

    def expected_batch_ms(self) -> float:
        return self.batch_ms

    def expected_step_ms(self) -> float:
        return min(self.STEP_MS, self.batch_ms)

    def add_request(self, job: Job) -> None:
        if len(self.running) >= self.max_batch:
            raise ValueError(f"the engine already runs {self.max_batch} requests")
        steps = max(1, round(self.batch_ms / self.expected_step_ms()))
        self.running[job.id] = _Simulated(job, steps)

    def abort_request(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def free_slots(self) -> int:
        if not self.continuous and self.running:
            return 0
        return self.max_batch - len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[StepOutput]:
        if self.hang and any(self.hang in r.job.prompt for r in self.running.values()):
            self._stop.wait()  # hung: no step ends, nobody is told
        # The simulated accelerator is busy for one step (an Event wait rather than a
        # bare sleep so a hard stop can interrupt it).
        self._stop.wait(self.expected_step_ms() / 1000.0)
        done = []
        for request in self.running.values():
            request.steps_left -= 1
            if request.steps_left <= 0:
                done.append(self._output(request.job))
        for out in done:
            del self.running[out.id]
        return done

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


def monotonic_ms() -> float:
    return time.monotonic() * 1000.0
