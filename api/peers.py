"""Forwarding to a peer region when this one cannot serve a request.

A region is one deployment: its broker, replicas and gateways. When the region
has no live replica for the model (503 `no_replica`) or its broker is away (503
`broker_unavailable`), a gateway configured with `PEERS` sends the request on to
each peer in order while the client's budget lasts, and the first answer that is
not a 503 goes back to the client as the peer gave it. A forwarded request
carries `X-Keybatch-Forwarded: <region>` and is never forwarded again, so two
regions that list each other cannot bounce a request between them. docs/regions.md.

A region short of the replicas it had within the last 30 s (one lost, a host lost, its
broker restarted and not all of them back) sends a request it refuses for want of room
(429 `overloaded`) to a peer too.

A request the region had admitted, and then lost its broker or replicas under, is
forwarded with `X-Keybatch-Stranded: 1`: everything that waited there is forwarded at
that moment, a burst. A peer's replica holding a stranded request starts its batch when
it is full or a deadline calls for it, not `max_wait` after the first arrival
(tasks/policy/collector.py), so the burst rides one or two batches instead of leaving
all but the first few a batch behind. A stranded request is forwarded only with
`RELAY_MS` and `STRANDED_GATHER_MS` (50 ms in all) to spare beyond a batch: one with
less would start a batch the moment it arrives, with little of the burst in it.

The gateway runs under gevent's monkey patching, so urllib3's blocking sockets
yield to the other requests of the process while a peer answers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import urllib3
from flask import Response, current_app, request
from prometheus_client import CollectorRegistry, Counter

from api.errors import ApiError
from control.core import protocol as p
from control.core.settings import Settings

if TYPE_CHECKING:
    from api.gateway import Gateway

log = logging.getLogger(__name__)

FORWARDED_HEADER = "X-Keybatch-Forwarded"
STRANDED_HEADER = "X-Keybatch-Stranded"  # "1": it waited in the region that forwards it
FORWARDABLE = frozenset({"no_replica", "broker_unavailable"})  # the region cannot serve; a peer may
PASSED_REQUEST_HEADERS = ("Authorization", "X-Session-Id", "X-Request-Id")
PASSED_RESPONSE_HEADERS = ("Content-Type", "Retry-After", "X-Request-Id", "Cache-Control")
MAX_CONNECT_S = 0.5  # a peer that does not accept within this is down: leave budget for the next
# A stranded request forwarded with less left than a batch, `RELAY_MS` and this would force
# a start at the peer the moment it arrives, and the rest of its burst would wait a batch.
STRANDED_GATHER_MS = 30.0
# The peer is told the client's budget less this: its answer still has the way back
# through this gateway to make, within the budget this gateway waits for it.
RELAY_MS = 20.0
MIN_BUDGET_MS = 1.0  # X-Deadline-Ms is sent in whole milliseconds, and must be above 0
MAX_CONNECTIONS = 64  # kept per peer; more are opened under a burst and closed after
STREAM_CHUNK = 65_536

_EXTENSION = "keybatch.peers"
_lock = threading.Lock()


def forward(gw: Gateway, job: p.Job, refusal: ApiError, stranded: bool = False) -> Response | None:
    """A peer region's answer to the request this region refused, or None to keep the refusal.
    `stranded`: the region refused it after admitting it (it lost its broker or replicas)."""
    if not is_forwardable(gw, refusal, job.model, stranded):
        return None
    return _peers(gw).forward(job, gw, stranded)


def is_forwarded(environ: dict[str, object]) -> bool:
    """Was this request sent on by a peer region (or by a client that says so)?"""
    return "HTTP_X_KEYBATCH_FORWARDED" in environ


def is_stranded(environ: dict[str, object]) -> bool:
    """Was this request forwarded by a peer region that had admitted it?"""
    return is_forwarded(environ) and environ.get("HTTP_X_KEYBATCH_STRANDED") == "1"


def is_forwardable(gw: Gateway, refusal: ApiError, model: str, stranded: bool) -> bool:
    """What the region cannot serve (503), and, while it is short of the replicas it had
    lately, what it refused at admission for want of room (429 `overloaded`): its peers
    have that room by design (regions are sized so that two carry the peak). A region at
    its full count keeps its 429s, so an overload is not doubled across regions. Never a
    request a peer forwarded here."""
    if not gw.settings.peers or FORWARDED_HEADER in request.headers:
        return False
    if refusal.status == 503:
        return refusal.code in FORWARDABLE
    return refusal.code == "overloaded" and not stranded and gw.short_of_replicas(model)


def _peers(gw: Gateway) -> Peers:
    """One set of peer pools per gateway process, made on the first forward."""
    peers = current_app.extensions.get(_EXTENSION)
    if peers is None:
        with _lock:
            peers = current_app.extensions.get(_EXTENSION)
            if peers is None:
                peers = current_app.extensions[_EXTENSION] = Peers(gw.settings, gw.metrics.registry)
    return peers


class Peer:
    """One peer region's gateway, through a pool of keep-alive connections."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.path = (urllib3.util.parse_url(url).path or "") + "/v1/completions"
        self.pool = urllib3.connection_from_url(url, maxsize=MAX_CONNECTIONS, block=False, retries=False)

    def send(self, body: bytes, headers: dict[str, str], budget_ms: float) -> urllib3.BaseHTTPResponse:
        """Send the request; the status and headers are read, the body is left to the caller.

        Raises urllib3's HTTPError when the peer cannot be reached or does not answer in time.
        Not retried here: a peer that did not answer in the budget will not answer a second
        send in what is left of it; the next peer is the retry.
        """
        budget_s = budget_ms / 1000.0
        timeout = urllib3.Timeout(total=budget_s, connect=min(budget_s, MAX_CONNECT_S))
        return self.pool.urlopen(
            "POST",
            self.path,
            body=body,
            headers=headers,
            timeout=timeout,
            retries=False,
            redirect=False,
            preload_content=False,
        )


