"""A simulated replica, and a group: one model's queue in one region with its replicas and its admission."""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from dataclasses import replace
from typing import Protocol

from control.core.vocab import FREE, PAID
from control.policy import admission
from control.policy.admission import Capacity, Limits, RateMeter, Verdict
from control.sim.config import SimConfig
from control.sim.continuous import SimEngine
from control.sim.cost import CONTEXT_TOKENS, MEAN_OUTPUT_TOKENS
from tasks.policy.collector import Collector, CollectorConfig, Pending
from tasks.policy.pullgate import PullGate
from tasks.policy.scheduler import ContinuousScheduler, SchedulerConfig

COPY = "h"  # the first character of a hedge copy's id (`Pending.id`); its payload is its request's


def is_copy(pending: Pending) -> bool:
    return pending.id[0] == COPY


class Numbering(Protocol):
    """What numbers the replicas of a run."""

    def next_replica(self) -> int: ...


class SimReplica:
    __slots__ = (
        "index",
        "group",
        "collector",
        "gate",
        "busy",
        "alive",
        "batch",
        "tokens",
        "last_launch",
        "ends_at",
        "engine",
        "gate_at",
        "asked_at",
        "host",
        "ready",
    )

    def __init__(self, index: int, group: Group, config: CollectorConfig, gate: PullGate) -> None:
        self.index = index
        self.group = group
        self.collector = Collector(config)
        self.gate = gate
        self.busy = False
        self.alive = True
        self.batch: list[Pending] = []
        self.tokens = [0, 0, 0]  # per timer kind (launch, end, gate): a bump forgets the one set
        self.last_launch = -1e18
        self.ends_at = 0.0
        self.engine: SimEngine | None = None  # continuous policy only
        self.gate_at = -1.0  # the reopening time a timer was last set for
        self.asked_at = 0.0  # when its consumer's BRPOP was sent
        self.host = ""  # the host it runs on (its group sets it)
        self.ready = True  # in the registry the gateways read (a lost one until it is swept)

    def held(self) -> list[Pending]:
        """What a sweep finds in its held hash: the batch or the engine's requests, and the buffer."""
        running = list(self.engine.pendings.values()) if self.engine else self.batch
        return running + self.collector.waiting


