"""One saturated replica, for `keybatch bench cycle`: run as a script in a child process
with the checkout under test first on the path, so it times that checkout's loop.

A real embedded Valkey, the fixed backend, no Celery and no gateway: requests are put
straight into the replica's buffer, always more than a batch, so the engine never waits
for work, only (if at all) for the loop around it. Prints one JSON line: the batches' (or
steps') start-to-start time, their own time, and the duty cycle (engine busy over wall).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import redis

from control.broker import keys
from control.core import protocol as p
from control.core.clock import BrokerClock
from control.fleet.valkey import EmbeddedBroker
from tasks.engine.fixed import FixedLatencyEngine
from tasks.policy.collector import CollectorConfig
from tasks.replica.config import ReplicaConfig
from tasks.replica.replica import Replica

MODEL = "small"
SKIP = 5  # the first batches (or steps) warm up


def main(policy: str, seconds: float, max_batch: int, batch_ms: float) -> dict:
    continuous = policy == "continuous"
    with EmbeddedBroker() as broker:
        state = redis.Redis.from_url(broker.url)
        engine = FixedLatencyEngine(max_batch=max_batch, batch_ms=batch_ms, continuous=continuous)
        clock = BrokerClock(state)
        config = CollectorConfig(max_batch=max_batch, max_wait_ms=20.0, batch_ms=batch_ms)
        replica = Replica(ReplicaConfig("cycle", MODEL, config, lease_ms=2000.0, stall_ms=5000.0), engine, state, clock)
        replica.start()
        n = 0
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            if len(replica.collector) < max_batch + max_batch // 2:
                now = clock.now_ms()
                for _ in range(max(1, max_batch // 4)):
                    rid = f"c{n}"
                    state.set(keys.owner_key(f"t:{rid}"), f"gw|{keys.waiting_key(MODEL, 'free')}|t|{rid}", px=60_000)
                    job = p.Job(
                        id=rid, key=f"t:{rid}", model=MODEL, prompt=f"p{n}", gateway="gw", received_ms=now,
                        deadline_ms=now + 60_000,
                    )  # fmt: skip
                    replica.submit(job)
                    n += 1
            time.sleep(0.002)
        runs = list(replica.perf.runs)[SKIP:]
        served = replica.stats.num_requests
        replica.stop()
    starts = [s for s, _e in runs]
    apart = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    busy = sum(e - s for s, e in runs)
    wall = runs[-1][1] - runs[0][0] if len(runs) > 1 else 0.0
    return {
        "policy": policy,
        "max_batch": max_batch,
        "batch_ms": batch_ms,
        "seconds": seconds,
        "runs": len(runs),
        "served": served,
        "start_to_start_ms": round(statistics.median(apart), 2) if apart else 0.0,
        "run_ms": round(statistics.median(e - s for s, e in runs), 2) if runs else 0.0,
        "duty_cycle": round(busy / wall, 4) if wall else 0.0,
        "served_per_s": round(served / seconds, 1),
    }


if __name__ == "__main__":
    policy, seconds, max_batch, batch_ms = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    print(json.dumps(main(policy, seconds, max_batch, batch_ms)), flush=True)
