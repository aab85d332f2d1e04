"""Admission control: how deep may the queue be for a new request to fit its budget?

Policy code, no I/O. The gateway asks `max_position` for the request's tier and
budget; Redis then admits the request atomically only if its position in the
queue (paid requests wait behind paid ones, free behind everything) is within
it. Beyond it the answer is 429 now, not a slow 504; a budget shorter than one
batch can never be met, and is answered 504 at once.

Within a tier, keys (tenants) share: each key has a token bucket (a rate and a burst,
per tier) and may hold at most a share of the queue its request may wait behind. A key's
queued requests up to its fair depth (`fair_batches` batches) keep their place in line;
beyond it a request waits in the tier's second list, behind every other key's requests of
the tier (the replicas pop that list only when the first is empty), so a key that floods
its tier delays itself, not the others. The admission script (api/gateway.py) applies
`decide` to the counts it reads, atomically with the enqueue.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from control.core.vocab import FREE, PAID, Tier

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(frozen=True)
class Phases:
    """When a model's static replicas start their next batches, as last seen: the starts
    (epoch ms, in order) of those in phase, each a slot after the last up to `until_ms`,
    and how many are idle. Made by `phases_of`."""

    starts_ms: tuple[float, ...]
    num_idle: int
    until_ms: float
    slot_ms: float
    read_ms: float  # when the launches were read


@dataclass(frozen=True)
class Capacity:
    """What serves one model right now.

    `batch_ms` is the engine's expected batch (what a replica's own rule that a request
    must start by its deadline less one batch uses); `cycle_ms` the measured time a batch
    slot takes on the replica, start to ready again (pop, settle, run, deliver: ~272 ms for
    a 250 ms engine), 0.0 until measured. Slots open at the cycle's pace (`slot_ms`).
    `phases`: when the static replicas start next, where their launches were read."""

    num_replicas: int
    max_batch: int
    batch_ms: float
    cycle_ms: float = 0.0
    join_ms: float = 0.0  # continuous replicas: a taken request waits up to a step to join
    phases: Phases | None = None

    @property
    def slot_ms(self) -> float:
        """What one batch slot takes a replica: the measured cycle, else the engine's batch."""
        return self.cycle_ms if self.cycle_ms > 0 else self.batch_ms

    @property
    def interval_ms(self) -> float:
        """The most time between two batch slots' starts, the replicas out of phase."""
        return self.slot_ms / max(1, self.num_replicas)

    @property
    def per_round(self) -> int:
        """Requests the model's replicas take in one round of batches."""
        return self.num_replicas * self.max_batch

    @property
    def requests_per_s(self) -> float:
        return self.per_round * 1000.0 / self.slot_ms


MAX_STRETCH = 2.0  # a cycle measured beyond this many engine batches is a cold start or a stall, not a pace


def replica_slot_ms(batch_ms: float, cycle_ms: float) -> float:
    """One replica's slot time: its measured cycle, no shorter than its engine's batch (the
    cycle holds the batch) and, as a median of few samples may be the first cold batch
    alone, no longer than `MAX_STRETCH` batches: admission then still lets in a slot's
    worth, the replica runs it, and later samples outvote the cold one."""
    if cycle_ms <= 0:
        return batch_ms
    return min(max(cycle_ms, batch_ms), MAX_STRETCH * batch_ms)


def pooled_capacity(replicas: list[tuple[int, float, float]]) -> Capacity:
    """What the ready replicas of one model, each given as (max_batch, batch_ms, cycle_ms),
    serve together. Their batch and slot times are the ones at which they serve what each
    serves at its own (the harmonic mean): a replica that reports a slow batch (a cold
    start, a stall) counts for its share of the model's rate, never for the whole, so one
    outlier does not make admission refuse budgets the others meet. A time that is not
    positive says nothing."""
    if not replicas:
        return Capacity(0, 1, 1.0)
    timed = [(ms, cycle) for _batch, ms, cycle in replicas if ms > 0]
    batch_ms = _harmonic([ms for ms, _cycle in timed]) or 1.0
    is_measured = any(cycle > 0 for _ms, cycle in timed)
    cycle_ms = _harmonic([replica_slot_ms(ms, cycle) for ms, cycle in timed]) if is_measured else 0.0
    return Capacity(len(replicas), min(batch for batch, _ms, _cycle in replicas), batch_ms, cycle_ms)