class Group:
    """One model's queue in one region, its replicas and its admission."""

    def __init__(self, index: int, region: int, model: int, config: SimConfig, sim: Numbering) -> None:
        self.index = index
        self.region = region
        self.model = model
        self.cost = config.costs.get(config.models[model])
        self.continuous = config.policy == "continuous"
        self.batch_ms = self.cost.expected_batch_ms(config.max_batch) if self.cost else config.batch_ms
        if self.cost and self.continuous:  # join to finish of a typical request at full load
            self.batch_ms = self.cost.prefill_ms_for(300) + MEAN_OUTPUT_TOKENS * self.cost.step_ms(
                config.max_batch, CONTEXT_TOKENS
            )
        # as `tasks.lm.engine.HFEngine` builds it: a step computes a decode for every slot and one chunk
        self.scheduler_config = SchedulerConfig(
            max_slots=config.max_batch, token_budget=config.max_batch + SchedulerConfig.prefill_chunk
        )
        self.collector_config = CollectorConfig(
            max_batch=config.max_batch,
            max_wait_ms=config.max_wait_ms,
            batch_ms=self.batch_ms,
            margin_ms=config.margin_ms,
        )
        # A replica's pull gate: max batch, lead, and PULL_EARLY and LEAD_YIELDS as played.
        self.gate_config = (
            config.max_batch,
            config.pull_lead_ms,
            config.pull_early,
            config.concentrate_idle and config.lead_yields,
        )
        self.replicas = [
            SimReplica(sim.next_replica(), self, self.collector_config, self.new_gate())
            for _ in range(config.replicas[model])
        ]
        for k, replica in enumerate(self.replicas):
            replica.engine = self.new_engine()
            replica.host = f"{index}.{k // config.host_size}"
        # Requests this group's replicas run or hold buffered, free and paid, sorted: (deadline,
        # request, host), what a batch with slots to spare may carry a copy of
        # (tasks/policy/hedging.py); kept only where hedging is on. One that left a buffer
        # unrun (dropped, cancelled) stays until a scan passes its deadline.
        self.hedging = config.hedge != "off"
        # Where a request joins that list: as a replica takes it into its buffer, or (the
        # earlier rule, `hedge_buffered` off) as its batch starts.
        self.list_taken = self.hedging and config.hedge_buffered
        self.list_started = self.hedging and not config.hedge_buffered
        self.lapses_at: dict[str, float] = {}  # a lost host: when its replicas' leases lapse
        self.held_by: tuple[list[tuple[float, int, str]], list[tuple[float, int, str]]] = ([], [])
        self.paid_queue: deque[int] = deque()
        self.free_queue: deque[int] = deque()
        self.num_waiting = [0, 0]  # free, paid: the waiting sets admission counts
        self.blocked: deque[SimReplica] = deque(self.replicas)  # consumers in BRPOP, first asked first
        self.gatherer: SimReplica | None = None  # the idle replica that took a first request last
        self.limits = Limits(config.max_queue_paid, config.max_queue_free, config.margin_ms)
        self.paid_meter = RateMeter()
        self.demand_meter = RateMeter()  # every arrival, where admission counts phases
        self.alive = True
        self.num_ready = len(self.replicas)
        self.verdict = Verdict.ADMIT
        self.deepest = (0, 0)
        self.deepest_at = -1e18  # with phases, moved back so that the next start foreseen is due too
        # Where static replicas' starts are read (ADMIT_PHASED), when each starts next, read
        # again every `launch_refresh_ms`, as a gateway reads the launch list.
        self.admit_phased = config.admit_phased and not self.continuous
        self.bump = config.admit_bump and not self.continuous  # `SimConfig.admit_bump`
        # ADMIT_OPEN: the requests asked per second, as gateways count them in the broker
        self.asked = admission.SecondCounts() if config.admit_open and not self.continuous else None
        self.open_gate = admission.OpenGate()  # worked out every `OPEN_REFRESH_MS`, as a gateway's
        self.open_deepest = (0, 0)
        self.launch_refresh_ms = config.launch_refresh_ms
        self.refresh_ms = config.admission_refresh_ms
        # `Capacity.cycle_ms`: the cycle a replica measures, with jitter the batch's mean
        jitter = config.batch_jitter_ms if self.cost is None else 0.0
        self.measured_ms = self.batch_ms + jitter / 2 if jitter > 0 else 0.0
        self.phases: admission.Phases | None = None
        self.phases_at = -1e18

    def new_gate(self) -> PullGate:
        """A replica's pull gate, as this run's settings make it."""
        max_batch, lead_ms, early, lead_yields = self.gate_config
        return PullGate(max_batch, lead_ms, early=early, lead_yields=lead_yields)

    def new_engine(self) -> SimEngine | None:
        if not self.continuous or self.cost is None:
            return None
        return SimEngine(ContinuousScheduler(self.scheduler_config), self.cost)

    def held(self, pending: Pending, paid: int, host: str) -> None:
        """A replica on `host` holds it (`list_taken`, `list_started`): a request to copy."""
        insort(self.held_by[paid], (pending.deadline_ms, pending.payload, host))

    def stopped(self, pending: Pending, paid: int) -> None:
        """It ended, went back to the queue or its replica was lost: no longer a request to copy."""
        if self.hedging:
            held = self.held_by[paid]
            at = bisect_left(held, (pending.deadline_ms, pending.payload, ""))
            if at < len(held) and held[at][1] == pending.payload:
                del held[at]

    def capacity(self, now: float | None = None, budget_ms: float = 0.0) -> Capacity:
        """What admission sees; at `now`, with the replicas' phases where they are read."""
        # As live, the measured cycle paces the slots (with jitter, longer than the batch).
        capacity = Capacity(self.num_ready, self.collector_config.max_batch, self.batch_ms, self.measured_ms)
        if not self.admit_phased or now is None:
            return capacity
        if now - self.phases_at >= self.launch_refresh_ms or self.phases is None:
            launches = [r.last_launch for r in self.replicas if r.ready]
            horizon = budget_ms + self.launch_refresh_ms + self.batch_ms
            self.phases = admission.phases_of(launches, now, capacity.slot_ms, horizon)
            self.phases_at = now
        return replace(capacity, phases=self.phases)

    def refresh_deepest(self, now: float, budget_ms: float) -> None:
        """The verdict before the queue and the (free, paid) deepest admissible positions,
        worked out again every `admission_refresh_ms` (a gateway's view of the fleet is
        250 ms old anyway, of the launches 50 ms), and with phases at the next start foreseen
        too (a gateway works them out per request)."""
        capacity = self.capacity(now, budget_ms)
        rate = self.paid_meter.rate(now)
        demand = self.demand_meter.rate(now) if self.admit_phased else None
        self.verdict = admission.check(budget_ms, capacity, self.limits)
        self.deepest = (
            (
                admission.max_position(FREE, budget_ms, capacity, self.limits, rate, now, demand, self.bump),
                admission.max_position(PAID, budget_ms, capacity, self.limits, rate, now, demand, self.bump),
            )
            if self.verdict == Verdict.ADMIT
            else (0, 0)
        )
        if self.asked is not None and self.verdict == Verdict.ADMIT:
            self.open_deepest = (
                admission.open_position(FREE, budget_ms, capacity, self.limits, rate),
                admission.open_position(PAID, budget_ms, capacity, self.limits),
            )
        self.deepest_at = now
        if capacity.phases is not None:
            starts = capacity.phases.starts_ms
            first = bisect_right(starts, now)  # the next start: the count changes when it is due
            if first < len(starts):
                self.deepest_at = min(now, starts[first] - self.refresh_ms)


# -- the simulation ---------------------------------------------------------------------------
