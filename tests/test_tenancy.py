"""Request ids, sessions and cancels belong to the caller's tenant; retries with the same
id join the request in flight, get its stored answer, or run again after a 504 or cancel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.conftest import FREE_KEY, MODEL, PAID_KEY, Deployment, free_port, until
from tests.test_serving import _queued_behind_busy_replicas


def test_a_session_of_one_tenant_cannot_supersede_another_tenants_request(kb: Deployment) -> None:
    # Tenant B finishes a request with id X in its session; tenant A then uses the same id X.
    assert kb.post(key=PAID_KEY, **{"X-Request-Id": "shared-x", "X-Session-Id": "sb"}).status_code == 200
    a, busy = _queued_behind_busy_replicas(kb, **{"X-Request-Id": "shared-x"})  # tenant A (FREE_KEY)
    b_next = kb.post(key=PAID_KEY, **{"X-Session-Id": "sb"})  # B's next request in its session
    assert b_next.status_code == 200
    assert a.result(5).status_code == 200, a.result().text
    [f.result() for f in busy]


def test_a_tenant_cannot_cancel_another_tenants_request(kb: Deployment) -> None:
    queued, busy = _queued_behind_busy_replicas(kb, **{"X-Request-Id": "mine-1"})
    stranger = requests.delete(f"{kb.url}/v1/completions/mine-1", headers={"Authorization": f"Bearer {PAID_KEY}"})
    anonymous = requests.delete(f"{kb.url}/v1/completions/mine-1")
    assert (stranger.status_code, anonymous.status_code) == (404, 404)
    assert queued.result(5).status_code == 200
    [f.result() for f in busy]


def test_anonymous_callers_cannot_cancel_each_other_by_a_chosen_id(kb: Deployment) -> None:
    queued, busy = _queued_behind_busy_replicas(kb, key=None, **{"X-Request-Id": "anon-1"})
    assert requests.delete(f"{kb.url}/v1/completions/anon-1").status_code == 404
    answer = queued.result(5)
    assert answer.status_code == 200
    assert answer.json()["id"] == "anon-1"  # echoed all the same
    [f.result() for f in busy]


def test_a_retry_after_the_answer_gets_the_stored_answer_without_running_again(kb: Deployment) -> None:
    first = kb.post(**{"X-Request-Id": "retry-done"})
    again = kb.post(**{"X-Request-Id": "retry-done"})
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.json()["choices"] == first.json()["choices"]
    assert again.json()["id"] == "retry-done"
    # The same batch, not another run of it (a run's time differs in the microseconds).
    assert again.json()["keybatch"]["batch_ms"] == first.json()["keybatch"]["batch_ms"]
    assert again.json()["keybatch"]["replica"] == first.json()["keybatch"]["replica"]


def test_a_retry_in_flight_joins_the_request(kb: Deployment) -> None:
    queued, busy = _queued_behind_busy_replicas(kb, **{"X-Request-Id": "retry-live"})
    with ThreadPoolExecutor(1) as pool:
        retry = pool.submit(kb.post, **{"X-Request-Id": "retry-live"}).result(10)
    first = queued.result(5)
    [f.result() for f in busy]
    # One run: both connections get its answer, or the older one is told it was taken over.
    assert retry.status_code == 200
    assert first.status_code in (200, 409)
    if first.status_code == 200:
        assert first.json()["choices"] == retry.json()["choices"]
    else:
        assert first.json()["error"]["code"] == "retried"


def test_a_retry_after_a_cancel_runs_again(kb: Deployment) -> None:
    queued, busy = _queued_behind_busy_replicas(kb, **{"X-Request-Id": "retry-cancelled"})
    auth = {"Authorization": f"Bearer {FREE_KEY}"}
    assert requests.delete(f"{kb.url}/v1/completions/retry-cancelled", headers=auth).status_code == 200
    assert queued.result(5).status_code == 409
    [f.result() for f in busy]
    assert kb.post(**{"X-Request-Id": "retry-cancelled"}).status_code == 200


def test_a_retry_after_a_504_runs_again(kb: Deployment) -> None:
    late, busy = _queued_behind_busy_replicas(kb, **{"X-Request-Id": "retry-late", "X-Deadline-Ms": "300"})
    assert late.result(5).status_code == 504
    [f.result() for f in busy]
    assert kb.post(**{"X-Request-Id": "retry-late"}).status_code == 200


def test_a_retry_through_another_gateway_takes_the_request_over(kb: Deployment) -> None:
    """The first connection (gateway A) is told 409 `retried`; the retry (gateway B) gets
    the answer of the one run."""
    port = free_port()
    env = {**os.environ, "KEYBATCH_REDIS_URL": kb.system.redis_url or "", "KEYBATCH_API_PROCESSES": "1"}
    env["KEYBATCH_MODELS"] = json.dumps({MODEL: MODEL})
    other = subprocess.Popen(
        [sys.executable, "-m", "control", "api", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        b_url = f"http://127.0.0.1:{port}"
        assert until(lambda: _ready(b_url), 20)
        queued, busy = _queued_behind_busy_replicas(kb, **{"X-Request-Id": "moved-1"})
        retry = requests.post(
            f"{b_url}/v1/completions",
            json={"model": MODEL, "prompt": "def add(a, b):\n    "},
            headers={"Authorization": f"Bearer {FREE_KEY}", "X-Request-Id": "moved-1"},
            timeout=10,
        )
        first = queued.result(5)
        [f.result() for f in busy]
    finally:
        other.terminate()
        other.wait(30)
    assert retry.status_code == 200 and retry.json()["id"] == "moved-1"
    assert first.status_code == 409 and first.json()["error"]["code"] == "retried"


def _ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/readyz", timeout=1).status_code == 200
    except requests.RequestException:
        return False