def _harmonic(times: list[float]) -> float:
    return len(times) / sum(1.0 / t for t in times) if times else 0.0


@dataclass(frozen=True)
class Limits:
    max_queue_paid: int
    max_queue_free: int
    margin_ms: float = 15.0

    def max_queue(self, tier: Tier) -> int:
        return self.max_queue_paid if tier == PAID else self.max_queue_free


class Verdict(IntEnum):
    ADMIT = 0
    OVERLOADED = 1  # 429: retry later
    TOO_SHORT = 2  # 504: the budget is below one batch
    NO_REPLICA = 3  # 503
    TENANT_RATE_LIMITED = 4  # 429: the key's own rate
    TENANT_QUEUE_FULL = 5  # 429: the key holds its share of the queue


def position(tier: Tier, paid_waiting: int, free_waiting: int) -> int:
    """1-based queue position of a new request in line: `lane_position` without the lists
    of requests behind other keys' ones, where both tiers count every request waiting
    (worked out here without building a `Depths`: the simulator asks it per arrival)."""
    return paid_waiting + free_waiting + 1


def predict_ms(position: int, capacity: Capacity) -> float:
    """Latest expected finish of the request at 1-based `position` in the queue.

    The request rides in batch slot k = ceil(position / max_batch), which starts by
    `slot_start_ms`; then its slot takes `slot_ms`.
    """
    return slot_start_ms(math.ceil(position / capacity.max_batch), capacity) + capacity.slot_ms


def slot_start_ms(slot: int, capacity: Capacity) -> float:
    """By when batch slot `slot` (1-based) starts, from now: with the replicas out of phase
    one starts every `interval_ms`, the first at most an interval away. (The mean, half an
    interval sooner, admitted requests to the last slot that then started after their
    deadline less a batch: the replica answered them 504.)"""
    return slot * capacity.interval_ms


def max_slots(budget_ms: float, capacity: Capacity, limits: Limits) -> int:
    """Batch slots a request may wait for (including its own) within its budget: those
    that start by the budget less a slot and the margin (a replica starts a request no
    later than its deadline less a batch and the margin, and the slot then takes `slot_ms`)."""
    return max(1, math.floor(latest_start_ms(budget_ms, capacity, limits) / capacity.interval_ms))


def max_depth(budget_ms: float, capacity: Capacity, limits: Limits) -> int:
    """The queue positions a request's budget holds. Static replicas: the slots that start
    in time, a batch each. Continuous ones free seats at every step, a step's share of a
    batch each (`join_ms` apart), in the order the requests joined: position p joins once p
    seats have freed, a step later at the most, so the positions are the seats that free by
    the latest join less a step, and less one step more for the seats a step frees short of
    its share and for the urgent requests that join out of order (with one step, 0.5-0.7%
    of the requests at twice capacity ended 504, 0-0.03% with two)."""
    if capacity.join_ms <= 0:
        return max_slots(budget_ms, capacity, limits) * capacity.max_batch
    latest_join = budget_ms - limits.margin_ms - capacity.slot_ms - 3 * capacity.join_ms
    return max(capacity.max_batch, math.floor(capacity.per_round * latest_join / capacity.slot_ms))


def check(budget_ms: float, capacity: Capacity, limits: Limits) -> Verdict:
    """What can be said before looking at the queue. The engine's batch, not the measured
    cycle, decides that a budget is too short: an idle replica starts a request at once and
    meets a budget of a batch and the margin, and a first cold cycle must not refuse every
    request (nothing would then run to measure a warm one)."""
    if capacity.num_replicas < 1:
        return Verdict.NO_REPLICA
    if budget_ms < capacity.batch_ms + limits.margin_ms:
        return Verdict.TOO_SHORT
    return Verdict.ADMIT


PAID_SPREAD = 1.0  # standard deviations of the paid arrivals a free request leaves room for


def paid_reserve(paid_rate_rps: float, within_ms: float, spread: float = PAID_SPREAD) -> int:
    """Room for the paid requests expected within `within_ms`, and for their spread:
    arrivals are Poisson, so as many again as `spread` standard deviations (sqrt of the mean)."""
    expected = max(0.0, paid_rate_rps * within_ms / 1000.0)
    return math.ceil(expected + spread * math.sqrt(expected))


