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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from control.core.vocab import PAID, Tier

HedgeMode = Literal["off", "paid", "all"]
HEDGE_MODES: tuple[HedgeMode, ...] = ("off", "paid", "all")


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
