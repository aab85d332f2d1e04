"""`keybatch bench serving`: the whole path under Poisson load, with figures.

Starts a private deployment (embedded Valkey, N fixed-latency replicas, the
gateway), runs the scenarios of issue 2 one after another and prints what the
issue asks to see, each next to its target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time

from control.loadgen import LoadSpec, print_summary, run_spec, summarize
from control.settings import Settings
from control.up import Plan, System

PAID_KEY, FREE_KEY = "bench-paid", "bench-free"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_serving(settings: Settings, args: argparse.Namespace) -> int:
    os.environ["KEYBATCH_API_KEYS"] = json.dumps({PAID_KEY: "paid", FREE_KEY: "free"})
    settings = Settings()
    model = next(iter(settings.models))
    plan = Plan(workers=args.workers, models=[model], port=_free_port(), quiet=True)
    system = System(settings, plan)
    system.start()
    capacity = args.workers * settings.max_batch * 1000.0 / settings.batch_ms
    print(
        f"keybatch bench serving: {args.workers} replicas x {settings.max_batch} per {settings.batch_ms:.0f} ms "
        f"(fixed backend, simulated) = {capacity:.0f} req/s; max_wait {settings.max_wait_ms:.0f} ms; "
        f"gateway {settings.api_worker_class} x{settings.api_processes}"
    )
    results: dict[str, object] = {"capacity_rps": capacity, "settings": settings.model_dump(mode="json")}
    try:
        _warm(system.url, model)
        for name in [s for s in args.scenarios.split(",") if s]:
            results[name] = SCENARIOS[name](system.url, model, capacity, settings, args)
            time.sleep(2.0)  # let queues empty between scenarios
    finally:
        system.stop()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


def _warm(url: str, model: str) -> None:
    asyncio.run(run_spec(LoadSpec(url, 50, 2.0, model, free_key=FREE_KEY), show_progress=False))


def _low(url: str, model: str, capacity: float, s: Settings, args: argparse.Namespace) -> dict:
    spec = LoadSpec(url, 5.0, 20.0, model, free_key=FREE_KEY)
    summary = summarize(asyncio.run(run_spec(spec)))
    print_summary("low load: 5 req/s for 20 s", summary)
    target = s.batch_ms + s.max_wait_ms + 15
    print(f"  p50 {summary['all']['p50_ms']:.1f} ms (target <= {target:.0f} = batch + max_wait + 15)\n")
    return summary


def _load90(url: str, model: str, capacity: float, s: Settings, args: argparse.Namespace) -> dict:
    rps = 0.9 * capacity
    spec = LoadSpec(url, rps, args.duration, model, free_key=FREE_KEY)
    summary = summarize(asyncio.run(run_spec(spec)))
    print_summary(f"90% load: {rps:.0f} req/s Poisson for {args.duration:.0f} s", summary)
    a = summary["all"]
    expected = min(s.max_batch, rps * s.batch_ms / 1000.0 / args.workers)
    print(f"  answered 200: {a['ok_share']:.2%} (target >= 99.5%)")
    print(f"  p99 end to end: {a['p99_ms']:.1f} ms (target <= 600)")
    print(
        f"  mean batch: {a['mean_batch']:.1f}; the policy should give {expected:.1f} "
        f"(rate x batch time / replicas); ratio {a['mean_batch'] / expected:.2f} (target >= 0.9)"
    )
    print(
        f"  overhead p50 {a['overhead_p50_ms']:.1f} ms (target <= 10), "
        f"p99 {a['overhead_p99_ms']:.1f} ms (target <= 40)\n"
    )
    return {**summary, "expected_batch": expected}


def _overload(url: str, model: str, capacity: float, s: Settings, args: argparse.Namespace) -> dict:
    rps = 2.0 * capacity
    duration = min(30.0, args.duration)
    spec = LoadSpec(url, rps, duration, model, paid_share=0.3, paid_key=PAID_KEY, free_key=FREE_KEY)
    records = asyncio.run(run_spec(spec))
    summary = summarize(records)
    print_summary(f"2x capacity: {rps:.0f} req/s, 30% paid, for {duration:.0f} s", summary)
    paid, free, a = summary["paid"], summary["free"], summary["all"]
    print(f"  paid p99 {paid['p99_ms']:.1f} ms (target <= 600); paid answered 200: {paid['ok_share']:.2%}")
    print(f"  free 429s: {free['status_429']:.0f}, p99 time to 429: {free['p99_429_ms']:.1f} ms (target <= 50)")
    print(f"  requests without an answer: {a['no_answer']:.0f} of {a['sent']:.0f} (target 0)\n")
    return summary


SCENARIOS = {"low": _low, "load90": _load90, "overload": _overload}
