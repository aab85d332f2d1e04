"""The broker scripts on a real Valkey: what a give-up may cancel, when a retry joins,
and which held records a replica writes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from control.broker import keys, lua
from control.broker.lua import ADMIT_LUA, CANCEL_LUA
from control.fleet.valkey import EmbeddedBroker
from tests.support.deploy import MODEL

WAITING = keys.waiting_key(MODEL, "free")


@pytest.fixture(scope="module")
def state() -> Iterator[redis.Redis]:
    with EmbeddedBroker() as broker:
        yield redis.Redis.from_url(broker.url)


def _admit(state: redis.Redis, key: str, attempt: str, gateway: str) -> list:
    names = [keys.owner_key(key), keys.waiting_key(MODEL, "paid"), WAITING, keys.queue_key(MODEL, "free")]
    args = ["", 60_000, 9e15, attempt, "free", 100, 0, "MESSAGE", "", gateway]
    return state.register_script(ADMIT_LUA)(keys=names, args=args)  # type: ignore[no-any-return]


def test_a_gateway_giving_up_cannot_cancel_what_a_retry_elsewhere_took_over(state: redis.Redis) -> None:
    cancel = state.register_script(CANCEL_LUA)
    assert _admit(state, "t:give-up", "a1", "gw-a")[0] == 1
    status, *_counts, joined = _admit(state, "t:give-up", "a2", "gw-b")  # the retry, on another gateway
    assert (status, joined) == (3, b"a1")
    # gw-a's client hung up while the retry waits on gw-b: gw-a only stops waiting (the
    # owner keeps gw-b, with the empty fingerprint of a request without a client's id, and
    # the message admission pushed).
    assert cancel(args=["t:give-up", "gone", "", "a1", "gw-a"]) == 0
    assert state.get(keys.owner_key("t:give-up")) == f"gw-b|{WAITING}|t|a1||MESSAGE".encode()
    assert cancel(args=["t:give-up", "gone", "", "a1", "gw-b"]) == 1


def test_a_retry_after_the_deadline_does_not_join_the_dead_attempt(state: redis.Redis) -> None:
    state.set(keys.owner_key("t:stale"), f"gw-a|{WAITING}|t|old", px=1_000)  # past its deadline (slack 5 s)
    status, *_rest, extra = _admit(state, "t:stale", "new", "gw-b")
    assert (status, extra) == (1, b"")  # admitted as a new attempt
    assert state.get(keys.cancel_key("old")) == b"expired"  # a replica holding the old one drops it


def test_a_replica_records_only_requests_still_in_flight(state: redis.Redis) -> None:
    state.set(keys.owner_key("t:live"), f"gw|{WAITING}|t|a-live", px=10_000)
    record = state.register_script(lua.RECORD_LUA)
    live, done = "1|q|w|t:live", "1|q|w|t:done"  # held records name the request's key
    n = record(args=["rep", "", "a-live", live, "", "a-done", done, ""])  # no model: no members
    assert n == 1
    assert state.hgetall(keys.held_key("rep")) == {b"a-live": live.encode()}
