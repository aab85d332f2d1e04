"""The typed wrappers of control/broker/scripts.py on a real Valkey: each packs its named
arguments as its script reads them and unpacks the answer into its typed result."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis

from control.broker import keys, records, scripts
from control.broker.leases import release_replica
from control.broker.scripts import Admission
from control.core import protocol as p
from control.fleet.valkey import EmbeddedBroker

MODEL = "kb-small"
FAR_MS = 9e15  # a deadline that never comes
NOW_MS = 1_000.0


@pytest.fixture(scope="module")
def broker() -> Iterator[redis.Redis]:
    with EmbeddedBroker() as server:
        yield redis.Redis.from_url(server.url)


@pytest.fixture
def state(broker: redis.Redis) -> redis.Redis:
    broker.flushall()
    return broker


def _tenant(key: str, attempt: str, gateway: str, *, fair: int = 100, rate: float = 100.0) -> scripts.TenantTerms:
    return scripts.TenantTerms(
        queue_behind=keys.queue_key(MODEL, "paid", behind=True),
        deepest_behind=100,
        fair_depth=fair,
        max_queued=100,
        rate_per_s=rate,
        bucket_size=1.0 if rate else 0.0,
        stale_checks=8,
    )


def _admit(
    state: redis.Redis,
    key: str,
    attempt: str,
    gateway: str = "gw-a",
    *,
    deepest: int = 100,
    fingerprint: str = "",
    tenant: scripts.TenantTerms | None = None,
) -> scripts.AdmitAnswer:
    waiting = keys.waiting_key(MODEL, "paid")
    return scripts.Admit(state)(
        owner_key=keys.owner_key(key),
        waiting_paid=waiting,
        waiting_free=keys.waiting_key(MODEL, "free"),
        queue=keys.queue_key(MODEL, "paid"),
        session=None,
        fingerprint=fingerprint,
        ttl_ms=60_000,
        deadline_ms=FAR_MS,
        attempt=attempt,
        tier="paid",
        deepest=deepest,
        now_ms=NOW_MS,
        message=f'{{"properties":{{"priority":0,"correlation_id":"{attempt}"}}}}',
        keeps_answer=bool(fingerprint),
        gateway=gateway,
        tenant=tenant,
    )


def _result(attempt: str) -> str:
    return (
        f'{{"kind":"result","id":"{attempt}","text":"x","finish_reason":"length","prompt_tokens":1,'
        '"completion_tokens":1,"replica":"r1","backend":"fixed","batch_size":1,"batch_start_ms":0,"batch_end_ms":1}'
    )


def test_admission_admits_then_joins_a_retry_from_another_gateway(state: redis.Redis) -> None:
    first = _admit(state, "acme:r1", "a1", "gw-a")
    assert first == scripts.AdmitAnswer(Admission.ADMITTED, 0, 0, 0, 0, b"")  # free in line: counted for paid too
    assert isinstance(first.status, Admission)
    assert state.llen(keys.queue_key(MODEL, "paid")) == 1
    assert not state.exists(keys.traffic_key(int(NOW_MS // 1000)))  # the gateway counts arrivals itself
    message = state.lindex(keys.queue_key(MODEL, "paid"), 0)
    assert isinstance(message, bytes)
    owner = records.parse_owner(state.get(keys.owner_key("acme:r1")))  # type: ignore[arg-type]
    assert owner == records.Owner("gw-a", keys.waiting_key(MODEL, "paid"), "acme", "a1", "", message.decode())
    joined = _admit(state, "acme:r1", "a2", "gw-b")
    assert (joined.status, joined.extra) == (Admission.JOINED, b"a1")
    assert records.parse_owner(state.get(keys.owner_key("acme:r1"))).gateways == "gw-a,gw-b"  # type: ignore[arg-type]


def test_admission_counts_the_queue_it_found_and_refuses_past_the_deepest_position(state: redis.Redis) -> None:
    assert _admit(state, "acme:r1", "a1").status == Admission.ADMITTED
    deep = _admit(state, "acme:r2", "a2", deepest=1)
    assert (deep.status, deep.paid, deep.free) == (Admission.TOO_DEEP, 1, 0)  # free in line counts for paid too


def test_admission_counts_past_expired_entries_that_a_replica_heartbeat_trims(state: redis.Redis) -> None:
    waiting = keys.waiting_key(MODEL, "paid")
    state.zadd(waiting, {"gone-1": NOW_MS - 1, "gone-2": NOW_MS})  # deadlines passed: nobody waits for them
    answer = _admit(state, "acme:r1", "a1", deepest=1)
    assert (answer.status, answer.paid) == (Admission.ADMITTED, 0)
    assert state.zcard(waiting) == 3  # counted past, not taken out


def test_admission_answers_a_retry_from_the_stored_answer_or_refuses_another_body(state: redis.Redis) -> None:
    assert _admit(state, "acme:r1", "a1", fingerprint="f1").status == Admission.ADMITTED
    delivery = scripts.Delivery("acme:r1", "a1", 60_000, "result", _result("a1"), "gw-a")
    assert scripts.Deliver(state)("r1", [delivery]) == scripts.Delivered(1, 0)
    answered = _admit(state, "acme:r1", "a9", fingerprint="f1")
    assert (answered.status, answered.extra) == (Admission.ANSWERED, _result("a1").encode())
    assert _admit(state, "acme:r1", "a9", fingerprint="other").status == Admission.BODY_MISMATCH


def test_a_kept_answer_under_the_owner_key_is_no_owner_to_the_other_scripts(state: redis.Redis) -> None:
    assert _admit(state, "acme:r1", "a1", fingerprint="f1").status == Admission.ADMITTED
    delivery = scripts.Delivery("acme:r1", "a1", 60_000, "result", _result("a1"), "gw-a")
    assert scripts.Deliver(state)("r1", [delivery]) == scripts.Delivered(1, 0)
    kept = state.get(keys.owner_key("acme:r1"))
    assert kept == f"{records.ANSWERED}{records.pack_done('f1', _result('a1'))}".encode()
    assert 0 < state.pttl(keys.owner_key("acme:r1")) <= 60_000
    assert scripts.Cancel(state)("acme:r1", "cancelled") is False  # answered: nothing to cancel
    held = records.pack_held(FAR_MS, keys.queue_key(MODEL, "paid"), keys.waiting_key(MODEL, "paid"), "acme:r1")
    assert scripts.Record(state)("r1", [scripts.HeldEntry("a1", held)]) == 0  # not held again
    assert scripts.Deliver(state)("r1", [delivery]) == scripts.Delivered(0, 1)  # a second copy: waste
    assert state.get(keys.owner_key("acme:r1")) == kept
    assert _admit(state, "acme:r1", "a2").status == Admission.ADMITTED  # one that keeps no answer: anew


def test_admission_refuses_a_tenant_out_of_tokens_and_one_holding_its_share(state: redis.Redis) -> None:
    assert _admit(state, "acme:r1", "a1", tenant=_tenant("acme:r1", "a1", "gw-a")).status == Admission.ADMITTED
    limited = _admit(state, "acme:r2", "a2", tenant=_tenant("acme:r2", "a2", "gw-a"))
    assert limited.status == Admission.TENANT_RATE_LIMITED and float(limited.extra) > 0  # ms until a token
    terms = _tenant("zeta:r1", "z1", "gw-a", rate=0.0)._replace(max_queued=0)
    assert _admit(state, "zeta:r1", "z1", tenant=terms).status == Admission.TENANT_QUEUE_FULL


def test_admission_queues_a_tenant_past_its_fair_depth_behind_the_others(state: redis.Redis) -> None:
    terms = _tenant("acme:r1", "a1", "gw-a", fair=0, rate=0.0)
    behind = _admit(state, "acme:r1", "a1", tenant=terms)
    assert (behind.status, behind.extra) == (Admission.ADMITTED, b"1")
    assert state.lrange(keys.queue_key(MODEL, "paid", behind=True), 0, -1) == [
        b'{"properties":{"priority":3,"correlation_id":"a1"}}'
    ]
    owner = records.parse_owner(state.get(keys.owner_key("acme:r1")))  # type: ignore[arg-type]
    assert owner.waiting == keys.waiting_key(MODEL, "paid", behind=True)  # the script made it from the tier's
    assert owner.message == '{"properties":{"priority":3,"correlation_id":"a1"}}'  # as pushed


def test_cancel_takes_the_request_and_tells_its_gateway(state: redis.Redis) -> None:
    _admit(state, "acme:r1", "a1", "gw-a")
    cancel = scripts.Cancel(state)
    assert cancel("acme:r1", "cancelled", tenant="other") is False
    assert cancel("acme:r1", "cancelled", tenant="acme") is True
    assert state.get(keys.cancel_key("a1")) == b"cancelled"
    reply = json.loads(state.lpop(keys.reply_key("gw-a")))  # type: ignore[arg-type]
    assert reply == {"items": [{"kind": "cancelled", "id": "a1", "reason": "cancelled"}]}


def test_a_replica_records_claims_streams_and_delivers(state: redis.Redis) -> None:
    _admit(state, "acme:r1", "a1", "gw-a")
    held = records.pack_held(FAR_MS, keys.queue_key(MODEL, "paid"), keys.waiting_key(MODEL, "paid"), "acme:r1")
    gone = records.pack_held(FAR_MS, keys.queue_key(MODEL, "paid"), keys.waiting_key(MODEL, "paid"), "acme:gone")
    entries = [scripts.HeldEntry("a1", held), scripts.HeldEntry("gone", gone)]
    assert scripts.Record(state)("r1", entries) == 1
    assert state.hgetall(keys.held_key("r1")) == {b"a1": held.encode()}
    claim = scripts.Claim(state)
    assert claim("r1", 10_000, ["a1"]) == [True]
    state.set(keys.lease_key("r1"), "1")
    assert claim("r2", 10_000, ["a1"]) == [False]  # r1 holds it and its lease is alive
    pipe = state.pipeline(transaction=False)
    assert claim("r1", 10_000, ["a1", "a2"], pipe=pipe) is None
    assert scripts.Claim.answer(pipe.execute()[0]) == [True, True]
    chunk = '{"kind":"chunk","id":"a1","offset":0,"text":"x"}'
    assert (
        scripts.Stream(state)(
            [scripts.StreamChunk("acme:r1", "a1", chunk), scripts.StreamChunk("acme:r1", "old", chunk)]
        )
        == 1
    )
    assert state.lpop(keys.reply_key("gw-a")) == f'{{"items":[{chunk}]}}'.encode()
    pipe = state.pipeline(transaction=False)
    twice = [scripts.Delivery("acme:r1", "a1", 0, "result", _result("a1"), "gw-a")] * 2
    assert scripts.Deliver(state)("r1", twice, pipe=pipe) is None
    assert scripts.Deliver.answer(pipe.execute()[0]) == scripts.Delivered(1, 1)  # the second is waste
    assert state.hgetall(keys.held_key("r1")) == {} and state.get(keys.WASTED_KEY) == b"1"


def _hold(state: redis.Redis, replica: str, key: str, attempt: str, deadline_ms: float) -> bytes:
    """Admit, take and record a request as `replica`; the message it took."""
    _admit(state, key, attempt)
    queue, waiting = keys.queue_key(MODEL, "paid"), keys.waiting_key(MODEL, "paid")
    message = state.rpop(queue)  # the replica took it
    state.zrem(waiting, attempt)
    record = records.pack_held(deadline_ms, queue, waiting, key)
    scripts.Record(state)(replica, [scripts.HeldEntry(attempt, record)])
    state.sadd(keys.HOLDERS_KEY, replica)
    assert isinstance(message, bytes)
    return message


def test_a_sweep_requeues_what_a_replica_without_a_lease_held(state: redis.Redis) -> None:
    message = _hold(state, "r1", "acme:r1", "a1", FAR_MS)
    state.set(keys.lease_key("r1"), "1")
    assert scripts.SweepOne(state)("r1", 265) is None  # its lease is alive
    assert scripts.SweepDead(state)(265)[:4] == (0, 0, 0, 0)
    state.delete(keys.lease_key("r1"))
    assert scripts.SweepDead(state)(265)[:4] == (1, 1, 0, 1)
    assert state.lrange(keys.queue_key(MODEL, "paid"), 0, -1) == [message]  # the owner kept it
    assert state.get(keys.requeued_key("a1")) == b"1"


def test_the_sweep_names_the_keyspace_until_the_broker_loses_it(state: redis.Redis) -> None:
    first = scripts.SweepDead(state)(265).epoch
    assert first and scripts.SweepDead(state)(265, lock_ms=90).epoch == first
    state.flushall()  # what a broker restarted without its data holds
    assert scripts.SweepDead(state)(265).epoch not in ("", first)


def test_release_replica_expires_what_has_no_time_left(state: redis.Redis) -> None:
    seconds, micros = state.time()
    _hold(state, "r1", "acme:r1", "a1", seconds * 1000 + micros / 1000 + 100)  # less than a batch left
    assert release_replica(state, "r1") == (0, 1)
    assert release_replica(state, "r1") == (0, 0)  # nothing held any more


def test_rescue_pushes_back_a_request_a_dead_replica_popped_and_never_recorded(state: redis.Redis) -> None:
    _admit(state, "acme:r1", "a1")
    queue, waiting = keys.queue_key(MODEL, "paid"), keys.waiting_key(MODEL, "paid")
    message = state.rpop(queue).decode()  # type: ignore[union-attr]  # popped, then the replica died
    offer = scripts.RescueOffer("a1", "acme:r1", queue, waiting, FAR_MS, NOW_MS)
    rescue = scripts.Rescue(state)
    assert rescue.look(265, [offer]) == {"a1"}
    assert state.llen(queue) == 0  # looking pushes nothing back
    assert rescue(265, [offer]) == 1
    assert rescue.look(265, [offer]) == set()  # it is in its queue now
    assert rescue(265, [offer]) == 0
    assert state.lrange(queue, 0, -1) == [message.encode()]


def test_rescue_looks_past_a_request_still_in_its_queue_or_held(state: redis.Redis) -> None:
    """What a live replica has recorded, or has not popped yet, is no one's to push back."""
    _hold(state, "r1", "acme:r1", "a1", FAR_MS)  # popped and recorded by a live replica
    _admit(state, "acme:r2", "a2")  # not popped yet
    queue, waiting = keys.queue_key(MODEL, "paid"), keys.waiting_key(MODEL, "paid")
    pairs = (("a1", "acme:r1"), ("a2", "acme:r2"))
    offers = [scripts.RescueOffer(a, k, queue, waiting, FAR_MS, NOW_MS) for a, k in pairs]
    rescue = scripts.Rescue(state)
    assert rescue.look(265, offers) == set()
    assert rescue(265, offers) == 0
    assert state.llen(queue) == 1


