"""`keybatch bench cycle`: does the engine wait for the loop around it?

One replica at saturation (control/bench/cycle_driver.py, run in a child process per
run: a real embedded Valkey, the fixed backend, requests put straight into the buffer),
under each policy; with `--checkout`, the same driver against another checkout's replica,
runs interleaved A, B, A, B. The figures: a batch's (or step's) start-to-start time
against its own time, and the duty cycle, the engine's busy time over wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from control.bench.path_cpu import commit_of

DRIVER = Path(__file__).with_name("cycle_driver.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(checkout: Path, policy: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, str(DRIVER), policy, str(args.seconds), str(args.max_batch), str(args.batch_ms)]
    out = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, timeout=args.seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"the cycle driver failed on {checkout}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 4)


def run_cycle(args: argparse.Namespace) -> int:
    sides = {"this": ROOT} | ({"other": Path(args.checkout).resolve()} if args.checkout else {})
    policies = [p for p in args.policies.split(",") if p]
    runs: dict[str, dict[str, list[dict]]] = {side: {p: [] for p in policies} for side in sides}
    for _ in range(args.rounds):
        for policy in policies:
            for side, checkout in sides.items():
                runs[side][policy].append(_run(checkout, policy, args))
    result: dict = {
        "command": "keybatch bench cycle"
        + (" --checkout OTHER" if args.checkout else "")
        + f" --policies {args.policies} --rounds {args.rounds} --seconds {args.seconds:g}"
        + f" --max-batch {args.max_batch} --batch-ms {args.batch_ms:g}",
        "max_batch": args.max_batch,
        "batch_ms": args.batch_ms,
        "sides": {},
    }
    head = f"{'side':<8} {'commit':<14} {'policy':<11} {'start-to-start ms':>18} {'own ms':>8} {'duty':>7}"
    print(head + f" {'served/s':>9}")
    for side, checkout in sides.items():
        commit = commit_of(str(checkout))
        result["sides"][side] = {"commit": commit, "policies": {}}
        for policy in policies:
            rs = runs[side][policy]
            figures = {k: _median(rs, k) for k in ("start_to_start_ms", "run_ms", "duty_cycle", "served_per_s")}
            result["sides"][side]["policies"][policy] = {**figures, "runs": rs}
            print(
                f"{side:<8} {commit:<14} {policy:<11} {figures['start_to_start_ms']:>18.2f} {figures['run_ms']:>8.2f}"
                f" {figures['duty_cycle']:>7.3f} {figures['served_per_s']:>9.1f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
