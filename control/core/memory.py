"""Keeping Python's cycle collector off the latency path."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_waited_frozen = False  # a standby froze its boot's objects; its next freeze keeps them frozen


def freeze_startup_objects() -> None:
    """Move what startup allocated (Celery, kombu, Flask, pydantic, the app) out of
    the collector's reach, so that a full collection scans only what serving made.

    Without it a full collection pauses a gateway process for tens of milliseconds,
    and every answer due in that time waits for it (docs/decisions/0006).
    """
    global _waited_frozen
    if not _waited_frozen:
        gc.unfreeze()  # called again (a replica restarted after losing its broker): what froze then may be garbage now
    _waited_frozen = False  # after a standby's takeover, only what the takeover made is scanned
    gc.collect()
    gc.freeze()


def freeze_while_waiting() -> None:
    """A standby's boot, frozen before it waits: its takeover's freeze then scans only
    what the takeover allocated."""
    global _waited_frozen
    gc.collect()
    gc.freeze()
    _waited_frozen = True


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
