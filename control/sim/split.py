"""A fleet simulation split over processes, one model queue (a group) at a time.

Groups share nothing while every region is up: each is one model's queue in one region
with its own replicas and admission. So each runs as a simulation of its own, in a pool
of forked processes that read the workload from the parent's memory and write each
request's outcome into arrays the parent shares with them. The one thing that crosses
groups is a region's loss: the lost region's groups run first, up to the loss, and hand
what they held to the surviving groups of the same model, which run next with those
requests sent again 100 ms after the loss (as `control/sim/simulate.py` does in one process).

What differs from one process: requests that reach the lost region after the loss, and
what it held, are spread over the other regions by a draw made here, once per typing
session, rather than by the simulation's own, once per request. Queueing inside a group
is the same code on the same arrivals.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from control.sim.config import SimConfig
from control.sim.result import SimResult
from control.sim.simulate import Simulation
from control.sim.workload import Workload

_SEED = 4242  # the draw that spreads the lost region's requests


@dataclass
class _Shared:
    """What the pool's processes inherit at fork: inputs to read, outputs to write."""

    config: SimConfig
    workload: Workload
    arrival_group: np.ndarray  # int16: the group each request reaches when it is sent
    state: np.ndarray  # uint8, shared
    start_ms: np.ndarray  # float64, shared
    end_ms: np.ndarray  # float64, shared


_shared: _Shared | None = None


def _shared_array(n: int, dtype: Any) -> np.ndarray:
    """An array the parent and its forked children see alike (an anonymous shared mapping)."""
    size = max(1, n * np.dtype(dtype).itemsize)
    return np.frombuffer(mmap.mmap(-1, size), dtype=dtype, count=n)


def _subset(workload: Workload, idx: np.ndarray) -> Workload:
    """The requests `idx` (ascending, then any sent again) with `prev` pointing inside them."""
    prev = workload.prev[idx]
    if np.any(prev >= 0):  # `idx` is its arrivals in order, then the resent in any order
        order = np.argsort(idx, kind="stable")
        at = order[np.minimum(np.searchsorted(idx, prev, sorter=order), len(idx) - 1)]
        prev = np.where((prev >= 0) & (idx[at] == prev), at, -1)
    return Workload(
        workload.t_ms[idx],
        workload.paid[idx],
        np.zeros(len(idx), dtype=np.int8),
        np.zeros(len(idx), dtype=np.int8),
        prev.astype(np.int32),
        workload.prompt_tokens[idx],
        workload.output_tokens[idx],
    )


def _group_config(config: SimConfig, group: int) -> SimConfig:
    num_models = len(config.models)
    region, model = divmod(group, num_models)
    name = config.models[model]
    return replace(
        config,
        replicas=[config.replicas[model]],
        models=[name],
        regions=1,
        costs={name: config.costs[name]} if name in config.costs else {},
        host_loss_at_s=config.host_loss_at_s if group == 0 else None,
        region_loss_at_s=None,
    )


def _run_group(group: int, resend: list[tuple[float, int]]) -> dict[str, Any]:
    """Simulate one group: its own arrivals, then `resend` (time, request) sent to it."""
    shared = _shared
    assert shared is not None
    arrivals = np.flatnonzero(shared.arrival_group == group)
    again = np.asarray([j for _, j in resend], dtype=np.int64)
    idx = np.concatenate([arrivals, again])
    if len(idx) == 0:
        return {"group": group, "stats": {}, "batch_sizes": np.zeros(0, dtype=np.int32), "handed_off": []}
    num_models = len(shared.config.models)
    loss_at_s = shared.config.region_loss_at_s
    lost = loss_at_s * 1000.0 if loss_at_s is not None and group // num_models == 0 else None
    run = Simulation(
        _group_config(shared.config, group),
        _subset(shared.workload, idx),
        arrivals=len(arrivals),
        resend=[(at, len(arrivals) + k) for k, (at, _) in enumerate(resend)],
        region_loss_ms=lost,
    )
    result = run.run()
    shared.state[idx] = result.state
    shared.start_ms[idx] = result.start_ms
    shared.end_ms[idx] = result.end_ms
    return {
        "group": group,
        "stats": result.stats,
        "batch_sizes": result.batch_sizes,
        "handed_off": [(at, int(idx[j])) for at, j in run.handed_off],
    }


