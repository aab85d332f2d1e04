"""`keybatch bench broker --cells 1,2,3`: one offered load on deployments of 1, 2, 3... cells.

Each deployment (`keybatch up --cells N`, the fixed backend, the same replicas in all)
idles, then takes the load. Every cell's broker is read (`INFO`) around both, and the
gateway's and replicas' processes are timed: what each cell carries of the commands and of
Valkey's CPU, what the background (the clock, no load) costs each cell, and whether the
request path's CPU and p99 change with the number of cells.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import redis

from control.bench.broker_cost import Rates, snapshot
from control.bench.harness import MODEL, Deployment, child_env
from control.bench.path_cpu import THIS_CHECKOUT, WARMUP_S, commit_of, cpu_seconds
from control.load.generator import generate
from control.load.spec import LoadSpec
from control.load.summary import summarize


def measure(cells: int, args: argparse.Namespace) -> dict[str, Any]:
    deployment = Deployment(f"cells-{cells}", args.workers, child_env(), cells=cells)
    deployment.start()
    try:
        spec = LoadSpec(deployment.url, args.rate, WARMUP_S, MODEL, paid_share=args.paid_share, seed=7)
        generate(spec, show_progress=False)
        clients = [redis.Redis.from_url(url) for url in deployment.cell_urls()]
        procs = {"gateway": deployment.gateway_workers(), "replica": [proc for _n, proc in deployment.replicas()]}
        a = [snapshot(c) for c in clients]
        time.sleep(args.idle)
        b = [snapshot(c) for c in clients]
        cpu_before = {kind: cpu_seconds(p) for kind, p in procs.items()}
        spec = LoadSpec(deployment.url, args.rate, args.duration, MODEL, paid_share=args.paid_share, seed=1)
        records = generate(spec, show_progress=False)
        cpu_after = {kind: cpu_seconds(p) for kind, p in procs.items()}
        c = [snapshot(cl) for cl in clients]
        for cl in clients:
            cl.close()
    finally:
        deployment.stop()
    summary = summarize(records)["all"]
    answered = max(1, sum(r.status == 200 for r in records))
    idle = [Rates.between(x, y) for x, y in zip(a, b, strict=True)]
    loaded = [Rates.between(x, y) for x, y in zip(b, c, strict=True)]
    total = sum(r.commands for r in loaded) or 1.0
    by_cell = [
        {
            "commands_per_s": r.commands / r.seconds,
            "share_of_commands": r.commands / total,
            "valkey_cpu_share": r.cpu_s / r.seconds,
            "idle_commands_per_s": i.commands / i.seconds,
            "idle_valkey_cpu_share": i.cpu_s / i.seconds,
            "answered_200": sum(rec.status == 200 and rec.cell == cell for rec in records),
        }
        for cell, (i, r) in enumerate(zip(idle, loaded, strict=True))
    ]
    return {
        "cells": cells,
        "sent": len(records),
        "answered": sum(r.status == 200 for r in records),
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "cpu_ms_per_request": {k: (cpu_after[k] - cpu_before[k]) * 1000 / answered for k in procs},
        "commands_per_request": total / answered,
        "by_cell": by_cell,
    }


def run_cells_bench(args: argparse.Namespace) -> int:
    counts = [int(n) for n in args.cells.split(",")]
    rows = [measure(n, args) for n in counts]
    out = {
        "command": f"keybatch bench broker --cells {args.cells} --rate {args.rate:g} --duration {args.duration:g} "
        f"--idle {args.idle:g} --workers {args.workers} --paid-share {args.paid_share:g}",
        "commit": commit_of(str(THIS_CHECKOUT)),
        "date": time.strftime("%Y-%m-%d"),
        "runs": rows,
    }
    for row in rows:
        cpu = row["cpu_ms_per_request"]
        print(
            f"{row['cells']} cells: {row['answered']} of {row['sent']} answered, p50/p99 {row['p50_ms']:.0f}/"
            f"{row['p99_ms']:.0f} ms; CPU per request: gateway {cpu['gateway']:.2f} ms, replicas "
            f"{cpu['replica']:.2f} ms; {row['commands_per_request']:.1f} broker commands per request"
        )
        for cell, c in enumerate(row["by_cell"]):
            print(
                f"  cell {cell}: {c['share_of_commands']:.0%} of the commands ({c['commands_per_s']:,.0f}/s), "
                f"Valkey CPU {c['valkey_cpu_share']:.1%}; idle {c['idle_commands_per_s']:.0f} commands/s, "
                f"{c['idle_valkey_cpu_share']:.1%}; {c['answered_200']} answered 200"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0
