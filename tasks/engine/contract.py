"""The engine interface a replica drives.

The contract has the shape of vLLM's engine core: the replica adds requests, aborts
them, and calls `step()`; each step runs one iteration of the model over the requests
it holds and returns what each produced (new text, finished or not). Two batching
policies sit behind it:

- static: requests join only an empty engine and the batch runs until its last
  request finishes (`run_batch` drives one such batch to its end);
- continuous: requests join and leave between steps (`free_slots` says how many
  more it takes now).

Every output, a step's or a batch's final one, is a `StepOutput`. The fixed backend
is in tasks/engine/fixed.py; nothing here imports torch, the torch engine lives in
tasks/lm/.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, Protocol

from control.core.protocol import Job
from control.core.vocab import FinishReason


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


# How a finished request ended: a reason its client sees, or one the replica handles
# itself (an abort answers nobody, an error becomes a failure).
Ending = FinishReason | Literal["abort", "error"]

ENDINGS: dict[RequestStatus, Ending] = {
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
    def finish_reason(self) -> Ending | None:
        return ENDINGS.get(self.status)


def refused(request_id: str, err: RequestError) -> StepOutput:
    """The final output of a request the engine refused to take."""
    return StepOutput(
        request_id, RequestStatus.FINISHED_ERROR, error=err.message, code=err.code, http_status=err.status
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

    def frees_after_step(self) -> int:
        """Running requests the next step certainly finishes (continuous: their slots are
        free for the step after it, so as many more may wait staged to join then)."""
        ...

    def step(self) -> list[StepOutput]:
        """Run one iteration; an output for each request that produced something or finished."""
        ...

    def close(self) -> None: ...


def run_batch(engine: Engine, jobs: list[Job], control: BatchControl) -> list[StepOutput]:
    """Run a static batch to its end: one output per job, in order.

    Between steps it renews the lease, streams new text and aborts requests whose
    clients have gone. If a step raises, every request of the batch is aborted
    before the error goes up, so the engine is empty for whoever retries.
    """
    outputs: dict[str, StepOutput] = {}
    for job in jobs:
        try:
            engine.add_request(job)
        except RequestError as err:
            outputs[job.id] = refused(job.id, err)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.is_finished:
                    outputs[out.id] = out
                elif out.delta:  # a finished request's text goes with its answer
                    control.emit(out.id, out.delta)
            control.end_step()
            for request_id in control.cancelled():
                if request_id not in outputs:
                    engine.abort_request(request_id)
                    outputs[request_id] = StepOutput(request_id, RequestStatus.FINISHED_ABORTED)
    except BaseException:
        for job in jobs:
            engine.abort_request(job.id)
        raise
    return [outputs[job.id] for job in jobs]
