"""The faults: each signals, pauses or floods part of the deployment under load, and says what it did."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import psutil
import redis

from control.bench.harness import MODEL, Deployment, describe, send_signal
from control.broker import keys
from control.chaos.connections import IDLE_ADDRESSES, IDLE_CONNECTIONS, SLOWLORIS_CONNECTIONS, dribble, hold_idle
from control.chaos.injection import Injection, Run
from control.chaos.spec import HANGUP_MS, HANGUP_SHARE, PAUSE_S

log = logging.getLogger(__name__)

REPEAT_GAP_S = 4.0  # --repeat: from the end of one injection to the next


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


async def _host_loss(run: Run) -> Injection:
    """Every replica of one simulated host stopped at once (no process exits, nobody is
    signalled: a machine or its network gone), for PAUSE_S, then killed (the supervisor
    starts them again); and how long until what they held was re-queued."""
    replicas = await asyncio.to_thread(run.target.replicas)
    hosts: dict[str, list[tuple[str, psutil.Process]]] = {}
    for name, proc in replicas:
        hosts.setdefault(name.rpartition("@")[2], []).append((name, proc))
    if not hosts:
        return Injection(run.now_s(), "SIGSTOP a host's replicas", note="no replica found")
    host = run.rng.choice(sorted(hosts))
    victims = hosts[host]
    swept = [asyncio.ensure_future(asyncio.to_thread(_wait_swept, run, name, PAUSE_S)) for name, _proc in victims]
    for _name, proc in victims:
        send_signal(proc, signal.SIGSTOP)
    injection = Injection(
        run.now_s(), f"SIGSTOP host {host} ({len(victims)} replicas) for {PAUSE_S:.0f} s, then SIGKILL them",
        [describe(proc, name) for name, proc in victims],
    )  # fmt: skip
    try:
        await asyncio.sleep(PAUSE_S)
    finally:
        for _name, proc in victims:
            send_signal(proc, signal.SIGKILL)
        injection.ended_s = run.now_s()
    times = [ms for ms in await asyncio.gather(*swept) if ms is not None]
    injection.requeue_ms = max(times) if len(times) == len(victims) else None
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


async def _cell_loss(run: Run) -> Injection:
    """One cell's broker SIGKILLed (the supervisor restarts it, empty) or, with `pause`,
    SIGSTOPped for PAUSE_S: the gateway sends what waits there to the other cells."""
    brokers = await asyncio.to_thread(run.target.cell_brokers)
    cells = [(f"cell {i}", proc) for i, proc in enumerate(brokers) if proc is not None]
    found = _pick(run, cells)
    what = f"the broker of {found[0]}" if found is not None else "a cell's broker"
    if run.spec.pause:
        injection = await _pause(run, what, found)
    else:
        injection = await _signal_one(run, what, found, signal.SIGKILL)
    injection.cell = int(found[0].split()[1]) if found is not None else None
    return injection


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
    run.slowloris = await dribble(run, SLOWLORIS_CONNECTIONS, run.spec.duration_s)
    return injection


async def _idle_connections(run: Run) -> Injection:
    what = f"{IDLE_CONNECTIONS} connections from {IDLE_ADDRESSES} addresses send nothing, reopened when closed"
    injection = Injection(run.now_s(), what)
    run.idle = await hold_idle(run, IDLE_CONNECTIONS, run.spec.duration_s)
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
    "cell-loss": _cell_loss,
    "host-loss": _host_loss,
    "gateway-kill": _gateway_kill,
    "client-hangup": _client_hangup,
    "region-loss": _region_loss,
    "slowloris": _slowloris,
    "idle-connections": _idle_connections,
    "overload-spike": _overload_spike,
}
REPEATABLE = {"replica-kill", "replica-hang", "host-loss", "broker-stall", "broker-loss", "cell-loss", "gateway-kill"}


async def inject(run: Run) -> None:
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
