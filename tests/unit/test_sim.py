"""The simulator: it runs the live policy objects, reproduces what queueing says it must,
and keeps every request accounted for through host and region loss."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from control.core.protocol import PULL_WAIT_S
from control.policy import admission
from control.sim import gateway as sim_gateway
from control.sim import group as sim_group
from control.sim.config import SimConfig
from control.sim.cost import CostModel
from control.sim.simulate import Simulation, simulate
from control.sim.states import CANCELLED, EXPIRED, LATE, OK, REFUSED, WAITING
from control.sim.workload import Workload, make_workload
from tasks.policy.collector import Collector
from tasks.policy.pullgate import PullGate


def make_config(replicas: int = 2, **kw: object) -> SimConfig:
    return SimConfig(replicas=[replicas], **kw)  # type: ignore[arg-type]


def test_the_policy_objects_are_the_live_ones() -> None:
    run = Simulation(make_config(3), make_workload(10, 1, seed=1))
    replica = run.groups[0].replicas[0]
    assert type(replica.collector) is Collector
    assert type(replica.gate) is PullGate
    assert sim_group.admission is admission and sim_gateway.admission is admission


def test_low_load_waits_max_wait_then_one_batch() -> None:
    result = simulate(make_config(4), make_workload(4, 60, seed=2))
    s = result.summary()
    assert s["answered_200_share"] == 1.0
    assert 19.0 <= s["queue_p50_ms"] <= 25.0  # max_wait_ms (20) and nothing else
    assert 269.0 <= s["p50_ms"] <= 276.0  # max_wait + batch_ms
    assert result.mean_batch() < 1.3


def test_at_ninety_percent_batches_fill_and_p99_fits() -> None:
    result = simulate(make_config(2), make_workload(461, 30, seed=3))
    s = result.summary()
    assert 0.99 <= s["answered_200_share"]
    assert 54 <= result.mean_batch() <= 64  # rate x batch time / replicas = 57.6
    assert s["p99_ms"] <= 540.0  # the budget: admission lets in only what fits


def test_overload_sheds_with_429_and_keeps_the_latency_of_the_admitted() -> None:
    result = simulate(make_config(2), make_workload(768, 20, seed=4))  # rho = 1.5
    counts = result.counts()
    refused = counts.get("refused_429", 0) / len(result.state)
    assert 0.25 <= refused <= 0.40  # about 1 - 1/rho
    assert result.summary()["p99_ms"] <= 540.0
    assert result.mean_batch() >= 62


def test_same_seed_same_run() -> None:
    config = make_config(3, host_loss_at_s=5.0, host_size=1)
    a = simulate(config, make_workload(600, 10, profile="typing", seed=5))
    b = simulate(make_config(3, host_loss_at_s=5.0, host_size=1), make_workload(600, 10, profile="typing", seed=5))
    assert np.array_equal(a.state, b.state)
    assert np.array_equal(a.end_ms, b.end_ms)
    c = simulate(make_config(3), make_workload(600, 10, profile="typing", seed=6))
    assert not np.array_equal(a.end_ms[: len(c.end_ms)], c.end_ms[: len(a.end_ms)])


def test_host_loss_requeues_what_it_held() -> None:
    config = make_config(4, host_loss_at_s=5.1, host_size=2, restart_s=3.0, budget_ms=2000.0)
    result = simulate(config, make_workload(700, 12, seed=7))
    assert result.stats["requeued"] > 64  # a running batch and more
    assert result.counts().get("lost", 0) == 0
    assert set(np.unique(result.state)) <= {OK, REFUSED, EXPIRED, LATE}  # every request answered once
    assert result.summary()["answered_200_share"] >= 0.97


def test_host_loss_with_a_600_ms_budget_answers_what_it_held_504() -> None:
    """The lease (300 ms) and the sweep (100 ms) leave less than one batch of a 540 ms budget."""
    result = simulate(make_config(4, host_loss_at_s=5.1, host_size=2), make_workload(700, 12, seed=7))
    assert result.stats["requeued"] == 0
    assert result.counts().get("lost", 0) == 0
    assert 64 <= result.counts()["expired_504"]


def test_free_slot_copies_on_another_host_answer_what_a_lost_host_ran() -> None:
    """Hedging: at 45% load half the slots are empty; copies of the requests running on the
    other host answer those the lost host held, paid ones first. Without a loss a copy only
    ever finishes after its request's own run: wasted, and nothing else changes."""
    workload = make_workload(0.45 * 4 * 16 / 0.25, 20, paid_fraction=0.3, seed=1)
    paid = workload.paid.astype(bool)
    runs = {
        mode: simulate(
            make_config(4, max_batch=16, host_size=2, host_loss_at_s=8.0, hedge=mode, budget_ms=600.0), workload
        )
        for mode in ("off", "paid", "all")
    }
    failed = {mode: sum(n for k, n in r.counts().items() if k != "ok") for mode, r in runs.items()}
    assert failed["all"] < failed["paid"] < failed["off"], failed
    # Paid ones the loss caught: a third as many fail (the rest were taken and not started)
    paid_504 = {mode: r.counts(paid).get("expired_504", 0) for mode, r in runs.items()}
    assert paid_504["off"] > 0 and 3 * paid_504["paid"] <= paid_504["off"], paid_504
    assert runs["all"].stats["hedge_wins"] > runs["paid"].stats["hedge_wins"] > 0
    for r in runs.values():
        assert r.counts().get("lost", 0) == 0
        assert r.stats["hedged"] == r.stats["hedge_wins"] + r.stats["hedge_wasted"]
    calm = {mode: simulate(make_config(4, max_batch=16, host_size=2, hedge=mode), workload) for mode in ("off", "all")}
    assert calm["all"].stats["hedge_wins"] == 0 and calm["all"].stats["hedged"] > 0
    assert np.array_equal(calm["all"].state, calm["off"].state)


