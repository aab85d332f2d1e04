"""The whole path over real HTTP, real Celery replicas and a real Valkey."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import redis
import requests

from control.broker.keys import waiting_key
from control.core.protocol import Job
from tasks.engine.fixed import simulated_text
from tests.support.busy import busy_replicas, queued_behind_busy_replicas
from tests.support.deploy import FREE_KEY, MODEL, PAID_KEY, Collector, Deployment, deployment

# A chord's hop (its members pulled, run and counted, then its body: tens of ms a batch
# on two cores, docs/decisions/0001) comes on top of every batch; under the default 600 ms
# a burst of 40 no longer fits two batches. The chord deployment's default deadline is
# longer so that these tests check what they are about: answers, cancels, errors.
CHORD_DEADLINE_MS = "2000"


@pytest.fixture(scope="module", params=["native", "chord"])
def kb(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """Every test here under both collectors."""
    collector: Collector = request.param
    env = {"deadline_ms": CHORD_DEADLINE_MS} if collector == "chord" else {}
    with deployment(collector=collector, **env) as d:
        yield d


def test_every_request_gets_exactly_one_answer(kb: Deployment) -> None:
    prompts = [f"def f{i}(x):\n    " for i in range(40)]
    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(lambda p: kb.post({"model": MODEL, "prompt": p, "max_tokens": 8}), prompts))
    assert [a.status_code for a in answers] == [200] * 40, [a.text for a in answers if a.status_code != 200][:3]
    bodies = [a.json() for a in answers]
    assert len({b["id"] for b in bodies}) == 40
    for prompt, body in zip(prompts, bodies, strict=True):
        expected, _ = simulated_text(
            Job(id="x", key="k", model=MODEL, prompt=prompt, max_tokens=8, gateway="g", received_ms=0, deadline_ms=1)
        )
        assert body["choices"][0]["text"] == expected
        assert body["object"] == "text_completion"
        assert body["keybatch"]["backend"].startswith("fixed (simulated")
    assert max(b["keybatch"]["batch_size"] for b in bodies) > 1  # they were batched


def test_request_id_is_echoed(kb: Deployment) -> None:
    resp = kb.post(**{"X-Request-Id": "my-id-1"})
    assert resp.status_code == 200
    assert resp.json()["id"] == "my-id-1"
    assert resp.headers["X-Request-Id"] == "my-id-1"


def test_cancel_before_the_batch_takes_no_slot(kb: Deployment) -> None:
    before = kb.metric("keybatch_dropped_before_batch_total", reason="cancelled")
    queued, busy = queued_behind_busy_replicas(kb, **{"X-Request-Id": "to-cancel"})
    stranger = {"Authorization": f"Bearer {PAID_KEY}"}  # another tenant cannot cancel it
    assert requests.delete(f"{kb.url}/v1/completions/to-cancel", headers=stranger).status_code == 404
    cancel = requests.delete(f"{kb.url}/v1/completions/to-cancel", headers={"Authorization": f"Bearer {FREE_KEY}"})
    assert cancel.status_code == 200
    state = redis.Redis.from_url(kb.system.redis_url)
    assert state.zscore(waiting_key(MODEL, "free"), "to-cancel") is None  # no longer counted as queued
    answer = queued.result(5)
    assert answer.status_code == 409
    assert answer.json()["error"]["code"] == "cancelled"
    [f.result() for f in busy]
    assert kb.metric_becomes("keybatch_dropped_before_batch_total", before + 1, reason="cancelled") == before + 1
    again = requests.delete(f"{kb.url}/v1/completions/to-cancel", headers={"Authorization": f"Bearer {FREE_KEY}"})
    assert again.status_code == 404


def test_a_newer_request_in_the_session_supersedes_the_older(kb: Deployment) -> None:
    before = kb.metric("keybatch_dropped_before_batch_total", reason="superseded")
    older, busy = queued_behind_busy_replicas(kb, **{"X-Session-Id": "s1"})
    newer = kb.post(**{"X-Session-Id": "s1"})
    assert older.result(5).status_code == 409
    assert older.result().json()["error"]["code"] == "superseded"
    assert newer.status_code == 200
    [f.result() for f in busy]
    assert kb.metric_becomes("keybatch_dropped_before_batch_total", before + 1, reason="superseded") == before + 1


def test_a_prompt_that_types_through_the_last_completion_is_answered_with_its_rest(kb: Deployment) -> None:
    prompt, session = "def typed_through(x):\n    ", {"X-Session-Id": "typing"}

    def ask(text: str, key: str = FREE_KEY, **headers: str) -> dict:
        resp = kb.post({"model": MODEL, "prompt": text, "max_tokens": 8}, key=key, **headers)
        assert resp.status_code == 200, resp.text
        return resp.json()

    first = ask(prompt, **session)
    text = first["choices"][0]["text"]
    assert first["keybatch"]["reused"] is False and len(text) > 5
    before = kb.metric("keybatch_reused_answers_total", model=MODEL, tier="free")
    second = ask(prompt + text[:3], **session)  # the user typed what was suggested
    assert second["choices"][0]["text"] == text[3:]
    assert second["keybatch"]["reused"] is True and second["keybatch"]["batch_size"] == 0
    assert second["choices"][0]["finish_reason"] == first["choices"][0]["finish_reason"]
    assert ask(prompt + text[:5], **session)["choices"][0]["text"] == text[5:]  # and typed on
    assert kb.metric("keybatch_reused_answers_total", model=MODEL, tier="free") == before + 2
    assert ask(prompt + text[:5] + "#", **session)["keybatch"]["reused"] is False  # typed something else
    assert ask(prompt + text[:3], **{"X-Session-Id": "another"})["keybatch"]["reused"] is False
    assert ask(prompt + text[:3], key=PAID_KEY, **session)["keybatch"]["reused"] is False  # another key's session


def test_an_answer_typed_through_supersedes_the_sessions_request_in_flight(kb: Deployment) -> None:
    session = {"X-Session-Id": "typing-on"}
    first = kb.post(**session).json()  # the default body: what `queued_behind_busy_replicas` sends too
    older, busy = queued_behind_busy_replicas(kb, **session)
    typed = {"model": MODEL, "prompt": "def add(a, b):\n    " + first["choices"][0]["text"][:2]}
    newer = kb.post(typed, **session)
    assert newer.status_code == 200 and newer.json()["keybatch"]["reused"] is True
    assert older.result(5).status_code == 409
    assert older.result().json()["error"]["code"] == "superseded"
    [f.result() for f in busy]


def test_errors_are_openai_shaped(kb: Deployment) -> None:
    def check(resp: requests.Response, status: int, code: str) -> None:
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["code"] == code
        assert resp.json()["error"]["type"]

    url = f"{kb.url}/v1/completions"
    check(requests.post(url, data="{nope", headers={"Content-Type": "application/json"}), 400, "invalid_json")
    check(kb.post({"model": MODEL}), 400, "invalid_request")
    check(kb.post({"model": MODEL, "prompt": "x", "n": 2}), 400, "invalid_request")
    check(kb.post({"model": MODEL, "prompt": "x", "stop": ["a"] * 5}), 400, "invalid_request")
    check(kb.post({"model": MODEL, "prompt": "x", "max_tokens": 0}), 400, "invalid_request")
    check(kb.post(**{"X-Deadline-Ms": "soon"}), 400, "invalid_header")
    check(kb.post(**{"X-Request-Id": "bad id!"}), 400, "invalid_header")
    check(kb.post(key="wrong-key"), 401, "invalid_api_key")
    check(kb.post({"model": "no-such-model", "prompt": "x"}), 404, "model_not_found")
    check(requests.get(f"{kb.url}/v1/nothing"), 404, "not_found")
    check(requests.delete(f"{url}/never-was"), 404, "request_not_found")
    check(kb.post({"model": MODEL, "prompt": "x" * 40_000}), 413, "prompt_too_long")
    check(kb.post(**{"X-Deadline-Ms": "100"}), 504, "deadline_exceeded")
    check(requests.put(url), 405, "method_not_allowed")


def test_what_ordinary_clients_send_is_accepted(kb: Deployment) -> None:
    nulls = {"model": MODEL, "prompt": ["x = 1\n"], "max_tokens": None, "temperature": None, "stop": None, "n": None}
    assert kb.post(nulls).status_code == 200
    raw = requests.post(f"{kb.url}/v1/completions", data='{"model": "kb-small", "prompt": "x"}')  # form content type
    assert raw.status_code == 200
    assert kb.post({"model": MODEL, "prompt": ["a", "b"]}).status_code == 400


def _raw(kb: Deployment, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written byte for byte; the status and body of the answer."""
    host, port = kb.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer.split(b"\r\n\r\n", 1)[1]


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_the_header_block_is_read_strictly(kb: Deployment) -> None:
    body = b'{"model": "kb-small", "prompt": "x = 1"}'
    start = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % len(body)
    status, answer = _raw(kb, start + b"Content-Type: application/json\r\nX-Request-Id: raw-1\r\n\r\n", body)
    assert status == 200 and b"raw-1" in answer
    bad_lines = (
        b"No colon here\r\n",
        b"Name : space before the colon\r\n",
        b"X-Bare: carriage\rreturn\r\n",
        b"Authorization: Bearer\r\n " + FREE_KEY.encode() + b"\r\n",  # obsolete folding (RFC 9112 5.2)
    )
    for bad in bad_lines:
        status, _ = _raw(kb, start + bad + b"\r\n", body)
        assert status == 400, bad[:40]
    assert _raw(kb, start + b"X: " + b"a" * 70_000 + b"\r\n\r\n", body)[0] == 431
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(101))
    assert _raw(kb, start + many + b"\r\n", body)[0] == 431


