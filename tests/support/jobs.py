"""Jobs as a gateway admitted them, written straight to the broker (no gateway running)."""

from __future__ import annotations

import redis

from control.broker import keys
from control.core import protocol as p
from tests.support.deploy import MODEL


def admitted_job(state: redis.Redis, i: int, now_ms: float, prompt: str = "x", budget_ms: float = 10_000) -> p.Job:
    """A request as a gateway admitted it: an owner pointing at gateway "gw"."""
    state.set(keys.owner_key(f"t:r{i}"), f"gw|{keys.waiting_key(MODEL, 'free')}|t|a{i}", px=20_000)
    return p.Job(
        id=f"a{i}",
        key=f"t:r{i}",
        model=MODEL,
        prompt=f"{prompt} {i}",
        gateway="gw",
        received_ms=now_ms,
        deadline_ms=now_ms + budget_ms,
    )
