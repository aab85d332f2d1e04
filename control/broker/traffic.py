"""The deployment's traffic, in Redis: arrivals, completions and end-to-end latency per
model and tier, in one small hash per second that expires after `KEEP_S`.

Gateways count the requests they admit in memory and add them every 100 ms, with their
sweep (`record_arrivals`: a few commands a gateway process, not one per request), and
with ADMIT_OPEN every request they were asked to admit (`asked_field`, `read_asked`);
replicas count what they answer in the pipeline that delivers a batch (`record_done`).
Any process reads the last seconds with `read_traffic`: one round trip for the buckets,
queue depths and the oldest queued message of every model and tier.
Latency is kept as a histogram (`LATENCY_BOUNDS_MS`), so a percentile is the upper bound
of the bucket it falls in.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import get_args

import redis

from control.broker import keys
from control.core.vocab import Tier

KEEP_S = 120
LATENCY_BOUNDS_MS = (25, 50, 100, 200, 300, 400, 500, 600, 800, 1000, 1500, 2000, 3000, 5000, 10000, 60000)
TIERS: tuple[Tier, ...] = get_args(Tier)


def arrival_field(model: str, tier: str) -> str:
    """The field of a second's hash that counts the admissions of a model's tier."""
    return f"{model}|{tier}|in"


def asked_field(model: str) -> str:
    """The field of a second's hash that counts the requests of a model that gateways asked
    the cell to admit, admitted or not (ADMIT_OPEN's demand)."""
    return f"{model}|asked"


def read_asked(client: redis.Redis, models: list[str], now_ms: float, whole_s: int) -> dict[str, list[int]]:
    """Each model's asked requests in the `whole_s` whole seconds before `now_ms`'s, oldest
    first, then in its second so far (what the gateways have added): one round trip."""
    second = int(now_ms // 1000)
    fields = [asked_field(m) for m in models]
    pipe = client.pipeline(transaction=False)
    for s in range(second - whole_s, second + 1):
        pipe.hmget(keys.traffic_key(s), fields)
    rows = pipe.execute()
    return {m: [int(row[i] or 0) for row in rows] for i, m in enumerate(models)}


def _bucket(e2e_ms: float) -> int:
    return min(bisect.bisect_left(LATENCY_BOUNDS_MS, e2e_ms), len(LATENCY_BOUNDS_MS) - 1)


def record_arrivals(client: redis.Redis, counts: Mapping[str, int], now_ms: float) -> None:
    """Add a gateway's admissions since its last call (`arrival_field` -> how many) to the
    second of `now_ms` (the broker's clock): one round trip."""
    if not counts:
        return
    key = keys.traffic_key(int(now_ms // 1000))
    pipe = client.pipeline(transaction=False)
    for field, n in counts.items():
        pipe.hincrby(key, field, n)
    pipe.expire(key, KEEP_S)
    pipe.execute()


def record_done(pipe: redis.client.Pipeline, model: str, done: Iterable[tuple[str, float]], now_ms: float) -> None:
    """Queue onto `pipe` the count and latency buckets of answered requests: (tier, end to end ms)."""
    fields: Counter[str] = Counter()
    for tier, e2e_ms in done:
        fields[f"{model}|{tier}|done"] += 1
        fields[f"{model}|{tier}|lat{_bucket(e2e_ms)}"] += 1
    if not fields:
        return
    key = keys.traffic_key(int(now_ms // 1000))
    for field, n in fields.items():
        pipe.hincrby(key, field, n)
    pipe.expire(key, KEEP_S)


@dataclass(frozen=True)
class TierTraffic:
    model: str
    tier: str
    num_queued: int  # admitted, not yet in a batch (in the queue or a replica's buffer)
    oldest_ms: float  # age of the oldest message still in the broker's queue (0: none)
    arrival_rate: float  # admitted per second over the window
    completion_rate: float  # answered per second over the window
    p50_ms: float | None  # end to end, bucket upper bound; None: nothing answered in the window
    p99_ms: float | None


def _percentile(counts: list[int], q: float) -> float | None:
    total = sum(counts)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return float(LATENCY_BOUNDS_MS[i])
    return float(LATENCY_BOUNDS_MS[-1])


def read_traffic(clients: redis.Redis | list[redis.Redis], models: list[str], window_s: int = 10) -> list[TierTraffic]:
    """The last `window_s` whole seconds on each broker's clock, for each model and tier,
    summed over the cells (one client each)."""
    pairs = [(m, t) for m in models for t in TIERS]
    totals: Counter[str] = Counter()
    queued: Counter[tuple[str, str]] = Counter()
    oldest: dict[tuple[str, str], float] = dict.fromkeys(pairs, 0.0)
    for client in clients if isinstance(clients, list) else [clients]:
        seconds, _micro = client.time()
        last = int(seconds) - 1  # the current second is still filling
        now_ms = int(seconds) * 1000 + _micro / 1000
        pipe = client.pipeline(transaction=False)
        for s in range(last - window_s + 1, last + 1):
            pipe.hgetall(keys.traffic_key(s))
        for model, tier in pairs:
            for behind in (False, True):  # in line, and behind other tenants' requests
                pipe.zcount(keys.waiting_key(model, tier, behind), now_ms, "+inf")
                pipe.lindex(keys.queue_key(model, tier, behind), -1)  # kombu pops from the right: the oldest
        replies = pipe.execute()
        buckets, rest = replies[:window_s], replies[window_s:]
        for h in buckets:
            for k, v in h.items():
                totals[k.decode()] += int(v)
        for pair, (n, tail, n_behind, tail_behind) in zip(pairs, _fours(rest), strict=True):
            queued[pair] += int(n) + int(n_behind)
            oldest[pair] = max(oldest[pair], _age_ms(tail, now_ms), _age_ms(tail_behind, now_ms))
    out = []
    for model, tier in pairs:
        lat = [totals[f"{model}|{tier}|lat{i}"] for i in range(len(LATENCY_BOUNDS_MS))]
        out.append(
            TierTraffic(
                model=model,
                tier=tier,
                num_queued=queued[(model, tier)],
                oldest_ms=oldest[(model, tier)],
                arrival_rate=totals[arrival_field(model, tier)] / window_s,
                completion_rate=totals[f"{model}|{tier}|done"] / window_s,
                p50_ms=_percentile(lat, 0.5),
                p99_ms=_percentile(lat, 0.99),
            )
        )
    return out


def _fours(replies: list) -> list[tuple]:
    return [tuple(replies[i : i + 4]) for i in range(0, len(replies), 4)]


def _age_ms(raw: bytes | None, now_ms: float) -> float:
    if raw is None:
        return 0.0
    from control.broker.envelope import job_from_message  # kombu's envelope is known there alone

    try:
        return max(0.0, now_ms - job_from_message(raw).received_ms)
    except (ValueError, KeyError, TypeError, IndexError):
        return 0.0
