"""pywsgi's handler with deadlines for a request's arrival (docs/decisions/0010) and
strict framing and header limits (docs/decisions/0017).

From a request's first byte its line and header block must arrive within
`header_timeout_s`, then its body within `body_timeout_s`: whole deadlines, not per
read, so a peer dribbling a byte at a time is answered 408 and closed. The body is read
here, before the app runs, up to `max_body_bytes` (413 beyond, chunked or not): the app
gets it whole, and an app waiting on its completion leaves nothing unread on the socket
(api/disconnect.py). A new connection sends its first byte within
`first_byte_timeout_s`; each write of an answer completes within `send_timeout_s`. A
request refused here (400, 408, 413, 431, 501) is answered and its connection closed.

It imports gevent and gunicorn's gevent worker: api/server/serve.py loads it only for a
gevent worker.
"""

from __future__ import annotations

import io
import socket
from collections.abc import Callable
from typing import Any

import gevent
from gevent.pywsgi import _InvalidClientInput
from gunicorn.workers.ggevent import PyWSGIHandler

from api.environ import BODY
from api.server.conntable import Conn, ConnectionTable
from api.server.headers import TOO_LONG, TOO_MANY, FramingError, check_framing, environ_fields, read_headers
from api.server.limits import KEEPALIVE_S, RequestLimits
from api.server.refusals import (
    ALL_TAKEN,
    LINGER_S,
    NOT_HTTP,
    TIMED_OUT,
    AllTaken,
    BadFraming,
    BodyTooLarge,
    HeaderBlockTooLarge,
    SendTimedOut,
    error_response,
    framing_response,
)


def handler_class(limits: RequestLimits) -> type[LimitedHandler]:
    """The handler with these limits bound once, as class attributes: a request reads
    each with one lookup, as it read a closure's cell."""
    bound = {
        "first_byte_timeout_s": limits.first_byte_timeout_s,
        "header_timeout_s": limits.header_timeout_s,
        "body_timeout_s": limits.body_timeout_s,
        "send_timeout_s": limits.send_timeout_s,
        "max_body_bytes": limits.max_body_bytes,
        "max_header_bytes": limits.max_header_bytes,
        "max_header_fields": limits.max_header_fields,
        "is_paid": limits.is_paid,
        "too_large": error_response(
            "413 Content Too Large", "request_too_large", f"the request body exceeds {limits.max_body_bytes} bytes"
        ),
        "headers_too_large": error_response(
            "431 Request Header Fields Too Large",
            "headers_too_large",
            f"the header block exceeds {limits.max_header_bytes} bytes or {limits.max_header_fields} fields",
        ),
    }
    return type("Handler", (LimitedHandler,), bound)


class LimitedHandler(PyWSGIHandler):
    """Use `handler_class(limits)`: the class attributes below without a value are bound there."""

    first_byte_timeout_s: float
    header_timeout_s: float
    body_timeout_s: float
    send_timeout_s: float
    max_body_bytes: int
    max_header_bytes: int
    max_header_fields: int
    is_paid: Callable[[str | None], bool]
    too_large: bytes
    headers_too_large: bytes

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
                return self._refuse(TIMED_OUT)
            raise
        except BodyTooLarge:
            return self._refuse(self.too_large)
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
            return self._refuse(self.headers_too_large)
        if isinstance(ex, FramingError):
            return self._refuse(framing_response(ex.status, str(ex)))
        return self._refuse(NOT_HTTP)

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
        self.idle = gevent.Timeout(self.first_byte_timeout_s if self.served == 1 else KEEPALIVE_S)
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
            self._start_deadline(self.header_timeout_s)  # from the first byte
        return super().read_requestline()

    def MessageClass(self, fp: Any, *_args: Any) -> Any:  # noqa: N802 (pywsgi's name)
        message = read_headers(fp, self.max_header_bytes, self.max_header_fields)
        if message.status in (TOO_LONG, TOO_MANY):
            raise HeaderBlockTooLarge(message.status)
        if not message.status:
            check_framing(message, self.request_version)
        return message

    def _headers(self) -> Any:  # pywsgi's: the environ's HTTP_ keys
        return environ_fields(self.headers)

    def get_environ(self) -> Any:
        self._end_deadline()  # the header block is in
        if self.conn is not None and self.table is not None:
            if not self.table.busy(self.conn, self.is_paid(self.headers.get("Authorization"))):
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
        most = self.max_body_bytes
        if (self.content_length or 0) > most:
            raise BodyTooLarge  # refused before a byte of it is read
        if self.wsgi_input.chunked_input or self.content_length > self.buffered_body:
            self._start_deadline(self.body_timeout_s)
        body = self.wsgi_input.read(most + 1)  # to its end, or one byte over
        self._end_deadline()
        if len(body) > most:
            raise BodyTooLarge
        environ["wsgi.input"] = io.BytesIO(body)
        environ[BODY] = body  # the app takes it as it is, not through werkzeug's stream
        environ["CONTENT_LENGTH"] = str(len(body))
        environ.pop("HTTP_TRANSFER_ENCODING", None)  # the app sees a plain body

    def _write_with_headers(self, data: bytes) -> None:
        """The status line, the headers and the first part of the body in one send.

        pywsgi sends the header block and the body in two (two syscalls, and on a
        socket without Nagle's algorithm two segments the client wakes for). The bytes
        are the same: its header block, then its own framing of `data` (`_write`)."""
        self.headers_sent = True
        self.finalize_headers()
        towrite = bytearray(b"HTTP/1.1 ")
        towrite += self.status
        towrite += b"\r\n"
        for header, value in self.response_headers:
            towrite += header
            towrite += b": "
            towrite += value
            towrite += b"\r\n"
        towrite += b"\r\n"
        if data and self.response_use_chunked:
            towrite += b"%x\r\n" % len(data)
            towrite += data
            towrite += b"\r\n"
        elif data:
            towrite += data
        self._sendall(towrite)

    def _sendall(self, data: bytes | bytearray | memoryview) -> None:
        # Most answers fit in the socket's send buffer: one try on the socket itself
        # (gevent keeps it non-blocking) sends them with no timer and none of gevent's
        # wait-and-retry layers. What is left waits under the send deadline.
        raw = getattr(self.socket, "_sock", None)
        if raw is not None and data:
            try:
                sent = raw.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                sent = 0  # pywsgi's own send below meets the error and records it
            self.response_length += sent
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
        # A client that does not read (pipelining requests it never reads the
        # answers of) would hold the connection and what is queued for it.
        timer = gevent.Timeout(self.send_timeout_s, SendTimedOut)
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
