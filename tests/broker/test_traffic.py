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


def test_the_requests_asked_read_back_per_second_for_the_open_gate(state: redis.Redis) -> None:
    now_ms = 1_000_000_500.0  # half a second into its second
    for back, n in ((3, 40), (1, 60), (0, 25)):  # two gateways add to the same seconds
        traffic.record_arrivals(state, {traffic.asked_field(MODEL): n // 2}, now_ms - back * 1000)
        traffic.record_arrivals(state, {traffic.asked_field(MODEL): n - n // 2}, now_ms - back * 1000)
    traffic.record_arrivals(state, {traffic.asked_field("kb-other"): 9}, now_ms)
    asked = traffic.read_asked(state, [MODEL, "kb-other"], now_ms, 5)
    assert asked == {MODEL: [0, 0, 40, 0, 60, 25], "kb-other": [0, 0, 0, 0, 0, 9]}
