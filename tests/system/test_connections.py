"""The gateway's connections under abuse (raw sockets against a real deployment): the
table of slots (api/server/conntable.py, through api/server/serve.py), the header block's
cap, the send timeout, and HTTP/1.1 framing as RFC 9112 has it."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.support.deploy import PAID_KEY, Deployment, deployment
from tests.support.waiting import until

GENERAL, RESERVE, PER_ADDRESS = 20, 5, 6  # one gateway process
FIRST_BYTE_S = 3.5
BODY = b'{"model": "kb-small", "prompt": "x = 1"}'


@pytest.fixture(scope="module")
def kb_conns() -> Iterator[Deployment]:
    with deployment(
        api_processes="1",
        max_connections=str(GENERAL),
        paid_reserve_connections=str(RESERVE),
        max_connections_per_address=str(PER_ADDRESS),
        first_byte_timeout_s=str(FIRST_BYTE_S),
        send_timeout_s="1",
    ) as d:
        yield d
        _wait_drained(d)


@pytest.fixture
def kb(kb_conns: Deployment) -> Iterator[Deployment]:
    _wait_drained(kb_conns)  # what one test left open does not count against the next
    yield kb_conns


def _port(kb: Deployment) -> int:
    return int(kb.url.rsplit(":", 1)[1])


def _connect(kb: Deployment, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _port(kb)), timeout=10, source_address=(source, 0))
    return sock


def _held(kb: Deployment) -> set[tuple[str, int]]:
    """The client ends of the connections the gateway process holds open."""
    workers = psutil.Process(kb.system.gateway.pid).children()  # type: ignore[union-attr]
    return {
        (c.raddr.ip, c.raddr.port)
        for w in workers
        for c in w.net_connections("tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == _port(kb) and c.raddr
    }


def _wait_drained(kb: Deployment, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _held(kb) and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_drained_to(kb: Deployment, count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_held(kb)) > count and time.monotonic() < deadline:
        time.sleep(0.02)


def _wait_held(kb: Deployment, count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_held(kb)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_held(kb)) >= count


def _answer(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65_536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (sending nothing) within `seconds`."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _completion(key: str | None = None, close: bool = True) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    conn = b"Connection: close\r\n" if close else b""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    return head + auth + conn + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY


def _read_response(sock: socket.socket) -> bytes:
    """One response (by its Content-Length) off a kept-alive connection."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65_536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
    while len(body) < length:
        body += sock.recv(65_536)
    return head + b"\r\n\r\n" + body


def _busy(kb: Deployment, source: str) -> socket.socket:
    """A connection whose request's header block is in and whose body is awaited."""
    sock = _connect(kb, source)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")
    return sock


# -- slots ----------------------------------------------------------------------------


def test_a_pool_full_of_idle_connections_gives_way_to_a_paid_request_at_once(kb: Deployment) -> None:
    sources = [f"127.0.0.{2 + i % 4}" for i in range(GENERAL)]  # under the per-address cap
    idle = []
    for source in sources:
        idle.append(_connect(kb, source))
        _wait_held(kb, len(idle))  # in this order: the first is the one waiting longest
    started = time.monotonic()
    with _connect(kb) as paid:
        paid.sendall(_completion(PAID_KEY))
        answer = _answer(paid)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert time.monotonic() - started < 1.5  # one batch, not the idle ones' first-byte deadline
    assert _closed_within(idle[0], 0.5)  # the longest waiting gave way
    for s in idle:
        s.close()


def _refused_503(answer: bytes) -> bool:
    return (
        answer.startswith(b"HTTP/1.1 503 ")
        and b"Retry-After: 1\r\n" in answer
        and b'"code":"too_many_connections"' in answer
    )


