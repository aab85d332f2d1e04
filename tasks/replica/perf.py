"""A replica's recent batch (or step) times and how busy it was: what `keybatch fleet`
shows per replica. Pure: times in ms from the caller's clock."""

from __future__ import annotations

import statistics
from collections import deque

WINDOW_MS = 10_000.0


CYCLES = 15  # the cycle time is the median of this many recent samples: one outlier moves nothing


class BatchTimes:
    def __init__(self, size: int = 512) -> None:
        self.runs: deque[tuple[float, float]] = deque(maxlen=size)  # (start, end)
        self.cycles: deque[float] = deque(maxlen=CYCLES)

    def add(self, start_ms: float, end_ms: float) -> None:
        self.runs.append((start_ms, end_ms))

    def cycle(self, ms: float) -> None:
        """One batch slot's whole time on the replica, from its start until the replica
        can start another (the engine's run and what the loop does around it)."""
        self.cycles.append(ms)

    def cycle_ms(self) -> float:
        """What a batch slot costs the replica now (0.0 until measured)."""
        return statistics.median(self.cycles) if self.cycles else 0.0

    def percentile_ms(self, q: float) -> float:
        times = sorted(end - start for start, end in self.runs)
        if not times:
            return 0.0
        return times[min(len(times) - 1, int(q * len(times)))]

    def utilization(self, now_ms: float, window_ms: float = WINDOW_MS) -> float:
        """The share of the last `window_ms` spent running batches."""
        since = now_ms - window_ms
        busy = sum(max(0.0, min(end, now_ms) - max(start, since)) for start, end in self.runs)
        return min(1.0, busy / window_ms)

    def as_fields(self, now_ms: float) -> dict[str, float]:
        return {
            "batch_p50_ms": round(self.percentile_ms(0.5), 1),
            "batch_p99_ms": round(self.percentile_ms(0.99), 1),
            "utilization": round(self.utilization(now_ms), 3),
            "cycle_ms": round(self.cycle_ms(), 1),
        }
