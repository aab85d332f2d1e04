"""The chord collector (`KEYBATCH_COLLECTOR=chord`): each batch runs as a Celery chord.

The design card's "chord-based size-or-deadline collector", built on Celery's public
canvas (`chord`, `group`, signatures) so that it can be measured against the native
collector (docs/decisions/0001). The request path up to the batch is the native one:
the strategy buffers, the collector (tasks/policy/collector.py) says when a batch
closes (`max_batch` requests, or its oldest request's wait and tightest deadline), the
loop takes and claims it. Then, instead of running it:

- the replica sends `chord(group(member(id, deadline, batch_id) ...), batch(batch_id))`
  to its own queue (`chord_queue`), from a thread of its own while the loop thread
  renews the lease: one header task per request (the request itself stays held here);
- each member runs as an ordinary Celery task in the worker's pool: it reads its
  request's cancel key and returns the reason it must not run (cancelled, superseded,
  gone, expired) or None; its result goes to the result backend, and the backend's
  `on_chord_part_return` counts it;
- the last member's count publishes the body, which runs the batch minus the dropped
  requests through the engine and answers each request once through the same delivery
  script (loop.py's `deliver`): the gateway waits on its reply list as with the native
  collector.

A chord's members are fixed by its producer, so the chord cannot be the collector
itself: the gateways' requests have no common producer. What the chord adds per
request is the price measured: a second task message and its pull, a task execution,
a result stored (SETEX and PUBLISH) and counted (the chord script), one cancel read;
per batch, the body's message and the header's results read back.

The loop thread waits for the body (the replica is busy from the take to the answer,
as with the native collector). A replica that is stopping no longer pulls, so a batch
whose chord has not started by then, or whose body has not come by its deadline, runs
without it; whichever of the two takes the batch first runs it, so it is answered once.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery, chord, group
from kombu import Exchange, Queue

from control.broker import keys
from control.core import connect
from control.core import protocol as p
from control.core.settings import Settings
from tasks.policy.collector import Pending
from tasks.replica.intake import held
from tasks.replica.lease import monotonic_ms
from tasks.replica.policies import Phases, StaticPolicy

if TYPE_CHECKING:
    from tasks.replica.core import ReplicaCore
    from tasks.replica.replica import Replica

log = logging.getLogger(__name__)

MEMBER_TASK = "keybatch.chord.member"
BATCH_TASK = "keybatch.chord.batch"
RESULT_PREFIX = keys.key("chord") + ":"  # the result backend's keys and channels (the replica's ACL)
RESULT_EXPIRES_S = 60  # a header's results and counters outlive their batch by this much at most
POOL_THREADS = 4  # the members and the body run in the worker's pool, beside the consumer
WAIT_STEP_S = 0.02  # the loop thread renews its lease this often while a chord runs
HOP_START_MS = 50.0  # the chord's hop before one is measured (`ChordPolicy._hop`)
HOP_WEIGHT = 0.3  # of the newest measure in the estimate
LATE_MS = 1000.0  # a body this late after the batch's last deadline is not awaited


def chord_queue(replica: str) -> str:
    """The replica's own queue: its chords' members and body run where its batch is held."""
    return f"{p.PREFIX}.chord.{replica}"  # like the model queues (kombu's routing reads ':')


def configure(app: Celery, settings: Settings, replica: str) -> None:
    """Give the worker's app what a chord needs: a result backend (the broker's Valkey,
    under the request path's prefix), the member and body tasks, the replica's chord
    queue (no broker acks, like the model queues). The worker consumes that queue before
    the model's and runs a thread pool (`POOL_THREADS`), so that the consumer keeps
    pulling while the members and the body run."""
    url, options = connect.kombu_broker(settings.broker)
    queue = chord_queue(replica)
    app.conf.update(
        result_backend=url,
        result_backend_transport_options={"global_keyprefix": RESULT_PREFIX, **_sentinel(options)},
        result_expires=RESULT_EXPIRES_S,
        task_queues=[*app.conf.task_queues, Queue(queue, Exchange(""), routing_key=queue, no_ack=True)],
    )
    for name in ("celery.app.trace", "celery.worker.strategy"):  # a line per task received and run
        logging.getLogger(name).setLevel(logging.WARNING)
    # No task events of their own: the replica sends its requests' (CeleryEvents).
    app.task(name=MEMBER_TASK, bind=True, ignore_result=False, send_events=False)(_member)
    app.task(name=BATCH_TASK, bind=True, ignore_result=True, send_events=False)(_batch)


def _sentinel(options: dict[str, object]) -> dict[str, object]:
    return {"master_name": options["master_name"]} if "master_name" in options else {}


def attach(replica: Replica, app: Celery) -> ChordPolicy:
    """Run `replica`'s batches as chords: its loop's policy becomes `ChordPolicy`, and its
    pull gate stays open while a chord of its own is still to be pulled (the consumer
    pulls the chord queue and the model queue together, the chord queue first). Static
    batches only: a continuous engine's requests join between steps, not as a batch."""
    if replica.engine.continuous:
        raise ValueError("the chord collector runs static batches; this replica's engine is continuous")
    policy = ChordPolicy(replica, replica.loop, replica.intake.hold, app, chord_queue(replica.name))
    replica.loop.policy = policy
    replica.intake.copyable = False  # a chord's members are its own batch: no copies are made
    wants = replica.wants_messages
    replica.wants_messages = lambda: policy.num_unpulled() > 0 or wants()  # type: ignore[method-assign]
    app.keybatch_chord = policy
    return policy