def test_hedging_picks_another_hosts_requests_that_can_still_finish_paid_first() -> None:
    from tasks.policy.hedging import Candidate, pick

    cands = [
        Candidate("free-early", "free", 900.0, "b"),
        Candidate("paid-late", "paid", 1000.0, "b"),
        Candidate("paid-early", "paid", 800.0, "b"),
        Candidate("paid-here", "paid", 900.0, "a"),  # this host's own: lost with it
        Candidate("paid-too-late", "paid", 760.0, "b"),  # would be answered past its deadline
    ]
    assert [c.key for c in pick("all", 3, "a", 750.0, 15.0, cands)] == ["paid-early", "paid-late", "free-early"]
    assert [c.key for c in pick("paid", 3, "a", 750.0, 15.0, cands)] == ["paid-early", "paid-late"]
    assert pick("off", 3, "a", 750.0, 15.0, cands) == [] and pick("all", 0, "a", 750.0, 15.0, cands) == []


def test_superseded_requests_cost_no_batch_while_queued() -> None:
    result = simulate(make_config(2), make_workload(300, 20, profile="typing", seed=8))
    cancelled = result.state == CANCELLED
    assert cancelled.sum() > 1000  # typing: most requests are superseded by the next keystroke
    ran = result.start_ms > 0
    # A batch row is a request that started; a cancelled one that started was running already.
    assert result.stats["batch_rows"] == int(ran.sum())
    assert int((cancelled & ran).sum()) == result.stats["wasted"]
    assert int((cancelled & ~ran).sum()) > 0  # superseded while queued: never ran


def test_region_loss_sends_what_was_in_flight_to_the_others() -> None:
    config = SimConfig(replicas=[3], regions=3, region_loss_at_s=5.0)
    result = simulate(config, make_workload(1200, 10, regions=3, seed=9))
    assert result.stats["resent"] > 0
    assert result.counts().get("lost", 0) == 0
    after = result.workload.t_ms > 5_100.0
    region = result.group // 1
    assert not np.any(after & (region == 0) & (result.state == OK))  # nothing answered by the lost region
    assert result.summary()["answered_200_share"] >= 0.95


def test_a_lost_cell_moves_what_waits_in_it_and_the_other_cells_carry_its_requests() -> None:
    # Three cells of two replicas of batch 16 (their runs' regions stand for the cells) at
    # about 40% of what they serve; cell 0's broker is lost 5 s in.
    config = SimConfig(replicas=[2], regions=3, max_batch=16, cell_loss_at_s=5.0)
    result = simulate(config, make_workload(150, 12, regions=3, seed=9))
    assert result.stats["moved"] > 0
    after = result.workload.t_ms > 5_000.0
    cell = result.group // 1
    assert not np.any(after & (cell == 0) & (result.state == OK))  # nothing new answered by the lost cell
    others = result.summary(mask=result.workload.region != 0)["answered_200_share"]
    assert others >= 0.999  # the other cells' own requests
    assert result.summary()["answered_200_share"] >= 0.99


