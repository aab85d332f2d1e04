"""`keybatch chaos client-hangup --idle`: hang-ups and cancels on an idle deployment.

Under load a replica's engine always has the next request to step, so a fault that
only shows once an engine is left empty stays hidden. Here each fault is the only
request in the system: a client that sends a completion and hangs up `hangup_ms`
later, or one that sends it and cancels it (`DELETE /v1/completions/{id}`) after as
long, alternately, one every `every_s`. Throughout, `/readyz` is sampled and the
replicas' processes are watched; after the last fault and a quiet `tail_s` (longer
than the replicas' stall watchdog needs), one request per replica is sent with the
default budget. The report says how many replicas exited (the supervisor's own log
lines), how much of the run the deployment was ready, and what the next requests got.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from control.bench.report import counts, figure_table, print_table

_DIED = re.compile(r"keybatch: replica (\S+) \(pid (\d+)\) died \(([^)]*)\)")
_STALLED = "restarting"  # the replica's own last words when its watchdog fires (tasks/replica/replica.py)


class Target(Protocol):
    """The deployment under test, as control/bench/harness.py's `Deployment` offers it."""

    url: str
    port: int
    log_path: str

    def replica_pids(self) -> list[int]: ...


@dataclass(frozen=True)
class IdleSpec:
    hangups: int = 100
    cancels: int = 100
    every_s: float = 0.5
    hangup_ms: float = 100.0  # a hang-up closes, and a cancel is sent, this long after the request
    tail_s: float | None = None  # quiet after the last fault, before the next requests (None: the caller's choice)
    ready_every_s: float = 0.1
    model: str = "kb-small"
    key: str = ""  # the clients' API key (a paid one: what a refusal would cost)

    def problem(self) -> str | None:
        if self.hangups < 0 or self.cancels < 0 or self.hangups + self.cancels == 0:
            return "--hangups and --cancels must not be negative, and not both 0"
        if self.every_s <= 0 or self.hangup_ms <= 0 or (self.tail_s is not None and self.tail_s < 0):
            return "--every and the hang-up delay must be positive, --tail not negative"
        return None

    def faults(self) -> list[str]:
        """Hang-ups and cancels alternately, the rest of the larger count at the end."""
        order = []
        for k in range(max(self.hangups, self.cancels)):
            order += (["hangup"] if k < self.hangups else []) + (["cancel"] if k < self.cancels else [])
        return order


@dataclass
class _Readiness:
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the start, status; 0: none)
    pids: set[int] = field(default_factory=set)  # every replica process seen


def run_idle(target: Target, spec: IdleSpec) -> dict[str, object]:
    """Drive the faults against `target` (started and warm) and report."""
    log_offset = _log_size(target.log_path)
    origin = time.monotonic()
    ready = _Readiness(pids=set(target.replica_pids()))
    first_pids = set(ready.pids)
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(target, spec, origin, ready, stop), daemon=True)
    sampler.start()
    outcomes: list[Future[str]] = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        for k, kind in enumerate(spec.faults()):
            _sleep_until(origin + k * spec.every_s)
            fault = _hang_up if kind == "hangup" else _cancel
            outcomes.append(pool.submit(fault, target, spec, f"idle-{secrets.token_hex(4)}-{k}"))
        results = [f.result() for f in outcomes]
    faults_end_s = time.monotonic() - origin
    time.sleep(spec.tail_s or 0.0)  # the quiet a stall watchdog needs to act, if it would
    next_answers = [_next_request(target, spec) for _ in range(max(1, len(first_pids)))]
    stop.set()
    sampler.join(5)
    exits, stalls = _exits(target.log_path, log_offset)
    return _report(spec, results, next_answers, ready, first_pids, exits, stalls, faults_end_s)


def _sleep_until(at: float) -> None:
    time.sleep(max(0.0, at - time.monotonic()))


def _sample(target: Target, spec: IdleSpec, origin: float, ready: _Readiness, stop: threading.Event) -> None:
    every = 0
    while not stop.wait(spec.ready_every_s):
        ready.samples.append((time.monotonic() - origin, _status(f"{target.url}/readyz")))
        every += 1
        if every % 10 == 0:  # a process scan costs more than a request: once a second
            ready.pids.update(target.replica_pids())


