"""`keybatch chaos SCENARIO`: one fault, injected into a live deployment under load.

It starts its own `keybatch up` as a subprocess (so the real supervisor is under
test), warms it, drives open-loop Poisson load at a share of its capacity,
injects the fault, stops the load and the deployment, and reports what the
clients saw: every request answered exactly once, how long until the service
was back, and how the requests caught in the fault fared against the rest.
docs/reliability.md says what each scenario does and what each figure means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import resource
import secrets
import signal
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace

import psutil
import redis
import uvloop

from control.bench.harness import MODEL, Deployment, DeploymentError, child_env, describe, send_signal, warm
from control.bench.report import counts, figure_table, ms, outcome, print_table, settle_logs, timeline, without_logs
from control.broker import keys
from control.chaos.idle import IdleSpec, print_idle, run_idle
from control.core.memory import collector_paused
from control.core.settings import Settings
from control.core.vocab import PAID, Backend, Policy
from control.load.generator import run_spec
from control.load.spec import LoadSpec, Record
from control.load.summary import percentile

log = logging.getLogger(__name__)

PAID_KEY, FREE_KEY = "chaos-paid", "chaos-free"
PAUSE_S = 5.0  # replica-hang, broker-stall: how long the process stays stopped
REPEAT_GAP_S = 4.0  # --repeat: from the end of one injection to the next
CLIENT_SLACK_S = 5.0  # a client waits its deadline plus this, then counts the request lost
HANGUP_SHARE, HANGUP_MS = 0.2, 100.0
SLOWLORIS_CONNECTIONS = 300
SLOWLORIS_BYTE_EVERY_S = 1.0
IDLE_CONNECTIONS = 2100
IDLE_ADDRESSES = 10  # 127.0.0.2 onwards (Linux routes 127/8 to lo): no one address's cap holds them back
IDLE_REOPEN_S = 0.1  # an idle connection the server closed is opened again after this
PROBE_EVERY_S, PROBE_BUDGET_MS = 0.25, 1000.0  # idle-connections: a paid request on a new connection
WINDOW_S = 1.0  # recovery is judged on windows of this length after the fault
P99_SLACK = 1.10  # ...whose p99 is within 10% of the pre-fault p99
FAST_503_MS = 100.0


class ChaosError(DeploymentError):
    """The run could not be set up (the deployment did not start or warm)."""


@dataclass(frozen=True)
class ChaosSpec:
    scenario: str
    replicas: int = 4
    load: float = 0.7
    paid_share: float = 0.3
    duration_s: float = 30.0
    fault_at_s: float = 8.0
    repeat: int = 1
    deadline_ms: float | None = None
    seed: int = 1
    client_retries: int = 2
    spike: float = 3.0
    spike_s: float = 30.0
    backend: Backend = "fixed"
    policy: Policy = "static"
    idle: IdleSpec | None = None  # client-hangup --idle: faults one at a time, no load

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChaosSpec:
        idle = None
        if args.idle:
            idle = IdleSpec(args.hangups, args.cancels, args.every, HANGUP_MS, args.tail, model=MODEL, key=PAID_KEY)
        return cls(
            args.scenario,
            args.replicas,
            args.load,
            args.paid_share,
            args.duration,
            args.fault_at,
            args.repeat,
            args.deadline_ms,
            args.seed,
            args.client_retries,
            args.spike,
            args.spike_s,
            args.backend,
            args.policy,
            idle,
        )

    def problem(self) -> str | None:
        if self.idle is not None:
            if self.scenario != "client-hangup":
                return "--idle is a variant of client-hangup only"
            return self.idle.problem()
        if self.replicas < 1 or self.repeat < 1:
            return "--replicas and --repeat must be at least 1"
        if not 0 < self.load <= 10 or not 0 <= self.paid_share <= 1:
            return "--load must be in (0, 10] and --paid-share in [0, 1]"
        if not 0 < self.fault_at_s < self.duration_s:
            return "--fault-at must fall inside the load: 0 < fault-at < duration"
        if self.deadline_ms is not None and self.deadline_ms <= 0:
            return "--deadline-ms must be positive"
        return None


def _plan(spec: ChaosSpec) -> list[Deployment]:
    """The deployments, the one under load first."""
    if spec.scenario != "region-loss":
        env = child_env(PAID_KEY, FREE_KEY)
        return [Deployment("main", spec.replicas, env, backend=spec.backend, policy=spec.policy)]
    b = Deployment("b", spec.replicas, child_env(PAID_KEY, FREE_KEY, region="b"))
    a = Deployment("a", spec.replicas, child_env(PAID_KEY, FREE_KEY, region="a", peers=json.dumps([b.url])))
    return [a, b]


# The gateway's counters the report shows as deltas over the load (summed over labels).
COUNTERS = {
    "keybatch_wasted_results_total": "wasted_results",
    "keybatch_cancels_total": "cancels",
    "keybatch_dropped_before_batch_total": "dropped_before_batch",
}


def _counters(url: str) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None  # the gateway is gone: the figures are unknown, not zero
    values = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in text.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in COUNTERS:
            values[COUNTERS[name]] += float(line.rpartition(" ")[2])
    return values


def _delta(before: list[dict[str, float] | None], after: list[dict[str, float] | None]) -> dict[str, float] | None:
    """What the deployments' counters moved by; None when a gateway could not be read.
    A counter that went down was reset (the wasted-results count lives in the broker,
    which a broker restart empties): what it counted since is the delta, a lower bound."""
    if any(v is None for v in [*before, *after]):
        return None
    pairs = [(a, b) for a, b in zip(after, before, strict=True) if a is not None and b is not None]
    return {key: sum(a[key] - b[key] if a[key] >= b[key] else a[key] for a, b in pairs) for key in COUNTERS.values()}


# -- the faults ----------------------------------------------------------------------


@dataclass
class Injection:
    at_s: float  # seconds since the load started, when the signal went out
    action: str
    targets: list[str] = field(default_factory=list)
    ended_s: float | None = None  # a pause: when it was lifted
    note: str = ""
    requeue_ms: float | None = None  # replica faults: until what it held was back in the queue
    recover_s: float | None = None  # filled in by the analysis


@dataclass
class Run:
    """What a fault needs: the deployments, a seeded choice, and the load's clock."""

    spec: ChaosSpec
    deployments: list[Deployment]
    origin: float  # time.perf_counter() of the load's second 0
    batch_ms: float
    rng: random.Random
    injections: list[Injection] = field(default_factory=list)
    slowloris: dict[str, object] | None = None
    idle: dict[str, object] | None = None

    @property
    def target(self) -> Deployment:
        return self.deployments[0]

    def now_s(self) -> float:
        return time.perf_counter() - self.origin

    async def sleep_until(self, at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - self.now_s()))


