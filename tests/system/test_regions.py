"""Region loss: a gateway forwards to a peer region; a client fails over between regions.

Two real deployments on loopback: region b, and region a whose gateway lists b as its
peer. Region a loses its replicas (or its broker) while its gateway stays up, then its
gateway too.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from api.peers import FORWARDED_HEADER, STRANDED_HEADER
from control.core.procs import free_port
from control.fleet.regionclient import NoRegionAnswered, RegionClient
from tests.support.deploy import FREE_KEY, MODEL, PAID_KEY, Deployment, deployment

BODY = {"model": MODEL, "prompt": "def add(a, b):\n    "}
BUDGET_MS = 5000  # room for two hops on two busy shared cores; what is tested is where the answer comes from


def post(d: Deployment, key: str = FREE_KEY, **headers: str) -> requests.Response:
    return d.post(key=key, **{"X-Deadline-Ms": str(BUDGET_MS), **headers})


def served_by(region: str, resp: requests.Response) -> bool:
    return resp.status_code == 200 and resp.json()["keybatch"]["replica"].startswith(f"{MODEL}-1.{region}@")


def wait_for(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the state did not come within the bound"
        time.sleep(0.05)


def readiness(d: Deployment) -> str:
    resp = requests.get(f"{d.url}/readyz", timeout=5)
    return "ready" if resp.status_code == 200 else str(resp.json()["error"]["code"])


def test_a_region_that_cannot_serve_forwards_then_clients_fail_over() -> None:
    with (
        deployment(workers=1, REGION="b") as b,
        # One gateway process in a: the one answering /readyz is the one whose view of the replicas
        # decides the next request (two processes refresh their views at different moments).
        deployment(workers=1, REGION="a", PEERS=json.dumps([b.url]), API_PROCESSES="1") as a,
    ):
        assert served_by("a", post(a))  # at home while it can
        replicas_hang_then_come_back(a, b)
        broker_and_replicas_die(a, b)
        the_client_moves_on_at_a_503(a, b)
        gateway_dies_too(a, b)


def replicas_hang_then_come_back(a: Deployment, b: Deployment) -> None:
    for worker in a.system.workers:
        worker.send_signal(signal.SIGSTOP)
    try:
        served_elsewhere_without_replicas(a, b)
    finally:  # a stopped replica would hold up the deployment's stop
        for worker in a.system.workers:
            worker.send_signal(signal.SIGCONT)
    wait_for(lambda: readiness(a) == "ready")


def served_elsewhere_without_replicas(a: Deployment, b: Deployment) -> None:
    """No live replica (their leases lapsed): 503 no_replica here, so b answers."""
    wait_for(lambda: readiness(a) == "not_ready")
    marked = post(a, **{FORWARDED_HEADER: "c"})  # forwarded once already: answered here
    assert marked.status_code == 503
    assert marked.json()["error"]["code"] == "no_replica"
    assert marked.headers["Retry-After"] == "1"

    answers = [post(a, key, **{"X-Request-Id": f"fwd-{i}"}) for i, key in enumerate([FREE_KEY, PAID_KEY] * 3)]
    assert all(served_by("b", r) for r in answers), [r.text for r in answers]
    assert [r.headers["X-Request-Id"] for r in answers] == [f"fwd-{i}" for i in range(6)]
    assert [r.json()["id"] for r in answers] == [f"fwd-{i}" for i in range(6)]
    assert [r.json()["keybatch"]["tier"] for r in answers] == ["free", "paid"] * 3  # the key went along

    # A budget shorter than a batch could not be met at b either: the refusal stands.
    short = a.post(**{"X-Deadline-Ms": "100"})
    assert short.status_code == 503
    assert short.json()["error"]["code"] == "no_replica"

    stream = requests.post(
        f"{a.url}/v1/completions",
        json={**BODY, "stream": True},
        headers={"Authorization": f"Bearer {FREE_KEY}", "X-Deadline-Ms": str(BUDGET_MS)},
        timeout=30,
    )
    assert stream.status_code == 200
    assert stream.headers["Content-Type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["keybatch"]["replica"].startswith(f"{MODEL}-1.b@")  # the last chunk carries it

    assert a.metric("keybatch_forwarded_total", peer=b.url, status="200") == 7


def broker_and_replicas_die(a: Deployment, b: Deployment) -> None:
    """The broker first: the gateway still believes in its replicas, then cannot reach them."""
    assert a.system.broker is not None
    a.system.broker.stop()
    for worker in a.system.workers:
        worker.kill()
        worker.wait(30)
    marked = post(a, **{FORWARDED_HEADER: "c"})
    assert marked.status_code == 503
    assert marked.json()["error"]["code"] == "broker_unavailable"
    answers = [post(a) for _ in range(4)]
    assert all(served_by("b", r) for r in answers), [r.text for r in answers]


def the_client_moves_on_at_a_503(a: Deployment, b: Deployment) -> None:
    with RegionClient([a.url, b.url], api_key=FREE_KEY) as client:
        # a's gateway refuses a request marked forwarded with its 503
        answer = client.complete(BODY, BUDGET_MS, "moved-on", headers={FORWARDED_HEADER: "c"})
    assert (answer.region, answer.status) == (b.url, 200)
    assert answer.json()["id"] == "moved-on"


def gateway_dies_too(a: Deployment, b: Deployment) -> None:
    assert a.system.gateway is not None
    a.system.gateway.terminate()
    a.system.gateway.wait(30)
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there either
    with RegionClient([gone, a.url, b.url], api_key=FREE_KEY) as client:
        answer = client.complete(BODY, BUDGET_MS, "failed-over")
    assert (answer.region, answer.status) == (b.url, 200)
    assert answer.json()["id"] == "failed-over"
    assert answer.json()["keybatch"]["replica"].startswith(f"{MODEL}-1.b@")


def test_the_client_gives_up_within_its_budget() -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with RegionClient([url, url]) as client, pytest.raises(NoRegionAnswered) as raised:
            client.complete(BODY, budget_ms=300)
        assert time.monotonic() - started < 0.6
        assert len(raised.value.failures) == 1  # the second one had no budget left
        assert "timed out" in raised.value.failures[0][1]


@pytest.mark.parametrize("stranded", [True, False], ids=["stranded", "forwarded-new"])
def test_a_burst_a_peer_forwards_after_losing_it_rides_one_batch(stranded: bool) -> None:
    """What waited in a region that lost its broker comes to the peer as a burst, forwarded
    request by request. The peer gathers stranded requests (up to `STRANDED_GATHER_MS`,
    100 ms, or a deadline's last start), so eight sent 8 ms apart ride one batch. Without
    the mark each idle replica starts a batch 20 ms (`max_wait`) after its first."""
    headers = {FORWARDED_HEADER: "a", "X-Deadline-Ms": "600", **({STRANDED_HEADER: "1"} if stranded else {})}
    with deployment(workers=2, max_batch="16", hedge="off", REGION="b") as b:
        assert b.post().status_code == 200  # warm

        def send(i: int, start: float) -> requests.Response:
            time.sleep(max(0.0, start + 0.008 * i - time.monotonic()))  # the burst's shape
            return b.post({**BODY, "prompt": f"stranded {i}"}, **headers)

        start = time.monotonic() + 0.05
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: send(i, start), range(8)))
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    sizes = [r.json()["keybatch"]["batch_size"] for r in answers]
    if stranded:
        assert sizes == [8] * 8, sizes
    else:  # the first few start a batch on each replica; the rest wait for one to end
        assert max(sizes) < 8, sizes
