"""Free-slot hedging on a real Valkey, with two replicas on two hosts and no Celery: a
batch's empty slot runs a second copy of a request running on the other host, and the
first answer is the one delivered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from control.broker import keys
from control.broker.envelope import TaskMessages
from control.core import protocol as p
from control.core.clock import BrokerClock
from control.core.settings import Settings
from control.fleet.valkey import EmbeddedBroker
from tasks.celery.app import make_celery
from tasks.engine.contract import StepOutput
from tasks.engine.fixed import FixedLatencyEngine
from tasks.policy.collector import CollectorConfig
from tasks.policy.hedging import HedgeMode
from tasks.replica.config import ReplicaConfig
from tasks.replica.replica import Replica
from tests.support.deploy import MODEL
from tests.support.replies import take_items
from tests.support.waiting import until


@pytest.fixture
def state() -> Iterator[redis.Redis]:
    with EmbeddedBroker() as broker:
        yield redis.Redis.from_url(broker.url)


def _replica(
    state: redis.Redis,
    name: str,
    host: str,
    batch_ms: float,
    hedge: HedgeMode,
    hand_back: bool = True,
    hedge_idle: bool = False,
    lease_ms: float = 2000.0,
) -> Replica:
    engine = FixedLatencyEngine(max_batch=4, batch_ms=batch_ms)
    collector = CollectorConfig(max_batch=4, max_wait_ms=5.0, batch_ms=batch_ms)
    config = ReplicaConfig(
        name, MODEL, collector, lease_ms=lease_ms, host=host, hedge=hedge, hand_back=hand_back, hedge_idle=hedge_idle
    )
    return Replica(config, engine, state, BrokerClock(state))


def _admit(
    state: redis.Redis, messages: TaskMessages, i: int, tier: str, now_ms: float, budget_ms: float = 8_000
) -> p.Job:
    """As admission leaves it: an owner that keeps the queue message."""
    job = p.Job(id=f"a{i}", key=f"t:r{i}", model=MODEL, prompt=f"x{i}", gateway="gw", received_ms=now_ms,
                deadline_ms=now_ms + budget_ms, tier=tier)  # fmt: skip
    waiting = keys.waiting_key(MODEL, tier)  # type: ignore[arg-type]
    state.set(keys.owner_key(job.key), f"gw|{waiting}|t|{job.id}||{messages(job)}", px=20_000)
    return job


def _answers(state: redis.Redis, items: dict[str, list[dict]]) -> int:
    for item in take_items(state):
        items.setdefault(item["id"], []).append(item)
    time.sleep(0.01)
    return len(items)


@pytest.mark.parametrize("hedge", ["all", "off"])
def test_an_empty_slot_on_another_host_answers_a_request_whose_own_run_is_slow(
    state: redis.Redis, hedge: HedgeMode
) -> None:
    messages = TaskMessages(make_celery(Settings(redis_url="redis://127.0.0.1:1")))
    slow = _replica(state, "r-slow", "host-a", 3_000.0, hedge)  # as good as lost while the test runs
    quick = _replica(state, "r-quick", "host-b", 100.0, hedge)
    slow.start()
    quick.start()
    try:
        now = BrokerClock(state).now_ms()
        slow.submit(_admit(state, messages, 1, "free", now))
        assert until(lambda: slow.busy, 5)  # claimed, in the running set where hedging is on
        quick.submit(_admit(state, messages, 2, "free", now))
        items: dict[str, list[dict]] = {}
        if hedge == "off":
            assert until(lambda: _answers(state, items) >= 1, 5)
            assert not until(lambda: "a1" in items or _answers(state, items) > 1, 1.0)
            assert quick.stats.hedged == 0 and state.zcard(keys.running_key(MODEL)) == 0
            return
        assert until(lambda: _answers(state, items) >= 2, 5)
        assert [i["replica"] for i in items["a1"]] == ["r-quick"] and items["a1"][0]["hedged"] is True
        assert items["a2"][0]["hedged"] is False
        assert (quick.stats.hedged, quick.stats.hedge_wins, quick.stats.hedge_wasted) == (1, 1, 0)
        assert until(lambda: slow.stats.num_requests == 1, 5)  # its own run ends later: nobody waits
        assert slow.stats.wasted_slots == 1
        assert _answers(state, items) == 2 and len(items["a1"]) == 1  # answered once
        assert state.zcard(keys.running_key(MODEL)) == 0
    finally:
        quick.stop()
        slow.stop()


@pytest.mark.parametrize(
    ("idlers", "busy_elsewhere"), [(3, 0), (2, 0), (3, 6)], ids=["two-more-idle", "one-more-idle", "most-busy"]
)
def test_an_idle_replica_on_another_host_runs_a_copy_of_a_request_whose_own_run_is_slow(
    state: redis.Redis, idlers: int, busy_elsewhere: int
) -> None:
    """No batch runs that a copy could ride (low load): with HEDGE_IDLE an idle replica on
    another host runs a batch of copies, while two more of the model's replicas stay idle
    for new arrivals; with only one more idle, none does, nor where fewer than half of the
    model's replicas are idle (six more have launched batches and are not idle)."""
    messages = TaskMessages(make_celery(Settings(redis_url="redis://127.0.0.1:1")))
    slow = _replica(state, "r-slow", "host-a", 3_000.0, "all", hedge_idle=True)  # as good as lost
    # An idle replica looks at its lease's renewals: every 100 ms with a 300 ms lease.
    idle = [
        _replica(state, f"r-idle-{i}", "host-b", 100.0, "all", hedge_idle=True, lease_ms=300.0) for i in range(idlers)
    ]
    for replica in (slow, *idle):
        replica.start()
    try:
        assert until(lambda: state.zcard(keys.idle_key(MODEL)) == 1 + idlers, 5)
        if busy_elsewhere:
            state.zadd(keys.launch_key(MODEL), {f"r-busy-{i}": 1.0 for i in range(busy_elsewhere)})
        slow.submit(_admit(state, messages, 1, "paid", BrokerClock(state).now_ms()))
        assert until(lambda: slow.busy, 5)
        items: dict[str, list[dict]] = {}
        if idlers < 3 or busy_elsewhere:
            assert not until(lambda: sum(r.stats.hedged for r in idle) > 0, 1.0)  # ten looks, no copy
            return
        assert until(lambda: _answers(state, items) >= 1, 5)
        assert items["a1"][0]["hedged"] is True and items["a1"][0]["replica"].startswith("r-idle-")
        assert sum(r.stats.idle_copy_batches for r in idle) == 1 and sum(r.stats.hedge_wins for r in idle) == 1
    finally:
        for replica in (*idle, slow):
            replica.stop()


