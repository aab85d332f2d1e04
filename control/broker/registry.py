"""The replica registry as read from Redis: who serves which model, and how.

Each replica refreshes its entry (`keys.replica_key`: the hash of
control/broker/records.py) with a short TTL and adds its name to `keys.REPLICAS_KEY`;
a name whose hash expired is a dead replica. A replica takes work only while its lease
(`keys.lease_key`, renewed by its batching loop) is alive: a hung replica keeps its
heartbeat but loses its lease.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import cast

import redis

from control.broker import keys
from control.broker.records import ENGINE_PREFIX, ReplicaInfo, parse_replica_entry
from control.policy.admission import Capacity, phases_of, pooled_capacity

__all__ = ["ENGINE_PREFIX", "FleetView", "FleetViews", "ReplicaInfo", "capacity_of", "read_fleet"]

log = logging.getLogger(__name__)

# A registry this much older than the last read comes from another clock (a broker failed
# over to another host), not from an old sweep: a sweep's registry lives 10 locks (900 ms).
CLOCK_STEP_MS = 1000.0
LAUNCH_REFRESH_S = 0.05  # how often the replicas' launches are read (ADMIT_PHASED)
PHASE_HORIZON_MS = 2000.0  # starts are foreseen this far; a longer budget counts as before


def read_fleet(client: redis.Redis, cell: int = 0) -> list[ReplicaInfo]:
    """The registry entry by entry."""
    return _read_fleet(client, cell)[1]


def _read_fleet(client: redis.Redis, cell: int) -> tuple[float, list[ReplicaInfo]]:
    """The broker's time of the read (ms) and the registry entry by entry."""
    members = cast("set[bytes]", client.smembers(keys.REPLICAS_KEY))  # the client does not decode replies
    names = sorted(n.decode() for n in members)
    if not names:
        return _broker_ms(client), []
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.replica_key(name))
        pipe.exists(keys.lease_key(name))
    pipe.time()
    *replies, (seconds, micros) = pipe.execute()
    now_ms = seconds * 1000 + micros / 1000
    fleet, dead = [], []
    for name, h, lease in zip(names, replies[::2], replies[1::2], strict=True):
        if h:
            fleet.append(parse_replica_entry(name, h, bool(lease), now_ms, cell))
        else:
            dead.append(name)
    if dead:
        client.srem(keys.REPLICAS_KEY, *dead)
    return now_ms, fleet


def _broker_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds * 1000 + micros / 1000)


def parse_fleet_digest(raw: bytes | str, cell: int = 0) -> list[ReplicaInfo]:
    """The registry as the last locked sweep left it (`keys.FLEET_KEY`, control/broker/lua.py)."""
    return _parse_fleet_digest(raw, cell)[1]


def _parse_fleet_digest(raw: bytes | str, cell: int) -> tuple[float, list[ReplicaInfo]]:
    """The broker's time of the sweep (ms) and the registry as it left it."""
    now_ms, *entries = json.loads(raw)
    fleet = []
    for name, flat, lease in entries:  # flat: the entry's fields and values, in turn (never empty)
        h = {k.encode(): v.encode() for k, v in zip(flat[::2], flat[1::2], strict=True)}
        fleet.append(parse_replica_entry(name, h, bool(lease), float(now_ms), cell))
    return float(now_ms), sorted(fleet, key=lambda rep: rep.name)


def capacity_of(
    fleet: list[ReplicaInfo],
    model: str,
    launches: dict[str, float] | None = None,
    read_ms: float = 0.0,
) -> Capacity:
    """What the model's ready replicas serve: their engines' batch and their measured cycles;
    with `launches` (replica -> its last launch, epoch ms, read at `read_ms`), when each
    starts next (`admission.phases_of`)."""
    ready = [r for r in fleet if r.model == model and r.is_ready]
    capacity = pooled_capacity([(r.max_batch, r.batch_ms, r.cycle_ms) for r in ready])
    capacity = replace(capacity, join_ms=max((r.join_ms for r in ready), default=0.0))
    if launches is None or not ready or capacity.join_ms > 0:
        return capacity
    last = [launches.get(r.name, -math.inf) for r in ready]
    return replace(capacity, phases=phases_of(last, read_ms, capacity.slot_ms, PHASE_HORIZON_MS))


# A model with fewer ready replicas than it had within this long is short of them: its
# region sends what it must refuse for want of room to a peer region instead.
SHORT_WINDOW_S = 30.0


def track_peaks(
    peaks: dict[str, tuple[int, float]], counts: dict[str, int], now_s: float, window_s: float = SHORT_WINDOW_S
) -> dict[str, tuple[int, float]]:
    """Each model's highest ready count and when it was last seen at it: a count as high
    replaces it, and so does any count once the peak is `window_s` old."""
    out = {}
    for model in peaks.keys() | counts.keys():
        count = counts.get(model, 0)
        peak, seen_s = peaks.get(model, (0, now_s))
        out[model] = (count, now_s) if count >= peak or now_s - seen_s > window_s else (peak, seen_s)
    return out


