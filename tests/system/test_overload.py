"""Priority and admission under overload, on a deployment small enough to overload cheaply."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from control.load.generator import generate
from control.load.spec import LoadSpec
from control.load.summary import summarize
from tests.support.deploy import FREE_KEY, MODEL, PAID_KEY, deployment


def test_paid_keeps_its_latency_and_free_is_shed_at_twice_capacity() -> None:
    # 2 replicas x 16 per 250 ms = 128 req/s; offer 256 req/s, 30% paid.
    with deployment(max_batch="16") as kb:
        spec = LoadSpec(kb.url, 256.0, 6.0, MODEL, paid_share=0.3, paid_key=PAID_KEY, free_key=FREE_KEY, seed=7)
        records = generate(spec, show_progress=False)
    summary = summarize(records)
    paid, free = summary["paid"], summary["free"]
    assert summary["all"]["no_answer"] == 0  # every request got exactly one answer
    assert paid["ok_share"] >= 0.95
    assert paid["p99_ms"] <= 600
    assert free["status_429"] > 0.25 * free["sent"]
    assert free["p99_429_ms"] < 200


def test_a_full_queue_answers_429_with_retry_after_at_once() -> None:
    with deployment(max_queue_free="1") as kb:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: kb.post({"model": MODEL, "prompt": f"q{i}"}), range(6)))
    refused = [a for a in answers if a.status_code == 429]
    assert refused, [a.status_code for a in answers]
    assert all(a.status_code in (200, 429) for a in answers)
    for a in refused:
        assert int(a.headers["Retry-After"]) >= 1
        assert a.json()["error"]["code"] == "overloaded"
        assert a.elapsed.total_seconds() < 0.2
