"""How the server refuses a request before the app sees it: the reasons, raised while
a request is read, and the whole answers sent for them."""

from __future__ import annotations

import errno

import orjson

LINGER_S = 2  # a refused request's connection drains this long at most before it closes


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


def error_response(status: str, code: str, message: str, retry_s: int | None = None) -> bytes:
    """A whole answer, OpenAI-shaped, for a request refused before the app saw it."""
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}})
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    if retry_s is not None:
        head += f"Retry-After: {retry_s}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


ALL_TAKEN = error_response(
    "503 Service Unavailable", "too_many_connections", "the server holds all the connections it can", retry_s=1
)
TIMED_OUT = error_response("408 Request Timeout", "request_timeout", "the request did not arrive in time")
NOT_HTTP = error_response("400 Bad Request", "bad_request", "the request is not valid HTTP/1.1")

# A framing error's status: the status line and code of its answer.
FRAMING = {400: ("400 Bad Request", "bad_request"), 501: ("501 Not Implemented", "not_implemented")}


def framing_response(status: int, message: str) -> bytes:
    line, code = FRAMING[status]
    return error_response(line, code, message)
