"""The stall watchdog's window: how long the engine has run its present step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tasks.replica.lease import monotonic_ms


class Watchdog:
    def __init__(self, stall_ms: float) -> None:
        self.stall_ms = stall_ms
        self._since: float | None = None  # monotonic ms the engine's batch or step began; None between

    @contextmanager
    def engine_running(self) -> Iterator[None]:
        """The engine runs a step (a static batch reports each of its steps, `stepped`).
        Only the engine can hang here; waiting for work, the broker or an aborted request
        cannot open it or leave it open."""
        self._since = monotonic_ms()
        try:
            yield
        finally:
            self._since = None

    def stepped(self) -> None:
        """A step of a static batch ended: the engine moves, however long its batch runs."""
        if self._since is not None:
            self._since = monotonic_ms()

    def running_ms(self) -> float:
        since = self._since  # read once: the loop thread clears it
        return 0.0 if since is None else monotonic_ms() - since

    def is_stalled(self, batch_ms: float) -> bool:
        """A step far past the time of a whole batch: the engine hangs."""
        return self.running_ms() > batch_ms + self.stall_ms
