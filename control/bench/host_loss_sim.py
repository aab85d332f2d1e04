"""`keybatch bench host-loss-sim`: what a lost host costs in the simulator, with free-slot
hedging off, copying running requests only, copying buffered ones too, and with idle
replicas also running batches of copies (`+idle`, HEDGE_IDLE: the live rule).

Each run is R replicas of batch B on the fixed 250 ms backend, as hosts of H replicas, 30%
paid, a 600 ms budget; the first host is lost 5 s in; its requests may be copied until its
leases lapse (`--lease-ms`), it is noticed `--detect-ms` later (the lease and the sweep),
and it is back 7 s after the loss. Every arm runs the same arrivals, seed
by seed. A request the lost host held is one it was running, or had buffered for its next
batch, when it vanished: the 504s among them are what hedging is for; the rest of the 504s
and the 429s are the survivors' load. `--bump` plays `ADMIT_BUMP` in every arm
(`SimConfig.admit_bump`): free requests admitted with no room kept for paid ones, which
bump them where they must. `--single-listener` sends every arm's arrivals to the idle
replica already gathering a batch (SINGLE_LISTENER, `SimConfig.concentrate_idle`).
Every arm admits deeper below capacity (ADMIT_OPEN, `SimConfig.admit_open`, on by default
as live) unless `--no-open`.
"""

from __future__ import annotations

import argparse
from multiprocessing import get_context
from typing import Any, NamedTuple

import numpy as np
from rich.console import Console
from rich.table import Table

from control.bench.report import write_sim_figures
from control.sim.config import SimConfig
from control.sim.simulate import Simulation
from control.sim.states import EXPIRED, LATE, REFUSED
from control.sim.workload import make_workload
from tasks.policy.hedging import HedgeMode

LOSS_AT_S = 5.0
RESTART_S = 7.0
PAID_FRACTION = 0.3

# Each arm by its name: the hedging mode, whether buffered requests are copied too, and
# whether idle replicas run batches of copies.
ARMS: dict[str, tuple[HedgeMode, bool, bool]] = {
    "off": ("off", False, False),
    "running": ("all", False, False),
    "+buffered": ("all", True, False),
    "+idle": ("all", True, True),
}


class Run(NamedTuple):
    arm: str
    load: float
    seed: int
    replicas: int
    per_host: int
    batch: int
    seconds: float
    lease_ms: float
    detect_ms: float
    bump: bool = False
    single_listener: bool = False
    admit_open: bool = True


def _one(run: Run) -> dict[str, Any]:
    mode, buffered, idle = ARMS[run.arm]
    config = SimConfig(
        replicas=[run.replicas],
        max_batch=run.batch,
        budget_ms=600,
        hedge=mode,
        hedge_buffered=buffered,
        hedge_idle=idle,
        concentrate_idle=run.single_listener,
        host_size=run.per_host,
        host_loss_at_s=LOSS_AT_S,
        restart_s=RESTART_S,
        lease_ms=run.lease_ms,
        detect_ms=run.detect_ms,
        admit_bump=run.bump,
        admit_open=run.admit_open,
    )
    rate = run.load * run.replicas * run.batch * 4
    sim = Simulation(config, make_workload(rate, run.seconds, paid_fraction=PAID_FRACTION, seed=run.seed))
    result = sim.run()
    state = result.state
    failed = set(np.flatnonzero((state == EXPIRED) | (state == LATE)).tolist())
    paid = result.workload.paid
    return {
        "arm": run.arm,
        "load": run.load,
        "seed": run.seed,
        "sent": len(state),
        "status_429": int((state == REFUSED).sum()),
        "status_504": len(failed),
        "paid_504": int(sum(1 for j in failed if paid[j])),
        "held_running": len(sim.lost_running),
        "held_buffered": len(sim.lost_buffered),
        "running_504": len(failed & sim.lost_running),
        "buffered_504": len(failed & sim.lost_buffered),
        "hedged": result.stats.get("hedged", 0),
        "hedge_wins": result.stats.get("hedge_wins", 0),
        "bumped": result.stats.get("bumped", 0),
        "idle_copy_batches": result.stats.get("idle_copy_batches", 0),
        "taken_lost": result.stats.get("taken_lost", 0),
    }


SUMMED = (
    "sent",
    "status_429",
    "status_504",
    "paid_504",
    "held_running",
    "held_buffered",
    "running_504",
    "buffered_504",
    "hedged",
    "hedge_wins",
    "bumped",
    "idle_copy_batches",
    "taken_lost",
)


def run_host_loss_sim(args: argparse.Namespace) -> int:
    try:
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError as exc:
        print(f"keybatch bench host-loss-sim: {exc}")
        return 2
    if args.replicas < 2 * args.replicas_per_host or args.seeds < 1:
        print("keybatch bench host-loss-sim: two hosts at least, and one seed")
        return 2
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - set(ARMS):
        print(f"keybatch bench host-loss-sim: --arms takes some of {', '.join(ARMS)}")
        return 2
    if not 0 < args.lease_ms <= args.detect_ms:
        print("keybatch bench host-loss-sim: a lease lapses before the loss is detected")
        return 2
    runs = [
        Run(
            name,
            load,
            seed,
            args.replicas,
            args.replicas_per_host,
            args.max_batch,
            args.seconds,
            args.lease_ms,
            args.detect_ms,
            args.bump,
            args.single_listener,
            not args.no_open,
        )
        for load in loads
        for name in arms
        for seed in range(1, args.seeds + 1)
    ]
    with get_context("fork").Pool(max(1, args.processes)) as pool:
        results = pool.map(_one, runs, chunksize=1)
    totals: dict[tuple[float, str], dict[str, int]] = {}
    for r in results:
        total = totals.setdefault((r["load"], r["arm"]), dict.fromkeys(SUMMED, 0))
        for key in SUMMED:
            total[key] += r[key]
    title = (
        f"A host of {args.replicas_per_host} lost, {args.replicas} x {args.max_batch}, {args.seeds} seeds summed; "
        "copies: off, of running requests, of buffered ones too, and idle replicas' batches of copies"
    ) + ("; free requests bumped by paid ones" if args.bump else "")
    title += "; arrivals to the replica gathering" if args.single_listener else ""
    title += "; admitted by the worst phase's limit (ADMIT_OPEN off)" if args.no_open else ""
    table = Table(title=title)
    for col in (
        "load",
        "copies",
        "sent",
        "429",
        "504",
        "paid 504",
        "lost ran",
        "504",
        "lost held",
        "504",
        "made",
        "won",
        "bumped",
        "idle batches",
    ):
        table.add_column(col, justify="right")
    for (load, arm), t in totals.items():
        table.add_row(
            f"{load:.0%}",
            arm,
            f"{t['sent']:,}",
            str(t["status_429"]),
            str(t["status_504"]),
            str(t["paid_504"]),
            str(t["held_running"]),
            str(t["running_504"]),
            str(t["held_buffered"]),
            str(t["buffered_504"]),
            f"{t['hedged']:,}",
            str(t["hedge_wins"]),
            str(t["bumped"]),
            str(t["idle_copy_batches"]),
        )
    Console().print(table)
    if args.json:
        totals_out = [{"load": load, "arm": arm, **t} for (load, arm), t in totals.items()]
        write_sim_figures(args.json, args, totals=totals_out, runs=results)
    return 0
