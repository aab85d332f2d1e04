"""The replica registry as read from Redis: who serves which model, and how.

Each replica refreshes a hash `kb:replica:<name>` with a short TTL and adds its
name to `kb:replicas`; a name whose hash expired is a dead replica. A replica takes
work only while its lease (`kb:lease:<name>`, renewed by its batching loop) is alive:
a hung replica keeps its heartbeat but loses its lease.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import cast

import redis

from control.core import protocol as p
from control.core.lifecycle import ReplicaState, parse
from control.policy.admission import Capacity, pooled_capacity

log = logging.getLogger(__name__)

ENGINE_PREFIX = "engine_"  # replica hash fields that carry the engine's `stats()`


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0


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
    heartbeat_age_ms: float = 0.0  # broker clock now minus the replica's last publish
    moving_to: str = ""
    wasted_slots: int = 0  # slots run for requests whose client had gone
    wasted_ms: float = 0.0  # their share of the model's time
    taken_shut: int = 0  # requests taken by a pull sent before its gate shut
    handed_back: int = 0  # of those, put back at the front of the queue

    @property
    def is_ready(self) -> bool:
        """Takes new work: the gateway counts it in its model's capacity."""
        return self.state == ReplicaState.SERVING and self.has_lease and not self.why_not_ready

    @property
    def batch_fill(self) -> float:
        return self.last_batch_size / self.max_batch if self.max_batch else 0.0

    @classmethod
    def from_hash(cls, name: str, h: dict[bytes, bytes], has_lease: bool = True, now_ms: float = 0.0) -> ReplicaInfo:
        f = {k.decode(): v.decode() for k, v in h.items()}
        seen_ms = _number(f.get("seen_ms", "0"))
        return cls(
            name=name,
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
            heartbeat_age_ms=max(0.0, now_ms - seen_ms) if now_ms and seen_ms else 0.0,
            moving_to=f.get("moving_to", ""),
            wasted_slots=int(_number(f.get("wasted_slots", "0"))),
            wasted_ms=_number(f.get("wasted_ms", "0")),
            taken_shut=int(_number(f.get("taken_shut", "0"))),
            handed_back=int(_number(f.get("handed_back", "0"))),
            backend=f.get("backend", "?"),
            max_batch=int(f.get("max_batch", 0)),
            batch_ms=float(f.get("batch_ms", 0.0)),
            buffered=int(f.get("buffered", 0)),
            busy=f.get("busy") == "1",
            num_batches=int(f.get("num_batches", 0)),
            num_requests=int(f.get("num_requests", 0)),
            dropped={
                reason: int(f.get(f"dropped_{reason}", 0)) for reason in ("cancelled", "superseded", "expired", "gone")
            },
            has_lease=has_lease,
            why_not_ready=f.get("why_not_ready", ""),
            clock_offset_ms=float(f.get("clock_offset_ms", 0.0)),
            engine={k.removeprefix(ENGINE_PREFIX): _number(v) for k, v in f.items() if k.startswith(ENGINE_PREFIX)},
        )


def read_fleet(client: redis.Redis) -> list[ReplicaInfo]:
    members = cast("set[bytes]", client.smembers(p.REPLICAS_KEY))  # the client does not decode replies
    names = sorted(n.decode() for n in members)
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(p.replica_key(name))
        pipe.exists(p.lease_key(name))
    pipe.time()
    *replies, (seconds, micros) = pipe.execute()
    now_ms = seconds * 1000 + micros / 1000
    fleet, dead = [], []
    for name, h, lease in zip(names, replies[::2], replies[1::2], strict=True):
        if h:
            fleet.append(ReplicaInfo.from_hash(name, h, bool(lease), now_ms))
        else:
            dead.append(name)
    if dead:
        client.srem(p.REPLICAS_KEY, *dead)
    return fleet


def capacity_of(fleet: list[ReplicaInfo], model: str) -> Capacity:
    return pooled_capacity([(r.max_batch, r.batch_ms) for r in fleet if r.model == model and r.is_ready])


class FleetView:
    """A copy of the registry, refreshed in the background every `refresh_s`."""

    def __init__(self, client: redis.Redis, refresh_s: float = 0.25) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self.replicas: list[ReplicaInfo] = []
        self.num_wasted = 0  # results that found their request answered or gone, whole deployment
        self.is_reachable = False
        self.read_at = 0.0  # time.monotonic() of the last successful read
        self._started = False
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        for _ in range(3):  # a first read that fails would leave an empty fleet until the next
            self.refresh()
            if self.is_reachable:
                break
        threading.Thread(target=self._loop, name="fleet-view", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def refresh(self) -> None:
        try:
            self.replicas = read_fleet(self.client)
            self.num_wasted = int(self.client.get(p.WASTED_KEY) or 0)
            self.is_reachable = True
            self.read_at = time.monotonic()
        except redis.RedisError:
            self.is_reachable = False

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def age_s(self) -> float:
        """Seconds since the registry was last read."""
        return time.monotonic() - self.read_at

    def capacity(self, model: str) -> Capacity:
        return capacity_of(self.replicas, model)
