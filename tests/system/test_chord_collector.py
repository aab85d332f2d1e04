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
from celery import Celery

from control.broker import keys
from control.core import protocol as p
from control.core.clock import BrokerClock
from control.core.settings import Settings
from control.fleet.valkey import EmbeddedBroker
from tasks.celery.app import make_celery
from tasks.engine.fixed import FixedLatencyEngine
from tasks.policy.collector import CollectorConfig
from tasks.replica.chord import RESULT_PREFIX, ChordBatch, ChordPolicy, chord_queue, configure
from tasks.replica.config import ReplicaConfig
from tasks.replica.replica import Replica
from tests.support.deploy import FREE_KEY, MODEL, Deployment, deployment
from tests.support.jobs import admitted_job
from tests.support.waiting import until


def _answer_ran(policy: ChordPolicy) -> None:
    """What the replica's loop does once the engine's thread ran the staged batch (the
    loop itself does not run here): answer it."""
    assert until(lambda: bool(policy.device.done) and policy.device.running is None, 5, 0.005)
    policy.finish()


MAX_BATCH = 4
MAX_WAIT_S = 3.0


@pytest.fixture(scope="module")
def kb_chord() -> Iterator[Deployment]:
    env = {
        "max_batch": str(MAX_BATCH),
        "max_wait_ms": str(MAX_WAIT_S * 1000),
        "deadline_ms": "5000",
        "deadline_margin_ms": "100",
    }
    with deployment(workers=1, collector="chord", **env) as d:
        yield d


def _members_run(kb: Deployment) -> int:
    """Header tasks whose result the backend holds (one per request a chord ran)."""
    state = redis.Redis.from_url(kb.system.redis_url)
    return len(state.keys(f"{RESULT_PREFIX}celery-task-meta-*"))


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
    name = "keybatch_dropped_before_batch_total"
    dropped = kb_chord.metric_becomes(name, before + 1, MAX_WAIT_S + 2, reason="cancelled")
    assert dropped == before + 1
    assert _members_run(kb_chord) == before_members
    assert kb_chord.post().status_code == 200  # the replica serves on
    assert _members_run(kb_chord) - before_members == 1


# -- the chord's tasks on a real Valkey, run as the worker's pool would run them --------


@pytest.fixture
def valkey() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture
def state(valkey: EmbeddedBroker) -> redis.Redis:
    return redis.Redis.from_url(valkey.url)


def test_a_cancel_that_lands_during_the_hop_is_honoured_and_each_request_answered_once(state: redis.Redis) -> None:
    """A request cancelled after its batch was taken, before its member ran: the member
    drops it, the body runs the others, and a second body (a duplicate) answers nothing."""
    clock = BrokerClock(state)
    engine = FixedLatencyEngine(max_batch=4, batch_ms=20.0)
    config = ReplicaConfig("r-chord", MODEL, CollectorConfig(max_batch=4, batch_ms=20.0))
    replica = Replica(config, engine, state, clock)
    policy = ChordPolicy(replica, replica.loop, replica.intake.hold, Celery(set_as_current=False), "unused")
    now = clock.now_ms()
    batch = [replica.intake.pending(admitted_job(state, i, now, budget_ms=5_000)) for i in range(3)]
    policy.batches["b1"] = ChordBatch(batch, now, len(batch) + 1)
    state.set(keys.cancel_key("a1"), "cancelled")  # after the take, before the members

    reasons = [policy.check(pd.id, pd.deadline_ms, "b1") for pd in batch]
    assert reasons == [None, "cancelled", None]
    assert policy.num_unpulled() == 1  # the body
    policy.run_members("b1", reasons)
    policy.run_members("b1", reasons)  # a duplicate body
    _answer_ran(policy)
    answers = [item for raw in state.lrange(keys.reply_key("gw"), 0, -1) for item in _items(raw)]
    assert sorted((a["id"], a["kind"]) for a in answers) == [("a0", "result"), ("a1", "dropped"), ("a2", "result")]
    assert {a["batch_size"] for a in answers if a["kind"] == "result"} == {2}
    assert replica.stats.dropped["cancelled"] == 1
    assert (replica.stats.num_batches, replica.stats.num_requests) == (1, 2)  # the duplicate ran nothing
    assert not replica.busy and not policy.batches


def _items(raw: bytes) -> list[dict]:
    return p.Reply.model_validate_json(raw).model_dump()["items"]


def test_a_chord_that_never_starts_runs_its_batch_without_it_once(valkey: EmbeddedBroker, state: redis.Redis) -> None:
    """Nobody pulls the chord queue: by the batch's last deadline (plus a second) the loop
    runs the batch itself, and each request is answered once."""
    settings = Settings(redis_url=valkey.url, models={MODEL: MODEL})
    app = make_celery(settings)
    configure(app, settings, "r-lost")
    clock = BrokerClock(state)
    engine = FixedLatencyEngine(max_batch=4, batch_ms=20.0)
    config = ReplicaConfig("r-lost", MODEL, CollectorConfig(max_batch=4, batch_ms=20.0))
    replica = Replica(config, engine, state, clock)
    policy = ChordPolicy(replica, replica.loop, replica.intake.hold, app, chord_queue("r-lost"))
    now = clock.now_ms()
    batch = [replica.intake.pending(admitted_job(state, i, now, budget_ms=300)) for i in range(3)]
    started = time.monotonic()
    policy.run(batch, now)
    assert 1.0 < time.monotonic() - started < 3.0
    _answer_ran(policy)
    assert state.llen(chord_queue("r-lost")) == 3  # the members, sent and never pulled
    assert policy.num_ran_without == 1 and not policy.batches
    answers = [item for raw in state.lrange(keys.reply_key("gw"), 0, -1) for item in _items(raw)]
    assert sorted((a["id"], a["kind"]) for a in answers) == [("a0", "result"), ("a1", "result"), ("a2", "result")]


def test_a_chord_whose_members_all_drop_leaves_the_replica_idle(state: redis.Redis) -> None:
    clock = BrokerClock(state)
    engine = FixedLatencyEngine(max_batch=4, batch_ms=20.0)
    replica = Replica(
        ReplicaConfig("r-empty", MODEL, CollectorConfig(max_batch=4, batch_ms=20.0)), engine, state, clock
    )
    policy = ChordPolicy(replica, replica.loop, replica.intake.hold, Celery(set_as_current=False), "unused")
    now = clock.now_ms()
    batch = [replica.intake.pending(admitted_job(state, i, now, budget_ms=5_000)) for i in range(2)]
    for i in range(2):
        state.set(keys.cancel_key(f"a{i}"), "gone")
    replica.busy = True  # as the take left it
    policy.batches["b1"] = ChordBatch(batch, now, len(batch) + 1)
    policy.run_members("b1", [policy.check(pd.id, pd.deadline_ms, "b1") for pd in batch])
    answers = [item for raw in state.lrange(keys.reply_key("gw"), 0, -1) for item in _items(raw)]
    assert sorted((a["id"], a["kind"], a["reason"]) for a in answers) == [
        ("a0", "dropped", "gone"),
        ("a1", "dropped", "gone"),
    ]
    assert replica.stats.num_batches == 0 and replica.stats.dropped["gone"] == 2
    assert not replica.busy and state.zscore(keys.idle_key(MODEL), "r-empty") is not None
