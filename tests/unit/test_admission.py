"""Admission policy: how deep the queue may be for a request's budget."""

from __future__ import annotations

from control.policy.admission import (
    Capacity,
    Limits,
    Verdict,
    check,
    max_position,
    pooled_capacity,
    predict_ms,
    retry_after_s,
)

CAP = Capacity(num_replicas=2, max_batch=64, batch_ms=250.0)
LIMITS = Limits(max_queue_paid=4096, max_queue_free=2048, margin_ms=15.0)


def test_three_batch_slots_fit_the_default_budget_on_two_replicas() -> None:
    # slot k starts (k - 0.5) * 250 / 2 ms from now, then runs 250 ms
    assert max_position("free", 600.0, CAP, LIMITS) == 192
    assert predict_ms(192, CAP) <= 600.0 - 15.0
    assert predict_ms(193, CAP) > 600.0 - 15.0


def test_a_longer_budget_allows_more_rounds() -> None:
    assert max_position("paid", 1400.0, CAP, LIMITS) == 9 * 64  # floor(1135 * 2 / 250 + 0.5) slots


def test_queue_limits_cap_the_position() -> None:
    small = Limits(max_queue_paid=10, max_queue_free=5)
    assert max_position("free", 60_000.0, CAP, small) == 5
    assert max_position("paid", 60_000.0, CAP, small) == 10


def test_a_budget_below_one_batch_can_never_fit() -> None:
    assert check(200.0, CAP, LIMITS) == Verdict.TOO_SHORT
    assert check(600.0, CAP, LIMITS) == Verdict.ADMIT


def test_no_replica() -> None:
    assert check(600.0, Capacity(0, 64, 250.0), LIMITS) == Verdict.NO_REPLICA


def test_retry_after_grows_with_the_excess() -> None:
    assert retry_after_s(193, 600.0, CAP, LIMITS) == 1
    assert retry_after_s(64 * 30, 600.0, CAP, LIMITS) == 4  # 27 slots of 125 ms


def test_free_leaves_room_for_the_paid_traffic_expected_before_its_last_slot_starts() -> None:
    # 3 slots on 2 replicas: the third starts 2.5 x 125 ms from now; 100 paid/s bring 32 by then.
    assert max_position("free", 600.0, CAP, LIMITS, paid_rate_rps=100.0) == 192 - 32
    assert max_position("paid", 600.0, CAP, LIMITS, paid_rate_rps=100.0) == 192


def test_rate_meter_follows_a_steady_rate() -> None:
    from control.policy.admission import RateMeter

    meter = RateMeter(window_ms=1000.0)
    for i in range(300):  # 100 per second for 3 s
        meter.add(i * 10.0)
    assert 90.0 <= meter.rate(3000.0) <= 110.0
    assert meter.rate(10_000.0) == 0.0


def test_a_tenant_beyond_its_fair_depth_waits_behind_the_tier_and_is_capped_at_its_share() -> None:
    from control.policy.admission import Depths, TenantPolicy, decide, lane_position, tenant_limits

    limits = tenant_limits(192, CAP, TenantPolicy(share=0.5, fair_batches=1.0))
    assert (limits.fair_depth, limits.max_queued, limits.deepest_behind) == (64, 96, 192)
    depths = Depths(paid=10, paid_behind=5, free=40, free_behind=80)
    # In line: behind paid (both lists) and the free in line only, not the flood behind.
    assert lane_position("free", depths, behind=False) == 56
    assert lane_position("free", depths, behind=True) == 136
    assert lane_position("paid", depths, behind=False) == 11
    assert decide("free", 3, depths, 192, limits) == (Verdict.ADMIT, False, 56)
    assert decide("free", 64, Depths(free=40, free_behind=160), 192, limits)[0] == Verdict.TENANT_QUEUE_FULL
    assert decide("free", 64, Depths(free=40), 192, limits) == (Verdict.ADMIT, True, 41)
    assert decide("free", 96, Depths(free=40), 192, limits)[0] == Verdict.TENANT_QUEUE_FULL
    assert decide("free", 3, Depths(free=200), 192, limits)[0] == Verdict.OVERLOADED


def test_a_token_bucket_refills_at_its_rate_up_to_its_size() -> None:
    from control.policy.admission import TenantPolicy, take_token

    policy = TenantPolicy(rate_per_s=10.0, burst=5.0)
    assert take_token(0.0, 0.0, 50.0, policy) == (0.5, 50.0)  # half a token: one in 50 ms more
    assert take_token(0.0, 0.0, 10_000.0, policy) == (5.0, 0.0)  # no more than the bucket
    assert take_token(2.0, 100.0, 50.0, policy) == (2.0, 0.0)  # another clock behind: no refill
    assert take_token(0.0, 0.0, 0.0, TenantPolicy())[1] == 0.0  # no rate: no limit


def test_one_slow_replica_does_not_make_admission_refuse_what_the_others_serve() -> None:
    capacity = pooled_capacity([(64, 300.0), (64, 3_738.0)])
    assert check(600.0, capacity, LIMITS) == Verdict.ADMIT
    assert max_position("paid", 600.0, capacity, LIMITS) >= 64
    # The pooled time serves what the two serve together, each at its own rate.
    assert capacity.requests_per_s == 64_000 / 300.0 + 64_000 / 3_738.0


def test_replicas_that_agree_pool_to_their_own_figures() -> None:
    assert pooled_capacity([(64, 250.0)] * 3) == Capacity(3, 64, 250.0)
    assert pooled_capacity([]) == Capacity(0, 1, 1.0)
    assert pooled_capacity([(64, 0.0), (32, 250.0)]) == Capacity(2, 32, 250.0)  # no time yet: no say
