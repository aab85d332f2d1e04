"""The gateway under gunicorn (a production WSGI server, not Flask's dev server)."""

from __future__ import annotations

from typing import Any

from gunicorn.app.base import BaseApplication

from control.settings import Settings


class GatewayServer(BaseApplication):  # type: ignore[misc]
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        options: dict[str, Any] = {
            "bind": f"{s.host}:{s.port}",
            "workers": s.api_processes,
            "worker_class": s.api_worker_class,
            "threads": s.api_threads if s.api_worker_class == "gthread" else 1,
            "worker_connections": 4096,
            "backlog": 4096,
            # An idle keep-alive connection holds a stopping worker until it times
            # out, so keep it short; in-flight requests end by their deadlines.
            "keepalive": 5,
            "graceful_timeout": max(10, int(s.max_deadline_ms / 1000) + 5),
            "timeout": 120,
            "accesslog": None,
            "errorlog": "-",
            "loglevel": "warning",
            "proc_name": "keybatch-api",
            "post_worker_init": _stop_admitting_with_worker,
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        from api import create_app

        return create_app(self.settings)


def _stop_admitting_with_worker(worker: Any) -> None:
    """A worker told to stop (SIGTERM) finishes its requests but admits no new ones."""
    worker.wsgi.extensions["keybatch"].is_serving = lambda: worker.alive


def serve(settings: Settings) -> None:
    GatewayServer(settings).run()
