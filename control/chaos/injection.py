"""A fault as injected (`Injection`) and what a fault needs to inject itself (`Run`)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from control.bench.harness import Deployment
from control.chaos.spec import ChaosSpec


@dataclass
class Injection:
    at_s: float  # seconds since the load started, when the signal went out
    action: str
    targets: list[str] = field(default_factory=list)
    ended_s: float | None = None  # a pause: when it was lifted
    note: str = ""
    requeue_ms: float | None = None  # replica faults: until what it held was back in the queue
    recover_s: float | None = None  # filled in by the analysis
    cell: int | None = None  # cell-loss: the cell whose broker it was


@dataclass
class Run:
    """What a fault needs: the deployments, a seeded choice, and the load's clock."""

    spec: ChaosSpec
    deployments: list[Deployment]
    origin: float  # time.perf_counter() of the load's second 0
    batch_ms: float
    rng: random.Random
    injections: list[Injection] = field(default_factory=list)
    slowloris: dict[str, object] | None = None
    idle: dict[str, object] | None = None

    @property
    def target(self) -> Deployment:
        return self.deployments[0]

    def now_s(self) -> float:
        return time.perf_counter() - self.origin

    async def sleep_until(self, at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - self.now_s()))
