"""Time, given to policy code rather than read from `time` directly.

Deadlines cross processes (and hosts), so the clock speaks epoch milliseconds, and
every process reads them on one clock: the broker's. `BrokerClock` is the local clock
plus the offset to the broker's `TIME`, measured in the background, so hosts whose
clocks disagree still agree on every deadline. The simulator and the unit tests pass
a `ManualClock`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> float: ...


class SystemClock:
    def __init__(self, skew_ms: float = 0.0) -> None:
        self.skew_ms = skew_ms  # only to test that nothing depends on hosts' clocks agreeing

    def now_ms(self) -> float:
        return time.time() * 1000.0 + self.skew_ms


class ManualClock:
    def __init__(self, start_ms: float = 0.0) -> None:
        self.t = start_ms

    def now_ms(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms


class TimeSource(Protocol):
    def time(self) -> tuple[int, int]:
        """The broker's TIME: (seconds, microseconds)."""
        ...


class BrokerClock:
    """The local clock corrected to the broker's.

    Each `sync` asks the broker for its time and takes the offset from the round trip
    (Cristian's method); the estimate in use is the one from the fastest of the last
    `window` round trips, whose error is at most half that round trip.
    """

    def __init__(self, source: TimeSource, local: SystemClock | None = None, window: int = 8) -> None:
        self.source = source
        self.local = local or SystemClock()
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (round trip, offset)
        self._lock = threading.Lock()
        self.offset_ms = 0.0
        self.error_ms = float("inf")  # half the round trip of the estimate in use

    def now_ms(self) -> float:
        return self.local.now_ms() + self.offset_ms

    def sync(self) -> None:
        """One measurement; raises what the broker client raises."""
        before = self.local.now_ms()
        seconds, micros = self.source.time()
        after = self.local.now_ms()
        broker_ms = seconds * 1000.0 + micros / 1000.0
        with self._lock:
            self._samples.append((after - before, broker_ms - (before + after) / 2))
            rtt, offset = min(self._samples)
            self.offset_ms, self.error_ms = offset, rtt / 2
