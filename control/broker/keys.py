"""Every Redis key name the deployment uses, made in one place.

A key is the prefix (its hash tag: docs/decisions/0015-broker-sharding.md) and its
parts, joined by ':' in `key`: giving every key a broker cell of its own changes that
one function. The Lua scripts spell no key either: they get the prefix-built pieces
they extend at run time (`lua_prelude`, built here from these functions).

The one name made elsewhere is a model's Celery queue (`protocol.queue_name`): kombu's
Redis transport keeps the queue in a list of that name, so it is both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from control.core import protocol as p
from control.core.vocab import FREE, PAID, Tier

PREFIX = p.PREFIX
HASH_TAG = p.HASH_TAG
BEHIND_SUFFIX = ":behind"  # a tier's waiting set of requests behind other keys' ones
TENANT_PART = ":t:"  # a tenant's share of a tier's waiting sets, after the tier's set


_HEAD = f"{PREFIX}:"


def key(*parts: object) -> str:
    """The key made of `parts`, under the one prefix (and hash tag) of the request path."""
    return _HEAD + ":".join([part if type(part) is str else str(part) for part in parts])


REPLICAS_KEY = key("replicas")  # names of the replicas that published a registry entry
HOLDERS_KEY = key("holders")  # replicas that may hold requests (control/broker/scripts.py)
WASTED_KEY = key("stats", "wasted")  # results that found their request answered or gone
HEDGE_WASTED_KEY = key("stats", "hedge_wasted")  # second copies (hedges) whose request was answered first
DEATHS_KEY = key("deaths")  # replicas ever swept, and pulses lapsed: gateways then run RESCUE
PULSES_KEY = key("pulses")  # replicas whose pulse (`pulse_key`) a sweep watches
SWEEPING_KEY = key("sweeping")  # held by the gateway process that sweeps now (one a cell at a time)
FLEET_KEY = key("fleet")  # the registry as the last sweep read it, for every gateway in one GET
EPOCH_KEY = key("epoch")  # set once by the first sweep of a broker's keyspace: a new one means it was lost


def queue_key(model: str, tier: Tier, behind: bool = False) -> str:
    """The Redis list kombu's Redis transport keeps a queue's messages of one priority in
    (`behind`: the tier's requests queued behind other keys' ones)."""
    priority = p.priority_of(tier) + (p.BEHIND_STEP if behind else 0)
    name = p.queue_name(model)
    return name if priority == 0 else f"{name}{p.PRIORITY_SEP}{priority}"


class LaneKeys(NamedTuple):
    """The keys of one model's tier that admission names for every request."""

    waiting: str  # the tier's waiting set
    waiting_behind: str
    waiting_paid: str
    waiting_free: str
    waiting_paid_behind: str
    waiting_free_behind: str
    queue: str
    queue_behind: str


@functools.lru_cache(maxsize=256)
def lane_keys(model: str, tier: Tier) -> LaneKeys:
    """Made once per model and tier (models are the deployment's few): the request path
    names them on every admission."""
    return LaneKeys(
        waiting_key(model, tier),
        waiting_key(model, tier, behind=True),
        waiting_key(model, PAID),
        waiting_key(model, FREE),
        waiting_key(model, PAID, behind=True),
        waiting_key(model, FREE, behind=True),
        queue_key(model, tier),
        queue_key(model, tier, behind=True),
    )


def reply_key(gateway_id: str) -> str:
    return key("reply", gateway_id)


def owner_key(request_key: str) -> str:
    """Which gateway holds the connection of a request in flight, by its tenant-scoped key;
    once answered, the answer kept for retries with the same id (control/broker/records.py)."""
    return key("req", request_key)


def cancel_key(attempt: str) -> str:
    return key("cancel", attempt)


def keyof_key(attempt: str) -> str:
    """A free request's key by its attempt, while it may be bumped (`ADMIT_BUMP`): a paid
    admission that bumps it cancels it under its key. Expires with its owner."""
    return key("keyof", attempt)


def listener_key(model: str) -> str:
    """SINGLE_LISTENER: the name of the one idle replica of a model that waits on its queue
    now (expires unless renewed: a holder that dies loses it)."""
    return key("listener", model)


def pulse_key(replica: str) -> str:
    """A replica's pulse: renewed from a thread of its own, it lapses soon after the
    process stops (PULSE_MS); a sweep that finds it gone counts a death."""
    return key("pulse", replica)


def listener_turn_key(model: str) -> str:
    """A list the model's other idle replicas block on (BLPOP) for the listener's turn: its
    holder pushes one item when its batch starts."""
    return key("listener", model, "turn")


def lease_key(replica: str) -> str:
    """Exists while the replica's batching loop is alive (renewed every few 100 ms)."""
    return key("lease", replica)


def held_key(replica: str) -> str:
    """Hash of the requests a replica took from the queue and has not answered."""
    return key("held", replica)


def claim_key(attempt: str) -> str:
    """Which replica runs an attempt (set before its batch starts)."""
    return key("claim", attempt)


def requeued_key(attempt: str) -> str:
    """How many times an attempt was put back in its queue after its replica died."""
    return key("requeued", attempt)


def running_key(model: str) -> str:
    """Sorted set of the model's requests running now or buffered for a replica's next
    batch, with the host of each, scored by deadline: what a batch with slots to spare may
    carry a second copy of (free-slot hedging, control/broker/lua.py's `HEDGE_LUA`)."""
    return key("running", model)


def copy_key(attempt: str) -> str:
    """Which replica runs the second copy of an attempt (a hedge)."""
    return key("copy", attempt)


def session_key(session_id: str) -> str:
    return key("session", session_id)


def last_key(session_id: str) -> str:
    """A session's last completion, for typed-through reuse (control/policy/reuse.py)."""
    return key("last", session_id)


def waiting_key(model: str, tier: Tier, behind: bool = False) -> str:
    """Sorted set of requests admitted but not yet in a batch, scored by deadline (`behind`:
    those in the tier's list behind other keys' requests)."""
    return key("waiting", model, tier) + (BEHIND_SUFFIX if behind else "")


def tenant_waiting_key(model: str, tier: Tier, tenant: str) -> str:
    """Sorted set of one tenant's requests waiting in a model's tier (either list), scored
    by deadline: the tenant's share of the queue. Named after the tier's waiting set, so the
    scripts that hold only a request's waiting set and tenant find it (control/broker/scripts.py)."""
    return f"{waiting_key(model, tier)}{TENANT_PART}{tenant}"


def bucket_key(tier: Tier, tenant: str) -> str:
    """Hash of one tenant's admission token bucket (tokens, when counted)."""
    return key("bucket", tier, tenant)


def idle_key(model: str) -> str:
    """Sorted set of the model's idle replicas, scored by when that news goes stale."""
    return key("idle", model)


def launch_key(model: str) -> str:
    """Sorted set of the model's replicas, scored by when each last started a batch."""
    return key("launch", model)


def replica_key(name: str) -> str:
    """The replica's registry entry (control/broker/records.py), refreshed with a short TTL."""
    return key("replica", name)


def assignment_key(name: str) -> str:
    """The model a replica was moved to: it serves that one again after a restart."""
    return key("assign", name)


def traffic_key(second: int) -> str:
    """One second's traffic counters (control/broker/traffic.py)."""
    return key("traffic", second)


def _stem(make: Callable[[str], str]) -> str:
    """The piece of a dynamic key before its last part."""
    return make("")


# What the Lua scripts extend at run time: the stem of each dynamic key (a script adds the
# id it found), and the fixed keys whole.
LUA_KEYS: dict[str, str] = {
    "reply": _stem(reply_key),
    "owner": _stem(owner_key),
    "cancel": _stem(cancel_key),
    "keyof": _stem(keyof_key),
    "lease": _stem(lease_key),
    "held": _stem(held_key),
    "claim": _stem(claim_key),
    "requeued": _stem(requeued_key),
    "replica": _stem(replica_key),
    "idle": _stem(idle_key),
    "launch": _stem(launch_key),
    "running": _stem(running_key),
    "copy": _stem(copy_key),
    "bucket": key("bucket", ""),  # + tier ':' tenant: `bucket_key`
    "holders": HOLDERS_KEY,
    "deaths": DEATHS_KEY,
    "pulse": _stem(pulse_key),
    "pulses": PULSES_KEY,
    "replicas": REPLICAS_KEY,
    "sweeping": SWEEPING_KEY,
    "fleet": FLEET_KEY,
    "epoch": EPOCH_KEY,
    "wasted": WASTED_KEY,
    "behind": BEHIND_SUFFIX,
    "tenant": TENANT_PART,
}