def test_continuous_policy_runs_the_live_scheduler_and_beats_static_on_the_engine_curve() -> None:
    from tasks.policy.scheduler import ContinuousScheduler

    cost = CostModel.from_file("docs/bench/engine-small.json")
    workload = make_workload(30, 40, seed=10)  # 7.5 req/s a replica: static sustains 8.9 at full batches
    runs = {
        policy: simulate(SimConfig(replicas=[4], costs={"kb-small": cost}, policy=policy, budget_ms=10_000.0), workload)
        for policy in ("static", "continuous")
    }
    engine = (
        Simulation(SimConfig(replicas=[1], costs={"kb-small": cost}, policy="continuous"), make_workload(1, 1))
        .groups[0]
        .replicas[0]
        .engine
    )
    assert engine is not None and type(engine.scheduler) is ContinuousScheduler
    static, continuous = (runs[p].summary() for p in ("static", "continuous"))
    assert continuous["answered_200_share"] == 1.0
    assert continuous["p50_ms"] < static["p50_ms"] / 2  # a short answer leaves when it is done
    assert runs["continuous"].stats["batches"] > 10 * runs["static"].stats["batches"]  # steps, not batches


def test_continuous_policy_aborts_superseded_requests() -> None:
    cost = CostModel.from_file("docs/bench/engine-small.json")
    config = SimConfig(replicas=[2], costs={"kb-small": cost}, policy="continuous", budget_ms=5_000.0)
    result = simulate(config, make_workload(10, 30, profile="typing", seed=11))
    assert result.counts()["cancelled_409"] > 50
    assert result.counts().get("lost", 0) == 0
    assert result.summary()["answered_200_share"] >= 0.99


def test_a_request_a_pull_brings_after_the_gate_shut_is_handed_back_not_kept() -> None:
    workload = make_workload(154, 20, paid_fraction=0.0, seed=1)  # 30% of two replicas
    keep = simulate(make_config(2, pull_in_flight="keep"), workload)
    back = simulate(make_config(2, pull_in_flight="hand_back"), workload)
    assert keep.stats["taken_shut"] > 0 and back.stats["taken_shut"] > 0
    assert back.summary()["p50_ms"] < 0.95 * keep.summary()["p50_ms"]  # kept ones wait for a batch to end


def test_a_curve_scaled_to_the_serving_engine_is_written_and_read_back(tmp_path: Path) -> None:
    measured = CostModel.from_file(Path(__file__).parents[2] / "docs" / "bench" / "engine-small.json")
    served = measured.scaled(decode=1.1, prefill=1.3, step_overhead_ms=0.9)
    path = tmp_path / "served.json"
    path.write_text(json.dumps(served.as_json()))
    back = CostModel.from_file(path)
    assert back == served
    assert back.step_ms(4, 300) == pytest.approx(1.1 * measured.step_ms(4, 300))
    step = 1.1 * measured.step_ms(1, 205) + 0.9  # a lone request: its prefill, then a step per token
    assert back.batch_ms([200], [10]) == pytest.approx(1.3 * measured.prefill_ms_for(200) + 10 * step)


def test_a_take_fills_its_empty_seats_from_the_queue_so_paid_requests_ride_the_next_start_past_capacity() -> None:
    """As a live take does (`ReplicaBroker.take`'s fill): the seats a due batch's buffer
    leaves empty are filled from the queue, paid first, as the batch is taken. A replica
    that instead pulled a second batch into its buffer as its batch ended kept the paid
    requests it pulled behind urgent free ones for a whole slot."""
    workload = make_workload(2.0 * 2 * 32 * 4, 30, paid_fraction=0.3, seed=1)  # twice 2 x 32 per 250 ms
    result = simulate(make_config(2, max_batch=32, budget_ms=600), workload)
    tiers = result.by_tier()
    assert tiers["paid"]["p99_ms"] <= 0.85 * tiers["free"]["p99_ms"], tiers
    assert tiers["paid"]["answered_200_share"] == 1.0


