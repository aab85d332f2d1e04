"""Acting on a replica known dead: its lease dropped and what it held re-queued now.

The lease, held records and sweep themselves are described in control/broker/scripts.py.
"""

from __future__ import annotations

import redis

from control.broker import keys
from control.broker.scripts import SweepOne


def release_replica(client: redis.Redis, name: str, min_ms: float = 265.0) -> tuple[int, int]:
    """A replica is known dead (its supervisor saw it exit): drop its lease and re-queue
    what it held now, rather than when the lease would have lapsed. (requeued, expired)"""
    client.delete(keys.lease_key(name))
    swept = SweepOne(client)(name, min_ms)
    return (0, 0) if swept is None else (swept.requeued, swept.expired)