def _pick(run: Run, candidates: list[tuple[str, psutil.Process]]) -> tuple[str, psutil.Process] | None:
    return run.rng.choice(candidates) if candidates else None


async def _signal_one(run: Run, what: str, found: tuple[str, psutil.Process] | None, sig: int) -> Injection:
    if found is None:
        return Injection(run.now_s(), f"{signal.Signals(sig).name} {what}", note=f"no {what} found")
    label, proc = found
    send_signal(proc, sig)
    return Injection(run.now_s(), f"{signal.Signals(sig).name} {what}", [describe(proc, label)])


async def _pause(run: Run, what: str, found: tuple[str, psutil.Process] | None) -> Injection:
    """SIGSTOP, PAUSE_S, SIGCONT (sent even if the run is cut short)."""
    injection = await _signal_one(run, what, found, signal.SIGSTOP)
    injection.action = f"SIGSTOP {what} for {PAUSE_S:.0f} s"
    if found is not None:
        try:
            await asyncio.sleep(PAUSE_S)
        finally:
            send_signal(found[1], signal.SIGCONT)
            injection.ended_s = run.now_s()
    return injection


async def _replica_kill(run: Run) -> Injection:
    found = _pick(run, await asyncio.to_thread(run.target.replicas))
    mid_batch = found is not None and await asyncio.to_thread(_wait_mid_batch, run, found[0])
    injection = await _signal_one(run, "replica", found, signal.SIGKILL)
    if found is not None:
        injection.note = "mid-batch" if mid_batch else "no batch start seen in 1.5 s: killed anyway"
        injection.requeue_ms = await asyncio.to_thread(_wait_swept, run, found[0])
    return injection