class Peers:
    """The peer regions of this gateway, tried in the configured order."""

    def __init__(self, settings: Settings, registry: CollectorRegistry) -> None:
        self.region = settings.region
        self.peers = [Peer(url) for url in settings.peers]
        self.outcomes = Counter(
            "keybatch_forwarded",
            "Requests forwarded to a peer region, by peer and the peer's status (or unreachable)",
            ["peer", "status"],
            registry=registry,
        )

    def forward(self, job: p.Job, gw: Gateway, stranded: bool) -> Response | None:
        body = request.get_data(cache=True)  # the handler parsed it already; the bytes are kept
        # A peer cannot run a batch in less than a batch time: the refusal stands then.
        least_ms = max(MIN_BUDGET_MS, gw.settings.batch_ms + gw.settings.deadline_margin_ms)
        if stranded:  # and it gathers the burst this long before it starts one
            least_ms += STRANDED_GATHER_MS
        for peer in self.peers:
            budget_ms = job.deadline_ms - gw.clock.now_ms()
            if budget_ms - RELAY_MS < least_ms:
                break
            headers = self._headers(job, budget_ms - RELAY_MS, stranded)
            answer = self._try(peer, body, headers, budget_ms, job.stream)
            if answer is not None:
                return answer
        return None

    def _headers(self, job: p.Job, budget_ms: float, stranded: bool) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "X-Deadline-Ms": str(int(budget_ms)),
            FORWARDED_HEADER: self.region,
        }
        if stranded:
            headers[STRANDED_HEADER] = "1"
        for name in PASSED_REQUEST_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    def _try(self, peer: Peer, body: bytes, headers: dict[str, str], budget_ms: float, stream: bool) -> Response | None:
        """The peer's answer for the client, or None if the peer could not take the request."""
        try:
            resp = peer.send(body, headers, budget_ms)
        except urllib3.exceptions.HTTPError as exc:
            self._unreachable(peer, exc)
            return None
        self.outcomes.labels(peer.url, str(resp.status)).inc()
        if resp.status == 503:  # that region cannot serve it either
            resp.drain_conn()
            resp.release_conn()
            return None
        passed = {name: resp.headers[name] for name in PASSED_RESPONSE_HEADERS if name in resp.headers}
        if stream:  # server-sent events go to the client as the peer sends them
            return Response(_relay(peer, resp), status=resp.status, headers=passed)
        try:
            data = resp.read()
        except urllib3.exceptions.HTTPError as exc:
            resp.close()
            self._unreachable(peer, exc)
            return None
        finally:
            resp.release_conn()
        return Response(data, status=resp.status, headers=passed)

    def _unreachable(self, peer: Peer, exc: Exception) -> None:
        log.warning("peer region %s did not answer: %r", peer.url, exc)
        self.outcomes.labels(peer.url, "unreachable").inc()


def _relay(peer: Peer, resp: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    complete = False
    try:
        yield from resp.stream(STREAM_CHUNK)
        complete = True
    except urllib3.exceptions.HTTPError as exc:  # the client sees the stream end without [DONE]
        log.warning("peer region %s broke off a stream: %r", peer.url, exc)
    finally:
        if not complete:  # broken, or the client left: the connection has unread data
            resp.close()
        resp.release_conn()