def test_with_the_rest_of_each_batch_handed_back_paid_requests_take_the_next_start_at_twice_capacity() -> None:
    """Against admission that counts the worst phase's starts (`admit_phased=False`): the
    hand-back's gain was measured there (decision 0030)."""
    workload = make_workload(2.0 * 2 * 32 * 4, 30, paid_fraction=0.3, seed=1)  # twice 2 x 32 per 250 ms
    runs = {
        hb: simulate(make_config(2, max_batch=32, budget_ms=600, hand_back_rest=hb, admit_phased=False), workload)
        for hb in (True, False)
    }
    tiers = {hb: run.by_tier() for hb, run in runs.items()}
    p50 = {hb: t["paid"]["p50_ms"] / t["free"]["p50_ms"] for hb, t in tiers.items()}
    assert p50[True] <= 0.8 and p50[False] >= 0.9, p50  # kept buffered, free requests urgent there run first
    assert tiers[True]["paid"]["p99_ms"] <= tiers[False]["paid"]["p99_ms"]
    assert runs[True].stats["rest_handed_back"] > 0 and runs[False].stats["rest_handed_back"] == 0
    ok = {hb: run.counts()["ok"] for hb, run in runs.items()}
    assert ok[True] >= 0.995 * ok[False]  # goodput kept
    assert runs[True].counts().get("expired_504", 0) <= runs[False].counts().get("expired_504", 0)


def test_the_tiers_bench_writes_both_arms_of_each_case(tmp_path: Path) -> None:
    from control.cli.main import main

    out = tmp_path / "tiers.json"
    args = ["bench", "tiers-sim", "--cases", "2x32", "--loads", "2.0", "--horizons", "0.6", "--seconds", "10"]
    assert main([*args, "--processes", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["load"], r["hand_back_rest"], r["rest_horizon"]) for r in runs] == [
        (2.0, False, None),
        (2.0, True, 0.75),
        (1.1, True, 0.6),
        (2.0, True, 0.6),
    ]
    assert runs[0]["rest_handed_back"] == 0 < runs[1]["rest_handed_back"]
    assert main(["bench", "tiers-sim", "--cases", "2y32"]) == 2
    switched = [*args, "--switch", "pull-early", "--jitter-ms", "40", "--processes", "1", "--json", str(out)]
    assert main(switched) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["pull_early"], r["hand_back_rest"], r["batch_jitter_ms"]) for r in runs] == [
        (False, False, 40.0),
        (True, False, 40.0),
    ]
    assert not any(r["admit_phased"] for r in runs)
    phased = [*args, "--switch", "admit-phased", "--processes", "1", "--json", str(out)]
    assert main(phased) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["admit_phased"], r["pull_early"], r["hand_back_rest"]) for r in runs] == [
        (False, False, False),
        (True, False, False),
    ]


def test_saturated_replicas_that_stagger_as_live_ones_do_do_not_start_in_clumps() -> None:
    workload = make_workload(2.0 * 8 * 64 * 4, 10, paid_fraction=0.3, seed=1)  # twice 8 x 64
    median_gap = {}
    for stagger in (False, True):
        result = simulate(make_config(8, max_batch=64, budget_ms=600, stagger_saturated=stagger), workload)
        starts = np.unique(result.start_ms[(result.state == OK) & (result.start_ms > 2_000)])
        median_gap[stagger] = float(np.median(np.diff(starts)))
    # 8 replicas of 250 ms batches: evenly spread, a start every 31 ms; in clumps, most
    # starts follow another within a millisecond.
    assert median_gap[True] >= 20.0 and median_gap[False] <= 5.0, median_gap


def test_with_batch_times_that_vary_paid_requests_are_ahead_only_where_busy_replicas_leave_arrivals_queued() -> None:
    """Batches that take 250-290 ms (as on a CPU-bound machine): a busy replica that pulls
    its next batch as soon as no peer frees before it (PULL_EARLY) fills its buffer with
    free requests a slot ahead, and a paid request arriving after them waits for the start
    after. Left in the queue until a lead before the start, paid requests go first. Against
    admission by the worst phase's limit (`admit_open=False`), where the rule was weighed."""
    workload = make_workload(1.1 * 2 * 32 * 4, 20, paid_fraction=0.3, seed=1)
    ratio = {}
    for early in (True, False):
        config = make_config(2, max_batch=32, budget_ms=600, batch_jitter_ms=40.0, pull_early=early, admit_open=False)
        tiers = simulate(config, workload).by_tier()
        ratio[early] = tiers["paid"]["p99_ms"] / tiers["free"]["p99_ms"]
    assert ratio[False] <= 0.85 and ratio[True] >= 0.95, ratio


