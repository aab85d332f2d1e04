"""`keybatch bench dash`: the dashboard's own cost, watching a fleet under load.

Starts `keybatch up --backend fixed` with N replicas over two models, offers open-loop
load to both, and runs `keybatch dash` in a real terminal (a detached tmux session of
100x30) against the same broker. The dashboard's CPU is read from its process over the
measured window; when it quits it writes an SVG of its screen.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from control.bench.harness import Deployment
from control.load.generator import generate
from control.load.spec import LoadSpec

MODELS = ("kb-small", "kb-large")


def _dash_process(session: str) -> psutil.Process | None:
    out = subprocess.run(["tmux", "list-panes", "-t", session, "-F", "#{pane_pid}"], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        return None
    shell = psutil.Process(int(out.stdout.split()[0]))
    for proc in [shell, *shell.children(recursive=True)]:
        try:
            if " dash" in " ".join(proc.cmdline()):
                return proc
        except psutil.Error:
            continue
    return None


def run_dash_bench(args: argparse.Namespace) -> int:
    if shutil.which("tmux") is None:
        print("keybatch bench dash runs the dashboard in tmux, which is not installed", file=sys.stderr)
        return 2
    env = {**os.environ, "KEYBATCH_MODELS": json.dumps({m: m for m in MODELS})}
    deployment = Deployment("dash", args.replicas, env, models=list(MODELS))
    deployment.start()
    session = f"kb-dash-{os.getpid()}"
    svg = str(Path(args.svg).resolve()) if args.svg else None
    stop = threading.Event()
    try:
        url = deployment.redis_url()
        capacity_per_model = args.replicas / len(MODELS) * 64 * 4.0  # 64 per 250 ms per replica
        rate = args.load * capacity_per_model

        def load(model: str) -> None:
            while not stop.is_set():
                generate(LoadSpec(deployment.url, rate, 5.0, model=model), show_progress=False)

        loaders = [threading.Thread(target=load, args=(m,), daemon=True) for m in MODELS]
        for t in loaders:
            t.start()
        cmd = [sys.executable, "-m", "control", "dash", "--exit-after", str(args.duration + 10)]
        if svg:
            cmd += ["--screenshot", svg]
        dash_env = f"KEYBATCH_REDIS_URL={url} KEYBATCH_MODELS='{env['KEYBATCH_MODELS']}' "
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "30", dash_env + " ".join(cmd)], check=True
        )
        time.sleep(5.0)  # started, first reads done
        proc = _dash_process(session)
        if proc is None:
            print("the dashboard did not start", file=sys.stderr)
            return 1
        before = proc.cpu_times()
        time.sleep(args.duration)
        after = proc.cpu_times()
        cpu_s = (after.user + after.system) - (before.user + before.system)
        screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
        deadline = time.monotonic() + 20
        while _dash_process(session) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop.set()
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        deployment.stop()
    report = {
        "replicas": args.replicas,
        "models": list(MODELS),
        "offered_rps_per_model": rate,
        "duration_s": args.duration,
        "dash_cpu_s": round(cpu_s, 2),
        "dash_cores": round(cpu_s / args.duration, 4),
        "screen": screen,
        "command": f"keybatch bench dash --replicas {args.replicas} --duration {args.duration:g} --load {args.load:g}",
    }
    print(screen)
    print(f"keybatch dash watching {args.replicas} replicas for {args.duration:.0f} s: {cpu_s:.2f} s of CPU "
          f"({100 * cpu_s / args.duration:.1f}% of a core)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
