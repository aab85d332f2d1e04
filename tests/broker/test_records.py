"""Each record that crosses processes: its Python pack and parse agree, and the Lua that
reads (or writes) it inside the broker reads what Python wrote (and the other way)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from control.broker import records
from control.broker.lua import LUA_LIB
from control.core.lifecycle import ReplicaState
from control.fleet.valkey import EmbeddedBroker

OWNER = records.Owner("gw-a,gw-b", "{kb}:waiting:kb-small:free", "acme", "att-1", "f00d", '{"a":"b|c"}')
HELD = records.Held(1_700_000_000_123.0, "{kb}.kb-small:6", "{kb}:waiting:kb-small:free:behind", "acme:r1")


@pytest.fixture(scope="module")
def state() -> Iterator[redis.Redis]:
    with EmbeddedBroker() as broker:
        yield redis.Redis.from_url(broker.url)


def _lua(state: redis.Redis, body: str, *args: object) -> list:
    return state.eval(LUA_LIB + body, 0, *args)  # type: ignore[no-any-return]


def test_an_owner_record_round_trips() -> None:
    assert records.parse_owner(records.pack_owner(*OWNER)) == OWNER
    assert records.parse_owner(records.pack_owner(*OWNER).encode()) == OWNER


def test_an_owner_record_without_a_fingerprint_field_parses_as_one_without_a_fingerprint() -> None:
    assert records.parse_owner("gw|w|t|att") == records.Owner("gw", "w", "t", "att", "")


def test_the_gateway_packs_an_owner_without_the_message_and_lua_reads_it_so(state: redis.Redis) -> None:
    head = records.pack_owner(*OWNER[:5])  # the admission script adds the message
    assert records.parse_owner(head) == OWNER._replace(message="")
    assert records.parse_owner(f"{head}|{OWNER.message}") == OWNER
    parts = _lua(state, "return {owner_parts(ARGV[1])}", head)
    assert records.Owner(*(p.decode() for p in parts)) == OWNER._replace(message="")


def test_lua_reads_the_owner_python_packs_and_packs_what_python_reads(state: redis.Redis) -> None:
    parts = _lua(state, "return {owner_parts(ARGV[1])}", records.pack_owner(*OWNER))
    assert records.Owner(*(p.decode() for p in parts)) == OWNER
    packed = _lua(state, "return pack_owner(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])", *OWNER)
    assert records.parse_owner(packed) == OWNER


def test_a_done_record_round_trips_with_or_without_a_fingerprint(state: redis.Redis) -> None:
    done = records.Done("f00d", '{"kind":"result","text":"a|b"}')
    assert records.parse_done(records.pack_done(*done)) == done
    assert records.parse_done('{"kind":"result"}') == records.Done("", '{"kind":"result"}')  # from before fingerprints
    parts = _lua(state, "return {done_parts(ARGV[1])}", records.pack_done(*done))
    assert records.Done(*(p.decode() for p in parts)) == done
    assert records.parse_done(_lua(state, "return pack_done(ARGV[1], ARGV[2])", *done)) == done


def test_a_held_record_round_trips_and_lua_reads_it(state: redis.Redis) -> None:
    packed = records.pack_held(*HELD[:4])
    assert records.parse_held(packed) == HELD
    deadline, *rest = _lua(state, "return {held_parts(ARGV[1])}", packed)
    assert records.Held(float(deadline), *(p.decode() for p in rest)) == HELD


def test_a_held_record_written_with_its_message_still_reads(state: redis.Redis) -> None:
    old = f'{records.pack_held(*HELD[:4])}|{{"a":"b|c"}}'  # as a replica wrote it before the owner kept it
    assert records.parse_held(old) == HELD._replace(message='{"a":"b|c"}')
    deadline, *rest = _lua(state, "return {held_parts(ARGV[1])}", old)
    assert records.Held(float(deadline), *(p.decode() for p in rest)) == HELD._replace(message='{"a":"b|c"}')


def test_a_registry_entry_reads_back_as_the_replica_wrote_it(state: redis.Redis) -> None:
    entry = records.pack_replica_entry(
        model="kb-small",
        state=ReplicaState.SERVING.label,
        held=3,
        moving_to="",
        backend="fixed",
        max_batch=16,
        batch_ms=120.5,
        join_ms=12.5,
        buffered=2,
        busy=True,
        host="h1",
        pid=4242,
        seen_ms=1_000.0,
        why_not_ready="",
        clock_offset_ms=-1.5,
        counters={"num_batches": 7, "num_requests": 40, "last_batch_size": 8, "dropped_expired": 2, "utilization": 0.5},
        engine={"steps": 12.0},
    )
    state.delete("entry")
    state.hset("entry", mapping=entry)  # type: ignore[arg-type]
    info = records.parse_replica_entry("r1", state.hgetall("entry"), has_lease=True, now_ms=1_250.0)  # type: ignore[arg-type]
    assert (info.name, info.model, info.state, info.backend, info.host, info.pid) == (
        "r1", "kb-small", ReplicaState.SERVING, "fixed", "h1", 4242,
    )  # fmt: skip
    assert (info.max_batch, info.batch_ms, info.join_ms, info.buffered, info.busy) == (16, 120.5, 12.5, 2, True)
    assert info.num_held == 3
    assert (info.num_batches, info.num_requests, info.last_batch_size, info.utilization) == (7, 40, 8, 0.5)
    assert info.dropped == {"cancelled": 0, "superseded": 0, "expired": 2, "gone": 0}
    assert (info.engine, info.clock_offset_ms, info.heartbeat_age_ms) == ({"steps": 12.0}, -1.5, 250.0)
    assert info.is_ready
