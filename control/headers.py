"""The request header parser of the gateway's HTTP server: the one module that leans on
the email package's internals.

pywsgi (gevent's WSGI server, under gunicorn) expects the header block as an
`email.message.Message` subclass (`OldMessage`), as `http.client.parse_headers`
builds it. This module builds that object directly, appending (name, value) pairs
to the list `email.message.Message` keeps them in (`_headers`). An email or gevent
upgrade that changes either fails `tests/test_adapters.py`, which compares this
parser with `http.client.parse_headers` on the same blocks.
"""

from __future__ import annotations

import re
from typing import Any

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
    from gevent.pywsgi import OldMessage  # here, not at import: gevent patches before it is used

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
