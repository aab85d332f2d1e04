"""Start and stop: a graceful stop loses nothing; no replica or no broker is a 503."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests

from control.core.procs import free_port
from tests.support.deploy import FREE_KEY, MODEL, PAID_KEY, deployment
from tests.support.waiting import alive


def test_sigterm_finishes_what_is_in_flight_and_leaves_nothing_running() -> None:
    port = free_port()
    env = {**os.environ, "KEYBATCH_API_KEYS": json.dumps({PAID_KEY: "paid", FREE_KEY: "free"})}
    env.pop("KEYBATCH_REDIS_URL", None)
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "control",
            "up",
            "--backend",
            "fixed",
            "--workers",
            "2",
            "--models",
            MODEL,
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        _serve_then_stop(up, port)
    finally:
        if up.poll() is None:
            up.kill()


def _serve_then_stop(up: subprocess.Popen[str], port: int) -> None:
    assert up.stdout is not None
    line = up.stdout.readline()
    assert line.strip() == f"keybatch ready: http://127.0.0.1:{port}", line
    children = psutil.Process(up.pid).children(recursive=True)
    assert any("valkey" in p.name() for p in children)  # the broker is a child, not a daemon
    family = [p.pid for p in children]
    url = f"http://127.0.0.1:{port}/v1/completions"
    for _ in range(2):  # readiness is not warmth: one request per replica first (as conftest does)
        requests.post(url, json={"model": MODEL, "prompt": "warm"}, timeout=30)
    with ThreadPoolExecutor(30) as pool:
        futures = [
            pool.submit(requests.post, url, json={"model": MODEL, "prompt": f"x{i}"}, timeout=30) for i in range(30)
        ]
        kept = requests.Session()  # a kept-alive connection, opened before the stop
        assert kept.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        time.sleep(0.2)  # all admitted (they take ~ms), none finished (a batch takes 250 ms)
        up.send_signal(signal.SIGTERM)
        up.send_signal(signal.SIGTERM)  # twice, as `timeout` (child, then group) and impatient people do
        time.sleep(0.1)
        late = kept.post(url, json={"model": MODEL, "prompt": "late"}, timeout=30)
        codes = [f.result().status_code for f in futures]
    assert codes == [200] * 30
    assert late.status_code == 503
    assert late.json()["error"]["code"] == "shutting_down"
    stopping = time.monotonic()
    assert up.wait(60) == 0
    assert time.monotonic() - stopping < 15
    assert alive(family) == []


def test_no_replica_then_no_broker_answer_503() -> None:
    with deployment(workers=1) as kb:
        for worker in kb.system.workers:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
        time.sleep(0.5)  # the gateway's copy of the registry refreshes every 250 ms
        resp = kb.post()
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "no_replica"
        assert resp.headers["Retry-After"] == "1"
        assert requests.get(f"{kb.url}/readyz").status_code == 503
        assert kb.system.broker is not None
        kb.system.broker.stop()
        resp = kb.post()
        assert resp.status_code == 503
        assert "Retry-After" in resp.headers
