"""When a replica's consumer may take another request from the shared queue. Policy
code: no Celery, no Redis, no torch; time comes from the caller.

Replicas of a model share one queue, and what a replica has pulled only it can run.
So a replica pulls what it can start soon, and leaves the rest to whichever replica
starts next:

- An idle replica pulls up to two batches (one while it holds its next batch back to
  spread the starts: it starts one batch, later).
- A busy one pulls at most one next batch, from `lead_ms` before it expects to be free,
  so its next batch is buffered when the running one ends. What arrives earlier waits
  in the shared queue, where a paid request still goes ahead of every free one, and
  the take fills the seats the buffer leaves empty (`ReplicaBroker.take`). An idle
  peer takes everything (low load: idle replicas first): with `lead_yields` a busy
  replica does not pull in its lead while an idle peer listens for the model's
  arrivals (SINGLE_LISTENER), or the arrivals it took would leave the listener's batch
  part empty and the idle replicas idle.
- With `early` (PULL_EARLY), a busy replica that no other frees before pulls its next
  batch at once: what arrives goes to whichever replica starts next, but into a buffer
  filled with free requests long before it starts, which a paid request arriving later
  can displace only where they could wait a whole slot more.
- A continuous engine pulls enough to fill its free slots (with those the step under
  way frees), and one behind them: no more waits in its buffer for a slot that frees
  later while another replica's is free.

The replica tells the gate when a batch starts and ends and what it learned about its
peers (on the broker round trips it makes anyway); the consumer's loop asks `wants`
before every pull, and `reopens_at` when the answer is no, to set a timer.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

_SLACK_MS = 1.0  # the bisection looks this much wider (epoch ms round to 1e-4); each found is checked exactly


@dataclass
class PullGate:
    max_batch: int
    lead_ms: float = 40.0
    busy: bool = False
    holding: bool = False  # idle, its next batch held back to spread the starts: it pulls one batch
    early: bool = False  # busy, it pulls before `lead_ms` too where no busy peer frees first (PULL_EARLY)
    stopping: bool = False
    # SINGLE_LISTENER: idle with nothing gathered, it pulls only while it holds its model's
    # listener token (another idle replica listens otherwise); busy ones pull from their lead.
    listens: bool = True
    # LEAD_YIELDS (with SINGLE_LISTENER): in its lead, a busy replica pulls only while no
    # idle peer listens, as last read (`listener_elsewhere`, assumed at each batch's start).
    lead_yields: bool = False
    listener_elsewhere: bool = False
    ends_at_ms: float = 0.0  # when the running batch is expected to end
    peer_idle: bool = True  # until the first batch says otherwise
    peer_launches: list[float] = field(default_factory=list)  # when the model's other replicas last started

    def __post_init__(self) -> None:
        self.peer_launches = sorted(self.peer_launches)  # in order: the peers' ends are found by bisection

    @property
    def pull_at_ms(self) -> float:
        return self.ends_at_ms - self.lead_ms

    def start(self, now_ms: float, batch_ms: float) -> None:
        """A batch (or the first request on a continuous engine) starts now."""
        self.busy = True
        self.ends_at_ms = now_ms + batch_ms
        self.listener_elsewhere = self.lead_yields  # until its lead reads the token

    def finish(self) -> None:
        self.busy = False

    def peers(self, idle: bool | None = None, launches: list[float] | None = None) -> None:
        """What the last broker round trip said of the other replicas of the model."""
        if idle is not None:
            self.peer_idle = idle
        if launches is not None:
            self.peer_launches = sorted(launches)

    def wants(self, now_ms: float, buffered: int, batch_ms: float) -> bool:
        """May a static-batching replica with `buffered` requests pull another now?"""
        if self.stopping:
            return False
        if not self.busy:
            if not buffered and not self.listens:
                return False
            return buffered < (1 if self.holding else 2) * self.max_batch
        if buffered >= self.max_batch:
            return False
        if now_ms >= self.ends_at_ms - self.lead_ms:  # `pull_at_ms`, asked before every pull
            return not (self.lead_yields and self.listener_elsewhere)
        return self.early and not self.peer_idle and not self._num_peers_free_first(now_ms, batch_ms)

    def wants_continuous(self, buffered: int, free_slots: int) -> bool:
        """May a continuous engine's replica pull another now?"""
        if self.stopping:
            return False
        return buffered < free_slots + 1  # and one behind a full engine, for the seat that frees first

    def peers_free_first(self, now_ms: float, batch_ms: float) -> list[float]:
        """The expected ends of the peers' batches that fall between now and this replica's end."""
        return [t + batch_ms for t in self._peers_between(now_ms, batch_ms)]

    def _num_peers_free_first(self, now_ms: float, batch_ms: float) -> int:
        return len(self._peers_between(now_ms, batch_ms))

    def _peers_between(self, now_ms: float, batch_ms: float) -> list[float]:
        """The starts of the peers' batches that end in (now, this replica's end): asked
        before every pull, so narrowed by bisection in the sorted starts, then checked
        exactly (an end that falls on now or on this end does not count)."""
        launches, ends_at = self.peer_launches, self.ends_at_ms
        lo = bisect_left(launches, now_ms - batch_ms - _SLACK_MS)
        hi = bisect_right(launches, ends_at - batch_ms + _SLACK_MS)
        return [t for t in launches[lo:hi] if now_ms < t + batch_ms < ends_at]

    def reopens_at(self, now_ms: float, buffered: int, batch_ms: float) -> float | None:
        """When a shut gate opens again by itself (None: not before work leaves)."""
        if not self.busy or self.stopping:
            return None
        if buffered >= self.max_batch:
            return self.ends_at_ms
        if not self.early:
            return self.pull_at_ms
        first = self.peers_free_first(now_ms, batch_ms)
        return min(self.pull_at_ms, max(first)) if first and not self.peer_idle else self.pull_at_ms
