"""Time, given to policy code rather than read from `time` directly.

Deadlines cross processes (and hosts), so the clock speaks epoch milliseconds.
The simulator and the unit tests pass a `ManualClock`.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> float: ...


class SystemClock:
    def now_ms(self) -> float:
        return time.time() * 1000.0


class ManualClock:
    def __init__(self, start_ms: float = 0.0) -> None:
        self.t = start_ms

    def now_ms(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms
