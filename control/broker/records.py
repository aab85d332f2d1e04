"""The records that cross processes through the broker, each with its one pack and parse.

- The *owner* record (`keys.owner_key`): which gateways wait for a request in flight,
  "<gateways>|<waiting set>|<tenant>|<attempt>|<fingerprint>|<message>", the gateways
  comma-separated (a retry through another gateway process joins the list). The gateway
  packs the first five; the admission script adds the queue message as it pushed it,
  which is what a sweep or a rescue pushes again (it is in the broker once more, not
  sent again).
- The *done* record: a finished request's answer kept for retries,
  "<fingerprint>|<result JSON>" (a bare JSON object from before fingerprints). It takes
  the owner record's place under the owner key, after `ANSWERED` (an owner record starts
  with a gateway's id, never with '|'), so admission reads one key for both.
- The *held* record (a field of `keys.held_key`): a request a replica took from its
  queue, "<deadline ms>|<queue>|<waiting set>|<request key>": it names the request, whose
  owner record holds the message (a record written with a message last, as before the
  owner kept it, is still read).
- The replica's *registry entry* (`keys.replica_key`): the hash a replica publishes.

The scripts that read the first three inside the broker parse them with the Lua of
`control/broker/scripts.py` (`owner_parts`, `done_parts`, `held_parts`), written next
to the pairs here in the same field order; tests/broker/test_records.py checks both
sides agree. Names go into these records unescaped: settings refuse a '|' in them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from control.core.lifecycle import ReplicaState, parse
from control.core.vocab import COUNTED_DROPS

# -- owner ------------------------------------------------------------------------------


class Owner(NamedTuple):
    gateways: str  # comma-separated gateway ids
    waiting: str  # the waiting set the request was admitted to
    tenant: str
    attempt: str
    fingerprint: str  # of the body ('' when the answer is not kept)
    message: str = ""  # the queue message, added by the admission script


def pack_owner(gateways: str, waiting: str, tenant: str, attempt: str, fingerprint: str, message: str = "") -> str:
    """Without `message`: what the gateway sends (the admission script appends it)."""
    head = f"{gateways}|{waiting}|{tenant}|{attempt}|{fingerprint}"
    return f"{head}|{message}" if message else head


def parse_owner(raw: bytes | str) -> Owner:
    text = raw.decode() if isinstance(raw, bytes) else raw
    gateways, waiting, tenant, rest = text.split("|", 3)
    attempt, _, rest = rest.partition("|")
    fingerprint, _, message = rest.partition("|")
    return Owner(gateways, waiting, tenant, attempt, fingerprint, message)


# -- done -------------------------------------------------------------------------------


class Done(NamedTuple):
    fingerprint: str
    result: str  # the Result's JSON


ANSWERED = "|"  # first in a value under an owner key that holds a done record


def pack_done(fingerprint: str, result: str) -> str:
    return f"{fingerprint}|{result}"


def parse_done(raw: bytes | str) -> Done:
    text = raw.decode() if isinstance(raw, bytes) else raw
    if text.startswith("{"):
        return Done("", text)
    fingerprint, _, result = text.partition("|")
    return Done(fingerprint, result)


# -- held -------------------------------------------------------------------------------


class Held(NamedTuple):
    deadline_ms: float
    queue: str
    waiting: str
    key: str  # the request's tenant-scoped key
    message: str = ""  # only in a record written before the owner kept the message


def pack_held(deadline_ms: float, queue: str, waiting: str, key: str) -> str:
    return f"{deadline_ms:.0f}|{queue}|{waiting}|{key}"


def parse_held(raw: bytes | str) -> Held:
    text = raw.decode() if isinstance(raw, bytes) else raw
    deadline, queue, waiting, rest = text.split("|", 3)
    key, _, message = rest.partition("|")
    return Held(float(deadline), queue, waiting, key, message)


# -- a running or buffered request, as the model's running set holds it (free-slot hedging) --


@dataclass(frozen=True)
class Running:
    attempt: str
    replica: str  # the replica that claimed it, or holds it buffered
    host: str
    tier: str
    max_tokens: int
    key: str


def pack_running(attempt: str, replica: str, host: str, tier: str, max_tokens: int, key: str) -> str:
    """The member HEDGE_LUA parses: the key last, as it may hold anything; a replica's
    name and its host never hold a '|'."""
    return f"{attempt}|{replica.replace('|', '_')}|{host.replace('|', '_')}|{tier}|{max_tokens}|{key}"


def parse_running(raw: bytes | str) -> Running:
    """ValueError for a member that does not read (written by another version)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    attempt, replica, host, tier, max_tokens, key = text.split("|", 5)
    return Running(attempt, replica, host, tier, int(max_tokens), key)


# -- the replica's registry entry -------------------------------------------------------

ENGINE_PREFIX = "engine_"  # entry fields that carry the engine's `stats()`