@dataclass
class ChordBatch:
    """One batch sent as a chord: run once, by its body or by the loop thread."""

    batch: list[Pending]
    started_ms: float
    num_unpulled: int  # its members and body not yet started in the pool
    sent_ms: float = field(default_factory=monotonic_ms)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    _taken: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken


class ChordPolicy(StaticPolicy):
    """The static policy whose batch runs as a chord (module docstring)."""

    def __init__(
        self, replica: ReplicaCore, loop: Phases, hold: Callable[[list[p.Job]], None], app: Celery, queue: str
    ) -> None:
        super().__init__(replica, loop, hold)
        self.app = app
        self.queue = queue
        self.batches: dict[str, ChordBatch] = {}
        self._lock = threading.Lock()
        self.num_chords = 0
        self.num_ran_without = 0  # batches run by the loop thread (stopping, or the body late)
        self.base_margin_ms = replica.collector.config.margin_ms
        self.hop_ms = HOP_START_MS
        self._hop(HOP_START_MS)

    def _hop(self, measured_ms: float) -> None:
        """The chord's time from its send to its body (members pulled, run, counted; the
        body published and pulled) is time a batch does not run: it joins the collector's
        margin, so a batch closed by its tightest deadline still ends before it."""
        self.hop_ms += HOP_WEIGHT * (measured_ms - self.hop_ms)
        self.replica.collector.config.margin_ms = self.base_margin_ms + self.hop_ms
        log.debug("chord hop %.1f ms, estimate %.1f ms", measured_ms, self.hop_ms)

    def num_unpulled(self) -> int:
        with self._lock:
            return sum(b.num_unpulled for b in self.batches.values())

    def hedge_finish_ms(self, now_ms: float) -> float | None:
        """A chord's members are its own batch's requests: no second copies here."""
        return None

    def pop(self, now_ms: float) -> list[Pending]:
        """The static policy's pop; the pull gate expects the batch to end a hop later."""
        batch = super().pop(now_ms)
        if batch:
            self.replica.start_batch(now_ms, self.replica.engine.expected_batch_ms() + self.hop_ms)
        return batch

    def run(self, batch: list[Pending], turn_started_ms: float) -> None:
        if not batch:
            return
        r = self.replica
        if r.stopping:  # the consumer no longer pulls: the chord would never start
            self.num_ran_without += 1
            super().run(batch, turn_started_ms)
            return
        batch_id = uuid.uuid4().hex
        state = ChordBatch(batch, turn_started_ms, len(batch) + 1)
        with self._lock:
            self.batches[batch_id] = state
        sender = threading.Thread(target=self._send, args=(batch_id, state), name=f"chord-{r.name}", daemon=True)
        sender.start()  # publishing a whole header can outlast the lease: the loop renews it meanwhile
        self.num_chords += 1
        self._await(batch_id, state)

    def _send(self, batch_id: str, state: ChordBatch) -> None:
        """Publish the chord (one message per member, then its size in the backend); a
        failure goes to the loop thread, whose fail path answers the batch."""
        q = self.queue
        member, body = self.app.tasks[MEMBER_TASK], self.app.tasks[BATCH_TASK]
        header = group(
            member.s(pd.id, pd.deadline_ms, batch_id).set(queue=q, argsrepr=pd.id, kwargsrepr="") for pd in state.batch
        )
        try:
            chord(header, body.s(batch_id).set(queue=q)).apply_async()
        except Exception as exc:
            if state.take():
                self._forget(batch_id)
                state.error = exc
                state.done.set()

    def _await(self, batch_id: str, state: ChordBatch) -> None:
        """Wait for the body to run the batch, renewing the lease; run it here if the
        replica stops or the body is late past the batch's last deadline."""
        r = self.replica
        give_up_ms = max(pd.deadline_ms for pd in state.batch) + LATE_MS
        while not state.done.wait(WAIT_STEP_S):
            r.renew_lease_if_due()
            if (r.stopping or r.clock.now_ms() > give_up_ms) and state.take():
                log.warning("chord %s did not start; its batch runs without it", batch_id)
                self._forget(batch_id)
                self.num_ran_without += 1
                super().run(state.batch, state.started_ms)
                return
        if state.error is not None:
            raise state.error  # the loop's fail path answers the batch

    def _forget(self, batch_id: str) -> ChordBatch | None:
        with self._lock:
            return self.batches.pop(batch_id, None)

    def _pulled(self, batch_id: str) -> None:
        with self._lock:
            state = self.batches.get(batch_id)
            if state is not None and state.num_unpulled > 0:
                state.num_unpulled -= 1

    # -- in the worker's pool: the chord's tasks -----------------------------------

    def check(self, request_id: str, deadline_ms: float, batch_id: str) -> str | None:
        """A member: why its request must not run (None: it runs)."""
        self._pulled(batch_id)
        r = self.replica
        reason = r.broker.cancels_and_paid(r.model, [request_id], 0)[0].get(request_id)
        # The hop is behind it now: the collector's margin less the hop.
        if reason is None and r.clock.now_ms() + r.collector.config.batch_ms + self.base_margin_ms > deadline_ms:
            reason = "expired"
        return reason

    def run_members(self, batch_id: str, reasons: list[str | None]) -> None:
        """The body: answer the dropped requests, run the rest."""
        self._pulled(batch_id)
        state = self._forget(batch_id)
        if state is not None:
            self._hop(monotonic_ms() - state.sent_ms)
        if state is None or not state.take():
            return  # run by the loop thread already, or a stale body after a restart
        try:
            dropped = {pd.id: reason for pd, reason in zip(state.batch, reasons, strict=True) if reason}
            kept = [pd for pd in state.batch if pd.id not in dropped]
            self._drop([pd for pd in state.batch if pd.id in dropped], dropped)
            if kept:
                super().run(kept, state.started_ms)
            elif not self.running():  # the engine may still run the batch before
                self.replica.busy = False
                self.replica.rejoin_idle()
                self.replica.wake()
        except Exception as exc:  # handed to the loop thread, whose fail path answers
            state.error = exc
        finally:
            state.done.set()

    def _drop(self, gone: list[Pending], reasons: dict[str, str]) -> None:
        if not gone:
            return
        r = self.replica
        notices = [p.Dropped(id=pd.id, reason=reasons[pd.id], replica=r.name) for pd in gone]
        r.broker.reply(notices, [held(pd).job for pd in gone])
        for reason in set(reasons.values()):
            same = [pd for pd in gone if reasons[pd.id] == reason]
            r.stats.dropped[reason] += len(same)
            r.events.revoked(same, reason)


def _policy(app: Celery) -> ChordPolicy:
    policy: ChordPolicy | None = getattr(app, "keybatch_chord", None)
    if policy is None:
        raise RuntimeError("a chord task reached a worker whose replica has not started")
    return policy


def _member(self: Any, request_id: str, deadline_ms: float, batch_id: str) -> str | None:
    """Header task of a batch's chord: its request's reason not to run, or None."""
    return _policy(self.app).check(request_id, deadline_ms, batch_id)


def _batch(self: Any, reasons: list[str | None], batch_id: str) -> None:
    """Body of a batch's chord: runs the batch, minus the requests its members dropped."""
    _policy(self.app).run_members(batch_id, reasons)
