"""`keybatch bench tiers-sim`: paid against free in the simulator, each case with one switch
off and on: the rest of each static batch handed back to the queue (`HAND_BACK_REST`, and
how far urgency looks then, `SimConfig.rest_horizon`, a share of a slot), busy replicas
pulling their next batch before their lead (`PULL_EARLY`), admission counting the
starts the replicas' phases hold (`ADMIT_PHASED`), arrivals going to an idle replica
already gathering a batch rather than to the next idle one in line
(`SINGLE_LISTENER`, `SimConfig.concentrate_idle`), free requests admitted with no room
kept for paid ones, which bump them where they must (`ADMIT_BUMP`, `SimConfig.admit_bump`),
or, with one listener at a time in both arms, busy replicas yielding their lead to an idle
listener (`LEAD_YIELDS`, `SimConfig.lead_yields`), or admission as deep as the best phase
allows while the demand is below capacity (`ADMIT_OPEN`, `SimConfig.admit_open`).

Each case is R replicas of batch B on the fixed 250 ms backend (plus up to `--jitter-ms`,
as batches stretch on a CPU-bound machine), 30% paid, a 600 ms budget and free-slot
hedging on (`all`, the default), at shares of R x B per 250 ms. The runs are independent:
they go side by side in `--processes` processes.
"""

from __future__ import annotations

import argparse
from multiprocessing import get_context
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table

from control.bench.report import write_sim_figures
from control.sim.config import SimConfig
from control.sim.simulate import simulate
from control.sim.workload import make_workload
from tasks.policy.collector import REST_HORIZON


class Run(NamedTuple):
    replicas: int
    batch: int
    load: float
    seconds: float
    jitter: float
    hand_back: bool = False
    horizon: float = REST_HORIZON
    early: bool = False
    phased: bool = False
    concentrate: bool = False
    bump: bool = False
    lead_yields: bool = True
    admit_open: bool = True


# Each switch's field of `Run`, and the key its arm has in a run's figures.
SWITCHES = {
    "hand-back": ("hand_back", "hand_back_rest"),
    "pull-early": ("early", "pull_early"),
    "admit-phased": ("phased", "admit_phased"),
    "concentrate": ("concentrate", "concentrate_idle"),
    "bump": ("bump", "admit_bump"),
    "lead-yields": ("lead_yields", "lead_yields"),
    "admit-open": ("admit_open", "admit_open"),
}


def _one(run: Run) -> dict[str, Any]:
    replicas, batch, load, seconds, jitter, hand_back, horizon, early, phased, concentrate, bump, yields, open_ = run
    config = SimConfig(
        replicas=[replicas],
        max_batch=batch,
        budget_ms=600,
        hedge="all",
        hand_back_rest=hand_back,
        rest_horizon=horizon,
        pull_early=early,
        batch_jitter_ms=jitter,
        admit_phased=phased,
        concentrate_idle=concentrate,
        admit_bump=bump,
        lead_yields=yields,
        admit_open=open_,
    )
    result = simulate(config, make_workload(load * replicas * batch * 4, seconds, paid_fraction=0.3, seed=1))
    tiers, counts = result.by_tier(), result.counts()
    out: dict[str, Any] = {
        "replicas": replicas,
        "max_batch": batch,
        "load": load,
        "hand_back_rest": hand_back,
        "rest_horizon": horizon if hand_back else None,
        "pull_early": early,
        "batch_jitter_ms": jitter,
        "admit_phased": phased,
        "concentrate_idle": concentrate,
        "admit_bump": bump,
        "lead_yields": yields,
        "admit_open": open_,
        "bumped": result.stats["bumped"],
        "ok_per_s": round(counts.get("ok", 0) / seconds, 1),
        "status_429": counts.get("refused_429", 0),
        "status_504": counts.get("expired_504", 0) + counts.get("late_504", 0),
        "rest_handed_back": result.stats["rest_handed_back"],
        "mean_batch": round(result.mean_batch(), 1),
    }
    for tier, s in tiers.items():
        out[tier] = {k: s.get(k) for k in ("p50_ms", "p99_ms", "answered_200_share", "queue_p50_ms", "queue_p99_ms")}
    out["paid_p99_over_free_p99"] = round(tiers["paid"]["p99_ms"] / tiers["free"]["p99_ms"], 3)
    return out


def run_tiers_sim(args: argparse.Namespace) -> int:
    try:
        cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
        loads = [float(x) for x in args.loads.split(",")]
        horizons = [float(x) for x in args.horizons.split(",") if x.strip()]
    except ValueError as exc:
        print(f"keybatch bench tiers-sim: {exc}")
        return 2
    field, key = SWITCHES[args.switch]
    both = {"concentrate": True} if args.switch == "lead-yields" else {}  # it applies to one listener
    runs = [
        Run(r, b, load, args.seconds, args.jitter_ms)._replace(**both, **{field: on})
        for r, b in cases
        for load in loads
        for on in (False, True)
    ]
    if args.switch == "hand-back":  # and other urgency horizons past capacity
        runs += [
            Run(r, b, load, args.seconds, args.jitter_ms, hand_back=True, horizon=h)
            for r, b in cases
            for load in (1.1, 2.0)
            for h in horizons
        ]
    with get_context("fork").Pool(max(1, args.processes)) as pool:
        results = pool.map(_one, runs, chunksize=1)
    switch = {
        "pull-early": "pull early",
        "admit-phased": "admit phased",
        "concentrate": "concentrate idle",
        "bump": "bump free",
        "lead-yields": "lead yields",
        "admit-open": "admit open",
    }.get(args.switch, "hand back the rest")
    table = Table(title=f"Paid against free, simulated ({switch}: off / on)")
    for col in ("case", "load", switch if args.switch != "hand-back" else "horizon", "answered 200/s", "429", "504"):
        table.add_column(col, justify="right")
    for col in ("paid p50", "free p50", "paid p99", "free p99", "paid/free p99"):
        table.add_column(col, justify="right")
    for r in results:
        if args.switch == "hand-back":
            arm = f"{r['rest_horizon']:.2f}" if r["hand_back_rest"] else "off"
        else:
            arm = "on" if r[key] else "off"
        table.add_row(
            f"{r['replicas']}x{r['max_batch']}",
            f"{r['load']:.0%}",
            arm,
            str(r["ok_per_s"]),
            str(r["status_429"]),
            str(r["status_504"]),
            str(r["paid"]["p50_ms"]),
            str(r["free"]["p50_ms"]),
            str(r["paid"]["p99_ms"]),
            str(r["free"]["p99_ms"]),
            str(r["paid_p99_over_free_p99"]),
        )
    Console().print(table)
    if args.json:
        write_sim_figures(args.json, args, runs=results)
    return 0