def test_a_listener_token_is_its_holders_alone_and_its_lapse_is_no_death(state: redis.Redis) -> None:
    """Only the holder renews or hands on its token; a holder whose token lapsed touches
    nothing. Whether it stopped is the pulse's to say (next test), not the token's."""
    from tasks.replica.broker import ReplicaBroker

    r1, r2 = ReplicaBroker(state, "r1", lambda job: ""), ReplicaBroker(state, "r2", lambda job: "")
    assert r1.take_listener(MODEL, 60_000) and not r2.take_listener(MODEL, 60_000)
    assert r1.renew_listener(MODEL, 60_000) and not r2.renew_listener(MODEL, 60_000)
    r1.hand_on_listener(MODEL)
    assert state.llen(keys.listener_turn_key(MODEL)) == 1  # wakes one idle replica
    assert r2.take_listener(MODEL, 60_000)
    state.delete(keys.listener_key(MODEL))  # r2 stopped: its token lapsed
    assert r1.take_listener(MODEL, 60_000) and not r2.renew_listener(MODEL, 60_000)
    r2.hand_on_listener(MODEL)  # a lapsed holder's hand-on touches nothing
    assert state.get(keys.listener_key(MODEL)) == b"r1"
    assert scripts.SweepDead(state)(265)[3] == 0


