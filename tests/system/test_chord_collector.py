"""The chord collector (KEYBATCH_COLLECTOR=chord, docs/decisions/0001): what is its own.

One replica that batches up to 4 and would wait 3 s to fill a batch, so that what closes a
batch is plain: its size, or its tightest deadline. Each request that runs passes through
one header task of its batch's chord, whose result the result backend keeps: the tests
count those results in the broker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from tasks.replica.chord import RESULT_PREFIX
from tests.support.deploy import FREE_KEY, MODEL, Deployment, deployment

MAX_BATCH = 4
MAX_WAIT_S = 3.0


@pytest.fixture(scope="module")
def kb_chord() -> Iterator[Deployment]:
    env = {"max_batch": str(MAX_BATCH), "max_wait_ms": str(MAX_WAIT_S * 1000), "deadline_ms": "5000"}
    with deployment(workers=1, collector="chord", **env) as d:
        yield d


def _members_run(kb: Deployment) -> int:
    """Header tasks whose result the backend holds (one per request a chord ran)."""
    state = redis.Redis.from_url(kb.system.redis_url)
    return len(state.keys(f"{RESULT_PREFIX}celery-task-meta-*"))


def _dropped(kb: Deployment, reason: str, want: float, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while (seen := kb.metric("keybatch_dropped_before_batch_total", reason=reason)) != want:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return seen


def test_a_full_batch_closes_at_once(kb_chord: Deployment) -> None:
    before = _members_run(kb_chord)
    started = time.monotonic()
    with ThreadPoolExecutor(MAX_BATCH) as pool:
        body = {"model": MODEL, "prompt": "def size(x):\n    ", "max_tokens": 8}
        answers = list(pool.map(lambda _: kb_chord.post(body), range(MAX_BATCH)))
    elapsed_s = time.monotonic() - started
    assert [a.status_code for a in answers] == [200] * MAX_BATCH, [a.text for a in answers]
    assert [a.json()["keybatch"]["batch_size"] for a in answers] == [MAX_BATCH] * MAX_BATCH
    assert elapsed_s < MAX_WAIT_S / 2  # closed by its size, not by the wait
    assert _members_run(kb_chord) - before == MAX_BATCH


def test_a_lone_request_closes_its_batch_by_its_deadline(kb_chord: Deployment) -> None:
    before = _members_run(kb_chord)
    deadline_ms = 1500
    answer = kb_chord.post(**{"X-Deadline-Ms": str(deadline_ms)})
    assert answer.status_code == 200, answer.text
    figures = answer.json()["keybatch"]
    assert figures["batch_size"] == 1
    # It waited for its deadline (less one batch, the margin and the chord's hop), not the
    # 3 s the collector waits to fill a batch, and not nothing.
    assert figures["queue_ms"] > deadline_ms / 2
    assert figures["total_ms"] < deadline_ms
    assert _members_run(kb_chord) - before == 1


def test_a_cancel_before_the_batch_leaves_it_out_of_the_chord(kb_chord: Deployment) -> None:
    before_members = _members_run(kb_chord)
    before = kb_chord.metric("keybatch_dropped_before_batch_total", reason="cancelled")
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(kb_chord.post, **{"X-Request-Id": "chord-cancel"})
        time.sleep(0.3)  # buffered by the replica, which waits to fill its batch
        auth = {"Authorization": f"Bearer {FREE_KEY}"}
        assert requests.delete(f"{kb_chord.url}/v1/completions/chord-cancel", headers=auth).status_code == 200
        answer = queued.result(10)
    assert answer.status_code == 409
    assert answer.json()["error"]["code"] == "cancelled"
    # The replica drops it when its batch would have closed (by the wait): no chord runs it.
    assert _dropped(kb_chord, "cancelled", before + 1, MAX_WAIT_S + 2) == before + 1
    assert _members_run(kb_chord) == before_members
    assert kb_chord.post().status_code == 200  # the replica serves on
    assert _members_run(kb_chord) - before_members == 1
