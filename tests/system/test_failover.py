"""A replica that dies or hangs loses no request; a poison prompt fails alone; a replica's
clock may disagree; a stalled broker answers 503 at once and service returns by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from control.broker import keys
from tests.support.deploy import MODEL, Deployment, deployment, held_counts, replica_for, stop_after_its_pull
from tests.support.waiting import until

BUDGET = {"X-Deadline-Ms": "2000"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Deployment]:
    with deployment(workers=2, fixed_poison="POISON", idempotency_window_s="1") as d:
        yield d


def _burst(kb: Deployment, n: int, **headers: str) -> list:
    pool = ThreadPoolExecutor(n)
    return [pool.submit(kb.post, {"model": MODEL, "prompt": f"def f{i}():\n"}, **headers) for i in range(n)]


def test_a_replica_killed_mid_batch_loses_no_request() -> None:
    with deployment(workers=2) as kb:
        victim = kb.system.workers[0]
        name = replica_for(kb, victim.pid)
        futures = _burst(kb, 60, **BUDGET)
        assert until(lambda: held_counts(kb).get(keys.held_key(name), 0) > 0, 5)  # it holds some of them
        victim.send_signal(signal.SIGKILL)
        answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 60, [a.text for a in answers if a.status_code != 200]
        assert all(a.json()["keybatch"]["replica"] != name or a.elapsed.total_seconds() < 2 for a in answers)
        assert len({a.json()["id"] for a in answers}) == 60
        assert keys.held_key(name) not in held_counts(kb)  # swept


def _claims(kb: Deployment, name: str) -> int:
    """How many of the requests replica `name` holds it has claimed for a batch."""
    state = redis.Redis.from_url(kb.system.redis_url)
    held = [i.decode() for i in state.hkeys(keys.held_key(name))]
    return sum(v == name.encode() for v in state.mget([keys.claim_key(i) for i in held])) if held else 0


def test_a_hung_replica_loses_its_lease_and_its_requests_run_elsewhere() -> None:
    with deployment(workers=2) as kb:
        victim = kb.system.workers[0]
        name = replica_for(kb, victim.pid)
        futures = _burst(kb, 60, **BUDGET)
        # Paused with a batch claimed (not only pulled: a replica holding back for its phase
        # claims at its start, and one paused before it finds its requests claimed elsewhere).
        assert until(lambda: _claims(kb, name) > 0, 5)
        victim.send_signal(signal.SIGSTOP)
        try:
            answers = [f.result() for f in futures]
        finally:
            victim.send_signal(signal.SIGCONT)
        assert [a.status_code for a in answers] == [200] * 60, [a.text for a in answers if a.status_code != 200]
        # Back from its pause, it runs what it still had: those answers are counted as waste, never sent.
        assert until(lambda: kb.metric("keybatch_wasted_results_total") > 0, 5)
        assert kb.post().status_code == 200


def test_a_poison_prompt_fails_alone(fleet: Deployment) -> None:
    pool = ThreadPoolExecutor(8)
    prompts = [f"ok {i}" for i in range(7)] + ["this is POISON"]
    answers = list(pool.map(lambda p: fleet.post({"model": MODEL, "prompt": p}), prompts))
    assert [a.status_code for a in answers] == [200] * 7 + [422]
    assert answers[-1].json()["error"]["code"] == "engine_error"
    assert max(a.json()["keybatch"]["batch_size"] for a in answers[:7]) > 1  # batched with it


def test_a_replica_whose_clock_is_off_still_meets_deadlines(fleet: Deployment) -> None:
    """Deadlines are read on the broker's clock, so a replica 400 ms ahead serves as usual."""
    env = {**os.environ, "KEYBATCH_REDIS_URL": fleet.system.redis_url, "KEYBATCH_CLOCK_SKEW_MS": "400"}
    env["KEYBATCH_MODELS"] = json.dumps({MODEL: MODEL})
    cmd = [sys.executable, "-m", "control", "worker", "--backend", "fixed", "--policy", "static"]
    cmd += ["--model", MODEL, "--name", "skewed@test"]
    skewed = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for worker in fleet.system.workers:  # the skewed replica alone serves
            worker.send_signal(signal.SIGSTOP)
        state = redis.Redis.from_url(fleet.system.redis_url)
        assert until(
            lambda: state.exists(keys.lease_key("skewed@test")) and len(state.keys(keys.lease_key("*"))) == 1, 15
        )
        assert until(lambda: fleet.post().status_code == 200, 5)
        answers = [f.result() for f in _burst(fleet, 10)]
        assert [a.status_code for a in answers] == [200] * 10
        assert {a.json()["keybatch"]["replica"] for a in answers} == {"skewed@test"}
        offset = float(state.hget(keys.replica_key("skewed@test"), "clock_offset_ms") or 0)
        assert -450 < offset < -350  # it knows how far off it is
    finally:
        for worker in fleet.system.workers:
            worker.send_signal(signal.SIGCONT)
        skewed.terminate()
        skewed.wait(30)