class FleetView:
    """A copy of the registry, refreshed in the background every `refresh_s`."""

    def __init__(self, client: redis.Redis, refresh_s: float = 0.25, cell: int = 0, phased: bool = False) -> None:
        self.client = client
        self.cell = cell
        self.refresh_s = refresh_s
        # ADMIT_PHASED: the static replicas' launches, read every LAUNCH_REFRESH_S, for
        # admission to count the starts their phases hold.
        self.phased = phased
        # The broker's time of the last read, and model -> replica -> last launch (epoch ms):
        # one value, replaced whole, so a request never reads one read's time with another's.
        self.launches: tuple[float, dict[str, dict[str, float]]] = (0.0, {})
        self.replicas: list[ReplicaInfo] = []
        self._capacity: dict[str, Capacity] = {}  # per model, for the `replicas` read last
        self.num_wasted = 0  # results that found their request answered or gone, whole deployment
        self.num_hedge_wasted = 0  # second copies whose request was answered first, whole deployment
        self.is_reachable = False
        self.ready: dict[str, int] = {}  # model -> its replicas ready, as of the last read
        self.peaks: dict[str, tuple[int, float]] = {}  # model -> (most ready replicas lately, when)
        self.read_at = 0.0  # time.monotonic() of the last successful read
        self.as_of_ms = 0.0  # the broker's time of the registry state in `replicas`
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

    def refresh(self, direct: bool = False) -> None:
        """Read the registry: as the last sweep left it (one GET, whatever the fleet's
        size), or `direct`ly, entry by entry (also where no sweep left one). A sweep's
        registry older than what a direct read found is not taken: the replica seen come
        back would be gone again until the next sweep."""
        try:
            digest, wasted, hedge_wasted = self.client.mget([keys.FLEET_KEY, keys.WASTED_KEY, keys.HEDGE_WASTED_KEY])
            if direct or digest is None:
                as_of_ms, replicas = _read_fleet(self.client, self.cell)
            else:
                as_of_ms, replicas = _parse_fleet_digest(digest, self.cell)
            if not 0 < self.as_of_ms - as_of_ms < CLOCK_STEP_MS:
                self.replicas, self._capacity, self.as_of_ms = replicas, {}, as_of_ms
            self.num_wasted = int(wasted or 0)
            self.num_hedge_wasted = int(hedge_wasted or 0)
            self.is_reachable = True
            self.read_at = time.monotonic()
            self.ready = Counter(rep.model for rep in self.replicas if rep.is_ready)
            self.peaks = track_peaks(self.peaks, self.ready, self.read_at)
        except redis.RedisError:
            self.is_reachable = False

    def short_of(self, model: str) -> bool:
        """Fewer of the model's replicas ready than there were within `SHORT_WINDOW_S`."""
        peak, _ = self.peaks.get(model, (0, 0.0))
        return self.ready.get(model, 0) < peak

    def refresh_launches(self) -> None:
        """Read each model's launch list (`keys.launch_key`) and the broker's time."""
        models = sorted({r.model for r in self.replicas})
        if not models:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for model in models:
                pipe.zrange(keys.launch_key(model), 0, -1, withscores=True)
            pipe.time()
            *lists, (seconds, micros) = pipe.execute()
        except redis.RedisError:
            return
        read = {
            model: {name.decode(): float(at) for name, at in found} for model, found in zip(models, lists, strict=True)
        }
        self.launches = (seconds * 1000 + micros / 1000, read)
        self._capacity = {}

    def _loop(self) -> None:
        """The registry every `refresh_s`; with phases, the launches at every tick between."""
        every = LAUNCH_REFRESH_S if self.phased else self.refresh_s
        ticks_per_refresh = max(1, round(self.refresh_s / every))
        tick = 0
        while not self._stop.wait(every):
            tick += 1
            if tick % ticks_per_refresh == 0:
                self.refresh()
            if self.phased:
                self.refresh_launches()

    def age_s(self) -> float:
        """Seconds since the registry was last read."""
        return time.monotonic() - self.read_at

    def capacity(self, model: str) -> Capacity:
        """Pooled once per registry read, not once per request."""
        cache = self._capacity  # a refresh meanwhile starts a new one
        capacity = cache.get(model)
        if capacity is None:
            read_ms, launches = self.launches
            mine = launches.get(model) if self.phased else None
            capacity = cache[model] = capacity_of(self.replicas, model, mine, read_ms)
        return capacity


class FleetViews:
    """The registries of every cell, read as one fleet (each replica names its cell)."""

    def __init__(self, views: list[FleetView]) -> None:
        self.views = views

    @property
    def replicas(self) -> list[ReplicaInfo]:
        return [rep for view in self.views for rep in view.replicas]

    @property
    def num_wasted(self) -> int:
        return sum(view.num_wasted for view in self.views)

    @property
    def num_hedge_wasted(self) -> int:
        return sum(view.num_hedge_wasted for view in self.views)

    def refresh(self, direct: bool = False) -> None:
        for view in self.views:
            view.refresh(direct)
