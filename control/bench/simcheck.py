"""`keybatch bench simcheck`: the simulator against the live fleet, same load.

For each load (a share of the fleet's capacity) a live deployment on the fixed backend
(`bench serving`'s, the simulated accelerator) takes open-loop Poisson load, then the
simulator (`control/sim/simulate.py`, on the same policy objects) runs the same configuration and
rate. The simulator is given what the live run measured of the parts it does not
compute, and nothing of the latency it is checked on:
- the batch's own time: the fixed backend's batch runs a little past its nominal time
  and varies (the floor is the 1st percentile of the live `batch_ms`, the spread up to
  the 99th a uniform draw);
- the path's own time (HTTP in and out, admission, the broker's round trips: the live
  `system_ms`, end to end less queueing and batch), whose median is added to the
  simulator's figures at that load.
The simulated figures pool `--sim-runs` runs with different arrival draws (one 30 s run's
p99 rests on a few dozen requests), each counted after `--sim-warmup` seconds: a
simulation starts with every replica idle and in phase, and the stagger takes a few
seconds to spread them, while the live fleet runs one load after another, already
spread (warmed up, and by the load before). The plain simulator (250 ms, nothing added) is reported beside them.

The torch engine's check runs the simulator on the engine's step curve measured just
before, on this machine, with the model it serves, and with the prompt and answer
lengths the live run had.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from control.bench.harness import fixed_fleet, hf_fleet
from control.bench.serving import FREE_KEY, PAID_KEY
from control.core.settings import Settings
from control.fleet.operator import Operator
from control.load.generator import generate
from control.load.spec import LoadSpec, Record
from control.load.summary import summarize
from control.sim.config import SimConfig
from control.sim.cost import CONTEXT_TOKENS, CostModel
from control.sim.result import SimResult
from control.sim.simulate import simulate
from control.sim.states import OK
from control.sim.workload import Workload, make_workload


def _pulls(s: Settings) -> tuple[int, int]:
    """The fleet's requests brought by a pull sent before the gate shut, and of those
    handed back, so far."""
    replicas = Operator(s).snapshot().replicas
    return sum(r.taken_shut for r in replicas), sum(r.handed_back for r in replicas)


def _pooled(results: list[SimResult], from_ms: float = 0.0) -> dict[str, Any]:
    """p50/p99 end to end and queueing over the 200s of several runs (requests sent from
    `from_ms` on), answered share, mean batch."""
    counted = [(r, r.workload.t_ms >= from_ms) for r in results]
    latency = np.concatenate([(r.end_ms - r.workload.t_ms)[(r.state == OK) & c] for r, c in counted])
    queue = np.concatenate([(r.start_ms - r.workload.t_ms)[(r.state == OK) & c] for r, c in counted])
    sent = sum(int(c.sum()) for _, c in counted)
    out: dict[str, Any] = {"runs": len(results), "answered_200_share": round(len(latency) / max(1, sent), 5)}
    if len(latency):
        p50, p99 = np.percentile(latency, [50, 99])
        q50, q99 = np.percentile(queue, [50, 99])
        out.update(p50_ms=round(float(p50), 1), p99_ms=round(float(p99), 1))
        out.update(queue_p50_ms=round(float(q50), 1), queue_p99_ms=round(float(q99), 1))
    out["mean_batch"] = round(float(np.mean([r.mean_batch() for r in results])), 1)
    out["taken_shut"] = round(float(np.mean([r.stats["taken_shut"] for r in results])), 1)  # per run
    return out


def _sim(s: Settings, args: argparse.Namespace, rps: float, batch: tuple[float, float] | None) -> dict[str, Any]:
    """The simulator at `rps`, pooled over `--sim-runs` arrival draws, each counted after
    `--sim-warmup` seconds; `batch`: the measured (floor, spread) of a batch's time, else
    the nominal `BATCH_MS`."""
    floor, spread = batch or (s.batch_ms, 0.0)
    config = SimConfig(
        replicas=[args.workers],
        max_batch=s.max_batch,
        batch_ms=floor,
        batch_jitter_ms=spread,
        max_wait_ms=s.max_wait_ms,
        pull_lead_ms=s.pull_lead_ms,
        pull_early=s.pull_early,
        margin_ms=s.deadline_margin_ms,
        budget_ms=s.deadline_ms,
        max_queue_paid=s.max_queue_paid,
        max_queue_free=s.max_queue_free,
        pull_in_flight="hand_back" if s.hand_back_pulls else "keep",
    )
    seconds = args.sim_warmup + args.duration
    results = [
        simulate(config, make_workload(rps, seconds, paid_fraction=0.0, seed=args.seed + k))
        for k in range(max(1, args.sim_runs))
    ]
    pooled = _pooled(results, args.sim_warmup * 1000.0)
    pooled["taken_shut"] = round(pooled["taken_shut"] * args.duration / seconds, 1)  # in as long as the live run
    return {**pooled, "batch_ms": round(floor, 1), "batch_jitter_ms": round(spread, 1)}


def _live(records: list[Record], taken: int, handed: int) -> dict[str, Any]:
    a = summarize(records)["all"]
    batch = np.array([r.batch_ms for r in records if r.status == 200])
    b01, b99 = np.percentile(batch, [1, 99]) if len(batch) else (0.0, 0.0)
    return {
        "p50_ms": round(a["p50_ms"], 1),
        "p99_ms": round(a["p99_ms"], 1),
        "ok_share": round(a["ok_share"], 5),
        "system_p50_ms": round(a["system_p50_ms"], 1),
        "mean_batch": round(a["mean_batch"], 1),
        "batch_p01_ms": round(float(b01), 1),
        "batch_p99_ms": round(float(b99), 1),
        "taken_shut": taken,
        "handed_back": handed,
    }


def _ratios(row: dict[str, Any]) -> None:
    live, sim = row["live"], row["sim"]
    own = live["system_p50_ms"]
    sim50, sim99 = sim["p50_ms"] + own, sim["p99_ms"] + own
    row["sim_with_overhead"] = {"p50_ms": round(sim50, 1), "p99_ms": round(sim99, 1), "overhead_ms": own}
    row["ratio_p50"] = round(live["p50_ms"] / sim50, 3)
    row["ratio_p99"] = round(live["p99_ms"] / sim99, 3)


def _hf(args: argparse.Namespace) -> dict[str, Any]:
    """The torch engine under continuous batching at one rate: live (kb-small, the
    workload of `bench policies`) against the simulator on the engine's measured curve,
    with the prompt and answer lengths the live run had (a model stops at its own end
    of text, so how long its answers are is the model's, not the request's). Twice: on
    the curve as `bench engine` measured it alone, and on that curve scaled to the
    forward times the serving engine itself measured during the run (its cores shared
    with the gateway, the broker and the load)."""
    from control.load import workloads

    curve = _engine_curve(args.hf_curve)
    bodies = workloads.mixed(400, seed=args.seed)
    deadline_ms = 5000.0
    with hf_fleet(1, "continuous", "kb-small", PAID_KEY, FREE_KEY) as url:
        before = _engine_times()
        spec = LoadSpec(url, args.hf_rps, args.duration, "kb-small", free_key=FREE_KEY, deadline_ms=deadline_ms,
                        bodies=bodies, seed=args.seed)  # fmt: skip
        records = generate(spec)
        time.sleep(2 * Settings().heartbeat_s)  # the engine's counters reach the registry with the heartbeat
        served = {k: v - before.get(k, 0.0) for k, v in _engine_times().items() if k in COUNTERS}
    live = summarize(records)["all"]
    lengths = np.array([(r.prompt_tokens, r.completion_tokens) for r in records if r.status == 200], dtype=np.int16)
    factors = _serving_factors(curve, served, lengths)
    out: dict[str, Any] = {
        "rps": args.hf_rps,
        "live": {"p50_ms": round(live["p50_ms"], 1), "p99_ms": round(live["p99_ms"], 1),
                 "ok_share": round(live["ok_share"], 5),
                 "system_p50_ms": round(live["system_p50_ms"], 1),
                 "mean_completion_tokens": round(float(lengths[:, 1].mean()), 1) if len(lengths) else 0.0,
                 "engine": {k: round(v, 1) for k, v in served.items()}},
        "serving_factors": factors,
    }  # fmt: skip
    served_curve = curve.scaled(factors["decode"], factors["prefill"], factors["step_overhead_ms"])
    if args.hf_curve_out:  # what `keybatch capacity --cost-model` takes: the engine as it served
        report = {**served_curve.as_json(), "serving_factors": factors, "measured": _when()}
        Path(args.hf_curve_out).write_text(json.dumps(report, indent=1) + "\n")
    own = live["system_p50_ms"]  # the path's own time, as for the fixed backend
    for key, model in (("sim", curve), ("sim_served", served_curve)):
        sim = _hf_sim(args, model, lengths, deadline_ms)
        out[key] = sim
        out[f"ratio_p50{key[3:]}"] = round(live["p50_ms"] / (sim["p50_ms"] + own), 3) if sim.get("p50_ms") else None
        out[f"ratio_p99{key[3:]}"] = round(live["p99_ms"] / (sim["p99_ms"] + own), 3) if sim.get("p99_ms") else None
    print(
        f"hf continuous at {args.hf_rps:g} req/s: live p50/p99 {live['p50_ms']:.0f}/{live['p99_ms']:.0f} ms; "
        f"sim on the engine's curve {out['sim'].get('p50_ms', 0):.0f}/{out['sim'].get('p99_ms', 0):.0f} ms "
        f"(ratios {out['ratio_p50']}/{out['ratio_p99']}); on the serving engine's forward times "
        f"(decode x{factors['decode']}, prefill x{factors['prefill']}, {factors['step_overhead_ms']} ms a step more) "
        f"{out['sim_served'].get('p50_ms', 0):.0f}/{out['sim_served'].get('p99_ms', 0):.0f} ms "
        f"(ratios {out['ratio_p50_served']}/{out['ratio_p99_served']}, the path's own {own:.1f} ms added)"
    )
    return out


# The engine's counters a run's difference means something for (the rest are moving averages).
COUNTERS = ("steps", "prefill_tokens", "decode_tokens", "finished", "total_step_ms", "total_decode_ms",
            "total_decode_forwards", "total_decode_rows", "total_prefill_ms", "total_loop_ms",
            "total_loops")  # fmt: skip


def _when() -> dict[str, Any]:
    load = os.getloadavg()[0]
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(), "load_avg_1m": load}


def _engine_times() -> dict[str, float]:
    """The one replica's engine counters (tokens, forwards, time in forwards) so far."""
    (replica,) = Operator(Settings()).snapshot().replicas
    return dict(replica.engine)


