"""Keeping Python's cycle collector off the latency path."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_objects() -> None:
    """Move what startup allocated (Celery, kombu, Flask, pydantic, the app) out of
    the collector's reach, so that a full collection scans only what serving made.

    Without it a full collection pauses a gateway process for tens of milliseconds,
    and every answer due in that time waits for it (docs/decisions/0006).
    """
    gc.unfreeze()  # called again (a replica restarted after losing its broker): what froze then may be garbage now
    gc.collect()
    gc.freeze()


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cycle collection inside the block, one after it: for the load generator,
    whose records and tasks grow through a run (a full collection there paused
    every answer's time stamp by ~50 ms)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()
