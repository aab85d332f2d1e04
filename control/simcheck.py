"""`keybatch bench simcheck`: the simulator against the live fleet, same load.

For each load (a share of the fleet's capacity) a live deployment on the fixed backend
(`bench serving`'s, the simulated accelerator) takes open-loop Poisson load, then the
simulator (`control/sim.py`, on the same policy objects) runs the same configuration and
rate. The two p50/p99 are printed side by side with their ratio. The live figure counts
what the simulator does not model (HTTP in and out, the broker's round trips, the
shared cores), so the simulator also reports with `--overhead-ms` added, the live
fleet's own time measured at the lowest load.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from control.bench import FREE_KEY, _deployment, _hf_deployment
from control.loadgen import LoadSpec, generate, summarize
from control.ops import Operator
from control.settings import Settings
from control.sim import CostModel, SimConfig, make_workload, simulate

ENGINE_CURVE = Path(__file__).resolve().parent.parent / "docs" / "bench" / "engine-small.json"


def _pulls(s: Settings) -> tuple[int, int]:
    """The fleet's requests brought by a pull sent before the gate shut, and of those
    handed back, so far."""
    replicas = Operator(s).snapshot().replicas
    return sum(r.taken_shut for r in replicas), sum(r.handed_back for r in replicas)


def _sim(s: Settings, workers: int, rps: float, seconds: float, seed: int) -> dict[str, Any]:
    config = SimConfig(
        replicas=[workers],
        max_batch=s.max_batch,
        batch_ms=s.batch_ms,
        max_wait_ms=s.max_wait_ms,
        pull_lead_ms=s.pull_lead_ms,
        margin_ms=s.deadline_margin_ms,
        budget_ms=s.deadline_ms,
        max_queue_paid=s.max_queue_paid,
        max_queue_free=s.max_queue_free,
        pull_in_flight="hand_back" if s.hand_back_pulls else "keep",
    )
    result = simulate(config, make_workload(rps, seconds, paid_fraction=0.0, seed=seed))
    return {**result.summary(), "mean_batch": round(result.mean_batch(), 1), "taken_shut": result.stats["taken_shut"]}


def _hf(args: argparse.Namespace) -> dict[str, Any]:
    """The torch engine under continuous batching at one rate: live (kb-small, the
    workload of `bench policies`) against the simulator on the engine's measured curve."""
    from control import workloads

    bodies = workloads.mixed(400, seed=args.seed)
    deadline_ms = 5000.0
    with _hf_deployment(1, "continuous", "kb-small") as url:
        spec = LoadSpec(url, args.hf_rps, args.duration, "kb-small", free_key=FREE_KEY, deadline_ms=deadline_ms,
                        bodies=bodies, seed=args.seed)  # fmt: skip
        live = summarize(generate(spec))["all"]
    s = Settings()
    config = SimConfig(
        replicas=[1],
        max_batch=s.max_batch,
        policy="continuous",
        costs={"kb-small": CostModel.from_file(ENGINE_CURVE)},
        budget_ms=deadline_ms,
        max_wait_ms=s.max_wait_ms,
        margin_ms=s.deadline_margin_ms,
    )
    sim = simulate(config, make_workload(args.hf_rps, args.duration, paid_fraction=0.0, seed=args.seed)).summary()
    out = {
        "rps": args.hf_rps,
        "live": {"p50_ms": round(live["p50_ms"], 1), "p99_ms": round(live["p99_ms"], 1),
                 "ok_share": round(live["ok_share"], 5)},
        "sim": sim,
    }  # fmt: skip
    out["ratio_p50"] = round(live["p50_ms"] / sim["p50_ms"], 3) if sim.get("p50_ms") else None
    out["ratio_p99"] = round(live["p99_ms"] / sim["p99_ms"], 3) if sim.get("p99_ms") else None
    print(
        f"hf continuous at {args.hf_rps:g} req/s: live p50/p99 {live['p50_ms']:.0f}/{live['p99_ms']:.0f} ms, "
        f"sim {sim.get('p50_ms', 0):.0f}/{sim.get('p99_ms', 0):.0f} ms, "
        f"ratios {out['ratio_p50']}/{out['ratio_p99']}"
    )
    return out