def test_a_due_take_brings_late_paid_requests_and_fills_the_empty_seats_counting_what_left_the_queue() -> None:
    """The simulated take, request by request (`ReplicaBroker.take`'s caps): paid requests
    up to the buffer's displaceable free ones plus its empty seats, then free ones up to the
    empty seats left; an entry that left the waiting set (here cancelled) counts against
    its pop and is dropped."""
    run = Simulation(make_config(1, max_batch=4, budget_ms=600), make_workload(400, 1, paid_fraction=0.5, seed=2))
    group, replica = run.groups[0], run.groups[0].replicas[0]
    paid = [i for i in range(len(run.t)) if run.paid[i]][:4]
    free = [i for i in range(len(run.t)) if not run.paid[i]][:4]
    run.now = max(run.t[i] for i in paid + free)  # everyone has arrived; all can still finish
    for i in paid + free:
        run.state[i] = WAITING
        group.num_waiting[run.paid[i]] += 1
    run.state[paid[1]] = CANCELLED  # superseded while queued
    group.num_waiting[1] -= 1
    run._take(replica, free[0])  # buffered: one free request, three empty seats
    replica.collector.urgent_before_ms = 0.0
    group.paid_queue.extend(paid)
    group.free_queue.extend(free[1:])
    replica.collector.config.max_wait_ms = 0.0  # the batch is due at once
    run._try_launch(replica)
    launched = sorted(int(p.payload) for p in replica.batch)
    # room 1 (the buffered free one can wait) + fill 3: four paid pops, the cancelled one dropped
    assert launched == sorted([paid[0], paid[2], paid[3], free[0]])
    assert list(group.paid_queue) == [] and list(group.free_queue) == free[1:]  # no seat left for free


def test_with_hedging_what_a_lost_host_ran_or_held_answers_through_copies() -> None:
    """Two hosts of two at 35% load: every request the lost host was running, and every one
    it held buffered for its next batch, has a copy on the other host and answers; none
    ends 504. Without copies of buffered requests, those were re-queued only when the
    leases lapsed, after the survivors' next starts, and ended 504."""
    config = make_config(4, max_batch=16, budget_ms=600, hedge="all", host_size=2, host_loss_at_s=5.0, restart_s=7.0)
    run = Simulation(config, make_workload(0.35 * 4 * 16 * 4, 20, paid_fraction=0.3, seed=1))
    result = run.run()
    assert run.lost_running and run.lost_buffered
    assert all(result.state[j] == OK for j in run.lost_running | run.lost_buffered)
    assert not np.any((result.state == EXPIRED) | (result.state == LATE))


def test_the_host_loss_bench_runs_each_arm_on_the_same_arrivals(tmp_path: Path) -> None:
    from control.cli.main import main

    out = tmp_path / "host-loss.json"
    args = ["bench", "host-loss-sim", "--loads", "0.35", "--seeds", "2", "--processes", "1", "--json", str(out)]
    assert main(args) == 0
    totals = {t["arm"]: t for t in json.loads(out.read_text())["totals"]}
    assert list(totals) == ["off", "running", "+buffered"]
    assert len({t["sent"] for t in totals.values()}) == 1  # the same arrivals
    assert totals["off"]["hedged"] == 0 < totals["running"]["hedged"]
    assert totals["off"]["running_504"] > 0 == totals["running"]["running_504"]
    assert totals["running"]["buffered_504"] > 0 == totals["+buffered"]["buffered_504"]
    assert main(["bench", "host-loss-sim", "--replicas", "2"]) == 2  # one host: nothing to lose to


def test_a_buffered_request_past_its_last_start_is_left_to_a_live_copy() -> None:
    """`_drop_expired`: a request its replica can no longer run in time ends 504, unless a
    copy of it runs on a live replica; then it leaves the buffer still waiting for the copy."""
    from tasks.policy.collector import Pending

    config = make_config(4, max_batch=16, budget_ms=600, hedge="all", host_size=2)
    run = Simulation(config, make_workload(10, 1, seed=1))
    group = run.groups[0]
    holder, copier = group.replicas[0], group.replicas[2]
    for j in (0, 1):
        run.state[j] = WAITING
        holder.collector.add(Pending(str(j), "free", 0.0, 300.0, j, 0.0))
    group.num_waiting[0] += 2
    run.hedges[0] = copier  # a copy of request 0 runs on the other host
    run.now = 100.0  # 100 + 250 + 15 > 300: neither can finish a batch started here now
    run._drop_expired(holder)
    assert holder.collector.waiting == []
    assert run.state[0] == WAITING and run.state[1] == EXPIRED
    copier.alive = False  # a copy on a lost replica answers nothing
    holder.collector.add(Pending("0", "free", 0.0, 300.0, 0, 0.0))
    run._drop_expired(holder)
    assert run.state[0] == EXPIRED