def test_a_pulse_that_lapsed_counts_a_death_once_and_one_that_left_none(state: redis.Redis) -> None:
    from tasks.replica.broker import ReplicaBroker

    def deaths() -> int:
        return scripts.SweepDead(state)(265)[3]

    r1, r2 = ReplicaBroker(state, "r1", lambda job: ""), ReplicaBroker(state, "r2", lambda job: "")
    r1.pulse(60_000)
    r2.pulse(60_000)
    assert deaths() == 0  # both alive
    state.delete(keys.pulse_key("r1"))  # r1 stopped: its pulse lapsed
    assert deaths() == 1  # once
    r2.leave(MODEL)  # a replica that leaves takes its pulse with it
    assert deaths() == 1
    r1.pulse(60_000)  # back: watched again
    assert state.hgetall(keys.PULSES_KEY) == {b"r1": b"1"}


def test_a_take_fills_empty_seats_from_every_list_paid_behind_included(state: redis.Redis) -> None:
    from control.broker.envelope import TaskMessages
    from control.core.settings import Settings
    from tasks.celery.app import make_celery
    from tasks.replica.broker import ReplicaBroker

    messages = TaskMessages(make_celery(Settings(redis_url="redis://127.0.0.1:1")))

    def job(i: int, tier: str) -> p.Job:
        return p.Job(id=f"{i:032d}", key=f"t:{i}", model=MODEL, prompt="x", gateway="g", received_ms=0,
                     deadline_ms=FAR_MS, tier=tier)  # fmt: skip

    state.lpush(keys.queue_key(MODEL, "paid", behind=True), messages(job(1, "paid")))
    state.lpush(keys.queue_key(MODEL, "free"), messages(job(2, "free")))
    state.lpush(keys.queue_key(MODEL, "free", behind=True), messages(job(3, "free")))
    broker = ReplicaBroker(state, "r1", messages)
    taken = broker.take(MODEL, [], room=0, fill=2).late
    # A paid request behind other paid keys' ones ranks as paid: it takes the first seat.
    assert [j.id for j, _raw in taken] == [f"{1:032d}", f"{2:032d}"]
    taken = broker.take(MODEL, [], room=0, fill=2).late
    assert [j.id for j, _raw in taken] == [f"{3:032d}"]
    # Both paid lists share the paid seats: one seat a paid request may take from a free one
    # (room) and one a free request in line may take from a free one behind (behind).
    for i in (4, 5):
        state.lpush(keys.queue_key(MODEL, "paid"), messages(job(i, "paid")))
    for i in (6, 7):
        state.lpush(keys.queue_key(MODEL, "paid", behind=True), messages(job(i, "paid")))
    state.lpush(keys.queue_key(MODEL, "free"), messages(job(8, "free")))
    taken = broker.take(MODEL, [], room=1, behind=1, fill=0).late
    assert [j.id for j, _raw in taken] == [f"{4:032d}", f"{8:032d}"]


