"""When a replica renews its lease, and for how long (control/broker/scripts.py); when it
doubts its broker.

Pure timing, monotonic ms: the broker calls that renew it are tasks/replica/broker.py's.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class LeaseClock:
    def __init__(self, lease_ms: float) -> None:
        self.lease_ms = lease_ms
        self.renew_at_ms = 0.0  # monotonic; 0 before the first renewal

    def renewal_ms(self, step_ms: float) -> float:
        """The lease a renewal sent now sets; the next one is due a third of a lease on."""
        now = monotonic_ms()
        # A step is renewed around, never during: the lease outlasts a few of the slowest.
        lease_ms = max(self.lease_ms, 4 * step_ms)
        late = now - (self.renew_at_ms + lease_ms - self.lease_ms / 3)
        if self.renew_at_ms and late > 0:
            log.warning("lease renewed %.0f ms after it lapsed (the loop stalled)", late)
        self.renew_at_ms = now + self.lease_ms / 3
        return lease_ms

    def is_due(self) -> bool:
        return monotonic_ms() >= self.renew_at_ms

    def due_in_ms(self) -> float:
        return self.renew_at_ms - monotonic_ms()


class BrokerDoubt:
    """After a failed call, the calls the engine makes between its steps (cancel checks,
    lease renewals) leave the broker alone for a window, which doubles up to `most_ms`
    while the calls go on failing: a stalled broker costs a batch one call's bound per
    window, not one per step."""

    def __init__(self, first_ms: float = 200.0, most_ms: float = 1000.0) -> None:
        self.first_ms, self.most_ms = first_ms, most_ms
        self.window_ms = 0.0
        self.until_ms = 0.0
        self.failed_ms = float("-inf")  # when a call last failed

    def skips(self) -> bool:
        return monotonic_ms() < self.until_ms

    def is_sure(self) -> bool:
        """Skipping after more than one failure in a row: one late answer on a busy host
        is not an outage (a lease renewal skipped for it could let the lease lapse)."""
        return self.skips() and self.window_ms > self.first_ms

    def failed(self) -> None:
        self.failed_ms = monotonic_ms()
        self.window_ms = min(self.most_ms, 2 * self.window_ms) if self.window_ms else self.first_ms
        self.until_ms = self.failed_ms + self.window_ms

    def answered(self) -> None:
        self.window_ms = self.until_ms = 0.0

    def failed_within(self, ms: float) -> bool:
        return monotonic_ms() - self.failed_ms < ms


def monotonic_ms() -> float:
    return time.monotonic() * 1000.0
