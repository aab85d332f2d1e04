"""A simulation's state and plumbing: the per-request arrays, the groups, the event heap and its timers."""

from __future__ import annotations

import heapq
from array import array
from typing import Any

import numpy as np

from control.sim.config import SimConfig
from control.sim.group import Group, SimReplica
from control.sim.workload import Workload

# Event kinds.
LAUNCH, END, GATE, HOST_DOWN, SWEEP, HOST_UP, REGION_DOWN, CELL_DOWN, LOOK, RESCUE = range(10)


class SimState:
    """A run's state (per-request arrays, groups, event heap) and its timers.

    `arrivals`: the first so many requests arrive at their time; the rest only as
    `resend`s (time, request): sent again to this run after their region was lost in
    another (control/sim/split.py). A region lost with no other region here hands what it
    held to `handed_off` instead."""

    def __init__(
        self,
        config: SimConfig,
        workload: Workload,
        *,
        arrivals: int | None = None,
        resend: list[tuple[float, int]] | None = None,
        region_loss_ms: float | None = None,
    ) -> None:
        self.config = config
        self.workload = workload
        n = len(workload)
        self.num_arrivals = n if arrivals is None else arrivals
        self.t = array("d", workload.t_ms.tobytes())
        self.paid = bytearray(workload.paid.astype(np.uint8).tobytes())
        self.prev = array("i", workload.prev.astype(np.int32).tobytes())
        self.state = bytearray(n)
        self.start_ms = array("d", bytes(8 * n))
        self.end_ms = array("d", bytes(8 * n))
        self.group_of = array("h", (workload.region.astype(np.int16) * len(config.models) + workload.model).tobytes())
        self.deadline = array("d", (workload.t_ms + config.budget_ms).tobytes())
        self.resent_ids: set[int] = set()  # sent again after a region loss
        self._num_replicas = 0
        self.groups = [
            Group(r * len(config.models) + m, r, m, config, self)
            for r in range(config.regions)
            for m in range(len(config.models))
        ]
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self._seq = 0
        self.now = 0.0
        self.requeues: dict[int, int] = {}
        self.hedges: dict[int, SimReplica] = {}  # request -> the replica running its copy
        self.died_at: dict[int, float] = {}  # a lost replica (by index): when it stopped
        self.looking: set[int] = set()  # replicas (by index) with a look for copies due (HEDGE_IDLE)
        # Idle replicas look for copies until the last request can no longer be running.
        last = max(float(workload.t_ms[-1]) if n else 0.0, max((at for at, _ in resend or []), default=0.0))
        self.looks_until = last + config.budget_ms
        # At a host loss, what its replicas were running (their own requests) and held buffered.
        self.lost_running: set[int] = set()
        self.lost_buffered: set[int] = set()
        self.resent: list[tuple[float, int]] = sorted(resend or [])  # heap: (time, request) sent again
        self.resent_ids.update(j for _, j in self.resent)
        # Sent on after their region was lost: a peer's replicas gather them (`SimConfig.stranded`).
        self.stranded_ids: set[int] = set(self.resent_ids) if config.stranded else set()
        self.handed_off: list[tuple[float, int]] = []
        counted: tuple[str, ...] = ("batches", "batch_rows", "wasted", "requeued", "resent", "moved", "events")
        counted += ("taken_shut", "rest_handed_back", "hedged", "hedge_wins", "hedge_wasted", "bumped")
        counted += ("idle_copy_batches", "idle_copies", "taken_lost", "rescued")
        self.stats = dict.fromkeys(counted, 0)
        self.batch_sizes: list[int] = []
        rng = np.random.default_rng(12345)
        self._alt = rng.random(4096).tolist()
        self._alt_i = 0
        if config.host_loss_at_s is not None:
            self._push(config.host_loss_at_s * 1000.0, HOST_DOWN, None, 0)
        if region_loss_ms is None and config.region_loss_at_s is not None:
            region_loss_ms = config.region_loss_at_s * 1000.0
        if region_loss_ms is not None:
            self._push(region_loss_ms, REGION_DOWN, None, 0)
        if config.cell_loss_at_s is not None:
            self._push(config.cell_loss_at_s * 1000.0, CELL_DOWN, None, 0)

    def next_replica(self) -> int:
        self._num_replicas += 1
        return self._num_replicas - 1

    # -- plumbing --

    def _push(self, at: float, kind: int, who: Any, token: int) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (at, self._seq, kind, who, token))

    def _timer(self, replica: SimReplica, kind: int, at: float) -> None:
        """Set the replica's one timer of this kind (forgetting the one set before)."""
        replica.tokens[kind] += 1
        self._push(at, kind, replica, replica.tokens[kind])

    def _random(self) -> float:
        self._alt_i = (self._alt_i + 1) % len(self._alt)
        return self._alt[self._alt_i]
