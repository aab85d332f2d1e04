"""The gateway under gunicorn (a production WSGI server, not Flask's dev server)."""

from __future__ import annotations

import io
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

import orjson
from gunicorn.app.base import BaseApplication

from control.broker import pid_alive
from control.headers import read_headers
from control.memory import freeze_startup_objects
from control.redis_internals import unpatched_pool_checks
from control.settings import Settings

KEEPALIVE_S = 5
LINGER_S = 2  # a refused request's connection drains this long at most before it closes


@dataclass(frozen=True)
class RequestLimits:
    """What one request may take of its connection before the app sees it."""

    header_timeout_s: float
    body_timeout_s: float
    max_body_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> RequestLimits:
        return cls(settings.header_timeout_s, settings.body_timeout_s, settings.max_body_bytes)


class BodyTooLarge(Exception):
    pass


class BadFraming(ValueError):
    pass


def handler_class(limits: RequestLimits) -> type:
    """pywsgi's handler with deadlines for a request's arrival (docs/decisions/0010).

    From a request's first byte its line and header block must arrive within
    `header_timeout_s`, then its body within `body_timeout_s`: whole deadlines,
    not per read, so a peer dribbling a byte at a time is answered 408 and
    closed. The body is read here, before the app runs, up to `max_body_bytes`
    (413 beyond, chunked or not): the app gets it whole, and an app waiting on
    its completion leaves nothing unread on the socket (api/disconnect.py).
    """
    import gevent
    from gevent.pywsgi import _InvalidClientInput
    from gunicorn.workers.ggevent import PyWSGIHandler

    timed_out = _error_response("408 Request Timeout", "request_timeout", "the request did not arrive in time")
    too_large = _error_response(
        "413 Content Too Large", "request_too_large", f"the request body exceeds {limits.max_body_bytes} bytes"
    )

    class Handler(PyWSGIHandler):
        idle: gevent.Timeout | None = None  # keep-alive: waiting for a request's first byte
        deadline: gevent.Timeout | None = None  # the request's header block's, then its body's
        buffered_body = -1  # bytes of the body in memory with its header block (-1: unknown)

        def handle_one_request(self) -> Any:
            try:
                return super().handle_one_request()
            except gevent.Timeout as timeout:
                if timeout is self.idle:
                    return None
                if timeout is self.deadline:
                    return self._refuse(timed_out)
                raise
            except BodyTooLarge:
                return self._refuse(too_large)
            except (BadFraming, _InvalidClientInput) as exc:
                return self._handle_client_error(exc)
            except OSError:
                return None  # the client went away while sending: nobody to answer
            finally:
                self._end_deadline()

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
            # closes after KEEPALIVE_S, as gunicorn's own worker does it.
            # (A new timer each time: a libev timer stopped and started again
            # resumes its remaining time, it does not start over.)
            self.idle = gevent.Timeout(KEEPALIVE_S)
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
            return read_headers(fp)

        def get_environ(self) -> Any:
            self._end_deadline()  # the header block is in
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


def _error_response(status: str, code: str, message: str) -> bytes:
    """A whole answer, OpenAI-shaped, for a request refused before the app saw it."""
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}})
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


def _worker_class(settings: Settings) -> type:
    from gunicorn.workers.ggevent import GeventPyWSGIWorker

    handler = handler_class(RequestLimits.of(settings))

    class Worker(GeventPyWSGIWorker):
        """gunicorn's process management; gevent's own WSGI server for the requests.

        pywsgi writes status, headers and body in one send and parses a request
        for less CPU than gunicorn's parser (docs/decisions/0003).
        """

        wsgi_handler = handler

    return Worker


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
            # Per process; beyond it the process stops accepting and new connections
            # wait in the listen backlog (docs/decisions/0010).
            "worker_connections": s.max_connections,
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
        from api import create_app

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
    try:
        GatewayServer(settings).run()
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
