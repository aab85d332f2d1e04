"""The gateway under gunicorn (a production WSGI server, not Flask's dev server)."""

from __future__ import annotations

import errno
import io
import os
import resource
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

import orjson
from gunicorn.app.base import BaseApplication

from api.server.conntable import Conn, ConnectionTable
from api.server.headers import TOO_LONG, TOO_MANY, FramingError, check_framing, read_headers
from api.server.redis_internals import unpatched_pool_checks
from control.core.memory import freeze_startup_objects
from control.core.procs import pid_alive
from control.core.settings import Settings
from control.core.vocab import PAID

KEEPALIVE_S = 5
LINGER_S = 2  # a refused request's connection drains this long at most before it closes


@dataclass(frozen=True)
class RequestLimits:
    """What one request may take of its connection before the app sees it."""

    header_timeout_s: float
    body_timeout_s: float
    max_body_bytes: int
    first_byte_timeout_s: float = KEEPALIVE_S
    send_timeout_s: float = 10.0
    max_header_bytes: int = 32_768
    max_header_fields: int = 100
    paid_keys: frozenset[str] = frozenset()

    @classmethod
    def of(cls, settings: Settings) -> RequestLimits:
        paid = frozenset(key for key, tier in settings.api_keys.items() if tier == PAID)
        return cls(
            settings.header_timeout_s,
            settings.body_timeout_s,
            settings.max_body_bytes,
            settings.first_byte_timeout_s,
            settings.send_timeout_s,
            settings.max_header_bytes,
            settings.max_header_fields,
            paid,
        )

    def is_paid(self, authorization: str | None) -> bool:
        """The key decides the tier, as the app reads it (api/completions.py: caller)."""
        if not authorization or not self.paid_keys:
            return False
        scheme, _, key = authorization.partition(" ")
        return scheme.lower() == "bearer" and key.strip() in self.paid_keys


class BodyTooLarge(Exception):
    pass


class BadFraming(ValueError):
    pass


class HeaderBlockTooLarge(ValueError):
    pass


class AllTaken(Exception):
    pass


class SendTimedOut(OSError):
    """A write that did not complete in time: taken as a client gone (EPIPE)."""

    def __init__(self) -> None:
        super().__init__(errno.EPIPE, "the client did not read the answer in time")


