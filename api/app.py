"""The gateway's Flask app: its factory, JSON provider and blueprints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import orjson
import redis
from flask import Flask, Response
from flask.json.provider import JSONProvider

from control.core import connect
from control.core.clock import BrokerClock, SystemClock
from control.core.settings import Settings


class OrjsonProvider(JSONProvider):
    """Flask's JSON through orjson: request bodies and every answer (keys in the order
    written, as OpenAI's are)."""

    def dumps(self, obj: object, **kwargs: object) -> str:
        return orjson.dumps(obj).decode()

    def loads(self, s: str | bytes, **kwargs: object) -> object:
        return orjson.loads(s)

    def response(self, *args: object, **kwargs: object) -> Response:
        obj = self._prepare_response_obj(args, kwargs)
        # Flask types the provider's app as its sansio base, whose response class takes no body.
        return cast(Flask, self._app).response_class(orjson.dumps(obj), mimetype="application/json")


class GatewayApp(Flask):
    """Flask, asking once per function whether it is a coroutine function: Flask asks
    `inspect` on every call of a view, a hook or an error handler (`ensure_sync`)."""

    def __init__(self, import_name: str) -> None:
        super().__init__(import_name)
        self._synced: dict[Callable[..., Any], Callable[..., Any]] = {}

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        synced = self._synced.get(func)
        if synced is None:
            synced = self._synced[func] = super().ensure_sync(func)
        return synced


def create_app(settings: Settings | None = None) -> Flask:
    """Build the gateway app; the serving process starts its listener on first use."""
    from api import completions, errors, health, openapi
    from api.gateway import Gateway
    from tasks.celery.app import make_celery

    settings = settings or Settings()
    app = GatewayApp(__name__)
    app.json = OrjsonProvider(app)
    # Larger bodies answer 413 (the server refuses them before the app runs, api/server/serve.py).
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    # A bounded pool: under a burst, requests wait for a connection instead of failing;
    # every call on the request path, and the wait for a connection, is bounded.
    bound_s = settings.broker_timeout_ms / 1000.0
    clients = [
        redis.Redis(
            connection_pool=connect.blocking_pool(
                url, max_connections=64, timeout=bound_s, socket_timeout=bound_s, socket_connect_timeout=bound_s
            )
        )
        for url in settings.cell_urls
    ]
    # Deadlines are on the first cell's clock; the cells' hosts keep time together (NTP).
    time_source = connect.client(settings.cell_urls[0], socket_timeout=bound_s, socket_connect_timeout=bound_s)
    clock = BrokerClock(time_source, SystemClock(settings.clock_skew_ms))
    app.extensions["keybatch"] = Gateway(settings, clients, make_celery(settings), clock)
    errors.init_app(app)
    app.register_blueprint(completions.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(openapi.bp)
    return app
