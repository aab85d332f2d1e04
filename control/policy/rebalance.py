"""Which model each replica should serve: a pure policy over a snapshot of the fleet.

Policy layer: no Celery, Redis or torch; time comes from the clock it is given. It
takes the replicas that serve each model and each model's demand (arrival rate, the
paid part of it, the age of its oldest queued request) and returns decisions, each
with its reason. It moves at most one replica per call, and only:
- from a model that keeps `min_per_model` replicas and enough for its paid traffic
  (`paid_floor`) after giving one up, and that has more than its demand needs;
- to a model short of replicas for `hold_ms` in a row (hysteresis: a burst shorter than
  that moves nothing), and not within `cooldown_ms` of the last move;
- while no replica is draining or moving (one move at a time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from control.core.clock import Clock
from control.core.lifecycle import ReplicaState


@dataclass(frozen=True)
class ReplicaSlot:
    name: str
    model: str
    state: ReplicaState | None
    capacity_rps: float  # requests a second it serves when full: max_batch / batch time


@dataclass(frozen=True)
class ModelDemand:
    model: str
    arrival_rate: float  # requests a second, both tiers
    paid_rate: float = 0.0
    oldest_ms: float = 0.0  # age of the oldest queued request


@dataclass(frozen=True)
class Snapshot:
    replicas: list[ReplicaSlot]
    demand: dict[str, ModelDemand]


@dataclass(frozen=True)
class Decision:
    """A move (`replica` from `from_model` to `to_model`), or a hold (`replica` empty)."""

    reason: str
    replica: str = ""
    from_model: str = ""
    to_model: str = ""

    @property
    def is_move(self) -> bool:
        return bool(self.replica)


@dataclass
class RebalanceConfig:
    min_per_model: int = 1
    target_utilization: float = 0.7  # replicas are planned to run this full at the current rate
    paid_headroom: float = 1.5  # a model keeps replicas for its paid rate times this, even at full load
    queue_pressure_ms: float = 300.0  # an oldest queued request this old asks for one more replica
    hold_ms: float = 10_000.0
    cooldown_ms: float = 30_000.0

    def __post_init__(self) -> None:
        if self.min_per_model < 1:
            raise ValueError("min_per_model must be at least 1: a model without a replica answers 503")
        if not 0.0 < self.target_utilization <= 1.0:
            raise ValueError("target_utilization must be in (0, 1]")


@dataclass
class RebalancePolicy:
    config: RebalanceConfig
    clock: Clock
    _short_since: dict[str, float] = field(default_factory=dict)  # model -> when it became short
    _last_move_ms: float | None = None

    def decide(self, snap: Snapshot) -> list[Decision]:
        now = self.clock.now_ms()
        serving: dict[str, list[ReplicaSlot]] = {m: [] for m in snap.demand}
        for r in snap.replicas:
            if r.state == ReplicaState.SERVING and r.model in serving:
                serving[r.model].append(r)
        unit = self._capacity_per_replica(snap)
        wants = {m: self.wanted(d, unit[m]) for m, d in snap.demand.items()}
        floors = {m: self.floor(d, unit[m]) for m, d in snap.demand.items()}
        short = {m: wants[m] - len(serving[m]) for m in snap.demand if wants[m] > len(serving[m])}
        for m in list(self._short_since):
            if m not in short:
                del self._short_since[m]
        for m in short:
            self._short_since.setdefault(m, now)
        if not short:
            return [Decision("every model has the replicas its demand needs")]
        busy = [r for r in snap.replicas if r.state in (ReplicaState.DRAINING, ReplicaState.MOVING)]
        if busy:
            return [Decision(f"waiting: {busy[0].name} is {busy[0].state.label if busy[0].state else '?'}")]
        if self._last_move_ms is not None and now - self._last_move_ms < self.config.cooldown_ms:
            left = (self.config.cooldown_ms - (now - self._last_move_ms)) / 1000
            return [Decision(f"cooling down: {left:.0f} s since the last move to go")]
        # The neediest first: a paid shortfall, then the largest one.
        order = sorted(short, key=lambda m: (len(serving[m]) >= floors[m], -short[m], m))
        for target in order:
            held_ms = now - self._short_since[target]
            if held_ms < self.config.hold_ms:
                continue
            donor = self._donor(serving, wants, floors, exclude=target)
            if donor is None:
                continue
            slot = sorted(serving[donor], key=lambda r: r.name)[-1]
            self._last_move_ms = now
            self._short_since.pop(target, None)
            need = self._need(snap.demand[target], wants[target], len(serving[target]))
            spare = self._need(snap.demand[donor], wants[donor], len(serving[donor]))
            reason = f"{target}: {need} for {held_ms / 1000:.0f} s; {donor}: {spare}"
            return [Decision(reason, slot.name, donor, target)]
        m = order[0]
        if now - self._short_since[m] < self.config.hold_ms:
            why = f"short for {(now - self._short_since[m]) / 1000:.0f} s of {self.config.hold_ms / 1000:.0f}"
        else:
            why = "no model can spare a replica"
        return [Decision(f"holding: {m}: {self._need(snap.demand[m], wants[m], len(serving[m]))}; {why}")]

    def wanted(self, d: ModelDemand, capacity_rps: float) -> int:
        """Replicas for the demand at the target utilization, one more under queue pressure."""
        by_rate = math.ceil(d.arrival_rate / (capacity_rps * self.config.target_utilization)) if capacity_rps else 0
        pressure = 1 if d.oldest_ms > self.config.queue_pressure_ms else 0
        return max(self.floor(d, capacity_rps), by_rate + pressure)

    def floor(self, d: ModelDemand, capacity_rps: float) -> int:
        """What a model never goes below: the minimum, and its paid traffic with headroom."""
        paid = math.ceil(d.paid_rate * self.config.paid_headroom / capacity_rps) if capacity_rps else 0
        return max(self.config.min_per_model, paid)

    def _donor(
        self, serving: dict[str, list[ReplicaSlot]], wants: dict[str, int], floors: dict[str, int], exclude: str
    ) -> str | None:
        """The model with the most replicas beyond its needs, if one can give one up."""
        spare = {
            m: len(reps) - max(wants[m], floors[m])
            for m, reps in serving.items()
            if m != exclude and len(reps) - 1 >= max(wants[m], floors[m])
        }
        return max(sorted(spare), key=lambda m: spare[m]) if spare else None

    @staticmethod
    def _capacity_per_replica(snap: Snapshot) -> dict[str, float]:
        """A model's capacity per replica, from its replicas (the fleet's mean if it has none)."""
        known = [r.capacity_rps for r in snap.replicas if r.capacity_rps > 0]
        fallback = sum(known) / len(known) if known else 0.0
        out = {}
        for m in snap.demand:
            caps = [r.capacity_rps for r in snap.replicas if r.model == m and r.capacity_rps > 0]
            out[m] = min(caps) if caps else fallback
        return out

    @staticmethod
    def _need(d: ModelDemand, want: int, have: int) -> str:
        return (
            f"{d.arrival_rate:.1f} req/s ({d.paid_rate:.1f} paid), oldest queued {d.oldest_ms:.0f} ms: "
            f"wants {want}, has {have}"
        )
