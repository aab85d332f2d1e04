"""Retries with one X-Request-Id: every connection, in any gateway process, gets the one
answer (never a 504 while it exists), and an id reused with another body gets 409."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from control.broker import keys
from tests.support.busy import busy_replicas, queued_behind_busy_replicas
from tests.support.deploy import FREE_KEY, MODEL, Deployment
from tests.support.gateways import gateway_process
from tests.support.waiting import until

BODY = {"model": MODEL, "prompt": "def join(a, b):\n    ", "max_tokens": 8}


@pytest.fixture(scope="module")
def other_gateway(kb: Deployment) -> Iterator[str]:
    """A second gateway on the same broker: with the fixture's two processes, copies sent
    to both URLs reach three gateway processes."""
    with gateway_process(kb) as url:
        yield url


def _ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/readyz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def _post(url: str, request_id: str, body: dict | None = None, deadline_ms: int = 3000) -> requests.Response:
    headers = {"Authorization": f"Bearer {FREE_KEY}", "X-Request-Id": request_id, "X-Deadline-Ms": str(deadline_ms)}
    return requests.post(f"{url}/v1/completions", json=body or BODY, headers=headers, timeout=10)


def _copies(urls: list[str], n: int, request_id: str) -> list[requests.Response]:
    """`n` connections with one id and body, sent at once, spread over `urls` in turn."""
    start = threading.Barrier(n)

    def one(i: int) -> requests.Response:
        start.wait(5)
        return _post(urls[i % len(urls)], request_id)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.slow
@pytest.mark.parametrize("copies", [5, 20])
def test_every_copy_of_a_request_in_any_gateway_process_gets_the_one_answer(
    kb: Deployment, other_gateway: str, copies: int
) -> None:
    for _ in range(4):
        answers = _copies([kb.url, other_gateway], copies, f"join-{uuid.uuid4().hex[:12]}")
        statuses = [a.status_code for a in answers]
        print(f"{copies} copies over 3 gateway processes: statuses {sorted(statuses)}")  # pytest -s shows it
        assert statuses == [200] * copies, [a.text for a in answers if a.status_code != 200][:3]
        bodies = [a.json() for a in answers]
        # One run: the same text, from the same batch of the same replica.
        runs = {(json.dumps(b["choices"]), b["keybatch"]["batch_ms"], b["keybatch"]["replica"]) for b in bodies}
        assert len(runs) == 1, runs


def test_a_join_through_another_gateway_leaves_the_first_connection_its_answer(
    kb: Deployment, other_gateway: str
) -> None:
    queued, busy = queued_behind_busy_replicas(kb, **{"X-Request-Id": "moved-2"})
    retry = _post(other_gateway, "moved-2", {"model": MODEL, "prompt": "def add(a, b):\n    "})
    first = queued.result(5)
    [f.result() for f in busy]
    assert (first.status_code, retry.status_code) == (200, 200), (first.text, retry.text)
    assert first.json()["choices"] == retry.json()["choices"]
    assert first.json()["keybatch"]["batch_ms"] == retry.json()["keybatch"]["batch_ms"]


def test_an_id_in_flight_reused_with_another_body_is_refused(kb: Deployment, other_gateway: str) -> None:
    queued, busy = queued_behind_busy_replicas(kb, **{"X-Request-Id": "reused-live"})
    other = {"model": MODEL, "prompt": "print('someone else')"}
    here, there = _post(kb.url, "reused-live", other), _post(other_gateway, "reused-live", other)
    for answer in (here, there):
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "request_id_reused"
    first = queued.result(5)
    [f.result() for f in busy]
    assert first.status_code == 200
    assert first.json()["choices"][0]["text"] != ""


def test_an_answered_id_reused_with_another_body_is_refused_and_the_same_body_gets_the_answer(
    kb: Deployment,
) -> None:
    first = _post(kb.url, "reused-done")
    assert first.status_code == 200
    for changed in ({"prompt": "x = 1\n"}, {"max_tokens": 9}, {"temperature": 0.5}, {"stop": ["\n"]}):
        answer = _post(kb.url, "reused-done", {**BODY, **changed})
        assert answer.status_code == 409, (changed, answer.text)
        assert answer.json()["error"]["code"] == "request_id_reused"
    # The same request written another way (a one-prompt array, defaults spelled out).
    same = {**BODY, "prompt": [BODY["prompt"]], "temperature": None, "top_p": 1.0, "stop": None}
    again = _post(kb.url, "reused-done", same)
    assert again.status_code == 200, again.text
    assert again.json()["choices"] == first.json()["choices"]
    assert again.json()["keybatch"]["batch_ms"] == first.json()["keybatch"]["batch_ms"]


def _owner(kb: Deployment, request_id: str) -> str:
    value = redis.Redis.from_url(kb.system.redis_url).get(keys.owner_key(f"{_tenant(FREE_KEY)}:{request_id}"))
    return value.decode() if value else ""


def _tenant(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def test_a_joined_connection_that_hangs_up_leaves_the_others_their_answer(kb: Deployment, other_gateway: str) -> None:
    queued, busy = queued_behind_busy_replicas(kb, **{"X-Request-Id": "join-hangup"})
    raw = json.dumps({"model": MODEL, "prompt": "def add(a, b):\n    "}).encode()
    host, port = other_gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {FREE_KEY}\r\nX-Request-Id: join-hangup\r\n".encode()
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        assert until(lambda: "," in _owner(kb, "join-hangup").partition("|")[0], 5)  # both gateways wait
    # The retry's gateway stops waiting; the request is not cancelled, the first gateway still waits.
    assert until(lambda: (o := _owner(kb, "join-hangup")) and "," not in o.partition("|")[0], 2)
    first = queued.result(5)
    [f.result() for f in busy]
    assert first.status_code == 200, first.text


def test_a_cancel_reaches_every_joined_connection_at_once(kb: Deployment, other_gateway: str) -> None:
    busy = busy_replicas(kb)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(_post, url, "join-cancel") for url in (kb.url, other_gateway)]
        assert until(lambda: "," in _owner(kb, "join-cancel").partition("|")[0], 5)  # both have joined
        auth = {"Authorization": f"Bearer {FREE_KEY}"}
        assert requests.delete(f"{kb.url}/v1/completions/join-cancel", headers=auth, timeout=5).status_code == 200
        answers = [f.result(5) for f in waiting]
    [f.result() for f in busy]
    assert [(a.status_code, a.json().get("error", {}).get("code")) for a in answers] == [(409, "cancelled")] * 2