def pack_replica_entry(
    *,
    model: str,
    state: str,
    held: int,
    moving_to: str,
    backend: str,
    max_batch: int,
    batch_ms: float,
    join_ms: float,
    buffered: int,
    busy: bool,
    host: str,
    pid: int,
    seen_ms: float,
    why_not_ready: str,
    clock_offset_ms: float,
    counters: Mapping[str, float],
    engine: Mapping[str, float],
) -> dict[str, str | int | float]:
    """The hash a replica publishes. `counters`: its batch and perf counters under the
    names `parse_replica_entry` reads (`num_batches`, `dropped_<reason>`, `batch_p50_ms`,
    ...); `engine`: the engine's own stats, stored under `ENGINE_PREFIX`."""
    return {
        "model": model,
        "state": state,
        "held": held,
        "moving_to": moving_to,
        "backend": backend,
        "max_batch": max_batch,
        "batch_ms": batch_ms,
        "join_ms": join_ms,
        "buffered": buffered,
        "busy": int(busy),
        "host": host,
        "pid": pid,
        "seen_ms": seen_ms,
        "why_not_ready": why_not_ready,
        "clock_offset_ms": clock_offset_ms,
        **counters,
        **{f"{ENGINE_PREFIX}{k}": v for k, v in engine.items()},
    }


@dataclass(frozen=True)
class ReplicaInfo:
    name: str
    model: str
    state: ReplicaState | None  # None: a state this version does not know (see `state_label`)
    backend: str
    max_batch: int
    batch_ms: float
    buffered: int
    busy: bool
    num_batches: int
    num_requests: int
    dropped: dict[str, int]
    has_lease: bool = True
    why_not_ready: str = ""
    clock_offset_ms: float = 0.0
    engine: dict[str, float] = field(default_factory=dict)  # the engine's own counters (hf: steps, prefix cache)
    state_label: str = "?"
    host: str = "?"
    pid: int = 0
    num_held: int = 0  # buffered and running
    last_batch_size: int = 0
    batch_p50_ms: float = 0.0  # a batch (static) or a step (continuous)
    batch_p99_ms: float = 0.0
    utilization: float = 0.0  # share of the last 10 s spent running batches or steps
    cycle_ms: float = 0.0  # measured: a batch slot's whole time on the replica (0.0: not yet)
    join_ms: float = 0.0  # continuous: a request taken waits this long for the next step to join
    heartbeat_age_ms: float = 0.0  # broker clock now minus the replica's last publish
    moving_to: str = ""
    wasted_slots: int = 0  # slots run for requests whose client had gone
    wasted_ms: float = 0.0  # their share of the model's time
    taken_shut: int = 0  # requests taken by a pull sent before its gate shut
    handed_back: int = 0  # of those, put back at the front of the queue
    hedged: int = 0  # second copies (hedges) run in its batches' empty slots
    hedge_wins: int = 0  # of those, the ones that answered first
    hedge_wasted: int = 0  # of those, the ones whose request was answered already (or gone)
    cell: int = 0  # the cell (broker) whose registry it was read from

    @property
    def is_ready(self) -> bool:
        """Takes new work: the gateway counts it in its model's capacity."""
        return self.state == ReplicaState.SERVING and self.has_lease and not self.why_not_ready

    @property
    def batch_fill(self) -> float:
        return self.last_batch_size / self.max_batch if self.max_batch else 0.0


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0


def parse_replica_entry(
    name: str, h: Mapping[bytes, bytes], has_lease: bool = True, now_ms: float = 0.0, cell: int = 0
) -> ReplicaInfo:
    """A registry entry as read back (`now_ms`: the broker's clock, for the heartbeat's
    age; `cell`: the cell whose registry held it)."""
    f = {k.decode(): v.decode() for k, v in h.items()}
    seen_ms = _number(f.get("seen_ms", "0"))
    return ReplicaInfo(
        name=name,
        cell=cell,
        model=f.get("model", "?"),
        state=parse(f.get("state", "?")),
        state_label=f.get("state", "?"),
        host=f.get("host", "?"),
        pid=int(_number(f.get("pid", "0"))),
        num_held=int(_number(f.get("held", "0"))),
        last_batch_size=int(_number(f.get("last_batch_size", "0"))),
        batch_p50_ms=_number(f.get("batch_p50_ms", "0")),
        batch_p99_ms=_number(f.get("batch_p99_ms", "0")),
        utilization=_number(f.get("utilization", "0")),
        cycle_ms=_number(f.get("cycle_ms", "0")),
        join_ms=_number(f.get("join_ms", "0")),
        heartbeat_age_ms=max(0.0, now_ms - seen_ms) if now_ms and seen_ms else 0.0,
        moving_to=f.get("moving_to", ""),
        wasted_slots=int(_number(f.get("wasted_slots", "0"))),
        wasted_ms=_number(f.get("wasted_ms", "0")),
        taken_shut=int(_number(f.get("taken_shut", "0"))),
        handed_back=int(_number(f.get("handed_back", "0"))),
        hedged=int(_number(f.get("hedged", "0"))),
        hedge_wins=int(_number(f.get("hedge_wins", "0"))),
        hedge_wasted=int(_number(f.get("hedge_wasted", "0"))),
        backend=f.get("backend", "?"),
        max_batch=int(f.get("max_batch", 0)),
        batch_ms=float(f.get("batch_ms", 0.0)),
        buffered=int(f.get("buffered", 0)),
        busy=f.get("busy") == "1",
        num_batches=int(f.get("num_batches", 0)),
        num_requests=int(f.get("num_requests", 0)),
        dropped={reason: int(f.get(f"dropped_{reason}", 0)) for reason in COUNTED_DROPS},
        has_lease=has_lease,
        why_not_ready=f.get("why_not_ready", ""),
        clock_offset_ms=float(f.get("clock_offset_ms", 0.0)),
        engine={k.removeprefix(ENGINE_PREFIX): _number(v) for k, v in f.items() if k.startswith(ENGINE_PREFIX)},
    )
