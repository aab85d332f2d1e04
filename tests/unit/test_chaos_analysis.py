"""What a chaos report counts of the requests a fault caught."""

from __future__ import annotations

from control.chaos.analysis import short_of_a_batch
from control.chaos.injection import Injection
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
