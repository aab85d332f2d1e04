"""Cells: `keybatch up --cells 2` runs two brokers, each with its own replicas. A request
is carried by its own cell, and by the other while its own broker does not answer: those
waiting in a cell whose broker is killed or stopped are answered 200 all the same."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import redis
import requests

from control.broker import keys
from control.policy.cells import home_cell
from tests.support.deploy import FREE_KEY, MODEL
from tests.support.up import Up, keybatch_up

TENANT = hashlib.sha256(FREE_KEY.encode()).hexdigest()[:16]  # what the gateway scopes this key's ids by


def ids_of_cell(cell: int, n: int, prefix: str) -> list[str]:
    """Request ids whose own cell (of 2) is `cell`."""
    found = (f"{prefix}-{i}" for i in range(10_000))
    return [rid for rid in found if home_cell(f"{TENANT}:{rid}", 2) == cell][:n]


def post(
    up: Up, request_id: str | None = None, session: str | None = None, budget_ms: int | None = None
) -> requests.Response:
    headers = {"Authorization": f"Bearer {FREE_KEY}"}
    if request_id:
        headers["X-Request-Id"] = request_id
    if session:
        headers["X-Session-Id"] = session
    if budget_ms:
        headers["X-Deadline-Ms"] = str(budget_ms)
    body = {"model": MODEL, "prompt": f"def f_{request_id or session}():\n    ", "max_tokens": 4}
    return requests.post(f"{up.url}/v1/completions", json=body, headers=headers, timeout=10)


def fault_while_waiting(up: Up, caught: list[str], sig: signal.Signals) -> list[requests.Response]:
    """Warm both cells, send `caught` (requests of cell 0, each with a budget of two
    batches and more: what is tested is that they are answered at all, by a move or
    through another cell, not how close to a batch), and once cell 0 holds all of them,
    send `sig` to its broker. Their answers."""
    assert post(up, ids_of_cell(0, 1, "warm0")[0]).status_code == 200
    assert post(up, ids_of_cell(1, 1, "warm1")[0]).status_code == 200
    broker = up.cell_broker(0)
    cell0 = redis.Redis.from_url(up.cell_urls()[0], socket_timeout=2)
    owners = [keys.owner_key(f"{TENANT}:{rid}") for rid in caught]
    with ThreadPoolExecutor(len(caught)) as pool:
        futures = [pool.submit(post, up, rid, None, 2000) for rid in caught]
        deadline = time.monotonic() + 5
        while cell0.exists(*owners) < len(owners) and time.monotonic() < deadline:
            time.sleep(0.005)
        cell0.close()
        broker.send_signal(sig)
        return [f.result() for f in futures]


def test_each_cell_carries_its_own_requests_and_the_fleet_names_every_replicas_cell_and_host() -> None:
    with keybatch_up("--workers", "2", "--models", MODEL, "--cells", "2", "--replicas-per-host", "1") as up:
        assert len(up.cell_urls()) == 2
        for cell in (0, 1):
            for rid in ids_of_cell(cell, 3, "own"):
                answer = post(up, rid)
                assert answer.status_code == 200, answer.text
                assert answer.json()["keybatch"]["cell"] == cell
        env = {**os.environ, "KEYBATCH_PORT": str(up.port)}
        env.pop("KEYBATCH_REDIS_URL", None)
        shown = subprocess.run(
            [sys.executable, "-m", "control", "fleet", "--json"], env=env, capture_output=True, text=True, timeout=30
        )
        assert shown.returncode == 0, shown.stderr
        replicas = json.loads(shown.stdout)["replicas"]
        assert sorted(r["cell"] for r in replicas) == [0, 1]
        # One simulated host each: the registry says it, and so does the name.
        hosts = sorted(r["host"] for r in replicas)
        assert hosts == [f"{socket.gethostname()}-h1", f"{socket.gethostname()}-h2"], hosts
        assert all(r["id"].endswith("@" + r["host"]) for r in replicas), replicas


def test_requests_waiting_in_a_cell_whose_broker_is_killed_are_answered_and_the_cell_comes_back() -> None:
    with keybatch_up("--workers", "2", "--models", MODEL, "--cells", "2") as up:
        caught = ids_of_cell(0, 8, "caught")
        answers = fault_while_waiting(up, caught, signal.SIGKILL)
        assert [a.status_code for a in answers] == [200] * len(caught), [a.text for a in answers]
        # Cell 0's own requests are carried by cell 1 meanwhile, then by cell 0 again.
        later = ids_of_cell(0, 200, "later")
        cells = []
        deadline = time.monotonic() + 20
        for rid in later:
            answer = post(up, rid)
            assert answer.status_code == 200, answer.text
            cells.append(answer.json()["keybatch"]["cell"])
            if cells[-1] == 0 or time.monotonic() > deadline:
                break
        assert cells[-1] == 0, f"cell 0 did not serve again: {cells}"
        assert "keybatch: broker restarted" in up.log()


def test_a_stopped_cell_broker_is_routed_around_and_what_waits_there_moves() -> None:
    with keybatch_up("--workers", "2", "--models", MODEL, "--cells", "2") as up:
        caught = ids_of_cell(0, 6, "stalled")
        broker = up.cell_broker(0)
        try:
            answers = fault_while_waiting(up, caught, signal.SIGSTOP)
            assert [a.status_code for a in answers] == [200] * len(caught), [a.text for a in answers]
            # New requests of the silent cell go to the other one.
            for rid in ids_of_cell(0, 4, "new"):
                answer = post(up, rid)
                assert answer.status_code == 200, answer.text
                assert answer.json()["keybatch"]["cell"] == 1
        finally:
            broker.send_signal(signal.SIGCONT)
