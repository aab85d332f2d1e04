"""The traffic counters on a real Valkey: a gateway's admissions, added in one round trip,
read back as the tier's arrival rate, and the second's hash expires."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from control.broker import keys, traffic
from control.fleet.valkey import EmbeddedBroker

MODEL = "kb-small"


@pytest.fixture
def state() -> Iterator[redis.Redis]:
    with EmbeddedBroker() as broker:
        yield redis.Redis.from_url(broker.url)


def test_a_gateways_admissions_read_back_as_its_tiers_arrival_rate(state: redis.Redis) -> None:
    seconds, _micros = state.time()
    last = (int(seconds) - 1) * 1000.0  # a whole second that read_traffic counts
    counts = {traffic.arrival_field(MODEL, "paid"): 3, traffic.arrival_field(MODEL, "free"): 7}
    traffic.record_arrivals(state, counts, last)
    traffic.record_arrivals(state, {traffic.arrival_field(MODEL, "free"): 3}, last)  # the next 100 ms
    traffic.record_arrivals(state, {}, last)  # nothing admitted: no call
    rates = {row.tier: row.arrival_rate for row in traffic.read_traffic(state, [MODEL], window_s=10)}
    assert rates == {"paid": 0.3, "free": 1.0}
    assert 0 < state.ttl(keys.traffic_key(int(last // 1000))) <= traffic.KEEP_S
