"""`keybatch capacity`: how many replicas serve a peak rate within the SLO, surviving the
loss of a region. First the statement's arithmetic, then the simulator (control/sim/simulate.py,
the live batching, pull and admission policy on a virtual clock) finds the smallest
count per region whose p99 plus the network's round trip meets the SLO while one region
is lost and the others carry all the traffic.

Regions share nothing and each model has its own queue, so one surviving region's queue
of one model is simulated at its share of the peak and the fleet is that group times
the regions and models (the groups are alike: no traffic crosses between them).
control/sim/capacity_cli.py reads the command's arguments and prints the plan.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import resource
import time
from dataclasses import dataclass
from typing import Any

from control.core.vocab import ArrivalProfile
from control.sim.config import SimConfig
from control.sim.cost import CONTEXT_TOKENS, MEAN_OUTPUT_TOKENS, CostModel
from control.sim.result import SimResult
from control.sim.simulate import simulate
from control.sim.split import simulate_split, used_processes
from control.sim.workload import Workload, make_workload
from tasks.policy.hedging import HEDGE_MODES


@dataclass
class Inputs:
    rps: float = 40_000.0
    max_batch: int = 64
    batch_ms: float = 250.0
    cost: CostModel | None = None
    slo_ms: float = 600.0
    network_ms: float = 60.0
    headroom: float = 0.2
    regions: int = 3
    paid_fraction: float = 0.2
    models: dict[str, float] | None = None
    sim_seconds: float = 60.0
    search_seconds: float = 20.0
    profile: ArrivalProfile = "poisson"
    seed: int = 1
    max_queue_paid: int = 10**9
    max_queue_free: int = 10**9
    min_answered: float = 0.999
    policy: str = "static"
    scope: str = "region"  # the final run: one surviving region, or the whole fleet losing a region
    cell: int = 128  # a queue with more replicas is simulated as this many at their per-replica rate
    processes: int = 0  # the final run's groups run in this many processes (0: one per core)
    broker_core_rps: float = 12_500.0  # requests a second one broker core carries (`keybatch bench broker`)
    broker_utilization: float = 0.5  # the share of a broker's core to plan on
    host_loss: bool = False  # also run a host's loss at the recommended counts, hedging off, paid and all
    host_size: int = 8  # replicas a host carries
    tier_loads: tuple[float, ...] = ()  # also paid and free latency at these shares of a region's capacity
    stagger_saturated: bool = True  # simulated replicas stagger full batches as live ones do (SimConfig)
    single_listener: bool = True  # idle replicas leave arrivals to one gathering (SINGLE_LISTENER)
    hedge_idle: bool = True  # with hedging on, idle replicas run batches of copies (HEDGE_IDLE)
    spare_hosts: int = 0  # hosts of `host_size` replicas of the first model added per region

    def __post_init__(self) -> None:
        self.models = self.models or {"kb-small": 1.0}
        if self.rps <= 0 or self.max_batch < 1 or self.batch_ms <= 0:
            raise ValueError("rps, max-batch and batch-ms must be positive")
        if self.spare_hosts < 0 or self.host_size < 1:
            raise ValueError("spare-hosts must be at least 0 and host-size at least 1")
        if not 0 <= self.headroom < 1:
            raise ValueError("headroom must be in [0, 1)")
        if self.regions < 1:
            raise ValueError("regions must be at least 1")
        if self.slo_ms <= self.network_ms:
            raise ValueError("the SLO must exceed the network's round trip")
        if not 0 <= self.paid_fraction <= 1:
            raise ValueError("paid-fraction must be in [0, 1]")
        if min(self.models.values()) <= 0:
            raise ValueError("model shares must be positive")
        if any(load <= 0 for load in self.tier_loads):
            raise ValueError("tier loads must be positive")
        if self.policy not in ("static", "continuous"):
            raise ValueError("policy must be static or continuous")
        if self.scope not in ("region", "fleet"):
            raise ValueError("scope must be region or fleet")
        if self.policy == "continuous" and self.cost is None:
            raise ValueError("the continuous policy needs --cost-model (an engine curve)")
        if self.cell < 1 or self.sim_seconds <= 0 or self.search_seconds <= 0:
            raise ValueError("cell, sim-seconds and search-seconds must be positive")
        if self.processes < 0:
            raise ValueError("processes must be 0 (one per core) or more")
        if self.broker_core_rps <= 0 or not 0 < self.broker_utilization <= 1:
            raise ValueError("broker-core-rps must be positive and broker-utilization in (0, 1]")

    @property
    def shares(self) -> dict[str, float]:
        assert self.models is not None
        total = sum(self.models.values())
        return {name: share / total for name, share in self.models.items()}

    @property
    def surviving(self) -> int:
        """Regions left after losing one (a single region has nothing to lose to)."""
        return max(1, self.regions - 1)

    @property
    def budget_ms(self) -> float:
        return self.slo_ms - self.network_ms


def parse_models(text: str) -> dict[str, float]:
    """`kb-small=0.8,kb-large=0.2` (a bare name has share 1)."""
    models: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, share = part.partition("=")
        try:
            models[name.strip()] = float(share) if share else 1.0
        except ValueError as exc:
            raise ValueError(f"bad model share {part!r}: expected NAME=SHARE") from exc
    if not models:
        raise ValueError("no models given")
    return models


# -- arithmetic ---------------------------------------------------------------------------------


def batch_ms_at(inputs: Inputs, size: int) -> float:
    """The time `size` requests take together: one batch (static), or on a continuous
    engine kept `size` full, each prompt's prefill plus the mean output's decode steps at
    that batch size (the engine's throughput)."""
    if inputs.cost is None:
        return inputs.batch_ms
    if inputs.policy == "continuous":
        return size * inputs.cost.prefill_ms_for(300) + MEAN_OUTPUT_TOKENS * inputs.cost.step_ms(size, CONTEXT_TOKENS)
    return inputs.cost.expected_batch_ms(size)


def arithmetic(inputs: Inputs) -> dict[str, Any]:
    """The statement's figures: one replica's rate, then counts at 100% and with headroom,
    per region and with one region lost."""
    full = inputs.max_batch * 1000.0 / batch_ms_at(inputs, inputs.max_batch)
    half_size = max(1, inputs.max_batch // 2)
    half = half_size * 1000.0 / batch_ms_at(inputs, half_size)
    usable = full * (1.0 - inputs.headroom)
    replicas_min = math.ceil(inputs.rps / full - 1e-9)
    with_headroom = math.ceil(inputs.rps / usable - 1e-9)
    per_region_normal = math.ceil(inputs.rps / inputs.regions / usable - 1e-9)
    per_region_survive = math.ceil(inputs.rps / inputs.surviving / usable - 1e-9)
    per_model = {
        name: {
            "rps": inputs.rps * share,
            "replicas_min": math.ceil(inputs.rps * share / full - 1e-9),
            "per_region_one_lost": math.ceil(inputs.rps * share / inputs.surviving / usable - 1e-9),
        }
        for name, share in inputs.shares.items()
    }
    return {
        "batch_ms_full": round(batch_ms_at(inputs, inputs.max_batch), 1),
        "replica_rps_full": round(full, 3),
        "replica_rps_half": round(half, 3),
        "replicas_exact": round(inputs.rps / full, 3),
        "replicas_min": replicas_min,
        "replicas_with_headroom": with_headroom,
        "per_region_normal": per_region_normal,
        "per_region_one_lost": per_region_survive,
        "replicas_arithmetic": per_region_survive * inputs.regions,
        "utilization_normal": round(inputs.rps / inputs.regions / (per_region_survive * full), 3),
        "utilization_one_lost": round(inputs.rps / inputs.surviving / (per_region_survive * full), 3),
        "per_model": per_model,
        "broker_cells": broker_cells(inputs, per_region_survive),
    }


def broker_cells(inputs: Inputs, replicas_per_region: int) -> dict[str, Any]:
    """Broker cells a region needs (each a broker primary and its own replicas): enough
    that with one region lost and then one of its cells lost too, each remaining cell
    carries at most its planned share of a core. A cell lost moves its routes evenly to
    the others (control/policy/cells.py)."""
    cell_rps = inputs.broker_core_rps * inputs.broker_utilization
    normal = inputs.rps / inputs.regions
    survive = inputs.rps / inputs.surviving
    needed = max(1, math.ceil(survive / cell_rps - 1e-9))
    cells = needed + 1 if needed > 1 else 2  # one more: a cell may be lost too
    return {
        "cell_rps_planned": round(cell_rps, 1),
        "cells_per_region": cells,
        "replicas_per_cell": math.ceil(replicas_per_region / cells),
        "cell_rps_normal": round(normal / cells, 1),
        "cell_rps_one_region_lost": round(survive / cells, 1),
        "cell_rps_one_region_and_one_cell_lost": round(survive / (cells - 1), 1),
        "core_share_one_region_and_one_cell_lost": round(survive / (cells - 1) / inputs.broker_core_rps, 3),
    }


# -- simulation ---------------------------------------------------------------------------------


def sim_config(inputs: Inputs, replicas: list[int], models: list[str], regions: int = 1) -> SimConfig:
    costs = {name: inputs.cost for name in models} if inputs.cost else {}
    return SimConfig(
        replicas=replicas,
        models=models,
        regions=regions,
        max_batch=inputs.max_batch,
        batch_ms=inputs.batch_ms,
        costs=costs,
        policy=inputs.policy,
        budget_ms=inputs.budget_ms,
        max_queue_paid=inputs.max_queue_paid,
        max_queue_free=inputs.max_queue_free,
        stagger_saturated=inputs.stagger_saturated,
        concentrate_idle=inputs.single_listener,
    )


def run_group(inputs: Inputs, model: str, replicas: int, rps: float, seconds: float) -> SimResult:
    """One model's queue in one region at `rps`; a queue of more than `cell` replicas is
    simulated as `cell` of them at the same rate per replica (pessimistic: a bigger pool
    only spreads the starts thinner)."""
    if replicas > inputs.cell:
        rps, replicas = rps * inputs.cell / replicas, inputs.cell
    workload = make_workload(rps, seconds, profile=inputs.profile, paid_fraction=inputs.paid_fraction, seed=inputs.seed)
    return simulate(sim_config(inputs, [replicas], [model]), workload)


def meets(inputs: Inputs, result: SimResult) -> bool:
    summary = result.summary(inputs.network_ms)
    return (
        "p99_ms" in summary
        and summary["p99_ms"] <= inputs.slo_ms
        and summary["answered_200_share"] >= inputs.min_answered
    )


def search(inputs: Inputs, model: str, rps: float, start: int, limit: int = 64) -> tuple[int | None, list[dict]]:
    """The smallest replica count for one surviving region's queue of `model` whose simulated
    p99 + network meets the SLO with at least `min_answered` answered 200; counts from
    `start` (100% utilization) upward, at most `limit` steps (None: none met it)."""
    tried: list[dict] = []
    step = max(1, start // 50)
    count = start
    for _ in range(limit):
        result = run_group(inputs, model, count, rps, inputs.search_seconds)
        summary = result.summary(inputs.network_ms)
        tried.append(
            {"replicas": count, "p99_ms": summary.get("p99_ms"), "answered_200_share": summary["answered_200_share"]}
        )
        if meets(inputs, result):
            if step > 1 and count > start:  # refine one by one above the last failing count
                for lower in range(count - step + 1, count):
                    res = run_group(inputs, model, lower, rps, inputs.search_seconds)
                    s = res.summary(inputs.network_ms)
                    tried.append(
                        {"replicas": lower, "p99_ms": s.get("p99_ms"), "answered_200_share": s["answered_200_share"]}
                    )
                    if meets(inputs, res):
                        return lower, tried
            return count, tried
        count += step
    return None, tried


def _cpu_s() -> float:
    """CPU seconds of this process and of its ended children (the simulation's pool)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _searched(tasks: list[tuple[Inputs, str, float, int]], processes: int) -> list[tuple[int | None, list[dict]]]:
    """`search` for each model, the models' searches side by side in processes of their own."""
    processes = max(1, min(processes or os.cpu_count() or 1, len(tasks)))
    if processes == 1:
        return [search(*task) for task in tasks]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return pool.starmap(search, tasks, chunksize=1)


@dataclass
class FinalRun:
    """The final run's figures, whichever way it ran (the fleet, one region, or cells)."""

    summary: dict[str, Any]
    per_tier: dict[str, Any]
    per_model: dict[str, Any]
    num_requests: int
    mean_batch: float
    scope: str
    processes: int
    by_region: dict[str, Any] | None = None


def plan(inputs: Inputs) -> dict[str, Any]:
    """Arithmetic, the search per model, and a final run of one surviving region at the
    recommended counts for `sim_seconds`."""
    out: dict[str, Any] = {"inputs": _inputs_json(inputs), "arithmetic": arithmetic(inputs)}
    why_not = _why_not(inputs, out["arithmetic"])
    if why_not is not None:
        out["why_not"] = why_not
    recommended, out["search"] = _recommend(inputs, out["arithmetic"], searching=why_not is None)
    counts = _counts(inputs, out, recommended)
    started, cpu_started = time.perf_counter(), _cpu_s()
    run = _final_run(inputs, list(inputs.shares), counts)
    wall, cpu = time.perf_counter() - started, _cpu_s() - cpu_started
    for key in ("replicas_min", "replica_rps_full", "replica_rps_half"):
        out[key] = out["arithmetic"][key]
    out["p50_ms"] = run.summary.get("p50_ms")
    out["p99_ms"] = run.summary.get("p99_ms")
    out["simulated"] = _simulated(inputs, run, wall, cpu)
    if inputs.host_loss:
        out["host_loss"] = [
            host_loss(inputs, list(inputs.shares), counts, inputs.rps / inputs.regions, "every region up"),
            host_loss(inputs, list(inputs.shares), counts, inputs.rps / inputs.surviving, "one region lost"),
        ]
    if inputs.tier_loads:
        first = next(iter(inputs.shares))
        out["tiers_by_load"] = {first: tier_curve(inputs, first, counts[0], list(inputs.tier_loads))}
    return out


def host_loss(inputs: Inputs, models: list[str], counts: list[int], region_rps: float, why: str) -> dict[str, Any]:
    """A region at the recommended counts and `region_rps` loses a host of `host_size`
    replicas of its first model halfway through, the one that runs and holds the most
    requests then, back 5 s later: what its users see with each hedging mode
    (tasks/policy/hedging.py), on the same arrivals."""
    workload = _workload(inputs, models, region_rps)
    paid = workload.paid.astype(bool)
    out: dict[str, Any] = {
        "scope": f"a region at {region_rps:.0f} req/s ({why})",
        "host": f"{inputs.host_size} replicas of {models[0]}",
        "lost_at_s": inputs.sim_seconds / 2,
        "requests": len(workload),
    }
    for mode in HEDGE_MODES:
        config = sim_config(inputs, counts, models)
        config.host_loss_at_s, config.host_size, config.hedge = inputs.sim_seconds / 2, inputs.host_size, mode
        config.hedge_idle = inputs.hedge_idle  # nothing to copy with hedging off
        config.host_loss_busiest = True
        result = simulate_split(config, workload, used_processes(config, inputs.processes or None))
        outcomes = result.counts()
        out[mode] = {
            "not_200": len(workload) - outcomes.get("ok", 0),
            "outcomes": outcomes,
            "paid_outcomes": result.counts(paid),
            "p99_ms": result.summary(inputs.network_ms).get("p99_ms"),
            **{key: result.stats.get(key, 0) for key in ("hedged", "hedge_wins", "hedge_wasted", "idle_copy_batches")},
        }
    return out


def _why_not(inputs: Inputs, arithmetic: dict[str, Any]) -> str | None:
    """Why no count can do: a static batch longer than the budget (else None)."""
    floor_ms = arithmetic["batch_ms_full"] + 15.0  # one full batch and the margin
    if inputs.policy == "static" and inputs.budget_ms < floor_ms:
        return (
            f"a full batch takes {floor_ms - 15:.0f} ms on this engine: a budget of {inputs.budget_ms:.0f} ms "
            "(SLO less network) is below one batch, and admission answers 504 at once at any replica count"
        )
    return None


def _recommend(
    inputs: Inputs, arithmetic: dict[str, Any], searching: bool
) -> tuple[dict[str, int | None], dict[str, list[dict]]]:
    """Each model's smallest count per surviving region that meets the SLO (None: none
    found, or no search), and the counts each search tried."""
    recommended: dict[str, int | None] = {}
    searches: dict[str, list[dict]] = {name: [] for name in inputs.shares}
    tasks = []
    for name, share in inputs.shares.items():
        if not searching:
            recommended[name] = None
            continue
        rps = inputs.rps * share / inputs.surviving
        start = arithmetic["per_model"][name]["replicas_min"]
        tasks.append((inputs, name, rps, max(1, math.ceil(start / inputs.surviving))))
    for task, (count, tried) in zip(tasks, _searched(tasks, inputs.processes), strict=True):
        recommended[task[1]], searches[task[1]] = count, tried
    return recommended, searches


def _counts(inputs: Inputs, out: dict[str, Any], recommended: dict[str, int | None]) -> list[int]:
    """The counts per region the final run uses, by model (the arithmetic's where the search
    found none), written into `out` with whether the SLO was met."""
    if any(r is None for r in recommended.values()):
        out["met"] = False
        out["replicas_per_region"] = None
        out["replicas"] = None
        per_model = out["arithmetic"]["per_model"]
        fallback = {n: r or per_model[n]["per_region_one_lost"] for n, r in recommended.items()}
    else:
        out["met"] = True
        fallback = {n: int(r) for n, r in recommended.items() if r is not None}
    models = list(inputs.shares)
    counts = [fallback[n] for n in models]
    # The search's count carries the peak with a region lost; a spare host more carries it
    # with a host lost too. The final run and the host's loss run with the spares.
    out["searched_per_region_by_model"] = dict(zip(models, counts, strict=True)) if out["met"] else None
    out["spare_per_region"] = inputs.spare_hosts * inputs.host_size
    counts[0] += out["spare_per_region"]
    out["replicas_per_region_by_model"] = dict(zip(models, counts, strict=True))
    if out["met"]:
        out["replicas_per_region"] = sum(counts)
        out["replicas"] = sum(counts) * inputs.regions
    return counts


def _final_run(inputs: Inputs, models: list[str], counts: list[int]) -> FinalRun:
    """One surviving region carrying its share of the whole peak (or the whole fleet)."""
    if inputs.scope == "fleet":
        return _run_fleet(inputs, models, counts)
    if all(c <= inputs.cell for c in counts):
        return _run_region(inputs, models, counts)
    return _run_cells(inputs, models, counts)


def _workload(inputs: Inputs, models: list[str], rps: float, regions: int = 1) -> Workload:
    """The final runs' arrivals: `sim_seconds` at `rps`, split over the models by share."""
    return make_workload(
        rps,
        inputs.sim_seconds,
        profile=inputs.profile,
        paid_fraction=inputs.paid_fraction,
        model_shares=[inputs.shares[n] for n in models],
        regions=regions,
        seed=inputs.seed,
    )


def _run_fleet(inputs: Inputs, models: list[str], counts: list[int]) -> FinalRun:
    """Every region at its third of the peak, the first lost a third of the way in."""
    loss_at = inputs.sim_seconds / 3 if inputs.regions > 1 else None
    workload = _workload(inputs, models, inputs.rps, regions=inputs.regions)
    config = sim_config(inputs, counts, models, regions=inputs.regions)
    config.region_loss_at_s = loss_at
    processes = used_processes(config, inputs.processes or None)
    result = simulate_split(config, workload, processes)
    by_region = result.by_region(inputs.network_ms)
    if loss_at is not None:
        after = workload.t_ms >= loss_at * 1000.0
        by_region["after_the_loss"] = result.summary(inputs.network_ms, after)
        by_region["resent"] = {"requests": result.stats["resent"]}
    scope = f"the whole fleet: {inputs.regions} regions at {inputs.rps:.0f} req/s" + (
        f", region 0 lost at {loss_at:.0f} s" if loss_at is not None else ""
    )
    return _whole(inputs, models, result, scope, processes, by_region)


def _run_region(inputs: Inputs, models: list[str], counts: list[int]) -> FinalRun:
    """One surviving region, every model's queue in one run."""
    region_rps = inputs.rps / inputs.surviving
    workload = _workload(inputs, models, region_rps)
    config = sim_config(inputs, counts, models)
    processes = used_processes(config, inputs.processes or None)
    result = simulate_split(config, workload, processes)
    scope = f"one of {inputs.surviving} surviving regions ({region_rps:.0f} req/s)"
    return _whole(inputs, models, result, scope, processes)


def _whole(
    inputs: Inputs,
    models: list[str],
    result: SimResult,
    scope: str,
    processes: int,
    by_region: dict[str, Any] | None = None,
) -> FinalRun:
    """A run of every model's queue together, summarised."""
    workload = result.workload
    return FinalRun(
        summary=result.summary(inputs.network_ms),
        per_tier=result.by_tier(inputs.network_ms),
        per_model={n: result.summary(inputs.network_ms, workload.model == k) for k, n in enumerate(models)},
        num_requests=len(workload),
        mean_batch=result.mean_batch(),
        scope=scope,
        processes=processes,
        by_region=by_region,
    )


def _run_cells(inputs: Inputs, models: list[str], counts: list[int]) -> FinalRun:
    """Each model's queue apart, as a cell, one after the other; the overall figures are
    the worst model's."""
    region_rps = inputs.rps / inputs.surviving
    results = {
        n: run_group(inputs, n, c, region_rps * inputs.shares[n], inputs.sim_seconds)
        for n, c in zip(models, counts, strict=True)
    }
    per_model = {n: r.summary(inputs.network_ms) for n, r in results.items()}
    worst = max(models, key=lambda n: per_model[n].get("p99_ms") or 0.0)
    scope = (
        f"one of {inputs.surviving} surviving regions ({region_rps:.0f} req/s), each model's queue as a cell of "
        f"{inputs.cell} replicas at its per-replica rate; overall figures are the worst model's ({worst})"
    )
    return FinalRun(
        summary=per_model[worst],
        per_tier=results[worst].by_tier(inputs.network_ms),
        per_model=per_model,
        num_requests=sum(len(r.workload) for r in results.values()),
        mean_batch=results[worst].mean_batch(),
        scope=scope,
        processes=1,
    )


def _simulated(inputs: Inputs, run: FinalRun, wall: float, cpu: float) -> dict[str, Any]:
    """The final run's section of the plan."""
    simulated = {
        "scope": run.scope
        if inputs.scope == "fleet"
        else f"{run.scope}; regions and model queues share nothing, so the fleet is this times {inputs.regions}",
        "policy": inputs.policy,
        "seconds": inputs.sim_seconds,
        "requests": run.num_requests,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),  # the wall time on a core of its own
        "processes": run.processes,
        "requests_per_wall_s": round(run.num_requests / wall),
        "mean_batch": round(run.mean_batch, 2),
        **run.summary,
        "per_tier": run.per_tier,
        "per_model": run.per_model,
    }
    if run.by_region is not None:
        simulated["per_region"] = run.by_region
    return simulated


def load_curve(inputs: Inputs, model: str, replicas: int, loads: list[float]) -> list[dict]:
    """p99 at a fixed count per region as the offered load (a multiple of the design rate) varies."""
    rps = inputs.rps * inputs.shares[model] / inputs.surviving
    points = []
    for load in loads:
        s = run_group(inputs, model, replicas, rps * load, inputs.search_seconds).summary(inputs.network_ms)
        points.append({"load": load, "p99_ms": s.get("p99_ms"), "answered_200_share": s["answered_200_share"]})
    return points


def tier_curve(inputs: Inputs, model: str, replicas: int, loads: list[float]) -> list[dict]:
    """Paid and free latency in one region's queue of `replicas` as the offered load, a share
    of their capacity (full batches back to back), varies."""
    capacity = replicas * inputs.max_batch * 1000.0 / batch_ms_at(inputs, inputs.max_batch)
    points = []
    for load in loads:
        result = run_group(inputs, model, replicas, capacity * load, inputs.search_seconds)
        point: dict[str, Any] = {"load": load, "rps": round(capacity * load, 1)}
        for tier, s in result.by_tier(inputs.network_ms).items():
            point[tier] = {k: s.get(k) for k in ("p50_ms", "p99_ms", "answered_200_share")}
        point["status_504"] = sum(n for k, n in result.counts().items() if k in ("expired_504", "late_504"))
        points.append(point)
    return points


def replica_curve(inputs: Inputs, model: str, counts: list[int]) -> list[dict]:
    """p99 and answered share at the design rate as the count per region varies."""
    rps = inputs.rps * inputs.shares[model] / inputs.surviving
    points = []
    for count in counts:
        s = run_group(inputs, model, count, rps, inputs.search_seconds).summary(inputs.network_ms)
        points.append({"replicas": count, "p99_ms": s.get("p99_ms"), "answered_200_share": s["answered_200_share"]})
    return points


def _inputs_json(inputs: Inputs) -> dict[str, Any]:
    fields = {k: v for k, v in vars(inputs).items() if k != "cost"}
    fields["cost_model"] = inputs.cost.name if inputs.cost else None
    return fields