def used_processes(config: SimConfig, processes: int | None = None) -> int:
    """How many processes `simulate_split` runs: as asked (default: one per core), at most
    one per group."""
    return max(1, min(processes or os.cpu_count() or 1, config.regions * len(config.models)))


def simulate_split(config: SimConfig, workload: Workload, processes: int | None = None) -> SimResult:
    """`simulate(config, workload)` with each group in a process of its own (`processes`
    at a time; default: one per core). The same result for any number of processes."""
    global _shared
    num_models, n = len(config.models), len(workload)
    loss_ms = config.region_loss_at_s * 1000.0 if config.region_loss_at_s is not None else None
    region = workload.region.astype(np.int16)
    elsewhere = _elsewhere(config, workload) if loss_ms is not None else region
    if loss_ms is not None:  # sent to the lost region after the loss: another region instead
        moved = (region == 0) & (workload.t_ms >= loss_ms)
        region[moved] = elsewhere[moved]
    arrival_group = (region * num_models + workload.model).astype(np.int16)
    final_group = arrival_group.copy()
    _shared = _Shared(
        config,
        workload,
        arrival_group,
        _shared_array(n, np.uint8),
        _shared_array(n, np.float64),
        _shared_array(n, np.float64),
    )
    groups = list(range(config.regions * num_models))
    first = groups[:num_models] if loss_ms is not None else []
    rest = sorted(set(groups) - set(first), key=lambda g: -int(np.count_nonzero(arrival_group == g)))
    processes = used_processes(config, processes)
    outputs: list[dict[str, Any]] = []
    try:
        if processes == 1:
            outputs += [_run_group(g, []) for g in first]
            resends = _spread(outputs, config, elsewhere, final_group)
            outputs += [_run_group(g, resends.get(g, [])) for g in rest]
        else:
            with multiprocessing.get_context("fork").Pool(processes) as pool:
                outputs += pool.starmap(_run_group, [(g, []) for g in first], chunksize=1)
                resends = _spread(outputs, config, elsewhere, final_group)
                outputs += pool.starmap(_run_group, [(g, resends.get(g, [])) for g in rest], chunksize=1)
        return _merge(config, workload, outputs, final_group)
    finally:
        _shared = None


def _elsewhere(config: SimConfig, workload: Workload) -> np.ndarray:
    """The region each of the lost region's requests goes to if it is sent after the loss or
    held at it: drawn once per typing session (its requests follow their first), so a
    newer request still finds the one it supersedes."""
    rng = np.random.default_rng(_SEED)
    target = workload.region.astype(np.int16)
    lost = target == 0
    target[lost] = rng.integers(1, config.regions, int(lost.sum()))
    follows = np.flatnonzero(lost & (workload.prev >= 0))
    before = workload.prev[follows]
    while len(follows):  # down the sessions' chains, a link a pass
        changed = target[before] != target[follows]
        if not changed.any():
            break
        target[follows] = target[before]
    return target


def _spread(
    outputs: list[dict[str, Any]], config: SimConfig, elsewhere: np.ndarray, final_group: np.ndarray
) -> dict[int, list[tuple[float, int]]]:
    """What the lost region's groups held, each to a surviving region's group of its model."""
    num_models = len(config.models)
    resends: dict[int, list[tuple[float, int]]] = {}
    for out in outputs:
        model = out["group"] % num_models
        for at, j in out["handed_off"]:
            group = int(elsewhere[j]) * num_models + model
            resends.setdefault(group, []).append((at, j))
            final_group[j] = group
    return resends


def _merge(config: SimConfig, workload: Workload, outputs: list[dict[str, Any]], group: np.ndarray) -> SimResult:
    assert _shared is not None
    stats: dict[str, int] = {}
    for out in outputs:
        for key, value in out["stats"].items():
            stats[key] = stats.get(key, 0) + value
    sizes = [out["batch_sizes"] for out in outputs]
    return SimResult(
        config=config,
        workload=workload,
        state=_shared.state,
        start_ms=_shared.start_ms,
        end_ms=_shared.end_ms,
        group=group,
        stats=stats,
        batch_sizes=np.concatenate(sizes).astype(np.int32) if sizes else np.zeros(0, dtype=np.int32),
    )
