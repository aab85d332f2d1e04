"""The batch-forming policy on a manual clock."""

from __future__ import annotations

from tasks.policy.collector import STRANDED_GATHER_MS, Collector, CollectorConfig, Pending


def make_pending(i: int, at: float = 0.0, tier: str = "free", deadline: float = 600.0) -> Pending:
    return Pending(id=f"r{i}", tier=tier, received_ms=at, deadline_ms=at + deadline)  # type: ignore[arg-type]


def make_collector(**kw: float) -> Collector:
    return Collector(CollectorConfig(**{"max_batch": 4, "max_wait_ms": 20.0, "batch_ms": 250.0, **kw}))


def test_empty_buffer_waits_for_nothing() -> None:
    assert make_collector().wait_ms(0.0) is None


def test_a_full_buffer_starts_at_once() -> None:
    c = make_collector()
    for i in range(4):
        c.add(make_pending(i, at=0.0))
    assert c.wait_ms(1.0) == 0.0


def test_a_lone_request_waits_max_wait_then_goes() -> None:
    c = make_collector()
    c.add(make_pending(0, at=100.0))
    assert c.wait_ms(105.0) == 15.0
    assert c.wait_ms(120.0) == 0.0


def test_the_tightest_deadline_pulls_the_launch_earlier() -> None:
    c = make_collector(max_wait_ms=100.0, margin_ms=15.0)
    c.add(make_pending(0, at=0.0, deadline=600.0))
    c.add(make_pending(1, at=0.0, deadline=280.0))  # must start by 280 - 250 - 15 = 15, taken by 15 - 10
    assert c.wait_ms(0.0) == 5.0
    c.pop_expired(5.0)
    assert len(c) == 2  # taken at its launch time, it can still finish


def test_a_stranded_request_waits_for_the_rest_of_its_burst_as_long_as_its_deadline_allows() -> None:
    c = make_collector(max_batch=8, margin_ms=15.0)
    c.add(Pending("s0", "free", received_ms=0.0, deadline_ms=350.0, stranded=True))
    assert c.wait_ms(0.0) == 350.0 - 250 - 15 - 10  # no max_wait of its own: its deadline's last start
    c.add(Pending("s1", "free", received_ms=30.0, deadline_ms=500.0, stranded=True))
    assert c.wait_ms(30.0) == 75.0 - 30  # the tightest still decides
    forwarded = Pending("f2", "free", received_ms=40.0, deadline_ms=440.0, forwarded=True)
    c.add(forwarded)  # a new request the peer sent on starts no clock while the burst is gathered
    assert c.wait_ms(40.0) == 75.0 - 40
    c.add(make_pending(3, at=50.0))  # one of the region's own does
    assert c.wait_ms(50.0) == 20.0
    c.remove({"s0", "s1", "r3"})
    assert c.wait_ms(50.0) == 10.0  # nothing stranded: the forwarded request's max_wait


def test_a_stranded_burst_is_gathered_for_a_bounded_time_whatever_the_budgets() -> None:
    c = make_collector(max_batch=8)
    c.add(Pending("s0", "free", received_ms=0.0, deadline_ms=60_000.0, stranded=True))
    c.add(Pending("f1", "free", received_ms=5.0, deadline_ms=60_000.0, forwarded=True))
    assert c.wait_ms(5.0) == STRANDED_GATHER_MS - 5  # not until the deadline a minute away


def test_paid_fills_the_batch_before_free() -> None:
    c = make_collector(paid_boost_ms=300.0)
    for i in range(4):
        c.add(make_pending(i, at=float(i)))
    c.add(make_pending(10, at=50.0, tier="paid"))
    batch = c.pop_batch()
    assert batch[0].id == "r10"
    assert [p.id for p in batch[1:]] == ["r0", "r1", "r2"]
    assert c.ids() == ["r3"]


def test_aging_lets_an_old_free_request_beat_a_new_paid_one() -> None:
    c = make_collector(max_batch=1, paid_boost_ms=300.0)
    c.add(make_pending(0, at=0.0))
    c.add(make_pending(1, at=400.0, tier="paid"))
    assert c.pop_batch()[0].id == "r0"


def test_requests_that_cannot_finish_in_time_are_taken_out() -> None:
    c = make_collector(margin_ms=15.0)
    c.add(make_pending(0, at=0.0, deadline=300.0))
    c.add(make_pending(1, at=0.0, deadline=600.0))
    assert c.expiring_ids(now_ms=30.0) == [] and c.expiring_ids(now_ms=40.0) == ["r0"]  # what the take asks ahead
    late = c.pop_expired(now_ms=40.0)  # 40 + 250 + 15 > 300
    assert [p.id for p in late] == ["r0"]
    assert c.ids() == ["r1"]


def test_cancelled_requests_leave_the_buffer() -> None:
    c = make_collector()
    for i in range(3):
        c.add(make_pending(i))
    assert [p.id for p in c.remove({"r1"})] == ["r1"]
    assert c.ids() == ["r0", "r2"]


def test_under_heavy_load_a_batch_waits_for_its_phase_behind_a_peer() -> None:
    # Two replicas; the peer started at 250, this one frees at 252 with 3 of 4 waiting.
    c = make_collector()
    for i in range(3):
        c.add(make_pending(i, at=100.0, deadline=2000.0))
    c.stagger_from([250.0], last_batch=4, now_ms=252.0)
    assert c.wait_ms(252.0) == 250.0 + 125.0 - 252.0  # half a batch time after the peer
    c.add(make_pending(3, at=260.0))
    assert c.wait_ms(261.0) == 0.0  # full: it goes at once


