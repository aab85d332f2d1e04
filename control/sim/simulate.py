"""A discrete-event simulation of the fleet on a virtual clock, running the live policy code.

What runs here is what the replicas and gateways run: `tasks.collector.Collector` forms
every batch (paid first, deadline pull-in, `stagger_from`), `tasks.pullgate.PullGate`
decides every pull from a model's shared queue, and `control.admission` answers every
admission (429 when the predicted wait does not fit the budget). The simulator only
plays the parts Redis and Celery play: the queue (paid list and free list, consumers
blocked in the order they asked), the waiting set admission counts, cancel flags, the
held hashes a sweep re-queues, and the clock.

One group is one model's queue in one region, with its replicas. Regions share nothing,
so groups only meet when a region is lost (what it held is sent again to the others).

Time is the event heap's (heapq): each replica has at most one live timer (a launch, a
batch end, a gate reopening); stale timers are skipped by a token. Per-request state
lives in compact arrays (`array.array`), arrivals are drawn with numpy in one go, and a
request becomes a Python object (`Pending`) only while it sits in a replica's buffer.
docs/decisions/0013-simulator.md says why, with figures.
control/sim/events.py holds the state and the timers, control/sim/replica.py, gateway.py and
faults.py the parts played, this module the loop.
"""

from __future__ import annotations

import gc
import heapq
import math
from typing import Any

import numpy as np

from control.sim.config import SimConfig
from control.sim.events import CELL_DOWN, END, GATE, HOST_DOWN, HOST_UP, LAUNCH, LOOK, REGION_DOWN, RESCUE, SWEEP
from control.sim.faults import FaultSide
from control.sim.group import SimReplica
from control.sim.result import SimResult
from control.sim.states import EXPIRED, WAITING
from control.sim.workload import Workload


class Simulation(FaultSide):
    """A run: arrivals, timers and faults in time order, to the end."""

    def run(self) -> SimResult:
        """Run to the end. The cyclic garbage collector is off meanwhile: the run makes no
        cycles, and its passes over millions of short-lived objects would only cost time
        (docs/decisions/0013 has how much)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if enabled:
                gc.enable()

    def _run(self) -> SimResult:
        for group in self.groups:  # HEDGE_IDLE: every replica is idle as the run starts
            for replica in group.replicas:
                self._next_look(replica, first=True)
        t, n = self.t, self.num_arrivals
        heap = self.heap
        i = 0
        expire_i = 0  # the gateway answers 504 at a deadline: requests in order of sending
        budget = self.config.budget_ms
        inf = math.inf
        while True:
            next_arrival = t[i] if i < n else inf
            next_resent = self.resent[0][0] if self.resent else inf
            next_event = heap[0][0] if heap else inf
            now = min(next_arrival, next_resent, next_event)
            if now == inf:
                break
            self.now = now
            while expire_i < i and t[expire_i] + budget <= now:
                self._expire(expire_i)
                expire_i += 1
            if next_event == now:
                at, _, kind, who, token = heapq.heappop(heap)
                self.stats["events"] += 1
                self._event(kind, who, token)
            elif next_resent == now:
                _, j = heapq.heappop(self.resent)
                self._arrive(j, resent=True)
            else:  # arrivals up to the next timer, in one go
                until = min(next_resent, heap[0][0] if heap else inf)
                arrive = self._arrive
                while i < n and t[i] < until:
                    self.now = t[i]
                    arrive(i)
                    i += 1
                    if heap and heap[0][0] < until:  # an arrival set an earlier timer
                        until = min(until, heap[0][0])
        return self._result()

    def _expire(self, j: int) -> None:
        """Its deadline passed while it waited: the gateway answered 504 and took it out of
        the waiting set; the replica holding it drops it before its batch."""
        if self.state[j] == WAITING and j not in self.resent_ids:
            self.state[j] = EXPIRED
            self.groups[self.group_of[j]].num_waiting[self.paid[j]] -= 1

    def _event(self, kind: int, who: Any, token: int) -> None:
        if kind in (LAUNCH, END, GATE):
            replica: SimReplica = who
            if not replica.alive or token != replica.tokens[kind]:
                return
            if kind == END:
                if replica.engine is not None:
                    self._cycle(replica, stepped=True)
                else:
                    self._end(replica)
            elif kind == LAUNCH:
                self._try_launch(replica)
            else:
                self._gate_timer(replica)
        elif kind == LOOK:
            self._look(who)
        elif kind == RESCUE:
            self._rescue(who, token)
        elif kind == HOST_DOWN:
            self._host_down()
        elif kind == SWEEP:
            self._sweep(who)
        elif kind == HOST_UP:
            self._host_up(who)
        elif kind == REGION_DOWN:
            self._region_down(0)
        elif kind == CELL_DOWN:
            self._cell_down(0)

    def _result(self) -> SimResult:
        state = np.frombuffer(bytes(self.state), dtype=np.uint8)
        # a request sent again after a region loss can only expire once it arrived; count its end here
        return SimResult(
            config=self.config,
            workload=self.workload,
            state=state,
            start_ms=np.frombuffer(self.start_ms, dtype=np.float64),
            end_ms=np.frombuffer(self.end_ms, dtype=np.float64),
            group=np.frombuffer(self.group_of, dtype=np.int16),
            stats=dict(self.stats),
            batch_sizes=np.asarray(self.batch_sizes, dtype=np.int32),
        )


def simulate(config: SimConfig, workload: Workload) -> SimResult:
    return Simulation(config, workload).run()