def test_a_locked_sweep_runs_once_a_span_and_leaves_the_registry_in_one_value(state: redis.Redis) -> None:
    from control.broker.registry import FleetView, parse_fleet_digest, read_fleet

    entry = records.pack_replica_entry(
        model=MODEL, state="serving", held=0, moving_to="", backend="fixed", max_batch=16, batch_ms=250.0,
        join_ms=0.0, buffered=0, busy=False, host="h", pid=7, seen_ms=0.0, why_not_ready="", clock_offset_ms=0.0,
        counters={"cycle_ms": 270.0}, engine={"steps": 3.0},
    )  # fmt: skip
    for name in ("r1", "r2"):
        state.hset(keys.replica_key(name), mapping=entry)
        state.sadd(keys.REPLICAS_KEY, name)
    state.set(keys.lease_key("r1"), "1")
    state.sadd(keys.REPLICAS_KEY, "gone")  # its entry expired: the sweep drops the name
    _hold(state, "r2", "acme:r2", "a2", FAR_MS)  # r2 has no lease: what it held is re-queued
    assert scripts.SweepDead(state)(265, lock_ms=10_000)[:4] == (1, 1, 0, 1)
    # Another gateway process within the lock's span sweeps nothing, though r1 lapsed now.
    state.delete(keys.lease_key("r1"))
    _hold(state, "r1", "acme:r1", "a1", FAR_MS)
    assert scripts.SweepDead(state)(265, lock_ms=10_000)[:4] == (0, 0, 0, 1)
    assert state.smembers(keys.REPLICAS_KEY) == {b"r1", b"r2"}
    digest = state.get(keys.FLEET_KEY)
    assert digest is not None
    as_swept = {rep.name: rep for rep in parse_fleet_digest(digest)}
    assert as_swept["r1"].has_lease and not as_swept["r2"].has_lease  # r1's lease was alive then
    assert as_swept["r1"].cycle_ms == 270.0 and as_swept["r1"].engine == {"steps": 3.0}
    direct = {rep.name: rep for rep in read_fleet(state)}
    assert {n: (r.model, r.max_batch, r.pid) for n, r in as_swept.items()} == {
        n: (r.model, r.max_batch, r.pid) for n, r in direct.items()
    }
    view = FleetView(state)
    view.refresh()
    assert [rep.has_lease for rep in view.replicas] == [True, False]  # read as swept, not entry by entry
    view.refresh(direct=True)
    assert [rep.has_lease for rep in view.replicas] == [False, False]
    view.refresh()  # the sweep's registry is older than that read: the view keeps the newer
    assert [rep.has_lease for rep in view.replicas] == [False, False]


