"""`keybatch bench broker`'s reading of Valkey: MONITOR's quoted lines back to the bytes
sent, calls split by script and by key, and a replay that runs what was seen."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from control.bench.broker_cost import monitor_during, replay
from control.broker import keys, lua
from control.fleet.valkey import EmbeddedBroker

ODD = b'a "quoted"\\ value\r\n\x00\xff{json: 1}'


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with EmbeddedBroker() as broker:
        yield broker.url


def test_monitor_gives_back_the_bytes_sent_and_names_each_script(url: str) -> None:
    client = redis.Redis.from_url(url)
    claim = client.register_script(lua.CLAIM_LUA)
    claim(args=["r1", 1000, "warm"])  # loaded before the sample: one EVALSHA each below

    def run() -> None:
        client.set(keys.owner_key("t:odd"), ODD)
        claim(args=["r1", 1000, "a1", "a2"])
        client.set(keys.lease_key("r1"), 1)
        client.lpush(keys.queue_key("kb-small", "paid"), "m")
        client.brpop([keys.queue_key("kb-small", "paid"), keys.queue_key("kb-small", "free")], timeout=1)

    sample, _ = monitor_during(url, run)
    assert [keys.owner_key("t:odd").encode(), ODD] in [args[1:] for args in sample.trace]
    assert sample.client_calls["CLAIM"] == 1
    assert sample.lua_by_script["CLAIM"] == 2  # one SET NX GET of each claim nobody held
    assert sample.client_kinds["SET lease"] == 1 and sample.client_kinds["BRPOP queue"] == 1
    assert [b"SET", keys.lease_key("r1").encode(), b"1"] in sample.background  # the clock's, not the request's
    replayed = replay(sample.trace, rounds=1, chunk=2)
    assert replayed["commands"] == len(sample.trace) == 4
    assert replayed["cpu_s_best"] >= 0
