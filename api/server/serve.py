"""The gateway under gunicorn (a production WSGI server, not Flask's dev server)."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import tempfile
from typing import Any

from gunicorn.app.base import BaseApplication

from api.server.conntable import Conn, ConnectionTable
from api.server.limits import KEEPALIVE_S, RequestLimits
from api.server.redis_internals import cooperative_pool_queue, quiet_pool_telemetry, unpatched_pool_checks
from api.server.refusals import ALL_TAKEN
from control.core.memory import freeze_startup_objects
from control.core.procs import pid_alive
from control.core.settings import Settings


def handler_class(limits: RequestLimits) -> type:
    """pywsgi's handler with these limits (api/server/handler.py), loaded with gevent."""
    from api.server.handler import handler_class as bound_handler

    return bound_handler(limits)


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
            "bind": f"{s.bind}:{s.port}",
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
    for cell in gateway.cells:
        cooperative_pool_queue(cell.redis.connection_pool)  # before anything borrows from it
    gateway.start()  # the registry is read before the first request, not by it
    unpatched_pool_checks()
    quiet_pool_telemetry()
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


def native_metric_locks() -> None:
    """Import prometheus-client here, in gunicorn's arbiter, before a worker patches
    threading: its locks are then the interpreter's own, not gevent's (which are
    Python code, taken about a dozen times a request: each counter and histogram write
    holds one). No greenlet switches while holding one: what they guard is a write to
    memory (a value, or the process's mmapped metric file), never I/O that yields."""
    import prometheus_client  # noqa: F401  # imported for its side effect: the locks it makes


def serve(settings: Settings) -> None:
    """Run the gateway in the foreground; with several processes, /metrics sums them
    through prometheus-client's multiprocess mode (a private directory of value files)."""
    own_dir = None
    if settings.api_processes > 1 and not os.environ.get(MULTIPROC_ENV):
        # Before any worker imports prometheus_client: the mode is chosen at import.
        remove_orphan_metric_dirs(tempfile.gettempdir())
        own_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
        os.environ[MULTIPROC_ENV] = own_dir
    native_metric_locks()
    raise_fd_limit(settings)
    try:
        GatewayServer(settings).run()
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