def test_idle_replicas_that_split_arrivals_start_small_batches_together() -> None:
    """8 replicas of batch 64 at 30% load: with arrivals shared in turn among the idle
    replicas (the BRPOP line), each starts a small batch, they end together, and a request
    that arrives between their clumps waits for the next; concentrated on one that is
    already gathering (`concentrate_idle`), batches fill and the waits end."""
    workload = make_workload(0.3 * 8 * 64 * 4, 10, paid_fraction=0.3, seed=1)
    queue_p99 = {}
    for concentrate in (False, True):
        result = simulate(make_config(8, max_batch=64, budget_ms=540, concentrate_idle=concentrate), workload)
        ran = result.start_ms > 0
        queue_p99[concentrate] = float(np.percentile((result.start_ms - workload.t_ms)[ran], 99))
    assert queue_p99[False] > 150.0 and queue_p99[True] < 120.0, queue_p99


def test_free_requests_bumped_by_paid_ones_are_refused_less_and_miss_nothing() -> None:
    """`admit_bump`: a free request is admitted with no room kept for paid arrivals, and a
    paid one bumps the first free request it would push past its last start. On 2 x 16 at
    90% load far fewer are refused than with the reserve; past capacity no request misses
    its deadline and no paid one is refused (bumping the newest free request instead let
    the ones before it miss: 290 × 504 at 200%). Against the reserve as it was weighed,
    with admission by the worst phase's limit (`admit_open=False`)."""
    figures = {}
    for load in (0.9, 2.0):
        workload = make_workload(load * 2 * 16 * 4, 20, paid_fraction=0.3, seed=1)
        paid = workload.paid.astype(bool)
        for bump in (False, True):
            config = make_config(2, max_batch=16, budget_ms=600, hedge="all", admit_bump=bump, admit_open=False)
            result = simulate(config, workload)
            state = result.state
            figures[load, bump] = (
                int((state == REFUSED).sum()),
                int((state[paid] == REFUSED).sum()),
                int(((state == EXPIRED) | (state == LATE)).sum()),
                result.stats["bumped"],
            )
    assert figures[0.9, False][0] > 4 * figures[0.9, True][0], figures
    assert figures[0.9, False][2] == figures[0.9, True][2] == 0, figures
    assert figures[2.0, True][1:3] == (0, 0) and figures[2.0, True][3] > 0, figures
    assert figures[0.9, False][3] == figures[2.0, False][3] == 0, figures


def _requests_at(*t_ms: float) -> Workload:
    """Free requests sent at these times, one model, one region, no session."""
    n = len(t_ms)
    return Workload(
        np.asarray(t_ms, dtype=np.float64),
        np.zeros(n, dtype=bool),
        np.zeros(n, dtype=np.int8),
        np.zeros(n, dtype=np.int8),
        np.full(n, -1, dtype=np.int32),
        np.full(n, 300, dtype=np.int16),
        np.full(n, 16, dtype=np.int16),
    )


def _lost_host_run(workload: Workload, **kw: object) -> tuple[Simulation, np.ndarray]:
    """4 replicas of batch 16 as 2 hosts of 2, a 600 ms budget, hedging on; the first host
    (replicas 0 and 1, the first in the BRPOP line) lost 5 s in."""
    config = make_config(
        4, max_batch=16, budget_ms=600, hedge="all", host_size=2, host_loss_at_s=5.0, restart_s=7.0, **kw
    )
    run = Simulation(config, workload)
    return run, run.run().state


