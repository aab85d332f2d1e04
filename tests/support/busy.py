"""Replicas kept busy on purpose, so that the next request waits in the queue behind them."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from tests.support.deploy import MODEL, Deployment


def busy_replicas(kb: Deployment, n: int = 2) -> list:
    """Start one batch on each replica so that the next request has to wait."""
    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(kb.post, {"model": MODEL, "prompt": f"busy {i}"}) for i in range(n)]
    time.sleep(0.08)
    return futures


def queued_behind_busy_replicas(kb: Deployment, **headers: str) -> tuple[Future, list[Future]]:
    """A request that has to wait in the queue, and the batches it waits behind."""
    busy = busy_replicas(kb)
    queued = ThreadPoolExecutor(1).submit(kb.post, **headers)
    time.sleep(0.03)
    return queued, busy