def test_a_phased_view_reads_the_launch_list_and_foresees_each_ready_replicas_starts(state: redis.Redis) -> None:
    from control.broker.registry import FleetView

    entry = records.pack_replica_entry(
        model=MODEL, state="serving", held=0, moving_to="", backend="fixed", max_batch=16, batch_ms=250.0,
        join_ms=0.0, buffered=0, busy=True, host="h", pid=7, seen_ms=0.0, why_not_ready="", clock_offset_ms=0.0,
        counters={"cycle_ms": 260.0}, engine={},
    )  # fmt: skip
    for name in ("r1", "r2", "r3"):
        state.hset(keys.replica_key(name), mapping=entry)
        state.sadd(keys.REPLICAS_KEY, name)
        state.set(keys.lease_key(name), "1")
    seconds, micros = state.time()
    now = seconds * 1000 + micros / 1000
    # r1 started 100 ms ago, r2 230 ms ago; r3 is ready and has never started a batch.
    state.zadd(keys.launch_key(MODEL), {"r1": now - 100.0, "r2": now - 230.0, "gone": now - 50.0})
    plain = FleetView(state)
    plain.refresh(direct=True)
    plain.refresh_launches()  # read, but a view that does not count phases keeps none
    assert plain.capacity(MODEL).phases is None
    view = FleetView(state, phased=True)
    view.refresh(direct=True)
    view.refresh_launches()
    phases = view.capacity(MODEL).phases
    assert phases is not None
    assert phases.slot_ms == 260.0 and phases.num_idle == 1  # r3; "gone" is no ready replica
    first = sorted(phases.starts_ms)[:2]
    assert first == pytest.approx([now + 30.0, now + 160.0], abs=5.0)  # r2's next start, then r1's


