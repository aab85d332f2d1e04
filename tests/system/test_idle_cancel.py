"""A client that hangs up on, or cancels, the only request of an idle replica leaves
the replica serving: no stall is seen, it does not exit, and the next request is
answered as usual. Both batching policies, on the fixed backend and the torch one."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import requests

from control.broker import keys
from tests.support.deploy import FREE_KEY, MODEL, Deployment, deployment, replica_for
from tests.support.lm_fixtures import quick_model  # noqa: F401  (a fixture)
from tests.support.waiting import until

# A stall is declared after two heartbeats past the expected batch time + STALL_MS:
# short here, so a replica that would give up does so well within the wait below.
STALL_MS, HEARTBEAT_S = 300, 0.2
STOP_S = 0.2  # under STALL_MS: a pause, not a hang
AUTH = {"Authorization": f"Bearer {FREE_KEY}"}
# Long enough on the torch engine to be cut short; the fixed one takes 250 ms whatever it asks.
BODY = {"model": MODEL, "prompt": "def hung_up(items):\n    ", "max_tokens": 256, "temperature": 0}
WATCH = {"stall_ms": str(STALL_MS), "heartbeat_s": str(HEARTBEAT_S)}
SETUPS = [
    pytest.param(("fixed", "continuous"), id="fixed-continuous"),
    pytest.param(("fixed", "static"), id="fixed-static"),
    pytest.param(("hf", "continuous"), id="hf-continuous", marks=pytest.mark.slow),
    pytest.param(("hf", "static"), id="hf-static", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=SETUPS)
def idle(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    backend, policy = request.param
    env = dict(WATCH)
    if backend == "hf":
        model: Path = request.getfixturevalue("quick_model")
        env.update(models_dir=str(model.parent), max_batch="8")
    with deployment(workers=1, backend=backend, policy=policy, **env) as d:
        yield d


def _hang_up(d: Deployment, name: str) -> None:
    """Send a request and close the connection once its replica has started it."""
    state = redis.Redis.from_url(d.system.redis_url)
    launched = state.zscore(keys.launch_key(MODEL), name)
    host, port = d.url.removeprefix("http://").split(":")
    body = json.dumps(BODY).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {FREE_KEY}\r\n"
        f"X-Deadline-Ms: 10000\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head + body)
        assert until(lambda: state.zscore(keys.launch_key(MODEL), name) != launched, 10, 0.002)  # its batch started


def _cancel_running(d: Deployment, name: str, request_id: str) -> requests.Response:
    """Send a request and cancel it once its replica has started it."""
    state = redis.Redis.from_url(d.system.redis_url)
    launched = state.zscore(keys.launch_key(MODEL), name)
    headers = {**AUTH, "X-Request-Id": request_id, "X-Deadline-Ms": "10000"}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(requests.post, f"{d.url}/v1/completions", json=BODY, headers=headers, timeout=20)
        assert until(lambda: state.zscore(keys.launch_key(MODEL), name) != launched, 10, 0.002)  # its batch started
        cancel = requests.delete(f"{d.url}/v1/completions/{request_id}", headers=AUTH, timeout=5)
        assert cancel.status_code == 200, cancel.text
        return answer.result(20)


def _serves_on(d: Deployment, pid: int, name: str) -> None:
    """Past the stall watchdog's window: the same process, serving, ready and answering."""
    state = redis.Redis.from_url(d.system.redis_url)
    batch_ms = float(state.hget(keys.replica_key(name), "batch_ms") or 0)
    waited_until = time.monotonic() + (batch_ms + STALL_MS) / 1000 + 3 * HEARTBEAT_S + 0.5
    while time.monotonic() < waited_until:
        assert d.system.workers[0].poll() is None, "the replica exited"
        assert state.hget(keys.replica_key(name), "state") == b"serving"
        assert requests.get(f"{d.url}/readyz", timeout=5).status_code == 200
        time.sleep(0.05)
    assert d.system.workers[0].pid == pid and d.system.workers[0].poll() is None
    assert state.hget(keys.replica_key(name), "busy") == b"0"  # nothing runs: not taken for busy
    answer = d.post({**BODY, "max_tokens": 4}, **{"X-Deadline-Ms": "10000"})
    assert answer.status_code == 200, answer.text


def test_a_hang_up_mid_batch_leaves_an_idle_replica_serving(idle: Deployment) -> None:
    pid = idle.system.workers[0].pid
    name = replica_for(idle, pid)
    state = redis.Redis.from_url(idle.system.redis_url)

    def gone() -> int:
        return int(state.hget(keys.replica_key(name), "dropped_gone") or 0)

    for i in range(2):
        _hang_up(idle, name)
        if idle.system.plan.policy == "continuous":  # it left the engine mid-run, not at its end
            assert until(lambda: gone() > i, 5)  # noqa: B023 (called at once)
        _serves_on(idle, pid, name)


def test_a_cancel_mid_batch_leaves_an_idle_replica_serving(idle: Deployment) -> None:
    pid = idle.system.workers[0].pid
    name = replica_for(idle, pid)
    for i in range(2):
        answer = _cancel_running(idle, name, f"cancelled-mid-{i}")
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "cancelled"
        _serves_on(idle, pid, name)


def test_a_step_that_hangs_still_ends_its_replica() -> None:
    """The watchdog still sees a continuous engine's step that never ends."""
    with deployment(workers=1, policy="continuous", fixed_hang="HANG", **WATCH) as d:
        hung = d.post({"model": MODEL, "prompt": "HANG"}, **{"X-Deadline-Ms": "3000"})
        assert hung.status_code in (503, 504)
        assert until(lambda: d.system.workers[0].poll() == 3, 10)


def test_a_replica_stopped_mid_step_does_not_learn_the_stop_as_a_batch_cost(idle: Deployment) -> None:
    """A pause the engine did not cause (the process stopped, starved of its core) lands in
    one step's measured time; admission still admits the default budget afterwards."""
    if idle.system.plan.backend != "hf":
        pytest.skip("the fixed backend learns nothing")
    worker = idle.system.workers[0]
    name = replica_for(idle, worker.pid)
    state = redis.Redis.from_url(idle.system.redis_url)
    launched = state.zscore(keys.launch_key(MODEL), name)
    before = _batch_ms(state, name)
    headers = {**AUTH, "X-Deadline-Ms": "20000"}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(requests.post, f"{idle.url}/v1/completions", json=BODY, headers=headers, timeout=30)
        assert until(lambda: state.zscore(keys.launch_key(MODEL), name) != launched, 10, 0.002)
        for _ in range(3):  # some stop lands inside a forward
            worker.send_signal(signal.SIGSTOP)
            time.sleep(STOP_S)  # the pause is the fault injected, not a wait for a state
            worker.send_signal(signal.SIGCONT)
            time.sleep(STOP_S)  # it runs on between the pauses (the watchdog sees steps end)
        answer.result(30)
    assert until(lambda: requests.get(f"{idle.url}/readyz", timeout=5).status_code == 200, 10)
    assert _batch_ms(state, name) < 3 * before  # the pauses were not learned as the cost of a step
    default_budget = idle.post({**BODY, "max_tokens": 4})
    assert default_budget.status_code == 200, default_budget.text


def _batch_ms(state: redis.Redis, name: str) -> float:
    """What the replica last published as the time of one batch (what admission reads)."""
    return float(state.hget(keys.replica_key(name), "batch_ms") or 0)
