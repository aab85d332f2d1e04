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
# that listens for arrivals among them), and at least this share of those that launched;
# of paid requests alone while at least the paid share of them is idle.
IDLE_LOOK_MS = 50.0
IDLE_SPARE = 2
IDLE_SHARE = 0.5
IDLE_SHARE_PAID = 0.25


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


def least_idle(num_launched: int, share: float = IDLE_SHARE) -> int:
    """The idle replicas of a model, the one asking included, without which an idle
    replica runs no batch of copies (HEDGE_IDLE): itself, `IDLE_SPARE` more for new
    arrivals, and no fewer than `share` of the `num_launched` replicas that launched
    batches. Past that, arrivals need the idle ones."""
    return max(1 + IDLE_SPARE, math.ceil(num_launched * share))


def idle_mode(mode: HedgeMode, num_idle: int, num_launched: int) -> tuple[HedgeMode, int, bool]:
    """What an idle replica's batch of copies may hold (HEDGE_IDLE), the least number of
    idle replicas that allows it, and whether the copies gather into a full batch first
    (`copies_due`):
    - the tiers `mode` copies, started at once, while half the replicas are idle
      (`least_idle`): low load, where a batch of copies costs an idle accelerator;
    - paid requests alone, gathered, while a quarter are (`IDLE_SHARE_PAID`): at normal
      load a fleet whose batches are full has no empty slot for a copy, and the paid
      share of the load, copied in full batches, fits in the replicas it leaves idle
      (one copy batch per primary one would double the batches);
    - ("off", 0, False) below that."""
    if mode == "off":
        return "off", 0, False
    most = least_idle(num_launched)
    if num_idle >= most:
        return mode, most, False
    paid = least_idle(num_launched, IDLE_SHARE_PAID)
    if num_idle >= paid:
        return "paid", paid, True
    return "off", 0, False


def look_ms(lease_ms: float) -> float:
    """How often an idle replica looks for copies: at its lease's renewals (a third of a
    lease), and no more often than `IDLE_LOOK_MS`."""
    return max(IDLE_LOOK_MS, lease_ms / 3.0)


def copies_due(
    chosen: list[Candidate], room: int, now_ms: float, batch_ms: float, margin_ms: float, look_every_ms: float
) -> bool:
    """Does an idle replica start its batch of the `chosen` copies now? When they fill it,
    or when one of them could not wait for the next look (`look_every_ms` apart, twice over
    for a late look) and still be answered in time. Otherwise the copies wait for more: a
    batch costs the same with 1 copy or `room`, and a copy started at its last moment
    answers a lost request as surely as one started at once."""
    if not chosen:
        return False
    if len(chosen) >= room:
        return True
    last_start = min(c.deadline_ms for c in chosen) - margin_ms - batch_ms
    return last_start < now_ms + 2 * look_every_ms
