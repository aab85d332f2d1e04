"""The two apps `keybatch bench floor` serves (control/bench/floor.py): a completion-shaped
answer at once, through Flask and as a bare WSGI function. Nothing else of keybatch is
imported here, so the worker's heap is the stack's own."""

from __future__ import annotations

import json
from typing import Any

MODEL = "kb-small"
ANSWER = {
    "id": "cmpl-floor",
    "object": "text_completion",
    "model": MODEL,
    "choices": [{"index": 0, "text": "    return a + b\n", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14},
}
_BODY = json.dumps(ANSWER).encode()


def wsgi_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """The bare floor: read the body, answer the fixed completion."""
    size = int(environ.get("CONTENT_LENGTH") or 0)
    environ["wsgi.input"].read(size)
    if environ.get("PATH_INFO") != "/v1/completions":
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(_BODY)))])
    return [_BODY]


def _flask() -> Any:
    from flask import Flask, jsonify, request

    app = Flask("floor")

    @app.post("/v1/completions")
    def completions() -> Any:
        body = request.get_json()
        return jsonify({**ANSWER, "model": body.get("model", MODEL)})

    @app.get("/readyz")
    def ready() -> str:
        return "ok"

    return app


def __getattr__(name: str) -> Any:
    """`flask_app` is made when gunicorn loads it, so importing this module loads no Flask."""
    if name == "flask_app":
        return _flask()
    raise AttributeError(name)
