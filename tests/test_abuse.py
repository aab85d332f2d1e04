"""The gateway under abuse: raw sockets against a real deployment."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import pytest

from tests.conftest import Deployment, deployment

MAX_CONNECTIONS = 40  # per gateway process
MAX_PROMPT_CHARS = 1000  # a body limit of 1000 * 6 + 65,536 bytes (Settings.max_body_bytes)
MAX_BODY = MAX_PROMPT_CHARS * 6 + 65_536
DRIBBLE_S = 0.25  # a byte this often: well inside any per-read timeout
BODY = b'{"model": "kb-small", "prompt": "x = 1"}'


@pytest.fixture(scope="module")
def kb_tight() -> Iterator[Deployment]:
    with deployment(
        header_timeout_s="1",
        body_timeout_s="1",
        max_connections=str(MAX_CONNECTIONS),
        max_prompt_chars=str(MAX_PROMPT_CHARS),
    ) as d:
        yield d


def _connect(kb: Deployment) -> socket.socket:
    host, port = kb.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _answer(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65_536):
        data += chunk
    return data


@dataclass
class Dribbled:
    answer: bytes = b""
    answered_s: float | None = None  # since the attack started
    closed_s: float | None = None


def _dribble(socks: list[socket.socket], bound_s: float = 6.0) -> list[Dribbled]:
    """Send each socket one byte every DRIBBLE_S until the server answers and closes it."""
    seen = {s: Dribbled() for s in socks}
    start = next_byte = time.monotonic()
    while time.monotonic() - start < bound_s:
        open_ = [s for s in socks if seen[s].closed_s is None]
        if not open_:
            break
        if time.monotonic() >= next_byte:
            for s in open_:
                try:
                    s.send(b"x")
                except OSError:
                    pass  # the server closed it; its answer is read below
            next_byte += DRIBBLE_S
        readable, _, _ = select.select(open_, [], [], max(0.0, next_byte - time.monotonic()))
        for s in readable:
            try:
                data = s.recv(65_536)
            except OSError:
                data = b""
            at = time.monotonic() - start
            if data:
                seen[s].answer += data
                seen[s].answered_s = seen[s].answered_s or at
            else:
                seen[s].closed_s = at
    return [seen[s] for s in socks]


def _assert_cut_at_the_deadline(results: list[Dribbled], deadline_s: float) -> None:
    for r in results:
        assert r.answer.startswith(b"HTTP/1.1 408 "), r.answer[:80]
        assert b'"code":"request_timeout"' in r.answer
        assert r.answered_s is not None and deadline_s - 0.2 <= r.answered_s <= deadline_s + 2.0, r
        assert r.closed_s is not None, "still open"


def test_slowloris_headers_are_cut_at_the_header_deadline_while_others_are_served(kb_tight: Deployment) -> None:
    idle = _connect(kb_tight)  # sends nothing: the keep-alive limit (5 s), not the header deadline, closes it
    idle_since = time.monotonic()
    slow = [_connect(kb_tight) for _ in range(30)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Slow: ")
    with ThreadPoolExecutor(4) as pool:
        normal = [pool.submit(kb_tight.post) for _ in range(4)]
        results = _dribble(slow)
        assert [f.result().status_code for f in normal] == [200] * 4
    _assert_cut_at_the_deadline(results, deadline_s=1.0)
    idle.settimeout(0)
    with pytest.raises(BlockingIOError):
        idle.recv(1)  # still open past the header deadline
    assert _answer(idle) == b""  # then closed, without an answer
    assert 4.5 <= time.monotonic() - idle_since <= 8
    for s in [idle, *slow]:
        s.close()


def test_a_dribbled_body_is_cut_at_the_body_deadline(kb_tight: Deployment) -> None:
    slow = [_connect(kb_tight) for _ in range(10)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n{")
    _assert_cut_at_the_deadline(_dribble(slow), deadline_s=1.0)
    for s in slow:
        s.close()


def test_bodies_over_the_limit_answer_413_chunked_or_not(kb_tight: Deployment) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"x" * 8192
    with _connect(kb_tight) as s:
        s.sendall(head)
        sent = 0
        while sent <= MAX_BODY:  # one chunk past the limit, then the last chunk
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        s.sendall(b"0\r\n\r\n")
        answer = _answer(s)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:80]
    assert b'"code":"request_too_large"' in answer
    with _connect(kb_tight) as s:  # refused on its Content-Length, before a byte of the body
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000000\r\n\r\n")
        assert _answer(s).startswith(b"HTTP/1.1 413 ")


def test_chunked_bodies_within_the_limit_are_served(kb_tight: Deployment) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (BODY[:10], BODY[10:]))
    with _connect(kb_tight) as s:
        s.sendall(head + chunks + b"0\r\n\r\n")
        answer = _answer(s)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert b'"object":"text_completion"' in answer
    with _connect(kb_tight) as s:  # any other transfer coding: the body's end is unknown
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n" + BODY)
        assert _answer(s).startswith(b"HTTP/1.1 400 ")


def _connections_held(kb: Deployment) -> list[int]:
    """Established client connections each gateway process holds."""
    port = int(kb.url.rsplit(":", 1)[1])
    workers = psutil.Process(kb.system.gateway.pid).children()  # type: ignore[union-attr]
    return [
        sum(1 for c in w.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)
        for w in workers
    ]


def test_each_gateway_process_holds_at_most_max_connections(kb_tight: Deployment) -> None:
    flood = [_connect(kb_tight) for _ in range(2 * MAX_CONNECTIONS + 20)]  # idle: they send nothing
    deadline = time.monotonic() + 5
    while (held := _connections_held(kb_tight)) != [MAX_CONNECTIONS] * 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held == [MAX_CONNECTIONS] * 2
    # One more client connects (the kernel's backlog takes it) but is not served until
    # a connection closes.
    late = _connect(kb_tight)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
    late.sendall(head % len(BODY) + BODY)
    assert select.select([late], [], [], 1.0)[0] == []
    assert _connections_held(kb_tight) == [MAX_CONNECTIONS] * 2
    for s in flood:
        s.close()
    assert _answer(late).startswith(b"HTTP/1.1 200 ")
    late.close()