def run_simcheck(args: argparse.Namespace) -> int:
    loads = [float(x) for x in args.loads.split(",") if x]
    rows: list[dict[str, Any]] = []
    with _deployment(args.workers, None) as (url, model, s):
        capacity = args.workers * s.max_batch * 1000.0 / s.batch_ms
        for load in loads:
            rps = load * capacity
            pulls = _pulls(s)
            live = summarize(generate(LoadSpec(url, rps, args.duration, model, free_key=FREE_KEY, seed=args.seed)))
            time.sleep(2 * s.heartbeat_s)  # the replicas' counters reach the registry with their heartbeat
            taken, handed = (after - before for after, before in zip(_pulls(s), pulls, strict=True))
            sim = _sim(s, args.workers, rps, args.duration, args.seed)
            a = live["all"]
            rows.append(
                {
                    "load": load,
                    "rps": round(rps, 1),
                    "live": {
                        "p50_ms": round(a["p50_ms"], 1),
                        "p99_ms": round(a["p99_ms"], 1),
                        "ok_share": round(a["ok_share"], 5),
                        "system_p50_ms": round(a["system_p50_ms"], 1),
                        "mean_batch": round(a["mean_batch"], 1),
                        "taken_shut": taken,
                        "handed_back": handed,
                    },
                    "sim": sim,
                }
            )
            print(f"load {load:.0%}: live p50/p99 {a['p50_ms']:.0f}/{a['p99_ms']:.0f} ms, "
                  f"sim {sim.get('p50_ms', 0):.0f}/{sim.get('p99_ms', 0):.0f} ms; pulled after the gate shut: "
                  f"live {taken} ({handed} handed back), sim {sim['taken_shut']}", flush=True)  # fmt: skip
    overhead = rows[0]["live"]["system_p50_ms"]  # the live path's own time where queues are short
    table = Table(title=f"simulator against the live fleet: {args.workers} replicas, fixed backend")
    for col in ("load", "req/s", "live p50", "sim p50 (+own)", "ratio", "live p99", "sim p99 (+own)", "ratio",
                "pulled late live / sim"):  # fmt: skip
        table.add_column(col, justify="right")
    for row in rows:
        live, sim = row["live"], row["sim"]
        sim50, sim99 = sim["p50_ms"] + overhead, sim["p99_ms"] + overhead
        row["sim_with_overhead"] = {"p50_ms": round(sim50, 1), "p99_ms": round(sim99, 1), "overhead_ms": overhead}
        row["ratio_p50"] = round(live["p50_ms"] / sim50, 3)
        row["ratio_p99"] = round(live["p99_ms"] / sim99, 3)
        table.add_row(
            f"{row['load']:.0%}",
            f"{row['rps']:.0f}",
            f"{live['p50_ms']:.0f}",
            f"{sim50:.0f}",
            f"{row['ratio_p50']:.2f}",
            f"{live['p99_ms']:.0f}",
            f"{sim99:.0f}",
            f"{row['ratio_p99']:.2f}",
            f"{live['taken_shut']} / {sim['taken_shut']}",
        )
    Console().print(table)
    within = all(abs(r["ratio_p50"] - 1) <= 0.1 and abs(r["ratio_p99"] - 1) <= 0.1 for r in rows)
    print(f"every p50 and p99 within 10%: {'yes' if within else 'no'} (own time added: {overhead:.1f} ms)")
    hf = _hf(args) if args.hf_rps > 0 else None
    if args.json:
        report = {
            "hf": hf,
            "command": f"keybatch bench simcheck --loads {args.loads} --workers {args.workers} "
            f"--duration {args.duration:g} --seed {args.seed} --hf-rps {args.hf_rps:g}",
            "rows": rows,
            "within_10_percent": within,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
