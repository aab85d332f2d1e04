"""Streamed text of running requests: offsets per attempt, chunks sent once a step."""

from __future__ import annotations

import logging

from control.core import protocol as p
from tasks.replica.broker import BrokerError, ReplicaBroker

log = logging.getLogger(__name__)


class Streams:
    def __init__(self, broker: ReplicaBroker) -> None:
        self.broker = broker
        self._sent: dict[str, int] = {}  # attempt -> characters streamed so far
        self._chunks: list[tuple[p.Job, p.Chunk]] = []  # the step's streamed text

    def add(self, job: p.Job, text: str) -> None:
        """Queue new text of a streaming request; `flush` sends a step's worth."""
        if not job.stream or not text:
            return
        offset = self._sent.get(job.id, 0)
        self._sent[job.id] = offset + len(text)
        self._chunks.append((job, p.Chunk(id=job.id, offset=offset, text=text)))

    def flush(self) -> None:
        if not self._chunks:
            return
        chunks, self._chunks = self._chunks, []
        try:
            self.broker.stream(chunks)
        except BrokerError:
            log.warning("could not stream %d chunks", len(chunks))  # the answer carries the whole text

    def forget(self, attempt: str) -> None:
        """The request was answered or left: its offset goes."""
        self._sent.pop(attempt, None)

    def clear(self) -> None:
        self._sent.clear()