# A start foreseen this long ago still counts if it was already due when the launches were
# read: its replica is late (a slot longer than its measured cycle) and had not launched it,
# so its requests still wait in the sets admission counts. (One due after the read may have
# launched since, and its requests left those sets with the launch.)
LATE_MS = 20.0
IDLE_AFTER = 1.5  # slots without a launch: the replica's batch ended and nothing came, it is idle
PHASED_SPREAD = 2.0  # standard deviations of paid arrivals a free request leaves room for, where starts are known
PHASED_BELOW = 0.95  # of the replicas' rate: the phases are counted only while the demand is below it


def phases_of(launches_ms: list[float], now_ms: float, slot_ms: float, horizon_ms: float) -> Phases:
    """The replicas' next starts from their last launches (epoch ms; -inf: none seen). One
    that launched within `IDLE_AFTER` slots starts its next batches a slot apart from its
    last (the stagger keeps a saturated replica's phase; one gone idle since starts as
    work reaches it, sooner; one running late, a few ms later, within the margin); one
    that did not is idle."""
    starts: list[float] = []
    idle = 0
    until = now_ms + horizon_ms
    step = max(slot_ms, 1.0)
    for last in launches_ms:
        if now_ms - last > IDLE_AFTER * step:
            idle += 1
            continue
        at = last + step
        while at <= until:
            starts.append(at)
            at += step
    starts.sort()
    return Phases(tuple(starts), idle, until, step, now_ms)


def phased_starts(phases: Phases, from_ms: float, to_ms: float) -> tuple[int, float] | None:
    """Batch starts in (`from_ms` - `LATE_MS`, `to_ms`] (those before `from_ms` only if due
    when the launches were read), epoch ms, and the last of them
    (`from_ms` if none); None where `to_ms` is past what `phases` foresees. A replica idle
    when the launches were read may have started a batch since, the moment before
    `from_ms` at the worst: its starts are counted from a slot after that. (Counted as
    starting one as work reaches it, a burst on an idle pair was admitted for two starts
    that had taken their batches a moment before.)"""
    if to_ms > phases.until_ms:
        return None
    starts = phases.starts_ms
    late_lo = bisect_right(starts, from_ms - LATE_MS)
    late = max(0, bisect_right(starts, min(phases.read_ms, from_ms, to_ms)) - late_lo)
    lo, hi = bisect_right(starts, from_ms), bisect_right(starts, to_ms)
    count = late + max(0, hi - lo)
    last = starts[hi - 1] if hi > lo else (starts[late_lo + late - 1] if late else from_ms)
    each = math.floor((to_ms - from_ms) / phases.slot_ms) if to_ms > from_ms else 0
    if phases.num_idle and each > 0:
        count += phases.num_idle * each
        last = max(last, from_ms + each * phases.slot_ms)
    return count, last


def max_position(
    tier: Tier,
    budget_ms: float,
    capacity: Capacity,
    limits: Limits,
    paid_rate_rps: float = 0.0,
    now_ms: float | None = None,
    demand_rps: float | None = None,
    bump: bool = False,
) -> int:
    """The deepest queue position (1-based) at which the request still fits.

    Every request in line counts, paid ones included (`lane_position`): a static replica
    runs a request that would otherwise miss its deadline ahead of a paid one (earliest
    deadline first where it must, tasks/policy/collector.py), so a request admitted within
    the slots is not pushed past its deadline by later arrivals of either tier. A free
    request leaves room for the paid traffic expected before the last slot it may ride in
    starts (at the mean phase: half an interval before its latest start), and for that
    traffic's spread: paid requests are then not refused while free ones fill the queue,
    and a continuous replica, whose slots free in cohorts and whose joins look one step
    ahead only, keeps its free requests' deadlines (with room for one interval of paid
    traffic instead, 8.8% of the requests ended 504 at twice capacity there, 1.6% with
    this; docs/decisions/0004). A free request that finds the queue empty is still
    admitted: an idle replica takes it now.

    With `bump` (ADMIT_BUMP, static replicas) a free request leaves no room for paid
    arrivals: a paid one admitted later bumps (429) the first free request it would push
    past its last start instead (the admission script; docs/decisions/0034).
    """
    if bump and capacity.join_ms <= 0:
        paid_rate_rps = 0.0
    slots = max_slots(budget_ms, capacity, limits)
    deepest = max_depth(budget_ms, capacity, limits)
    phased = None
    if now_ms is not None and demand_rps is not None and demand_rps < PHASED_BELOW * capacity.requests_per_s:
        phased = _phased_slots(budget_ms, capacity, limits, now_ms)
    if phased is not None and phased[0] > slots:
        # The starts as seen hold more than the worst phase: a request arriving just before
        # a start rides it, and the one a budget's last slot allows. Only below capacity:
        # past it the queue stays at its limit, and a deeper one only moves free requests'
        # answers later, and paid ones with them (docs/decisions/0032).
        count, last_in = phased
        deepest = count * capacity.max_batch
        if tier == FREE:
            deepest = max(1, deepest - paid_reserve(paid_rate_rps, max(0.0, last_in), PHASED_SPREAD))
        return min(deepest, limits.max_queue(tier))
    return min(_less_paid_room(tier, deepest, slots, capacity, paid_rate_rps), limits.max_queue(tier))


