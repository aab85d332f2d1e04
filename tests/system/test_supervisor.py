"""`keybatch up` heals: a killed replica, broker or gateway comes back while the rest
serve; a killed supervisor leaves nothing behind; a plan without a replica for a model
is refused at once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import psutil
import pytest
import redis

from control.bench.harness import Deployment
from control.broker import keys
from control.core.settings import Settings
from control.fleet.up import HEALTHY_AFTER_S, RESTART_MAX_S, Backoff, Plan, System
from control.fleet.valkey import EmbeddedBroker
from tests.support.deploy import MODEL
from tests.support.up import Up, cmdline, keybatch_up
from tests.support.waiting import alive

T = TypeVar("T")


def poll(what: Callable[[], T | None], timeout_s: float, why: str) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {why}")


def test_a_killed_replica_is_restarted_under_its_name_while_the_other_serves() -> None:
    # No standby: one would take the place of a replica that lived 5 s (a slow start).
    with keybatch_up("--workers", "2", "--models", MODEL, standby_replicas="0") as up:
        assert up.posts(2) == [200, 200]  # one per replica: readiness is not warmth
        name = f"{MODEL}-1@{socket.gethostname()}"
        victim = up.replica(name)
        assert victim is not None
        victim.send_signal(signal.SIGKILL)
        died = f"keybatch: replica {name} (pid {victim.pid}) died (killed by SIGKILL)"
        poll(lambda: died in up.log(), 5, "the supervisor noticed the death")
        # The other replica serves while the first is down. One request at a time:
        # until the dead replica's entries expire (or failover releases them), the
        # survivor, when busy, takes the dead one for an idle peer and leaves it the work.
        assert [up.post() for _ in range(3)] == [200] * 3
        reborn = poll(lambda: (r := up.replica(name)) and r.pid != victim.pid and r, 15, "a new replica process")
        client = up.redis()
        poll(
            lambda: client.hget(keys.replica_key(name), "pid") == str(reborn.pid).encode(), 15, "the new one registered"
        )
        assert up.proc.poll() is None
        assert up.posts(8) == [200] * 8
        assert f"keybatch: replica {name} restarted (pid {reborn.pid})" in up.log()


def test_a_replica_that_dies_after_a_healthy_life_is_replaced_by_the_standby() -> None:
    """STANDBY_REPLICAS (one by default): a booted process waits with its engine loaded;
    a replica that served its healthy life and dies is replaced by it under the same name,
    with no new boot, and another standby follows; chaos's harness names it as a replica."""
    with keybatch_up("--workers", "2", "--models", MODEL) as up:
        ready_at = time.monotonic()  # the replicas started before this
        standby = poll(up.standby, 30, "a standby once the deployment is ready")
        name = f"{MODEL}-1@{socket.gethostname()}"
        victim = up.replica(name)
        assert victim is not None
        poll(lambda: time.monotonic() - ready_at >= HEALTHY_AFTER_S, 2 * HEALTHY_AFTER_S, "a healthy life")
        assert up.posts(2) == [200, 200]
        victim.send_signal(signal.SIGKILL)
        client = up.redis()
        poll(
            lambda: client.hget(keys.replica_key(name), "pid") == str(standby.pid).encode(),
            10,
            "the standby registered under the dead replica's name",
        )
        log = up.log()
        assert f"keybatch: replica {name}: standby (pid {standby.pid}) took its place" in log
        assert f"replica {name}: restarting" not in log
        assert up.posts(8) == [200] * 8
        follower = poll(lambda: (s := up.standby()) and s.pid != standby.pid and s, 30, "another standby")
        assert follower.nice() > 0  # it boots at a low priority; the one that took the place does not
        assert psutil.Process(standby.pid).nice() == 0
        assert up.replica(name) is None  # its command line names no replica: the registry does
        assert dict((n, p.pid) for n, p in _harness_replicas(up)) == {
            name: standby.pid,
            f"{MODEL}-2@{socket.gethostname()}": up.replica(f"{MODEL}-2@").pid,  # type: ignore[union-attr]
        }


def _harness_replicas(up: Up) -> list[tuple[str, psutil.Process]]:
    """What `keybatch chaos` picks its victims from, for this `up`."""
    deployment = Deployment("test", 2, {})
    deployment.proc, deployment.port = up.proc, up.port
    return deployment.replicas()


def test_a_killed_broker_is_restarted_on_its_port_and_requests_answer_again() -> None:
    with keybatch_up("--workers", "2", "--models", MODEL) as up:
        assert up.posts(2) == [200, 200]
        broker = up.broker()
        broker.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        poll(lambda: up.post() == 200, 10, "a 200 after the broker's restart")
        assert time.monotonic() - killed < 6
        assert up.broker().pid != broker.pid
        assert up.posts(4) == [200] * 4
        assert "keybatch: broker restarted" in up.log()


def test_a_killed_gateway_is_restarted_and_its_orphaned_workers_go() -> None:
    with keybatch_up("--workers", "2", "--models", MODEL) as up:
        assert up.posts(2) == [200, 200]
        master = next(c for c in up.children() if "api" in cmdline(c))
        workers = [w.pid for w in master.children()]
        assert workers
        master.send_signal(signal.SIGKILL)
        poll(lambda: not alive(workers), 10, "the dead gateway's workers gone")
        poll(lambda: up.post() == 200, 15, "a 200 from the new gateway")
        assert "keybatch: gateway restarted" in up.log()


