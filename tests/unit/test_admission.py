"""Admission policy: how deep the queue may be for a request's budget."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from control.core.vocab import FREE, PAID, Tier
from control.policy import admission
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


def test_two_batch_slots_fit_the_default_budget_on_two_replicas() -> None:
    # A slot starts every 125 ms, the next at most 125 ms away: slot k starts by k x 125 ms
    # and must start by 600 - 15 - 250 = 335 ms, so two slots (the third may start at 375).
    assert max_position("paid", 600.0, CAP, LIMITS) == 128
    assert predict_ms(128, CAP) <= 600.0 - 15.0
    assert predict_ms(129, CAP) > 600.0 - 15.0


def test_the_measured_cycle_paces_the_slots() -> None:
    # 272 ms a slot on two replicas: one every 136 ms, the last by 600 - 15 - 272 = 313 ms.
    measured = Capacity(2, 64, 250.0, cycle_ms=272.0)
    assert measured.slot_ms == 272.0 and measured.interval_ms == 136.0
    assert max_position("paid", 600.0, measured, LIMITS) == 128
    assert max_position("paid", 680.0, CAP, LIMITS) == 192  # by 415 ms: three slots of 125
    assert max_position("paid", 680.0, measured, LIMITS) == 128  # by 393 ms: three of 136 do not fit
    assert measured.requests_per_s == 128_000 / 272.0
    assert predict_ms(1, measured) == 136.0 + 272.0


def test_a_longer_budget_allows_more_rounds() -> None:
    assert max_position("paid", 1400.0, CAP, LIMITS) == 9 * 64  # floor(1135 / 125) slots


def test_queue_limits_cap_the_position() -> None:
    small = Limits(max_queue_paid=10, max_queue_free=5)
    assert max_position("free", 60_000.0, CAP, small) == 5
    assert max_position("paid", 60_000.0, CAP, small) == 10


def test_a_budget_below_one_batch_can_never_fit() -> None:
    assert check(200.0, CAP, LIMITS) == Verdict.TOO_SHORT
    assert check(600.0, CAP, LIMITS) == Verdict.ADMIT


def test_a_budget_of_one_batch_is_admitted_to_one_slot_whatever_the_cycle() -> None:
    slow = Capacity(2, 64, 250.0, cycle_ms=500.0)
    assert check(300.0, slow, LIMITS) == Verdict.ADMIT  # the engine's batch decides, not the cycle
    assert max_position("paid", 300.0, slow, LIMITS) == 64


def test_no_replica() -> None:
    assert check(600.0, Capacity(0, 64, 250.0), LIMITS) == Verdict.NO_REPLICA


def test_retry_after_grows_with_the_excess() -> None:
    assert retry_after_s(129, 600.0, CAP, LIMITS) == 1
    assert retry_after_s(64 * 30, 600.0, CAP, LIMITS) == 4  # 28 slots of 125 ms


def test_free_leaves_room_for_the_paid_traffic_expected_before_its_last_slot_starts() -> None:
    # 2 slots: the second starts 1.5 x 125 ms from now at the mean phase; 100 paid/s bring
    # 18.75 by then, and one standard deviation more (4.3): room for 24.
    assert max_position("free", 600.0, CAP, LIMITS, paid_rate_rps=100.0) == 128 - 24
    assert max_position("paid", 600.0, CAP, LIMITS, paid_rate_rps=100.0) == 128
    # Paid traffic that fills every slot still leaves a free request the empty queue.
    assert max_position("free", 600.0, CAP, LIMITS, paid_rate_rps=1000.0) == 1


def test_rate_meter_follows_a_steady_rate() -> None:
    from control.policy.admission import RateMeter

    meter = RateMeter(window_ms=1000.0)
    for i in range(300):  # 100 per second for 3 s
        meter.add(i * 10.0)
    assert 90.0 <= meter.rate(3000.0) <= 110.0
    assert meter.rate(10_000.0) == 0.0


def test_rate_meter_follows_a_ramp_from_idle_at_once_and_a_fall_over_its_window() -> None:
    from control.policy.admission import RateMeter

    meter = RateMeter(window_ms=1000.0)
    meter.rate(0.0)  # idle until now
    for i in range(15):  # 100 per second from idle: 15 in the first 150 ms
        meter.add(i * 10.0)
    assert meter.rate(150.0) >= 90.0  # the blend with the idle window alone read 15
    for i in range(100):  # a second at 100 per second, then silence
        meter.add(1000.0 + i * 10.0)
    assert meter.rate(2200.0) >= 75.0  # falls over the window, not at once


def test_a_tenant_beyond_its_fair_depth_waits_behind_the_tier_and_is_capped_at_its_share() -> None:
    from control.policy.admission import Depths, TenantPolicy, decide, lane_position, tenant_limits

    limits = tenant_limits(192, CAP, TenantPolicy(share=0.5, fair_batches=1.0))
    assert (limits.fair_depth, limits.max_queued, limits.deepest_behind) == (64, 96, 192)
    depths = Depths(paid=10, paid_behind=5, free=40, free_behind=80)
    # In line: behind paid (both lists) and the free in line only, not the flood behind; a paid
    # request behind everything in line (the replicas run it first where no deadline suffers).
    assert lane_position("free", depths, behind=False) == 56
    assert lane_position("free", depths, behind=True) == 136
    assert lane_position("paid", depths, behind=False) == 51  # every request in line counts
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
    capacity = pooled_capacity([(64, 300.0, 0.0), (64, 3_738.0, 0.0)])
    assert check(600.0, capacity, LIMITS) == Verdict.ADMIT
    assert max_position("paid", 600.0, capacity, LIMITS) >= 64
    # The pooled time serves what the two serve together, each at its own rate.
    assert capacity.requests_per_s == 64_000 / 300.0 + 64_000 / 3_738.0


def test_replicas_that_agree_pool_to_their_own_figures() -> None:
    assert pooled_capacity([(64, 250.0, 0.0)] * 3) == Capacity(3, 64, 250.0)
    assert pooled_capacity([(64, 250.0, 272.0)] * 3) == Capacity(3, 64, 250.0, 272.0)
    assert pooled_capacity([]) == Capacity(0, 1, 1.0)
    assert pooled_capacity([(64, 0.0, 0.0), (32, 250.0, 0.0)]) == Capacity(2, 32, 250.0)  # no time yet: no say


def test_a_first_cold_cycle_slows_admission_by_at_most_twice_and_still_admits_a_slot() -> None:
    # A fresh replica's cycle is the median of one sample: its first, cold batch.
    cold = pooled_capacity([(64, 250.0, 3_738.0), (64, 250.0, 3_738.0)])
    assert cold.slot_ms == 500.0  # two engine batches at most
    assert check(600.0, cold, LIMITS) == Verdict.ADMIT
    assert max_position("paid", 600.0, cold, LIMITS) == 64  # a slot's worth runs, and is measured
    # One replica cold, one warm: the warm one's pace counts for its share.
    mixed = pooled_capacity([(64, 250.0, 3_738.0), (64, 250.0, 260.0)])
    assert mixed.slot_ms == 2 / (1 / 500.0 + 1 / 260.0)
    # A cycle below the engine's batch is a sample of too little work: the batch holds.
    assert pooled_capacity([(64, 250.0, 100.0)]).slot_ms == 250.0


def test_a_lone_key_may_hold_a_batch_of_a_short_queue() -> None:
    from control.policy.admission import TenantPolicy, tenant_limits

    assert tenant_limits(20, CAP, TenantPolicy(share=0.5)).max_queued == 64
    assert tenant_limits(400, CAP, TenantPolicy(share=0.5)).max_queued == 200


def test_continuous_replicas_admit_the_seats_that_free_by_the_latest_join_less_two_steps() -> None:
    # Two replicas of 32, 250 ms a request in steps of 50: 256 seats free a second. A 600 ms
    # budget joins by 600 - 15 - 250 - 50 = 285 ms; the seats that free by two steps less: 47.
    continuous = Capacity(2, 32, 250.0, 250.0, join_ms=50.0)
    assert max_position("paid", 600.0, continuous, LIMITS) == 47
    assert max_position("paid", 600.0, Capacity(2, 32, 250.0, 250.0), LIMITS) == 64  # static: two slots


def test_a_key_alone_in_its_tier_may_fill_a_short_queue_in_line() -> None:
    from control.policy.admission import TenantPolicy, tenant_limits

    policy = TenantPolicy(share=0.5)
    # 2 x 64 at a 600 ms budget: 128 positions, a share of 64. Alone in its tier, a key's
    # request that starts within 335 ms may take them all, in line.
    alone = tenant_limits(128, CAP, policy, alone=True, horizon_ms=335.0)
    assert (alone.fair_depth, alone.max_queued) == (128, 128)
    shared = tenant_limits(128, CAP, policy, alone=False, horizon_ms=335.0)  # another key asked lately
    assert (shared.fair_depth, shared.max_queued) == (64, 64)
    # A long wait: keys not seen yet may come before it starts; the share holds.
    assert tenant_limits(400, CAP, policy, alone=True, horizon_ms=3700.0).max_queued == 200
    assert tenant_limits(128, CAP, policy).max_queued == 64  # not known to be alone: the share


def test_a_key_is_alone_until_another_key_of_its_tier_asks_and_for_a_while_after() -> None:
    from control.policy.admission import LONE_MEMORY_MS, LastOtherKey

    seen = LastOtherKey()
    assert seen.alone("m", "free", "a", 0.0)  # nobody asked yet
    for i in range(100):
        seen.add("m", "free", "a", i * 10.0)
    assert seen.alone("m", "free", "a", 1000.0)
    seen.add("m", "free", "b", 1000.0)  # another key asks once (refused, say)
    seen.add("m", "paid", "c", 1000.0)  # another tier does not count
    for i in range(100):
        seen.add("m", "free", "a", 1000.0 + i * 10.0)
    assert not seen.alone("m", "free", "a", 2000.0)
    assert not seen.alone("m", "free", "a", 1000.0 + LONE_MEMORY_MS)  # remembered for a while
    assert seen.alone("m", "free", "a", 1001.0 + LONE_MEMORY_MS)
    assert not seen.alone("m", "free", "b", 2000.0)  # a asked lately: b is not alone
    assert seen.alone("m", "paid", "c", 2000.0) and seen.alone("other-model", "free", "a", 2000.0)


@pytest.mark.parametrize("tier", [PAID, FREE])
def test_a_position_in_line_is_the_lane_position_without_the_lists_behind(tier: Tier) -> None:
    for paid, free in [(0, 0), (3, 0), (0, 5), (7, 11)]:
        lane = admission.lane_position(tier, admission.Depths(paid=paid, free=free), behind=False)
        assert admission.position(tier, paid, free) == lane


def test_with_bumps_a_free_request_keeps_no_room_for_paid_ones_and_a_paid_one_counts_paid_ones_only() -> None:
    rate = 200.0  # paid requests a second: a reserve of many positions without bumps
    kept = max_position(FREE, 600.0, CAP, LIMITS, rate)
    assert kept < max_position(FREE, 600.0, CAP, LIMITS, rate, bump=True) == max_position(PAID, 600.0, CAP, LIMITS)
    depths = admission.Depths(paid=3, free=40)
    assert admission.lane_position(PAID, depths, behind=False, bump=True) == 4
    assert admission.lane_position(PAID, depths, behind=False) == 44
    assert admission.lane_position(FREE, depths, behind=False, bump=True) == 44
    continuous = replace(CAP, join_ms=25.0)  # seats free at every step: no bumps, the reserve stays
    assert max_position(FREE, 600.0, continuous, LIMITS, rate, bump=True) == max_position(
        FREE, 600.0, continuous, LIMITS, rate
    )


# -- the replicas' phases (ADMIT_PHASED) ------------------------------------------------------


def _phased(launches: list[float], now: float = 1000.0) -> Capacity:
    return replace(CAP, phases=admission.phases_of(launches, now, 250.0, 2000.0))


def test_phases_project_each_replicas_starts_a_slot_apart_and_call_a_silent_one_idle() -> None:
    phases = admission.phases_of([900.0, 500.0, -math.inf], 1000.0, 250.0, 600.0)
    assert phases.starts_ms == (1150.0, 1400.0)  # from 900, up to 1600; 500 is 2 slots ago
    assert phases.num_idle == 2
    assert admission.phased_starts(phases, 1000.0, 1400.0) == (2 + 2 * 1, 1400.0)  # an idle one: a slot on
    assert admission.phased_starts(phases, 1000.0, 1700.0) is None  # past what they foresee


def test_a_start_due_when_the_launches_were_read_still_counts_for_a_moment_its_replica_is_late() -> None:
    read_late = admission.phases_of([760.0], 1015.0, 250.0, 1000.0)  # due at 1010, 1260, ...
    assert admission.phased_starts(read_late, 1020.0, 1300.0) == (2, 1260.0)
    assert admission.phased_starts(read_late, 1010.0 + admission.LATE_MS, 1300.0) == (1, 1260.0)
    assert admission.phased_starts(read_late, 1020.0, 1015.0) == (1, 1010.0)  # only the late one fits
    read_before = admission.phases_of([760.0], 1000.0, 250.0, 1000.0)  # 1010 may have launched since
    assert admission.phased_starts(read_before, 1020.0, 1300.0) == (1, 1260.0)
    assert admission.phased_starts(read_before, 1040.0, 1000.0) == (0, 1040.0)  # no window: no start


def test_below_capacity_a_request_just_before_a_start_is_admitted_for_the_third_start() -> None:
    # Two replicas a half slot apart: the next starts in 10 ms, then 135, 260 and 385 ms on.
    # The latest start is 335 ms on: three starts, where the worst phase counts two.
    capacity = _phased([760.0, 885.0])
    assert max_position(PAID, 600.0, capacity, LIMITS, 0.0, 1000.0, demand_rps=400.0) == 3 * 64
    assert max_position(PAID, 600.0, capacity, LIMITS, 0.0, 1000.0, demand_rps=None) == 128  # no demand read
    assert max_position(PAID, 600.0, capacity, LIMITS, 0.0, 1000.0, demand_rps=500.0) == 128  # at capacity
    free = max_position(FREE, 600.0, capacity, LIMITS, 100.0, 1000.0, demand_rps=400.0)
    expected = 100.0 * 260.0 / 1000.0  # paid ones expected before the last start, and two deviations
    assert free == 3 * 64 - math.ceil(expected + admission.PHASED_SPREAD * math.sqrt(expected))


def test_a_free_request_whose_only_starts_are_late_ones_is_admitted_for_them_not_an_error() -> None:
    capacity = replace(CAP, cycle_ms=272.0, phases=admission.phases_of([723.0, 733.0], 1010.0, 272.0, 2000.0))
    for budget in (300.0, 400.0):  # starts due at 995 and 1005, read at 1010: only late ones count
        # two starts where the worst phase counts one; no paid arrival is expected before them
        assert max_position(FREE, budget, capacity, LIMITS, 50.0, 1010.0, demand_rps=10.0) == 2 * 64


def test_phases_never_count_fewer_starts_than_the_worst_phase() -> None:
    capacity = _phased([999.0, 999.0])  # in step: the next two starts in 249 ms, then 499
    assert max_position(PAID, 600.0, capacity, LIMITS, 0.0, 1000.0, demand_rps=100.0) == 128
    continuous = replace(capacity, join_ms=20.0)
    assert max_position(PAID, 600.0, continuous, LIMITS, 0.0, 1000.0, 100.0) == max_position(
        PAID, 600.0, replace(continuous, phases=None), LIMITS
    )


def test_the_open_gate_opens_below_capacity_over_its_traffic_and_shuts_at_a_burst() -> None:
    # 100 a second served; five whole seconds, then the current one.
    assert admission.is_open([90, 90, 90, 90, 90, 45], 0.5, 100.0)
    assert not admission.is_open([90, 90, 90, 90, 90, 45], 0.5, 90.0)  # fewer replicas: at their rate
    assert not admission.is_open([100, 100, 100, 100, 100, 50], 0.5, 100.0)  # at capacity
    assert admission.is_open([100, 100, 100, 100, 90, 50], 0.5, 100.0)  # just below it
    # A burst, seen in the current second from half of it: 100 a second vary by 3
    # deviations (sqrt(50) in half a second) up to 142 a second, 1,000 a second up to 113.
    assert not admission.is_open([90, 90, 90, 90, 90, 75], 0.5, 100.0)  # 150 a second
    assert admission.is_open([90, 90, 90, 90, 90, 65], 0.5, 100.0)  # 130: not told from noise yet
    assert not admission.is_open([900, 900, 900, 900, 900, 650], 0.5, 1000.0)  # 130 on a fleet ten times the size
    assert not admission.is_open([80, 80, 80, 80, 160, 20], 0.2, 100.0)  # early in a second, the last one counts
    # From idle, the window starts after the first busy second (traffic may have begun late
    # in it), and tells nothing for two seconds.
    assert not admission.is_open([0, 0, 0, 0, 0, 20], 0.3, 100.0)
    assert not admission.is_open([0, 0, 0, 0, 60, 60], 0.9, 100.0)
    assert not admission.is_open([0, 0, 0, 60, 60, 20], 0.3, 100.0)  # 1.3 s after the first busy second
    assert admission.is_open([0, 0, 60, 60, 60, 20], 0.3, 100.0)  # 61 a second over 2.3 s
    assert not admission.is_open([0, 0, 110, 110, 110, 30], 0.3, 100.0)  # 109 a second: past capacity
    assert not admission.is_open([1, 0, 0, 0, 0, 50], 0.5, 100.0)  # a stray request starts no window
    assert not admission.is_open([90], 0.5, 100.0)  # no window
    assert not admission.is_open([0, 0, 0, 0, 0, 0], 0.5, 0.0)  # no replica


def test_the_gate_admits_paid_requests_deep_for_a_second_after_it_was_last_open() -> None:
    gate = admission.OpenGate()
    assert not gate.admits_deep(PAID, 0.0) and not gate.admits_deep(FREE, 0.0)
    gate.update([90, 90, 90, 90, 90, 45], 0.5, 100.0, 1000.0)
    assert gate.admits_deep(FREE, 1000.0) and gate.admits_deep(PAID, 1000.0)
    gate.update([90, 90, 90, 90, 150, 80], 0.5, 100.0, 1250.0)  # a burst shuts it
    assert not gate.admits_deep(FREE, 1250.0)
    # the free requests admitted deep are still in line: a paid one is not refused behind them
    assert gate.admits_deep(PAID, 1250.0) and gate.admits_deep(PAID, 2000.0)
    assert not gate.admits_deep(PAID, 2001.0)


def test_second_counts_keep_the_window_as_the_brokers_counters_do() -> None:
    counts = admission.SecondCounts(keep_s=2)
    for t in (100.0, 1100.0, 1200.0, 2300.0, 3400.0, 3500.0, 3600.0):
        counts.add(t)
    assert counts.window(3750.0) == ([2, 1, 3], 0.75)  # two whole seconds, then the current one
    assert counts.window(5000.0) == ([3, 0, 0], 0.0)


def test_an_open_gate_admits_two_slots_past_the_worst_phase_keeping_room_for_paid_arrivals() -> None:
    # 600 ms budget on 2 x 64: the worst phase holds two slots (128 positions), open four.
    assert admission.open_position(PAID, 600.0, CAP, LIMITS) == 4 * 64
    assert admission.open_position(FREE, 600.0, CAP, LIMITS) == 4 * 64  # no paid traffic to keep room for
    # Room for the paid arrivals expected before the fourth slot starts (at the mean phase).
    expected = 50.0 * (4 * 125.0 - 62.5) / 1000.0
    room = math.ceil(expected + math.sqrt(expected))
    assert admission.open_position(FREE, 600.0, CAP, LIMITS, 50.0) == 4 * 64 - room
    assert max_position(FREE, 600.0, CAP, LIMITS, 50.0) < 128 < 4 * 64 - room
    assert admission.open_position(FREE, 600.0, CAP, Limits(4096, 100, 15.0)) == 100  # the queue's cap holds
    assert admission.open_position(FREE, 600.0, replace(CAP, join_ms=20.0), LIMITS) == 0  # continuous: the limit


def test_the_gate_shuts_where_most_free_admissions_go_past_the_limit() -> None:
    # A ramp into overload fills the deep positions before the demand's window passes capacity.
    steady = [90, 90, 90, 90, 90, 45]
    gate = admission.OpenGate()
    for i in range(20):  # a few of a burst past the limit: the gate stays open
        gate.admitted(i * 10.0, deep=i % 10 == 0)
    gate.update(steady, 0.5, 100.0, 200.0)
    assert gate.admits_deep(FREE, 200.0)
    for i in range(30):  # then most of them
        gate.admitted(400.0 + i * 10.0, deep=i % 10 != 0)
    gate.update(steady, 0.5, 100.0, 700.0)
    assert not gate.admits_deep(FREE, 700.0) and gate.admits_deep(PAID, 700.0)
    for i in range(20):  # a second on, all within the limit again
        gate.admitted(1700.0 + i * 10.0, deep=False)
    gate.update(steady, 0.5, 100.0, 2000.0)
    assert gate.admits_deep(FREE, 2000.0)