def test_a_broker_at_its_memory_limit_still_answers_the_locked_sweep(state: redis.Redis) -> None:
    # The lock is a write, which a full broker refuses: the sweep must still answer (the
    # gateway's health probe), or a full broker would look like a dead one.
    limit = state.config_get("maxmemory")["maxmemory"]
    state.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            state.set("{kb}:probe", "1")
        assert scripts.SweepDead(state)(265, lock_ms=90) == scripts.SweepReport(0, 0, 0, 0, "")  # epoch unknown
    finally:
        state.config_set("maxmemory", limit)


def test_a_hedge_copies_a_running_request_once_and_the_sweep_leaves_it_to_the_copy(state: redis.Redis) -> None:
    message = _hold(state, "r1", "acme:r1", "a1", FAR_MS)
    _hold(state, "r1", "acme:r2", "a2", FAR_MS)
    assert scripts.Claim(state)("r1", 60_000, ["a1", "a2"]) == [True, True]
    state.set(keys.lease_key("r1"), "1")
    hedge = scripts.Hedge(state)
    members = [
        records.pack_running(a, "r1", "host-a", "paid", 16, f"acme:{r}") for a, r in (("a1", "r1"), ("a2", "r2"))
    ]
    state.zadd(keys.running_key(MODEL), dict.fromkeys(members, FAR_MS))  # r1 runs them, as its claim adds them
    assert state.zcard(keys.running_key(MODEL)) == 2
    scripts.Cancel(state)("acme:r2", "cancelled")
    assert hedge(MODEL, "r3", members) == [message]  # a2's client went: no copy of it
    assert state.zcard(keys.running_key(MODEL)) == 0  # one copy at most: taken out of the set
    assert state.get(keys.copy_key("a1")) == b"r3"
    assert hedge(MODEL, "r4", members) == []
    # r1 dies while r3, alive, runs the copy: r3 holds the request now, nothing is re-queued.
    state.delete(keys.lease_key("r1"))
    state.set(keys.lease_key("r3"), "1")
    assert scripts.SweepDead(state)(265)[:3] == (1, 0, 0)
    assert state.llen(keys.queue_key(MODEL, "paid")) == 0
    assert state.hkeys(keys.held_key("r3")) == [b"a1"] and state.get(keys.claim_key("a1")) == b"r3"
    # The copy answers and its record goes; a late answer of the first run is wasted, counted as such.
    copy = [scripts.Delivery("acme:r1", "a1", 0, "result", _result("a1"), "gw-a")]
    assert scripts.Deliver(state)("r3", copy, copies=True) == scripts.Delivered(1, 0)
    assert state.hgetall(keys.held_key("r3")) == {} and state.get(keys.copy_key("a1")) is None
    assert scripts.Deliver(state)("r1", copy, copies=True) == scripts.Delivered(0, 1)
    assert state.get(keys.HEDGE_WASTED_KEY) == b"1" and state.get(keys.WASTED_KEY) is None


def test_a_request_buffered_for_the_next_batch_is_copied_once_by_another_replica(state: redis.Redis) -> None:
    """Recorded held with its member, not claimed yet: another replica may copy it; its
    own may not; a copy made, or the request handed back to the queue, ends that."""
    queue, waiting = keys.queue_key(MODEL, "paid"), keys.waiting_key(MODEL, "paid")
    members, messages = [], []
    for attempt, key in (("a1", "acme:r1"), ("a2", "acme:r2")):
        _admit(state, key, attempt)
        messages.append(state.rpop(queue))
        member = records.pack_running(attempt, "r1", "host-a", "paid", 16, key)
        entry = scripts.HeldEntry(attempt, records.pack_held(FAR_MS, queue, waiting, key), member)
        assert scripts.Record(state)("r1", [entry], MODEL) == 1
        members.append(member)
    assert state.zscore(keys.running_key(MODEL), members[0]) == FAR_MS  # joined at the record, by its deadline
    state.set(keys.lease_key("r1"), "1")
    hedge = scripts.Hedge(state)
    assert hedge(MODEL, "r1", members[:1]) == []  # its own replica runs it anyway
    state.zadd(keys.running_key(MODEL), {members[0]: FAR_MS})
    state.zadd(keys.idle_key(MODEL), {"r2": FAR_MS})
    assert hedge(MODEL, "r2", members, least_idle=1) == []  # an idle replica's batch of copies waits for its start
    assert state.zcard(keys.running_key(MODEL)) == 2  # left in the set for a later look
    state.delete(keys.idle_key(MODEL))
    state.hdel(keys.held_key("r1"), "a2")  # handed back to the queue
    assert hedge(MODEL, "r2", members) == [messages[0]]
    assert state.get(keys.copy_key("a1")) == b"r2" and state.get(keys.copy_key("a2")) is None
    state.zadd(keys.running_key(MODEL), {members[0]: FAR_MS})  # r1's claim adds it again
    assert scripts.Claim(state)("r1", 60_000, ["a1"]) == [True]
    assert hedge(MODEL, "r3", members[:1]) == []  # a copy runs already: one at most


