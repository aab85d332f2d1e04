"""A gateway process under cProfile, for `keybatch bench path-cpu --profile`.

Run as a script (`python control/bench/profiled_gateway.py OUT`) with the environment of a
deployment's gateway and the checkout to profile on PYTHONPATH: gunicorn with one gevent
worker, the handler, server, hooks and metric files `keybatch api` has, and
`cProfile.Profile(time.thread_time)` in the worker from `post_worker_init`; the stats are
written to OUT when the worker exits (SIGTERM to this process).

The profile's greenlets share one thread's stack, so trust call counts and self-time
shares, not cumulative times across a switch (docs/decisions/0024).
"""

from __future__ import annotations

import cProfile
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from api.server import serve
from control.core.settings import Settings

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def main(out: str) -> None:
    profiles: list[cProfile.Profile] = []

    def start(worker: Any) -> None:
        serve._init_worker(worker)  # as `keybatch api`'s worker starts (gevent patched it already)
        profile = cProfile.Profile(time.thread_time)
        profiles.append(profile)
        profile.enable()

    def stop(_server: Any, _worker: Any) -> None:
        for profile in profiles:
            profile.disable()
            profile.dump_stats(out)

    class Profiled(serve.GatewayServer):
        def load_config(self) -> None:
            super().load_config()
            self.cfg.set("workers", 1)
            self.cfg.set("post_worker_init", start)
            self.cfg.set("worker_exit", stop)

    metrics_dir = tempfile.mkdtemp(prefix="keybatch-profile-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # the metric files, as a gateway of two processes writes them
    settings = Settings()
    serve.raise_fd_limit(settings)
    native_locks = getattr(serve, "native_metric_locks", None)  # a checkout before it has none
    if native_locks is not None:
        native_locks()
    try:
        Profiled(settings).run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1])
