"""`keybatch bench gateway-cpu`: the gateway's CPU per request, this checkout against
another (an A/B across commits, same load, same machine, runs interleaved).

Each run starts `keybatch up --backend fixed --policy static` from one checkout (its
own `control` package, this interpreter and its installed libraries), warms it up,
then offers a fixed Poisson rate from this process and reads the CPU seconds the
gateway's worker processes (and, for context, the replicas) spent during the load,
per request answered. Runs alternate A, B, A, B ... so a drift of the shared cores
falls on both sides alike; each side's figure is the median of its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import psutil

from control.bench.harness import MODEL, Deployment
from control.load.generator import generate
from control.load.spec import LoadSpec
from control.load.summary import summarize

WARMUP_S = 3.0


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def commit_of(checkout: str) -> str:
    """A checkout's commit, `+dirty` when its tracked files differ from it."""
    git = ["git", "-C", checkout]
    out = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True)
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def measure(checkout: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout}
    deployment = Deployment(f"cpu-{Path(checkout).name}", args.workers, env, cwd=checkout)
    deployment.start()
    try:
        generate(LoadSpec(deployment.url, args.rate, WARMUP_S, model=MODEL, seed=7), show_progress=False)
        gateways = deployment.gateway_workers()
        replicas = [proc for _name, proc in deployment.replicas()]
        before = _cpu_s(gateways), _cpu_s(replicas)
        records = generate(LoadSpec(deployment.url, args.rate, args.duration, model=MODEL, seed=1), show_progress=False)
        after = _cpu_s(gateways), _cpu_s(replicas)
    finally:
        deployment.stop()
    summary = summarize(records)["all"]
    answered = sum(r.status == 200 for r in records)
    return {
        "answered": answered,
        "sent": len(records),
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "gateway_processes": len(gateways),
        "gateway_cpu_ms_per_request": (after[0] - before[0]) * 1000.0 / max(1, answered),
        "replica_cpu_ms_per_request": (after[1] - before[1]) * 1000.0 / max(1, answered),
    }


def run_gateway_cpu(args: argparse.Namespace) -> int:
    here = str(Path(__file__).resolve().parent.parent)
    sides = {"this": here, "other": str(Path(args.checkout).resolve())}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side, checkout in sides.items():
            started = time.monotonic()
            run = measure(checkout, args)
            runs[side].append(run)
            print(
                f"round {round_ + 1} {side:5} ({commit_of(checkout)}): gateway "
                f"{run['gateway_cpu_ms_per_request']:.3f} ms CPU/request, replicas "
                f"{run['replica_cpu_ms_per_request']:.3f}, p50 {run['p50_ms']:.0f} ms, "
                f"{run['answered']}/{run['sent']} answered ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    report: dict[str, object] = {
        "rate_rps": args.rate,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "workers": args.workers,
        "command": f"keybatch bench gateway-cpu --checkout OTHER --rate {args.rate:g} --duration {args.duration:g} "
        f"--rounds {args.rounds} --workers {args.workers}",
    }
    for side, checkout in sides.items():
        per_request = [run["gateway_cpu_ms_per_request"] for run in runs[side]]
        report[side] = {
            "commit": commit_of(checkout),
            "gateway_cpu_ms_per_request_median": statistics.median(per_request),
            "runs": runs[side],
        }
    this = report["this"]["gateway_cpu_ms_per_request_median"]  # type: ignore[index]
    other = report["other"]["gateway_cpu_ms_per_request_median"]  # type: ignore[index]
    report["ratio_this_over_other"] = this / other
    print(f"gateway CPU per request: this {this:.3f} ms, other {other:.3f} ms, ratio {this / other:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
