"""`keybatch bench peer`: keybatch against `transformers serve --continuous-batching`.

Both servers serve the same model folder with the same torch threads and get the same
open-loop workload (`workloads.mixed`). For each, one after the other:

1. an idle probe: short requests at 1 req/s, whose p50 is what "normal" means later;
2. the sustainable rate: the ladder of control/bench/serving.py (>= 99% answered 200, p99 within
   the target), the server let settle between rates;
3. a burst at twice that rate, while the probe goes on for up to `--recovery-s` after the
   burst: how many got an answer in time, and how long until the probe is normal again.

The peer runs as a child process in its own process group, fully offline; the group is
killed at the end, whatever happens. If it cannot serve with continuous batching, what
failed is recorded and it is measured without (labelled so).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import uvloop

from control.bench import serving as bench
from control.bench.harness import hf_fleet
from control.core.memory import collector_paused
from control.core.procs import free_port
from control.core.settings import Settings
from control.load.generator import generate, run_spec
from control.load.httpclient import Client
from control.load.spec import LoadSpec, Record

PEER_INSTALL = "pip install -e .[peer]"
PEER_MODULES = ("fastapi", "uvicorn", "openai")  # transformers serve refuses to start without them


class PeerFailed(RuntimeError):
    """The peer did not come up, or did not answer its first request."""


# -- the peer's process ----------------------------------------------------------------


@dataclass
class PeerServer:
    """How `transformers serve` is started: one model folder, pinned (the `model` field of
    every request must then be the folder's path as given here)."""

    folder: str
    port: int
    threads: int
    continuous: bool = True
    memory_share: float = 0.2
    extra: list[str] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return "continuous batching" if self.continuous else "sequential (no continuous batching)"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.folder]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--log-level", "warning"]
        if self.continuous:
            # On CPU the paged cache otherwise takes 60% of the machine's free memory.
            cmd += ["--continuous-batching", "--cb-max-memory-percent", str(self.memory_share)]
        return cmd + self.extra

    def env_changes(self) -> dict[str, str]:
        threads = str(self.threads)  # torch reads these at import: the same compute keybatch's replicas get
        return {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_UPDATE_CHECK": "1",  # else its command line asks PyPI for a newer version
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
        }

    def shown(self) -> str:
        """The command as one would type it, with the environment it differs by (`python`
        and the model folder's name, not this machine's paths)."""
        env = " ".join(f"{k}={v}" for k, v in self.env_changes().items())
        cmd = ["python", *self.command()[1:]]
        cmd[cmd.index(self.folder)] = Path(self.folder).name
        return f"{env} {shlex.join(cmd)}"


@contextmanager
def peer_process(server: PeerServer, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            server.command(),
            env={**os.environ, **server.env_changes()},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so the whole group can be killed
        )
    try:
        yield proc
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM to the peer's group, then SIGKILL to whatever of it is left."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_ready(server: PeerServer, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Seconds until GET /health answers 200 (the pinned model is loaded before it listens)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise PeerFailed(f"exited with code {proc.returncode} before answering /health")
        with suppress(OSError):
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return time.monotonic() - start
        time.sleep(0.5)
    raise PeerFailed(f"/health did not answer 200 within {timeout_s:.0f} s")


