"""`keybatch bench path-cpu` (also `gateway-cpu`): the whole path's CPU per request by
process kind (the gateway's workers, the replicas, the broker), this checkout against
another (an A/B across commits, same load, same machine, runs interleaved).

Each run starts `keybatch up --backend fixed --policy static` from one checkout (its
own `control` package, this interpreter and its installed libraries), warms it up,
then offers a fixed Poisson rate from this process and reads the CPU seconds each kind
of process spent during the load, per request answered: the gateway's worker
processes, the replicas, and the embedded Valkey. Runs alternate A, B, A, B ... so a
drift of the shared cores falls on both sides alike; each figure of a side is the
median of its runs (each kind's median on its own, and the median of the runs' totals).

With `--profile DIR`, each side then runs once more with a gateway process of its own
under cProfile beside the deployment, at a low rate (`--profile-rate`), and the functions
whose calls per request differ most between the sides are printed: call counts hold on
a shared machine where CPU seconds do not (docs/decisions/0024).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pstats
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import redis

from control.bench.harness import MODEL, Deployment, role
from control.core.procs import free_port
from control.load.generator import generate
from control.load.spec import LoadSpec
from control.load.summary import summarize

WARMUP_S = 3.0
# The checkout this module is in: its `control` runs the "this" side (not whichever one
# the interpreter's editable install points at).
THIS_CHECKOUT = Path(__file__).resolve().parents[2]
KINDS = ("gateway", "replica", "broker")  # the processes a request passes through, in its order


def cpu_seconds(procs: list[psutil.Process]) -> float:
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


def _processes(deployment: Deployment) -> dict[str, list[psutil.Process]]:
    """Each kind's processes, found once before the load (a process replaced during it
    would take its CPU with it: the run's `answered` then shows something went wrong)."""
    broker = deployment.broker()
    return {
        "gateway": deployment.gateway_workers(),
        "replica": [proc for _name, proc in deployment.replicas()],
        "broker": [broker] if broker is not None else [],
    }


def _broker_client(deployment: Deployment) -> redis.Redis | None:
    url = deployment.redis_url()
    return redis.Redis.from_url(url) if url else None


def _commands(client: redis.Redis | None) -> int | None:
    """The broker's commands processed so far (a script's own calls included); None: unread."""
    if client is None:
        return None
    try:
        return int(client.info("stats")["total_commands_processed"])
    except redis.RedisError:
        return None


def per_request_ms(before: dict[str, float], after: dict[str, float], answered: int) -> dict[str, float]:
    """CPU ms per answered request of each kind, and their total."""
    spent = {kind: (after[kind] - before[kind]) * 1000.0 / max(1, answered) for kind in KINDS}
    return {**spent, "total": sum(spent.values())}


def measure(checkout: str, args: argparse.Namespace, extra_env: dict[str, str] | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout, **(extra_env or {})}
    per_host = getattr(args, "replicas_per_host", 0)
    deployment = Deployment(f"cpu-{Path(checkout).name}", args.workers, env, cwd=checkout, replicas_per_host=per_host)
    deployment.start()
    try:
        generate(LoadSpec(deployment.url, args.rate, WARMUP_S, model=MODEL, seed=7), show_progress=False)
        procs = _processes(deployment)
        broker = _broker_client(deployment)
        before = {kind: cpu_seconds(procs[kind]) for kind in KINDS}
        commands_before = _commands(broker)
        records = generate(LoadSpec(deployment.url, args.rate, args.duration, model=MODEL, seed=1), show_progress=False)
        after = {kind: cpu_seconds(procs[kind]) for kind in KINDS}
        commands_after = _commands(broker)
    finally:
        deployment.stop()
    summary = summarize(records)["all"]
    answered = sum(r.status == 200 for r in records)
    commands = None
    if commands_before is not None and commands_after is not None:
        commands = round((commands_after - commands_before) / max(1, answered), 2)
    return {
        "broker_commands_per_request": commands,
        "answered": answered,
        "sent": len(records),
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "processes": {kind: len(found) for kind, found in procs.items()},
        "cpu_ms_per_request": per_request_ms(before, after, answered),
    }


PROFILED_GATEWAY = Path(__file__).with_name("profiled_gateway.py")
PROFILE_WARMUP_S = 2.0


def profile(checkout: str, args: argparse.Namespace, out: Path) -> dict:
    """A gateway process of its own under cProfile (control/bench/profiled_gateway.py),
    beside a deployment of `checkout` and on its broker, loaded at `--profile-rate`; its
    stats go to `out`. The figures: calls per request of each function."""
    env = {**os.environ, "PYTHONPATH": checkout}
    deployment = Deployment(f"profile-{Path(checkout).name}", args.workers, env, cwd=checkout)
    deployment.start()
    try:
        gateway = next(proc for proc in deployment.descendants() if role(proc) == "gateway")
        port = free_port()
        own = {**gateway.environ(), "PYTHONPATH": checkout, "KEYBATCH_PORT": str(port)}
        own.pop("PROMETHEUS_MULTIPROC_DIR", None)
        proc = subprocess.Popen([sys.executable, str(PROFILED_GATEWAY), str(out)], env=own, cwd=checkout)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url)
            rate = args.profile_rate
            generate(LoadSpec(url, rate, PROFILE_WARMUP_S, model=MODEL, seed=7), show_progress=False)
            records = generate(LoadSpec(url, rate, args.duration, model=MODEL, seed=1), show_progress=False)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    finally:
        deployment.stop()
    served = len(records) + round(args.profile_rate * PROFILE_WARMUP_S)  # the warm-up is in the profile
    stats = pstats.Stats(str(out))
    _check_ran(stats, checkout)
    return {
        "stats": str(out),
        "answered": sum(r.status == 200 for r in records),
        "requests_profiled": served,
        "calls_per_request": calls_per_request(stats, served),
    }


