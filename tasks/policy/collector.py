"""The batch-forming policy of one replica. Policy code: no Celery, no torch.

A replica holds a buffer of waiting requests. When the replica is free it starts a
batch as soon as the buffer is full (`max_batch`) or the launch time has come:
the oldest request's arrival in the buffer plus `max_wait_ms`, pulled earlier by
the tightest deadline in the buffer (a request must start by its deadline minus
one batch). Arrival in the buffer, not at the gateway: when requests reach the
replica late (a burst, a slow consumer) it still gathers the ones right behind
instead of launching each alone, and the deadline term bounds the wait.
While the buffer holds a `stranded` request (forwarded by a peer region that lost it,
with everything else that waited there), forwarded requests start no `max_wait`: the
replica gathers the burst, up to `STRANDED_GATHER_MS` after the first stranded arrival or
a deadline's last start, instead of starting with its first few. New requests the peer
forwards meanwhile, one every few ms, would otherwise start it. The region's own
requests keep their `max_wait`: a caller that marks its requests stranded delays
forwarded ones by up to `STRANDED_GATHER_MS`, never the region's own.
Paid requests fill a batch before free ones; a free request that has waited
`paid_boost_ms` ranks with a paid one arriving now, so free traffic cannot starve.
A free request `behind` other tenants' ones (its tenant held its fair depth of the queue,
control/policy/admission.py) ranks after every request in line, whatever its age: a replica
that pulled it while the lists in line were empty still runs a newer one in line first.
A paid request behind other paid tenants' ones still ranks as paid: the tier comes
first, and among paid tenants the broker's lanes already keep the order.

Under heavy load replicas of a model that run back-to-back batches lock in phase:
all of them start together, every T, and each request waits for the next common
start. `not_before_ms` (set by the replica from its peers' launches, see
`stagger_from`) holds a batch that is not full until one batch time divided by
the replicas has passed since the latest launch of a peer, so starts spread out
to every T/R; the deadline term still bounds it.

What a batch leaves in the buffer may go back instead of waiting for this replica's next
batch (the replica's `hand_back_rest`): where peers start in between, `pop_rest` hands it
to the front of the shared queue, for the batch that starts next, whoever runs it. Urgency
then looks less far (`urgent_horizon_ms`): what can wait for a peer's start makes room for
a paid request taken late, so paid requests ride the next start and free ones a later one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from control.core.vocab import FREE, PAID, Tier

BEHIND_MS = 1e13  # later than any request in line: epoch ms are ~1.8e12
LAUNCH_LEAD_MS = 10.0  # a batch closed by a deadline launches this long before its last moment
STAGGER_TOLERANCE = 0.1  # of a gap: starts spread this evenly are left where they are
REST_HORIZON = 0.75  # of a slot: how long a request handed back may have to wait for a peer's start
STRANDED_GATHER_MS = 100.0  # a stranded burst reaches a peer within tens of ms: gather it no longer


def recent_launches(peer_launches_ms: list[float], at_ms: float, slot_ms: float) -> list[float]:
    """The peers' launches that still tell a phase at `at_ms`: within two slots of it."""
    return [t for t in peer_launches_ms if at_ms - t < 2 * slot_ms]


@dataclass(slots=True)
class Pending:
    """One request in a replica's buffer."""

    id: str
    tier: Tier
    received_ms: float  # when the gateway admitted it
    deadline_ms: float  # when its client stops waiting
    payload: Any = None  # the job, for the glue
    arrived_ms: float = -1.0  # when it reached this replica's buffer (default: received_ms)
    behind: bool = False  # queued behind other tenants' requests of its tier
    forwarded: bool = False  # sent on by a peer region
    stranded: bool = False  # one of a burst a peer region forwarded after losing it

    def __post_init__(self) -> None:
        if self.arrived_ms < 0:
            self.arrived_ms = self.received_ms

    def rank(self, paid_boost_ms: float) -> float:
        if self.tier == PAID:
            return self.received_ms - paid_boost_ms
        return self.received_ms + (BEHIND_MS if self.behind else 0.0)


@dataclass
class CollectorConfig:
    max_batch: int = 64
    max_wait_ms: float = 20.0
    batch_ms: float = 250.0  # expected time of the next batch
    paid_boost_ms: float = 300.0
    margin_ms: float = 15.0  # slack for the trip back to the client
    stagger_fill: float = 0.5  # stagger starts after a batch at least this full

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if min(self.max_wait_ms, self.batch_ms, self.paid_boost_ms, self.margin_ms, self.stagger_fill) < 0:
            raise ValueError("times must not be negative")