def first_answer(url: str, body: dict, timeout_s: float) -> float:
    """Seconds the first completion takes (continuous batching allocates its cache then)."""
    request = urllib.request.Request(
        f"{url}/v1/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            completion = orjson.loads(answer.read())
    except urllib.error.HTTPError as exc:
        raise PeerFailed(f"first request answered {exc.code}: {exc.read()[:500].decode(errors='replace')}") from exc
    except (OSError, ValueError) as exc:
        raise PeerFailed(f"first request failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(completion, dict) or not completion.get("choices"):
        raise PeerFailed(f"first request answered 200 without a completion: {completion!r:.500}")
    return time.monotonic() - start


def _log_tail(path: Path, lines: int = 30) -> str:
    with suppress(OSError):
        return "\n".join([line for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:])
    return ""


# -- a server under test, as its clients see it ---------------------------------------


@dataclass
class Target:
    name: str
    url: str
    model: str  # the `model` field of a request body
    key: str | None  # the API key the clients send (keybatch's free tier; the peer takes none)
    burst_deadline_ms: float | None  # the burst's and the probe's X-Deadline-Ms (the peer knows none)
    probe_timeout_s: float
    burst_timeout_s: float
    spec_fields: dict[str, Any]  # how its ladder's load differs from bench.run_load's (model, key, deadline)

    @property
    def headers(self) -> dict[str, str]:
        """The probe's."""
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        if self.burst_deadline_ms:
            headers["X-Deadline-Ms"] = str(self.burst_deadline_ms)
        return headers


@dataclass
class Probe:
    sent_s: float  # seconds since the probe's second 0 (the burst's start)
    status: int  # 0: no answer within the timeout
    latency_ms: float


async def _probe_once(client: Client, target: Target, body: bytes, t0: float) -> Probe:
    start = time.perf_counter()
    try:
        answer = await client.post("/v1/completions", body, target.headers, target.probe_timeout_s)
        status, done = answer.status, answer.done_s
    except (TimeoutError, OSError):
        status, done = 0, time.perf_counter()
    return Probe(round(start - t0, 3), status, round((done - start) * 1000, 1))


async def _probes(
    target: Target, body: bytes, t0: float, every_s: float, end_s: float, stop: Callable[[list[Probe]], bool]
) -> list[Probe]:
    """One probe every `every_s` from `t0` until `end_s`, or until `stop` says so of those answered."""
    client = Client(target.url)
    tasks: list[asyncio.Task[Probe]] = []
    try:
        for i in itertools.count():
            if i * every_s >= end_s or stop(_answered(tasks)):
                break
            await asyncio.sleep(max(0.0, t0 + i * every_s - time.perf_counter()))
            tasks.append(asyncio.create_task(_probe_once(client, target, body, t0)))
        return list(await asyncio.gather(*tasks))
    finally:
        client.close()


def _answered(tasks: list[asyncio.Task[Probe]]) -> list[Probe]:
    """The probes answered so far, up to the first still outstanding (in the order sent)."""
    done = []
    for task in tasks:
        if not task.done():
            break
        done.append(task.result())
    return done


def recovery_index(probes: list[Probe], threshold_ms: float, window: int = 3) -> int | None:
    """The first normal probe (a 200 within `threshold_ms`) from which on every `window`
    consecutive probes have their p50 within `threshold_ms`; None if the last window has not.
    A median, so that one slow probe on a busy machine does not count as a relapse."""
    latencies = [p.latency_ms if p.status == 200 else float("inf") for p in probes]
    normal = [statistics.median(latencies[i : i + window]) <= threshold_ms for i in range(len(probes) - window + 1)]
    k = len(normal)
    while k > 0 and normal[k - 1]:
        k -= 1
    if k == len(normal):
        return None
    while latencies[k] > threshold_ms:  # a normal window's p50 is one of its probes: this ends in the window
        k += 1
    return k


def _has_recovered(probes: list[Probe], threshold_ms: float, after_s: float, hold: int) -> bool:
    """Normal since some probe, and for `hold` probes sent after `after_s` (the burst's end)."""
    k = recovery_index(probes, threshold_ms)
    return k is not None and sum(p.sent_s >= after_s for p in probes[k:]) >= hold


def _probe_body(target: Target, bodies: list[dict], max_tokens: int) -> bytes:
    shortest = min(bodies, key=lambda b: len(b["prompt"]))
    return orjson.dumps(
        {"model": target.model, "prompt": shortest["prompt"], "max_tokens": max_tokens, "temperature": 0.0}
    )


def _run_async(coro: Any) -> Any:
    with collector_paused():
        return uvloop.run(coro)


# -- the measurements ------------------------------------------------------------------


def _idle_probe(target: Target, body: bytes, args: argparse.Namespace) -> dict:
    n = args.idle_probes
    t0 = time.perf_counter()
    probes = _run_async(_probes(target, body, t0, 1.0 / args.probe_rps, n / args.probe_rps, lambda _: False))
    ok = [p.latency_ms for p in probes if p.status == 200]
    if not ok:
        return {"p50_ms": None, "answered_200": 0, "sent": len(probes)}
    return {"p50_ms": statistics.median(ok), "answered_200": len(ok), "sent": len(probes)}


def _settle(target: Target, body: bytes, threshold_ms: float, cap_s: float, streak: int = 3) -> dict:
    """Probes one at a time until `streak` in a row are normal (a server still working for
    clients that have gone is not), at most `cap_s`."""

    async def settle() -> dict:
        client = Client(target.url)
        start = time.perf_counter()
        normal = 0
        try:
            while normal < streak and time.perf_counter() - start < cap_s:
                probe = await _probe_once(client, target, body, start)
                normal = normal + 1 if probe.status == 200 and probe.latency_ms <= threshold_ms else 0
                await asyncio.sleep(0.2)  # a quick refusal must not become a busy loop
        finally:
            client.close()
        return {"settle_s": round(time.perf_counter() - start, 1), "settled": normal >= streak}

    result: dict = _run_async(settle())
    return result


def _burst(
    target: Target, bodies: list[dict], rps: float, body: bytes, threshold_ms: float, args: argparse.Namespace
) -> tuple[list[Record], list[Probe]]:
    """The burst's records and the probes sent through it and after it."""
    spec = LoadSpec(
        target.url,
        rps,
        args.burst_s,
        target.model,
        free_key=target.key,
        deadline_ms=target.burst_deadline_ms,
        timeout_s=target.burst_timeout_s,
        bodies=bodies,
        seed=args.seed + 1,
    )

    def stop(probes: list[Probe]) -> bool:
        return _has_recovered(probes, threshold_ms, args.burst_s, args.hold_probes)

    async def both() -> tuple[list[Record], list[Probe]]:
        t0 = time.perf_counter() + 0.1
        burst = asyncio.create_task(run_spec(replace(spec, start_at=t0), show_progress=False))
        probes = await _probes(target, body, t0, 1.0 / args.probe_rps, args.burst_s + args.recovery_s, stop)
        return await burst, probes

    records, probes = _run_async(both())
    return records, probes


def _burst_report(
    target: Target,
    records: list[Record],
    probes: list[Probe],
    rps: float,
    threshold_ms: float,
    args: argparse.Namespace,
) -> dict:
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    in_time_ms = (target.burst_deadline_ms + args.margin_ms) if target.burst_deadline_ms else None
    if in_time_ms is not None:  # keybatch: every request answered 200, 429 or 504 within its deadline
        late = [r for r in records if r.status not in (200, 429, 504) or r.latency_ms > in_time_ms]
    else:  # the peer: what the clients gave up on
        late = [r for r in records if r.status == 0]
    useful_ms = args.burst_deadline_ms  # one yardstick for both: a 200 an IDE could still show
    k = recovery_index(probes, threshold_ms)
    recovery_s = None if k is None else round(max(0.0, probes[k].sent_s - args.burst_s), 1)
    ok = sorted(r.latency_ms for r in records if r.status == 200)
    return {
        "offered_rps": rps,
        "duration_s": args.burst_s,
        "sent": len(records),
        "by_status": dict(sorted(statuses.items())),  # "0": no answer before the client gave up
        "no_answer_in_time": len(late),
        "in_time_limit_ms": in_time_ms if in_time_ms is not None else target.burst_timeout_s * 1000,
        "ok_within_ms": {"ms": useful_ms, "count": sum(x <= useful_ms for x in ok)},
        "p50_ms": statistics.median(ok) if ok else None,
        "recovery_s": recovery_s,  # None: not normal within recovery_s after the burst
        "recovery_threshold_ms": threshold_ms,
        "probes": [[round(p.sent_s - args.burst_s, 1), p.status, p.latency_ms] for p in probes],
    }


def _measure(target: Target, args: argparse.Namespace, bodies: list[dict]) -> dict:
    """Idle probe, ladder, burst: one server, already warm."""
    body = _probe_body(target, bodies, args.probe_tokens)
    idle = _idle_probe(target, body, args)
    if idle["p50_ms"] is None:
        return {"idle_probe": idle, "sustainable_rps": None, "error": "no probe answered 200 while idle"}
    threshold = args.recovery_factor * idle["p50_ms"]

    def settle() -> dict:
        return _settle(target, body, threshold, args.settle_s)

    ladder = bench.ladder(target.url, args, bodies, target.name, settle=settle, **target.spec_fields)
    capacity = ladder["sustainable_rps"]
    rps = args.burst_factor * (capacity or args.start_rate)
    before = settle()
    print(f"\n== {target.name}: burst at {rps:.2f} req/s for {args.burst_s:.0f} s, then the probe", flush=True)
    records, probes = _burst(target, bodies, rps, body, threshold, args)
    burst = _burst_report(target, records, probes, rps, threshold, args)
    burst["settled_before"] = before
    burst["capacity_basis"] = "sustainable rate" if capacity else "start rate (no rate was sustainable)"
    return {"idle_probe": idle, "sustainable_rps": capacity, "ladder": ladder, "burst": burst}


def _peer_target(server: PeerServer, args: argparse.Namespace) -> Target:
    return Target(
        name="peer",
        url=server.url,
        model=server.folder,
        key=None,
        burst_deadline_ms=None,
        probe_timeout_s=args.timeout_s,
        burst_timeout_s=args.timeout_s,
        spec_fields={"model": server.folder, "free_key": None, "deadline_ms": None, "timeout_s": args.timeout_s},
    )


def _keybatch_target(url: str, args: argparse.Namespace) -> Target:
    deadline_s = args.burst_deadline_ms / 1000
    return Target(
        name="keybatch",
        url=url,
        model=args.model,
        key=bench.FREE_KEY,
        burst_deadline_ms=args.burst_deadline_ms,
        probe_timeout_s=deadline_s + 5,
        burst_timeout_s=deadline_s + 30,  # long enough to see how late a late answer is
        spec_fields={"timeout_s": args.timeout_s},
    )


def _measure_peer(folder: str, threads: int, args: argparse.Namespace, bodies: list[dict]) -> dict:
    """With continuous batching; if it cannot serve so, what failed, and then without."""
    logs = Path(tempfile.mkdtemp(prefix="keybatch-peer-"))
    failures = []
    for continuous in [True, False] if args.peer_cb else [False]:
        server = PeerServer(folder, free_port(), threads, continuous, args.peer_memory, args.peer_arg)
        log_path = logs / ("serve-cb.log" if continuous else "serve.log")
        print(f"\n== peer ({server.mode}): {server.shown()}\n   log: {log_path}", flush=True)
        try:
            measured = _serve_and_measure(server, log_path, args, bodies)
        except PeerFailed as exc:
            error = f"{exc}; its log ends: {_log_tail(log_path, 1)}"
            failures.append(
                {"mode": server.mode, "command": server.shown(), "error": error, "log_tail": _log_tail(log_path)}
            )
            print(f"   the peer failed: {exc}\n{_log_tail(log_path, 12)}", file=sys.stderr, flush=True)
            continue
        return {"mode": server.mode, "command": server.shown(), **measured, "failures": failures}
    return {"mode": None, "sustainable_rps": None, "failures": failures}


def _serve_and_measure(server: PeerServer, log_path: Path, args: argparse.Namespace, bodies: list[dict]) -> dict:
    """Start, wait until it answers, warm it, measure; the process group is gone on return."""
    with peer_process(server, log_path) as proc:
        started = {"ready_s": round(wait_ready(server, proc, args.start_timeout_s), 1)}
        warm = {**bodies[0], "model": server.folder, "max_tokens": 4}
        started["first_answer_s"] = round(first_answer(server.url, warm, args.start_timeout_s), 1)
        generate(LoadSpec(server.url, 2.0, 3.0, server.folder, bodies=bodies, timeout_s=60), show_progress=False)
        result = _measure(_peer_target(server, args), args, bodies)
        if proc.poll() is not None:  # it died under the load: the figures after that are of a dead server
            result["exited"] = {"code": proc.returncode, "log_tail": _log_tail(log_path)}
    return {**started, **result}


def _measure_keybatch(folder: str, args: argparse.Namespace, bodies: list[dict]) -> dict:
    models = json.dumps({args.model: folder})  # the very folder the peer served, under the model's name
    print(f"\n== keybatch: {args.workers} replica(s), continuous policy, {folder}", flush=True)
    with hf_fleet(args.workers, "continuous", args.model, bench.PAID_KEY, bench.FREE_KEY, models=models) as url:
        return {"mode": "continuous policy", **_measure(_keybatch_target(url, args), args, bodies)}


# -- the command -----------------------------------------------------------------------


def run_peer(settings: Settings, args: argparse.Namespace) -> int:
    """Measure both servers (or those `--servers` names), print a table, write JSON."""
    folder = _model_folder(settings, args)
    if folder is None:
        return 2
    servers = [s for s in args.servers.split(",") if s]
    missing = [m for m in PEER_MODULES if importlib.util.find_spec(m) is None]
    if "peer" in servers and missing:
        print(f"keybatch bench peer: transformers serve needs {', '.join(missing)}: {PEER_INSTALL}", file=sys.stderr)
        return 2
    from control.load import workloads

    bodies = workloads.mixed(args.requests, seed=args.seed)
    threads = args.workers * settings.engine_threads
    results: dict[str, Any] = {
        "model": args.model,
        "folder": Path(folder).name,
        "torch_threads": threads,
        "workload": {"name": "mixed", "requests": args.requests, "seed": args.seed},
        "p99_target_ms": args.p99_ms,
        "client_timeout_s": args.timeout_s,
        "versions": {name: _version(name) for name in ("transformers", "torch", "fastapi", "uvicorn")},
        "keybatch_settings": settings.model_dump(
            include={"max_batch", "token_budget", "prefill_chunk", "prefix_cache_tokens", "engine_threads"}
        ),
    }
    with _sigterm_exits():
        if "peer" in servers:
            results["peer"] = _measure_peer(folder, threads, args, bodies)
        if "keybatch" in servers:
            results["keybatch"] = _measure_keybatch(folder, args, bodies)
    kb, peer = (results.get(s, {}).get("sustainable_rps") for s in ("keybatch", "peer"))
    results["ratio"] = kb / peer if kb and peer else None
    print_report(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _model_folder(settings: Settings, args: argparse.Namespace) -> str | None:
    if args.model_path:
        path = Path(args.model_path)
    elif args.model in settings.models:
        path = settings.model_path(args.model)
    else:
        print(f"keybatch bench peer: unknown model {args.model!r}; give --model-path", file=sys.stderr)
        return None
    if not (path / "config.json").exists():
        print(f"keybatch bench peer: no model folder at {path} (`keybatch model build`)", file=sys.stderr)
        return None
    return str(path.resolve())


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the peer's group and keybatch's deployment are stopped."""

    def exit_(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def print_report(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    names = [n for n in ("keybatch", "peer") if n in results]
    table = Table(
        title=f"keybatch against transformers serve: {results['folder']}, {results['torch_threads']} thread(s)"
    )
    table.add_column("")
    for name in names:
        table.add_column(name, justify="right")
    for label, cell in _ROWS:
        table.add_row(label, *(cell(results[n]) for n in names))
    console = Console(width=170)
    console.print(table)
    ratio = results.get("ratio")
    console.print(f"sustainable rate keybatch / peer: {ratio:.2f} (target >= 2)" if ratio else "ratio: not measured")
    for name in names:
        for failure in results[name].get("failures", []):
            console.print(f"[red]{name} failed ({failure['mode']}):[/red] {failure['error']}\n  {failure['command']}")


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _at_sustainable(r: dict, key: str) -> str:
    points = [p for p in r.get("ladder", {}).get("points", []) if p["rps"] == r.get("sustainable_rps")]
    return _fmt(round(points[0][key]) if points else None, " ms")


def _burst_cell(key: str) -> Callable[[dict], str]:
    def cell(r: dict) -> str:
        burst = r.get("burst")
        if burst is None:
            return "-"
        if key == "by_status":
            return " ".join(f"{'none' if s == '0' else s}:{n}" for s, n in burst["by_status"].items())
        if key == "no_answer_in_time":
            return f"{burst['no_answer_in_time']} of {burst['sent']} (limit {burst['in_time_limit_ms']:.0f} ms)"
        if key == "ok_within":
            return f"{burst['ok_within_ms']['count']} (<= {burst['ok_within_ms']['ms']:.0f} ms)"
        if key == "recovery_s":
            after = burst["probes"][-1][0] if burst["probes"] else 0
            return f"> {after:.0f} s" if burst["recovery_s"] is None else f"{burst['recovery_s']:.1f} s"
        return _fmt(burst[key])

    return cell


_ROWS: list[tuple[str, Callable[[dict], str]]] = [
    ("served as", lambda r: str(r.get("mode") or "failed to serve")),
    ("idle probe p50", lambda r: _fmt(r.get("idle_probe", {}).get("p50_ms"), " ms")),
    ("sustainable rate (req/s)", lambda r: _fmt(r.get("sustainable_rps"))),
    ("  p50 there", lambda r: _at_sustainable(r, "p50_ms")),
    ("  p99 there", lambda r: _at_sustainable(r, "p99_ms")),
    ("burst: offered (req/s)", _burst_cell("offered_rps")),
    ("burst: answers by status", _burst_cell("by_status")),
    ("burst: no answer in time", _burst_cell("no_answer_in_time")),
    ("burst: 200s an IDE could use", _burst_cell("ok_within")),
    ("recovery after the burst", _burst_cell("recovery_s")),
]