def test_a_stalled_broker_answers_503_at_once_and_service_returns_by_itself(fleet: Deployment) -> None:
    assert fleet.system.broker is not None
    assert fleet.system.broker.process is not None
    pid = fleet.system.broker.process.pid
    waiting = _burst(fleet, 10, **{"X-Deadline-Ms": "5000"})
    time.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.3)  # noticed by then
        during = []
        for _ in range(5):
            start = time.monotonic()
            during.append((fleet.post().status_code, time.monotonic() - start))
        held = [f.result(10).status_code for f in waiting]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert {code for code, _ in during} == {503}
    assert max(t for _, t in during) < 0.2
    assert set(held) <= {200, 503}
    assert until(lambda: fleet.post().status_code == 200, 5)
    assert requests.get(f"{fleet.url}/readyz", timeout=5).status_code == 200


def test_a_batch_that_hangs_ends_its_replica_and_its_request_is_answered() -> None:
    with deployment(workers=2, fixed_hang="HANG", stall_ms="300", heartbeat_s="0.25") as kb:
        hung = ThreadPoolExecutor(1).submit(kb.post, {"model": MODEL, "prompt": "HANG"}, **{"X-Deadline-Ms": "4000"})
        # The replica that took it exits (3) once the batch is far past its time (the supervisor,
        # not running here, would start a fresh one); its lease lapsed long before, so the request
        # was re-queued, hung the other replica too, and is answered, never left waiting.
        assert hung.result(10).status_code in (503, 504)  # 503 once no replica is left
        assert until(lambda: sorted(w.poll() or 0 for w in kb.system.workers) == [3, 3], 10)


def test_a_stored_answer_is_kept_for_the_idempotency_window_only(fleet: Deployment) -> None:
    first = fleet.post(**{"X-Request-Id": "kept-1"})
    again = fleet.post(**{"X-Request-Id": "kept-1"})
    assert again.json()["keybatch"]["batch_ms"] == first.json()["keybatch"]["batch_ms"]  # the stored one
    time.sleep(1.1)  # the window (IDEMPOTENCY_WINDOW_S=1) is a TTL on the broker: nothing to poll
    later = fleet.post(**{"X-Request-Id": "kept-1"})
    assert later.status_code == 200
    # It ran again: its batch started after it arrived (a stored answer's started before:
    # queue_ms 0). Two runs' batch times may round to the same figure.
    assert again.json()["keybatch"]["queue_ms"] == 0
    assert later.json()["keybatch"]["queue_ms"] > 0


