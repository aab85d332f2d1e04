"""The request header parser of the gateway's HTTP server: the one module that leans on
the email package's internals.

pywsgi (gevent's WSGI server, under gunicorn) expects the header block as an
`email.message.Message` subclass (`OldMessage`), as `http.client.parse_headers`
builds it. This module builds that object directly, appending (name, value) pairs
to the list `email.message.Message` keeps them in (`_headers`). An email or gevent
upgrade that changes either fails `tests/broker/test_adapters.py`, which compares this
parser with `http.client.parse_headers` on the same blocks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

MAX_HEADER_LINE = 65_536  # the limits of http.client, which pywsgi parses with
MAX_HEADERS = 100
TOO_LONG = "Line too long"  # a field line, or the whole block, past its cap
TOO_MANY = "Too many headers"
FOLDED = "Obsolete line folding"


def read_headers(fp: Any, max_bytes: int = MAX_HEADER_LINE, max_fields: int = MAX_HEADERS) -> Any:
    """The request's header block, as the message object pywsgi expects.

    pywsgi hands the block to http.client.parse_headers, which runs it through
    the email package's feed parser, a visible share of the gateway's CPU per
    request (docs/decisions/0006 has the profile).
    The header block of an HTTP request needs much less: a line per field,
    split at the first colon. A malformed block (a name that is not a token,
    space before the colon, a bare CR or NUL, obsolete line folding) sets
    `status`, which the server answers 400; a block over `max_bytes` in all, or
    with more than `max_fields` fields, sets TOO_LONG or TOO_MANY (431). No more
    than `max_bytes` of the block is ever read. docs/decisions/0006.
    """
    message = _message_class()()
    fields = message._headers  # email.message.Message keeps (name, value) pairs here
    left = max_bytes
    for _ in range(max_fields + 1):
        line = fp.readline(min(left, MAX_HEADER_LINE) + 1)
        left -= len(line)
        if left < 0 or len(line) > MAX_HEADER_LINE:
            message.status = TOO_LONG
            return message
        if line in (b"\r\n", b"\n", b""):
            return message
        text = line.decode("iso-8859-1").removesuffix("\n").removesuffix("\r")
        if "\r" in text or "\0" in text:
            message.status = "Invalid header line"
            return message
        if text[0] in " \t":
            # RFC 9112 5.2: a recipient may refuse folding; a proxy that joins it
            # differently would read another field than this server does.
            message.status = FOLDED if fields else "Invalid header line"
            return message
        name, colon, value = text.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            message.status = "Invalid header line"
            return message
        fields.append((name, value.strip(" \t")))
    message.status = TOO_MANY
    return message


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 5.1: a field name

_MESSAGE_CLASS: list[type] = []


def _message_class() -> type:
    """pywsgi's message class, with a `get` that looks a field up in an index.

    pywsgi and the handler ask for a field about ten times a request; email's `get`
    lowercases every field name on each call. The index (the first value of each name,
    as email's `get` answers: compat32 returns a str value as it is, and one decoded
    from ISO-8859-1 holds no surrogate) is built again whenever the fields changed.
    Made at the first request, not at import: gevent patches before pywsgi is used."""
    if _MESSAGE_CLASS:
        return _MESSAGE_CLASS[0]
    from gevent.pywsgi import OldMessage

    class Fields(OldMessage):
        _seen: list[tuple[str, str]] | None = None  # the fields as they were when indexed
        _first: dict[str, str]

        def get(self, name: str, failobj: Any = None) -> Any:
            if self._seen != self._headers:  # first call, or changed since (pywsgi deletes some)
                self._first = {}
                for field_name, value in self._headers:
                    self._first.setdefault(field_name.lower(), value)
                self._seen = list(self._headers)
            return self._first.get(name.lower(), failobj)

    _MESSAGE_CLASS.append(Fields)
    return Fields


def environ_fields(message: Any) -> Iterator[tuple[str, str]]:
    """The header fields as pywsgi puts them in the environ (`HTTP_` and the name in upper
    case with `_` for `-`; a name holding `_` dropped, as pywsgi drops it; Content-Type and
    Content-Length left to pywsgi, which sets them apart), from the parsed pairs. pywsgi's
    own `_headers` formats each field as a line and splits it again. No field is folded
    here: `read_headers` refuses folding."""
    for name, value in message._headers:
        if "_" in name:
            continue
        key = name.replace("-", "_").upper()
        if key != "CONTENT_TYPE" and key != "CONTENT_LENGTH":
            yield "HTTP_" + key, value.strip()


class FramingError(ValueError):
    """A request whose framing a proxy in front could read otherwise: answered, then closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_DIGITS = re.compile(r"[0-9]+")


def check_framing(message: Any, version: str | None) -> None:
    """RFC 9112's rules for a request's framing and Host (6.1, 6.3, 3.2), on the parsed
    block; the one Transfer-Encoding left is exactly "chunked". Raises FramingError."""
    fields = message._headers
    lengths = [v for name, v in fields if name.lower() == "content-length"]
    codings = [v for name, v in fields if name.lower() == "transfer-encoding"]
    hosts = [v for name, v in fields if name.lower() == "host"]
    if version == "HTTP/1.1" and len(hosts) != 1 or len(hosts) > 1:
        raise FramingError(400, "an HTTP/1.1 request carries exactly one Host header")
    if codings and lengths:
        raise FramingError(400, "a request has either Content-Length or Transfer-Encoding, not both")
    if lengths:
        values = {part.strip(" \t") for v in lengths for part in v.split(",")}
        if len(values) != 1 or not _DIGITS.fullmatch(next(iter(values))):
            raise FramingError(400, "Content-Length is one decimal number")
        if lengths != [next(iter(values))]:  # most requests carry one, already as it should be
            _replace(fields, "content-length", values.pop())
    if codings:
        if version != "HTTP/1.1":
            raise FramingError(400, "Transfer-Encoding needs HTTP/1.1")
        tokens = [part.strip(" \t").lower() for v in codings for part in v.split(",")]
        if not all(_TOKEN.fullmatch(t) for t in tokens) or tokens[-1] != "chunked" or tokens.count("chunked") > 1:
            raise FramingError(400, "Transfer-Encoding ends with chunked, once")
        if len(tokens) > 1:
            raise FramingError(501, "the only transfer coding served is chunked")
        _replace(fields, "transfer-encoding", "chunked")


def _replace(fields: list[tuple[str, str]], name: str, value: str) -> None:
    """The fields called `name` made one, with `value`, where the first of them was."""
    at = next(i for i, (n, _v) in enumerate(fields) if n.lower() == name)
    fields[:] = [f for i, f in enumerate(fields) if i == at or f[0].lower() != name]
    fields[at] = (fields[at][0], value)