async def _replica_hang_timed(run: Run) -> Injection:
    """replica-hang, and how long until what the stopped replica held was re-queued."""
    found = _pick(run, await asyncio.to_thread(run.target.replicas))
    if found is None:
        return await _pause(run, "replica", found)
    swept = asyncio.ensure_future(asyncio.to_thread(_wait_swept, run, found[0], PAUSE_S))
    injection = await _pause(run, "replica", found)
    injection.requeue_ms = await swept
    return injection


def _wait_swept(run: Run, name: str, timeout_s: float = 3.0) -> float | None:
    """Milliseconds from now until the replica's held requests were re-queued (its held
    hash is gone), or None if that did not happen within `timeout_s`."""
    return _poll_broker(run, lambda client: not client.exists(keys.held_key(name)), timeout_s, 0.002)


def _wait_mid_batch(run: Run, name: str, timeout_s: float = 1.5) -> bool:
    """Wait for the replica to start a batch (its score in the model's launch set),
    so the kill lands in the first half of the batch's run."""

    def started_lately(client: redis.Redis) -> bool:
        # Replicas stamp launches with the broker's clock: compare with it.
        pipe = client.pipeline()
        pipe.zscore(keys.launch_key(MODEL), name)
        pipe.time()
        started_ms, (seconds, micros) = pipe.execute()
        return started_ms is not None and 0 <= seconds * 1000 + micros / 1000 - started_ms < run.batch_ms / 2

    return _poll_broker(run, started_lately, timeout_s, 0.005) is not None


def _poll_broker(run: Run, check: Callable[[redis.Redis], bool], timeout_s: float, every_s: float) -> float | None:
    """Milliseconds until `check` held on the deployment's broker; None if it did not
    within `timeout_s` (or the broker could not be asked)."""
    url = run.target.redis_url()
    if url is None:
        return None
    client = redis.Redis.from_url(url, socket_timeout=1)
    start = time.monotonic()
    try:
        while time.monotonic() - start < timeout_s:
            if check(client):
                return round((time.monotonic() - start) * 1000, 1)
            time.sleep(every_s)
    except redis.RedisError:
        return None
    finally:
        client.close()
    return None


async def _broker_stall(run: Run) -> Injection:
    return await _pause(run, "broker", await asyncio.to_thread(_broker_of, run.target))


async def _broker_loss(run: Run) -> Injection:
    return await _signal_one(run, "broker", await asyncio.to_thread(_broker_of, run.target), signal.SIGKILL)


async def _gateway_kill(run: Run) -> Injection:
    workers = await asyncio.to_thread(run.target.gateway_workers)
    found = _pick(run, [("", proc) for proc in workers])
    return await _signal_one(run, "gateway worker", found, signal.SIGKILL)


async def _client_hangup(run: Run) -> Injection:
    # The load itself does it (LoadSpec.hangup_*); this only marks when it begins.
    return Injection(run.now_s(), f"{HANGUP_SHARE:.0%} of clients hang up {HANGUP_MS:.0f} ms after sending")


async def _region_loss(run: Run) -> Injection:
    """Region A loses its broker and every replica; its gateway stays and has peer B."""

    def victims() -> list[tuple[str, psutil.Process]]:
        broker = _broker_of(run.target)
        return ([("broker", broker[1])] if broker else []) + run.target.replicas()

    found = await asyncio.to_thread(victims)
    for _label, proc in found:
        send_signal(proc, signal.SIGKILL)
    targets = [describe(proc, label) for label, proc in found]
    return Injection(run.now_s(), "SIGKILL region A's broker and replicas", targets)


async def _slowloris(run: Run) -> Injection:
    injection = Injection(run.now_s(), f"{SLOWLORIS_CONNECTIONS} connections dribble header bytes")
    run.slowloris = await _dribble(run, SLOWLORIS_CONNECTIONS, run.spec.duration_s)
    return injection


async def _idle_connections(run: Run) -> Injection:
    what = f"{IDLE_CONNECTIONS} connections from {IDLE_ADDRESSES} addresses send nothing, reopened when closed"
    injection = Injection(run.now_s(), what)
    run.idle = await _hold_idle(run, IDLE_CONNECTIONS, run.spec.duration_s)
    injection.ended_s = run.now_s()
    return injection


