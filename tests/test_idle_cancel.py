"""A client that hangs up on, or cancels, the only request of an idle replica leaves
the replica serving: no stall is seen, it does not exit, and the next request is
answered as usual. Both batching policies, on the fixed backend."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from control import protocol as p
from tests.conftest import FREE_KEY, MODEL, Deployment, deployment, replica_for, until

# A stall is declared after two heartbeats past batch_ms + STALL_MS: short here, so a
# replica that would give up does so well within the wait below.
STALL_MS, HEARTBEAT_S = 300, 0.2
WATCHDOG_S = (250 + STALL_MS) / 1000 + 3 * HEARTBEAT_S + 0.5
AUTH = {"Authorization": f"Bearer {FREE_KEY}"}


@pytest.fixture(scope="module", params=["continuous", "static"])
def idle(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    with deployment(
        workers=1, policy=request.param, stall_ms=str(STALL_MS), heartbeat_s=str(HEARTBEAT_S), batch_ms="250"
    ) as d:
        yield d


def _hang_up(d: Deployment, after_s: float) -> None:
    """Send a whole request, then close the connection before the answer."""
    host, port = d.url.removeprefix("http://").split(":")
    body = b'{"model": "%s", "prompt": "def hung_up():\\n    "}' % MODEL.encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {FREE_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(head + body)
        conn.settimeout(after_s)
        try:
            assert conn.recv(1) == b"", "answered before the hang-up"
        except TimeoutError:
            pass


def _cancel_running(d: Deployment, name: str, request_id: str) -> requests.Response:
    """Send a request and cancel it once its replica has started it."""
    state = redis.Redis.from_url(d.system.redis_url)
    launched = state.zscore(p.launch_key(MODEL), name)
    headers = {**AUTH, "X-Request-Id": request_id, "X-Deadline-Ms": "5000"}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            requests.post, f"{d.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers, timeout=10
        )
        assert until(lambda: state.zscore(p.launch_key(MODEL), name) != launched, 5, 0.005)  # its batch started
        cancel = requests.delete(f"{d.url}/v1/completions/{request_id}", headers=AUTH, timeout=5)
        assert cancel.status_code == 200, cancel.text
        return answer.result(10)


def _serves_on(d: Deployment, pid: int, name: str) -> None:
    """Past the stall watchdog's window: the same process, ready, and answering."""
    state = redis.Redis.from_url(d.system.redis_url)
    waited_until = time.monotonic() + WATCHDOG_S
    while time.monotonic() < waited_until:
        assert d.system.workers[0].poll() is None, "the replica exited"
        assert state.hget(p.replica_key(name), "state") == b"serving"
        assert requests.get(f"{d.url}/readyz", timeout=5).status_code == 200
        time.sleep(0.05)
    assert d.system.workers[0].pid == pid and d.system.workers[0].poll() is None
    assert state.hget(p.replica_key(name), "busy") == b"0"  # nothing runs: not taken for busy
    answer = d.post()
    assert answer.status_code == 200, answer.text
    assert answer.json()["keybatch"]["batch_ms"] < 1000


def test_a_hang_up_mid_batch_leaves_an_idle_replica_serving(idle: Deployment) -> None:
    pid = idle.system.workers[0].pid
    name = replica_for(idle, pid)
    for _ in range(2):
        _hang_up(idle, 0.1)
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
    with deployment(
        workers=1, policy="continuous", fixed_hang="HANG", stall_ms=str(STALL_MS), heartbeat_s=str(HEARTBEAT_S)
    ) as d:
        hung = d.post({"model": MODEL, "prompt": "HANG"}, **{"X-Deadline-Ms": "3000"})
        assert hung.status_code in (503, 504)
        assert until(lambda: d.system.workers[0].poll() == 3, 10)
