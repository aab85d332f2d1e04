"""Fairness among the keys of a tier: one key flooding beyond its share of the queue delays
itself, not another key of its tier nor paid ones; its share is released as its requests
leave the queue, whichever way they leave."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from control.broker import keys
from control.core import protocol as p
from control.load.generator import generate_tenants
from control.load.spec import LoadSpec, TenantLoad
from control.load.summary import summarize
from tests.support.deploy import FREE_KEY, MODEL, PAID_KEY, Deployment, deployment, held_counts
from tests.support.waiting import until

FLOOD_KEY, OTHER_KEY = "test-free-flood", "test-free-other"
KEYS = json.dumps({PAID_KEY: "paid", FREE_KEY: "free", FLOOD_KEY: "free", OTHER_KEY: "free"})
FLOOD_BUDGET_MS = 4000


def _tenant(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _queued(kb: Deployment, key: str, tier: str = "free") -> int:
    """What the key holds of its tier's queue now, by the broker's own count."""
    state = redis.Redis.from_url(kb.system.redis_url)
    now_ms = time.time() * 1000
    return int(state.zcount(keys.tenant_waiting_key(MODEL, tier, _tenant(key)), now_ms, "+inf"))


@pytest.mark.slow
def test_a_flooding_free_key_leaves_another_free_key_and_paid_their_share() -> None:
    # 2 replicas x 4 per 250 ms = 32 req/s; one free key offers 3x that with long budgets.
    with deployment(max_batch="4", api_keys=KEYS) as kb:
        base = LoadSpec(kb.url, 1.0, 5.0, MODEL, max_tokens=8, seed=3)
        tenants = [
            TenantLoad("flood", FLOOD_KEY, 96.0, deadline_ms=FLOOD_BUDGET_MS, prompt_chars=2000, for_s=4.0),
            TenantLoad("other", OTHER_KEY, 4.0, from_s=1.0),
            TenantLoad("paid", PAID_KEY, 4.0, from_s=1.0),
        ]
        records = generate_tenants(base, tenants)
        summary = summarize(records)
        # The flood has stopped: within its budgets its share is free again.
        assert until(lambda: _queued(kb, FLOOD_KEY) == 0, timeout_s=FLOOD_BUDGET_MS / 1000 + 2)
        assert kb.post(key=FLOOD_KEY).status_code == 200
    flood, other, paid = summary["flood"], summary["other"], summary["paid"]
    assert summary["all"]["no_answer"] == 0
    assert flood["codes"].get("429 tenant_queue_full", 0) > 0.3 * flood["sent"], flood["codes"]
    assert flood["codes"].get("200", 0) > 0
    # Before: the other free key 0 of 22 answered (429 overloaded), paid 4 of 19 ended 504.
    assert other["ok_share"] >= 0.85, other["codes"]
    assert paid["ok_share"] >= 0.85, paid["codes"]
    assert flood["status_504"] <= 0.05 * flood["sent"], flood["codes"]  # the flood is refused, not left to expire


@pytest.mark.slow
def test_a_key_that_filled_the_queue_alone_leaves_room_for_keys_that_come_later() -> None:
    # 2 replicas x 8 per 250 ms = 64 req/s, 16 positions at the default 600 ms budget; a
    # free key offers 3x that. Alone for its first second, it may fill the queue in line;
    # then the others' requests are seen (refused ones too) and room is kept for them.
    # Weighed against the worst phase's limit, not ADMIT_OPEN's deeper one (decision 0039).
    with deployment(max_batch="8", api_keys=KEYS, admit_open="false") as kb:
        base = LoadSpec(kb.url, 1.0, 5.0, MODEL, max_tokens=8, seed=3)
        tenants = [
            TenantLoad("flood", FLOOD_KEY, 192.0, for_s=4.0),
            TenantLoad("other", OTHER_KEY, 4.0, from_s=1.0),
            TenantLoad("paid", PAID_KEY, 4.0, from_s=1.0),
        ]
        summary = summarize(generate_tenants(base, tenants))
    flood, other, paid = summary["flood"], summary["other"], summary["paid"]
    assert summary["all"]["no_answer"] == 0
    assert other["ok_share"] >= 0.85, other["codes"]
    assert paid["ok_share"] >= 0.85, paid["codes"]
    assert flood["codes"].get("200", 0) > 0
    assert flood["status_504"] <= 0.05 * flood["sent"], flood["codes"]


def test_a_key_alone_in_its_tier_may_fill_the_queue_beyond_its_share() -> None:
    # One replica of 8 per 250 ms, 1000 ms budgets: two slots wait, 16 positions, a key's
    # share of them 8. Alone in the tier, its burst of 16 fits (one runs at once, the rest
    # take the next two batches); before, every one beyond the 8th queued was refused.
    with deployment(workers=1, max_batch="8", api_keys=KEYS) as kb:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: kb.post(key=FREE_KEY, **{"X-Deadline-Ms": "1000"}), range(16)))
    codes = [a.status_code if a.status_code == 200 else a.json()["error"]["code"] for a in answers]
    assert codes == [200] * 16, codes


def test_a_queued_request_that_leaves_releases_its_keys_share() -> None:
    # One replica, one request a batch: the first holds the replica, the next queues.
    with deployment(workers=1, max_batch="1", batch_ms="400", api_keys=KEYS) as kb:
        auth = {"Authorization": f"Bearer {FLOOD_KEY}"}
        long = {"X-Deadline-Ms": "5000"}
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(kb.post, key=FLOOD_KEY, **long)
            assert until(lambda: sum(held_counts(kb).values()) == 1, timeout_s=2)
            cancelled = pool.submit(kb.post, key=FLOOD_KEY, **{"X-Request-Id": "leave-by-cancel", **long})
            # The first taken into a batch is out of the share; the second waits in it.
            assert until(lambda: _queued(kb, FLOOD_KEY) == 1 and not running.done(), timeout_s=2)
            assert requests.delete(f"{kb.url}/v1/completions/leave-by-cancel", headers=auth).status_code == 200
            assert _queued(kb, FLOOD_KEY) == 0  # cancelled: out at once
            assert cancelled.result(5).status_code == 409
            assert running.result(5).status_code == 200
        # Entries nothing removed (a process killed in between): those past their deadline
        # go at once; those no longer in the tier's queue are found by the next admission.
        state = redis.Redis.from_url(kb.system.redis_url)
        share = keys.tenant_waiting_key(MODEL, "free", _tenant(FLOOD_KEY))
        now_ms = time.time() * 1000
        state.zadd(share, {f"past-{i}": now_ms - 1000 for i in range(20)})
        state.zadd(share, {f"lost-{i}": now_ms + 60_000 for i in range(6)})
        assert kb.post(key=FLOOD_KEY, **long).status_code == 200
        assert state.zcard(share) == 0


def test_a_key_over_its_rate_is_refused_with_its_own_code() -> None:
    with deployment(workers=1, tenant_rate_free="2", tenant_burst_free="2", api_keys=KEYS) as kb:
        answers = [kb.post(key=FLOOD_KEY) for _ in range(4)]
        other = kb.post(key=OTHER_KEY)
    refused = [a for a in answers if a.status_code == 429]
    assert refused, [a.status_code for a in answers]
    for a in refused:
        assert a.json()["error"]["code"] == "tenant_rate_limited"
        assert a.json()["error"]["type"] == "rate_limit_error"
        assert int(a.headers["Retry-After"]) >= 1
    assert other.status_code == 200  # another key of the tier has its own bucket


def test_a_queued_request_takes_a_bounded_size_in_the_broker(kb: Deployment) -> None:
    # 32,000 characters of code queue as ~35 KB; as many control characters would take
    # ~7 bytes each once escaped twice (the job's JSON inside the message's): refused.
    code = ("def f(x):\n    return x + 1\n" * 1200)[:32_000]
    assert kb.post({"model": MODEL, "prompt": code, "max_tokens": 4}).status_code == 200
    escaped = kb.post({"model": MODEL, "prompt": "\x01" * 32_000, "max_tokens": 4})
    assert escaped.status_code == 413, escaped.text
    assert escaped.json()["error"]["code"] == "prompt_too_long"
    assert kb.post({"model": MODEL, "prompt": "\x01" * 32_000}, key=PAID_KEY).status_code == 200  # paid's cap


def test_the_message_of_a_large_prompt_is_about_its_size() -> None:
    from control.broker.envelope import TaskMessages
    from control.core.settings import Settings
    from tasks.celery.app import make_celery

    messages = TaskMessages(make_celery(Settings(redis_url="redis://127.0.0.1:1")))
    code = ("def f(x):\n    return x + 1\n" * 1200)[:32_000]
    job = p.Job(id="a" * 32, key="t:b", model=MODEL, prompt=code, gateway="g", received_ms=0, deadline_ms=1)
    assert len(messages(job)) < 32_000 * 1.2 + 2048


@pytest.mark.slow
def test_requests_re_queued_after_a_replica_dies_keep_then_release_their_keys_share() -> None:
    import signal

    from tests.support.deploy import replica_for

    with deployment(workers=2, max_batch="8", api_keys=KEYS) as kb:
        victim = kb.system.workers[0]
        name = replica_for(kb, victim.pid)
        with ThreadPoolExecutor(48) as pool:
            body = {"model": MODEL, "prompt": "def f():\n"}
            futures = [pool.submit(kb.post, body, FLOOD_KEY, **{"X-Deadline-Ms": "3000"}) for _ in range(48)]
            assert until(lambda: held_counts(kb).get(keys.held_key(name), 0) > 0, 5)  # it holds some of them
            victim.send_signal(signal.SIGKILL)
            answers = [f.result() for f in futures]
        codes = [a.status_code if a.status_code == 200 else a.json()["error"]["code"] for a in answers]
        assert set(codes) <= {200, "tenant_queue_full"}, codes
        assert codes.count(200) >= 24
        assert _queued(kb, FLOOD_KEY) == 0  # every one left: none holds the key's share
        assert kb.post(key=FLOOD_KEY).status_code == 200