def handler_class(limits: RequestLimits) -> type:
    """pywsgi's handler with deadlines for a request's arrival (docs/decisions/0010)
    and strict framing and header limits (docs/decisions/0017).

    From a request's first byte its line and header block must arrive within
    `header_timeout_s`, then its body within `body_timeout_s`: whole deadlines,
    not per read, so a peer dribbling a byte at a time is answered 408 and
    closed. The body is read here, before the app runs, up to `max_body_bytes`
    (413 beyond, chunked or not): the app gets it whole, and an app waiting on
    its completion leaves nothing unread on the socket (api/disconnect.py).
    A new connection sends its first byte within `first_byte_timeout_s`; each
    write of an answer completes within `send_timeout_s`. A request refused here
    (400, 408, 413, 431, 501) is answered and its connection closed.
    """
    import gevent
    from gevent.pywsgi import _InvalidClientInput
    from gunicorn.workers.ggevent import PyWSGIHandler

    timed_out = _error_response("408 Request Timeout", "request_timeout", "the request did not arrive in time")
    too_large = _error_response(
        "413 Content Too Large", "request_too_large", f"the request body exceeds {limits.max_body_bytes} bytes"
    )
    headers_too_large = _error_response(
        "431 Request Header Fields Too Large",
        "headers_too_large",
        f"the header block exceeds {limits.max_header_bytes} bytes or {limits.max_header_fields} fields",
    )
    framing = {
        400: lambda message: _error_response("400 Bad Request", "bad_request", message),
        501: lambda message: _error_response("501 Not Implemented", "not_implemented", message),
    }

    class Handler(PyWSGIHandler):
        idle: gevent.Timeout | None = None  # waiting for a request's first byte
        deadline: gevent.Timeout | None = None  # the request's header block's, then its body's
        buffered_body = -1  # bytes of the body in memory with its header block (-1: unknown)
        conn: Conn | None = None  # its slot in the server's table (ConnectionTable)
        table: ConnectionTable | None = None
        served = 0  # requests read on this connection

        def handle_one_request(self) -> Any:
            try:
                result = super().handle_one_request()
                if isinstance(result, tuple):  # pywsgi's own refusal (414): sent as ours are
                    return self._refuse(result[1])
                return result
            except gevent.Timeout as timeout:
                if timeout is self.idle:
                    return None
                if timeout is self.deadline:
                    return self._refuse(timed_out)
                raise
            except BodyTooLarge:
                return self._refuse(too_large)
            except AllTaken:
                return self._refuse(ALL_TAKEN)
            except (BadFraming, _InvalidClientInput) as exc:
                return self._handle_client_error(exc)
            except OSError:
                return None  # the client went away while sending: nobody to answer
            finally:
                self._end_deadline()

        def _handle_client_error(self, ex: BaseException) -> None:
            if isinstance(ex, HeaderBlockTooLarge):
                return self._refuse(headers_too_large)
            if isinstance(ex, FramingError):
                return self._refuse(framing[ex.status](str(ex)))
            return self._refuse(framing[400]("the request is not valid HTTP/1.1"))

        def _refuse(self, response: bytes) -> None:
            """Answer, then close so that the client reads the answer: a socket closed
            with unread bytes resets the connection, and the reset can overtake the
            answer. So stop sending and drop what still comes, for LINGER_S at most."""
            self._end_deadline()
            with gevent.Timeout(LINGER_S, False):
                try:
                    self.socket.sendall(response)
                    self.socket.shutdown(socket.SHUT_WR)
                    while self.socket.recv(65_536):
                        pass
                except OSError:
                    pass  # it went away: nothing left to tell it

        def read_requestline(self) -> Any:
            # A stopping worker waits for its open connections: an idle one
            # closes after KEEPALIVE_S, as gunicorn's own worker does it; a new
            # one sends its first byte sooner (an idle one holds a slot).
            # (A new timer each time: a libev timer stopped and started again
            # resumes its remaining time, it does not start over.)
            if self.served and self.conn is not None and self.table is not None:
                self.table.waiting(self.conn)
            self.served += 1
            self.idle = gevent.Timeout(limits.first_byte_timeout_s if self.served == 1 else KEEPALIVE_S)
            self.idle.start()
            try:
                buffered = self.rfile.peek(1)  # all that is in memory; b"" at EOF
            finally:
                self.idle.close()
            if not buffered:
                return None
            # Most requests come in one piece, and reading what is in memory needs
            # no deadline: a timer is set only for what has yet to arrive.
            end = buffered.find(b"\r\n\r\n")
            self.buffered_body = len(buffered) - end - 4 if end >= 0 else -1
            if end < 0:
                self._start_deadline(limits.header_timeout_s)  # from the first byte
            return super().read_requestline()

        def MessageClass(self, fp: Any, *_args: Any) -> Any:  # noqa: N802 (pywsgi's name)
            message = read_headers(fp, limits.max_header_bytes, limits.max_header_fields)
            if message.status in (TOO_LONG, TOO_MANY):
                raise HeaderBlockTooLarge(message.status)
            if not message.status:
                check_framing(message, self.request_version)
            return message

        def get_environ(self) -> Any:
            self._end_deadline()  # the header block is in
            if self.conn is not None and self.table is not None:
                if not self.table.busy(self.conn, limits.is_paid(self.headers.get("Authorization"))):
                    raise AllTaken  # on trial for a paid request, and it is not
            environ = super().get_environ()
            chunked = self.wsgi_input.chunked_input
            if "HTTP_TRANSFER_ENCODING" in environ and not chunked:
                # pywsgi would take the body for the next request (RFC 9112 6.1: 400)
                raise BadFraming("a transfer coding other than chunked")
            if chunked or self.content_length:
                self._read_body(environ)
            return environ

        def _read_body(self, environ: dict[str, Any]) -> None:
            """The whole body, within its deadline and size, handed to the app as bytes."""
            if (self.content_length or 0) > limits.max_body_bytes:
                raise BodyTooLarge  # refused before a byte of it is read
            if self.wsgi_input.chunked_input or self.content_length > self.buffered_body:
                self._start_deadline(limits.body_timeout_s)
            body = self.wsgi_input.read(limits.max_body_bytes + 1)  # to its end, or one byte over
            self._end_deadline()
            if len(body) > limits.max_body_bytes:
                raise BodyTooLarge
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
            environ.pop("HTTP_TRANSFER_ENCODING", None)  # the app sees a plain body

        def _sendall(self, data: bytes) -> None:
            # A client that does not read (pipelining requests it never reads the
            # answers of) would hold the connection and what is queued for it.
            timer = gevent.Timeout(limits.send_timeout_s, SendTimedOut)
            timer.start()
            try:
                super()._sendall(data)
            finally:
                timer.close()

        def _start_deadline(self, seconds: float) -> None:
            self.deadline = gevent.Timeout(seconds)
            self.deadline.start()

        def _end_deadline(self) -> None:
            if self.deadline is not None:
                self.deadline.close()
                self.deadline = None

        def log_request(self) -> None:
            pass  # the access log is off: skip gunicorn's per-request bookkeeping for it

    return Handler