def test_with_a_quarter_of_the_pool_idle_an_idle_replica_gathers_paid_copies_until_one_must_start(
    state: redis.Redis,
) -> None:
    """Three of ten replicas idle (six more have launched batches): fewer than half, so
    HEDGE_IDLE copies paid requests only, gathered into a batch until one of them must
    start (`hedging.copies_due`). A paid and a free request run on a slow replica (3 s
    batches) with a 3.2 s budget: the looks leave the paid one's copy to gather until its
    last start (3.2 s less the margin and a batch) is within two looks, then run it; the
    free one is not copied."""
    messages = TaskMessages(make_celery(Settings(redis_url="redis://127.0.0.1:1")))
    slow = _replica(state, "r-slow", "host-a", 3_000.0, "all", hedge_idle=True)
    idle = [_replica(state, f"r-idle-{i}", "host-b", 100.0, "all", hedge_idle=True, lease_ms=300.0) for i in range(3)]
    for replica in (slow, *idle):
        replica.start()
    try:
        assert until(lambda: state.zcard(keys.idle_key(MODEL)) == 4, 5)
        state.zadd(keys.launch_key(MODEL), {f"r-busy-{i}": 1.0 for i in range(6)})
        now = BrokerClock(state).now_ms()
        slow.submit(_admit(state, messages, 1, "paid", now, budget_ms=3_200))
        slow.submit(_admit(state, messages, 2, "free", now, budget_ms=3_200))
        assert until(lambda: slow.busy, 5)

        def copied() -> int:
            return sum(r.stats.idle_copy_batches for r in idle)

        # Its last start is 3,085 ms in; looks (every 100 ms, a third of the lease) find it
        # due from 2,885 ms, two looks before.
        assert not until(lambda: copied() > 0, (now + 2_700 - BrokerClock(state).now_ms()) / 1000)
        assert until(lambda: copied() == 1, 2)
        started_ms = BrokerClock(state).now_ms() - now
        assert 2_700 <= started_ms <= 3_200, started_ms
        assert sum(r.stats.hedged for r in idle) == 1  # the paid one only
        items: dict[str, list[dict]] = {}
        assert until(lambda: _answers(state, items) >= 2, 5)
        assert items["a2"][0]["hedged"] is False and len(items["a1"]) == 1
    finally:
        for replica in (*idle, slow):
            replica.stop()