def _status(url: str, timeout_s: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except (urllib.error.URLError, OSError):
        return 0


def _body(spec: IdleSpec) -> bytes:
    return json.dumps({"model": spec.model, "prompt": "def on_keystroke(buffer):\n    ", "max_tokens": 256}).encode()


def _hang_up(target: Target, spec: IdleSpec, request_id: str) -> str:
    """Send a completion and close the connection `hangup_ms` later, as `curl -m` does."""
    body = _body(spec)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{target.port}\r\n"
        f"Authorization: Bearer {spec.key}\r\nX-Request-Id: {request_id}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection(("127.0.0.1", target.port), timeout=5) as conn:
            conn.sendall(head + body)
            conn.settimeout(spec.hangup_ms / 1000)
            try:
                early = conn.recv(64)
            except TimeoutError:
                return "hung up"
    except OSError as exc:
        return f"error: {type(exc).__name__}"
    status = early.split(b" ", 2)[1].decode() if early.count(b" ") >= 2 else "closed"
    return f"answered before the hang-up: {status}"


def _cancel(target: Target, spec: IdleSpec, request_id: str) -> str:
    """Send a completion and cancel it `hangup_ms` later; what the request itself got."""
    headers = {"Authorization": f"Bearer {spec.key}", "Content-Type": "application/json", "X-Request-Id": request_id}
    req = urllib.request.Request(f"{target.url}/v1/completions", _body(spec), headers)
    answer: Future[int] = Future()
    threading.Thread(target=lambda: answer.set_result(_send(req)), daemon=True).start()
    time.sleep(spec.hangup_ms / 1000)  # the client's own delay before it cancels, not a wait for a state
    delete = urllib.request.Request(f"{target.url}/v1/completions/{request_id}", method="DELETE", headers=headers)
    cancel = _send(delete)
    status = answer.result(60)
    return f"{status} (cancel {cancel})"


def _send(req: urllib.request.Request, timeout_s: float = 30.0) -> int:
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        err.read()
        return int(err.code)
    except (urllib.error.URLError, OSError):
        return 0


def _next_request(target: Target, spec: IdleSpec) -> dict[str, object]:
    """A request with the default budget, as a client sends it after the faults."""
    headers = {"Authorization": f"Bearer {spec.key}", "Content-Type": "application/json"}
    req = urllib.request.Request(f"{target.url}/v1/completions", _body(spec), headers)
    started = time.perf_counter()
    status = _send(req)
    return {"status": status, "ms": round((time.perf_counter() - started) * 1000, 1)}


def _log_size(path: str) -> int:
    try:
        with open(path, "rb") as fh:
            return fh.seek(0, 2)
    except OSError:
        return 0


def _exits(path: str, offset: int) -> tuple[list[dict[str, str]], int]:
    """Replica deaths the supervisor logged since `offset`, and stall give-ups among the lines."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return [], 0
    exits = [{"replica": m[1], "pid": m[2], "how": m[3]} for m in _DIED.finditer(text)]
    stalls = sum(1 for line in text.splitlines() if "batch running" in line and _STALLED in line)
    return exits, stalls


def _stretches(samples: list[tuple[float, int]], every_s: float) -> list[float]:
    """Lengths in seconds of the runs of consecutive not-ready samples."""
    runs, current = [], 0
    for _t, status in samples:
        if status == 200:
            if current:
                runs.append(current * every_s)
            current = 0
        else:
            current += 1
    if current:
        runs.append(current * every_s)
    return runs


def _report(
    spec: IdleSpec,
    results: list[str],
    next_answers: list[dict[str, object]],
    ready: _Readiness,
    first_pids: set[int],
    exits: list[dict[str, str]],
    stalls: int,
    faults_end_s: float,
) -> dict[str, object]:
    kinds = spec.faults()
    hangups = Counter(r for r, kind in zip(results, kinds, strict=True) if kind == "hangup")
    cancels = Counter(r for r, kind in zip(results, kinds, strict=True) if kind == "cancel")
    statuses = [status for _t, status in ready.samples]
    not_ready = _stretches(ready.samples, spec.ready_every_s)
    failed = []
    if exits:
        failed.append(f"{len(exits)} replica exits")
    if any(status != 200 for status in statuses):
        failed.append(f"{sum(status != 200 for status in statuses)} of {len(statuses)} readiness samples not ready")
    if any(answer["status"] != 200 for answer in next_answers):
        failed.append("a request after the faults was not answered 200")
    return {
        "scenario": "client-hangup --idle",
        "spec": {k: v for k, v in spec.__dict__.items() if k != "key"},
        "faults_s": round(faults_end_s, 1),
        "hangups": dict(sorted(hangups.items())),
        "cancels": dict(sorted(cancels.items())),
        "replica_exits": exits,
        "stall_restarts": stalls,
        "replica_pids_seen": len(ready.pids),
        "replica_pids_new": len(ready.pids - first_pids),
        "readiness": {
            "samples": len(statuses),
            "ready_share": round(statuses.count(200) / len(statuses), 4) if statuses else None,
            "by_status": dict(sorted(Counter(str(s) for s in statuses).items())),
            "not_ready_stretches": len(not_ready),
            "longest_not_ready_s": round(max(not_ready, default=0.0), 2),
        },
        "next_requests": next_answers,
        "failed": failed,
        "ok": not failed,
    }


def print_idle(report: dict) -> None:
    spec = report["spec"]
    table = figure_table(
        f"keybatch chaos client-hangup --idle: {report.get('replicas', '?')} replicas "
        f"({report.get('backend', '?')}, {report.get('policy', '?')}), {spec['hangups']} hang-ups and "
        f"{spec['cancels']} cancels, one every {spec['every_s']} s, {spec['hangup_ms']:.0f} ms after sending"
    )
    table.add_row("hang-ups", counts(report["hangups"]), "")
    table.add_row("cancels: the request's answer (the cancel's)", counts(report["cancels"]), "")
    exits = report["replica_exits"]
    how = ", ".join(f"{e['replica']} {e['how']}" for e in exits)
    table.add_row("replica exits", f"{len(exits)} {how}".strip(), "0")
    table.add_row("stall give-ups logged", str(report["stall_restarts"]), "0")
    table.add_row("new replica processes", str(report["replica_pids_new"]), "0")
    r = report["readiness"]
    table.add_row(
        "/readyz samples: ready share", f"{r['ready_share']} of {r['samples']} ({counts(r['by_status'])})", "1.0"
    )
    table.add_row("not ready: stretches, longest", f"{r['not_ready_stretches']}, {r['longest_not_ready_s']:.1f} s", "0")
    nexts = ", ".join(f"{a['status']} in {a['ms']:.0f} ms" for a in report["next_requests"])
    table.add_row(f"next requests ({spec['tail_s']:.0f} s after the last fault)", nexts, "200")
    verdict = "PASS" if report["ok"] else "FAIL: " + "; ".join(report["failed"])
    for d in report.get("deployments", []):
        table.add_row(f"stop ({d['name']})", f"exit {d['exit_code']} in {d['stop_s']:.1f} s", "")
    table.add_row("verdict", verdict, "")
    print_table(table)
