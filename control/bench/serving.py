"""`keybatch bench serving`: the whole path under Poisson load, with figures.

Starts a private deployment (embedded Valkey, N fixed-latency replicas, the
gateway), runs the serving scenarios one after another and prints what the
serving targets ask to see, each next to its target.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from control.bench.harness import fixed_fleet, hf_fleet
from control.core.settings import Settings
from control.load.generator import generate
from control.load.printing import print_summary
from control.load.spec import LoadSpec
from control.load.summary import summarize

PAID_KEY, FREE_KEY = "bench-paid", "bench-free"


def run_serving(settings: Settings, args: argparse.Namespace) -> int:
    """Each scenario on a fresh deployment, so one cannot leave work for the next."""
    results: dict[str, object] = {}
    if getattr(args, "collector", None):  # the deployment's processes take their settings from the environment
        os.environ["KEYBATCH_COLLECTOR"] = args.collector
    for name in [s for s in args.scenarios.split(",") if s]:
        batch = args.overload_batch if name == "overload" else None
        with fixed_fleet(args.workers, PAID_KEY, FREE_KEY, batch) as (url, model, s):
            capacity = args.workers * s.max_batch * 1000.0 / s.batch_ms
            print(
                f"\n== {name}: {args.workers} replicas x {s.max_batch} per {s.batch_ms:.0f} ms (fixed backend, "
                f"simulated) = {capacity:.0f} req/s; max_wait {s.max_wait_ms:.0f} ms; "
                f"gateway {s.api_worker_class} x{s.api_processes}; {s.collector} collector"
            )
            results[name] = {
                "capacity_rps": capacity,
                "collector": s.collector,
                **SCENARIOS[name](url, model, capacity, s, args),
            }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


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


# -- static against continuous batching on the real model -----------------------------


def run_policies(settings: Settings, args: argparse.Namespace) -> int:
    """Sustainable rate (p99 <= the target, >= 99% answered 200) of each policy on the same
    open-loop workload, then both at one common rate; streaming's time to first token;
    the prefix cache on a workload whose requests share file headers."""
    from control.load import workloads

    bodies = workloads.mixed(args.requests, seed=args.seed)
    results: dict[str, Any] = {"model": args.model, "workers": args.workers, "p99_target_ms": args.p99_ms}
    policies = [p for p in args.policies.split(",") if p]
    for policy in policies:
        with hf_fleet(args.workers, policy, args.model, PAID_KEY, FREE_KEY) as url:
            results[policy] = ladder(url, args, bodies, f"{policy}")
    common = args.common_rate or min(results[p]["sustainable_rps"] or args.start_rate for p in policies)
    results["common_rps"] = common
    for policy in policies:
        with hf_fleet(args.workers, policy, args.model, PAID_KEY, FREE_KEY) as url:
            summary = run_load(url, args, bodies, common, f"{policy} at the common rate {common:.2f} req/s")
            results[f"{policy}_at_common"] = summary["all"]
            if policy == "continuous":
                streamed = run_load(url, args, bodies, common, f"{policy}, streaming, {common:.2f} req/s", stream=True)
                results["continuous_stream_at_common"] = streamed["all"]
    if args.prefix:
        results["prefix"] = _prefix(args)
    _print_policies(results, policies)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


def run_load(
    url: str,
    args: argparse.Namespace,
    bodies: list[dict],
    rps: float,
    title: str,
    stream: bool = False,
    **spec_fields: Any,
) -> dict:
    """`spec_fields` replace the load's defaults (another server takes another model name, no key)."""
    spec = LoadSpec(
        url,
        rps,
        args.duration,
        args.model,
        free_key=FREE_KEY,
        deadline_ms=args.deadline_ms,
        bodies=bodies,
        stream=stream,
        seed=args.seed,
    )
    summary = summarize(generate(replace(spec, **spec_fields)))
    print_summary(title, summary)
    return summary


def ladder(
    url: str,
    args: argparse.Namespace,
    bodies: list[dict],
    policy: str,
    settle: Callable[[], dict] | None = None,
    **spec_fields: Any,
) -> dict:
    """Rates growing by `--step` from `--start-rate` until a rate misses the target twice in a row.
    `settle`, if given, runs before each rate after the first (a server still working off the
    last rate would count against the next) and what it returns is kept with the rate."""
    points: list[dict] = []
    best, misses, rps = None, 0, args.start_rate
    while misses < 2 and rps <= args.max_rate:
        settled = settle() if settle is not None and points else {}
        title = f"{policy}: {rps:.2f} req/s for {args.duration:.0f} s"
        a = run_load(url, args, bodies, rps, title, **spec_fields)["all"]
        ok = a["ok_share"] >= 0.99 and a["p99_ms"] <= args.p99_ms
        points.append({"rps": rps, "ok": ok, **a, **settled})
        best, misses = (rps, 0) if ok else (best, misses + 1)
        rps *= args.step
    return {"sustainable_rps": best, "points": points}


def _prefix(args: argparse.Namespace) -> dict:
    """Goodput and hit rate with the prefix cache and without, offered more than either serves."""
    from control.load import workloads

    bodies = workloads.shared_prefix(args.requests, seed=args.seed)
    out = {}
    for label, tokens in (("cache", None), ("no_cache", "0")):
        env = {} if tokens is None else {"prefix_cache_tokens": tokens}
        with hf_fleet(args.workers, "continuous", args.model, PAID_KEY, FREE_KEY, **env) as url:
            spec = LoadSpec(
                url, args.prefix_rate, args.duration, args.model, free_key=FREE_KEY, deadline_ms=args.deadline_ms
            )
            spec.bodies = bodies
            records = generate(spec)
            summary = summarize(records)
            print_summary(f"shared file headers, prefix cache {label}: {args.prefix_rate:.1f} req/s offered", summary)
            ok = sum(r.status == 200 for r in records)
            out[label] = {
                **summary["all"],
                "goodput_rps": ok / args.duration,
                "hit_rate": _hit_rate(url),
            }
    return out


def _hit_rate(url: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    rates = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("keybatch_prefix_cache_hit_rate{")
    ]
    return sum(rates) / len(rates) if rates else 0.0


def _print_policies(results: dict, policies: list[str]) -> None:
    print("\n== static against continuous")
    for policy in policies:
        print(
            f"  {policy:10} sustainable rate at p99 <= {results['p99_target_ms']:.0f} ms: "
            f"{results[policy]['sustainable_rps']} req/s"
        )
    for policy in policies:
        a = results[f"{policy}_at_common"]
        print(
            f"  {policy:10} at {results['common_rps']:.2f} req/s: p50 {a['p50_ms']:.0f} ms, "
            f"p99 {a['p99_ms']:.0f} ms, 200: {a['ok_share']:.1%}"
        )
    if "continuous_stream_at_common" in results:
        s = results["continuous_stream_at_common"]
        print(f"  streaming time to first token: p50 {s['ttft_p50_ms']:.0f} ms, p99 {s['ttft_p99_ms']:.0f} ms")
    if "prefix" in results:
        for label, r in results["prefix"].items():
            print(
                f"  prefix {label:8}: goodput {r['goodput_rps']:.2f} req/s, hit rate {r['hit_rate']:.1%}, "
                f"p50 {r['p50_ms']:.0f} ms"
            )
