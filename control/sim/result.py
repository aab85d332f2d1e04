"""What a simulated run answers: each request's outcome and times, and their summaries."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from control.core.vocab import FREE, PAID
from control.sim.config import SimConfig
from control.sim.states import OK, STATE_NAMES
from control.sim.workload import Workload


@dataclass
class SimResult:
    config: SimConfig
    workload: Workload
    state: np.ndarray
    start_ms: np.ndarray
    end_ms: np.ndarray
    group: np.ndarray
    stats: dict[str, int]
    batch_sizes: np.ndarray

    def counts(self, mask: np.ndarray | None = None) -> dict[str, int]:
        states = self.state if mask is None else self.state[mask]
        found = np.bincount(states, minlength=len(STATE_NAMES))
        return {name: int(found[k]) for k, name in enumerate(STATE_NAMES) if found[k]}

    @cached_property
    def _ok(self) -> np.ndarray:
        return self.state == OK

    @cached_property
    def _latency_ms(self) -> np.ndarray:
        """Sent to answered, and sent to its batch's start (float32: a summary's percentiles
        over millions of requests read half the memory)."""
        return (self.end_ms - self.workload.t_ms).astype(np.float32)

    @cached_property
    def _queue_ms(self) -> np.ndarray:
        return (self.start_ms - self.workload.t_ms).astype(np.float32)

    def summary(self, network_ms: float = 0.0, mask: np.ndarray | None = None) -> dict[str, Any]:
        """Latency (ms, end to end with the network's round trip) and queueing of the
        requests answered 200, with counts by outcome."""
        ok = self._ok if mask is None else self._ok & mask
        outcomes = self.counts(mask)
        num_ok = outcomes.get("ok", 0)
        num = sum(outcomes.values()) - outcomes.get("cancelled_409", 0)
        out: dict[str, Any] = {"requests": sum(outcomes.values()), "answered_200": num_ok}
        out["answered_200_share"] = round(num_ok / num, 5) if num else 1.0
        out["outcomes"] = outcomes
        if num_ok:
            p50, p99 = np.percentile(self._latency_ms[ok], [50, 99]) + network_ms
            q50, q99 = np.percentile(self._queue_ms[ok], [50, 99])
            out.update(p50_ms=round(float(p50), 1), p99_ms=round(float(p99), 1))
            out.update(queue_p50_ms=round(float(q50), 1), queue_p99_ms=round(float(q99), 1))
        return out

    def by_tier(self, network_ms: float = 0.0) -> dict[str, dict[str, Any]]:
        paid = self.workload.paid
        return {PAID: self.summary(network_ms, paid), FREE: self.summary(network_ms, ~paid)}

    def by_region(self, network_ms: float = 0.0) -> dict[str, dict[str, Any]]:
        num_models = len(self.config.models)
        region = self.group // num_models
        return {str(r): self.summary(network_ms, region == r) for r in range(self.config.regions)}

    def mean_batch(self) -> float:
        return float(self.batch_sizes.mean()) if len(self.batch_sizes) else 0.0