def test_at_low_load_idle_replicas_run_copies_that_answer_what_a_lost_host_ran() -> None:
    """HEDGE_IDLE (`hedge_idle`): a lone request runs on the first host from 4.82 s, and no
    other batch runs that a copy could ride. The host is lost at 5 s, noticed 400 ms later,
    too late for another batch: it ends 504. With HEDGE_IDLE an idle replica of the other
    host runs a batch of its copy within a look (`hedging.IDLE_LOOK_MS`), while three of the
    four replicas stay idle (`hedging.least_idle`), and the copy answers it."""
    for idle in (False, True):
        run, state = _lost_host_run(_requests_at(4800.0), hedge_idle=idle)
        assert run.lost_running == {0}
        assert state[0] == (OK if idle else EXPIRED)
        assert run.stats["idle_copy_batches"] == run.stats["hedge_wins"] == int(idle)
    # No loss, at 5% load: batches of copies run, and every request is answered 200 once.
    config = make_config(4, max_batch=16, budget_ms=600, hedge="all", host_size=2, hedge_idle=True)
    calm = Simulation(config, make_workload(0.05 * 4 * 16 * 4, 10, paid_fraction=0.3, seed=1))
    result = calm.run()
    assert calm.stats["idle_copy_batches"] > 0
    assert calm.stats["hedged"] == calm.stats["hedge_wins"] + calm.stats["hedge_wasted"]
    assert set(np.unique(result.state)) == {OK}


def test_idle_replicas_run_no_copies_where_too_few_stay_idle_for_arrivals() -> None:
    """Two replicas, one a host: an idle one would leave no other idle for arrivals
    (`hedging.least_idle` is 3), so none runs a batch of copies."""
    from tasks.policy.hedging import least_idle

    assert [least_idle(n) for n in (1, 2, 4, 6, 7, 10)] == [3, 3, 3, 3, 4, 5]
    config = make_config(2, max_batch=16, budget_ms=600, hedge="all", host_size=1, hedge_idle=True)
    run = Simulation(config, make_workload(10, 10, seed=1))
    run.run()
    assert run.stats["idle_copy_batches"] == 0 and run.stats["hedged"] > 0


def test_what_a_lost_replicas_last_pull_took_goes_back_to_the_queue_and_is_answered() -> None:
    """The first replica's BRPOP is out when its host stops at 5 s, and takes the request
    sent 40 ms later, which nothing records. RESCUE puts it back at the front of the queue
    `rescue_ms` after the loss, and a survivor answers it. A pull out for longer than
    `protocol.PULL_WAIT_S` had timed out and takes nothing; with no pull in flight
    (`pull_in_flight="none"`) nothing is taken either."""
    run, state = _lost_host_run(_requests_at(4880.0, 5040.0))
    assert run.stats["taken_lost"] == run.stats["rescued"] == 1
    assert list(state) == [OK, OK]
    late = 5000.0 + 1000.0 * PULL_WAIT_S + 30.0  # the stopped replica's BRPOP has timed out
    run, state = _lost_host_run(_requests_at(4880.0, late))
    assert run.stats["taken_lost"] == 0 and list(state) == [OK, OK]
    run, state = _lost_host_run(_requests_at(4880.0, 5040.0), pull_in_flight="none")
    assert run.stats["taken_lost"] == 0 and list(state) == [OK, OK]


def test_idle_copies_take_every_tier_while_half_the_pool_is_idle_and_paid_gathered_while_a_quarter_is() -> None:
    from tasks.policy.hedging import Candidate, copies_due, idle_mode, look_ms

    assert idle_mode("all", 12, 24) == ("all", 12, False)
    assert idle_mode("all", 11, 24) == ("paid", 6, True)
    assert idle_mode("paid", 6, 24) == ("paid", 6, True)
    assert idle_mode("all", 5, 24) == ("off", 0, False)
    assert idle_mode("all", 3, 4) == ("all", 3, False)  # a small pool: the spare replicas decide
    assert idle_mode("all", 2, 4) == ("off", 0, False)
    assert idle_mode("off", 24, 24) == ("off", 0, False)
    copies = [Candidate(k, "paid", deadline, "b") for k, deadline in enumerate((900.0, 1000.0))]
    # Two copies of a batch of 4 wait for more while the first may still start after the
    # next two looks (its last start: 900 - 15 - 250 = 635); they start once it may not.
    assert look_ms(300.0) == 100.0 and look_ms(90.0) == 50.0  # a lease's renewals, 50 ms at least
    assert not copies_due(copies, 4, 430.0, 250.0, 15.0, 100.0)
    assert copies_due(copies, 4, 440.0, 250.0, 15.0, 100.0)
    assert not copies_due(copies, 4, 530.0, 250.0, 15.0, 50.0)
    assert copies_due(copies, 2, 430.0, 250.0, 15.0, 100.0)  # a full batch starts at once
    assert not copies_due([], 4, 540.0, 250.0, 15.0, 100.0)


