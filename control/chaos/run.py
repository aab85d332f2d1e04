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
import logging
import random
import secrets
import sys
import time
from dataclasses import asdict, replace

import uvloop

from control.bench.harness import MODEL, Deployment, DeploymentError, warm
from control.chaos.analysis import analyze, counters_delta, read_counters
from control.chaos.connections import raise_fd_limit
from control.chaos.faults import inject
from control.chaos.idle import IdleSpec, print_idle, run_idle
from control.chaos.injection import Run
from control.chaos.report import finish, save
from control.chaos.spec import CLIENT_SLACK_S, FREE_KEY, HANGUP_MS, HANGUP_SHARE, PAID_KEY, ChaosSpec, deployments_for
from control.core.memory import collector_paused
from control.core.settings import Settings
from control.load.generator import run_spec
from control.load.spec import LoadSpec, Record

log = logging.getLogger(__name__)

# --keep-logs lists a 200 as late this long past the clients' budget (their clock and
# the gateway's see the same deadline a few milliseconds apart).
LATE_SLACK_MS = 50.0
PEER_SEED = 1000  # the peer's clients draw their arrivals from the run's seed plus this


def run_chaos(settings: Settings, args: argparse.Namespace) -> int:
    spec = ChaosSpec.from_args(args)
    problem = spec.problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    raise_fd_limit()
    deployments = deployments_for(spec)
    if spec.idle is not None:
        idle = spec.idle
        if idle.tail_s is None:  # long enough for a replica's stall watchdog to act, if it would
            idle = replace(idle, tail_s=(settings.batch_ms + settings.stall_ms) / 1000 + 3 * settings.heartbeat_s + 1)
        return _run_idle(deployments[0], spec, idle, args.json, args.keep_logs)
    capacity = spec.replicas * settings.max_batch * 1000.0 / settings.batch_ms
    try:
        _start(deployments, spec.replicas)
        before = [read_counters(d.url) for d in deployments]
        records, peer_records, run = _drive(spec, deployments, capacity, settings)
        after = [read_counters(d.url) for d in deployments]
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
        **analyze(spec, records, run, counters_delta(before, after), peer_records),
        "deployments": stops,
        "pids": sorted(pid for d in deployments for pid in d.seen),
        "logs": [d.log_path for d in deployments],
    }
    if args.keep_logs:  # what a reader of the logs looks for: each error, by request id
        late_ms = (spec.deadline_ms or settings.deadline_ms) + LATE_SLACK_MS
        for r in [*records, *(peer_records or [])]:
            if (r.status not in (200, 429) or r.latency_ms > late_ms) and not r.hung_up:
                sent = f"sent {r.sent_s:.3f} s, {r.latency_ms:.0f} ms (gateway {r.server_ms:.0f})"
                print(f"{r.status} {r.code} {r.tier} {sent}: {r.id} {r.error}", file=sys.stderr)
    return finish(report, args.json, args.keep_logs)


def _run_idle(deployment: Deployment, spec: ChaosSpec, idle: IdleSpec, json_path: str | None, keep_logs: bool) -> int:
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
    return save(report, json_path, keep_logs)


def _start(deployments: list[Deployment], replicas: int) -> None:
    for d in deployments:
        started = time.monotonic()
        d.start()
        warm(d.url, replicas, FREE_KEY)
        log.info("deployment %s ready and warm in %.1f s: %s", d.name, time.monotonic() - started, d.url)


def _drive(
    spec: ChaosSpec, deployments: list[Deployment], capacity: float, settings: Settings
) -> tuple[list[Record], list[Record] | None, Run]:
    """The records of the clients of the deployment under fault, those of the peer
    region's own clients (None without a peer load), and the run's injections."""
    deadline_ms = spec.deadline_ms or settings.deadline_ms
    run_id = secrets.token_hex(4)
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
        id_prefix=f"chaos-{run_id}",
        timeout_s=deadline_ms / 1000 + CLIENT_SLACK_S,
        start_at=time.perf_counter() + 0.1,
        hangup_share=HANGUP_SHARE if spec.scenario == "client-hangup" else 0.0,
        hangup_from_s=spec.fault_at_s,
        hangup_ms=HANGUP_MS,
        retries=spec.client_retries,
    )
    peer_load = None
    if spec.peer_load and len(deployments) > 1:  # the peer's own clients, with their own arrivals
        peer_load = replace(
            load,
            url=deployments[1].url,
            rps=spec.peer_load * capacity,
            seed=spec.seed + PEER_SEED,
            id_prefix=f"chaos-peer-{run_id}",
            hangup_share=0.0,
        )
    if spec.scenario == "overload-spike":
        load.spike_rps = spec.spike * capacity
        load.spike_from_s, load.spike_to_s = spec.fault_at_s, spec.fault_at_s + spec.spike_s
    assert load.start_at is not None
    run = Run(spec, deployments, load.start_at, settings.batch_ms, random.Random(spec.seed))

    async def both() -> tuple[list[Record], list[Record] | None]:
        peer = run_spec(peer_load, show_progress=False) if peer_load else asyncio.sleep(0, None)
        records, peer_records, _ = await asyncio.gather(
            run_spec(load, show_progress=sys.stdout.isatty()), peer, inject(run)
        )
        return records, peer_records

    with collector_paused():
        records, peer_records = uvloop.run(both())
    return records, peer_records, run