async def _overload_spike(run: Run) -> Injection:
    # The load itself does it (LoadSpec.spike_*); this marks its start and end.
    injection = Injection(run.now_s(), f"arrivals at {run.spec.spike:.1f}x capacity for {run.spec.spike_s:.0f} s")
    await run.sleep_until(run.spec.fault_at_s + run.spec.spike_s)
    injection.ended_s = run.now_s()
    return injection


def _broker_of(deployment: Deployment) -> tuple[str, psutil.Process] | None:
    proc = deployment.broker()
    return ("", proc) if proc is not None else None


FAULTS: dict[str, Callable[[Run], Awaitable[Injection]]] = {
    "replica-kill": _replica_kill,
    "replica-hang": _replica_hang_timed,
    "broker-stall": _broker_stall,
    "broker-loss": _broker_loss,
    "gateway-kill": _gateway_kill,
    "client-hangup": _client_hangup,
    "region-loss": _region_loss,
    "slowloris": _slowloris,
    "idle-connections": _idle_connections,
    "overload-spike": _overload_spike,
}
REPEATABLE = {"replica-kill", "replica-hang", "broker-stall", "broker-loss", "gateway-kill"}


async def _inject(run: Run) -> None:
    await run.sleep_until(run.spec.fault_at_s)
    times = run.spec.repeat if run.spec.scenario in REPEATABLE else 1
    for k in range(times):
        try:
            injection = await FAULTS[run.spec.scenario](run)
        except Exception as exc:  # the report says so; the load and the stop go on
            log.exception("injecting %s failed", run.spec.scenario)
            injection = Injection(run.now_s(), run.spec.scenario, note=f"injection failed: {exc!r}")
        run.target.remember()
        run.injections.append(injection)
        next_s = (injection.ended_s or injection.at_s) + REPEAT_GAP_S
        if k + 1 < times:
            if next_s >= run.spec.duration_s:
                ended = f"the load ended before injection {k + 2} of {times}"
                injection.note = "; ".join(filter(None, [injection.note, ended]))
                return
            await run.sleep_until(next_s)


# -- slowloris -------------------------------------------------------------------------


@dataclass
class _Dribbler:
    opened_s: float
    closed_s: float | None = None
    answer: str = ""  # the status line the server sent before closing, if any


async def _dribble(run: Run, count: int, until_s: float) -> dict[str, object]:
    """`count` connections that send a request line, then one header byte a second."""
    host, port = "127.0.0.1", run.target.port
    results = await asyncio.gather(*(_dribble_one(run, host, port, until_s) for _ in range(count)))
    opened = [d for d in results if d is not None]
    closed = [d for d in opened if d.closed_s is not None]
    held_s = [d.closed_s - d.opened_s for d in closed if d.closed_s is not None]
    return {
        "connections": count,
        "refused": count - len(opened),
        "closed_by_server": len(closed),
        "still_open_at_end": len(opened) - len(closed),
        "first_closed_s": min((d.closed_s for d in closed if d.closed_s is not None), default=None),
        "held_p50_s": percentile(held_s, 50) if held_s else None,
        "held_max_s": max(held_s, default=None),
        "answers": dict(Counter(d.answer or "closed without an answer" for d in closed)),
    }


async def _dribble_one(run: Run, host: str, port: int, until_s: float) -> _Dribbler | None:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return None
    conn = _Dribbler(run.now_s())
    headers = b"".join(f"X-Dribble-{i}: {i}\r\n".encode() for i in range(1000))  # never the blank line
    reading = asyncio.ensure_future(reader.read(256))  # a byte or EOF: the server gave up on us
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: chaos\r\n")
        for sent in range(len(headers)):
            done, _ = await asyncio.wait({reading}, timeout=SLOWLORIS_BYTE_EVERY_S)
            if done:
                conn.closed_s = run.now_s()
                data = b"" if reading.exception() else reading.result()
                conn.answer = data.split(b"\r\n", 1)[0].decode("latin-1")
                return conn
            if run.now_s() >= until_s:
                return conn
            writer.write(headers[sent : sent + 1])
            await writer.drain()
    except (ConnectionError, OSError):
        conn.closed_s = run.now_s()
    finally:
        if reading.done() and not reading.cancelled():
            reading.exception()  # looked at, so asyncio does not report it as never retrieved
        reading.cancel()
        writer.close()
    return conn


