"""One more gateway process on a deployment's broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import requests

from control.core.procs import free_port
from tests.support.deploy import MODEL, Deployment
from tests.support.waiting import until


def _ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/readyz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


@contextmanager
def gateway_process(kb: Deployment, **env: str) -> Iterator[str]:
    """One more gateway (one process) on the deployment's broker, with these KEYBATCH_
    settings; yields its URL once it is ready."""
    port = free_port()
    environ = {**os.environ, "KEYBATCH_REDIS_URL": kb.system.redis_url or "", "KEYBATCH_API_PROCESSES": "1"}
    environ["KEYBATCH_MODELS"] = json.dumps({MODEL: MODEL})
    environ.update({f"KEYBATCH_{k.upper()}": v for k, v in env.items()})
    proc = subprocess.Popen(
        [sys.executable, "-m", "control", "api", "--port", str(port)],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert until(lambda: _ready(url), 30)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