def test_an_idle_replicas_copy_takes_a_request_once_its_batch_runs_while_enough_are_idle(state: redis.Redis) -> None:
    message = _hold(state, "r1", "acme:r1", "a1", FAR_MS)
    member = records.pack_running("a1", "r1", "host-a", "paid", 16, "acme:r1")
    state.zadd(keys.running_key(MODEL), {member: FAR_MS})
    state.zadd(keys.idle_key(MODEL), {"r2": FAR_MS, "r3": FAR_MS})
    state.set(keys.lease_key("r1"), "1")
    hedge = scripts.Hedge(state)
    assert hedge(MODEL, "r2", [member], least_idle=2) == []  # buffered: not yet
    assert scripts.Claim(state)("r1", 60_000, ["a1"]) == [True]
    assert hedge(MODEL, "r2", [member], least_idle=3) == []  # two idle, three wanted
    assert state.zcard(keys.running_key(MODEL)) == 1
    assert hedge(MODEL, "r2", [member], least_idle=2) == [message]
    assert state.get(keys.copy_key("a1")) == b"r2" and state.zcard(keys.running_key(MODEL)) == 0
    assert state.zrange(keys.idle_key(MODEL), 0, -1) == [b"r3"]  # r2 left the idle list as it took the copy


def test_a_member_left_by_a_dead_replica_is_not_copied_once_its_request_is_requeued(state: redis.Redis) -> None:
    _hold(state, "r1", "acme:r1", "a1", FAR_MS)
    assert scripts.Claim(state)("r1", 60_000, ["a1"]) == [True]
    member = records.pack_running("a1", "r1", "host-a", "paid", 16, "acme:r1")
    state.zadd(keys.running_key(MODEL), {member: FAR_MS})
    assert scripts.SweepDead(state)(265)[:2] == (1, 1)  # r1 had no lease: re-queued, under the same attempt
    assert scripts.Hedge(state)(MODEL, "r2", [member]) == []  # queued, not running on r1: no copy
    assert state.get(keys.copy_key("a1")) is None


def test_a_copys_failure_reaches_no_client_unless_the_request_was_handed_to_it(state: redis.Redis) -> None:
    _admit(state, "acme:r1", "a1", "gw-a")
    _admit(state, "acme:r2", "a2", "gw-a")
    for attempt in ("a1", "a2"):
        state.set(keys.copy_key(attempt), "r3")
    held = records.pack_held(FAR_MS, keys.queue_key(MODEL, "paid"), keys.waiting_key(MODEL, "paid"), "acme:r2")
    state.hset(keys.held_key("r3"), "a2", held)  # a sweep handed a2 to r3: its copy is a2's only run
    failed = [
        scripts.Delivery(f"acme:r{i}", f"a{i}", 0, "failed", f'{{"kind":"failed","id":"a{i}"}}', "") for i in (1, 2)
    ]
    assert scripts.Deliver(state)("r3", failed, copies=True) == scripts.Delivered(1, 0)
    reply = json.loads(state.lpop(keys.reply_key("gw-a")))  # type: ignore[arg-type]
    assert [item["id"] for item in reply["items"]] == ["a2"]
    assert state.get(keys.owner_key("acme:r1")) is not None  # a1 still waits for its own run
    assert state.get(keys.copy_key("a1")) is None and state.get(keys.copy_key("a2")) is None


def test_the_running_set_sheds_what_is_past_its_deadline(state: redis.Redis) -> None:
    seconds, micros = state.time()
    now = seconds * 1000 + micros / 1000
    from tasks.replica.broker import ReplicaBroker

    old = records.pack_running("a1", "r1", "host-a", "free", 16, "acme:r1")
    state.zadd(keys.running_key(MODEL), {old: now - 1})
    assert state.zcard(keys.running_key(MODEL)) == 1
    assert scripts.Hedge(state)(MODEL, "r2", [old]) == []  # past its deadline: no copy
    ReplicaBroker(state, "r2", lambda job: "").settle(MODEL, [], [], (300.0, 1000, now), scan_from_ms=now)
    assert state.zcard(keys.running_key(MODEL)) == 0  # the next claim sheds it


