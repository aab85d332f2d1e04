"""What an engine learns of its costs, and what admission makes of the replicas' figures:
one far-off measurement (a cold first forward, a process stopped mid-step) or one slow
replica never makes admission refuse a budget the engine meets."""

from __future__ import annotations

from control.broker.registry import ReplicaInfo, capacity_of
from control.core.lifecycle import ReplicaState
from control.policy.admission import Capacity, Limits, Verdict, check
from tasks.policy.costs import StepCosts

LIMITS = Limits(max_queue_paid=4096, max_queue_free=2048, margin_ms=15.0)
PREFILL_CHUNK = 256
DECODE_MS, PREFILL_MS_PER_TOKEN = 2.0, 0.1


def _served(costs: StepCosts, requests: int = 3) -> None:
    """Requests of 40 prompt tokens and 16 generated, one at a time, as the engine records them."""
    for _ in range(requests):
        costs.record_prefill(40, 40 * PREFILL_MS_PER_TOKEN)
        costs.record_step(40 * PREFILL_MS_PER_TOKEN + DECODE_MS, 40)
        for _ in range(16):
            costs.record_decode(1, DECODE_MS)
            costs.record_step(DECODE_MS, 0)
        costs.record_request(40, 16)


def _warmed(cold_ms: float | None = None) -> StepCosts:
    """A cost model as the engine's start-up leaves it: three runs of each forward."""
    costs = StepCosts(prompt_prior=PREFILL_CHUNK, completion_prior=16)
    first_prefill = cold_ms / 32 if cold_ms is not None else PREFILL_MS_PER_TOKEN
    for per_token in (first_prefill, PREFILL_MS_PER_TOKEN, PREFILL_MS_PER_TOKEN):
        costs.record_prefill(32, 32 * per_token)
    for batch in (1, 64):
        for ms in (cold_ms or DECODE_MS, DECODE_MS, DECODE_MS):
            costs.record_decode(batch, ms * (1 if batch == 1 else 4))
    return costs


def _batch_ms(costs: StepCosts) -> float:
    return costs.request(1, PREFILL_CHUNK, static=False)


def test_a_stalled_forward_is_not_learned_as_the_cost_of_a_batch() -> None:
    costs = _warmed()
    _served(costs)
    before = _batch_ms(costs)
    costs.record_decode(1, 3_500.0)  # stopped mid-forward: the wall clock ran on
    costs.record_step(3_500.0, 0)
    assert _batch_ms(costs) == before
    assert check(600.0, Capacity(1, 64, _batch_ms(costs)), LIMITS) == Verdict.ADMIT


def test_a_few_stalls_in_a_row_still_do_not_move_the_estimate() -> None:
    costs = _warmed()
    _served(costs)
    before = _batch_ms(costs)
    for _ in range(4):
        costs.record_decode(1, 3_500.0)
    assert _batch_ms(costs) == before


def test_a_cold_first_forward_at_start_up_does_not_decide_the_first_estimate() -> None:
    costs = _warmed(cold_ms=400.0)
    assert costs.decode(1) == DECODE_MS
    assert costs.prefill_ms_per_token == PREFILL_MS_PER_TOKEN
    assert check(600.0, Capacity(1, 64, _batch_ms(costs)), LIMITS) == Verdict.ADMIT


def test_an_engine_that_really_got_slower_is_followed() -> None:
    costs = _warmed()
    _served(costs)
    for _ in range(10):
        costs.record_decode(1, 10 * DECODE_MS)
    assert costs.decode(1) == 10 * DECODE_MS


def _replica(name: str, batch_ms: float, state: ReplicaState = ReplicaState.SERVING) -> ReplicaInfo:
    return ReplicaInfo(name, "kb-small", state, "hf:kb-small", 64, batch_ms, 0, False, 0, 0, {})


def test_the_registry_capacity_is_not_decided_by_its_slowest_replica() -> None:
    fleet = [
        _replica("a", 280.0),
        _replica("b", 3_738.0),
        _replica("c", 310.0),
        _replica("d", 9_000.0, ReplicaState.DRAINING),
    ]
    capacity = capacity_of(fleet, "kb-small")
    assert capacity.num_replicas == 3
    assert capacity.batch_ms < 600.0 - LIMITS.margin_ms
    assert check(600.0, capacity, LIMITS) == Verdict.ADMIT