# -- idle connections ------------------------------------------------------------------


async def _hold_idle(run: Run, count: int, until_s: float) -> dict[str, object]:
    """`count` connections that send nothing, each opened again when the server closes it."""
    seen: Counter[str] = Counter()
    held_s: list[float] = []
    open_now = [0]
    samples: list[int] = []

    async def one(k: int) -> None:
        source = f"127.0.0.{2 + k % IDLE_ADDRESSES}"
        while run.now_s() < until_s:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", run.target.port, local_addr=(source, 0))
            except OSError as exc:
                seen[f"connect failed: {type(exc).__name__}"] += 1
                await asyncio.sleep(IDLE_REOPEN_S)
                continue
            opened_s = run.now_s()
            open_now[0] += 1
            try:
                data = await asyncio.wait_for(reader.read(256), max(0.0, until_s - opened_s))
                seen[data.split(b"\r\n", 1)[0].decode("latin-1") or "closed without an answer"] += 1
                held_s.append(run.now_s() - opened_s)
            except TimeoutError:
                seen["open at the end"] += 1
            except OSError:
                seen["reset"] += 1
            finally:
                open_now[0] -= 1
                writer.close()
            await asyncio.sleep(IDLE_REOPEN_S)

    async def sample() -> None:
        while run.now_s() < until_s:
            samples.append(open_now[0])
            await asyncio.sleep(0.5)

    probes: list[tuple[str, float]] = []

    async def probe() -> None:
        await asyncio.sleep(1.0)  # the idle connections open first
        while run.now_s() < until_s - 1.0:
            probes.append(await _paid_probe(run.target.port))
            await asyncio.sleep(PROBE_EVERY_S)

    await asyncio.gather(sample(), probe(), *(one(k) for k in range(count)))
    settled = samples[len(samples) // 4 :] or [0]  # after the first opens
    waits_ms = [t for _status, t in probes]
    return {
        "connections": count,
        "addresses": IDLE_ADDRESSES,
        "outcomes": dict(seen.most_common()),
        "held_p50_s": percentile(held_s, 50) if held_s else None,
        "open_at_once_min": min(settled),
        "open_at_once_median": sorted(settled)[len(settled) // 2],
        "paid_new_connection": {
            "sent": len(probes),
            "budget_ms": PROBE_BUDGET_MS,
            "statuses": dict(Counter(status for status, _t in probes)),
            "p50_ms": percentile(waits_ms, 50) if waits_ms else None,
            "p99_ms": percentile(waits_ms, 99) if waits_ms else None,
            "max_ms": max(waits_ms, default=None),
            "over_budget": sum(status != "200" or t > PROBE_BUDGET_MS for status, t in probes),
        },
    }


async def _paid_probe(port: int) -> tuple[str, float]:
    """One paid request on a new connection: its status and time to its answer (ms)."""
    body = json.dumps({"model": MODEL, "prompt": "def probe():\n    ", "max_tokens": 4}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {PAID_KEY}\r\nX-Deadline-Ms: {PROBE_BUDGET_MS:.0f}\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    started = time.perf_counter()
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head.encode() + body)
        line = await asyncio.wait_for(reader.readline(), PROBE_BUDGET_MS / 1000 + CLIENT_SLACK_S)
        status = line.split(b" ", 2)[1].decode("latin-1") if line.count(b" ") >= 2 else "closed"
    except (TimeoutError, OSError) as exc:
        status = type(exc).__name__
    finally:
        if writer is not None:
            writer.close()
    return status, (time.perf_counter() - started) * 1000


def _raise_fd_limit() -> None:
    """Room for the idle connections' sockets in this process and in the deployment it starts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * IDLE_CONNECTIONS + 4096
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


# -- the run ---------------------------------------------------------------------------


def run_chaos(settings: Settings, args: argparse.Namespace) -> int:
    spec = ChaosSpec.from_args(args)
    problem = spec.problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    _raise_fd_limit()
    deployments = _plan(spec)
    if spec.idle is not None:
        idle = spec.idle
        if idle.tail_s is None:  # long enough for a replica's stall watchdog to act, if it would
            idle = replace(idle, tail_s=(settings.batch_ms + settings.stall_ms) / 1000 + 3 * settings.heartbeat_s + 1)
        return _run_idle(deployments[0], spec, idle, args.json)
    capacity = spec.replicas * settings.max_batch * 1000.0 / settings.batch_ms
    try:
        _start(deployments, spec.replicas)
        before = [_counters(d.url) for d in deployments]
        records, run = _drive(spec, deployments, capacity, settings)
        after = [_counters(d.url) for d in deployments]
    except DeploymentError as exc:
        print(f"keybatch chaos: {exc}", file=sys.stderr)
        return 2
    finally:
        stops = [d.stop() for d in deployments]
        log.info("deployments stopped: %s", stops)
    report = {
        "scenario": spec.scenario,
        "spec": asdict(spec),
        "capacity_rps": capacity,
        "rps": spec.load * capacity,
        **analyze(spec, records, run, _delta(before, after)),
        "deployments": stops,
        "pids": sorted(pid for d in deployments for pid in d.seen),
        "logs": [d.log_path for d in deployments],
    }
    return _finish(report, args.json)


def _run_idle(deployment: Deployment, spec: ChaosSpec, idle: IdleSpec, json_path: str | None) -> int:
    try:
        _start([deployment], spec.replicas)
        report = run_idle(deployment, idle)
    except DeploymentError as exc:
        print(f"keybatch chaos: {exc}", file=sys.stderr)
        return 2
    finally:
        stop = deployment.stop()
    report.update(backend=spec.backend, policy=spec.policy, replicas=spec.replicas, deployments=[stop])
    report["logs"] = [deployment.log_path]
    print_idle(report)
    return _save(report, json_path)


def _start(deployments: list[Deployment], replicas: int) -> None:
    for d in deployments:
        started = time.monotonic()
        d.start()
        warm(d.url, replicas, FREE_KEY)
        log.info("deployment %s ready and warm in %.1f s: %s", d.name, time.monotonic() - started, d.url)


def _finish(report: dict, json_path: str | None) -> int:
    _print(report)
    return _save(report, json_path)


def _save(report: dict, json_path: str | None) -> int:
    """Save (without the logs' paths, which are this machine's), and keep the
    deployments' logs only when the run failed."""
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(without_logs(report), fh, indent=2)
    return 0 if settle_logs(report) else 1


def _drive(
    spec: ChaosSpec, deployments: list[Deployment], capacity: float, settings: Settings
) -> tuple[list[Record], Run]:
    deadline_ms = spec.deadline_ms or settings.deadline_ms
    load = LoadSpec(
        deployments[0].url,
        spec.load * capacity,
        spec.duration_s,
        MODEL,
        spec.paid_share,
        PAID_KEY,
        FREE_KEY,
        seed=spec.seed,
        deadline_ms=spec.deadline_ms,
        id_prefix=f"chaos-{secrets.token_hex(4)}",
        timeout_s=deadline_ms / 1000 + CLIENT_SLACK_S,
        start_at=time.perf_counter() + 0.1,
        hangup_share=HANGUP_SHARE if spec.scenario == "client-hangup" else 0.0,
        hangup_from_s=spec.fault_at_s,
        hangup_ms=HANGUP_MS,
        retries=spec.client_retries,
    )
    if spec.scenario == "overload-spike":
        load.spike_rps = spec.spike * capacity
        load.spike_from_s, load.spike_to_s = spec.fault_at_s, spec.fault_at_s + spec.spike_s
    assert load.start_at is not None
    run = Run(spec, deployments, load.start_at, settings.batch_ms, random.Random(spec.seed))

    async def both() -> list[Record]:
        records, _ = await asyncio.gather(run_spec(load, show_progress=sys.stdout.isatty()), _inject(run))
        return records

    with collector_paused():
        return uvloop.run(both()), run


# -- the report ------------------------------------------------------------------------


def _group(records: list[Record]) -> dict[str, object]:
    ok = [r.latency_ms for r in records if r.status == 200]
    paid = [r.latency_ms for r in records if r.status == 200 and r.tier == PAID]
    return {
        "sent": len(records),
        "statuses": dict(sorted(Counter(outcome(r) for r in records).items())),
        "p99_ms": percentile(ok, 99) if ok else None,
        "paid_p99_ms": percentile(paid, 99) if paid else None,
        "paid_statuses": dict(sorted(Counter(outcome(r) for r in records if r.tier == PAID).items())),
    }


def _healthy(window: list[Record], baseline_p99: float) -> bool:
    ok = [r.latency_ms for r in window if r.status == 200]
    return bool(ok) and all(r.status in (200, 429) for r in window) and percentile(ok, 99) <= P99_SLACK * baseline_p99


def recovery_s(records: list[Record], fault_s: float, until_s: float, baseline_p99: float | None) -> float | None:
    """Seconds from the fault to the start of the first whole window after it in which
    every request sent got 200 or 429 and the p99 is back near the pre-fault p99."""
    if baseline_p99 is None:
        return None
    start = fault_s
    while start + WINDOW_S <= until_s:
        window = [r for r in records if start <= r.sent_s < start + WINDOW_S and not r.hung_up]
        if _healthy(window, baseline_p99):
            return round(start - fault_s, 3)
        start += WINDOW_S
    return None


def _affected(records: list[Record], injections: list[Injection], ends: list[float]) -> set[int]:
    """In flight at a fault, or sent from it until recovery (or its window's end)."""
    hit = set()
    for injection, end in zip(injections, ends, strict=True):
        ended = injection.ended_s or injection.at_s
        until = ended + injection.recover_s if injection.recover_s is not None else end
        for i, r in enumerate(records):
            if (r.sent_s < injection.at_s < r.answered_s) or injection.at_s <= r.sent_s < until:
                hit.add(i)
    return hit


def analyze(spec: ChaosSpec, records: list[Record], run: Run, counters: dict[str, float] | None) -> dict[str, object]:
    injections = run.injections
    wasted = counters["wasted_results"] if counters is not None else None
    first = injections[0].at_s if injections else spec.duration_s
    before = [r.latency_ms for r in records if r.sent_s < first and r.status == 200]
    baseline = percentile(before, 99) if before else None
    ends = [nxt.at_s for nxt in injections[1:]] + [spec.duration_s]
    for injection, end in zip(injections, ends, strict=True):  # from the fault's end, if it lasts
        injection.recover_s = recovery_s(records, injection.ended_s or injection.at_s, end, baseline)
    hit = _affected(records, injections, ends)
    lost = [r for r in records if r.status == 0 and not r.hung_up]
    # An answer carrying another request's id: a reply routed to the wrong client, or a
    # second answer to an earlier request read off a reused connection.
    crossed = sum(1 for r in records if r.status == 200 and r.id and r.answer_id != r.id)
    # Wasted results (a copy run for a request answered already, or for a client that was
    # answered 503 or hung up) cost model time but reach no client: reported, not failed.
    failed = _verdict(len(lost), crossed)
    probes = run.idle["paid_new_connection"] if run.idle else None
    if isinstance(probes, dict) and probes["over_budget"]:
        failed.append(f"{probes['over_budget']} paid requests on new connections not answered 200 within budget")
    s503 = [r.latency_ms for r in records if r.status == 503]
    recovered = [i.recover_s for i in injections]
    return {
        "sent": len(records),
        "answered": dict(sorted(Counter(str(r.status) for r in records if r.status).items())),
        "lost": len(lost),
        "lost_by_error": dict(Counter(r.error for r in lost)),
        "hung_up": sum(r.hung_up for r in records),
        "duplicated": crossed,
        "duplicated_answers": crossed,
        "wasted_results": wasted,
        "server_counters": counters,
        "faults": [asdict(i) for i in injections],
        "recover_s": None if not recovered or None in recovered else max(r for r in recovered if r is not None),
        "requeue_ms_median": _median([i.requeue_ms for i in injections if i.requeue_ms is not None]),
        "pre_fault_p99_ms": baseline,
        "affected": _group([r for i, r in enumerate(records) if i in hit]),
        "rest": _group([r for i, r in enumerate(records) if i not in hit]),
        "status_503": {
            "count": len(s503),
            "p99_ms": percentile(s503, 99) if s503 else None,
            f"over_{FAST_503_MS:.0f}ms": sum(t > FAST_503_MS for t in s503),
        },
        "slowloris": run.slowloris,
        "idle_connections": run.idle,
        "timeline": timeline(records, spec.duration_s, _group),
        "failed": failed,
        "ok": not failed,
    }


def _median(values: list[float]) -> float | None:
    return percentile(values, 50) if values else None


def _verdict(lost: int, crossed: int) -> list[str]:
    """Why the run fails, if it does: lost == 0 and duplicated == 0 must both be shown."""
    reasons = []
    if lost:
        reasons.append(f"{lost} requests lost")
    if crossed:
        reasons.append(f"{crossed} answers carried another request's id")
    return reasons


def _print(report: dict) -> None:
    spec = report["spec"]
    table = figure_table(
        f"keybatch chaos {report['scenario']}: {spec['replicas']} replicas, "
        f"{report['rps']:.0f} req/s ({spec['load']:.0%} of {report['capacity_rps']:.0f}), "
        f"{spec['paid_share']:.0%} paid, {spec['duration_s']:.0f} s"
    )
    for fault in report["faults"]:
        recover = "not recovered" if fault["recover_s"] is None else f"recovered in {fault['recover_s']:.1f} s"
        what = "; ".join(
            filter(None, [": ".join(filter(None, [fault["action"], ", ".join(fault["targets"])])), fault["note"]])
        )
        requeue = "" if fault["requeue_ms"] is None else f"; re-queued after {fault['requeue_ms']:.0f} ms"
        table.add_row(f"fault at {fault['at_s']:.2f} s", f"{what}{requeue}; {recover}", "")
    table.add_row("sent", str(report["sent"]), "")
    table.add_row("answered by status", counts(report["answered"]), "")
    table.add_row("lost (no HTTP answer)", f"{report['lost']} {counts(report['lost_by_error'])}".strip(), "0")
    wasted = "unknown" if report["wasted_results"] is None else f"{report['wasted_results']:.0f}"
    table.add_row("duplicated", f"{report['duplicated_answers']} answers; wasted results {wasted}", "0")
    if report["hung_up"]:
        table.add_row("hung up on purpose", str(report["hung_up"]), "")
    counters = report["server_counters"]
    table.add_row("gateway counters, delta", "unknown" if counters is None else counts(counters), "")
    recover = "not recovered" if report["recover_s"] is None else f"{report['recover_s']:.1f} s"
    table.add_row("time to recover (from the fault's end)", recover, "")
    table.add_row("pre-fault p99", ms(report["pre_fault_p99_ms"]), "")
    for name in ("affected", "rest"):
        group = report[name]
        table.add_row(
            f"{name}: sent, statuses, p99", f"{group['sent']}; {counts(group['statuses'])}; {ms(group['p99_ms'])}", ""
        )
        table.add_row("  paid: statuses, p99", f"{counts(group['paid_statuses'])}; {ms(group['paid_p99_ms'])}", "")
    s503 = report["status_503"]
    table.add_row("503s: count, p99", f"{s503['count']}; {ms(s503['p99_ms'])}", f"<= {FAST_503_MS:.0f} ms")
    if report["slowloris"]:
        table.add_row("slowloris", counts(report["slowloris"]), "")
    if report.get("idle_connections"):
        idle = report["idle_connections"]
        shown = {k: v for k, v in idle.items() if k not in ("outcomes", "paid_new_connection")}
        table.add_row("idle connections", counts(shown), "")
        table.add_row("  closed by the server", counts(idle["outcomes"]), "")
        probes = idle["paid_new_connection"]
        table.add_row(
            "  paid, each on a new connection",
            f"{probes['sent']}; {counts(probes['statuses'])}; p50 {ms(probes['p50_ms'])}, "
            f"p99 {ms(probes['p99_ms'])}, max {ms(probes['max_ms'])}",
            f"200 within {probes['budget_ms']:.0f} ms",
        )
    for d in report["deployments"]:
        left = ", ".join(d["left_running"]) or "nothing"
        table.add_row(f"stop ({d['name']})", f"exit {d['exit_code']} in {d['stop_s']:.1f} s; left running: {left}", "")
    verdict = "PASS" if report["ok"] else "FAIL: " + "; ".join(report["failed"])
    table.add_row("verdict", verdict, "lost 0, duplicated 0")
    print_table(table)