def test_at_normal_load_idle_replicas_gather_paid_copies_that_answer_a_lost_hosts_paid_requests() -> None:
    """24 replicas of batch 64 as 3 hosts of 8, 60% load: batches are nearly full, so few
    free slots carry copies, and fewer than half the replicas are idle. The busiest host
    lost ends its paid requests 504. With HEDGE_IDLE, idle replicas (a quarter of the pool
    and more) run batches of copies of paid requests, gathered, and none ends 504."""
    workload = make_workload(0.6 * 24 * 64 * 4, 10, paid_fraction=0.2, seed=1)
    paid = workload.paid.astype(bool)
    failed = {}
    for idle in (False, True):
        config = make_config(
            24,
            max_batch=64,
            budget_ms=540,
            hedge="all",
            hedge_idle=idle,
            host_size=8,
            host_loss_at_s=5.0,
            host_loss_busiest=True,
            concentrate_idle=True,
        )
        run = Simulation(config, workload)
        state = run.run().state
        lost = np.asarray(sorted(run.lost_running | run.lost_buffered))
        assert len(lost) > 100 and paid[lost].sum() > 20
        failed[idle] = int(((state == EXPIRED) | (state == LATE))[paid].sum())
        batches, copies = run.stats["idle_copy_batches"], run.stats["idle_copies"]
        assert (batches > 0) == idle
        if idle:  # of paid requests only, gathered: batches of copies half full or more
            assert copies <= paid.sum() and copies >= 32 * batches, (copies, batches)
    assert failed[False] > 20 and failed[True] == 0, failed


def test_one_listener_keeps_full_batches_after_a_disturbance_where_busy_replicas_yield_their_lead() -> None:
    """16 replicas of batch 64 at 65% load, one listener at a time: idle replicas gather
    full batches. A few batches of copies in the first 0.1 s (every replica idle then) moved
    the fleet for good into batches fed by busy replicas' lead pulls, a third smaller, with
    no replica idle; with `lead_yields` (a busy replica pulls in its lead only while no peer
    is idle) the same disturbance leaves the batches as full as without it."""
    workload = make_workload(2667, 20, paid_fraction=0.2, seed=1)
    mean = {}
    for yields in (False, True):
        for idle in (False, True):
            config = make_config(
                16,
                max_batch=64,
                batch_ms=251,
                budget_ms=540,
                concentrate_idle=True,
                hedge="paid",
                hedge_idle=idle,
                host_size=8,
                lead_yields=yields,
            )
            run = Simulation(config, workload)
            result = run.run()
            assert (run.stats["idle_copy_batches"] > 0) == idle
            mean[yields, idle] = float(np.mean(result.batch_sizes))
    assert mean[False, False] > 50 and mean[False, True] < 45, mean
    assert min(mean[True, False], mean[True, True]) > 50, mean


def test_admitted_deeper_below_capacity_fewer_requests_fail_and_no_paid_one() -> None:
    """`admit_open`: while the demand is below the replicas' rate a free request is admitted
    as deep as the best phase allows (a paid one too, up to a second after), and the replicas' deadline
    rule answers 504 the few that then miss. On 2 x 16 at 90% far fewer requests fail than
    with the worst phase's limit; past capacity the gate shuts, and nothing changes but
    that no paid request fails."""
    figures = {}
    for load in (0.9, 2.0):
        workload = make_workload(load * 2 * 16 * 4, 20, paid_fraction=0.3, seed=1)
        paid = workload.paid.astype(bool)
        for admit_open in (False, True):
            config = make_config(2, max_batch=16, budget_ms=600, hedge="all", admit_open=admit_open)
            state = simulate(config, workload).state
            failed = (state == REFUSED) | (state == EXPIRED) | (state == LATE)
            figures[load, admit_open] = (int(failed.sum()), int(failed[paid].sum()), int((state == OK).sum()))
    assert figures[0.9, True][0] * 2 < figures[0.9, False][0], figures  # the first 2 s keep the limit
    assert figures[0.9, True][1] == figures[2.0, True][1] == 0, figures
    assert figures[2.0, True][2] >= 0.99 * figures[2.0, False][2], figures