def server_class(table: ConnectionTable) -> type:
    """pywsgi's server, accepting through `table` (docs/decisions/0017): a connection it
    has no slot for is answered 503 at once and closed, not left in the backlog."""
    from gunicorn.workers.ggevent import PyWSGIServer

    class Server(PyWSGIServer):
        def do_handle(self, sock: Any, address: Any) -> None:
            host = address[0] if isinstance(address, tuple) else str(address)
            conn = table.admit(host, lambda: _shut(sock), lambda: has_input(sock))
            if conn is None:
                _refuse_at_once(sock, ALL_TAKEN)
                return
            super().do_handle(sock, address, conn)

        def do_close(self, sock: Any, *_args: Any) -> None:
            sock.close()

        def handle(self, sock: Any, address: Any, conn: Conn) -> None:
            handler = self.handler_class(sock, address, self)
            handler.conn, handler.table = conn, table
            try:
                handler.handle()
            finally:
                table.release(conn)

    return Server


REFUSED_READS = 4  # a client that keeps sending to a refused connection does not hold the loop


def has_input(sock: Any) -> bool:
    """Bytes wait in the socket (a request on its way in); end of file is not input."""
    raw = getattr(sock, "_sock", sock)
    try:
        return len(raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)) > 0
    except OSError:  # nothing to read (EAGAIN), or the connection is gone
        return False


