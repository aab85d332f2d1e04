"""A client that fails over between regions, for when a whole region is gone.

A gateway forwards to a peer region when its own region cannot serve (api/peers.py),
but when the gateways of a region are gone too only the client can go elsewhere. The
rule an IDE plugin follows (docs/regions.md): an ordered list of regions, nearest
first; a short connect timeout; on a connection error, a timeout or a 503, the next
region, within what remains of the request's budget, with the same X-Request-Id (a
retry reaching a region where the request is still in flight joins it there).

Synchronous, on http.client, one keep-alive connection per region; one client per
thread.
"""

from __future__ import annotations

import http.client
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

DEFAULT_CONNECT_TIMEOUT_S = 0.2  # a nearby region accepts in a few ms; one that does not is gone
MIN_BUDGET_MS = 1.0
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


@dataclass
class RegionAnswer:
    region: str  # the base URL that answered
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class NoRegionAnswered(ConnectionError):
    """No region gave an HTTP answer within the budget."""

    failures: list[tuple[str, str]] = field(default_factory=list)  # (region, what went wrong)

    def __str__(self) -> str:
        tried = "; ".join(f"{url}: {why}" for url, why in self.failures) or "the budget ran out first"
        return f"no region answered ({tried})"


class Region:
    """One region's gateway, through one keep-alive connection."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a region is an http:// or https:// base URL, not {url!r}")
        self.url = url.rstrip("/")
        self.path = parts.path + "/v1/completions"
        self._connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._port = parts.hostname, parts.port
        self._conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes, headers: dict[str, str], connect_s: float, read_s: float) -> RegionAnswer:
        """Raises OSError (timeouts included) or http.client.HTTPException if there is no answer."""
        reused = self._conn is not None
        try:
            return self._post(body, headers, connect_s, read_s)
        except _STALE:
            self.close()
            if not reused:
                raise
            # The server closed the idle connection as the request went out; it never saw it.
            return self._post(body, headers, connect_s, read_s)
        except (OSError, http.client.HTTPException):
            self.close()
            raise

    def _post(self, body: bytes, headers: dict[str, str], connect_s: float, read_s: float) -> RegionAnswer:
        if self._conn is None:
            conn = self._connection_class(self._host, self._port, timeout=connect_s)
            conn.connect()
            self._conn = conn
        assert self._conn.sock is not None
        self._conn.sock.settimeout(read_s)
        self._conn.request("POST", self.path, body=body, headers=headers)
        resp = self._conn.getresponse()
        data = resp.read()
        if resp.will_close:
            self.close()
        return RegionAnswer(self.url, resp.status, dict(resp.getheaders()), data)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class RegionClient:
    """Completions from the first region that can serve them, nearest first."""

    def __init__(
        self,
        regions: list[str],
        api_key: str | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        if not regions:
            raise ValueError("at least one region is needed")
        self.regions = [Region(url) for url in regions]
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s

    def complete(
        self,
        body: dict[str, Any],
        budget_ms: float = 600.0,
        request_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> RegionAnswer:
        """POST /v1/completions to each region in turn until one answers other than 503.

        Returns that answer (any status but 503), else the last 503; raises
        NoRegionAnswered when no region answered at all within `budget_ms`.
        """
        deadline = time.monotonic() + budget_ms / 1000.0
        data = json.dumps(body).encode()
        sent = {**(headers or {}), "Content-Type": "application/json"}
        sent["X-Request-Id"] = request_id or f"cmpl-{secrets.token_hex(16)}"  # the same in every region
        if self.api_key:
            sent["Authorization"] = f"Bearer {self.api_key}"
        refused: RegionAnswer | None = None
        failures: list[tuple[str, str]] = []
        for region in self.regions:
            remaining_s = deadline - time.monotonic()
            if remaining_s * 1000.0 < MIN_BUDGET_MS:
                break
            sent["X-Deadline-Ms"] = str(int(remaining_s * 1000.0))
            try:
                answer = region.post(data, sent, min(self.connect_timeout_s, remaining_s), remaining_s)
            except (OSError, http.client.HTTPException) as exc:
                failures.append((region.url, repr(exc)))
                continue
            if answer.status != 503:
                return answer
            refused = answer
        if refused is not None:
            return refused
        raise NoRegionAnswered(failures)

    def close(self) -> None:
        for region in self.regions:
            region.close()

    def __enter__(self) -> RegionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
