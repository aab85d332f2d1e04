"""The fleet simulation split over processes: the same answer for any number of them, and
the answer one process gives, through a region's loss."""

from __future__ import annotations

import numpy as np

from control.sim.config import SimConfig
from control.sim.simulate import simulate
from control.sim.split import simulate_split
from control.sim.states import NEW, OK, RUNNING, WAITING
from control.sim.workload import Workload, make_workload


def fleet(seconds: float = 12.0) -> tuple[SimConfig, Workload]:
    config = SimConfig(replicas=[6, 2], models=["kb-small", "kb-large"], regions=3, region_loss_at_s=seconds / 3)
    workload = make_workload(4000, seconds, paid_fraction=0.2, model_shares=[0.75, 0.25], regions=3, seed=3)
    return config, workload


def test_any_number_of_processes_gives_the_same_run() -> None:
    config, workload = fleet()
    one = simulate_split(config, workload, processes=1)
    two = simulate_split(config, workload, processes=2)
    assert np.array_equal(one.state, two.state)
    assert np.array_equal(one.end_ms, two.end_ms)
    assert np.array_equal(one.group, two.group)
    assert one.stats == two.stats


def test_split_agrees_with_one_process_through_a_region_loss() -> None:
    config, workload = fleet()
    whole = simulate(config, workload)
    split = simulate_split(config, workload, processes=2)
    assert split.stats["resent"] == whole.stats["resent"] > 0  # the same requests were held at the loss
    assert not np.isin(split.state, [NEW, WAITING, RUNNING]).any()  # every request has its outcome
    a, b = whole.summary(), split.summary()
    assert abs(a["answered_200_share"] - b["answered_200_share"]) < 0.005
    assert abs(a["p50_ms"] - b["p50_ms"]) / a["p50_ms"] < 0.03
    assert abs(a["p99_ms"] - b["p99_ms"]) / a["p99_ms"] < 0.03
    region = split.group // 2
    after = workload.t_ms > 4_100.0
    assert not np.any(after & (region == 0) & (split.state == OK))  # the lost region answered nothing more
    assert np.all(split.group[workload.model == 1] % 2 == 1)  # a model's requests stay with its replicas


def test_typing_sessions_supersede_across_the_split_as_in_one_process() -> None:
    config = SimConfig(replicas=[4], regions=3, region_loss_at_s=4.0)
    workload = make_workload(2000, 12, profile="typing", regions=3, seed=5)
    whole = simulate(config, workload)
    split = simulate_split(config, workload, processes=2)
    cancelled = whole.counts().get("cancelled_409", 0)
    assert cancelled > 1000
    # what a region held at the loss is sent again elsewhere; a newer request of its session still cancels it
    assert abs(split.counts().get("cancelled_409", 0) - cancelled) / cancelled < 0.02
    assert abs(split.stats["wasted"] - whole.stats["wasted"]) <= max(10, 0.1 * whole.stats["wasted"])


def test_more_processes_than_queues_and_no_region_lost() -> None:
    config = SimConfig(replicas=[3], regions=2)
    workload = make_workload(1000, 6, regions=2, seed=2)
    whole = simulate(config, workload)
    split = simulate_split(config, workload, processes=8)
    assert np.array_equal(whole.state, split.state)  # nothing crosses regions: the very same run
    assert np.array_equal(whole.end_ms, split.end_ms)