def test_when_every_general_slot_serves_a_request_paid_traffic_keeps_its_share(kb: Deployment) -> None:
    # Paid kept-alive connections: in the reserve, outside the general pool.
    paid = [_connect(kb) for _ in range(RESERVE - 2)]
    for s in paid:
        s.sendall(_completion(PAID_KEY, close=False))
    for s in paid:
        assert _read_response(s).startswith(b"HTTP/1.1 200 ")
    busy = [_busy(kb, f"127.0.0.{2 + i % 4}") for i in range(GENERAL)]  # all of the general pool
    _wait_held(kb, len(paid) + GENERAL)
    started = time.monotonic()
    with _connect(kb, "127.0.0.9") as late:  # a free request on a new connection: refused at once
        late.sendall(_completion())
        answer = _answer(late, timeout_s=3)
    assert time.monotonic() - started < 0.5
    assert _refused_503(answer), answer[:200]
    started = time.monotonic()
    with _connect(kb, "127.0.0.9") as new_paid:  # a paid one is served
        new_paid.sendall(_completion(PAID_KEY))
        answer = _answer(new_paid)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert time.monotonic() - started < 1.5
    for s in paid:  # and the paid connections kept theirs
        s.sendall(_completion(PAID_KEY, close=False))
        assert _read_response(s).startswith(b"HTTP/1.1 200 ")
    for s in paid:
        s.close()
    # Every reserve slot serving a paid request too: a new connection is refused on accept.
    _wait_drained_to(kb, GENERAL)
    paid_busy = []
    for _ in range(RESERVE):  # one at a time: one on trial that has sent nothing gives way to a newer one
        s = _connect(kb, "127.0.0.10")
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {PAID_KEY}\r\n".encode())
        s.sendall(b"Content-Length: 100\r\n\r\n{")
        paid_busy.append(s)
        _wait_held(kb, GENERAL + len(paid_busy))
    started = time.monotonic()
    with _connect(kb, "127.0.0.9") as late:
        answer = _answer(late, timeout_s=3)  # it sends nothing: the answer comes on accept
    assert time.monotonic() - started < 0.5
    assert _refused_503(answer), answer[:200]
    for s in busy + paid_busy:
        s.close()


def test_one_address_holds_at_most_its_cap_and_others_are_served(kb: Deployment) -> None:
    idle = []
    for _ in range(PER_ADDRESS):
        idle.append(_connect(kb, "127.0.0.2"))
        _wait_held(kb, len(idle))
    extra = _connect(kb, "127.0.0.2")
    assert _closed_within(idle[0], 1.0)  # the address's own longest waiting gave way
    busy = [_busy(kb, "127.0.0.3") for _ in range(PER_ADDRESS)]
    _wait_held(kb, PER_ADDRESS * 2)
    with _connect(kb, "127.0.0.3") as over:  # its slots all serve requests: refused
        over.sendall(_completion())
        assert _answer(over, timeout_s=3).startswith(b"HTTP/1.1 503 ")
    with _connect(kb, "127.0.0.4") as other:  # another address is served
        other.sendall(_completion())
        assert _answer(other).startswith(b"HTTP/1.1 200 ")
    assert sum(ip == "127.0.0.3" for ip, _port in _held(kb)) == PER_ADDRESS
    for s in [*idle, extra, *busy]:
        s.close()


def test_a_new_connection_that_sends_nothing_is_closed_at_its_first_byte_deadline(kb: Deployment) -> None:
    with _connect(kb) as idle:
        started = time.monotonic()
        assert _closed_within(idle, FIRST_BYTE_S + 2)
        assert FIRST_BYTE_S - 0.3 <= time.monotonic() - started <= FIRST_BYTE_S + 0.8


def test_a_client_that_never_reads_its_answers_is_closed_at_the_send_timeout(kb: Deployment) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", _port(kb)))
    me = sock.getsockname()
    sock.setblocking(False)
    request = b"GET /openapi.json HTTP/1.1\r\nHost: t\r\n\r\n" * 50  # answers of some kB each
    stop = time.monotonic() + 2.0
    while time.monotonic() < stop:  # pipelined, as fast as the server takes them
        try:
            sock.send(request)
        except BlockingIOError:
            time.sleep(0.05)
        except OSError:
            break
    deadline = time.monotonic() + 5
    while me in _held(kb) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert me not in _held(kb), "still held"
    sock.close()


def test_the_table_sheds_the_longest_waiting_and_keeps_the_reserve_for_paid_requests() -> None:
    from api.server.conntable import ConnectionTable

    shed: list[str] = []
    table = ConnectionTable(general=2, reserve=2)

    def admit(name: str) -> Any:
        conn = table.admit(name, lambda: shed.append(name))
        assert conn is not None, name
        return conn

    a, b = admit("a"), admit("b")
    table.busy(a, paid=True)  # into the reserve: a general slot frees
    c = admit("c")
    assert shed == [] and (a.pool, c.pool) == ("reserve", "general")
    table.busy(b, paid=False)
    table.busy(c, paid=False)
    d = admit("d")  # no general slot waits: on trial in the reserve
    assert d.pool == "trial" and table.busy(d, paid=False) is False  # not paid: refused
    table.release(d)
    e = admit("e")
    assert table.busy(e, paid=True) and e.pool == "reserve"
    assert table.admit("f", lambda: None) is None  # every slot serves a request
    table.waiting(c)
    g = admit("g")  # the longest waiting gives way
    assert shed == ["c"]
    table.busy(g, paid=False)
    table.release(c)  # released when shed already: nothing counted twice
    table.waiting(a)
    h = admit("h")  # on trial, in the slot of the waiting paid one
    assert h.pool == "trial" and shed == ["c", "a"]
    assert table.used == {"general": 2, "reserve": 1, "trial": 1}