def _less_paid_room(tier: Tier, deepest: int, slots: int, capacity: Capacity, paid_rate_rps: float) -> int:
    """`deepest` less, for a free request, room for the paid arrivals expected before the
    last of `slots` starts (at the mean phase: half an interval before it)."""
    if tier != FREE:
        return deepest
    before_last = slot_start_ms(slots, capacity) - capacity.interval_ms / 2
    return max(1, deepest - paid_reserve(paid_rate_rps, before_last))


def _phased_slots(budget_ms: float, capacity: Capacity, limits: Limits, now_ms: float) -> tuple[int, float] | None:
    """Starts a request of this budget may ride, counted from the replicas' phases (static
    replicas whose launches were read), and in how long the last is; None where not known."""
    if capacity.phases is None or capacity.join_ms > 0:
        return None
    found = phased_starts(capacity.phases, now_ms, now_ms + latest_start_ms(budget_ms, capacity, limits))
    return None if found is None else (found[0], found[1] - now_ms)


class RateMeter:
    """Events per second over a sliding window, on the clock it is given."""

    def __init__(self, window_ms: float = 1000.0) -> None:
        self.window_ms = window_ms
        self._start = 0.0
        self._count = 0
        self._last_rate = 0.0

    def add(self, now_ms: float) -> None:
        self._roll(now_ms)
        self._count += 1

    def rate(self, now_ms: float) -> float:
        """The current window's rate blended into the last one's as the window fills; a rate
        that rises above the blend is followed at once (a paid reserve that lags a ramp from
        idle lets free requests fill the queue the paid ones then find full)."""
        self._roll(now_ms)
        elapsed = max(now_ms - self._start, 1.0)
        current = self._count * 1000.0 / max(elapsed, self.window_ms / 10)
        weight = min(1.0, elapsed / self.window_ms)
        return max(current, weight * current + (1 - weight) * self._last_rate)

    def _roll(self, now_ms: float) -> None:
        if now_ms - self._start >= self.window_ms:
            elapsed = now_ms - self._start
            self._last_rate = self._count * 1000.0 / elapsed if elapsed < 2 * self.window_ms else 0.0
            self._start, self._count = now_ms, 0


OPEN_WINDOW_S = 5  # whole seconds of demand the open gate weighs, before the current one
OPEN_BELOW = 1.0  # of the replicas' rate, over the window (from the first second with traffic in it)
OPEN_MIN_S = 2.0  # of traffic seen in the window before the gate may open (a cold start keeps the limit)
OPEN_BUSY = 0.1  # of the replicas' rate: a second with fewer requests is idle, and the window starts after it
OPEN_BURST_BELOW = 1.1  # of the replicas' rate, over the current second (from half of it) or the last one and it,
OPEN_BURST_SIGMAS = 3.0  # or more where that many standard deviations of arrivals at capacity are more
OPEN_REFRESH_MS = 250.0  # how often a gateway reads the demand and works its gate out again
OPEN_DEEP_SHARE = 0.5  # of the free admissions of the last period or two beyond the limit: the gate shuts
OPEN_DEEP_PERIOD_MS = 500.0
OPEN_DEEP_MIN = 10  # admissions the share needs before it counts (a gateway process's own)
OPEN_MEMORY_MS = 1000.0  # a paid request is admitted deep this long after the gate was last open
OPEN_EXTRA_SLOTS = 2  # beyond the worst phase's: the best phase holds one more, jitter the other


