"""Noticing, while a request waits for its completion, that its client hung up.

    watch = hangup_event(environ)      # None: no client socket to watch
    try:
        ...wait for the completion, or for watch.event...
    finally:
        if watch is not None:
            watch.close()               # before the handler reads the socket again

`hangup_event(environ)` returns a `Hangup`: `.event` (a `gevent.event.Event`) is set
once the client's socket reaches EOF or fails (reset); `.close()` stops watching and
must be called before the request's handler returns (it is also a context manager).
To wake a waiter on either, `gevent.wait([done, watch.event], timeout, count=1)` (a
monkey-patched `threading.Event` is a gevent Event), or `watch.event.rawlink(fn)`
(fn runs in the hub, once, with the event: it must not block).

How: one io watcher on the socket's descriptor in gevent's loop, no greenlet and no
polling. When the socket turns readable the callback peeks one byte (`MSG_PEEK`, so a
keep-alive client's next request stays unread for the handler): EOF or an error set
the event; bytes mean the client sent more (a pipelined request), which says it is
there and hides any later EOF behind them, so the watch ends without setting the event.
The request's own body is already read when the app runs (api/server/serve.py reads it
whole), so what the peek sees comes after it.

EOF is taken as gone: an HTTP/1.1 client does not half-close while it waits for its
answer (one that shuts down its sending side after the request would be taken as gone).

Where the socket is: gunicorn's `GeventPyWSGIWorker` handler (`PyWSGIHandler`,
subclassed in api/server/serve.py) puts the connection's gevent socket in the environ as
`gunicorn.sock`; a server that does not (gthread) gets None.
"""

from __future__ import annotations

import socket
from types import TracebackType
from typing import Any

from gevent import get_hub
from gevent.event import Event

SOCKET_KEY = "gunicorn.sock"
_READ = 1  # libev/libuv: the descriptor is readable
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT


class Hangup:
    """A watch on one client socket; `event` is set if the client goes away."""

    __slots__ = ("event", "_raw", "_watcher")

    def __init__(self, sock: Any) -> None:
        self.event = Event()
        # The stdlib socket under gevent's (pywsgi reads it the same way): its recv
        # never waits, which a callback running in the hub must not do.
        self._raw = getattr(sock, "_sock", sock)
        self._watcher: Any = get_hub().loop.io(sock.fileno(), _READ, ref=False)
        self._watcher.start(self._readable)

    def _readable(self) -> None:
        try:
            sent_more = bool(self._raw.recv(1, _PEEK))
        except BlockingIOError:
            return  # woken with nothing to read after all
        except OSError:
            sent_more = False  # reset: gone as surely as EOF
        if not sent_more:
            self.event.set()
        self.close()

    def close(self) -> None:
        """Stop watching (idempotent); the event keeps its state."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
            watcher.close()

    def __enter__(self) -> Hangup:
        return self

    def __exit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def hangup_event(environ: dict[str, Any]) -> Hangup | None:
    """Watch the request's client socket for a hang-up; None when the server gives none."""
    sock = environ.get(SOCKET_KEY)
    if sock is None or sock.fileno() < 0:
        return None
    return Hangup(sock)
