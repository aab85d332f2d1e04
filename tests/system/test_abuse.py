"""The gateway under abuse (raw sockets against a real deployment), and noticing clients
that hang up (api/disconnect.py in a real gevent pywsgi server)."""

from __future__ import annotations

import queue
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import pytest

from api.disconnect import hangup_event
from tests.support.deploy import Deployment, deployment

MAX_CONNECTIONS = 40  # per gateway process
MAX_PROMPT_CHARS = 1000  # a body limit of 1000 * 6 + 65,536 bytes (Settings.max_body_bytes)
MAX_BODY = MAX_PROMPT_CHARS * 6 + 65_536
FIRST_BYTE_S = 3.0  # a new connection's first byte; then the keep-alive limit (5 s) between requests
DRIBBLE_S = 0.25  # a byte this often: well inside any per-read timeout
BODY = b'{"model": "kb-small", "prompt": "x = 1"}'


@pytest.fixture(scope="module")
def kb_tight() -> Iterator[Deployment]:
    with deployment(
        header_timeout_s="1",
        body_timeout_s="1",
        first_byte_timeout_s=str(FIRST_BYTE_S),
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
    idle = _connect(kb_tight)  # sends nothing: the first-byte deadline, not the header deadline, closes it
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
    assert FIRST_BYTE_S - 0.5 <= time.monotonic() - idle_since <= FIRST_BYTE_S + 3
    for s in [idle, *slow]:
        s.close()


def test_the_deadlines_and_the_idle_limit_are_per_request_not_per_connection(kb_tight: Deployment) -> None:
    # Over four requests this kept-alive client idles 5.6 s in all (the idle limit is
    # 5 s) and spends 1.6 s sending header blocks (their deadline is 1 s).
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % len(BODY)
    with _connect(kb_tight) as s:
        s.settimeout(10)
        for _ in range(4):
            time.sleep(1.4)  # the client's pace, as an IDE between keystrokes
            s.sendall(head)
            time.sleep(0.4)
            s.sendall(b"\r\n" + BODY)
            answer = s.recv(65_536)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:80]
            while not answer.endswith(b"}"):  # the rest of the JSON body, if it came apart
                answer += s.recv(65_536)


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


def test_each_gateway_process_holds_at_most_max_connections_and_a_new_one_is_served(kb_tight: Deployment) -> None:
    flood = [_connect(kb_tight) for _ in range(2 * MAX_CONNECTIONS + 20)]  # idle: they send nothing
    seen: list[list[int]] = []
    settled = None
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        seen.append(held := _connections_held(kb_tight))
        if max(held) == MAX_CONNECTIONS and len(seen) > 1 and seen[-2] == held:
            settled = held
            break
        time.sleep(0.05)
    # Which process accepts is the kernel's choice: a full one keeps accepting (its
    # longest waiting give way), so one of them may take most of the flood.
    assert settled is not None, seen
    # A full process accepts first and then sheds: a reading between the two sees one more.
    assert max(map(max, seen)) <= MAX_CONNECTIONS + 1, seen
    # One more client is served at once: the connection waiting longest gives way to it
    # (api/server/conntable.py), rather than the client waiting in the listen backlog.
    late = _connect(kb_tight)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
    late.sendall(head % len(BODY) + BODY)
    assert _answer(late, timeout_s=1.5).startswith(b"HTTP/1.1 200 ")
    assert max(_connections_held(kb_tight)) <= MAX_CONNECTIONS
    late.close()
    for s in flood:
        s.close()


# -- noticing hang-ups -------------------------------------------------------------


@pytest.fixture(scope="module")
def hangup_server() -> Iterator[tuple[int, queue.Queue[str]]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.hangup_server"], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in stdout], daemon=True).start()
    try:
        yield int(lines.get(timeout=20)), lines
    finally:
        proc.kill()
        proc.wait(10)


def _request(port: int, path: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % path.encode())
    return sock


def test_a_client_that_closes_or_resets_is_noticed_at_once(hangup_server: tuple[int, queue.Queue[str]]) -> None:
    port, lines = hangup_server
    sock = _request(port, "/closes?10")
    assert lines.get(timeout=5) == "GET /closes watching"
    sock.close()
    assert lines.get(timeout=2) == "GET /closes gone"  # long before its 10 s
    sock = _request(port, "/resets?10")
    assert lines.get(timeout=5) == "GET /resets watching"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # an RST, not a FIN
    assert lines.get(timeout=2) == "GET /resets gone"


def test_a_client_that_stays_or_pipelines_is_not_taken_for_gone(hangup_server: tuple[int, queue.Queue[str]]) -> None:
    port, lines = hangup_server
    with _request(port, "/stays?0.3") as sock:
        assert [lines.get(timeout=5) for _ in range(2)] == ["GET /stays watching", "GET /stays stayed"]
        # The same connection serves another request: the watch left nothing behind.
        sock.sendall(b"GET /again?0.1 HTTP/1.1\r\nHost: t\r\n\r\n")
        assert [lines.get(timeout=5) for _ in range(2)] == ["GET /again watching", "GET /again stayed"]
    with _request(port, "/first?0.3") as sock:
        assert lines.get(timeout=5) == "GET /first watching"
        # Pipelined while the first waits: its bytes reach the socket the watch is on.
        sock.sendall(b"GET /second?0.1 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        want = ["GET /first stayed", "GET /second watching", "GET /second stayed"]  # peeked at, not taken
        assert [lines.get(timeout=5) for _ in want] == want
        assert _answer(sock).count(b"HTTP/1.1 200 OK") == 2


def test_a_closed_watch_sets_nothing(hangup_server: tuple[int, queue.Queue[str]]) -> None:
    port, lines = hangup_server
    sock = _request(port, "/closed?0.5")
    assert lines.get(timeout=5) == "GET /closed watching"
    sock.close()
    assert lines.get(timeout=5) == "GET /closed stayed"


def test_no_client_socket_no_watch() -> None:
    assert hangup_event({}) is None
