"""Contract tests of the modules that reach into libraries' internals, each against the
real library (and a real Valkey where it talks to one): an upgrade that moves what
they touch fails here, not in production. The queue message's envelope has its own
(`test_messages.py`)."""

from __future__ import annotations

import http.client
import inspect
import io
import json
import socket
import subprocess
import sys
import time

import pytest
import redis
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.connection import Connection as KombuConnection
from kombu.exceptions import OperationalError

from api.server.headers import read_headers
from control.core import protocol as p
from control.core.settings import Settings
from control.fleet.valkey import EmbeddedBroker
from tasks.celery import celery_internals, kombu_internals
from tasks.celery.app import make_celery
from tests.support.waiting import until


@pytest.fixture(scope="module")
def broker_url() -> object:
    with EmbeddedBroker() as broker:
        yield broker.url


# -- the header parser (gevent's pywsgi message, the email package's field list) --

BLOCKS = [
    b"Host: a\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n",
    b"host: a\r\nX-Dup: 1\r\nx-dup: 2\r\nAuthorization:  Bearer k  \r\n\r\n",
    b"Host: a\nX-Bare-Lf: yes\n\n",
    b"\r\n",
]


@pytest.mark.parametrize("block", BLOCKS)
def test_the_header_parser_builds_what_http_client_builds(block: bytes) -> None:
    from gevent.pywsgi import OldMessage

    ours = read_headers(io.BytesIO(block))
    theirs = http.client.parse_headers(io.BytesIO(block), _class=OldMessage)
    assert isinstance(ours, OldMessage)
    assert ours.status == theirs.status == ""
    assert [name.lower() for name in ours.keys()] == [name.lower() for name in theirs.keys()]
    for name in theirs.keys():
        assert ours.get_all(name) == [" ".join(v.split()) for v in theirs.get_all(name)]
        assert ours[name] is not None and name.upper() in ours  # case-insensitive, like email's
        for asked in (name, name.lower(), name.upper()):  # our indexed `get` answers as email's does
            assert ours.get(asked) == " ".join(theirs.get(asked).split())
    assert ours.get("X-Absent") is theirs.get("X-Absent") is None
    assert ours.get("X-Absent", "") == theirs.get("X-Absent", "") == ""
    # pywsgi reads the fields from the list email keeps them in, to build the environ
    assert [name for name, _value in ours._headers] == [name for name, _value in theirs._headers]
    for message in (ours, theirs):  # pywsgi deletes Content-Length for a chunked body; fields may change
        del message["content-length"]
        message["X-Added"] = "1"
    assert ours.get("Content-Length") is theirs.get("Content-Length") is None
    assert ours.get("x-added") == theirs.get("x-added") == "1"


@pytest.mark.parametrize(
    ("block", "status"),
    [
        (b"Host a\r\n\r\n", "Invalid header line"),
        (b"Bad Name: x\r\n\r\n", "Invalid header line"),
        (b"X: a\rb\r\n\r\n", "Invalid header line"),
        (b" X: folded first\r\n\r\n", "Invalid header line"),
        (b"Host: a\r\nX-Folded: one\r\n  two\r\n\r\n", "Obsolete line folding"),
        (b"X: " + b"a" * 70_000 + b"\r\n\r\n", "Line too long"),
        (b"".join(b"X%d: v\r\n" % i for i in range(101)) + b"\r\n", "Too many headers"),
    ],
)
def test_a_malformed_header_block_sets_the_status_pywsgi_answers_400(block: bytes, status: str) -> None:
    assert read_headers(io.BytesIO(block)).status == status


# -- pywsgi's answer, written by our handler --------------------------------------

