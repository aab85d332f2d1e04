"""Priority and admission under overload, on a deployment small enough to overload cheaply."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from control.core.vocab import PAID, POLICIES, Policy
from control.load.generator import generate
from control.load.spec import LoadSpec
from control.load.summary import summarize
from tests.support.deploy import FREE_KEY, MODEL, PAID_KEY, deployment

SMALL = 2 * 4 * 1000 / 250  # 2 replicas x 4 per 250 ms: 32 req/s
OVERLOAD_S = 8.0


def test_paid_keeps_its_latency_and_free_is_shed_at_twice_capacity() -> None:
    # 2 replicas x 16 per 250 ms = 128 req/s; offer 256 req/s, 30% paid.
    with deployment(max_batch="16") as kb:
        spec = LoadSpec(kb.url, 256.0, 6.0, MODEL, paid_share=0.3, paid_key=PAID_KEY, free_key=FREE_KEY, seed=7)
        records = generate(spec, show_progress=False)
    summary = summarize(records)
    paid, free = summary["paid"], summary["free"]
    assert summary["all"]["no_answer"] == 0  # every request got exactly one answer
    # What a failure needs to be read: the answers, and when the paid ones not answered 200 were sent.
    refused = sorted(round(r.sent_s, 2) for r in records if r.tier == PAID and r.status != 200)
    why = f"paid {paid['codes']}, p99 {paid['p99_ms']:.0f} ms; free {free['codes']}; paid not 200 sent at {refused}"
    # From idle, both replicas start their first batches at once, nearly empty, and the
    # first quarter second's arrivals wait for the next two: 1-4% of the paid requests,
    # all sent in the first half second, are refused there (docs/decisions/0026). From
    # the first second on, paid requests are answered.
    steady = summarize([r for r in records if r.sent_s >= 1.0])["paid"]
    assert steady["ok_share"] >= 0.98, why
    assert paid["ok_share"] >= 0.93, why
    assert paid["p99_ms"] <= 600, why
    assert free["status_429"] > 0.25 * free["sent"]
    assert free["p99_429_ms"] < 200


def test_with_bumps_free_requests_fill_the_queue_and_paid_ones_bump_those_they_would_delay_too_long() -> None:
    """ADMIT_BUMP at twice capacity: free requests are admitted with no room kept for paid
    ones, so paid ones arriving later bump some of them. A bumped request is answered 429
    `overloaded` once it is bumped, after it waited, where a refusal comes at once; paid
    requests keep their answers and nothing ends 504 for want of a start."""
    with deployment(max_batch="16", admit_bump="true") as kb:
        spec = LoadSpec(kb.url, 256.0, 6.0, MODEL, paid_share=0.3, paid_key=PAID_KEY, free_key=FREE_KEY, seed=7)
        records = generate(spec, show_progress=False)
    summary = summarize(records)
    steady = summarize([r for r in records if r.sent_s >= 1.0])
    why = f"paid {summary['paid']['codes']}; free {summary['free']['codes']}"
    assert summary["all"]["no_answer"] == 0, why
    assert steady["paid"]["ok_share"] >= 0.98, why
    refused = [r for r in records if r.status == 429]
    assert refused and all(r.code in ("overloaded", "tenant_queue_full") for r in refused), why
    bumped = [r for r in refused if r.tier != PAID and r.code == "overloaded" and r.latency_ms > 100]
    assert len(bumped) > 10, sorted(round(r.latency_ms) for r in refused)[-20:]
    assert steady["all"]["codes"].get(504, 0) <= 0.01 * steady["all"]["sent"], why


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


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_at_twice_capacity_what_cannot_meet_its_deadline_is_refused_at_once_not_admitted_to_a_504(
    policy: Policy,
) -> None:
    # 30% paid at 2x: paid alone is 60% of capacity, and every free request admitted leaves
    # room for the paid ones that overtake it. Before: 6-14 of the ~320 requests sent after
    # the first second of 6 ended 504 (free ones pushed past their last slot, paid ones admitted to a
    # third slot that started after their deadline less a batch): admission predicted with
    # the engine's 250 ms and the mean phase while a slot took ~256 ms (static) or ~285 ms
    # (continuous).
    with deployment(max_batch="4", policy=policy) as kb:
        spec = LoadSpec(kb.url, 2 * SMALL, OVERLOAD_S, MODEL, paid_share=0.3, paid_key=PAID_KEY, free_key=FREE_KEY)
        spec.deadline_ms, spec.seed = 600.0, 7
        records = generate(spec, show_progress=False)
    summary = summarize(records)["all"]
    assert summary["no_answer"] == 0
    assert summary["status_429"] > 0.3 * summary["sent"], summary["codes"]
    assert summary["p99_429_ms"] < 200  # refused at once, without waiting for the queue
    # From the first second on (the paid rate is measured over a second): few late 504s.
    # At a batch of 4 the paid arrivals' spread is a slot's size, and a free request that
    # late paid ones displace from its replica's next batch waits for that replica's batch
    # after it. Static: 0-3 of ~440 before the overlapped cycle, 5-14 with it (free ones,
    # dropped at ~350 ms) on two cores, a regression that is the next piece of work
    # (docs/decisions/0004); before admission counted the measured cycle, 10. Continuous:
    # 2-11, 24 before. 200s near capacity (~29 req/s; some batches of 4 hold 3).
    steady = [r for r in records if r.sent_s >= 1.0]
    late = [(round(r.sent_s, 2), r.tier, round(r.latency_ms)) for r in steady if r.status == 504]
    assert len(late) <= 0.04 * len(steady), late
    assert summary["status_504"] <= 0.04 * summary["sent"], summary["codes"]  # continuous: 11 of 509 seen
    assert sum(r.status == 200 for r in steady) / (OVERLOAD_S - 1.0) >= 0.7 * SMALL, summary["codes"]