def is_open(per_second: Sequence[int], into_current_s: float, capacity_rps: float) -> bool:
    """ADMIT_OPEN's gate: whether the demand is below what a model's static replicas serve.
    `per_second`: the requests the cell was asked to admit (admitted or not) in each of the
    last `OPEN_WINDOW_S` whole seconds, oldest first, then the current second's so far,
    `into_current_s` of it counted.

    Below capacity, a request refused for want of room is one of a burst that the next
    starts would have taken; well past it, the queue stays at its limit, and a deeper one
    only moves answers later. So the gate opens while the window's demand is below
    `OPEN_BELOW` of the replicas' rate, and shuts at once where the current second's (or,
    early in it, the last one's and its) passes `OPEN_BURST_BELOW`, or as many standard
    deviations of arrivals at capacity as `OPEN_BURST_SIGMAS` where that is more (on a small
    fleet a half second at 110% is noise). The window starts after its first busy second
    (`OPEN_BUSY`), and the gate stays shut until it holds `OPEN_MIN_S`: a spike from idle
    to 110% opened it for four seconds, and what it admitted deep ended 504. The current
    second's count covers about `into_current_s`: gateways file what they counted under the
    second they add it in, up to 100 ms late, so its start is as late as its end."""
    if capacity_rps <= 0 or len(per_second) < 2:
        return False
    *whole, current = per_second
    # The window starts after its first busy second (traffic may have begun late in it); a
    # window busy from its first second is whole.
    busy = max(1.0, OPEN_BUSY * capacity_rps)
    first = next((i for i, n in enumerate(whole) if n >= busy), len(whole))
    if first > 0:
        whole = whole[first + 1 :]
    if len(whole) + into_current_s < OPEN_MIN_S:
        return False
    window_rps = (sum(whole) + current) / (len(whole) + into_current_s)
    if window_rps >= OPEN_BELOW * capacity_rps:
        return False
    span_s = into_current_s if into_current_s >= 0.5 else 1.0 + into_current_s
    burst_rps = (current if into_current_s >= 0.5 else whole[-1] + current) / span_s
    # Poisson arrivals at capacity vary by sqrt(n) in a span that expects n.
    burst_below = max(OPEN_BURST_BELOW, 1.0 + OPEN_BURST_SIGMAS / math.sqrt(capacity_rps * span_s))
    return burst_rps < burst_below * capacity_rps


class OpenGate:
    """ADMIT_OPEN's gate for one model of a cell, worked out again at each read of the
    demand (`update`): whether a request of a tier is admitted as deep as
    `open_position`. A free one while the gate is open; a paid one also for
    `OPEN_MEMORY_MS` after, as the free requests admitted deep while it was open are still
    in line (a paid request behind them, refused at the shut gate's limit, was the one paid
    failure left on 2 x 16 at capacity).

    Open where the demand is below capacity (`is_open`), and where fewer than
    `OPEN_DEEP_SHARE` of the free requests admitted in the last half second to second went
    beyond the limit (`admitted`). Below capacity a few do, in bursts; a ramp into overload
    fills the deep positions within a second or two, before the demand's window passes
    capacity (it opened the gate for the first 3-4 s at 110% on 2 x 16)."""

    def __init__(self) -> None:
        self.open = False
        self.open_ms = -math.inf  # when last seen open
        self.updated_ms = -math.inf
        self._admitted = [0, 0, 0, 0]  # last period's admitted and deep, this period's
        self._period_ms = -math.inf

    def admitted(self, now_ms: float, deep: bool) -> None:
        """A free request admitted; `deep`: beyond the limit, where only the open gate admits."""
        if now_ms - self._period_ms >= OPEN_DEEP_PERIOD_MS:
            fresh = now_ms - self._period_ms < 2 * OPEN_DEEP_PERIOD_MS
            self._admitted = [self._admitted[2], self._admitted[3], 0, 0] if fresh else [0, 0, 0, 0]
            self._period_ms = now_ms
        self._admitted[2] += 1
        self._admitted[3] += deep

    def deep_share(self, now_ms: float) -> float:
        """Of the free admissions of this period and the last (none if the last began two
        periods ago), the share beyond the limit."""
        counts, since = self._admitted, self._period_ms  # one list: a roll replaces it whole
        if now_ms - since >= 2 * OPEN_DEEP_PERIOD_MS:
            return 0.0
        num = counts[0] + counts[2]
        return (counts[1] + counts[3]) / num if num >= OPEN_DEEP_MIN else 0.0

    def update(self, per_second: Sequence[int], into_current_s: float, capacity_rps: float, now_ms: float) -> None:
        self.open = is_open(per_second, into_current_s, capacity_rps) and self.deep_share(now_ms) < OPEN_DEEP_SHARE
        self.updated_ms = now_ms
        if self.open:
            self.open_ms = now_ms

    def admits_deep(self, tier: Tier, now_ms: float) -> bool:
        return self.open if tier == FREE else now_ms - self.open_ms <= OPEN_MEMORY_MS