def test_sigkill_of_keybatch_up_leaves_nothing_running() -> None:
    with keybatch_up("--workers", "2", "--models", MODEL) as up:
        poll(up.standby, 30, "a standby")
        family = psutil.Process(up.proc.pid).children(recursive=True)
        names = " ".join(" ".join(cmdline(c)) for c in family)
        # Replicas, the standby, the gateway master and its two workers, Valkey: all must go.
        assert sum("control worker" in " ".join(cmdline(c)) for c in family) == 3
        assert sum("control api" in " ".join(cmdline(c)) for c in family) == 3, names
        assert any("valkey" in c.name() for c in family)
        up.proc.kill()
        up.proc.wait()
        pids = [c.pid for c in family]
        try:
            poll(lambda: not alive(pids), 10, "every child of keybatch up gone")
        except AssertionError as err:  # name what was left, for the next look
            left = [" ".join(cmdline(c)) for c in family if c.pid in alive(pids)]
            raise AssertionError(f"{err}; left: {left}") from None


def test_fewer_workers_than_models_is_refused_at_once() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "control",
            "up",
            "--backend",
            "fixed",
            "--workers",
            "1",
            "--models",
            "kb-small,kb-large",
        ],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 2
    assert "kb-large without a replica" in done.stderr
    assert done.stdout == ""
    assert time.monotonic() - started < 5


def test_a_plan_that_leaves_a_cell_without_a_replica_is_refused() -> None:
    from control.fleet.up import PlanError, check_plan

    settings = Settings(models={"kb-small": "kb-small", "kb-large": "kb-large"})
    plan = Plan(workers=4, models=["kb-small", "kb-large"], cells=2)
    check_plan(settings, plan)  # a round of both models to each cell
    assert [plan.replica_cell(i, 2) for i in range(4)] == [0, 0, 1, 1]
    with pytest.raises(PlanError, match="leaves cell 2 without a replica"):
        check_plan(settings, Plan(workers=4, models=["kb-small", "kb-large"], cells=3))
    with pytest.raises(PlanError, match="--cells must be at least 1"):
        check_plan(settings, Plan(workers=4, cells=0))


def test_the_default_is_two_replicas_per_model() -> None:
    plan = Plan(models=["kb-small", "kb-large"])
    assert plan.replica_models() == ["kb-small", "kb-large", "kb-small", "kb-large"]


def test_backoff_doubles_to_its_cap_and_resets_after_a_long_life() -> None:
    backoff = Backoff()
    assert [backoff.after_death(1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, RESTART_MAX_S, RESTART_MAX_S]
    assert backoff.after_death(HEALTHY_AFTER_S + 1) == 0.0  # it served: back at once
    assert backoff.after_death(1.0) == 0.5  # and a crash loop from there waits again
    assert backoff.after_death(1.0) == 1.0


@pytest.fixture
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as b:
        yield b


def _system(url: str) -> System:
    return System(Settings(redis_url=url), Plan(models=[MODEL]))


def test_replica_died_requeues_what_it_held(broker: EmbeddedBroker) -> None:
    """What a dead replica held goes back to the front of its queue at once."""
    state = redis.Redis.from_url(broker.url)
    name, queue, waiting = "kb-small-1@host", keys.queue_key(MODEL, "free"), keys.waiting_key(MODEL, "free")
    deadline_ms = time.time() * 1000 + 10_000
    state.set(keys.owner_key("t:req-1"), f"gw|{waiting}|t|attempt-1", px=10_000)
    state.hset(keys.held_key(name), "attempt-1", f"{deadline_ms:.0f}|{queue}|{waiting}|t:req-1|MESSAGE")
    state.sadd(keys.HOLDERS_KEY, name)
    state.set(keys.lease_key(name), 1, px=10_000)  # the supervisor does not wait for it to lapse
    _system(broker.url)._replica_died(name)
    assert state.lrange(queue, 0, -1) == [b"MESSAGE"]
    assert state.zscore(waiting, "attempt-1") == round(deadline_ms)
    assert not state.exists(keys.held_key(name), keys.lease_key(name))


def test_replica_died_never_raises(broker: EmbeddedBroker) -> None:
    system = _system(broker.url)
    broker.stop()
    started = time.monotonic()
    system._replica_died("kb-small-1@host")  # the broker is down: logged, not raised
    assert time.monotonic() - started < 2


ORPHAN = """
import os, sys, subprocess, threading
if sys.argv[1] == "parent":  # start the replica-like child, wait until it watches, then die
    argv = [sys.executable, "-c", sys.argv[2], "child", sys.argv[3]]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    os._exit(0)
import logging
logging.basicConfig(filename=sys.argv[2])
from tasks.replica.worker import exit_when_orphaned
exit_when_orphaned(grace_s=0.5, every_s=0.05)
print("watching", flush=True)
threading.Event().wait()  # a shutdown that never ends
"""


def test_a_replica_whose_supervisor_died_exits_even_if_its_shutdown_hangs(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    args = [sys.executable, "-c", ORPHAN, "parent", ORPHAN, str(log)]
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=30)
    pid = int(done.stdout.split()[0])
    try:
        poll(lambda: not alive([pid]), 10, "the orphaned child gone")
    finally:
        if alive([pid]):
            os.kill(pid, signal.SIGKILL)
    assert "is gone and the shutdown did not end: exiting" in log.read_text()  # by the watch, not by chance