def _serving_factors(curve: CostModel, served: dict[str, float], lengths: np.ndarray) -> dict[str, float]:
    """How much longer the serving engine's forwards took than the curve says: its mean
    decode forward against the curve's at its mean rows, its prefill per token against
    the curve's for the mean prompt; and what its steps spent besides forwards."""
    forwards, prefill_tokens = served.get("total_decode_forwards", 0.0), served.get("prefill_tokens", 0.0)
    steps = served.get("steps", 0.0)
    if not forwards or not prefill_tokens or not steps or not len(lengths):
        return {"decode": 1.0, "prefill": 1.0, "step_overhead_ms": 0.0}
    rows = served["total_decode_rows"] / forwards
    decode = served["total_decode_ms"] / forwards / curve.step_ms(max(1, round(rows)), CONTEXT_TOKENS)
    prompt = float(lengths[:, 0].mean())
    prefill = served["total_prefill_ms"] / prefill_tokens / (curve.prefill_ms_for(round(prompt)) / prompt)
    # what a turn of the replica's loop spent besides forwards: the engine's own step work,
    # and the replica's (a round trip for cancels each turn, answers, admissions)
    turns = served.get("total_loops") or steps
    spent = served.get("total_loop_ms") or served["total_step_ms"]
    rest = spent - served["total_decode_ms"] - served["total_prefill_ms"]
    return {
        "decode": round(decode, 3),
        "prefill": round(prefill, 3),
        "step_overhead_ms": round(max(0.0, rest / turns), 3),
        "mean_decode_rows": round(rows, 2),
    }


