"""The HTTP gateway: Flask app factory and blueprints."""

from __future__ import annotations

import redis
from flask import Flask

from control.clock import SystemClock
from control.settings import Settings


def create_app(settings: Settings | None = None) -> Flask:
    """Build the gateway app; the serving process starts its listener on first use."""
    from api import completions, errors, ops
    from api.gateway import Gateway
    from tasks.app import make_celery

    settings = settings or Settings()
    app = Flask(__name__)
    app.json.sort_keys = False  # type: ignore[attr-defined]  # answers keep the order OpenAI's do
    # Room for the largest prompt plus JSON quoting; larger bodies answer 413.
    app.config["MAX_CONTENT_LENGTH"] = settings.max_prompt_chars * 6 + 65_536
    # A bounded pool: under a burst, requests wait for a connection instead of failing.
    pool = redis.BlockingConnectionPool.from_url(settings.state_url, max_connections=64, timeout=2, socket_timeout=5)
    client = redis.Redis(connection_pool=pool)
    app.extensions["keybatch"] = Gateway(settings, client, make_celery(settings), SystemClock())
    errors.init_app(app)
    app.register_blueprint(completions.bp)
    app.register_blueprint(ops.bp)
    return app
