"""Waiting on a state, not on the clock; which processes are still running; the logs a
failed run kept."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil


def until(check: Callable[[], object], timeout_s: float = 10.0, every_s: float = 0.05) -> bool:
    """Poll `check` until it is true or `timeout_s` has passed: a state, not a sleep."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return False


def alive(pids: list[int]) -> list[int]:
    """The processes among `pids` still running (a zombie is not)."""
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def drop_kept_logs(stderr: str) -> list[str]:
    """Delete the logs a failed chaos or ops run kept (it names them on stderr, never in
    its JSON); their paths."""
    paths = [path for line in stderr.splitlines() if line.startswith("logs kept: ") for path in line[11:].split(", ")]
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)
    return paths
