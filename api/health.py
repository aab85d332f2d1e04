"""Models, health, readiness and metrics."""

from __future__ import annotations

import time

from flask import Blueprint, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.completions import caller, gateway
from api.errors import ApiError
from api.metrics import check_scrape, scrape_allowed
from control.core.settings import Settings

bp = Blueprint("ops", __name__)
_CREATED = int(time.time())


@bp.get("/v1/models")
def list_models() -> Response:
    """The configured models and how many replicas serve each."""
    gw = gateway()
    caller(gw.settings)  # a key is checked as for completions
    ready = gw.readiness()
    data = [
        {"id": name, "object": "model", "created": _CREATED, "owned_by": "keybatch", "replicas": n}
        for name, n in ready.items()
    ]
    return jsonify({"object": "list", "data": data})


@bp.get("/healthz")
def healthz() -> Response:
    """The process is up."""
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> Response:
    """Ready when the broker answers and every configured model has a replica."""
    gw = gateway()
    if not gw.ping():
        raise ApiError(503, "the broker is unreachable", "broker_unavailable", retry_after_s=1)
    gw.fleet.refresh(direct=True)
    counts = gw.readiness()
    missing = sorted(m for m, n in counts.items() if n == 0)
    detail = shows_deployment(gw.settings)
    if missing or not gw.is_serving():
        models = ", ".join(missing) if detail else "a model"
        why = "shutting down" if not gw.is_serving() else f"no replica for {models}"
        raise ApiError(503, f"not ready: {why}", "not_ready", retry_after_s=1)
    # No process id, host or replica name here: an open endpoint tells a caller no more than
    # what it needs to route (docs/decisions/0014); with anonymous access off, not even the
    # models, unless the caller has a key or the scrape token (docs/decisions/0018).
    return jsonify({"status": "ready", "replicas": counts} if detail else {"status": "ready"})


def shows_deployment(settings: Settings) -> bool:
    """Whether this caller may see what the deployment serves (models, replica counts)."""
    auth = request.headers.get("Authorization")
    if settings.allow_anonymous or scrape_allowed(settings, auth):
        return True
    scheme, _, key = (auth or "").partition(" ")
    return scheme.lower() == "bearer" and key.strip() in settings.api_keys


@bp.get("/metrics")
def metrics() -> Response:
    """Prometheus text; needs the scrape token when one is set, or when anonymous access is off."""
    check_scrape(gateway().settings, request.headers.get("Authorization"))
    return Response(generate_latest(gateway().metrics.exposition), mimetype=CONTENT_TYPE_LATEST)