@dataclass
class Collector:
    config: CollectorConfig
    waiting: list[Pending] = field(default_factory=list)
    not_before_ms: float = 0.0  # a batch that is not full starts no earlier (staggering)
    urgent_before_ms: float = 0.0  # a request that must start before this rides the next batch
    last_batch: int = 0  # the size of the last batch popped

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, pending: Pending) -> None:
        self.waiting.append(pending)

    def latest_start_ms(self, pending: Pending) -> float:
        """The last moment a batch holding `pending` may start and still finish in time."""
        return pending.deadline_ms - self.config.batch_ms - self.config.margin_ms

    def is_urgent(self, pending: Pending) -> bool:
        """Must `pending` ride the next batch? Its latest start comes before this replica's
        batch after the next one (`urgent_before_ms`, set by the replica before a take)."""
        return self.latest_start_ms(pending) < self.urgent_before_ms

    def num_free(self) -> int:
        """Free requests that a late paid one would displace from the next batch: those
        that can still wait for the batch after it (an urgent one keeps its place)."""
        return self._num_displaced(lambda p: p.tier == FREE)

    def num_behind(self) -> int:
        """Free requests behind other tenants' ones that a late free one in line would displace."""
        return self._num_displaced(lambda p: p.behind and p.tier == FREE)

    def _num_displaced(self, displaceable: Callable[[Pending], bool]) -> int:
        c = self.config
        urgent_before = self.urgent_before_ms
        urgent = movable = 0
        for pending in self.waiting:
            if pending.deadline_ms - c.batch_ms - c.margin_ms < urgent_before:  # `is_urgent`, inlined
                urgent += 1
            elif displaceable(pending):
                movable += 1
        return max(0, min(movable, c.max_batch - urgent))

    def ids(self) -> list[str]:
        return [p.id for p in self.waiting]

    def expiring_ids(self, now_ms: float) -> list[str]:
        """The requests that a take at `now_ms` drops as expired (`pop_expired`)."""
        cutoff = self.finish_cutoff_ms(now_ms)
        return [p.id for p in self.waiting if p.deadline_ms < cutoff]

    def finish_cutoff_ms(self, now_ms: float) -> float:
        """The earliest deadline a request may have and still finish a batch started now."""
        return now_ms + self.config.batch_ms + self.config.margin_ms

    def launch_at(self) -> float | None:
        """Epoch ms at which a free replica should start a batch; None when empty."""
        if not self.waiting:
            return None
        c = self.config
        # The last start that lets the tightest request finish, less the time between
        # the launch time and the take that checks it (`pop_expired`): launched at its
        # very last moment, it would be taken a moment late and dropped as expired.
        tightest = min(p.deadline_ms for p in self.waiting) - c.batch_ms - c.margin_ms - LAUNCH_LEAD_MS
        first_stranded = min((p.arrived_ms for p in self.waiting if p.stranded), default=None)
        if first_stranded is None:
            oldest: float | None = min(p.arrived_ms for p in self.waiting)
            latest = tightest
        else:
            # The rest of a stranded request's burst is on its way, and a batch started with
            # its first few leaves the others a batch behind: forwarded requests start no
            # `max_wait` then, and the gather has a bound of its own.
            oldest = min((p.arrived_ms for p in self.waiting if not (p.forwarded or p.stranded)), default=None)
            latest = min(tightest, first_stranded + STRANDED_GATHER_MS)
        if oldest is None:
            return latest
        return min(max(oldest + c.max_wait_ms, self.not_before_ms), latest)

    def stagger_from(self, peer_launches_ms: list[float], last_batch: int, now_ms: float) -> None:
        """Set `not_before_ms` from when the other replicas of the model last started.

        Only under heavy load (the last batch at least `stagger_fill` full): at low
        load a request should not wait for a phase. Starts spread to every
        batch time / replicas after the latest peer start.
        """
        c = self.config
        recent = recent_launches(peer_launches_ms, now_ms, c.batch_ms)
        if not recent or last_batch < c.stagger_fill * c.max_batch:
            self.not_before_ms = 0.0
            return
        self.not_before_ms = max(recent) + c.batch_ms / (len(recent) + 1)

    def staggered_start_ms(self, start_ms: float, peer_launches_ms: list[float], slot_ms: float) -> float:
        """When a saturated replica should start the batch it could start at `start_ms`.

        Replicas that run back-to-back full batches keep whatever phase they fell into,
        and when they start together a request just after a start waits a whole slot, and
        a queue admitted for staggered slots fills each of them in part. So under heavy
        load (the last batch at least `stagger_fill` full) a replica whose start falls less
        than a gap (slot / replicas) after a peer's latest launch follows it by that gap.
        Only launches seen count, never one predicted from a peer's slot: of two replicas
        about to start together, the one whose take comes second sees the other's launch
        (the take reads the launches afresh, `Policy.spreads`) and moves; the first sees
        only the other's launch a slot ago and keeps its start (predicted starts made both
        move, and stay in phase). A replica pays one part-slot once; the starts then stay
        spread. A start within `STAGGER_TOLERANCE` of a gap after the peer's stays (jitter
        moves starts by a few ms every slot).
        """
        recent = recent_launches(peer_launches_ms, start_ms, slot_ms)
        if not recent or self.last_batch < self.config.stagger_fill * self.config.max_batch:
            return start_ms
        gap = slot_ms / (len(recent) + 1)
        close = gap * (1 - STAGGER_TOLERANCE)
        staggered = start_ms
        for _ in range(len(recent) + 1):
            moved = False
            for launch in recent:
                if launch <= staggered < launch + close:  # <=: two takes at one instant (the simulator)
                    staggered, moved = launch + gap, True
            if not moved:
                break
        if staggered == start_ms:  # asked at every wake of the loop: most often nothing moves
            return start_ms
        # Never past the last start of the tightest request buffered (`launch_at`'s bound).
        latest = min((self.latest_start_ms(p) - LAUNCH_LEAD_MS for p in self.waiting), default=math.inf)
        return max(start_ms, min(staggered, latest))

    def urgent_horizon_ms(
        self, start_ms: float, peer_launches_ms: list[float], slot_ms: float, share: float = REST_HORIZON
    ) -> float:
        """From a batch's start, how far urgency looks: what must start before then rides
        this batch. With no peer started recently, this replica's next batch, a slot later.
        With peers, what the batch leaves goes back to the queue (`pop_rest`) for a peer's
        start, and only `share` of a slot: a request that can wait that long makes room for
        a paid one taken late."""
        if recent_launches(peer_launches_ms, start_ms, slot_ms):
            return share * slot_ms
        return slot_ms

    def pop_rest(self, launched: set[str]) -> list[Pending]:
        """Take out what a batch left in the buffer, to go back to the front of the shared
        queue: earliest deadline first (the first to be taken again). A second copy of a
        request the batch runs (`launched`) leaves with the rest and is not returned."""
        rest: list[Pending] = []
        seen = set(launched)
        for pending in sorted(self.waiting, key=lambda p: p.deadline_ms):
            if pending.id not in seen:
                seen.add(pending.id)
                rest.append(pending)
        self.waiting = []
        return rest

    def wait_ms(self, now_ms: float) -> float | None:
        """How long a free replica should wait before it starts a batch (0: now)."""
        launch = self.launch_at()
        if launch is None:
            return None
        if len(self.waiting) >= self.config.max_batch:
            return 0.0
        return max(0.0, launch - now_ms)

    def remove(self, ids: set[str]) -> list[Pending]:
        """Take the given requests out of the buffer (cancelled or superseded)."""
        gone = [p for p in self.waiting if p.id in ids]
        if gone:
            self.waiting = [p for p in self.waiting if p.id not in ids]
        return gone

    def pop_expired(self, now_ms: float) -> list[Pending]:
        """Take out the requests that can no longer finish before their deadline."""
        cutoff = self.finish_cutoff_ms(now_ms)
        late = [p for p in self.waiting if cutoff > p.deadline_ms]
        if late:
            self.waiting = [p for p in self.waiting if cutoff <= p.deadline_ms]
        return late

    def pop_batch(self, limit: int | None = None) -> list[Pending]:
        """The next batch: up to `max_batch` (or `limit`) requests. Those that cannot wait
        for the batch after it (`is_urgent`) go first, by deadline; then paid ahead of free,
        with aging. A late paid request so takes the place of a free one only if the free
        one still makes the next batch: priority reorders who waits, and never makes an
        admitted request miss its deadline (earliest deadline first where it must)."""
        boost = self.config.paid_boost_ms
        size = self.config.max_batch if limit is None else min(limit, self.config.max_batch)
        urgent_before = self.urgent_before_ms + self.config.batch_ms + self.config.margin_ms

        def order(p: Pending) -> tuple[int, float]:
            if p.deadline_ms < urgent_before:  # `is_urgent`, inlined: sorted at every take
                return 0, p.deadline_ms
            return 1, p.rank(boost)

        self.waiting.sort(key=order)
        batch: list[Pending] = []
        seen: set[str] = set()
        taken = 0
        for pending in self.waiting:
            if len(batch) == size:
                break
            taken += 1
            if pending.id not in seen:  # a second copy (re-queued while this one waited) runs once
                seen.add(pending.id)
                batch.append(pending)
        self.waiting = self.waiting[taken:]
        if batch:
            self.last_batch = len(batch)
        return batch
