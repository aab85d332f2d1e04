"""`keybatch bench serving`: the whole path under Poisson load, with figures.

Starts a private deployment (embedded Valkey, N fixed-latency replicas, the
gateway), runs the serving scenarios one after another and prints what the
issue asks to see, each next to its target.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from control.loadgen import LoadSpec, generate, print_summary, summarize
from control.settings import Settings
from control.up import Plan, System

PAID_KEY, FREE_KEY = "bench-paid", "bench-free"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_serving(settings: Settings, args: argparse.Namespace) -> int:
    """Each scenario on a fresh deployment, so one cannot leave work for the next."""
    results: dict[str, object] = {}
    for name in [s for s in args.scenarios.split(",") if s]:
        batch = args.overload_batch if name == "overload" else None
        with _deployment(args.workers, batch) as (url, model, s):
            capacity = args.workers * s.max_batch * 1000.0 / s.batch_ms
            print(
                f"\n== {name}: {args.workers} replicas x {s.max_batch} per {s.batch_ms:.0f} ms (fixed backend, "
                f"simulated) = {capacity:.0f} req/s; max_wait {s.max_wait_ms:.0f} ms; "
                f"gateway {s.api_worker_class} x{s.api_processes}"
            )
            results[name] = {"capacity_rps": capacity, **SCENARIOS[name](url, model, capacity, s, args)}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


@contextmanager
def _deployment(workers: int, max_batch: int | None) -> Iterator[tuple[str, str, Settings]]:
    os.environ["KEYBATCH_API_KEYS"] = json.dumps({PAID_KEY: "paid", FREE_KEY: "free"})
    if max_batch is not None:
        os.environ["KEYBATCH_MAX_BATCH"] = str(max_batch)
    try:
        settings = Settings()
        model = next(iter(settings.models))
        system = System(settings, Plan(workers=workers, models=[model], port=_free_port(), quiet=True))
        system.start()
        try:
            _warm(system.url, model)
            yield system.url, model, settings
        finally:
            system.stop()
    finally:
        os.environ.pop("KEYBATCH_MAX_BATCH", None)


def _warm(url: str, model: str) -> None:
    generate(LoadSpec(url, 50, 2.0, model, free_key=FREE_KEY), show_progress=False)


def _low(url: str, model: str, capacity: float, s: Settings, args: argparse.Namespace) -> dict:
    spec = LoadSpec(url, 5.0, 20.0, model, free_key=FREE_KEY)
    summary = summarize(generate(spec))
    print_summary("low load: 5 req/s for 20 s", summary)
    target = s.batch_ms + s.max_wait_ms + 15
    print(f"  p50 {summary['all']['p50_ms']:.1f} ms (target <= {target:.0f} = batch + max_wait + 15)\n")
    return summary


def _load90(url: str, model: str, capacity: float, s: Settings, args: argparse.Namespace) -> dict:
    rps = 0.9 * capacity
    spec = LoadSpec(url, rps, args.duration, model, free_key=FREE_KEY)
    summary = summarize(generate(spec))
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
        f"  overhead, the system's own time (end to end - queue - batch) p50 {a['system_p50_ms']:.1f} ms "
        f"(target <= 10), p99 {a['system_p99_ms']:.1f} ms (target <= 40)"
    )
    print(
        f"    of which inside the gateway (its total - queue - batch): p50 {a['gateway_p50_ms']:.1f} ms, "
        f"p99 {a['gateway_p99_ms']:.1f} ms; the rest is the client and the sockets on the same 2 cores"
    )
    floor = s.batch_ms / (2 * args.workers)
    print(
        f"  end to end - batch, which adds the wait for the next batch start ({a['queue_p50_ms']:.0f} ms p50; "
        f"{floor:.0f} ms on average at best with {s.batch_ms:.0f} ms batches on {args.workers} staggered replicas): "
        f"p50 {a['overhead_p50_ms']:.1f} ms, p99 {a['overhead_p99_ms']:.1f} ms\n"
    )
    return {**summary, "expected_batch": expected}


def _overload(url: str, model: str, capacity: float, s: Settings, args: argparse.Namespace) -> dict:
    rps = 2.0 * capacity
    duration = min(30.0, args.duration)
    spec = LoadSpec(url, rps, duration, model, paid_share=0.3, paid_key=PAID_KEY, free_key=FREE_KEY)
    records = generate(spec)
    summary = summarize(records)
    print_summary(f"2x capacity: {rps:.0f} req/s, 30% paid, for {duration:.0f} s", summary)
    paid, free, a = summary["paid"], summary["free"], summary["all"]
    print(f"  paid p99 {paid['p99_ms']:.1f} ms (target <= 600); paid answered 200: {paid['ok_share']:.2%}")
    print(f"  free 429s: {free['status_429']:.0f}, p99 time to 429: {free['p99_429_ms']:.1f} ms (target <= 50)")
    print(f"  requests without an answer: {a['no_answer']:.0f} of {a['sent']:.0f} (target 0)\n")
    return summary


def _curve(url: str, model: str, capacity: float, s: Settings, args: argparse.Namespace) -> dict:
    """The system's own time against load: it grows with the answers each batch end
    releases at once (the gateway answers them one after another), not with the rate."""
    points = {}
    for share in (0.2, 0.5, 0.7, 0.9):
        spec = LoadSpec(url, share * capacity, 15.0, model, free_key=FREE_KEY)
        a = summarize(generate(spec, show_progress=False))["all"]
        points[f"{share:.0%}"] = a
        print(
            f"  {share:4.0%} load ({share * capacity:3.0f} req/s): mean batch {a['mean_batch']:4.1f}; "
            f"system's own time p50 {a['system_p50_ms']:5.1f} ms, p99 {a['system_p99_ms']:5.1f} ms; "
            f"inside the gateway p50 {a['gateway_p50_ms']:5.1f} ms"
        )
    return points


SCENARIOS = {"low": _low, "load90": _load90, "overload": _overload, "curve": _curve}