def _check_ran(stats: pstats.Stats, checkout: str) -> None:
    """The profiled gateway ran this side's `api` (an import that found another checkout's,
    or a port another gateway took first, would profile the wrong code without a word)."""
    ran = {Path(f).parent.parent for f, _line, _name in stats.stats if Path(f).parent.name == "api"}  # type: ignore[attr-defined]
    if ran != {Path(checkout).resolve()}:
        raise RuntimeError(f"the profiled gateway ran the api of {sorted(map(str, ran))}, not of {checkout}")


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the profiled gateway at {url} was not ready in {timeout_s:.0f} s")


def calls_per_request(stats: pstats.Stats, requests: int) -> dict[str, float]:
    """Calls of each function per request, by `file:function` (the file from its package on)."""
    calls: collections.Counter[str] = collections.Counter()
    for (filename, _line, name), (_primitive, total, *_times) in stats.stats.items():  # type: ignore[attr-defined]
        parts = Path(filename).parts
        where = parts[parts.index("site-packages") + 1 :] if "site-packages" in parts else parts[-2:]
        calls[f"{'/'.join(where)}:{_ADDRESS.sub('', name)}"] += total / max(1, requests)
    return dict(calls)


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # a built-in's name carries its object's address: not the same in two runs


def changed_calls(this: dict[str, float], other: dict[str, float], top: int = 25) -> list[tuple[str, float, float]]:
    """The functions whose calls per request differ most: (name, other, this)."""
    names = sorted(set(this) | set(other), key=lambda n: -abs(this.get(n, 0.0) - other.get(n, 0.0)))
    return [(name, other.get(name, 0.0), this.get(name, 0.0)) for name in names[:top]]


def side_medians(runs: list[dict]) -> dict[str, float]:
    """Each kind's median over a side's runs, and the median of the runs' totals."""
    return {kind: statistics.median(run["cpu_ms_per_request"][kind] for run in runs) for kind in (*KINDS, "total")}


def ratios(this: dict[str, float], other: dict[str, float]) -> dict[str, float | None]:
    """this / other for each kind (None where the other side spent nothing)."""
    return {kind: (this[kind] / other[kind] if other[kind] else None) for kind in this}


def _line(figures: dict[str, float]) -> str:
    return ", ".join(f"{kind} {figures[kind]:.3f}" for kind in (*KINDS, "total"))


def run_path_cpu(args: argparse.Namespace) -> int:
    sides = {"this": str(THIS_CHECKOUT), "other": str(Path(args.checkout).resolve())}
    other_env = dict(item.split("=", 1) for item in getattr(args, "other_env", None) or [])
    envs = {"this": {}, "other": other_env}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side, checkout in sides.items():
            started = time.monotonic()
            run = measure(checkout, args, envs[side])
            runs[side].append(run)
            print(
                f"round {round_ + 1} {side:5} ({commit_of(checkout)}): CPU ms/request "
                f"{_line(run['cpu_ms_per_request'])}; broker commands/request {run['broker_commands_per_request']}; "
                f"p50 {run['p50_ms']:.0f} ms, {run['answered']}/{run['sent']} answered "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    report: dict[str, object] = {
        "rate_rps": args.rate,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "workers": args.workers,
        "command": f"keybatch bench path-cpu --checkout OTHER --rate {args.rate:g} --duration {args.duration:g} "
        f"--rounds {args.rounds} --workers {args.workers}"
        + (f" --replicas-per-host {args.replicas_per_host}" if args.replicas_per_host else "")
        + "".join(f" --other-env {k}={v}" for k, v in other_env.items()),
    }
    medians = {side: side_medians(runs[side]) for side in sides}
    for side, checkout in sides.items():
        report[side] = {
            "commit": commit_of(checkout),
            "env": envs[side],
            "cpu_ms_per_request_median": medians[side],
            "runs": runs[side],
        }
    ratio = ratios(medians["this"], medians["other"])
    report["ratio_this_over_other"] = ratio
    for side in sides:
        print(f"CPU ms per request, {side:5}: {_line(medians[side])}")
    shown = (f"{kind} {r:.2f}" if r is not None else f"{kind} -" for kind, r in ratio.items())
    print("ratio this/other: " + ", ".join(shown))
    if args.profile:
        where = Path(args.profile)
        where.mkdir(parents=True, exist_ok=True)
        profiles = {side: profile(checkout, args, where / f"{side}.prof") for side, checkout in sides.items()}
        changed = changed_calls(profiles["this"]["calls_per_request"], profiles["other"]["calls_per_request"])
        report["profile"] = {
            "rate_rps": args.profile_rate,
            **{side: {k: v for k, v in found.items() if k != "calls_per_request"} for side, found in profiles.items()},
            "changed_calls_per_request": [{"function": n, "other": o, "this": t} for n, o, t in changed],
        }
        print("gateway calls per request that differ most (other -> this):")
        for name, before, after in changed:
            print(f"  {before:8.2f} -> {after:8.2f}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
