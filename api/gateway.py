"""The gateway's side of the request path: admit, enqueue, wait, and route replies.

Each gateway process has an id and one reply list in each cell's broker. Replicas push
one message per batch onto it; one listener thread per cell reads it and wakes the
waiting requests through an in-process map from request id to waiter. Cancels and
supersedes are routed the same way, to whichever gateway holds the request. A request
waits in one cell at a time: its own (api/cells.py, control/policy/cells.py), or the next
that answers while its own does not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import redis
from celery import Celery

from api.cells import Cell
from api.errors import ApiError
from api.metrics import Metrics
from control.broker import keys, traffic
from control.broker.envelope import TaskMessages
from control.broker.lua import OWNER_SLACK_MS
from control.broker.registry import FleetViews
from control.broker.scripts import Admission, BumpTerms, RescueOffer, TenantTerms
from control.core import protocol as p
from control.core.clock import BrokerClock, Clock
from control.core.settings import Settings
from control.core.vocab import FREE, PAID, TIERS, Tier
from control.policy import admission, reuse
from control.policy.admission import Capacity, Limits, Verdict
from control.policy.cells import cell_order

log = logging.getLogger(__name__)

FRESH_DEPTH_MS = 20.0  # queue depths seen this recently are trusted to refuse without Redis
EARLY_KEEP_S = 2.0  # an answer kept for joins of its request that have not registered yet
EARLY_REWAITS = 2  # a wait that ends before the clock reads the deadline waits again, so often

Item = p.Result | p.Dropped | p.Cancelled | p.Failed


@dataclass
class Waiter:
    """One connection waiting in this process for the answer of attempt `attempt`."""

    job: p.Job
    request_id: str  # as the caller names it, echoed in the answer
    attempt: str = ""
    event: threading.Event = field(default_factory=threading.Event)
    item: Item | None = None
    news: threading.Event = field(default_factory=threading.Event)  # a chunk or the answer came
    chunks: list[p.Chunk] = field(default_factory=list)  # streamed text not yet sent on
    enqueued: bool = False  # this process pushed its message (RESCUE may push it again)
    behind: bool = False  # it waits behind other tenants' requests of its tier (their list)
    cell: int = 0  # the cell it waits in
    session: str | None = None  # its tenant-scoped session, if it named one

    def __post_init__(self) -> None:
        self.attempt = self.attempt or self.job.id

    def resolve(self, item: Item) -> None:
        if self.item is None:
            self.item = item
            self.event.set()
            self.news.set()

    def add_chunk(self, chunk: p.Chunk) -> None:
        if self.item is None and self.job.stream:
            self.chunks.append(chunk)
            self.news.set()

    def take_chunks(self) -> list[p.Chunk]:
        """The chunks that came since the last call (the caller's thread only clears `news`)."""
        self.news.clear()
        chunks, self.chunks = self.chunks, []
        return chunks


STALE_CHECKS = 8  # a tenant's oldest queued entries checked per admission at its fair depth
RESCUE_AFTER_S = 0.03  # a RESCUE round looks, then pushes back what it saw still unrecorded this much later
# A second round after a death: a stopped replica's last pull, sent before its pulse lapsed,
# may take an arrival until it times out on the broker (PULL_WAIT_S, and one broker tick).
RESCUE_AGAIN_S = 2 * p.PULL_WAIT_S
RESCUE_CHUNK = 1000  # requests per RESCUE call (each call may read the queue once)
NO_REPLICA_RECHECK_S = 0.02  # a request that finds no replica reads the registry again if its view is older
MOVE_AFTER_S = 0.1  # a cell silent this long after a failed call: its waiting requests go to another
SWEEP_LOCK_MS = 90  # one gateway process sweeps a cell in each span this long (each asks every 100 ms)
_NEXT_CELL = ("broker_unavailable", "no_replica")  # refusals after which a request tries the next cell


class Gateway:
    def __init__(
        self, settings: Settings, clients: redis.Redis | list[redis.Redis], celery: Celery, clock: Clock
    ) -> None:
        self.settings = settings
        clients = clients if isinstance(clients, list) else [clients]
        self.cells = [Cell(i, c, settings.broker_timeout_ms, settings.admit_phased) for i, c in enumerate(clients)]
        self.celery = celery
        self.clock = clock
        self.id = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
        self.fleet = FleetViews([cell.fleet for cell in self.cells])
        self.metrics = Metrics(self.fleet)
        self.limits = Limits(settings.max_queue_paid, settings.max_queue_free, settings.deadline_margin_ms)
        self.waiters: dict[str, list[Waiter]] = {}  # by attempt (unique across cells)
        self._lost: dict[int, list[Waiter]] = {}  # by cell: requests its broker lost, not yet enqueued again
        self._early: dict[str, tuple[Item, float]] = {}  # answers kept for joins not yet registered
        # Admissions with a client's id between their script call and their registration, by key.
        self._joining: dict[str, int] = {}
        self._tenants = {tier: _tenant_policy(settings, tier) for tier in TIERS}
        self._other_keys = admission.LastOtherKey()  # who asked lately, per tier (this process)
        # Set by the server: False once this process was told to stop (it then
        # finishes what it holds but admits nothing new, and /readyz says so).
        self.is_serving: Callable[[], bool] = lambda: True
        self._lock = threading.Lock()
        self._started = False
        self._task_message = TaskMessages(celery)

    def start(self) -> None:
        """Start the listener, the health loop and the fleet view (once, in the serving process)."""
        if self._started:  # every request asks: no lock once started
            return
        with self._lock:  # held through the first registry read: no request sees an empty fleet
            if self._started:
                return
            for cell in self.cells:
                cell.fleet.start()
            self._sync_clock()
            for cell in self.cells:
                name = f"cell-{cell.index}"
                threading.Thread(target=self._listen, args=(cell,), name=f"{name}-replies", daemon=True).start()
                threading.Thread(target=self._watch_broker, args=(cell,), name=f"{name}-health", daemon=True).start()
            self._started = True

    def _sync_clock(self) -> None:
        if not isinstance(self.clock, BrokerClock):
            return
        for _ in range(3):
            try:
                self.clock.sync()
            except redis.RedisError:
                log.warning("could not read the broker's clock")
                return

    # -- typed-through reuse (control/policy/reuse.py) ------------------------------

    def reuse(self, job: p.Job, session_key: str) -> tuple[p.Result, int] | None:
        """The rest of the session's last completion, when this request's prompt only adds
        a start of it, and the cell that keeps the session; None: the model answers it. A
        request answered so supersedes the session's request in flight, as admission would."""
        window_ms = int(self.settings.reuse_window_s * 1000)
        cell = self._session_cell(job, session_key)
        if cell is None:
            return None
        options = _options(job)
        try:
            raw = cell.redis.get(keys.last_key(session_key))
            previous = reuse.parse(raw) if raw is not None else None
            rest = reuse.typed_through(previous, options, job.prompt) if previous is not None else None
            if previous is None or rest is None:
                return None
            ttl_ms = int(job.deadline_ms - job.received_ms) + OWNER_SLACK_MS
            cell.supersede(keys.session_key(session_key), job.key, ttl_ms)
            kept = reuse.remember(options, job.prompt, rest, previous.finish_reason)
            cell.redis.set(keys.last_key(session_key), reuse.pack(kept), px=window_ms)
        except redis.RedisError as exc:
            cell.health.failed(exc)
            return None
        cell.health.ok()
        now = self.clock.now_ms()
        result = p.Result(
            id=job.id,
            text=rest,
            finish_reason=previous.finish_reason,
            prompt_tokens=0,
            completion_tokens=0,
            replica="",
            backend="reused",
            batch_size=0,
            batch_start_ms=now,
            batch_end_ms=now,
            reused=True,
        )
        return result, cell.index

    def _session_cell(self, job: p.Job, session_key: str) -> Cell | None:
        """The cell that keeps the session's last completion, where reuse applies to this
        request: on, not a stream, not a request id whose answer is kept (its retries get
        that answer), and the cell not down."""
        if self.settings.reuse_window_s <= 0 or job.stream or job.keep_ms > 0:
            return None
        cell = self.cells[cell_order(session_key, len(self.cells))[0]]
        return None if cell.health.is_down else cell

    def remember(self, job: p.Job, session_key: str, result: p.Result) -> None:
        """Keep a session's completion for its next request (`reuse`)."""
        window_ms = int(self.settings.reuse_window_s * 1000)
        cell = self._session_cell(job, session_key)
        if cell is None or not result.text:
            return
        kept = reuse.remember(_options(job), job.prompt, result.text, result.finish_reason)
        try:
            cell.redis.set(keys.last_key(session_key), reuse.pack(kept), px=window_ms)
        except redis.RedisError as exc:
            cell.health.failed(exc)
            log.warning("could not keep a session's completion for reuse")

    # -- submit ----------------------------------------------------------------

    def submit(self, job: p.Job, request_id: str, session_key: str | None) -> Waiter:
        """Admit and enqueue one request, or join the attempt in flight under its key;
        raise ApiError if it cannot be taken. The request's own cell first; the next one
        where that cell's broker does not answer or no replica there serves the model, and
        once where its queue is too deep for the request's budget (a lost cell's requests
        arriving at the others all at once, a cell hotter than the rest); a second cell
        too deep refuses it."""
        self.start()
        if not self.is_serving():
            raise ApiError(503, "the gateway is shutting down", "shutting_down", retry_after_s=1)
        order = [self.cells[i] for i in cell_order(session_key or job.key, len(self.cells))]
        live = [cell for cell in order if not cell.health.is_down]
        if not live:
            raise _broker_down(None)
        refusal: ApiError | None = None
        overloaded: ApiError | None = None
        for cell in live:
            is_last = cell is live[-1]
            try:
                return self._submit_to(
                    cell, job, request_id, session_key, is_last, spills=overloaded is None and not is_last
                )
            except ApiError as err:
                if err.code == "overloaded":
                    if overloaded is not None:
                        break
                    overloaded = err
                elif err.code not in _NEXT_CELL:
                    raise
                elif refusal is None or err.code != "no_replica":  # a broker down says more
                    refusal = err
        final = refusal or overloaded  # a cell down or without a replica: a peer region may serve it
        assert final is not None
        raise final

    def _submit_to(
        self,
        cell: Cell,
        job: p.Job,
        request_id: str,
        session_key: str | None,
        is_last: bool = True,
        spills: bool = False,
    ) -> Waiter:
        """Admit the request in `cell`, or raise its refusal; one the next cell may still
        take (no replica here, or, where it `spills`, too deep) is not counted."""
        budget = job.deadline_ms - job.received_ms
        capacity = self._capacity(cell, job.model)
        verdict, position, retry_ms = admission.check(budget, capacity, self.limits), 0, 0.0
        waiter: Waiter | None = None
        if verdict == Verdict.ADMIT:
            now = self.clock.now_ms()
            # Every key that asks is seen, refused or not: one refused while another fills
            # the queue puts that one back to its share.
            self._other_keys.add(job.model, job.tier, p.tenant_of(job.key), now)
            deepest, limit = self._deepest(cell, job, budget, capacity, now)
            position = self._recent_position(cell, job, self._bumps(capacity))
            if position > deepest:  # the queue was this deep a moment ago: refuse without a round trip
                verdict = Verdict.OVERLOADED
        if verdict == Verdict.ADMIT:
            waiter = Waiter(job, request_id, cell=cell.index, session=session_key)
            self._register(waiter)  # before the enqueue: a reply may come at once
            verdict = Verdict.OVERLOADED  # until the enqueue says otherwise (or raises)
            try:
                verdict, position, retry_ms = self._enqueue(cell, waiter, session_key, deepest, capacity)
            finally:
                if verdict != Verdict.ADMIT:
                    self._forget(waiter)
            gate = cell.open_gates.get(job.model)
            if verdict == Verdict.ADMIT and job.tier == FREE and gate is not None and position > 0:
                gate.admitted(time.monotonic() * 1000, position > limit)  # (0: it joined one in line)
        if job.tier == PAID and verdict in (Verdict.ADMIT, Verdict.OVERLOADED):
            # Paid requests count for the free tier's reserve when admitted or refused for
            # want of room (a free key filling the queue must not hide them), not when
            # refused by their own key's limits.
            cell.paid_rate[job.model].add(self.clock.now_ms())
        if cell.fleet.phased:  # the demand, admitted or not: ADMIT_PHASED counts phases below capacity
            cell.demand.setdefault(job.model, admission.RateMeter()).add(self.clock.now_ms())
        if self.settings.admit_open:  # the demand, admitted or not: ADMIT_OPEN admits deeper below capacity
            with cell.arrivals_lock:
                cell.arrivals[traffic.asked_field(job.model)] += 1
        if verdict == Verdict.ADMIT and waiter is not None:
            self.metrics.inflight.inc()
            return waiter
        if not (verdict == Verdict.NO_REPLICA and not is_last or verdict == Verdict.OVERLOADED and spills):
            self.metrics.of(self.metrics.rejected, job.model, job.tier, verdict.name.lower()).inc()
        raise _refusal(verdict, budget, capacity, self.limits, position, retry_ms)

    def _capacity(self, cell: Cell, model: str) -> Capacity:
        if not cell.fleet.is_reachable and len(self.cells) > 1:
            return Capacity(0, 1, 1.0)  # its registry could not be read: the other cells serve
        capacity = cell.fleet.capacity(model)
        if capacity.num_replicas == 0 and cell.fleet.age_s() > NO_REPLICA_RECHECK_S:
            # The view is refreshed every 250 ms: a replica that registered since (a fleet
            # starting, a replica back from a restart) must not be refused 503 meanwhile.
            cell.fleet.refresh(direct=True)
            capacity = cell.fleet.capacity(model)
        return capacity

    def _deepest(self, cell: Cell, job: p.Job, budget_ms: float, capacity: Capacity, now_ms: float) -> tuple[int, int]:
        """The deepest position in the cell's queue at which the request may be admitted, and
        the limit at which it still fits at the worst phase (the same, unless ADMIT_OPEN's
        gate admits it deeper)."""
        # Each process sees its share of the paid traffic (connections spread evenly).
        meter = cell.paid_rate.setdefault(job.model, admission.RateMeter())
        paid_rate = meter.rate(now_ms) * self.settings.api_processes
        demand = cell.demand.get(job.model)
        demand_rps = demand.rate(now_ms) * self.settings.api_processes if demand is not None else None
        bump = self._bumps(capacity)
        limit = admission.max_position(job.tier, budget_ms, capacity, self.limits, paid_rate, now_ms, demand_rps, bump)
        if self.settings.admit_open and self._admits_deep(cell, job):
            return max(limit, admission.open_position(job.tier, budget_ms, capacity, self.limits, paid_rate)), limit
        return limit, limit

    def _admits_deep(self, cell: Cell, job: p.Job) -> bool:
        """ADMIT_OPEN's gate, on the cell's demand as every gateway counted it (a process
        sees only its share of the connections, and not an even one); shut where the
        model's demand was not read for a second (the broker did not answer, or the model
        had no replica ready)."""
        gate = cell.open_gates.get(job.model)
        now_ms = time.monotonic() * 1000
        return gate is not None and now_ms - gate.updated_ms <= 1000.0 and gate.admits_deep(job.tier, now_ms)

    def _read_asked(self, cell: Cell) -> None:
        """Every gateway's requests asked of the cell per second, and each model's gate."""
        cell.asked_tried = time.monotonic()  # a failed read is not tried again at once
        models = sorted(cell.fleet.ready)
        if not models:
            return
        now_ms = self.clock.now_ms()
        counts = traffic.read_asked(cell.prober, models, now_ms, admission.OPEN_WINDOW_S)
        into_s = (now_ms % 1000) / 1000
        read_ms = time.monotonic() * 1000
        for model, per_second in counts.items():
            rate = self._capacity(cell, model).requests_per_s
            cell.open_gates.setdefault(model, admission.OpenGate()).update(per_second, into_s, rate, read_ms)

    def _bumps(self, capacity: Capacity) -> bool:
        """ADMIT_BUMP applies: static replicas serve the model (a continuous engine's seats
        free at every step, which the script's count of slots does not follow)."""
        return self.settings.admit_bump and capacity.join_ms <= 0

    def _register(self, waiter: Waiter) -> None:
        with self._lock:
            self.waiters.setdefault(waiter.attempt, []).append(waiter)
            early = self._early.get(waiter.attempt)  # kept for every join of the attempt, not the first
        if early is not None:
            waiter.resolve(early[0])

    def _forget(self, waiter: Waiter) -> None:
        with self._lock:
            group = self.waiters.get(waiter.attempt, [])
            if waiter in group:
                group.remove(waiter)
            if not group:
                self.waiters.pop(waiter.attempt, None)

    def _recent_position(self, cell: Cell, job: p.Job, bump: bool) -> int:
        """The request's queue position by the cell's last admission's counts, if they are
        fresh: in line (a request behind other tenants' ones only waits longer)."""
        depths, at_ms = cell.depth.get(job.model, (admission.Depths(), 0.0))
        if self.clock.now_ms() - at_ms > FRESH_DEPTH_MS:
            return 0
        return admission.lane_position(job.tier, depths, behind=False, bump=bump)

    def _enqueue(
        self, cell: Cell, waiter: Waiter, session_key: str | None, deepest: int, capacity: Capacity
    ) -> tuple[Verdict, int, float]:
        """One round trip admits the request and enqueues its Celery task, or neither; or
        joins the attempt in flight under the same key, or finds its stored answer.
        (verdict, queue position, ms until the tenant's rate admits one more)."""
        job = waiter.job
        ttl = int(job.deadline_ms - job.received_ms) + OWNER_SLACK_MS
        message = self._task_message(job)
        _check_size(message, self._max_message_bytes(job.tier))
        tenant = p.tenant_of(job.key)
        fingerprint = body_fingerprint(job) if job.keep_ms else ""  # only a client's own id is joined
        now = self.clock.now_ms()
        lane = keys.lane_keys(job.model, job.tier)
        if fingerprint:
            self._joins(job.key, +1)
        try:
            try:
                status, paid, free, paid_behind, free_behind, extra = cell.admit(
                    owner_key=keys.owner_key(job.key),
                    waiting_paid=lane.waiting_paid,
                    waiting_free=lane.waiting_free,
                    queue=lane.queue,
                    session=keys.session_key(session_key) if session_key else None,
                    fingerprint=fingerprint,
                    ttl_ms=ttl,
                    deadline_ms=job.deadline_ms,
                    attempt=job.id,
                    tier=job.tier,
                    deepest=deepest,
                    now_ms=now,
                    message=message,
                    keeps_answer=bool(job.keep_ms),
                    gateway=self.id,
                    tenant=self._tenant_terms(job, lane, tenant, deepest, capacity, now),
                    bump=self._bump_terms(capacity),
                )
            except redis.exceptions.OutOfMemoryError as exc:
                cell.health.ok()  # it answered: full (its memory limit), not down
                raise ApiError(503, "the broker is full; retry shortly", "broker_unavailable", retry_after_s=1) from exc
            except redis.RedisError as exc:
                cell.health.failed(exc)
                raise _broker_down(exc) from exc
            cell.health.ok()
            if status == Admission.ANSWERED:  # answered within the idempotency window: the same answer again
                waiter.resolve(p.Result.model_validate_json(extra))
                return Verdict.ADMIT, 0, 0.0
            if status == Admission.JOINED:  # joined the attempt in flight
                self._forget(waiter)
                waiter.enqueued = False  # the attempt it joined is the enqueuer's to rescue
                waiter.attempt = extra.decode()
                self._register(waiter)
                return Verdict.ADMIT, 0, 0.0
        finally:
            if fingerprint:
                self._joins(job.key, -1)
        if status == Admission.BODY_MISMATCH:
            raise _reused(waiter.request_id)
        # A list the script did not count (-1: not ahead of this request) is known as empty
        # here: the cached depths then refuse less without a round trip, never more.
        depths = admission.Depths(max(paid, 0), max(paid_behind, 0), max(free, 0), max(free_behind, 0))
        cell.depth[job.model] = (depths, now)
        verdict = _ADMIT_STATUS[status]
        if verdict == Verdict.ADMIT:
            waiter.behind = job.behind = extra == b"1"
            waiter.enqueued = True
            self._count_arrival(cell, job)
        retry_ms = float(extra) if verdict == Verdict.TENANT_RATE_LIMITED else 0.0
        return verdict, admission.lane_position(job.tier, depths, waiter.behind, self._bumps(capacity)), retry_ms

    def _bump_terms(self, capacity: Capacity) -> BumpTerms | None:
        """How the admission script tells which waiting free request a paid one would delay
        past its last start (`admission.max_depth` of what is left of its budget)."""
        if not self._bumps(capacity):
            return None
        reach = self.limits.margin_ms + capacity.slot_ms
        return BumpTerms(capacity.interval_ms, capacity.max_batch, reach)

    def _count_arrival(self, cell: Cell, job: p.Job) -> None:
        field = traffic.arrival_field(job.model, job.tier)
        with cell.arrivals_lock:
            cell.arrivals[field] += 1

    def _flush_arrivals(self, cell: Cell) -> None:
        """The admissions counted since the last call, into the second's traffic counters
        (kept for the next call if the broker did not take them)."""
        with cell.arrivals_lock:
            counts, cell.arrivals = cell.arrivals, Counter()
        try:
            traffic.record_arrivals(cell.prober, counts, self.clock.now_ms())
        except redis.RedisError:
            with cell.arrivals_lock:
                cell.arrivals.update(counts)
            raise

    def _max_message_bytes(self, tier: Tier) -> int:
        kb = self.settings.max_message_kb_paid if tier == PAID else self.settings.max_message_kb_free
        return kb * 1024

    def _tenant_terms(
        self, job: p.Job, lane: keys.LaneKeys, tenant: str, deepest: int, capacity: Capacity, now_ms: float
    ) -> TenantTerms:
        """What the admission script counts the request against its tenant by."""
        policy = self._tenants[job.tier]
        # Each process sees its share of every key's traffic (connections spread evenly):
        # the memory is long enough for a key that asks now and then to be seen by each.
        alone = self._other_keys.alone(job.model, job.tier, tenant, now_ms)
        horizon = admission.latest_start_ms(job.deadline_ms - job.received_ms, capacity, self.limits)
        limits = admission.tenant_limits(deepest, capacity, policy, alone, horizon)
        return TenantTerms(
            queue_behind=lane.queue_behind,
            deepest_behind=limits.deepest_behind,
            fair_depth=limits.fair_depth,
            max_queued=limits.max_queued,
            rate_per_s=policy.rate_per_s,
            bucket_size=policy.bucket,
            stale_checks=STALE_CHECKS,
        )

    # -- waiting, cancel, give up ----------------------------------------------------

    def wait(self, waiter: Waiter, hangup: object | None = None) -> None:
        """Block until the answer, a cancel, the deadline (then give the request up) or,
        with `hangup` (a gevent event set when the client's connection closes), until the
        client hangs up (then cancel the request: it takes no batch slot, or it is wasted)."""
        try:
            self._await(waiter, waiter.event, hangup)
        finally:
            self._forget(waiter)
            self.metrics.inflight.dec()

    def stream(self, waiter: Waiter, hangup: object | None = None) -> Iterator[list[p.Chunk]]:
        """Yield streamed text as it comes, until the answer (or a cancel, the deadline,
        a hang-up) resolves the waiter. A client that goes while text is being sent
        (the generator is closed) gives its request up."""
        try:
            while True:
                chunks = waiter.take_chunks()
                if chunks:
                    try:
                        yield chunks
                    except GeneratorExit:
                        self._gone(waiter)
                        raise
                elif waiter.item is not None or not self._await(waiter, waiter.news, hangup):
                    return
        finally:
            self._forget(waiter)
            self.metrics.inflight.dec()

    def _await(self, waiter: Waiter, event: threading.Event, hangup: object | None) -> bool:
        """Wait for `event`; True if it came. At the deadline or a hang-up, resolve the
        waiter with why and give its request up (False)."""
        for _ in range(1 + EARLY_REWAITS):
            timeout_s = max(0.0, (waiter.job.deadline_ms - self.clock.now_ms()) / 1000.0)
            if event.wait(timeout_s) if hangup is None else self._wait_or_hangup(event, timeout_s, hangup):
                return True
            if waiter.item is not None:
                return False
            # Gone only if the client's socket said so: the wait's timer may end a little
            # before the clock reads the deadline (the clock is the broker's, the timer the
            # host's), and a client still there then waits out the rest.
            if hangup is not None and cast("threading.Event", hangup).is_set():
                self._gone(waiter)
                return False
            if self.clock.now_ms() >= waiter.job.deadline_ms - 1.0:
                break
        # At the deadline with the broker silent, the broker is why: 503, not 504.
        reason = "unavailable" if self.cells[waiter.cell].health.silent_s > 0 else "expired"
        waiter.resolve(p.Dropped(id=waiter.attempt, reason=reason, replica=""))
        self._give_up(waiter, reason)
        return False

    def _gone(self, waiter: Waiter) -> None:
        waiter.resolve(p.Cancelled(id=waiter.attempt, reason="gone"))
        self._give_up(waiter, "gone")

    def abandon(self, waiter: Waiter) -> None:
        """The client went before its wait began: give the request up, as `wait` would."""
        try:
            self._gone(waiter)
        finally:
            self._forget(waiter)
            self.metrics.inflight.dec()

    @staticmethod
    def _wait_or_hangup(event: threading.Event, timeout_s: float, hangup: object) -> bool:
        """True once `event` is set; False at the deadline or when the client has gone."""
        import gevent  # `hangup` is a gevent event: only the gevent server watches for hang-ups

        gevent.wait([event, hangup], timeout=timeout_s, count=1)
        return event.is_set()

    def _give_up(self, waiter: Waiter, reason: str) -> None:
        """Drop the request where it waits (unless another connection joined it)."""
        with self._lock:  # another connection here waits for it, or is joining it
            joined = len(self.waiters.get(waiter.attempt, [])) > 1 or waiter.job.key in self._joining
        if joined:
            return
        cell = self.cells[waiter.cell]
        try:
            cell.cancel(waiter.job.key, reason, attempt=waiter.attempt, holder=self.id)
        except redis.RedisError as exc:
            cell.health.failed(exc)  # the broker is away; the answer stands all the same

    def cancel(self, key: str, reason: str, tenant: str) -> bool:
        """Cancel the request with this key on any gateway; False if `tenant` has none. The
        key alone does not say the cell (a session places a request): each is asked, the
        key's own first, and a cell that does not answer leaves the answer unknown (503)."""
        unreachable: redis.RedisError | None = None
        for index in cell_order(key, len(self.cells)):
            cell = self.cells[index]
            if cell.health.is_down:
                unreachable = unreachable or redis.ConnectionError("down")
                continue
            try:
                if cell.cancel(key, reason, tenant=tenant):
                    return True
            except redis.RedisError as exc:
                cell.health.failed(exc)
                unreachable = exc
        if unreachable is not None:
            raise _broker_down(unreachable) from unreachable
        return False

    # -- the broker's health, and the sweep of lapsed leases -------------------------

    def _watch_broker(self, cell: Cell) -> None:
        """Every 100 ms (50 while it is down), and at once when the reply listener loses
        the broker: sweep the cell's replicas whose lease lapsed,
        which is also the probe of its broker, and add the admissions to its traffic
        counters; every second, read the clock (the first cell's broker keeps it). A cell
        silent for `MOVE_AFTER_S` after a failed call sends its waiting requests to the
        cells that answer. Those it keeps wait on: its replicas answer a batch they ran
        through another cell (tasks/replica/broker.py, `FallbackReplies`). With no other cell answering,
        they end 503 once it is down."""
        min_ms = self.settings.batch_ms + self.settings.deadline_margin_ms
        last_sync = 0.0
        failed_waiting = False
        while True:
            cell.wake.clear()  # before the probe: a wake set during it is not lost
            try:
                swept, requeued, expired, deaths, epoch = cell.sweep(min_ms, SWEEP_LOCK_MS)
                if swept:
                    log.warning(
                        "cell %d: swept %d lapsed replicas: %d requests re-queued, %d expired",
                        cell.index, swept, requeued, expired,
                    )  # fmt: skip
                if cell.deaths is not None and deaths != cell.deaths and not cell.rescuing:
                    # A replica died (this process swept it, another did, a supervisor
                    # released it, or its pulse lapsed): what it had popped and not yet
                    # recorded is nowhere.
                    cell.rescuing = True
                    threading.Thread(target=self._rescue_rounds, args=(cell, min_ms), daemon=True).start()
                cell.deaths = deaths
                if epoch and cell.epoch and epoch != cell.epoch:
                    self._keyspace_lost(cell)
                cell.epoch = epoch or cell.epoch
                self._resend(cell)
                self._flush_arrivals(cell)
                if self.settings.admit_open and time.monotonic() - cell.asked_tried >= admission.OPEN_REFRESH_MS / 1000:
                    self._read_asked(cell)
                self._release_orphans(cell)
                is_clock = cell.index == 0 and isinstance(self.clock, BrokerClock)
                if is_clock and time.monotonic() - last_sync > 1.0:
                    cast("BrokerClock", self.clock).sync()
                    last_sync = time.monotonic()
                if cell.health.silent_s:  # back after an outage: its registry may have changed (a
                    cell.fleet.refresh(direct=True)  # restarted broker holds none until its replicas beat again)
                cell.health.ok()
                failed_waiting = False
            except redis.RedisError as exc:
                cell.health.failed(exc)
                if cell.health.silent_s >= MOVE_AFTER_S:
                    self._move_waiting(cell)  # each round: requests registered since go too
                if cell.health.is_down and not failed_waiting and not self._others_answer(cell):
                    self._fail_waiting(cell)  # nothing will come back to them
                    failed_waiting = True
            except Exception:
                log.exception("broker health loop")
            cell.wake.wait(0.05 if cell.health.silent_s else 0.1)

    def _others_answer(self, cell: Cell) -> bool:
        return any(not other.health.is_down for other in self.cells if other is not cell)

    def _waiting_in(self, cell: Cell) -> list[Waiter]:
        with self._lock:
            return [w for group in self.waiters.values() for w in group if w.cell == cell.index and w.item is None]

    def _rescue_rounds(self, cell: Cell, min_ms: float) -> None:
        """Two RESCUE rounds after a death: at once, and once the dead replica's last pull
        has timed out on the broker (what it took after the first round)."""
        started = time.monotonic()
        self._rescue_waiting(cell, min_ms)
        cell.rescuing = False  # a death counted from now on calls rounds of its own
        time.sleep(max(0.0, started + RESCUE_AGAIN_S - time.monotonic()))
        self._rescue_waiting(cell, min_ms)

    def _rescue_waiting(self, cell: Cell, min_ms: float) -> None:
        """Offer this process's waiting requests in the cell to RESCUE (control/broker/scripts.py):
        those a dead replica had taken from the queue and not yet recorded go back to it.
        Only what two looks `RESCUE_AFTER_S` apart both found unrecorded: a live replica
        records what it pops within that, and a request it popped a moment ago is not
        pushed back as a second copy."""
        waiting = list({w.attempt: w for w in self._waiting_in(cell) if w.enqueued}.values())
        rescued = 0
        try:
            seen: set[str] = set()
            for start in range(0, len(waiting), RESCUE_CHUNK):
                seen |= cell.rescue.look(min_ms, [_rescue_offer(w) for w in waiting[start : start + RESCUE_CHUNK]])
            if not seen:
                return
            time.sleep(RESCUE_AFTER_S)
            suspects = [w for w in waiting if w.attempt in seen]
            for start in range(0, len(suspects), RESCUE_CHUNK):
                rescued += cell.rescue(min_ms, [_rescue_offer(w) for w in suspects[start : start + RESCUE_CHUNK]])
        except redis.RedisError as exc:
            log.warning("could not offer waiting requests for rescue: %s", exc)
        if rescued:
            log.warning("re-queued %d requests a dead replica had taken and not recorded", rescued)

    def _keyspace_lost(self, cell: Cell) -> None:
        """The cell's broker came back without what it held (a restart faster than the
        health loop saw, or one seen): this process's requests waiting in it are nowhere
        now, and go in again, to another cell or to this one."""
        lost = [w for w in self._waiting_in(cell) if w.enqueued and w.attempt == w.job.id]
        self._lost[cell.index] = lost
        log.warning("cell %d's broker restarted empty: %d waiting requests to send again", cell.index, len(lost))

    def _resend(self, cell: Cell) -> None:
        """Enqueue again what the cell's broker lost, each round until it is taken (a
        restarted broker knows no replica until they beat again), answered or moved."""
        lost = self._lost.get(cell.index)
        if lost:
            waiting = [w for w in lost if w.item is None and w.cell == cell.index]
            self._lost[cell.index] = [w for w in waiting if not self._move(w, here_too=True)]

    def _release_orphans(self, cell: Cell) -> None:
        """Requests of a model that has no live replica left in their cell go to another
        cell that serves it; with none, they end now with 503 (which a gateway with peer
        regions forwards), not at their deadline with a 504."""
        orphaned = {m for m in self.settings.models if cell.fleet.capacity(m).num_replicas == 0}
        if not orphaned or not self.waiters:
            return
        for waiter in self._waiting_in(cell):
            if waiter.job.model in orphaned and not self._move(waiter):
                self._give_up(waiter, "no_replica")
                waiter.resolve(p.Dropped(id=waiter.attempt, reason="no_replica", replica=""))

    def _move_waiting(self, cell: Cell) -> None:
        """Send the cell's waiting requests to the next cells that answer, within budget."""
        waiting = self._waiting_in(cell)
        moved = sum(self._move(w) for w in waiting)
        if moved:
            log.warning("cell %d is silent: %d of %d waiting requests sent on", cell.index, moved, len(waiting))

    def _move(self, waiter: Waiter, here_too: bool = False) -> bool:
        """Enqueue a waiting request again in another cell (its next in order that answers
        and serves its model, with room within what is left of its budget), or, `here_too`,
        in its own cell last. It keeps its attempt: whichever cell answers first answers
        it. True if it moved.

        Only what this process enqueued under the request's own attempt moves: a request
        that joined another's attempt is answered with it (that attempt's enqueuer moves
        it), and one whose first enqueue is still under way is not in the cell yet. A
        stream stays where it is: two runs of it would both send text."""
        job, here = waiter.job, waiter.cell
        if job.stream or waiter.item is not None:
            return False
        if not waiter.enqueued or waiter.attempt != job.id:
            return False
        now = self.clock.now_ms()
        budget = job.deadline_ms - now
        order = [i for i in cell_order(waiter.session or job.key, len(self.cells)) if i != here]
        for index in order + [here] if here_too else order:
            cell = self.cells[index]
            if cell.health.is_down:
                continue
            capacity = cell.fleet.capacity(job.model)
            if admission.check(budget, capacity, self.limits) != Verdict.ADMIT:
                continue
            deepest, _limit = self._deepest(cell, job, budget, capacity, now)
            waiter.behind = job.behind = False  # the new cell's admission decides, as at the first
            try:
                verdict, _position, _retry = self._enqueue(cell, waiter, waiter.session, deepest, capacity)
            except ApiError:
                continue
            if verdict == Verdict.ADMIT:
                waiter.cell = index
                self.metrics.moved.inc()
                return True
        return False

    def _fail_waiting(self, cell: Cell) -> None:
        waiting = self._waiting_in(cell)
        log.warning("cell %d unreachable: answering %d waiting requests 503", cell.index, len(waiting))
        for waiter in waiting:
            waiter.resolve(p.Dropped(id=waiter.attempt, reason="unavailable", replica=""))

    # -- replies ---------------------------------------------------------------------

    def _listen(self, cell: Cell) -> None:
        key = keys.reply_key(self.id)
        client = cell.listener
        backlog: list[bytes | str] = []
        while True:
            try:
                if not backlog:  # wait for one message; take what queued behind it after delivering it
                    popped = client.blpop([key], timeout=1)
                    if popped is None:
                        continue
                    raws = [popped[1]]
                else:
                    raws, backlog = backlog, []
            except redis.RedisError:
                log.warning("cell %d: reply listener lost its broker; retrying", cell.index)
                # The probe goes now: a broker that is gone refuses it, and what waits on it
                # moves on within a few ms, with that much more of its budget.
                cell.wake.set()
                threading.Event().wait(0.2)
                continue
            cell.health.ok()
            for raw in raws:
                try:
                    self._deliver(p.Reply.model_validate_json(raw))
                except Exception:  # one bad message must not stop the listener
                    log.exception("could not deliver a reply message")
            try:
                # With a count LPOP answers a list (or nil); redis-py's type does not tell the forms apart.
                backlog = cast("list[bytes | str] | None", client.lpop(key, 256)) or []
            except redis.RedisError:
                backlog = []

    def _deliver(self, reply: p.Reply) -> None:
        for item in reply.items:
            if isinstance(item, p.Chunk):
                with self._lock:
                    group = list(self.waiters.get(item.id, ()))
                for waiter in group:
                    waiter.add_chunk(item)
                continue
            if isinstance(item, p.Dropped):
                self.metrics.dropped.labels(item.reason).inc()
            elif isinstance(item, p.Cancelled):
                self.metrics.cancels.labels(item.reason).inc()
            with self._lock:
                group = list(self.waiters.get(item.id, ()))
                if not group or self._joining:
                    self._keep_early(item)
            for waiter in group:
                waiter.resolve(item)

    def _joins(self, key: str, delta: int) -> None:
        with self._lock:
            count = self._joining.get(key, 0) + delta
            if count:
                self._joining[key] = count
            else:
                del self._joining[key]

    def _keep_early(self, item: Item) -> None:
        """An answer may overtake joins of its request that this process has not registered
        yet (their script call named this process, the registration follows it): each of them
        finds it here. Called with the lock held."""
        now = time.monotonic()
        self._early.pop(item.id, None)  # to the end: the dict is in the order kept
        self._early[item.id] = (item, now)
        while True:  # oldest first: stop at the first one still fresh (the newest is)
            oldest = next(iter(self._early))
            if now - self._early[oldest][1] < EARLY_KEEP_S:
                break
            del self._early[oldest]

    def short_of_replicas(self, model: str) -> bool:
        """Whether a cell has fewer of the model's replicas ready than it had lately (a
        replica, a host or the broker lost and not all back yet); a cell that is down and
        had some is short of all of them."""
        return any(
            cell.fleet.peaks.get(model, (0, 0.0))[0] > 0 if cell.health.is_down else cell.fleet.short_of(model)
            for cell in self.cells
        )

    def readiness(self) -> dict[str, int]:
        """Ready replicas per configured model, in the cells whose broker answers."""
        self.start()
        counts = dict.fromkeys(self.settings.models, 0)
        for cell in self.cells:
            if cell.health.is_down or not cell.fleet.is_reachable:
                continue
            for rep in cell.fleet.replicas:
                if rep.is_ready and rep.model in counts:
                    counts[rep.model] += 1
        return counts

    def ping(self) -> bool:
        """Whether any cell's broker answers (each asked in turn)."""
        for cell in self.cells:
            try:
                cell.redis.ping()
                return True
            except redis.RedisError:
                continue
        return False


def body_fingerprint(job: p.Job) -> str:
    """What decides the answer, from the request as checked (defaults filled in, a prompt
    array unwrapped, one stop string as a list): a retry must ask for the same thing."""
    fields = [job.model, job.prompt, job.suffix, job.max_tokens, job.temperature, job.top_p, job.stop]
    return hashlib.sha256(json.dumps(fields, ensure_ascii=False).encode()).hexdigest()[:32]


def _options(job: p.Job) -> str:
    return reuse.options_digest(job.model, job.suffix, job.max_tokens, job.temperature, job.top_p, job.stop)


def _reused(request_id: str) -> ApiError:
    return ApiError(
        409,
        f"X-Request-Id {request_id} belongs to a request with a different body; use a new id",
        "request_id_reused",
    )


def _broker_down(exc: BaseException | None) -> ApiError:
    if exc is not None:
        log.warning("broker unreachable: %r (%s)", exc, exc)
    return ApiError(503, "the broker is unreachable; retry shortly", "broker_unavailable", retry_after_s=1)


_ADMIT_STATUS = {
    Admission.ADMITTED: Verdict.ADMIT,
    Admission.TOO_DEEP: Verdict.OVERLOADED,
    Admission.TENANT_RATE_LIMITED: Verdict.TENANT_RATE_LIMITED,
    Admission.TENANT_QUEUE_FULL: Verdict.TENANT_QUEUE_FULL,
}


def _rescue_offer(waiter: Waiter) -> RescueOffer:
    job = waiter.job
    return RescueOffer(
        attempt=waiter.attempt,
        key=job.key,
        queue=keys.queue_key(job.model, job.tier, waiter.behind),
        waiting=keys.waiting_key(job.model, job.tier, waiter.behind),
        deadline_ms=job.deadline_ms,
        received_ms=job.received_ms,
    )


def _tenant_policy(settings: Settings, tier: Tier) -> admission.TenantPolicy:
    paid = tier == PAID
    return admission.TenantPolicy(
        rate_per_s=settings.tenant_rate_paid if paid else settings.tenant_rate_free,
        burst=settings.tenant_burst_paid if paid else settings.tenant_burst_free,
        share=settings.tenant_share_paid if paid else settings.tenant_share_free,
        fair_batches=settings.tenant_fair_batches,
    )


def _check_size(message: str, limit: int) -> None:
    """A request's task message is what it holds in the broker while it waits: 413 beyond
    the tier's limit (a prompt of many escaped characters takes several bytes for each)."""
    size = len(message) if len(message) * 4 <= limit else len(message.encode())
    if size > limit:
        raise ApiError(
            413,
            f"the request takes {size // 1024} KiB queued, above this tier's {limit // 1024} KiB; shorten the prompt",
            "prompt_too_long",
        )


def _refusal(
    verdict: Verdict, budget_ms: float, capacity: Capacity, limits: Limits, position: int, retry_ms: float = 0.0
) -> ApiError:
    if verdict == Verdict.TENANT_RATE_LIMITED:
        return ApiError(
            429,
            "this key's request rate is above its tier's limit",
            "tenant_rate_limited",
            retry_after_s=max(1, math.ceil(retry_ms / 1000.0)),
        )
    if verdict == Verdict.TENANT_QUEUE_FULL:
        return ApiError(
            429,
            f"this key holds its share of the queue (position {position}); retry when its requests are answered",
            "tenant_queue_full",
            retry_after_s=admission.retry_after_s(position, budget_ms, capacity, limits),
        )
    if verdict == Verdict.NO_REPLICA:
        return ApiError(503, "no replica serves this model right now", "no_replica", retry_after_s=1)
    if verdict == Verdict.TOO_SHORT:
        return ApiError(
            504,
            f"a deadline of {budget_ms:.0f} ms is shorter than one batch ({capacity.batch_ms:.0f} ms)",
            "deadline_exceeded",
        )
    predicted = admission.predict_ms(position, capacity)
    return ApiError(
        429,
        f"overloaded: position {position} in the queue, predicted {predicted:.0f} ms, budget {budget_ms:.0f} ms",
        "overloaded",
        retry_after_s=admission.retry_after_s(position, budget_ms, capacity, limits),
    )