def test_what_a_stopped_replicas_pull_took_comes_back_within_the_default_budget() -> None:
    """The same as below with the default budget (600 ms) and every idle replica waiting on
    the queue: the stopped replica's pull takes one of the burst. Its pulse lapses within
    100 ms, and the request is back in line in time. Found by the lease (300 ms) and a
    sweep, it is too late for that budget (504 with PULSE_MS=0)."""
    with deployment(workers=3, single_listener="false", hedge="off") as kb:
        victim = kb.system.workers[0]
        stop_after_its_pull(kb, victim)  # its pull is out for its whole wait (0.1 s)
        try:
            futures = _burst(kb, 3)
            answers = [f.result(20) for f in futures]
        finally:
            victim.send_signal(signal.SIGKILL)
            victim.wait(5)
        assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers if a.status_code != 200]
        # One of them came back: it waited for the pulse to lapse, not only for a batch.
        assert max(a.json()["keybatch"]["queue_ms"] for a in answers) > 60, [a.json()["keybatch"] for a in answers]


def test_a_request_a_replica_took_and_died_with_before_recording_it_is_queued_again() -> None:
    """A stopped replica's outstanding pull still takes a message off the queue: the
    request is then in no queue and no held hash. Once the replica is found dead, the
    gateway that owns the request pushes it back, and the replica left answers it."""
    with deployment(workers=2, single_listener="false") as kb:
        victim = kb.system.workers[0]
        stop_after_its_pull(kb, victim)
        try:
            futures = _burst(kb, 8, **{"X-Deadline-Ms": "10000"})
            answers = [f.result(20) for f in futures]
        finally:
            victim.send_signal(signal.SIGKILL)
            victim.wait(5)
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers if a.status_code != 200]
        # None waited for its deadline: the one the stopped replica took came back within
        # its pulse (100 ms), the sweep (100 ms) and the rescue's delay (30 ms).
        assert max(a.elapsed.total_seconds() for a in answers) < 4.0


@pytest.mark.parametrize("hedge_idle", ["true", "false"])
def test_a_request_whose_host_is_lost_at_low_load_is_answered_by_an_idle_replicas_copy(hedge_idle: str) -> None:
    """Four idle replicas as two hosts of two: one request's batch starts, and its host is
    stopped (no signal to anyone). No other batch runs that a copy could ride; with
    HEDGE_IDLE an idle replica of the other host runs a batch of its copy and answers it
    within the default budget. Without it, the lease lapses too late to run it again: 504."""
    with deployment(workers=4, max_batch="16", replicas_per_host=2, hedge_idle=hedge_idle) as kb:
        state = redis.Redis.from_url(kb.system.redis_url)
        # Every replica idle (the warm-up requests' copies ran too), then a claim to tell apart.
        assert until(lambda: state.zcard(keys.idle_key(MODEL)) == 4, 5, 0.01)
        # The warm-up requests ran on idle replicas: copies, answered first by their own runs.
        copies_wasted = kb.metric("keybatch_hedge_copies_wasted_total")
        assert copies_wasted >= 1 if hedge_idle == "true" else copies_wasted == 0
        warm = set(state.keys(keys.claim_key("*")))
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(kb.post, {"model": MODEL, "prompt": "its host is lost"})
            assert until(lambda: bool(set(state.keys(keys.claim_key("*"))) - warm) or sent.done(), 5, 0.002)
            [claim] = set(state.keys(keys.claim_key("*"))) - warm
            runner = state.get(claim)
            assert runner is not None
            host = runner.decode().split("@")[1]
            victims = [w for w in kb.system.workers if replica_for(kb, w.pid).endswith(f"@{host}")]
            assert len(victims) == 2
            for victim in victims:
                victim.send_signal(signal.SIGSTOP)
            try:
                answer = sent.result(10)
            finally:
                for victim in victims:
                    victim.send_signal(signal.SIGKILL)
                    victim.wait(5)
        if hedge_idle == "false":
            assert answer.status_code == 504, answer.text
            return
        assert answer.status_code == 200, answer.text
        meta = answer.json()["keybatch"]
        assert meta["hedged"] is True and not meta["replica"].endswith(f"@{host}")
