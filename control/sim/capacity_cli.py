"""`keybatch capacity` on the command line: its arguments, the plan printed as tables or JSON,
and the curves drawn."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from control.core.vocab import POLICIES
from control.sim.capacity import Inputs, load_curve, parse_models, plan, replica_curve
from control.sim.cost import CostModel
from control.sim.workload import PROFILES


def add_capacity_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rps", type=float, default=40_000.0, help="peak requests per second, worldwide")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--batch-ms", type=float, default=250.0, help="fixed time of any batch")
    parser.add_argument("--cost-model", default=None, help="engine curve JSON (docs/bench/engine-*.json) instead")
    parser.add_argument("--slo-ms", type=float, default=600.0, help="p99 end to end, network included")
    parser.add_argument("--network-ms", type=float, default=60.0, help="client <-> gateway round trip")
    parser.add_argument("--headroom", type=float, default=0.2)
    parser.add_argument("--regions", type=int, default=3, help="survive losing one of them")
    parser.add_argument("--paid-fraction", type=float, default=0.2)
    parser.add_argument("--models", default="kb-small=0.8,kb-large=0.2")
    parser.add_argument(
        "--policy", choices=POLICIES, default=None, help="default: the POLICY setting; continuous: needs --cost-model"
    )
    parser.add_argument(
        "--scope",
        choices=["region", "fleet"],
        default="region",
        help="final run: one surviving region (default), or every region with one lost a third of the way in",
    )
    parser.add_argument("--cell", type=int, default=128, help="simulate a bigger queue as this many replicas, scaled")
    parser.add_argument(
        "--processes", type=int, default=0, help="run the final simulation's model queues in parallel (0: one per core)"
    )
    parser.add_argument("--profile", choices=PROFILES, default="poisson", help="arrivals")
    parser.add_argument("--sim-seconds", type=float, default=60.0, help="simulated time of the final run")
    parser.add_argument("--search-seconds", type=float, default=20.0, help="simulated time of each search run")
    parser.add_argument("--max-queue-free", type=int, default=10**9, help="admission's cap (live: MAX_QUEUE_FREE)")
    parser.add_argument("--max-queue-paid", type=int, default=10**9, help="admission's cap (live: MAX_QUEUE_PAID)")
    parser.add_argument(
        "--broker-core-rps",
        type=float,
        default=12_500.0,
        help="requests a second one broker core carries (`keybatch bench broker`, replayed one by one)",
    )
    parser.add_argument("--broker-utilization", type=float, default=0.5, help="the share of a broker core to plan on")
    parser.add_argument(
        "--host-loss",
        action="store_true",
        help="also lose a host halfway through a surviving region's run: errors with hedging off, paid and all",
    )
    parser.add_argument("--host-size", type=int, default=8, help="replicas a host carries (--host-loss)")
    parser.add_argument(
        "--tiers-by-load",
        default="",
        metavar="L,L,...",
        help="also paid and free p50/p99 in a region's queue of the first model at these shares of its capacity",
    )
    parser.add_argument(
        "--stagger-saturated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="simulated replicas delay a full batch by a gap after a peer's start, as live ones do (the default)",
    )
    parser.add_argument(
        "--single-listener",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one idle replica of a model waits on its queue at a time, as live (SINGLE_LISTENER, the default)",
    )
    parser.add_argument(
        "--hedge-idle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --host-loss, idle replicas run batches of copies where hedging is on, as live (HEDGE_IDLE)",
    )
    parser.add_argument(
        "--spare-hosts",
        type=int,
        default=1,
        help="hosts of --host-size replicas of the first model added per region to the smallest count that "
        "meets the SLO: the peak with a region lost, and a host lost too",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, metavar="F.png", help="p99 against replicas and load")


def run_capacity(args: argparse.Namespace) -> int:
    try:
        cost = CostModel.from_file(args.cost_model) if args.cost_model else None
        inputs = Inputs(
            rps=args.rps,
            max_batch=args.max_batch,
            batch_ms=args.batch_ms,
            cost=cost,
            slo_ms=args.slo_ms,
            network_ms=args.network_ms,
            headroom=args.headroom,
            regions=args.regions,
            paid_fraction=args.paid_fraction,
            models=parse_models(args.models),
            sim_seconds=args.sim_seconds,
            search_seconds=min(args.search_seconds, args.sim_seconds),
            profile=args.profile,
            seed=args.seed,
            max_queue_paid=args.max_queue_paid,
            max_queue_free=args.max_queue_free,
            policy=args.policy,
            scope=args.scope,
            cell=args.cell,
            processes=args.processes,
            broker_core_rps=args.broker_core_rps,
            broker_utilization=args.broker_utilization,
            host_loss=args.host_loss,
            host_size=args.host_size,
            tier_loads=tuple(float(x) for x in args.tiers_by_load.split(",") if x.strip()),
            stagger_saturated=args.stagger_saturated,
            single_listener=args.single_listener,
            hedge_idle=args.hedge_idle,
            spare_hosts=args.spare_hosts,
        )
    except (OSError, ValueError) as exc:
        print(f"keybatch capacity: {exc}", file=sys.stderr)
        return 2
    out = plan(inputs)
    if args.plot:
        first = next(iter(inputs.shares))
        count = out["replicas_per_region_by_model"][first]
        out["load_curve"] = {first: load_curve(inputs, first, count, [0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.4])}
        counts = sorted({max(1, round(count * f)) for f in (0.9, 0.95, 1.0, 1.1, 1.25, 1.5, 2.0)})
        out["replica_curve"] = {first: replica_curve(inputs, first, counts)}
        _plot(out, first, args.plot)
    if args.json:
        print(json.dumps(out, indent=2, default=float))
    else:
        _print(out)
    return 0


def _print(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    a, i = out["arithmetic"], out["inputs"]
    table = Table(title=f"Arithmetic at {i['rps']:,.0f} req/s (batch {i['max_batch']} in {a['batch_ms_full']} ms)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("one replica, full batches (req/s)", f"{a['replica_rps_full']:.1f}")
    table.add_row("one replica, half-full batches (req/s)", f"{a['replica_rps_half']:.1f}")
    table.add_row("replicas at 100% utilization", f"{a['replicas_exact']} -> {a['replicas_min']}")
    table.add_row(f"with {i['headroom']:.0%} headroom", str(a["replicas_with_headroom"]))
    table.add_row(f"per region, {i['regions']} regions, normal", str(a["per_region_normal"]))
    table.add_row("per region, one region lost (survivors carry all)", str(a["per_region_one_lost"]))
    table.add_row("fleet by arithmetic", str(a["replicas_arithmetic"]))
    b = a["broker_cells"]
    table.add_row(
        f"broker cells per region ({b['cell_rps_planned']:,.0f} req/s each planned)",
        f"{b['cells_per_region']} of ~{b['replicas_per_cell']} replicas",
    )
    table.add_row(
        "req/s a cell: normal / region lost / and a cell lost",
        f"{b['cell_rps_normal']:,.0f} / {b['cell_rps_one_region_lost']:,.0f} / "
        f"{b['cell_rps_one_region_and_one_cell_lost']:,.0f} "
        f"({b['core_share_one_region_and_one_cell_lost']:.0%} of a core)",
    )
    console.print(table)
    sim = out["simulated"]
    table = Table(title=f"Simulated: {sim['scope']}, {sim['seconds']:.0f} s")
    for col in ("", "replicas/region", "p50 ms", "p99 ms", "queue p50 ms", "queue p99 ms", "answered 200"):
        table.add_column(col, justify="right")
    for name, s in sim["per_model"].items():
        count = out["replicas_per_region_by_model"][name]
        table.add_row(name, str(count), *_cells(s))
    for tier, s in sim["per_tier"].items():
        table.add_row(tier, "", *_cells(s))
    console.print(table)
    spare = out["spare_per_region"]
    verdict = (
        f"recommended: {out['replicas_per_region']} replicas per region, {out['replicas']} in all "
        f"(p99 {out['p99_ms']} ms with the network, SLO {i['slo_ms']:.0f} ms, one region lost"
        + (f"; {spare} of them per region a spare for a host lost)" if spare else ")")
        if out["met"]
        else "no replica count searched met the SLO: see the search figures (--json)"
    )
    console.print(verdict)
    console.print(
        f"simulation: {sim['requests']:,} requests in {sim['wall_s']} s of wall time ({sim['cpu_s']} s of CPU)"
    )
    for loss in out.get("host_loss", []):
        table = Table(title=f"A host of {loss['host']} lost at {loss['lost_at_s']:.0f} s: {loss['scope']}")
        for col in ("hedging", "not 200", "of them paid", "p99 ms", "copies", "copies that answered"):
            table.add_column(col, justify="right")
        for mode in ("off", "paid", "all"):
            m = loss[mode]
            paid_failed = sum(n for k, n in m["paid_outcomes"].items() if k != "ok")
            row = [f"{m['not_200']:,}", f"{paid_failed:,}", str(m["p99_ms"]), f"{m['hedged']:,}", str(m["hedge_wins"])]
            table.add_row(mode, *row)
        console.print(table)
    for model, points in out.get("tiers_by_load", {}).items():
        count = out["replicas_per_region_by_model"][model]
        table = Table(title=f"Paid and free by load: {model}, {count} replicas, a region's queue")
        for col in ("load", "req/s", "paid p50/p99 ms", "free p50/p99 ms", "paid p99 / free p99", "free 200", "504"):
            table.add_column(col, justify="right")
        for pt in points:
            paid, free = pt["paid"], pt["free"]
            ratio = f"{paid['p99_ms'] / free['p99_ms']:.2f}" if paid["p99_ms"] and free["p99_ms"] else "-"
            table.add_row(
                f"{pt['load']:.0%}",
                f"{pt['rps']:,.0f}",
                f"{paid['p50_ms']} / {paid['p99_ms']}",
                f"{free['p50_ms']} / {free['p99_ms']}",
                ratio,
                f"{free['answered_200_share']:.2%}",
                str(pt["status_504"]),
            )
        console.print(table)


def _cells(s: dict[str, Any]) -> list[str]:
    return [
        str(s.get("p50_ms", "-")),
        str(s.get("p99_ms", "-")),
        str(s.get("queue_p50_ms", "-")),
        str(s.get("queue_p99_ms", "-")),
        f"{s['answered_200_share']:.2%}",
    ]


def _plot(out: dict[str, Any], model: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    slo = out["inputs"]["slo_ms"]
    panels = (
        (left, out["replica_curve"][model], "replicas", f"{model} replicas per region, one region lost"),
        (
            right,
            out["load_curve"][model],
            "load",
            f"offered load (x design rate), {out['replicas_per_region_by_model'][model]} replicas",
        ),
    )
    for axis, points, key, label in panels:
        shown = [p for p in points if p["p99_ms"] is not None]
        axis.plot([p[key] for p in shown], [p["p99_ms"] for p in shown], marker="o", label="p99 end to end")
        axis.axhline(slo, color="red", linestyle="--", label="SLO")
        axis.set_xlabel(label)
        axis.set_ylabel("p99 end to end (ms)")
        share = axis.twinx()  # admission holds the p99 under the budget: what it refuses shows here
        share.plot([p[key] for p in points], [100 * p["answered_200_share"] for p in points], color="green", marker="x")
        share.set_ylabel("answered 200 (%)", color="green")
        axis.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