ANSWER_PROBE = """
from gevent import monkey
monkey.patch_all()
import json, re, socket, sys
from gevent.pywsgi import WSGIServer
from gunicorn.workers.ggevent import PyWSGIHandler
from api.server.handler import handler_class
from api.server.limits import RequestLimits

def app(environ, start_response):
    if environ["PATH_INFO"] == "/environ":  # the header fields as the app sees them
        fields = {k: v for k, v in environ.items() if k.startswith(("HTTP_", "CONTENT_"))}
        body = json.dumps(fields, sort_keys=True).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]
    if environ["PATH_INFO"] == "/chunked":  # no Content-Length: pywsgi frames it in chunks
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        return iter([b"data: one\\n\\n", b"data: two\\n\\n"])
    body = b'{"id": "cmpl-1", "object": "text_completion"}'
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]

FIELDS = (  # repeated names, a name with _, spaces around a value, an empty one, a form feed, framing
    b"X-Dup: 1\\r\\nx-dup: 2\\r\\nX_Under: dropped\\r\\nAccept:   spaced  \\r\\nX-Empty:\\r\\nX-Feed: form\\x0c\\r\\n"
    b"Content-Type: text/plain\\r\\nContent-Length: 0\\r\\n"
)
ours = handler_class(RequestLimits(header_timeout_s=5.0, body_timeout_s=5.0, max_body_bytes=1000))
seen = {}
for name, base in (("ours", ours), ("pywsgi", PyWSGIHandler)):
    sends = []
    class Counting(base):
        def _sendall(self, data):
            sends.append(bytes(data))
            return super()._sendall(data)
    server = WSGIServer(("127.0.0.1", 0), app, handler_class=Counting, log=None)
    server.start()
    for path in ("/json", "/chunked", "/environ"):
        sends.clear()
        with socket.create_connection(server.address) as client:
            request = b"GET %s HTTP/1.1\\r\\nHost: a\\r\\nConnection: close\\r\\n%s\\r\\n" % (path.encode(), FIELDS)
            client.sendall(request)
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
        seen[name + path] = {
            "answer": re.sub(rb"Date: [^\\r]*", b"Date: -", answer).decode(),
            "first_send_has_body": path == "/json" and sends[0].endswith(b"}"),
            "sends": len(sends),
        }
    server.stop()
print(json.dumps(seen))
"""