def test_the_phase_yields_to_the_deadline_and_to_light_load() -> None:
    c = make_collector(margin_ms=15.0)
    c.add(make_pending(0, at=100.0, deadline=610.0))  # must start by 710 - 250 - 15 = 445, taken by 435
    c.stagger_from([300.0], last_batch=4, now_ms=302.0)  # phase says 425
    assert c.wait_ms(302.0) == 425.0 - 302.0
    c.stagger_from([400.0], last_batch=4, now_ms=402.0)  # phase says 525: the deadline (435) wins
    assert c.wait_ms(402.0) == 435.0 - 402.0
    c.stagger_from([400.0], last_batch=1, now_ms=402.0)  # light load: no phase, max_wait rules
    assert c.wait_ms(402.0) == 0.0
    c.stagger_from([0.0], last_batch=4, now_ms=900.0)  # a peer silent for two batch times is ignored
    assert c.not_before_ms == 0.0


def test_a_second_copy_of_a_request_in_the_buffer_runs_once() -> None:
    c = Collector(CollectorConfig(max_batch=3))
    for i, rid in enumerate(["a", "b", "a", "c", "d"]):
        c.add(Pending(rid, "free", received_ms=float(i), deadline_ms=10_000.0))
    assert [p.id for p in c.pop_batch()] == ["a", "b", "c"]  # the copy of a is dropped
    assert [p.id for p in c.waiting] == ["d"]


def test_a_paid_request_behind_other_paid_tenants_still_goes_before_free_ones() -> None:
    c = make_collector(max_batch=2)
    free = make_pending(0, at=0.0)
    free_behind = make_pending(1, at=0.0)
    free_behind.behind = True
    paid_behind = make_pending(2, at=50.0, tier="paid")
    paid_behind.behind = True
    for pending in (free_behind, free, paid_behind):
        c.add(pending)
    assert [pd.id for pd in c.pop_batch()] == ["r2", "r0"]  # the tier first, then the lane
    assert c.num_behind() == 1  # only a free request behind is displaced by a free one in line


def test_a_free_request_that_cannot_wait_for_the_next_batch_keeps_its_place_before_a_paid_one() -> None:
    # Free r0..r3, deadlines 600-603: latest starts 335-338 (a 250 ms batch, a 15 ms margin).
    c = make_collector(max_batch=4, margin_ms=15.0)
    for i in range(4):
        c.add(make_pending(i, at=float(i)))
    c.urgent_before_ms = 300.0  # the batch after this one starts by then: every free one waits
    assert c.num_free() == 4  # late paid requests may take all four seats
    c.urgent_before_ms = 337.0  # r0 and r1 (latest starts 335, 336) cannot wait for it
    assert c.num_free() == 2
    c.add(make_pending(10, at=50.0, tier="paid"))
    c.add(make_pending(11, at=60.0, tier="paid"))
    c.add(make_pending(12, at=70.0, tier="paid"))
    assert [p.id for p in c.pop_batch()] == ["r0", "r1", "r10", "r11"]  # the urgent ones by deadline, then paid
    assert sorted(c.ids()) == ["r12", "r2", "r3"]


def test_a_saturated_replica_follows_a_peer_that_starts_just_before_it_by_a_gap() -> None:
    c = make_collector(max_batch=4)
    c.add(make_pending(0, at=0.0, deadline=10_000.0))
    # At low load (the last batch under half full) starts are left where they fall.
    assert c.staggered_start_ms(1000.0, [990.0], 250.0) == 1000.0
    for i in range(4):
        c.add(make_pending(i + 1, at=0.0, deadline=10_000.0))
    c.pop_batch()
    assert c.last_batch == 4
    # Two replicas: a gap of 125. A peer that launched 10 ms before: follow it by the gap.
    assert c.staggered_start_ms(1000.0, [990.0], 250.0) == 1115.0
    # A peer that launched a slot ago less 10 ms: its next start is not predicted from it (two
    # replicas that each predicted the other's both moved); this one keeps its start, and
    # the peer, whose take comes after this one's launch, moves.
    assert c.staggered_start_ms(1000.0, [760.0], 250.0) == 1000.0
    # Within a tenth of a gap of even: left as it is.
    assert c.staggered_start_ms(1000.0, [880.0], 250.0) == 1000.0
    # Never past the last start of the tightest request buffered.
    c.add(make_pending(9, at=0.0, deadline=1300.0))  # latest start 1300 - 250 - 15 - 10 = 1025
    assert c.staggered_start_ms(1000.0, [990.0], 250.0) == 1025.0


def test_urgency_looks_as_far_as_a_peers_start_where_the_rest_is_handed_back() -> None:
    c = make_collector()
    assert c.urgent_horizon_ms(1000.0, [], 250.0) == 250.0  # alone: its own next batch
    assert c.urgent_horizon_ms(1000.0, [400.0], 250.0) == 250.0  # a peer idle for two slots
    assert c.urgent_horizon_ms(1000.0, [900.0], 250.0) == 0.75 * 250.0


def test_the_rest_of_a_batch_leaves_earliest_deadline_first_without_copies_of_what_runs() -> None:
    c = make_collector(max_batch=2)
    for i, deadline in enumerate([900.0, 700.0, 800.0]):
        c.add(make_pending(i, at=0.0, deadline=deadline))
    c.add(make_pending(0, at=0.0, deadline=900.0))  # a second copy of r0
    batch = c.pop_batch()
    assert [pd.id for pd in batch] == ["r0", "r1"]  # free, by age: all came at 0
    assert [pd.id for pd in c.pop_rest({pd.id for pd in batch})] == ["r2"]
    assert len(c) == 0