def _shut(sock: Any) -> None:
    """End a connection given way to another: its handler reads EOF and returns."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _refuse_at_once(sock: Any, response: bytes) -> None:
    """Answer and close without blocking (in the accept loop, not a greenlet of its
    own): a new connection has room for a small answer in its send buffer; what the
    client sent already is dropped first, so that the close is not a reset."""
    raw = getattr(sock, "_sock", sock)
    try:
        raw.send(response, socket.MSG_DONTWAIT)
        raw.shutdown(socket.SHUT_WR)
        for _ in range(REFUSED_READS):
            if not raw.recv(65_536, socket.MSG_DONTWAIT):
                break
    except OSError:
        pass  # nothing more to read (EAGAIN), or it went away
    finally:
        sock.close()


def _error_response(status: str, code: str, message: str, retry_s: int | None = None) -> bytes:
    """A whole answer, OpenAI-shaped, for a request refused before the app saw it."""
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}})
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    if retry_s is not None:
        head += f"Retry-After: {retry_s}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


ALL_TAKEN = _error_response(
    "503 Service Unavailable", "too_many_connections", "the server holds all the connections it can", retry_s=1
)


def _worker_class(settings: Settings) -> type:
    from gunicorn.workers.ggevent import GeventPyWSGIWorker

    handler = handler_class(RequestLimits.of(settings))

    class Worker(GeventPyWSGIWorker):
        """gunicorn's process management; gevent's own WSGI server for the requests.

        pywsgi writes status, headers and body in one send and parses a request
        for less CPU than gunicorn's parser (docs/decisions/0003). Each process
        keeps its own table of connections (made after the fork).
        """

        wsgi_handler = handler

        def run(self) -> None:
            self.server_class = server_class(connection_table(settings))
            super().run()

    return Worker


def connection_table(settings: Settings) -> ConnectionTable:
    return ConnectionTable(
        settings.max_connections,
        settings.paid_reserve_connections,
        settings.max_connections_per_address,
        frozenset(settings.connection_cap_exempt),
    )


# Beyond the table's slots, room in gevent's pool for connections that were given way
# to and have not yet returned: when the pool is full, the process stops accepting.
SHED_HEADROOM = 64
FDS_PER_PROCESS = 256  # the broker's pool, the listener, logs, the metric files


def pool_size(settings: Settings) -> int:
    return settings.max_connections + settings.paid_reserve_connections + SHED_HEADROOM


def raise_fd_limit(settings: Settings) -> None:
    """The soft limit on open files up to what the pool needs, within the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = pool_size(settings) + FDS_PER_PROCESS
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class GatewayServer(BaseApplication):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        options: dict[str, Any] = {
            "bind": f"{s.host}:{s.port}",
            "workers": s.api_processes,
            "worker_class": _worker_class(s) if s.api_worker_class == "gevent" else "gthread",
            "threads": s.api_threads if s.api_worker_class == "gthread" else 1,
            # Per process: gevent's pool; the server's table decides who holds a
            # slot and refuses the rest at once (docs/decisions/0017).
            "worker_connections": pool_size(s),
            "backlog": 4096,
            # An idle keep-alive connection holds a stopping worker until it times
            # out, so keep it short; in-flight requests end by their deadlines.
            "keepalive": KEEPALIVE_S,
            "graceful_timeout": max(10, int(s.max_deadline_ms / 1000) + 5),
            "timeout": 120,
            "accesslog": None,
            "errorlog": "-",
            "loglevel": "warning",
            "proc_name": "keybatch-api",
            "post_worker_init": _init_worker,
            "child_exit": _forget_worker_metrics,
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        from api.app import create_app

        return create_app(self.settings)


def _init_worker(worker: Any) -> None:
    # A worker told to stop (SIGTERM) finishes its requests but admits no new ones.
    gateway = worker.wsgi.extensions["keybatch"]
    gateway.is_serving = lambda: worker.alive
    gateway.start()  # the registry is read before the first request, not by it
    unpatched_pool_checks()
    freeze_startup_objects()


def _forget_worker_metrics(_server: Any, worker: Any) -> None:
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


METRICS_DIR_PREFIX = "keybatch-metrics-"


def remove_orphan_metric_dirs(parent: str) -> list[str]:
    """Remove the metric directories of gateways that died without cleaning up (a
    SIGKILL skips the `finally` below); their names carry the owner's pid."""
    removed = []
    for entry in os.scandir(parent):
        if not entry.name.startswith(METRICS_DIR_PREFIX) or not entry.is_dir():
            continue
        pid = entry.name.removeprefix(METRICS_DIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def serve(settings: Settings) -> None:
    """Run the gateway in the foreground; with several processes, /metrics sums them
    through prometheus-client's multiprocess mode (a private directory of value files)."""
    own_dir = None
    if settings.api_processes > 1 and not os.environ.get(MULTIPROC_ENV):
        # Before any worker imports prometheus_client: the mode is chosen at import.
        remove_orphan_metric_dirs(tempfile.gettempdir())
        own_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
        os.environ[MULTIPROC_ENV] = own_dir
    raise_fd_limit(settings)
    try:
        GatewayServer(settings).run()
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
