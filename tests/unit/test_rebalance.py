"""The rebalance policy on a manual clock: demand moves replicas, with hysteresis, a
minimum per model and a floor for paid traffic."""

from __future__ import annotations

from control.core.clock import ManualClock
from control.core.lifecycle import ReplicaState
from control.policy.rebalance import Decision, ModelDemand, RebalanceConfig, RebalancePolicy, ReplicaSlot, Snapshot

CAPACITY = 100.0  # requests a second one replica serves when full


def fleet(small: int, large: int, **states: ReplicaState) -> list[ReplicaSlot]:
    names = [(f"small-{i}", "kb-small") for i in range(small)] + [(f"large-{i}", "kb-large") for i in range(large)]
    return [ReplicaSlot(n, m, states.get(n.replace("-", "_"), ReplicaState.SERVING), CAPACITY) for n, m in names]


def snap(replicas: list[ReplicaSlot], small: float, large: float, paid_small: float = 0.0, **old: float) -> Snapshot:
    return Snapshot(
        replicas,
        {
            "kb-small": ModelDemand("kb-small", small, paid_small, old.get("small_oldest", 0.0)),
            "kb-large": ModelDemand("kb-large", large, 0.0, old.get("large_oldest", 0.0)),
        },
    )


def policy(clock: ManualClock, min_per_model: int = 1) -> RebalancePolicy:
    return RebalancePolicy(RebalanceConfig(min_per_model, hold_ms=10_000, cooldown_ms=30_000), clock)


def moves(decisions: list[Decision]) -> list[tuple[str, str, str]]:
    return [(d.replica, d.from_model, d.to_model) for d in decisions if d.is_move]


def test_a_model_short_for_the_hold_time_gets_a_replica_from_one_with_spare() -> None:
    clock = ManualClock()
    pol = policy(clock)
    demand = snap(fleet(3, 1), small=20, large=150)  # large wants ceil(150 / 70) = 3, small 1
    decided = pol.decide(demand)
    assert moves(decided) == [] and "short for 0 s of 10" in decided[0].reason
    clock.advance(9_999)
    assert moves(pol.decide(demand)) == []
    clock.advance(1)
    decided = pol.decide(demand)
    assert moves(decided) == [("small-2", "kb-small", "kb-large")]
    assert "kb-large: 150.0 req/s" in decided[0].reason and "wants 3, has 1" in decided[0].reason


def test_a_burst_shorter_than_the_hold_time_moves_nothing() -> None:
    clock = ManualClock()
    pol = policy(clock)
    for rate in (150, 150, 20, 150, 150):  # short, then not, then short again: the clock restarts
        assert moves(pol.decide(snap(fleet(3, 1), small=20, large=rate))) == []
        clock.advance(4_000)
    clock.advance(6_000)
    assert moves(pol.decide(snap(fleet(3, 1), small=20, large=150))) != []


def test_no_second_move_within_the_cooldown_nor_while_one_is_under_way() -> None:
    clock = ManualClock()
    pol = policy(clock)
    demand = snap(fleet(4, 1), small=10, large=250)
    pol.decide(demand)
    clock.advance(10_000)
    assert len(moves(pol.decide(demand))) == 1
    moving = snap(fleet(4, 1, small_3=ReplicaState.MOVING), small=10, large=250)
    assert "small-3 is moving" in pol.decide(moving)[0].reason
    clock.advance(10_000)
    after = snap(fleet(3, 2), small=10, large=250)
    assert "cooling down" in pol.decide(after)[0].reason
    clock.advance(20_000)
    assert moves(pol.decide(after)) == [("small-2", "kb-small", "kb-large")]


def test_never_below_the_minimum_per_model_even_with_no_traffic() -> None:
    clock = ManualClock()
    pol = policy(clock, min_per_model=1)
    demand = snap(fleet(1, 1), small=0, large=1_000)
    for _ in range(5):
        decided = pol.decide(demand)
        clock.advance(60_000)
        assert moves(decided) == []
    assert "no model can spare a replica" in decided[0].reason


def test_paid_traffic_keeps_its_replicas_whatever_the_other_model_wants() -> None:
    clock = ManualClock()
    pol = policy(clock)
    # small: 130 req/s, all paid: 130 * 1.5 / 100 -> a floor of 2 replicas.
    demand = snap(fleet(3, 1), small=130, large=600, paid_small=130)
    pol.decide(demand)
    clock.advance(10_000)
    assert moves(pol.decide(demand)) == [("small-2", "kb-small", "kb-large")]  # 3 -> 2, still its floor
    clock.advance(60_000)
    demand = snap(fleet(2, 2), small=130, large=600, paid_small=130)
    pol.decide(demand)
    clock.advance(60_000)
    assert moves(pol.decide(demand)) == []  # 2 -> 1 would drop below the paid floor


def test_an_old_queue_asks_for_one_more_replica_than_the_rate_does() -> None:
    clock = ManualClock()
    pol = policy(clock)
    quiet = snap(fleet(3, 1), small=10, large=50)
    assert "every model has the replicas" in pol.decide(quiet)[0].reason
    backed_up = snap(fleet(3, 1), small=10, large=50, large_oldest=900)
    pol.decide(backed_up)
    clock.advance(10_000)
    assert moves(pol.decide(backed_up)) == [("small-2", "kb-small", "kb-large")]
