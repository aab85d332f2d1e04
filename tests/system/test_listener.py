"""SINGLE_LISTENER on a real deployment: idle replicas leave a burst to the one that holds
the listener token, instead of sharing it out in small batches that start together."""

from __future__ import annotations

import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from control.broker import keys
from tests.support.deploy import MODEL, Deployment, deployment, replica_for, stop_after_its_pull
from tests.support.waiting import until

BURST = 8
# The holder gathers for max_wait: 100 ms, not the default 20, so that the 8 requests of a
# burst, sent from 8 threads, reach it within its gather on a slow machine too.
BURST_WAIT_MS = 100


def _burst(kb: Deployment, state: redis.Redis, single: bool) -> list[int]:
    """Batch sizes of a burst sent while every replica is idle (with the listener token
    held: one idle replica waits on the queue)."""
    if single:
        assert until(lambda: state.get(keys.listener_key(MODEL)) is not None, 5, 0.005)
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda i: kb.post({"model": MODEL, "prompt": f"b{i}", "max_tokens": 4}), range(BURST)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    sizes: dict[str, int] = {}
    for a in answers:
        meta = a.json()["keybatch"]
        sizes[meta["replica"]] = meta["batch_size"]
    return sorted(sizes.values(), reverse=True)


def _holder(kb: Deployment, state: redis.Redis) -> tuple[str, subprocess.Popen[bytes]]:
    """The replica that holds the model's listener token once one does, and its process."""
    assert until(lambda: state.get(keys.listener_key(MODEL)) is not None, 5, 0.005)
    holder = state.get(keys.listener_key(MODEL))
    assert holder is not None
    return holder.decode(), next(w for w in kb.system.workers if replica_for(kb, w.pid) == holder.decode())


def _deaths(state: redis.Redis) -> int:
    return int(state.get(keys.DEATHS_KEY) or 0)


@pytest.mark.parametrize("single", [True, False], ids=["single-listener", "every-idle-replica"])
def test_a_burst_on_idle_replicas_goes_to_the_one_that_listens(single: bool) -> None:
    settings = {"max_batch": "16", "hedge": "off", "max_wait_ms": str(BURST_WAIT_MS)}
    with deployment(workers=4, single_listener=str(single).lower(), **settings) as kb:
        state = redis.Redis.from_url(kb.system.redis_url)
        bursts = [_burst(kb, state, single) for _ in range(3)]
    largest = [sizes[0] for sizes in bursts]
    if single:
        # The holder gathers the burst for max_wait: most of it, or all, rides its batch.
        assert min(largest) >= BURST // 2 + 1, bursts
    else:
        # Four idle replicas share the burst in turn: none gets more than half of it.
        assert max(largest) <= BURST // 2, bursts


def test_a_listener_that_stops_without_a_word_loses_its_turn_to_another_idle_replica() -> None:
    """The token's holder is stopped (SIGSTOP: no exit, no signal to anyone): its token
    lapses, another idle replica takes it, and requests are answered by the others. Its
    outstanding pull may take one request with it, which comes back once its lease
    lapses (the failover tests), so the deadline here is generous."""
    with deployment(workers=3, max_batch="16", hedge="off", single_listener="true") as kb:
        state = redis.Redis.from_url(kb.system.redis_url)
        holder, victim = _holder(kb, state)
        victim.send_signal(signal.SIGSTOP)
        try:
            # Another idle replica holds the token once the stopped one's lapses (150 ms).
            assert until(lambda: state.get(keys.listener_key(MODEL)) not in (None, holder.encode()), 3, 0.005)
            with ThreadPoolExecutor(6) as pool:
                answers = list(
                    pool.map(
                        lambda i: kb.post({"model": MODEL, "prompt": f"s{i}"}, **{"X-Deadline-Ms": "10000"}), range(6)
                    )
                )
        finally:
            victim.send_signal(signal.SIGKILL)
            victim.wait(5)
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers if a.status_code != 200]
        assert holder not in {a.json()["keybatch"]["replica"] for a in answers}


def test_what_a_stopped_listener_took_comes_back_when_its_pulse_lapses() -> None:
    """The holder is stopped while it waits on the queue: its pull, already sent, takes the
    next arrival with it, which it will never record. Its token lapses (80 ms) and another
    replica listens; its pulse lapses (100 ms), not a lease later (300 ms and a sweep), and
    the gateway puts the request back in line: it is answered within the default budget
    (600 ms)."""
    with deployment(workers=3, max_batch="16", hedge="off", single_listener="true") as kb:
        state = redis.Redis.from_url(kb.system.redis_url)
        holder, victim = _holder(kb, state)
        deaths = _deaths(state)
        victim.send_signal(signal.SIGSTOP)
        try:
            answer = kb.post({"model": MODEL, "prompt": "taken"})
        finally:
            victim.send_signal(signal.SIGKILL)
            victim.wait(5)
        assert answer.status_code == 200, answer.text
        meta = answer.json()["keybatch"]
        assert meta["replica"] != holder
        assert _deaths(state) > deaths  # the lapse was seen


def test_a_stopped_listeners_last_pull_is_gone_before_the_next_arrival() -> None:
    """The holder is stopped right after it sent a pull (BRPOP), so that pull is out for
    its whole wait on the broker. A request sent 0.3 s after the gateway saw the holder's
    pulse lapse goes to the replica that listens now: the stopped pull has timed out
    (`PULL_WAIT_S`, and a broker tick), and only the new holder's is out. With kombu's
    default wait (1 s) the stopped pull would still be out, first in line, and would take
    the request after the rescue rounds had run."""
    with deployment(workers=2, max_batch="16", hedge="off", single_listener="true") as kb:
        state = redis.Redis.from_url(kb.system.redis_url)
        holder, victim = _holder(kb, state)
        deaths = _deaths(state)
        stop_after_its_pull(kb, victim)
        try:
            assert until(lambda: _deaths(state) > deaths, 3, 0.005)
            time.sleep(0.3)  # the arrival's moment, not a wait for a mechanism
            pulls = [c for c in state.client_list() if c.get("cmd") == "brpop" and "b" in c.get("flags", "")]
            assert len(pulls) <= 1, pulls  # the new holder's, if it is between two
            answer = kb.post({"model": MODEL, "prompt": "after the lapse"})
        finally:
            victim.send_signal(signal.SIGKILL)
            victim.wait(5)
        assert answer.status_code == 200, answer.text
        assert answer.json()["keybatch"]["replica"] != holder
