"""A lean HTTP/1.1 keep-alive client for the load generator (httptools parses).

The load generator shares two cores with the system it measures, so what it
spends per request is taken from the gateway. This client, an asyncio protocol
with httptools' C parser, spends a fraction of aiohttp's CPU per request (the
figures: docs/decisions/0005). It also stamps the answer when its
last byte is parsed, not when the waiting coroutine next runs. It does only
what the load generator needs: one request at a time per connection, bodies
with Content-Length or chunked, a pool of idle connections reused first-in
first-out: traffic spreads over every connection, as it does over the
connections of many users, and so over the gateway's processes. (Reused
last-in first-out, a few hot connections carry most requests, and whichever
gateway process holds them does most of the work: docs/decisions/0005.)
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools


class Answer:
    __slots__ = ("status", "body", "done_s", "first_data_s")

    def __init__(self, status: int, body: bytes, done_s: float, first_data_s: float | None = None) -> None:
        self.status = status
        self.body = body
        self.done_s = done_s  # time.perf_counter() when the last byte was parsed
        self.first_data_s = first_data_s  # when the first server-sent event with data came (streams)


class _Connection(asyncio.Protocol):
    def __init__(self, pool: deque[_Connection]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Answer] | None = None
        self.chunks: list[bytes] = []
        self.first_data_s: float | None = None
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"bad response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.pool:
            self.pool.remove(self)
        self._fail(ConnectionError("connection closed by the server"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        if self.first_data_s is None and b"data: " in body:
            self.first_data_s = time.perf_counter()
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        answer = Answer(self.parser.get_status_code(), b"".join(self.chunks), time.perf_counter(), self.first_data_s)
        self.chunks, self.first_data_s = [], None
        waiter, self.waiter = self.waiter, None
        if not self.parser.should_keep_alive():
            self.close()
        elif not self.closed:
            self.pool.append(self)
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def send(self, data: bytes, waiter: asyncio.Future[Answer]) -> None:
        assert self.transport is not None
        self.waiter = waiter
        self.transport.write(data)

    def give_up(self) -> None:
        self._fail(TimeoutError("no answer in time"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()


class Client:
    """POSTs to one server; `post` returns the status, body and completion time."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._host_header = f"{self.host}:{self.port}"
        self._idle: deque[_Connection] = deque()

    async def post(
        self, path: str, body: bytes, headers: dict[str, str], timeout_s: float, fresh: bool = False
    ) -> Answer:
        """`fresh`: on a new connection (a retry after a broken one: the idle ones may be
        broken too)."""
        loop = asyncio.get_running_loop()
        conn = self._idle.popleft() if self._idle and not fresh else await self._connect(loop)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self._host_header}\r\nContent-Length: {len(body)}\r\n{head}\r\n"
        ).encode("latin-1") + body
        waiter: asyncio.Future[Answer] = loop.create_future()
        conn.send(request, waiter)
        timer = loop.call_later(timeout_s, conn.give_up)
        try:
            return await waiter
        except asyncio.CancelledError:
            conn.close()  # a connection with a request outstanding is never reused
            raise
        finally:
            timer.cancel()

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        _transport, conn = await loop.create_connection(lambda: _Connection(self._idle), self.host, self.port)
        return conn

    def close(self) -> None:
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()