class SecondCounts:
    """Requests counted per whole second of the clock, as the broker's traffic counters keep
    them (control/broker/traffic.py): the simulator's view for `is_open`."""

    def __init__(self, keep_s: int = OPEN_WINDOW_S) -> None:
        self.keep_s = keep_s
        self._counts: dict[int, int] = {}

    def add(self, now_ms: float) -> None:
        second = int(now_ms // 1000)
        if second not in self._counts:  # a new second: the ones out of the window go (once)
            for old in [k for k in self._counts if k < second - self.keep_s]:
                del self._counts[old]
            self._counts[second] = 0
        self._counts[second] += 1

    def window(self, now_ms: float) -> tuple[list[int], float]:
        """(`is_open`'s counts, how far into the current second)."""
        second = int(now_ms // 1000)
        return [self._counts.get(k, 0) for k in range(second - self.keep_s, second + 1)], (now_ms % 1000) / 1000


def open_position(tier: Tier, budget_ms: float, capacity: Capacity, limits: Limits, paid_rate_rps: float = 0.0) -> int:
    """ADMIT_OPEN's deepest position, where the `OpenGate` admits a request deep: for static
    replicas, every start the budget could hold; a free request still leaves room for the
    paid arrivals expected before the last of them. 0 for a continuous engine, whose limit
    holds (its seats free at every step, which the slots here do not follow)."""
    if capacity.join_ms > 0:
        return 0
    slots = max_slots(budget_ms, capacity, limits) + OPEN_EXTRA_SLOTS
    return min(
        _less_paid_room(tier, slots * capacity.max_batch, slots, capacity, paid_rate_rps), limits.max_queue(tier)
    )


def retry_after_s(position: int, budget_ms: float, capacity: Capacity, limits: Limits) -> int:
    """When a refused request could expect to fit: a slot drains every `interval_ms`."""
    excess = math.ceil(position / capacity.max_batch) - max_slots(budget_ms, capacity, limits)
    return max(1, math.ceil(excess * capacity.interval_ms / 1000.0))


@dataclass(frozen=True)
class TenantPolicy:
    """What one key of a tier may have: settings, per tier."""

    rate_per_s: float = 0.0  # admitted requests per second (0: no limit)
    burst: float = 0.0  # the bucket's size (0: one second of the rate)
    share: float = 0.5  # of the queue a request of its budget may wait behind
    fair_batches: float = 1.0  # queued requests that keep their place, in batches

    @property
    def bucket(self) -> float:
        return self.burst or max(1.0, self.rate_per_s)


@dataclass(frozen=True)
class TenantLimits:
    """One key's limits for a request of a given budget, as the admission script takes them."""

    fair_depth: int  # the key's queued requests that keep their place in line
    max_queued: int  # the most queued requests the key may hold (429 beyond)
    deepest_behind: int  # the deepest position for a request behind other keys' ones


@dataclass(frozen=True)
class Depths:
    """Requests waiting in a model's four lists: each tier, in line and behind."""

    paid: int = 0
    paid_behind: int = 0
    free: int = 0
    free_behind: int = 0


LONE_HORIZON_MS = 1000.0  # a key alone may fill the queue for requests that start this soon
LONE_MEMORY_MS = 30_000.0  # and is alone while no other key of its tier asked for this long


def tenant_limits(
    deepest: int, capacity: Capacity, policy: TenantPolicy, alone: bool = False, horizon_ms: float = 0.0
) -> TenantLimits:
    """A key's share of the queue for a request whose deepest admissible position is `deepest`.

    A key may always hold its fair depth (a batch): with a short queue (a 600 ms budget
    admits two slots, less the paid reserve for a free request) a share of it alone left
    a lone key's batches part empty while its requests were refused. A request behind
    other keys' ones is admitted to the same depth: the lists in line overtake it only
    while other keys have requests there, which their rate bounds.

    A key `alone` in its tier (no other key of the tier asked for `LONE_MEMORY_MS`,
    `LastOtherKey`) may take the whole queue, in line, for a request that starts within
    `LONE_HORIZON_MS` (`horizon_ms`): it is refused only where the queue is full, and its
    newer requests never overtake its older ones (behind the tier, a key's requests wait
    while its own newer ones in line go first; a continuous replica then ended 2.3% of
    them 504 at 110% of capacity). A key that comes later may be refused once, until the
    queue the first filled has started, within the horizon; from its first request the
    first key is back to its share for the memory's length, so a key that asks now and
    then is not refused every time. A longer wait keeps the share, room for keys not seen
    yet."""
    fair = max(1, math.ceil(policy.fair_batches * capacity.max_batch))
    if alone and horizon_ms <= LONE_HORIZON_MS and deepest > fair:
        return TenantLimits(fair_depth=deepest, max_queued=deepest, deepest_behind=deepest)
    return TenantLimits(
        fair_depth=fair,
        max_queued=max(math.floor(policy.share * deepest), fair),
        deepest_behind=deepest,
    )


def latest_start_ms(budget_ms: float, capacity: Capacity, limits: Limits) -> float:
    """How long after its arrival a request of this budget may start at the latest."""
    return budget_ms - limits.margin_ms - capacity.slot_ms - capacity.join_ms


class LastOtherKey:
    """When a key other than a given one last asked for admission in each tier (this
    process's, on the clock given): the last two distinct keys of each tier and when each
    last asked, so a few fields per tier whatever the number of keys."""

    def __init__(self) -> None:
        # (model, tier) -> [latest key, its time, the latest other key's time]
        self._tiers: dict[tuple[str, Tier], list] = {}

    def add(self, model: str, tier: Tier, key: str, now_ms: float) -> None:
        seen = self._tiers.get((model, tier))
        if seen is None:
            self._tiers[(model, tier)] = [key, now_ms, -math.inf]
        elif seen[0] == key:
            seen[1] = max(seen[1], now_ms)
        else:
            self._tiers[(model, tier)] = [key, now_ms, seen[1]]

    def alone(self, model: str, tier: Tier, key: str, now_ms: float, memory_ms: float = LONE_MEMORY_MS) -> bool:
        """No other key of the tier asked within `memory_ms`."""
        seen = self._tiers.get((model, tier))
        if seen is None:
            return True
        other_ms = seen[2] if seen[0] == key else seen[1]
        return now_ms - other_ms > memory_ms


def lane_position(tier: Tier, depths: Depths, behind: bool, bump: bool = False) -> int:
    """1-based queue position of a new request in its list: paid lists before free ones, a
    tier's list of keys in line before its list of requests behind them. Every request in
    line counts for a paid one too, except with `bump` (ADMIT_BUMP), where the free ones
    it would delay too long leave instead."""
    if tier == PAID:
        ahead = depths.paid if bump else depths.paid + depths.free
        return ahead + 1 + (depths.paid_behind if behind else 0)
    ahead = depths.paid + depths.paid_behind + depths.free
    return ahead + 1 + (depths.free_behind if behind else 0)


def take_token(tokens: float, counted_ms: float, now_ms: float, policy: TenantPolicy) -> tuple[float, float]:
    """Refill a key's bucket to `now_ms`: (tokens now, ms until one token is there: 0 if one is).

    A clock that reads earlier than the last count (another gateway's) refills nothing."""
    if policy.rate_per_s <= 0:
        return policy.bucket, 0.0
    elapsed = max(0.0, now_ms - counted_ms)
    level = min(policy.bucket, tokens + elapsed * policy.rate_per_s / 1000.0)
    wait = 0.0 if level >= 1.0 else (1.0 - level) * 1000.0 / policy.rate_per_s
    return level, wait


def decide(tier: Tier, queued: int, depths: Depths, deepest: int, limits: TenantLimits) -> tuple[Verdict, bool, int]:
    """(verdict, behind, position) of a request whose key holds `queued` requests in the
    tier's queue (the script's rule; the rate is checked before it)."""
    behind = queued >= limits.fair_depth
    position = lane_position(tier, depths, behind)
    if position > (limits.deepest_behind if behind else deepest):
        return (Verdict.TENANT_QUEUE_FULL if behind else Verdict.OVERLOADED), behind, position
    if queued >= limits.max_queued:
        return Verdict.TENANT_QUEUE_FULL, behind, position
    return Verdict.ADMIT, behind, position
