"""`keybatch bench rebalance`: demand moves from one model to the other; do the replicas
follow?

A deployment of 4 replicas (fixed backend) starts with 3 on kb-small and 1 on kb-large,
which suits an 80/20 mix. The offered load (a share of the fleet's capacity) is 80/20
for `--steady-s`, moves linearly to 20/80 over `--shift-s`, and stays there for
`--after-s`. Run once with `rebalance --auto` (the policy of `control/policy/rebalance.py`,
stepped by this process every 2 s, as `keybatch rebalance --auto` does) and once
without. Reported: when the replicas followed (the last move done), p99 per model in
5 s windows, and p99 per model from convergence to the end (with the rebalancer) or
over the same stretch (without).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

from control.bench.harness import Deployment, child_env
from control.core.settings import Settings
from control.fleet.operator import Operator
from control.load.generator import generate
from control.load.spec import LoadSpec, Record
from control.load.summary import percentile
from control.policy.rebalance import RebalanceConfig

SMALL, LARGE = "kb-small", "kb-large"
SEGMENT_S = 5.0
PAID_KEY, FREE_KEY = "kb-rebalance-paid", "kb-rebalance-free"


def _share_small(t: float, args: argparse.Namespace) -> float:
    if t < args.steady_s:
        return 0.8
    if t < args.steady_s + args.shift_s:
        return 0.8 - 0.6 * (t - args.steady_s) / args.shift_s
    return 0.2


def _drive(
    url: str, model: str, total_rps: float, args: argparse.Namespace, t0: float, out: list[tuple[float, Record]]
) -> None:
    """Open-loop load for one model in segments whose rate follows the mix."""
    end = args.steady_s + args.shift_s + args.after_s
    k = 0
    while (start := k * SEGMENT_S) < end:
        mid = start + SEGMENT_S / 2
        share = _share_small(mid, args) if model == SMALL else 1.0 - _share_small(mid, args)
        spec = LoadSpec(url, max(0.1, share * total_rps), SEGMENT_S, model=model, paid_share=0.2,
                        paid_key=PAID_KEY, free_key=FREE_KEY, seed=k + (0 if model == SMALL else 1000))  # fmt: skip
        offset = time.perf_counter() - t0
        out.extend((offset + r.sent_s, r) for r in generate(spec, show_progress=False))
        k += 1


def _windows(records: list[tuple[float, Record]], end_s: float) -> list[dict[str, Any]]:
    rows = []
    t = 0.0
    while t < end_s:
        inside = [r for s, r in records if t <= s < t + SEGMENT_S]
        ok = [r.latency_ms for r in inside if r.status == 200]
        rows.append({"t_s": t, "sent": len(inside), "ok": len(ok),
                     "p99_ms": round(percentile(ok, 99), 1) if ok else None})  # fmt: skip
        t += SEGMENT_S
    return rows


def _stretch(records: list[tuple[float, Record]], from_s: float) -> dict[str, Any]:
    inside = [r for s, r in records if s >= from_s]
    ok = [r.latency_ms for r in inside if r.status == 200]
    statuses: dict[str, int] = {}
    for r in inside:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "from_s": round(from_s, 1),
        "sent": len(inside),
        "statuses": statuses,
        "p50_ms": round(percentile(ok, 50), 1) if ok else None,
        "p99_ms": round(percentile(ok, 99), 1) if ok else None,
    }


def _run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    env = child_env(PAID_KEY, FREE_KEY, max_batch=str(args.max_batch))
    deployment = Deployment(f"rebalance-{mode}", 4, env, models=[SMALL, LARGE])
    deployment.start()
    stop = threading.Event()
    try:
        url = deployment.redis_url()
        op = Operator(Settings(redis_url=url, models={SMALL: SMALL, LARGE: LARGE}))
        snap = op.snapshot()
        large = sorted(r.name for r in snap.replicas if r.model == LARGE)
        op.move(large[0], SMALL, force=True, wait_s=20)  # 3 + 1: what an 80/20 mix wants
        capacity = 4 * args.max_batch * 4.0  # per 250 ms
        total = args.load * capacity
        end_s = args.steady_s + args.shift_s + args.after_s
        t0 = time.perf_counter()
        small_records: list[tuple[float, Record]] = []
        large_records: list[tuple[float, Record]] = []
        counts: list[tuple[float, int, int]] = []
        moves: list[dict[str, Any]] = []

        def sample() -> None:
            while not stop.is_set():
                try:
                    s = op.snapshot()
                    serving = [r for r in s.replicas if r.state_label == "serving"]
                    counts.append((time.perf_counter() - t0, sum(r.model == SMALL for r in serving),
                                   sum(r.model == LARGE for r in serving)))  # fmt: skip
                except Exception:  # a read that failed is a gap in the samples
                    pass
                stop.wait(1.0)

        def rebalance() -> None:
            for decisions, results in op.rebalance(auto=True, config=RebalanceConfig(), every_s=2.0, stop=stop):
                for d in decisions:
                    if d.is_move:
                        moves.append({"t_s": round(time.perf_counter() - t0, 1), "replica": d.replica,
                                      "to": d.to_model, "reason": d.reason,
                                      "ok": all(r.ok for r in results)})  # fmt: skip

        threads = [
            threading.Thread(target=_drive, args=(deployment.url, SMALL, total, args, t0, small_records), daemon=True),
            threading.Thread(target=_drive, args=(deployment.url, LARGE, total, args, t0, large_records), daemon=True),
            threading.Thread(target=sample, daemon=True),
        ]
        if mode == "auto":
            threads.append(threading.Thread(target=rebalance, daemon=True))
        for t in threads:
            t.start()
        threads[0].join()
        threads[1].join()
        stop.set()
        for t in threads[2:]:
            t.join(10)
    finally:
        stop.set()
        deployment.stop()
    shift_start = args.steady_s
    final = counts[-1][1:] if counts else (0, 0)
    converged_s = next(
        (t for t, s, g in counts if t >= shift_start and (s, g) == final and
         all(c[1:] == final for c in counts if c[0] >= t)), None,
    )  # fmt: skip
    from_s = converged_s if mode == "auto" and converged_s is not None else args.steady_s + args.shift_s
    return {
        "mode": mode,
        "offered_rps": total,
        "moves": moves,
        "replicas_over_time": [{"t_s": round(t, 1), SMALL: s, LARGE: g} for t, s, g in counts],
        "final_replicas": {SMALL: final[0], LARGE: final[1]},
        "converged_s": round(converged_s, 1) if converged_s is not None else None,
        "converged_after_shift_start_s": round(converged_s - shift_start, 1) if converged_s is not None else None,
        "after": {SMALL: _stretch(small_records, from_s), LARGE: _stretch(large_records, from_s)},
        "windows": {SMALL: _windows(small_records, end_s), LARGE: _windows(large_records, end_s)},
    }


def run_rebalance_bench(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {
        "command": f"keybatch bench rebalance --load {args.load:g} --max-batch {args.max_batch} "
        f"--steady-s {args.steady_s:g} --shift-s {args.shift_s:g} --after-s {args.after_s:g}",
    }
    for mode in [m for m in args.modes.split(",") if m]:
        result = _run(mode, args)
        report[mode] = result
        a = result["after"]
        print(
            f"{mode}: replicas now {result['final_replicas']}, converged "
            f"{result['converged_after_shift_start_s']} s after the shift began; moves {len(result['moves'])}; "
            f"from {a[SMALL]['from_s']} s: {SMALL} p99 {a[SMALL]['p99_ms']} ms {a[SMALL]['statuses']}, "
            f"{LARGE} p99 {a[LARGE]['p99_ms']} ms {a[LARGE]['statuses']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