@contextmanager
def _one_buffered(
    state: redis.Redis, slow_ms: float, other: str, other_ms: float, budget_ms: float = 8_000
) -> Iterator[tuple[Replica, Replica, TaskMessages, float]]:
    """Replica r-slow on host-a runs request a1 and holds a2 (paid, `budget_ms`) buffered for
    its next batch, recorded and in the running set; replica `other` on host-b is idle."""
    messages = TaskMessages(make_celery(Settings(redis_url="redis://127.0.0.1:1")))
    # It keeps what it takes while busy, as a pull in its lead does.
    slow = _replica(state, "r-slow", "host-a", slow_ms, "all", hand_back=False)
    idle = _replica(state, other, "host-b", other_ms, "all")
    slow.start()
    idle.start()
    try:
        now = BrokerClock(state).now_ms()
        slow.submit(_admit(state, messages, 1, "free", now))
        assert until(lambda: slow.busy, 5)
        slow.submit(_admit(state, messages, 2, "paid", now, budget_ms=budget_ms))  # waits for the next batch
        assert until(lambda: state.zcard(keys.running_key(MODEL)) == 2, 5)  # recorded: a member too
        yield slow, idle, messages, now
    finally:
        idle.stop()
        slow.stop()


def test_a_request_buffered_behind_a_slow_batch_answers_from_another_hosts_empty_slot(state: redis.Redis) -> None:
    with _one_buffered(state, 3_000.0, "r-quick", 100.0) as (_slow, quick, messages, now):
        quick.submit(_admit(state, messages, 3, "free", now))
        items: dict[str, list[dict]] = {}
        assert until(lambda: _answers(state, items) >= 3, 5)
        assert [i["replica"] for i in items["a2"]] == ["r-quick"] and items["a2"][0]["hedged"] is True
        assert quick.stats.hedged == 2  # the running one and the buffered one


def test_a_buffered_request_its_replica_can_no_longer_run_in_time_is_left_to_its_copy(state: redis.Redis) -> None:
    """Buffered behind a 1.5 s batch with 2.6 s of budget, a request cannot finish the slow
    replica's next batch, but its copy, started at once in a 2 s batch on another host, can:
    the slow replica lets it go with no notice, and the copy answers it."""
    with _one_buffered(state, 1_500.0, "r-copier", 2_000.0, budget_ms=2_600) as (slow, copier, messages, now):
        copier.submit(_admit(state, messages, 3, "free", now))
        assert until(lambda: copier.stats.hedged == 2, 5)
        items: dict[str, list[dict]] = {}
        assert until(lambda: _answers(state, items) >= 3, 8)
        assert [(i["kind"], i["replica"]) for i in items["a2"]] == [("result", "r-copier")]
        assert slow.stats.dropped["to_copy"] == 1 and slow.stats.dropped["expired"] == 0
        assert state.zcard(keys.running_key(MODEL)) == 0  # what left the slow buffer left the set too
        assert state.hget(keys.held_key("r-slow"), "a2") is None


class PoisonEngine(FixedLatencyEngine):
    """Raises for a whole batch that holds a prompt with POISON in it (as a forward pass would)."""

    def step(self) -> list[StepOutput]:
        if any("POISON" in r.job.prompt for r in self.running.values()):
            raise RuntimeError("shape mismatch")
        return super().step()


def test_a_copy_that_fails_leaves_its_request_to_its_own_run(state: redis.Redis) -> None:
    messages = TaskMessages(make_celery(Settings(redis_url="redis://127.0.0.1:1")))
    slow = _replica(state, "r-slow", "host-a", 1_500.0, "all")
    collector = CollectorConfig(max_batch=4, max_wait_ms=5.0, batch_ms=100.0)
    config = ReplicaConfig("r-quick", MODEL, collector, lease_ms=2000.0, host="host-b", hedge="all")
    quick = Replica(config, PoisonEngine(max_batch=4, batch_ms=100.0), state, BrokerClock(state))
    slow.start()
    quick.start()
    try:
        now = BrokerClock(state).now_ms()
        poison = _admit(state, messages, 1, "free", now)
        poison.prompt = "POISON"  # only the quick replica's engine fails on it
        state.set(keys.owner_key(poison.key), f"gw|{keys.waiting_key(MODEL, 'free')}|t|a1||{messages(poison)}")
        slow.submit(poison)
        assert until(lambda: slow.busy, 5)
        quick.submit(_admit(state, messages, 2, "free", now))
        items: dict[str, list[dict]] = {}
        assert until(lambda: _answers(state, items) >= 2, 8)
        assert [(i["kind"], i["replica"]) for i in items["a1"]] == [("result", "r-slow")]
        assert items["a2"][0]["kind"] == "result"
        assert quick.stats.hedged == 1 and quick.stats.hedge_wins == 0
        assert state.get(keys.copy_key("a1")) is None  # the copy's record went with it
    finally:
        quick.stop()
        slow.stop()