def test_what_a_batch_leaves_goes_back_to_the_front_of_its_queue_and_out_of_the_held_hash(state: redis.Redis) -> None:
    from control.broker.envelope import TaskMessages
    from control.core.settings import Settings
    from tasks.celery.app import make_celery
    from tasks.replica.broker import ReplicaBroker

    messages = TaskMessages(make_celery(Settings(redis_url="redis://127.0.0.1:1")))

    def job(i: int, tier: str, deadline: float) -> p.Job:
        return p.Job(id=f"{i:032d}", key=f"t:{i}", model=MODEL, prompt="x", gateway="g", received_ms=0,
                     deadline_ms=deadline, tier=tier)  # fmt: skip

    broker = ReplicaBroker(state, "r1", messages)
    soon, later, paid = job(1, "free", FAR_MS - 2), job(2, "free", FAR_MS - 1), job(3, "paid", FAR_MS)
    newer = job(4, "free", FAR_MS)
    state.lpush(keys.queue_key(MODEL, "free"), messages(newer))  # arrived meanwhile: behind them
    state.hset(keys.held_key("r1"), mapping={j.id: "x" for j in (soon, later, paid)})
    broker.settle(MODEL, [], [], None, handed_back=[soon, later, paid])  # earliest deadline first
    assert state.hlen(keys.held_key("r1")) == 0  # a sweep of r1 must not re-queue them again
    taken = broker.take(MODEL, [], room=0, fill=4).late
    assert [j.id for j, _raw in taken] == [paid.id, soon.id, later.id, newer.id]  # paid list first


def _admit_tier(state: redis.Redis, key: str, tier: str, deadline_ms: float, deepest: int = 100) -> Admission:
    """ADMIT_BUMP's admission: batch starts every 100 ms at the worst phase, 2 seats each,
    and a request starts by its deadline (a reach of 0 ms): a deadline d ms away allows
    max(1, floor(d / 100)) * 2 positions."""
    queue = keys.queue_key(MODEL, tier)  # type: ignore[arg-type]
    return scripts.Admit(state)(
        owner_key=keys.owner_key(key),
        waiting_paid=keys.waiting_key(MODEL, "paid"),
        waiting_free=keys.waiting_key(MODEL, "free"),
        queue=queue,
        session=None,
        fingerprint="",
        ttl_ms=60_000,
        deadline_ms=deadline_ms,
        attempt=key.split(":")[1],
        tier=tier,
        deepest=deepest,
        now_ms=NOW_MS,
        message=f'{{"properties":{{"priority":0,"correlation_id":"{key}"}}}}',
        keeps_answer=False,
        gateway="gw-a",
        tenant=None,
        bump=scripts.BumpTerms(interval_ms=100.0, max_batch=2, reach_ms=0.0),
    ).status


def test_a_paid_admission_bumps_the_first_free_request_it_would_push_past_its_last_start(state: redis.Redis) -> None:
    free_set = keys.waiting_key(MODEL, "free")
    for key, after_ms in (("acme:f1", 250), ("acme:f2", 260), ("acme:f3", 450)):  # 4, 4 and 8 positions
        assert _admit_tier(state, key, "free", NOW_MS + after_ms) == Admission.ADMITTED
    # A paid request waits behind paid ones only: admitted at position 1 of 1 with 3 free waiting.
    assert _admit_tier(state, "acme:p1", "paid", NOW_MS + 600, deepest=1) == Admission.ADMITTED
    assert _admit_tier(state, "acme:p2", "paid", NOW_MS + 600) == Admission.ADMITTED  # f2 at 4 of 4
    assert state.zcard(free_set) == 3 and not state.exists(keys.cancel_key("f1"), keys.cancel_key("f2"))
    # The third would put f2 at 5 of 4: f2 leaves, not f3 (the newest, with room to spare) nor f1 (at 4 of 4).
    assert _admit_tier(state, "acme:p3", "paid", NOW_MS + 600) == Admission.ADMITTED
    assert state.get(keys.cancel_key("f2")) == b"bumped"
    assert not state.exists(keys.owner_key("acme:f2"))
    assert [m.decode() for m in state.zrange(free_set, 0, -1)] == ["f1", "f3"]
    notice = json.loads(state.lindex(keys.reply_key("gw-a"), -1))  # type: ignore[arg-type]
    assert notice["items"] == [{"kind": "cancelled", "id": "f2", "reason": "bumped"}]
    # The fourth would put f1 at 5 of 4; f3 is then at 6 of 8.
    assert _admit_tier(state, "acme:p4", "paid", NOW_MS + 600) == Admission.ADMITTED
    assert [m.decode() for m in state.zrange(free_set, 0, -1)] == ["f3"]
    assert state.get(keys.cancel_key("f1")) == b"bumped"
    # A free request's own admission bumps nothing, and counts every request ahead.
    assert _admit_tier(state, "acme:f4", "free", NOW_MS + 450, deepest=5) == Admission.TOO_DEEP
    assert state.zcard(free_set) == 1 and state.exists(keys.keyof_key("f3"))