def test_a_header_cannot_raise_the_tier(kb: Deployment) -> None:
    resp = kb.post(key=None, **{"X-Tier": "paid"})
    assert resp.status_code == 200
    assert resp.json()["keybatch"]["tier"] == "free"
    assert kb.post(key=PAID_KEY).json()["keybatch"]["tier"] == "paid"


def test_health_readiness_models_metrics(kb: Deployment) -> None:
    assert requests.get(f"{kb.url}/healthz").json() == {"status": "ok"}
    ready = requests.get(f"{kb.url}/readyz").json()
    assert ready["replicas"] == {MODEL: 2}
    models = requests.get(f"{kb.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    kb.post()
    assert kb.metric("keybatch_requests_total", model=MODEL, tier="free", status="200") >= 1


def test_openai_client_library(kb: Deployment) -> None:
    client = openai.OpenAI(base_url=f"{kb.url}/v1", api_key=PAID_KEY, max_retries=0)
    done = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=5)
    assert done.choices[0].text
    assert done.object == "text_completion"
    chunks = list(client.completions.create(model=MODEL, prompt="import os\n", max_tokens=5, stream=True))
    raw = requests.post(
        f"{kb.url}/v1/completions", json={"model": MODEL, "prompt": "import os\n", "max_tokens": 5, "stream": True}
    )
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
    try:
        client.completions.create(model="no-such-model", prompt="x")
    except openai.NotFoundError as err:
        assert err.status_code == 404
    else:
        raise AssertionError("expected a 404")


def test_a_client_that_hangs_up_cancels_its_request(kb: Deployment) -> None:
    before = kb.metric("keybatch_dropped_before_batch_total", reason="gone")
    busy = busy_replicas(kb)
    body = b'{"model": "kb-small", "prompt": "never mind"}'
    host, port = kb.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.03)  # admitted and queued behind the busy replicas
    [f.result() for f in busy]
    # It takes no batch slot: the replica drops it when it next forms a batch.
    assert kb.metric_becomes("keybatch_dropped_before_batch_total", before + 1, reason="gone") == before + 1