def test_the_answer_goes_in_one_send_with_the_bytes_pywsgi_sends_and_the_environ_it_builds() -> None:
    out = subprocess.run([sys.executable, "-c", ANSWER_PROBE], capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    for path in ("/json", "/chunked", "/environ"):  # the environ: pywsgi's fields, built from our parser's pairs
        assert seen["ours" + path]["answer"] == seen["pywsgi" + path]["answer"]
    assert '"HTTP_X_DUP": "1,2"' in seen["ours/environ"]["answer"] and "UNDER" not in seen["ours/environ"]["answer"]
    assert seen["ours/json"]["sends"] == 1 and seen["ours/json"]["first_send_has_body"]
    assert seen["pywsgi/json"]["sends"] == 2  # what the override is for: header block and body apart
    assert seen["ours/chunked"]["sends"] == seen["pywsgi/chunked"]["sends"] - 1  # the first chunk goes with the headers


# -- redis-py's pooled-connection check under gevent -------------------------------

POLL_PROBE = """
from gevent import monkey
monkey.patch_all()
import json, sys
import redis
from redis._parsers import hiredis
from api.server.redis_internals import unpatched_pool_checks

patched_poll = hiredis.select.poll
unpatched_pool_checks()
calls = []
real_poll = hiredis.select.poll
def counting_poll(*args):
    calls.append(1)
    return real_poll(*args)
hiredis.select.poll = counting_poll
client = redis.Redis.from_url(sys.argv[1])
client.ping()
client.ping()
print(json.dumps({
    "patched_was_gevent": patched_poll is not monkey.get_original("select", "poll"),
    "now_original": real_poll is monkey.get_original("select", "poll"),
    "parser": type(client.connection_pool.get_connection()._parser).__name__,
    "polls": len(calls),
}))
"""


def test_redis_py_checks_pooled_connections_through_the_poll_we_swap(broker_url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", POLL_PROBE, broker_url], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["patched_was_gevent"], "gevent no longer patches the poll redis-py uses: the swap is moot"
    assert seen["now_original"]
    assert seen["parser"] == "_HiredisParser"
    assert seen["polls"] >= 1, "redis-py no longer polls through redis._parsers.hiredis.select"


# -- kombu's Redis channel: the pull gate ------------------------------------------


POOL_PROBE = """
import redis  # before the patching, as in the gateway: gunicorn's arbiter imported it before the fork
from gevent import monkey
monkey.patch_all()
import json, sys, time
import gevent
from api.server.redis_internals import cooperative_pool_queue, unpatched_pool_checks

unpatched_pool_checks()  # as the gateway's worker does: the check before a lend does not yield either
pool = redis.BlockingConnectionPool.from_url(sys.argv[1], max_connections=2, timeout=0.2)
if sys.argv[2] == "gevent":
    cooperative_pool_queue(pool)
pool.release(pool.get_connection())  # the connect itself goes through the loop
client = redis.Redis(connection_pool=pool)
import greenlet
switches = []
greenlet.settrace(lambda event, args: switches.append(event))
for _ in range(50):
    pool.release(pool.get_connection())
greenlet.settrace(None)
lend_and_return = len(switches)
held = [pool.get_connection(), pool.get_connection()]
started = time.monotonic()
try:
    pool.get_connection()
    full = "lent a third"
except redis.ConnectionError as exc:
    full = str(exc)
waited_s = time.monotonic() - started
later = gevent.spawn(pool.get_connection)  # waits for one to come back
gevent.sleep(0.01)
pool.release(held.pop())
handed_on = later.get(timeout=1)
pool.release(handed_on)
pool.release(held.pop())
print(json.dumps({
    "queue": type(pool.pool).__module__,
    "switches": lend_and_return,
    "full": full,
    "waited_s": waited_s,
    "handed_on": handed_on is not None,
    "ping": client.ping(),
}))
"""


@pytest.mark.parametrize("queue", ["gevent", "standard"])
def test_the_bounded_pool_lends_through_gevents_queue_without_a_switch_to_the_hub(broker_url: str, queue: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", POOL_PROBE, broker_url, queue], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if queue == "gevent":
        assert seen["queue"].startswith("gevent")
        assert seen["switches"] == 0
    else:  # what the swap is for: the standard library's queue switches to gevent's hub and back on each
        assert seen["queue"] == "queue" and seen["switches"] >= 100  # get and put
    assert seen["full"] == "No connection available." and 0.15 < seen["waited_s"] < 1.0  # the bound holds
    assert seen["handed_on"] and seen["ping"]


TELEMETRY_PROBE = """
import json, sys
import redis
from redis.observability import recorder
from api.server.redis_internals import POOL_TELEMETRY, quiet_pool_telemetry

present = all(name in vars(redis.connection) for name in POOL_TELEMETRY)
asked = []
original = recorder._get_or_create_collector
recorder._get_or_create_collector = lambda: asked.append(1) or original()
if sys.argv[2] == "quiet":
    quiet_pool_telemetry()
pool = redis.ConnectionPool.from_url(sys.argv[1])
pool.release(pool.get_connection())
asked.clear()
for _ in range(50):
    pool.release(pool.get_connection())
print(json.dumps({"present": present, "asked": len(asked), "ping": redis.Redis(connection_pool=pool).ping()}))
"""


@pytest.mark.parametrize("telemetry", ["quiet", "standard"])
def test_the_pool_skips_telemetry_nobody_collects(broker_url: str, telemetry: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", TELEMETRY_PROBE, broker_url, telemetry],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["present"], "redis.connection no longer calls the telemetry functions we replace"
    assert seen["ping"]
    if telemetry == "quiet":
        assert seen["asked"] == 0
    else:  # what it is for: redis-py asks for a collector on each lend and return
        assert seen["asked"] >= 200


def test_the_pull_gate_holds_messages_in_the_queue_until_it_opens(broker_url: str) -> None:
    queue = Queue("gate-contract", Exchange("gate-contract", type="direct"), routing_key="gate-contract")
    received: list[str] = []
    shut_calls: list[int] = []
    state = {"open": False}
    with Connection(broker_url) as conn:
        channel = conn.channel()
        Producer(conn.channel()).publish("hello", exchange=queue.exchange, routing_key="gate-contract", declare=[queue])
        assert hasattr(channel, "_in_poll")
        kombu_internals.gate_pulls(channel, lambda: state["open"], lambda: shut_calls.append(1))
        with Consumer(channel, [queue], callbacks=[lambda body, message: (received.append(body), message.ack())]):
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.5)
            assert received == [] and shut_calls, "the channel pulled without asking the gate"
            state["open"] = True
            deadline = time.monotonic() + 5
            while not received and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
    assert received == ["hello"]


def test_a_bounded_pull_leaves_the_broker_within_its_wait(broker_url: str) -> None:
    """The replica's pulls wait `PULL_WAIT_S` on the broker, not the transport's 1 s: one
    sent on an empty queue is no longer blocked there a broker tick after that."""
    queue = Queue("wait-contract", Exchange("wait-contract", type="direct"), routing_key="wait-contract")
    admin = redis.Redis.from_url(broker_url)

    def blocked() -> bool:
        return any(c.get("cmd") == "brpop" and "b" in c.get("flags", "") for c in admin.client_list())

    with Connection(broker_url) as conn:
        channel = conn.channel()
        kombu_internals.bound_pulls(channel, p.PULL_WAIT_S)
        with Consumer(channel, [queue]):
            started = time.monotonic()
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.05)  # sends one pull and leaves it out
            assert until(blocked, 2, 0.002)
            assert until(lambda: not blocked(), 1.0, 0.005)
            assert time.monotonic() - started < p.PULL_WAIT_S + 0.3  # a tick of the broker (hz 10) and slack


# -- Celery's event dispatcher: paced flushes --------------------------------------


def test_paced_task_events_wait_in_the_buffer_until_the_timer_flushes_them(broker_url: str) -> None:
    app = make_celery(Settings(redis_url=broker_url, models={"kb-small": "kb-small"}))
    timers: list[tuple[float, object]] = []
    listener = redis.Redis.from_url(broker_url).pubsub()
    listener.psubscribe("*celeryev*")
    listener.get_message(timeout=1)  # the subscription's confirmation
    with app.connection_for_write() as conn:
        dispatcher = app.events.Dispatcher(conn, buffer_group=["task"], enabled=True)
        celery_internals.pace_dispatcher(dispatcher, lambda s, f: timers.append((s, f)), 0.05, buffer_limit=64)
        assert dispatcher.buffer_limit == 64
        for i in range(3):
            dispatcher.send("task-received", uuid=f"id{i}")
        assert len(timers) == 1 and timers[0][0] == 0.05, "one timer per flush, not one per event"
        assert listener.get_message(timeout=0.3) is None, "an event went out before the flush"
        timers[0][1]()  # the timer fires
        message = listener.get_message(timeout=2)
        assert message is not None and message["type"] == "pmessage"
        dispatcher.send("task-started", uuid="id0")
        assert len(timers) == 2, "after a flush the next event sets a new timer"
        dispatcher.close()
    listener.close()
    app.close()


def test_the_consumer_reconnects_through_the_hook_we_wrap() -> None:
    assert list(inspect.signature(CeleryConsumer.ensure_connected).parameters) == ["self", "conn"]
    assert "ensure_connection" in inspect.getsource(CeleryConsumer.ensure_connected)
    # kombu honours the intervals we pass: two retries to a closed port take
    # 0.1 s with ours, where its defaults (2, 4, ... s) would take 2 s or more
    from control.core.procs import free_port

    start_s = time.monotonic()
    with KombuConnection(f"redis://127.0.0.1:{free_port()}/0") as dead, pytest.raises(OperationalError):
        dead.ensure_connection(max_retries=2, interval_start=0.05, interval_step=0.05, interval_max=0.05)
    assert time.monotonic() - start_s < 1.5

    class Fake:
        def ensure_connected(self, conn: object) -> object:
            return conn

    calls: list[dict] = []

    class Conn:
        def ensure_connection(self, **kwargs: object) -> None:
            calls.append(kwargs)

    consumer = Fake()
    celery_internals.reconnect_quickly(consumer)
    conn = Conn()
    assert consumer.ensure_connected(conn) is conn
    conn.ensure_connection()
    start, step, most = celery_internals.RECONNECT_EVERY_S
    assert calls == [{"interval_start": start, "interval_step": step, "interval_max": most}]


def test_the_wrapped_modules_are_the_only_ones_that_reach_in() -> None:
    """Each internal is touched in its adapter alone."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    where = {
        "_in_poll": {"tasks/celery/kombu_internals.py"},
        "on_send_buffered": {"tasks/celery/celery_internals.py"},
        "message._headers": {"api/server/headers.py"},
        "hiredis": {"api/server/redis_internals.py"},
    }
    for needle, allowed in where.items():
        found = {
            str(path.relative_to(root))
            for package in ("api", "control", "tasks", "tui")
            for path in (root / package).rglob("*.py")
            if needle in path.read_text()
        }
        assert found <= allowed, f"{needle} reached from {sorted(found - allowed)}"
