"""The pull gate on a manual clock: who takes the next request from a shared queue."""

from control.core.clock import ManualClock
from tasks.policy.pullgate import PullGate

BATCH_MS = 250.0


def busy_gate(clock: ManualClock, **kwargs: object) -> PullGate:
    gate = PullGate(max_batch=8, lead_ms=40.0, **kwargs)  # type: ignore[arg-type]
    gate.start(clock.now_ms(), BATCH_MS)
    return gate


def test_an_idle_replica_pulls_up_to_two_batches() -> None:
    gate = PullGate(max_batch=8)
    assert gate.wants(0.0, buffered=15, batch_ms=BATCH_MS)
    assert not gate.wants(0.0, buffered=16, batch_ms=BATCH_MS)
    assert gate.reopens_at(0.0, buffered=16, batch_ms=BATCH_MS) is None  # opens when work leaves


def test_a_busy_replica_with_an_idle_peer_leaves_arrivals_to_the_peer_until_its_lead() -> None:
    clock = ManualClock(1000.0)
    gate = busy_gate(clock)
    assert gate.peer_idle
    assert not gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)
    assert gate.reopens_at(clock.now_ms(), buffered=0, batch_ms=BATCH_MS) == 1000.0 + BATCH_MS - 40.0
    clock.advance(BATCH_MS - 40.0)
    assert gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)


def test_with_early_pulls_a_busy_replica_pulls_while_no_busy_peer_frees_before_it() -> None:
    clock = ManualClock(1000.0)
    gate = busy_gate(clock, early=True)
    gate.peers(idle=False, launches=[1000.0 - 10.0])  # the peer started just before: frees just before us
    assert not gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)
    assert gate.reopens_at(clock.now_ms(), buffered=0, batch_ms=BATCH_MS) == 1000.0 + BATCH_MS - 40.0
    gate.peers(launches=[1000.0 + 5.0])  # the peer started after us: we free first, so we take it
    assert gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)


def test_a_busy_replica_that_frees_first_waits_for_its_lead_all_the_same() -> None:
    clock = ManualClock(1000.0)
    gate = busy_gate(clock, early=False)
    gate.peers(idle=False, launches=[1000.0 + 5.0])  # the peer started after us: we free first
    assert not gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)
    assert gate.reopens_at(clock.now_ms(), buffered=0, batch_ms=BATCH_MS) == 1000.0 + BATCH_MS - 40.0
    clock.advance(BATCH_MS - 40.0)
    assert gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)
    assert not gate.wants(clock.now_ms(), buffered=8, batch_ms=BATCH_MS)  # still one next batch at most


def test_the_gate_reopens_when_the_freeing_peer_has_started_again() -> None:
    clock = ManualClock(1000.0)
    gate = busy_gate(clock, early=True)
    gate.peers(idle=False, launches=[1000.0 - 200.0])  # frees at 1050, before our 1250
    assert not gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)
    assert gate.reopens_at(clock.now_ms(), buffered=0, batch_ms=BATCH_MS) == 1050.0
    clock.advance(60.0)  # the peer's expected end has passed: nobody frees before us
    assert gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)


def test_a_busy_replica_buffers_at_most_one_next_batch() -> None:
    clock = ManualClock(0.0)
    gate = busy_gate(clock)
    clock.advance(BATCH_MS)
    assert gate.wants(clock.now_ms(), buffered=7, batch_ms=BATCH_MS)
    assert not gate.wants(clock.now_ms(), buffered=8, batch_ms=BATCH_MS)
    assert gate.reopens_at(clock.now_ms(), buffered=8, batch_ms=BATCH_MS) == gate.ends_at_ms
    gate.finish()
    assert gate.wants(clock.now_ms(), buffered=8, batch_ms=BATCH_MS)


def test_a_stopping_replica_pulls_nothing() -> None:
    gate = PullGate(max_batch=8)
    gate.stopping = True
    assert not gate.wants(0.0, buffered=0, batch_ms=BATCH_MS)
    assert not gate.wants_continuous(buffered=0, free_slots=8)


def test_a_continuous_replica_pulls_for_its_free_slots_and_one_behind() -> None:
    # `free_slots` counts the seats the step under way frees (`Engine.frees_after_step`): no
    # more than one request waits in the buffer for a seat that frees later.
    gate = PullGate(max_batch=16)
    assert gate.wants_continuous(buffered=3, free_slots=3)
    assert not gate.wants_continuous(buffered=4, free_slots=3)
    assert gate.wants_continuous(buffered=0, free_slots=0)  # one behind a full engine
    assert not gate.wants_continuous(buffered=1, free_slots=0)


def test_with_lead_yields_a_busy_replica_pulls_in_its_lead_only_while_no_idle_peer_listens() -> None:
    """LEAD_YIELDS: at each batch's start a listener elsewhere is assumed until the lead
    reads the token; while one listens, the lead pulls nothing (the arrivals fill the
    listener's batch); once none does, the lead pulls as before."""
    clock = ManualClock(1000.0)
    gate = busy_gate(clock, lead_yields=True)
    assert gate.listener_elsewhere
    clock.advance(BATCH_MS - 40.0)
    assert not gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)
    gate.listener_elsewhere = False  # the lead read the token: nobody holds it
    assert gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)
    gate.finish()
    gate.start(clock.now_ms(), BATCH_MS)  # the next batch assumes a listener again
    clock.advance(BATCH_MS - 40.0)
    assert not gate.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)
    plain = busy_gate(clock)  # without it the lead pulls whoever listens
    clock.advance(BATCH_MS - 40.0)
    assert not plain.listener_elsewhere and plain.wants(clock.now_ms(), buffered=0, batch_ms=BATCH_MS)
