"""What a chaos report counts of the requests a fault caught."""

from __future__ import annotations

import random

from control.chaos.analysis import analyze, short_of_a_batch
from control.chaos.injection import Injection, Run
from control.chaos.spec import ChaosSpec
from control.load.spec import Record


def test_a_request_in_flight_with_less_than_a_batch_of_budget_left_at_the_fault_is_short() -> None:
    fault = Injection(at_s=10.0, action="SIGKILL")
    records = [
        Record(sent_s=9.5, tier="free", status=504, latency_ms=600.0, answered_s=10.1),  # 100 ms left
        Record(sent_s=9.8, tier="free", status=200, latency_ms=450.0, answered_s=10.25),  # 400 ms left
        Record(sent_s=9.0, tier="free", status=200, latency_ms=300.0, answered_s=9.3),  # answered before
        Record(sent_s=10.2, tier="paid", status=200, latency_ms=300.0, answered_s=10.5),  # sent after
    ]
    assert short_of_a_batch(records, [fault], budget_ms=600.0, batch_ms=250.0) == {0}
    assert short_of_a_batch(records, [fault], budget_ms=600.0, batch_ms=400.0) == {0, 1}


def test_the_peer_regions_own_clients_are_counted_apart_and_judged_as_strictly() -> None:
    spec = ChaosSpec("host-loss", replicas=4, replicas_per_host=2, duration_s=2.0, fault_at_s=1.0, peer_load=0.5)
    run = Run(spec, [], origin=0.0, batch_ms=250.0, rng=random.Random(1), injections=[Injection(1.0, "SIGSTOP")])
    ours = [Record(sent_s=0.1, tier="free", status=200, latency_ms=300.0, answered_s=0.4, id="a-1", answer_id="a-1")]
    peer = [
        Record(sent_s=0.2, tier="paid", status=200, latency_ms=300.0, answered_s=0.5, id="b-1", answer_id="b-1"),
        Record(sent_s=0.3, tier="free", status=0, latency_ms=5600.0, answered_s=5.9, id="b-2", error="TimeoutError"),
    ]
    report = analyze(spec, ours, run, None, peer)
    rest, peer_group = report["rest"], report["peer"]
    assert isinstance(rest, dict) and isinstance(peer_group, dict)
    assert report["sent"] == 1 and rest["sent"] == 1  # the peer's clients are not ours
    assert peer_group["sent"] == 2 and peer_group["lost"] == 1
    assert report["failed"] == ["1 requests lost"] and not report["ok"]
    assert analyze(spec, ours, run, None, peer[:1])["ok"]
    assert analyze(spec, ours, run, None)["peer"] is None
