"""A tiny gevent pywsgi server with the gateway's handler, for tests/system/test_abuse.py.

`python -m tests.support.hangup_server` prints its port, then two lines per request:
`GET /path watching` once the app watches its client, then `GET /path gone` if the
client hung up while the app waited (the query string's seconds, default 5), or
`GET /path stayed` if not. A path starting `/closed` stops watching before it waits.
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

from collections.abc import Callable, Iterable  # noqa: E402 (after the patching)
from typing import Any  # noqa: E402

from gevent.pywsgi import WSGIServer  # noqa: E402

from api.disconnect import hangup_event  # noqa: E402
from api.server.serve import RequestLimits, handler_class  # noqa: E402


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ["PATH_INFO"]
    label = f"{environ['REQUEST_METHOD']} {path}"  # a request read whole, from its first byte
    watch = hangup_event(environ)
    assert watch is not None, "no client socket in the environ"
    print(f"{label} watching", flush=True)
    with watch:
        if path.startswith("/closed"):
            watch.close()
        gone = watch.event.wait(float(environ["QUERY_STRING"] or 5))
    print(f"{label} {'gone' if gone else 'stayed'}", flush=True)
    start_response("200 OK", [("Content-Length", "2")])
    return [b"ok"]


def main() -> None:
    limits = RequestLimits(header_timeout_s=5, body_timeout_s=5, max_body_bytes=1024)
    server = WSGIServer(("127.0.0.1", 0), app, handler_class=handler_class(limits), log=None)
    server.start()
    print(server.server_port, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
