"""Which requests a batch's empty slots carry a second copy of. Policy code: no Celery, no
Redis, no torch; time comes from the caller.

A static batch costs the same whether it holds 1 request or 64, so a slot no primary
request wants is free. A replica starting a batch with slots to spare fills them with
copies of requests that run now on replicas of another host, or wait buffered there for
their next batch: if that host is lost, the copy answers; if not, the first answer wins
and the other run's result is dropped (a wasted slot that cost nothing).

- Only a request whose copy can still finish by its deadline is worth a slot.
- Paid requests first, then free ones where the mode allows; within a tier the earliest
  deadline first.
- A request runs as one copy at most besides its own run: the caller keeps the copies
  already made out of the candidates.
- At low load no batch runs that a copy could ride. With HEDGE_IDLE an idle replica runs
  a batch of copies alone, of requests whose batch runs on another host, but only while
  enough of its model's replicas stay idle for new arrivals (`least_idle`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from control.core.vocab import PAID, Tier

HedgeMode = Literal["off", "paid", "all"]
HEDGE_MODES: tuple[HedgeMode, ...] = ("off", "paid", "all")

# HEDGE_IDLE: an idle replica looks for requests to copy at most this often, and runs a
# batch of them only while this many other replicas of its model are idle too (the one
# that listens for arrivals among them), and at least this share of those that launched.
IDLE_LOOK_MS = 50.0
IDLE_SPARE = 2
IDLE_SHARE = 0.5


@dataclass(frozen=True)
class Candidate:
    """A request running, or buffered for the next batch, on another replica."""

    key: Any  # the caller's handle on the request
    tier: Tier
    deadline_ms: float
    host: str  # the host of the replica that runs it


def pick(
    mode: HedgeMode, room: int, host: str, finish_ms: float, margin_ms: float, candidates: Iterable[Candidate]
) -> list[Candidate]:
    """Up to `room` candidates for a batch on `host` that ends at `finish_ms`: none of
    this host's own (a host lost takes its copies with it), none that the copy would
    answer past its deadline (less `margin_ms` for the trip back)."""
    if mode == "off" or room <= 0:
        return []
    fit = [
        c
        for c in candidates
        if c.host != host and c.deadline_ms - margin_ms >= finish_ms and (mode == "all" or c.tier == PAID)
    ]
    fit.sort(key=lambda c: (c.tier != PAID, c.deadline_ms))
    return fit[:room]


def least_idle(num_launched: int) -> int:
    """The idle replicas of a model, the one asking included, without which an idle
    replica runs no batch of copies (HEDGE_IDLE): itself, `IDLE_SPARE` more for new
    arrivals, and no fewer than `IDLE_SHARE` of the `num_launched` replicas that launched
    batches. Past that, arrivals need the idle ones."""
    return max(1 + IDLE_SPARE, math.ceil(num_launched * IDLE_SHARE))
