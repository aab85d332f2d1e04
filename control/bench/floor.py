"""`keybatch bench floor`: what one HTTP request costs the gateway's stack before any of
keybatch's own work: gunicorn with gevent's pywsgi (the gateway's server), serving a
completion-shaped answer at once, through Flask (one route, `request.get_json`,
`jsonify`) and as a bare WSGI function, at the same Poisson rate from the load generator
the other benches use. The figure is the worker process's CPU per answered request, the
median of interleaved runs: the least a Flask gateway on this server can cost a request
on this machine, against which the path's own figure (`keybatch bench path-cpu`) reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import psutil

from control.bench.harness import MODEL
from control.bench.path_cpu import _wait_ready
from control.core.procs import free_port
from control.load.generator import generate
from control.load.spec import LoadSpec

WARMUP_S = 2.0
# The apps live in a module of their own that loads nothing else of keybatch: a larger heap
# would make the worker's garbage collection, and so the floor, cost more.
APPS = {"flask": "control.bench.floor_apps:flask_app", "wsgi": "control.bench.floor_apps:wsgi_app"}


def _serve(app: str, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "gunicorn", "--worker-class", "gevent", "--workers", "1"]
    argv += ["--bind", f"127.0.0.1:{port}", "--log-level", "warning", app]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(app: str, rate: float, duration_s: float) -> dict[str, float]:
    """One run: the worker's CPU ms per answered request at `rate`."""
    port = free_port()
    server = _serve(app, port)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url)
        workers = psutil.Process(server.pid).children()
        generate(LoadSpec(url, rate, WARMUP_S, model=MODEL, seed=7), show_progress=False)
        before = sum(sum(w.cpu_times()[:2]) for w in workers)
        records = generate(LoadSpec(url, rate, duration_s, model=MODEL, seed=1), show_progress=False)
        after = sum(sum(w.cpu_times()[:2]) for w in workers)
    finally:
        server.terminate()
        server.wait(30)
    answered = sum(r.status == 200 for r in records)
    return {
        "answered": answered,
        "sent": len(records),
        "cpu_ms_per_request": (after - before) * 1000.0 / max(1, answered),
    }


def run_floor(args: argparse.Namespace) -> int:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in APPS}
    for round_ in range(args.rounds):
        for name, app in APPS.items():
            run = measure(app, args.rate, args.duration)
            runs[name].append(run)
            print(
                f"round {round_ + 1} {name:5}: {run['cpu_ms_per_request']:.3f} CPU ms per request, "
                f"{run['answered']:.0f}/{run['sent']:.0f} answered",
                flush=True,
            )
    medians = {name: statistics.median(r["cpu_ms_per_request"] for r in found) for name, found in runs.items()}
    for name, value in medians.items():
        print(f"{name:5} on gunicorn + gevent: {value:.3f} CPU ms per request (median of {args.rounds})")
    if args.json:
        report = {
            "command": f"keybatch bench floor --rate {args.rate:g} --duration {args.duration:g} --rounds {args.rounds}",
            "rate_rps": args.rate,
            "duration_s": args.duration,
            "cpu_ms_per_request_median": medians,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
