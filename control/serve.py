"""The gateway under gunicorn (a production WSGI server, not Flask's dev server)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any

from gunicorn.app.base import BaseApplication

from control.broker import pid_alive
from control.memory import freeze_startup_objects
from control.settings import Settings

KEEPALIVE_S = 5


def _worker_class() -> type:
    import gevent
    from gunicorn.workers.ggevent import GeventPyWSGIWorker, PyWSGIHandler

    class Handler(PyWSGIHandler):  # type: ignore[misc]
        def read_requestline(self) -> Any:
            # A stopping worker waits for its open connections: an idle one
            # closes after KEEPALIVE_S, as gunicorn's own worker does it.
            with gevent.Timeout(KEEPALIVE_S, False):
                return super().read_requestline()
            return None

        def MessageClass(self, fp: Any, *_args: Any) -> Any:  # noqa: N802 (pywsgi's name)
            return read_headers(fp)

        def log_request(self) -> None:
            pass  # the access log is off: skip gunicorn's per-request bookkeeping for it

    class Worker(GeventPyWSGIWorker):  # type: ignore[misc]
        """gunicorn's process management; gevent's own WSGI server for the requests.

        pywsgi writes status, headers and body in one send and parses a request
        for less CPU than gunicorn's parser (docs/decisions/0003).
        """

        wsgi_handler = Handler

    return Worker


MAX_HEADER_LINE = 65_536  # the limits of http.client, which pywsgi parses with
MAX_HEADERS = 100


def read_headers(fp: Any) -> Any:
    """The request's header block, as the message object pywsgi expects.

    pywsgi hands the block to http.client.parse_headers, which runs it through
    the email package's feed parser: 9% of the gateway's CPU per request here.
    The header block of an HTTP request needs much less: a line per field,
    split at the first colon. A malformed block (a name that is not a token,
    space before the colon, a bare CR or NUL, too long, too many) sets `status`,
    which pywsgi answers with 400; obsolete line folding is joined with a space
    (RFC 9112 5.2). docs/decisions/0006.
    """
    from gevent.pywsgi import OldMessage  # type: ignore[attr-defined]

    message = OldMessage()
    fields = message._headers  # email.message.Message keeps (name, value) pairs here
    for _ in range(MAX_HEADERS + 1):
        line = fp.readline(MAX_HEADER_LINE + 1)
        if len(line) > MAX_HEADER_LINE:
            message.status = "Line too long"
            return message
        if line in (b"\r\n", b"\n", b""):
            return message
        text = line.decode("iso-8859-1").removesuffix("\n").removesuffix("\r")
        if "\r" in text or "\0" in text:
            message.status = "Invalid header line"
            return message
        if text[0] in " \t":
            if not fields:
                message.status = "Invalid header line"
                return message
            name, value = fields[-1]
            fields[-1] = (name, (value + " " + text.strip(" \t")).strip(" \t"))
            continue
        name, colon, value = text.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            message.status = "Invalid header line"
            return message
        fields.append((name, value.strip(" \t")))
    message.status = "Too many headers"
    return message


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 5.1: a field name


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class GatewayServer(BaseApplication):  # type: ignore[misc]
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        options: dict[str, Any] = {
            "bind": f"{s.host}:{s.port}",
            "workers": s.api_processes,
            "worker_class": _worker_class() if s.api_worker_class == "gevent" else "gthread",
            "threads": s.api_threads if s.api_worker_class == "gthread" else 1,
            "worker_connections": 4096,
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
    _unpatched_pool_checks()
    freeze_startup_objects()


def _unpatched_pool_checks() -> None:
    """Let redis-py check pooled connections with the real `select.poll`.

    Before lending a connection, redis-py polls its socket with a zero timeout
    (is there stale data, did the server close it?). Under gevent's monkey
    patching that poll builds and starts event-loop watchers (18 us a check
    here, 7% of the gateway's CPU), for a check that never blocks. The original
    poll answers the same question with one syscall (1.8 us).
    """
    import select
    import types

    from gevent import monkey

    if not monkey.is_module_patched("select"):
        return
    from redis._parsers import hiredis

    original = types.ModuleType("select")
    original.__dict__.update(vars(select))
    original.poll = monkey.get_original("select", "poll")  # type: ignore[attr-defined]
    hiredis.select = original  # type: ignore[attr-defined]


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