def _hf_sim(args: argparse.Namespace, curve: CostModel, lengths: np.ndarray, deadline_ms: float) -> dict[str, Any]:
    s = Settings()
    config = SimConfig(
        replicas=[1],
        max_batch=s.max_batch,
        policy="continuous",
        costs={"kb-small": curve},
        budget_ms=deadline_ms,
        max_wait_ms=s.max_wait_ms,
        margin_ms=s.deadline_margin_ms,
    )
    results = []
    for k in range(max(1, args.sim_runs)):
        workload = make_workload(args.hf_rps, args.duration, paid_fraction=0.0, seed=args.seed + k)
        if len(lengths):
            workload = _with_lengths(workload, lengths, args.seed + k)
        results.append(simulate(config, workload))
    return _pooled(results)


def _engine_curve(path: str | None) -> CostModel:
    """The engine's step curve: from `path`, else measured now with the model about to be
    served (`keybatch bench engine`, one torch thread as a replica runs it; a few seconds)."""
    if path:
        return CostModel.from_file(path)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "curve.json"
        cmd = [sys.executable, "-m", "control", "bench", "engine", "--model", "kb-small", "--threads", "1"]
        subprocess.run([*cmd, "--json", str(out)], check=True, capture_output=True, timeout=600)
        return CostModel.from_file(out)


