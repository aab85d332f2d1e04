"""Reading what replicas sent a gateway, as a test stands in for the gateway."""

from __future__ import annotations

import redis

from control.broker import keys
from control.core import protocol as p


def take_items(state: redis.Redis, gateway: str = "gw") -> list[dict]:
    """Every item waiting in the gateway's reply list, taken out in one transaction: a reply
    pushed between a read and a separate delete would be lost to the test."""
    pipe = state.pipeline(transaction=True)
    pipe.lrange(keys.reply_key(gateway), 0, -1)
    pipe.delete(keys.reply_key(gateway))
    raws, _deleted = pipe.execute()
    return [item for raw in raws for item in p.Reply.model_validate_json(raw).model_dump()["items"]]