# -- the header block -----------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        b"".join(b"X-Big-%d: %s\r\n" % (i, b"a" * 65_000) for i in range(99)),  # 6.4 MB
        b"X-A: %s\r\nX-B: %s\r\n" % (b"a" * 20_000, b"b" * 20_000),  # 40 kB
        b"".join(b"X-%d: v\r\n" % i for i in range(101)),
    ],
    ids=["99-fields-of-65kB", "40kB", "101-fields"],
)
def test_a_header_block_over_its_caps_is_answered_431_and_closed(kb: Deployment, fields: bytes) -> None:
    with _connect(kb) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        try:
            s.sendall(fields + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it was all sent
        answer = _answer(s)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b'"code":"headers_too_large"' in answer


def test_a_request_line_too_long_is_answered_414_and_closed(kb: Deployment) -> None:
    with _connect(kb) as s:
        s.sendall(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n" + HEALTHZ)
        answer = _answer(s)
    assert answer.startswith(b"HTTP/1.1 414 ") and answer.count(b"HTTP/1.1 ") == 1, answer[:200]


def test_a_header_block_within_its_caps_is_served(kb: Deployment) -> None:
    fields = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 200) for i in range(60))
    with _connect(kb) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + fields + b"\r\n")
        assert _answer(s).startswith(b"HTTP/1.1 200 ")


# -- framing (RFC 9112) ---------------------------------------------------------------

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    ("request_", "status"),
    [
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 39\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + HEALTHZ,
            400,
        ),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 39\r\nContent-Length: 40\r\n\r\n" + BODY, 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 39, 40\r\n\r\n" + BODY, 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\nContent-Length: 39\r\n\r\n" + BODY, 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: +39\r\n\r\n" + BODY, 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3_9\r\n\r\n" + BODY, 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0x27\r\n\r\n" + BODY, 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\x0b\r\n\r\n0\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \xa0chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501),
        (b"POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    ],
    ids=[
        "length-and-chunked",
        "two-lengths",
        "length-list",
        "folded-coding",
        "folded-field",
        "plus-length",
        "underscore-length",
        "hex-length",
        "chunked-vt",
        "nbsp-chunked",
        "chunked-twice",
        "gzip-chunked",
        "chunked-in-1.0",
        "no-host",
        "two-hosts",
    ],
)
def test_ambiguous_framing_is_refused_and_the_connection_closed(kb: Deployment, request_: bytes, status: int) -> None:
    with _connect(kb) as s:
        s.sendall(request_ + HEALTHZ)  # a request after it is never served
        answer = _answer(s)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert len(re.findall(rb"HTTP/1\.1 \d{3} ", answer)) == 1, answer
    assert b'"error"' in answer


@pytest.mark.parametrize(
    "request_",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (len(BODY), BODY),
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\nContent-Length: 40\r\n\r\n" + BODY,
        b"GET /healthz HTTP/1.0\r\n\r\n",
    ],
    ids=["chunked-any-case", "same-length-twice", "1.0-without-host"],
)
def test_well_framed_requests_are_served(kb: Deployment, request_: bytes) -> None:
    assert len(BODY) == 40
    with _connect(kb) as s:
        s.sendall(request_.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
        answer = _answer(s)
    assert answer.split(b" ", 2)[1] == b"200", answer[:300]


def test_a_waiting_connection_whose_request_has_arrived_is_not_shed() -> None:
    from api.server.conntable import ConnectionTable

    shed: list[str] = []
    arrived = {"a"}  # a's next request is in its socket, not read by its handler yet
    table = ConnectionTable(general=2, reserve=0)
    for name in ("a", "b"):
        table.admit(name, lambda name=name: shed.append(name), lambda name=name: name in arrived)
    assert table.admit("c", lambda: None, lambda: "c" in arrived) is not None
    assert shed == ["b"]  # a waited longer, but has a request on its way in
    arrived.add("c")
    assert table.admit("d", lambda: None) is None  # none idle: refused, nothing closed
    assert shed == ["b"]


def test_has_input_sees_bytes_not_yet_read_and_not_an_end_of_file() -> None:
    from api.server.serve import has_input

    left, right = socket.socketpair()
    try:
        assert has_input(right) is False
        left.sendall(b"GET / HTTP/1.1\r\n")
        assert until(lambda: has_input(right), timeout_s=2.0)
        assert right.recv(64) == b"GET / HTTP/1.1\r\n"  # peeked, not consumed
        left.close()
        assert has_input(right) is False
    finally:
        right.close()