def _with_lengths(workload: Workload, lengths: np.ndarray, seed: int) -> Workload:
    """The workload with each request's prompt and answer lengths drawn from `lengths`."""
    pick = np.random.default_rng(seed).integers(0, len(lengths), len(workload))
    drawn = lengths[pick]
    workload.prompt_tokens, workload.output_tokens = drawn[:, 0], np.maximum(drawn[:, 1], 1)
    return workload


def run_simcheck(args: argparse.Namespace) -> int:
    loads = [float(x) for x in args.loads.split(",") if x]
    rows = _fixed(args, loads) if loads else []
    if rows:
        _print_table(rows, args.workers)
    within = all(abs(r["ratio_p50"] - 1) <= 0.1 and abs(r["ratio_p99"] - 1) <= 0.1 for r in rows)
    if rows:
        print(f"every p50 and p99 within 10%: {'yes' if within else 'no'}")
    hf = _hf(args) if args.hf_rps > 0 else None
    if args.json:
        report = {
            "hf": hf,
            "command": f"keybatch bench simcheck --loads {args.loads} --workers {args.workers} "
            f"--duration {args.duration:g} --sim-runs {args.sim_runs} --sim-warmup {args.sim_warmup:g} "
            f"--seed {args.seed} --hf-rps {args.hf_rps:g}" + (f" --hf-curve {args.hf_curve}" if args.hf_curve else ""),
            "rows": rows,
            "within_10_percent": within,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _fixed(args: argparse.Namespace, loads: list[float]) -> list[dict[str, Any]]:
    """The fixed backend at each load, live then simulated."""
    rows: list[dict[str, Any]] = []
    with fixed_fleet(args.workers, PAID_KEY, FREE_KEY) as (url, model, s):
        capacity = args.workers * s.max_batch * 1000.0 / s.batch_ms
        for load in loads:
            rps = load * capacity
            pulls = _pulls(s)
            records = generate(LoadSpec(url, rps, args.duration, model, free_key=FREE_KEY, seed=args.seed))
            time.sleep(2 * s.heartbeat_s)  # the replicas' counters reach the registry with their heartbeat
            taken, handed = (after - before for after, before in zip(_pulls(s), pulls, strict=True))
            live = _live(records, taken, handed)
            batch = (live["batch_p01_ms"], max(0.0, live["batch_p99_ms"] - live["batch_p01_ms"]))
            sim = _sim(s, args, rps, batch)
            plain = _sim(s, args, rps, None)
            row = {"load": load, "rps": round(rps, 1), "live": live, "sim": sim, "sim_plain": plain}
            _ratios(row)
            rows.append(row)
            print(f"load {load:.0%}: live p50/p99 {live['p50_ms']:.0f}/{live['p99_ms']:.0f} ms, "
                  f"sim {sim.get('p50_ms', 0):.0f}/{sim.get('p99_ms', 0):.0f} ms (+{live['system_p50_ms']:.1f}); "
                  f"pulled after the gate shut: live {taken} ({handed} handed back), sim {sim['taken_shut']:.0f}",
                  flush=True)  # fmt: skip
    return rows


def _print_table(rows: list[dict[str, Any]], workers: int) -> None:
    table = Table(title=f"simulator against the live fleet: {workers} replicas, fixed backend")
    for col in ("load", "req/s", "live p50", "sim p50 (+own)", "ratio", "live p99", "sim p99 (+own)", "ratio",
                "batch ms live", "pulled late live / sim"):  # fmt: skip
        table.add_column(col, justify="right")
    for row in rows:
        live, sim = row["live"], row["sim_with_overhead"]
        table.add_row(
            f"{row['load']:.0%}",
            f"{row['rps']:.0f}",
            f"{live['p50_ms']:.0f}",
            f"{sim['p50_ms']:.0f}",
            f"{row['ratio_p50']:.2f}",
            f"{live['p99_ms']:.0f}",
            f"{sim['p99_ms']:.0f}",
            f"{row['ratio_p99']:.2f}",
            f"{live['batch_p01_ms']:.1f}-{live['batch_p99_ms']:.1f}",
            f"{live['taken_shut']} / {row['sim']['taken_shut']:.0f}",
        )
    Console().print(table)
