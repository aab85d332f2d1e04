"""Request ids, sessions and cancels belong to the caller's tenant; retries with the same
id join the request in flight, get its stored answer, or run again after a 504 or cancel."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests

from tests.support.busy import queued_behind_busy_replicas
from tests.support.deploy import FREE_KEY, PAID_KEY, Deployment


def test_a_session_of_one_tenant_cannot_supersede_another_tenants_request(kb: Deployment) -> None:
    # Tenant B finishes a request with id X in its session; tenant A then uses the same id X.
    assert kb.post(key=PAID_KEY, **{"X-Request-Id": "shared-x", "X-Session-Id": "sb"}).status_code == 200
    a, busy = queued_behind_busy_replicas(kb, **{"X-Request-Id": "shared-x"})  # tenant A (FREE_KEY)
    b_next = kb.post(key=PAID_KEY, **{"X-Session-Id": "sb"})  # B's next request in its session
    assert b_next.status_code == 200
    assert a.result(5).status_code == 200, a.result().text
    [f.result() for f in busy]


def test_a_tenant_cannot_cancel_another_tenants_request(kb: Deployment) -> None:
    queued, busy = queued_behind_busy_replicas(kb, **{"X-Request-Id": "mine-1"})
    stranger = requests.delete(f"{kb.url}/v1/completions/mine-1", headers={"Authorization": f"Bearer {PAID_KEY}"})
    anonymous = requests.delete(f"{kb.url}/v1/completions/mine-1")
    assert (stranger.status_code, anonymous.status_code) == (404, 404)
    assert queued.result(5).status_code == 200
    [f.result() for f in busy]


def test_anonymous_callers_cannot_cancel_each_other_by_a_chosen_id(kb: Deployment) -> None:
    queued, busy = queued_behind_busy_replicas(kb, key=None, **{"X-Request-Id": "anon-1"})
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
    queued, busy = queued_behind_busy_replicas(kb, **{"X-Request-Id": "retry-live"})
    with ThreadPoolExecutor(1) as pool:
        retry = pool.submit(kb.post, **{"X-Request-Id": "retry-live"}).result(10)
    first = queued.result(5)
    [f.result() for f in busy]
    # One run: both connections get its answer (tests/system/test_joins.py: across gateway processes).
    assert (first.status_code, retry.status_code) == (200, 200)
    assert first.json()["choices"] == retry.json()["choices"]


def test_a_retry_after_a_cancel_runs_again(kb: Deployment) -> None:
    queued, busy = queued_behind_busy_replicas(kb, **{"X-Request-Id": "retry-cancelled"})
    auth = {"Authorization": f"Bearer {FREE_KEY}"}
    assert requests.delete(f"{kb.url}/v1/completions/retry-cancelled", headers=auth).status_code == 200
    assert queued.result(5).status_code == 409
    [f.result() for f in busy]
    assert kb.post(**{"X-Request-Id": "retry-cancelled"}).status_code == 200


def test_a_retry_after_a_504_runs_again(kb: Deployment) -> None:
    late, busy = queued_behind_busy_replicas(kb, **{"X-Request-Id": "retry-late", "X-Deadline-Ms": "300"})
    assert late.result(5).status_code == 504
    [f.result() for f in busy]
    assert kb.post(**{"X-Request-Id": "retry-late"}).status_code == 200
