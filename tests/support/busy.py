"""Replicas kept busy on purpose, so that the next request waits in the queue behind them."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import redis

from control.broker import keys
from control.core.vocab import FREE, PAID
from tests.support.deploy import MODEL, Deployment
from tests.support.waiting import until


def _broker_ms(state: redis.Redis) -> float:
    seconds, micros = state.time()
    return seconds * 1000.0 + micros / 1000.0


def busy_replicas(kb: Deployment, n: int = 2) -> list:
    """Start one batch on each replica so that the next request has to wait: returns once
    `n` replicas have launched a batch since (a replica that holds its start for its phase
    behind a peer launches up to a gap later)."""
    state = redis.Redis.from_url(kb.system.redis_url)
    since = _broker_ms(state)
    pool = ThreadPoolExecutor(n)
    futures = []
    for i in range(n):  # one at a time: idle replicas may leave arrivals to one (SINGLE_LISTENER)
        futures.append(pool.submit(kb.post, {"model": MODEL, "prompt": f"busy {i}"}))
        launched = until(lambda k=i + 1: state.zcount(keys.launch_key(MODEL), since, "+inf") >= k, 5, every_s=0.002)
        assert launched, "not busy"
    state.close()
    return futures


def queued_behind_busy_replicas(kb: Deployment, **headers: str) -> tuple[Future, list[Future]]:
    """A request that has to wait in the queue, and the batches it waits behind: returns
    once it is admitted and waiting (in the queue or a replica's buffer, not started)."""
    busy = busy_replicas(kb)
    state = redis.Redis.from_url(kb.system.redis_url)
    waiting = [keys.waiting_key(MODEL, tier, behind) for tier in (PAID, FREE) for behind in (False, True)]

    def live() -> int:  # admitted and not started (scored by deadline: past ones are stale)
        now = _broker_ms(state)
        return sum(state.zcount(key, now, "+inf") for key in waiting)

    before = live()
    queued = ThreadPoolExecutor(1).submit(kb.post, **headers)
    admitted = until(lambda: live() > before, 5, every_s=0.005)
    state.close()
    assert admitted, "not queued"
    return queued, busy
