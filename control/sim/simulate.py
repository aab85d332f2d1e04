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
"""

from __future__ import annotations

import gc
import heapq
import json
import math
from array import array
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from control.core.vocab import ARRIVALS, FREE, MAX_TOKENS, MIN_TOKENS, PAID, ArrivalProfile, Tier
from control.load.arrivals import FlatRate, rate_profile, typing_sessions
from control.policy import admission
from control.policy.admission import Capacity, Limits, RateMeter, Verdict
from tasks.policy.collector import Collector, CollectorConfig, Pending
from tasks.policy.pullgate import PullGate
from tasks.policy.scheduler import ContinuousScheduler, RunningRequest, SchedulerConfig, SchedulerOutput, WaitingRequest

# Request states (one byte each). The finished states come last.
NEW, WAITING, RUNNING, OK, REFUSED, EXPIRED, CANCELLED, LATE, LOST = range(9)
STATE_NAMES = ("new", "waiting", "running", "ok", "refused_429", "expired_504", "cancelled_409", "late_504", "lost")
PROFILES = ARRIVALS  # the arrival shapes a workload can have

_TIERS: tuple[Tier, Tier] = (FREE, PAID)  # indexed by a request's paid flag

BRPOP_TIMEOUT_MS = 1000.0  # kombu's Redis transport: a BRPOP returns empty after this long
_ADMIT = Verdict.ADMIT  # looked up once: an enum member's lookup is on the hot path

# Event kinds.
_LAUNCH, _END, _GATE, _HOST_DOWN, _SWEEP, _HOST_UP, _REGION_DOWN = range(7)


# -- cost ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """A batch's time from the engine's measured curve (`keybatch bench engine`'s JSON):
    decode step time by context and batch size, prefill time by prompt tokens."""

    decode_ms: dict[int, dict[int, float]]  # context tokens -> batch size -> ms per step
    prefill_ms: dict[int, float]  # prompt tokens -> ms for one request's prefill
    name: str = ""
    step_overhead_ms: float = 0.0  # a step's work besides its forwards (scheduling, sampling)

    @classmethod
    def from_file(cls, path: str | Path) -> CostModel:
        data = json.loads(Path(path).read_text())
        try:
            decode = {int(c): {int(b): float(ms) for b, ms in row.items()} for c, row in data["decode_ms"].items()}
            prefill = {int(t): float(ms) for t, ms in data["prefill_ms"].items()}
        except (KeyError, AttributeError, ValueError) as exc:
            raise ValueError(f"{path}: not an engine curve (decode_ms, prefill_ms): {exc}") from exc
        if not decode or not prefill:
            raise ValueError(f"{path}: empty decode_ms or prefill_ms")
        name = data.get("model", {})
        name = name.get("name", Path(path).stem) if isinstance(name, dict) else str(name)
        return cls(decode, prefill, str(name), float(data.get("step_overhead_ms", 0.0)))

    def as_json(self) -> dict[str, Any]:
        """What `from_file` reads."""
        return {
            "model": {"name": self.name},
            "decode_ms": {str(c): {str(b): ms for b, ms in row.items()} for c, row in self.decode_ms.items()},
            "prefill_ms": {str(t): ms for t, ms in self.prefill_ms.items()},
            "step_overhead_ms": self.step_overhead_ms,
        }

    def scaled(self, decode: float, prefill: float, step_overhead_ms: float | None = None) -> CostModel:
        """The same curve with every decode step and prefill taking these multiples, and
        each step `step_overhead_ms` besides its forwards (default: this curve's)."""
        return CostModel(
            {c: {b: ms * decode for b, ms in row.items()} for c, row in self.decode_ms.items()},
            {t: ms * prefill for t, ms in self.prefill_ms.items()},
            self.name,
            self.step_overhead_ms if step_overhead_ms is None else step_overhead_ms,
        )

    def step_ms(self, batch: int, context: float) -> float:
        """One decode step for `batch` rows at `context` tokens: interpolated in both, and
        made monotone in batch size (the measured table has noise from a shared machine)."""
        row = self.decode_ms[min(self.decode_ms, key=lambda c: abs(c - context))]
        sizes = sorted(row)
        times = np.maximum.accumulate([row[s] for s in sizes])  # a bigger batch never steps faster
        if batch > sizes[-1]:  # beyond the table: linear in rows
            return float(times[-1]) * batch / sizes[-1]
        return float(np.interp(batch, sizes, times))

    def prefill_ms_for(self, tokens: int) -> float:
        """One prompt's prefill, in chunks of the largest measured size, interpolated."""
        sizes = sorted(self.prefill_ms)
        chunk = sizes[-1]
        whole, rest = divmod(max(tokens, 1), chunk)
        total = whole * self.prefill_ms[chunk]
        if rest:
            total += float(np.interp(rest, sizes, [self.prefill_ms[s] for s in sizes]))
        return total

    def batch_ms(self, prompts: list[int], outputs: list[int]) -> float:
        """A static batch: every prompt prefilled, then the longest output's steps for all rows."""
        longest = max(outputs)
        context = sum(prompts) / len(prompts) + longest / 2
        step = self.step_ms(len(prompts), context) + self.step_overhead_ms
        return sum(self.prefill_ms_for(t) for t in prompts) + longest * step

    def expected_batch_ms(self, size: int, samples: int = 200, seed: int = 7) -> float:
        """The mean time of a batch of `size` requests from the workload's mix (what a replica
        on this engine publishes as its `batch_ms`: measured, not assumed)."""
        rng = np.random.default_rng(seed)
        total = 0.0
        for _ in range(samples):
            prompts = rng.integers(100, 501, size).tolist()
            outputs = np.exp(rng.uniform(np.log(4), np.log(129), size)).astype(int).tolist()
            total += self.batch_ms(prompts, outputs)
        return total / samples


# -- workload -------------------------------------------------------------------------------


@dataclass
class Workload:
    """Every request of a run, in order of sending; arrays indexed by request."""

    t_ms: np.ndarray  # float64: when the client sent it (= reached a gateway; network is added apart)
    paid: np.ndarray  # bool
    model: np.ndarray  # int8: index into the model list
    region: np.ndarray  # int8
    prev: np.ndarray  # int32: the request of the same typing session this one supersedes, or -1
    prompt_tokens: np.ndarray  # int16
    output_tokens: np.ndarray  # int16

    def __len__(self) -> int:
        return len(self.t_ms)


def _times(rate_fn: Any, seconds: float, rng: np.random.Generator, bin_ms: float = 10.0) -> np.ndarray:
    """Arrival times (ms) of a Poisson process whose rate (req/s) follows `rate_fn(t_s)`."""
    if isinstance(rate_fn, FlatRate):  # exponential gaps: in order as drawn, no sort
        mean_gap_ms = 1000.0 / rate_fn.rps
        gaps = rng.exponential(mean_gap_ms, int(seconds * 1000.0 / mean_gap_ms * 1.01 + 100))
        t = np.cumsum(gaps)
        while t[-1] < seconds * 1000.0:  # rare: the draw ran short; draw on
            t = np.r_[t, t[-1] + np.cumsum(rng.exponential(mean_gap_ms, len(t) // 10 + 100))]
        return t[: np.searchsorted(t, seconds * 1000.0)]
    edges = np.arange(0.0, seconds * 1000.0, bin_ms)
    rates = np.maximum(np.asarray(rate_fn(edges / 1000.0), dtype=float), 0.0)
    counts = rng.poisson(rates * bin_ms / 1000.0)
    starts = np.repeat(edges, counts)
    return np.sort(starts + rng.uniform(0.0, bin_ms, len(starts)))


def make_workload(
    rps: float,
    seconds: float,
    *,
    profile: ArrivalProfile = "poisson",
    paid_fraction: float = 0.2,
    model_shares: list[float] | None = None,
    regions: int = 1,
    seed: int = 0,
    keystrokes: float = 6.0,
    pause_ms: float = 350.0,
) -> Workload:
    """Requests for a run. `typing`: sessions of `keystrokes` requests on average, one every
    typing pause (100 ms + exponential `pause_ms`); a session's next request supersedes
    its previous one. A session keeps its tier, model and region."""
    rng = np.random.default_rng(seed)
    shares = np.asarray(model_shares or [1.0], dtype=float)
    shares = shares / shares.sum()
    if profile == "typing":
        typing = typing_sessions(rng, rps, seconds, keystrokes, pause_ms)  # what `keybatch load` sends
        num_sessions, prev = typing.num_sessions, typing.prev
        session_paid = rng.random(num_sessions) < paid_fraction
        session_model = rng.choice(len(shares), num_sessions, p=shares)
        session_region = rng.integers(0, regions, num_sessions)
        t, sess = typing.t_ms, typing.session
        paid, model, region = session_paid[sess], session_model[sess], session_region[sess]
    else:
        t = _times(rate_profile(profile, rps, seconds), seconds, rng)
        n = len(t)
        prev = np.full(n, -1, dtype=np.int32)
        paid = rng.random(n) < paid_fraction
        model = rng.choice(len(shares), n, p=shares)
        region = rng.integers(0, regions, n)
    n = len(t)
    # max_tokens log-uniform 4..128 (as `keybatch bench policies`), prompts 100-500 tokens
    outputs = np.exp(rng.uniform(np.log(4), np.log(129), n)).astype(np.int16)
    prompts = rng.integers(100, 501, n).astype(np.int16)
    return Workload(  # copy=False: tens of millions of requests are not copied for nothing
        t.astype(np.float64, copy=False),
        paid.astype(bool, copy=False),
        model.astype(np.int8, copy=False),
        region.astype(np.int8, copy=False),
        prev.astype(np.int32, copy=False),
        prompts,
        outputs,
    )


# -- configuration ---------------------------------------------------------------------------


@dataclass
class SimConfig:
    replicas: list[int]  # per model: replicas in each region
    models: list[str] = field(default_factory=lambda: ["kb-small"])
    regions: int = 1
    max_batch: int = 64
    batch_ms: float = 250.0  # fixed batch time, unless `costs` gives a model a curve
    batch_jitter_ms: float = 0.0  # a fixed batch takes batch_ms plus up to this much more (uniform)
    costs: dict[str, CostModel] = field(default_factory=dict)
    policy: str = "static"  # or "continuous": tasks/policy/scheduler.py plans each step, a cost model prices it
    max_wait_ms: float = 20.0
    pull_lead_ms: float = 40.0
    margin_ms: float = 15.0
    budget_ms: float = 540.0  # the client's deadline at the gateway (the SLO less the network)
    max_queue_paid: int = 4096
    max_queue_free: int = 2048
    admission_refresh_ms: float = 10.0  # how often a group's admission limits are worked out again
    host_size: int = 8  # replicas a host carries
    host_loss_at_s: float | None = None  # one host of the first group dies then
    restart_s: float = 5.0  # and is back this long after
    detect_ms: float = 400.0  # lease (300 ms) lapsed + the next sweep (every 100 ms)
    region_loss_at_s: float | None = None  # region 0 is lost then
    resend_ms: float = 100.0  # a client's retry of a lost region's request reaches another region
    # A BRPOP sent before the gate shut takes one more message (kombu lets it finish); the
    # replica then "hand_back"s it to the front of the queue (the live default), or "keep"s
    # it for its next batch (KEYBATCH_HAND_BACK_PULLS=0); "none": a gate that also stops a
    # BRPOP already sent (no such consumer exists; what the simulator did before).
    pull_in_flight: str = "hand_back"

    def __post_init__(self) -> None:
        if len(self.replicas) != len(self.models) or min(self.replicas) < 1:
            raise ValueError("one replica count (>= 1) per model")
        if self.policy not in ("static", "continuous"):
            raise ValueError(f"policy must be static or continuous, not {self.policy!r}")
        if self.policy == "continuous" and set(self.models) - set(self.costs):
            raise ValueError("the continuous policy needs a cost model (an engine curve) for every model")
        if self.pull_in_flight not in ("hand_back", "keep", "none"):
            raise ValueError(f"pull_in_flight must be hand_back, keep or none, not {self.pull_in_flight!r}")
        if self.regions < 1 or (self.region_loss_at_s is not None and self.regions < 2):
            raise ValueError("region loss needs at least two regions")


# -- the simulated parts ---------------------------------------------------------------------


MEAN_OUTPUT_TOKENS = (MAX_TOKENS - MIN_TOKENS) / math.log(MAX_TOKENS / MIN_TOKENS)  # log-uniform
CONTEXT_TOKENS = 400.0  # a 100-500 token prompt and part of its answer


class SimEngine:
    """A continuous replica's engine, counted in tokens: `tasks.scheduler` plans every step
    (admit into free slots paid first, decode one token each, prefill with the rest of the
    budget), the cost model prices it: one decode step for the decoding rows plus each
    prompt chunk's own forward."""

    def __init__(self, scheduler: ContinuousScheduler, cost: CostModel) -> None:
        self.scheduler = scheduler
        self.cost = cost
        self.waiting: dict[str, WaitingRequest] = {}
        self.rows: dict[str, list[int]] = {}  # id -> [prompt tokens left to prefill, tokens left to decode]
        self.pendings: dict[str, Pending] = {}  # every request in the engine, waiting or running
        self.outputs: dict[str, int] = {}
        self.plan: SchedulerOutput | None = None
        self._arrivals = 0

    def free_slots(self) -> int:
        return max(0, self.scheduler.config.max_slots - len(self.rows) - len(self.waiting))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.rows)

    def add(self, pending: Pending, prompt_tokens: int, output_tokens: int) -> None:
        self._arrivals += 1
        self.waiting[pending.id] = WaitingRequest(pending.id, pending.tier, prompt_tokens, self._arrivals)
        self.pendings[pending.id] = pending
        self.outputs[pending.id] = output_tokens

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self.rows.pop(request_id, None)
        self.pendings.pop(request_id, None)

    def schedule(self) -> float:
        """Plan the next step; its cost in ms (0: nothing to compute)."""
        running = [
            RunningRequest(i, row[0], self.pendings[i].tier, 0, is_finished=row[1] <= 0) for i, row in self.rows.items()
        ]
        plan = self.scheduler.schedule(list(self.waiting.values()), running)
        for i in plan.released:
            del self.rows[i]
            self.pendings.pop(i, None)
        for i in plan.joined:
            request = self.waiting.pop(i)
            self.rows[i] = [request.num_prompt_tokens, self.outputs.pop(i)]
        self.plan = plan
        decode = self.cost.step_ms(len(plan.decodes), CONTEXT_TOKENS) if plan.decodes else 0.0
        prefill = sum(self.cost.prefill_ms_for(n) for n in plan.prefills.values())
        return decode + prefill + (self.cost.step_overhead_ms if decode or prefill else 0.0)

    def finish_step(self) -> list[Pending]:
        """Apply the planned step; the requests that finished with it."""
        done: list[Pending] = []
        if self.plan is None:
            return done
        for i in self.plan.decodes:
            row = self.rows.get(i)
            if row is not None and row[1] > 0:
                row[1] -= 1
                if row[1] == 0:
                    done.append(self.pendings[i])
        for i, n in self.plan.prefills.items():
            if i in self.rows:
                self.rows[i][0] -= n
        self.plan = None
        return done


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

    def held(self) -> list[Pending]:
        """What a sweep finds in its held hash: the batch or the engine's requests, and the buffer."""
        running = list(self.engine.pendings.values()) if self.engine else self.batch
        return running + self.collector.waiting


class Group:
    """One model's queue in one region, its replicas and its admission."""

    def __init__(self, index: int, region: int, model: int, config: SimConfig, sim: Simulation) -> None:
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
        self.replicas = [
            SimReplica(sim.next_replica(), self, self.collector_config, PullGate(config.max_batch, config.pull_lead_ms))
            for _ in range(config.replicas[model])
        ]
        for replica in self.replicas:
            replica.engine = self.new_engine()
        self.paid_queue: deque[int] = deque()
        self.free_queue: deque[int] = deque()
        self.num_waiting = [0, 0]  # free, paid: the waiting sets admission counts
        self.blocked: deque[SimReplica] = deque(self.replicas)  # consumers in BRPOP, first asked first
        self.limits = Limits(config.max_queue_paid, config.max_queue_free, config.margin_ms)
        self.paid_meter = RateMeter()
        self.alive = True
        self.num_ready = len(self.replicas)
        self.verdict = Verdict.ADMIT
        self.deepest = (0, 0)
        self.deepest_at = -1e18

    def new_engine(self) -> SimEngine | None:
        if not self.continuous or self.cost is None:
            return None
        return SimEngine(ContinuousScheduler(self.scheduler_config), self.cost)

    def capacity(self) -> Capacity:
        return Capacity(self.num_ready, self.collector_config.max_batch, self.batch_ms)

    def refresh_deepest(self, now: float, budget_ms: float) -> None:
        """The verdict before the queue and the (free, paid) deepest admissible positions,
        worked out again every `admission_refresh_ms` (a gateway's view of the fleet is
        250 ms old anyway)."""
        capacity = self.capacity()
        rate = self.paid_meter.rate(now)
        self.verdict = admission.check(budget_ms, capacity, self.limits)
        self.deepest = (
            (
                admission.max_position(FREE, budget_ms, capacity, self.limits, rate),
                admission.max_position(PAID, budget_ms, capacity, self.limits, rate),
            )
            if self.verdict == Verdict.ADMIT
            else (0, 0)
        )
        self.deepest_at = now


# -- the simulation ---------------------------------------------------------------------------


class Simulation:
    """`arrivals`: the first so many requests arrive at their time; the rest only as
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
        self.resent: list[tuple[float, int]] = sorted(resend or [])  # heap: (time, request) sent again
        self.resent_ids.update(j for _, j in self.resent)
        self.handed_off: list[tuple[float, int]] = []
        self.stats = dict.fromkeys(("batches", "batch_rows", "wasted", "requeued", "resent", "events", "taken_shut"), 0)
        self.batch_sizes: list[int] = []
        rng = np.random.default_rng(12345)
        self._alt = rng.random(4096).tolist()
        self._alt_i = 0
        if config.host_loss_at_s is not None:
            self._push(config.host_loss_at_s * 1000.0, _HOST_DOWN, None, 0)
        if region_loss_ms is None and config.region_loss_at_s is not None:
            region_loss_ms = config.region_loss_at_s * 1000.0
        if region_loss_ms is not None:
            self._push(region_loss_ms, _REGION_DOWN, None, 0)

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

    # -- the run --

    def run(self) -> SimResult:
        """Run to the end. The cyclic garbage collector is off meanwhile: the run makes no
        cycles, and its passes over millions of short-lived objects cost a fifth of the time."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if enabled:
                gc.enable()

    def _run(self) -> SimResult:
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
        if kind in (_LAUNCH, _END, _GATE):
            replica: SimReplica = who
            if not replica.alive or token != replica.tokens[kind]:
                return
            if kind == _END:
                if replica.engine is not None:
                    self._cycle(replica, stepped=True)
                else:
                    self._end(replica)
            elif kind == _LAUNCH:
                self._try_launch(replica)
            else:
                self._pull(replica)
        elif kind == _HOST_DOWN:
            self._host_down()
        elif kind == _SWEEP:
            self._sweep(who)
        elif kind == _HOST_UP:
            self._host_up(who)
        elif kind == _REGION_DOWN:
            self._region_down(0)

    # -- the gateway: supersede, admit, enqueue --

    def _arrive(self, i: int, resent: bool = False) -> None:
        """The gateway's ADMIT, then the LPUSH. The hot path: one call per request."""
        group = self.groups[self.group_of[i]]
        if not group.alive:  # its region is gone: the client's next region
            group = self._move(i)
        state, now, paid = self.state, self.now, self.paid[i]
        prev = self.prev[i]
        if prev >= 0 and not resent and WAITING <= state[prev] <= RUNNING:
            self._cancel(prev)
        if resent:
            verdict, deepest = self._admit_resent(group, i)
        else:
            if now - group.deepest_at >= self.config.admission_refresh_ms:
                group.refresh_deepest(now, self.config.budget_ms)
            verdict, deepest = group.verdict, group.deepest[paid]
        waiting = group.num_waiting
        position = waiting[1] + 1 + (0 if paid else waiting[0])
        if verdict is not _ADMIT or position > deepest:
            state[i] = EXPIRED if verdict == Verdict.TOO_SHORT else REFUSED
            return
        if paid:
            group.paid_meter.add(now)
        state[i] = WAITING
        waiting[paid] += 1
        # LPUSH: a consumer blocked in BRPOP takes it at once (the one that asked first), if
        # its gate still lets it or its BRPOP was sent before the gate shut; it asks again at
        # the back of the line if its gate lets it then. A replica whose gate had shut hands
        # the message back to the front of the queue (`Replica._hands_back`).
        blocked = group.blocked
        handed_back = False
        while blocked:
            replica = blocked[0]
            if not replica.alive or not (
                self._wants(replica)
                if group.continuous
                else replica.gate.wants(now, len(replica.collector.waiting), group.batch_ms)
            ):
                if not self._in_flight(replica):
                    self._shut(replica)
                    continue
                self.stats["taken_shut"] += 1
                if self.config.pull_in_flight == "hand_back":
                    self._shut(replica)
                    handed_back = True
                    continue
            blocked.rotate(-1)
            replica.asked_at = now
            self._take(replica, i)
            if not (
                self._wants(replica)
                if group.continuous
                else replica.gate.wants(now, len(replica.collector.waiting), group.batch_ms)
            ):
                self._shut(replica)
            return
        queue = group.paid_queue if paid else group.free_queue
        if handed_back:  # RPUSH: the next pull takes it
            queue.appendleft(i)
        else:
            queue.append(i)

    def _admit_resent(self, group: Group, i: int) -> tuple[Verdict, int]:
        """A request sent again after a region loss: admitted on what is left of its budget."""
        budget = self.deadline[i] - self.now
        capacity = group.capacity()
        verdict = admission.check(budget, capacity, group.limits)
        if verdict != Verdict.ADMIT:
            return verdict, 0
        return verdict, admission.max_position(_TIERS[self.paid[i]], budget, capacity, group.limits)

    def _move(self, i: int) -> Group:
        alive = [g for g in self.groups if g.alive and g.model == self.groups[self.group_of[i]].model]
        group = alive[int(self._random() * len(alive))]
        self.group_of[i] = group.index
        return group

    def _cancel(self, j: int) -> None:
        """A newer request of the session supersedes it: out of the waiting set at once; a
        replica drops it before its batch; a static batch already running runs it for nothing."""
        if self.state[j] == WAITING:
            self.groups[self.group_of[j]].num_waiting[self.paid[j]] -= 1
        else:
            self.stats["wasted"] += 1
        self.state[j] = CANCELLED

    def _requeue(self, group: Group, i: int) -> None:
        """SWEEP's RPUSH: back at the front of its queue (the end consumers pop from)."""
        (group.paid_queue if self.paid[i] else group.free_queue).appendleft(i)

    # -- the replica: gate, buffer, launch, end --

    def _wants(self, replica: SimReplica) -> bool:
        """`Replica.wants_messages`."""
        if not replica.alive:
            return False
        if replica.engine is not None:
            return replica.gate.wants_continuous(len(replica.collector.waiting), replica.engine.free_slots())
        return replica.gate.wants(self.now, len(replica.collector.waiting), replica.group.batch_ms)

    def _in_flight(self, replica: SimReplica) -> bool:
        """Has the consumer a BRPOP out that its gate did not stop? kombu lets a BRPOP sent
        before the gate shut take one more message (`tasks.kombu_internals.gate_pulls`),
        unless the BRPOP's own timeout came first."""
        return (
            self.config.pull_in_flight != "none"
            and replica.alive
            and self.now - replica.asked_at < BRPOP_TIMEOUT_MS
            and replica in replica.group.blocked
        )

    def _shut(self, replica: SimReplica, in_flight: bool = False) -> None:
        """The gate said no: the consumer stops asking, with a timer if it reopens by itself.
        `in_flight`: the gate shut on the replica's side (a batch started) while its BRPOP
        was out: that BRPOP still takes one message."""
        blocked = replica.group.blocked
        if in_flight and self._in_flight(replica):
            pass
        elif blocked and blocked[0] is replica:
            blocked.popleft()
        elif replica in blocked:
            blocked.remove(replica)
        if replica.engine is not None:  # reopens when work leaves (`Replica.reopens_at_ms`)
            return
        at = replica.gate.reopens_at(self.now, len(replica.collector), replica.group.batch_ms)
        # As the worker's consumer loop does (tasks/replica/worker.py): one timer per reopening time,
        # so a time already past (a batch longer than expected) wakes it once, not forever.
        if at is not None and at != replica.gate_at and replica.alive:
            replica.gate_at = at
            self._timer(replica, _GATE, max(at, self.now))

    def _take(self, replica: SimReplica, i: int) -> None:
        collector = replica.collector
        collector.add(Pending(str(i), _TIERS[self.paid[i]], self.t[i], self.deadline[i], i, self.now))
        if replica.engine is not None:
            if not replica.busy:  # an idle continuous replica admits at once
                self._cycle(replica)
            return
        if not replica.busy:
            if len(collector) >= collector.config.max_batch:
                self._try_launch(replica)
            elif len(collector) == 1 or i in self.resent_ids:
                wait = collector.wait_ms(self.now)
                if wait is not None:
                    self._timer(replica, _LAUNCH, self.now + wait)

    def _pull(self, replica: SimReplica) -> None:
        """The consumer's loop: BRPOP (paid list first) while the gate lets it."""
        group = replica.group
        while self._wants(replica):
            if group.paid_queue:
                self._take(replica, group.paid_queue.popleft())
            elif group.free_queue:
                self._take(replica, group.free_queue.popleft())
            else:
                if replica not in group.blocked:
                    group.blocked.append(replica)
                    replica.asked_at = self.now
                elif self.now - replica.asked_at >= BRPOP_TIMEOUT_MS:  # timed out, sent again
                    replica.asked_at = self.now
                return
        self._shut(replica, in_flight=True)

    def _try_launch(self, replica: SimReplica) -> None:
        """`Replica._take`: drop what was cancelled or expired, let paid requests still in the
        queue in ahead of buffered free ones, then start a batch if one is due."""
        if replica.busy or not replica.alive:
            return
        collector, group, now = replica.collector, replica.group, self.now
        gone = {p.id for p in collector.waiting if self.state[p.payload] != WAITING}
        if gone:
            collector.remove(gone)
        room = collector.num_free()
        while room and group.paid_queue:
            j = group.paid_queue.popleft()
            collector.add(Pending(str(j), PAID, self.t[j], self.deadline[j], j, now))
            room -= 1
        for pending in collector.pop_expired(now):
            j = pending.payload
            if self.state[j] == WAITING:
                self.state[j] = EXPIRED
                group.num_waiting[self.paid[j]] -= 1
        wait = collector.wait_ms(now)
        if wait is None:
            return
        if wait > 0:
            self._timer(replica, _LAUNCH, now + wait)
            return
        batch = collector.pop_batch()
        for pending in batch:
            j = pending.payload
            group.num_waiting[self.paid[j]] -= 1
            self.state[j] = RUNNING
            self.start_ms[j] = now
        duration = self._batch_ms(group, batch)
        replica.batch, replica.busy = batch, True
        replica.last_launch, replica.ends_at = now, now + duration
        replica.gate.start(now, group.batch_ms)
        replica.gate.peers(idle=self._peer_idle(replica), launches=self._peer_launches(replica))
        self.stats["batches"] += 1
        self.stats["batch_rows"] += len(batch)
        self._timer(replica, _END, now + duration)
        self._pull(replica)

    def _cycle(self, replica: SimReplica, stepped: bool = False) -> None:
        """`Replica._run_continuous`, one turn: answer what the step finished; drop what was
        cancelled or expired (buffered or running); admit into free slots; plan and price
        the next step."""
        engine, collector, group, now, state = replica.engine, replica.collector, replica.group, self.now, self.state
        assert engine is not None
        if stepped:
            for pending in engine.finish_step():
                j = pending.payload
                if state[j] == RUNNING:
                    state[j] = OK if now <= pending.deadline_ms else LATE
                    self.end_ms[j] = now
        for request_id, pending in list(engine.pendings.items()):
            j = pending.payload
            if state[j] != RUNNING or now > pending.deadline_ms:
                engine.abort(request_id)
                if state[j] == RUNNING:
                    state[j] = LATE
        gone = {p.id for p in collector.waiting if state[p.payload] != WAITING}
        if gone:
            collector.remove(gone)
        room = min(collector.num_free(), engine.free_slots())
        while room and group.paid_queue:
            j = group.paid_queue.popleft()
            collector.add(Pending(str(j), PAID, self.t[j], self.deadline[j], j, now))
            room -= 1
        for pending in collector.pop_expired(now):
            j = pending.payload
            if state[j] == WAITING:
                state[j] = EXPIRED
                group.num_waiting[self.paid[j]] -= 1
        batch = collector.pop_batch(limit=engine.free_slots())
        w = self.workload
        for pending in batch:
            j = pending.payload
            group.num_waiting[self.paid[j]] -= 1
            state[j] = RUNNING
            self.start_ms[j] = now
            engine.add(pending, int(w.prompt_tokens[j]), int(w.output_tokens[j]))
        self.stats["batch_rows"] += len(batch)
        replica.busy = False
        for _ in range(3):  # a plan that only releases finished rows costs nothing: plan again
            if not engine.has_unfinished():
                break
            cost = engine.schedule()
            if cost > 0:
                replica.busy = True
                self.stats["batches"] += 1
                self._timer(replica, _END, now + cost)
                break
        self._pull(replica)

    def _batch_ms(self, group: Group, batch: list[Pending]) -> float:
        if group.cost is None:
            return self.config.batch_ms + self.config.batch_jitter_ms * self._random()
        w = self.workload
        idx = [p.payload for p in batch]
        return group.cost.batch_ms(w.prompt_tokens[idx].tolist(), w.output_tokens[idx].tolist())

    def _peer_idle(self, replica: SimReplica) -> bool:
        return any(not r.busy for r in replica.group.replicas if r is not replica and r.alive)

    def _peer_launches(self, replica: SimReplica) -> list[float]:
        """The other replicas' last starts (`kb:launch:<model>`), those still able to matter:
        a start whose batch ended already can neither end before this one nor be recent."""
        horizon = self.now - 2 * replica.group.batch_ms
        return [
            r.last_launch for r in replica.group.replicas if r is not replica and r.alive and r.last_launch > horizon
        ]

    def _end(self, replica: SimReplica) -> None:
        now, state = self.now, self.state
        for pending in replica.batch:
            j = pending.payload
            if state[j] == RUNNING:
                state[j] = OK if now <= pending.deadline_ms else LATE
                self.end_ms[j] = now
        num = len(replica.batch)
        self.batch_sizes.append(num)
        replica.batch, replica.busy = [], False
        replica.gate.finish()
        launches = self._peer_launches(replica)
        replica.collector.stagger_from(launches, num, now)
        replica.gate.peers(launches=launches)
        self._pull(replica)
        self._try_launch(replica)

    # -- faults --

    def _host_down(self) -> None:
        """The first host of the first group dies mid-batch: its replicas stop at once; the
        lease lapses and a sweep re-queues what they held (control/broker/scripts.py, SWEEP)."""
        group = self.groups[0]
        dead = [r for r in group.replicas if r.alive][: self.config.host_size]
        for replica in dead:
            replica.alive = False
            replica.tokens = [t + 1 for t in replica.tokens]
            if replica in group.blocked:
                group.blocked.remove(replica)
        self._push(self.now + self.config.detect_ms, _SWEEP, dead, 0)
        self._push(self.now + self.config.restart_s * 1000.0, _HOST_UP, dead, 0)

    def _sweep(self, dead: list[SimReplica]) -> None:
        """SWEEP: each held request still wanted goes back to the front of its queue, or is
        answered 504 when its deadline leaves less than one batch (or it came back twice)."""
        group = dead[0].group
        group.num_ready -= len(dead)
        min_ms = group.batch_ms + self.config.margin_ms
        for replica in dead:
            held = replica.held()
            replica.batch, replica.collector.waiting, replica.busy = [], [], False
            replica.engine = group.new_engine()
            for pending in reversed(held):
                j = pending.payload
                if self.state[j] not in (WAITING, RUNNING):
                    continue
                was_running = self.state[j] == RUNNING
                if self.deadline[j] - self.now >= min_ms and self.requeues.get(j, 0) < 2:
                    self.requeues[j] = self.requeues.get(j, 0) + 1
                    self.stats["requeued"] += 1
                    if was_running:
                        group.num_waiting[self.paid[j]] += 1
                    self.state[j] = WAITING
                    self._requeue(group, j)
                else:
                    if not was_running:
                        group.num_waiting[self.paid[j]] -= 1
                    self.state[j] = EXPIRED
        for replica in list(group.blocked):  # re-queued requests go to the consumers blocked on the queue
            self._pull(replica)

    def _host_up(self, dead: list[SimReplica]) -> None:
        group = dead[0].group
        for replica in dead:
            replica.alive = True
            replica.collector = Collector(group.collector_config)
            replica.engine = group.new_engine()
            replica.gate = PullGate(self.config.max_batch, self.config.pull_lead_ms)
            replica.last_launch = -1e18
            group.blocked.append(replica)
            replica.asked_at = self.now
        group.num_ready += len(dead)
        for replica in dead:
            self._pull(replica)

    def _region_down(self, region: int) -> None:
        """Region 0 is lost with everything in it. Its clients send what was in flight again
        to another region (`control/fleet/regionclient.py`, same request id), with what is left of
        the budget; new requests go to the other regions from now on."""
        for group in self.groups:
            if group.region != region:
                continue
            group.alive = False
            held: list[int] = list(group.paid_queue) + list(group.free_queue)
            for replica in group.replicas:
                held += [p.payload for p in replica.held()]
                replica.alive = False
                replica.tokens = [t + 1 for t in replica.tokens]
            group.paid_queue.clear()
            group.free_queue.clear()
            group.blocked.clear()
            group.num_ready = 0
            elsewhere = any(g.alive and g.model == group.model for g in self.groups)
            for j in held:
                if self.state[j] not in (WAITING, RUNNING):
                    continue
                self.state[j] = NEW
                self.stats["resent"] += 1
                if not elsewhere:  # the other regions run apart: the caller sends it on
                    self.handed_off.append((self.now + self.config.resend_ms, j))
                    continue
                self.resent_ids.add(j)
                self._move(j)
                heapq.heappush(self.resent, (self.now + self.config.resend_ms, j))

    # -- the answer --

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


def simulate(config: SimConfig, workload: Workload) -> SimResult:
    return Simulation(config, workload).run()
