"""What a replica counts about the requests it ran and dropped (published in the registry)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from control.core.vocab import COUNTED_DROPS


@dataclass
class Stats:
    num_batches: int = 0
    num_requests: int = 0
    last_batch_size: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    wasted_slots: int = 0  # slots run for requests whose client had gone
    wasted_ms: float = 0.0  # their share of the model's time
    num_taken_shut: int = 0  # brought by a pull sent before the gate shut
    num_handed_back: int = 0  # of those, put back at the front of the queue
    rest_handed_back: int = 0  # left by a batch, put back at the front of the queue for a peer's start
    hedged: int = 0  # second copies (hedges) run in a batch's empty slots
    hedge_wins: int = 0  # of those, the ones that answered their request first
    hedge_wasted: int = 0  # of those, the ones whose request was answered already (or gone)
    idle_copy_batches: int = 0  # batches of copies only, run while idle (HEDGE_IDLE)

    def waste(self, slots: int, share_ms: float) -> None:
        self.wasted_slots += slots
        self.wasted_ms += slots * share_ms

    def ran(self, num_requests: int, batch_size: int) -> None:
        """A batch (static) or a step (continuous) answered `num_requests`."""
        self.num_batches += 1
        self.num_requests += num_requests
        self.last_batch_size = batch_size

    def as_fields(self) -> dict[str, float]:
        fields: dict[str, float] = {
            "num_batches": self.num_batches,
            "num_requests": self.num_requests,
            "last_batch_size": self.last_batch_size,
            "wasted_slots": self.wasted_slots,
            "wasted_ms": round(self.wasted_ms, 1),
            "taken_shut": self.num_taken_shut,
            "handed_back": self.num_handed_back,
            "rest_handed_back": self.rest_handed_back,
            "hedged": self.hedged,
            "hedge_wins": self.hedge_wins,
            "hedge_wasted": self.hedge_wasted,
            "idle_copy_batches": self.idle_copy_batches,
        }
        for reason in COUNTED_DROPS:
            fields[f"dropped_{reason}"] = self.dropped[reason]
        return fields
