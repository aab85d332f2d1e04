"""`keybatch bench goodput`: answered 200 per second at and past capacity, and how the
rest are refused, under each policy on the fixed backend.

For each policy and each case `BATCHxLOAD` (e.g. `32x1.1`: two replicas of 32 per
250 ms, offered 110% of their nominal rate), a fresh deployment (embedded Valkey, the
replicas, the gateway) takes an open-loop Poisson load from this process over plain
HTTP, 30% paid, every request with the default 600 ms budget. Printed per run: 200s a
second and their share of nominal capacity, 504s (admitted, then late), 429s and their
p99, the p99 of the 200s, requests left without an answer, each replica's duty cycle as
it reports it, and this process's own CPU share (the load generator's).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import redis

from control.bench.harness import fixed_fleet
from control.broker.registry import read_fleet
from control.core.vocab import POLICIES, Policy
from control.load.generator import generate
from control.load.spec import LoadSpec
from control.load.summary import summarize

PAID_KEY, FREE_KEY = "bench-paid", "bench-free"
TIER_FIGURES = ("sent", "ok_share", "status_429", "status_504", "p50_ms", "p99_ms")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _case(text: str) -> tuple[int, float]:
    batch, load = text.lower().split("x")
    return int(batch), float(load)


def measure(policy: Policy, max_batch: int, load: float, args: argparse.Namespace) -> dict:
    with fixed_fleet(args.workers, PAID_KEY, FREE_KEY, max_batch, policy=policy) as (url, model, s):
        nominal = args.workers * s.max_batch * 1000.0 / s.batch_ms
        spec = LoadSpec(
            url, load * nominal, args.duration, model, paid_share=0.3, paid_key=PAID_KEY, free_key=FREE_KEY, seed=11
        )
        wall0, cpu0 = time.monotonic(), _cpu_s()
        records = generate(spec, show_progress=False)
        wall, cpu = time.monotonic() - wall0, _cpu_s() - cpu0
        fleet = read_fleet(redis.Redis.from_url(s.redis_url or s.state_url))
    summary = summarize(records, duration_s=args.duration)
    a = summary["all"]
    ok = sum(r.status == 200 for r in records)
    return {
        "policy": policy,
        "max_batch": max_batch,
        "load": load,
        "nominal_rps": nominal,
        "offered_rps": load * nominal,
        "sent": a["sent"],
        "ok_per_s": ok / args.duration,
        "ok_of_nominal": ok / args.duration / nominal,
        "ok_share": a["ok_share"],
        "share_504": a["status_504"] / max(1, a["sent"]),
        "status_504": a["status_504"],
        "status_429": a["status_429"],
        "p99_429_ms": a["p99_429_ms"],
        "p99_ms": a["p99_ms"],
        "p99_paid_ms": summary.get("paid", {}).get("p99_ms", 0.0),
        "tiers": {
            tier: {
                key: summary[tier][key] for key in ("sent", "ok_share", "status_429", "status_504", "p50_ms", "p99_ms")
            }
            for tier in ("paid", "free")
            if tier in summary
        },
        "no_answer": a["no_answer"],
        "codes": a["codes"],
        "duty_cycle": {r.name: r.utilization for r in fleet},
        "cycle_ms": {r.name: r.cycle_ms for r in fleet},
        "load_generator_cpu_share": cpu / max(wall, 1e-9),
    }


def run_goodput(args: argparse.Namespace) -> int:
    runs = []
    for case in [c for c in args.cases.split(",") if c]:
        max_batch, load = _case(case)
        for policy in [p for p in POLICIES if p in args.policies.split(",")]:
            r = measure(policy, max_batch, load, args)
            runs.append(r)
            duty = " ".join(f"{v:.3f}" for v in r["duty_cycle"].values())
            print(
                f"{policy:<10} {args.workers}x{max_batch} at {load:.0%} ({r['offered_rps']:.0f} req/s): "
                f"200/s {r['ok_per_s']:.1f} = {r['ok_of_nominal']:.1%} of nominal; 200s {r['ok_share']:.2%}; "
                f"504 {r['status_504']} ({r['share_504']:.2%}); 429 {r['status_429']} p99 {r['p99_429_ms']:.1f} ms; "
                f"p99 {r['p99_ms']:.0f} ms (paid {r['p99_paid_ms']:.0f}); no answer {r['no_answer']}; "
                f"duty {duty}; load generator {r['load_generator_cpu_share']:.0%} of a core",
                flush=True,
            )
            for tier, t in r["tiers"].items():
                print(
                    f"  {tier}: 200s {t['ok_share']:.2%}, p50/p99 {t['p50_ms']:.0f}/{t['p99_ms']:.0f} ms, "
                    f"429 {t['status_429']}, 504 {t['status_504']}",
                    flush=True,
                )
    if args.json:
        result = {"command": "keybatch bench goodput " + " ".join(sys.argv[3:]), "runs": runs}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
