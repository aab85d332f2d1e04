"""One model replica: a buffer, a batching loop and the Redis glue around them.

No Celery here: the Celery consumer hands each request to `Replica.submit`. A
recorder thread writes what arrived into the replica's held hash; the loop thread
renews the replica's lease (control/broker/failover.py), waits until the collector says a
batch is due, checks the whole buffer for cancels in one MGET, claims the batch,
runs the engine, and answers every gateway in one delivery script.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, cast

import redis
from redis.typing import EncodableT, FieldT

from control.broker import failover, traffic
from control.broker.envelope import job_from_message
from control.broker.registry import ENGINE_PREFIX
from control.core import protocol as p
from control.core.clock import BrokerClock, Clock
from control.core.lifecycle import IllegalTransition, ReplicaState, can_transition, transition
from tasks.engine.contract import Engine, Output, RequestError, StepOutput, run_batch
from tasks.policy.collector import Collector, CollectorConfig, Pending
from tasks.policy.pullgate import PullGate
from tasks.replica.perf import BatchTimes

log = logging.getLogger(__name__)

RECORD_MS = 3.0  # arrivals are written to the held hash in groups gathered this long


@dataclass
class Held:
    """What the replica keeps for a buffered request besides the policy fields."""

    job: p.Job
    message: str | None = None  # the queue message as taken, for requests popped at a launch


class EventSink(Protocol):
    """Where the replica reports request life-cycle events (Celery task events)."""

    def started(self, batch: list[Pending]) -> None: ...
    def succeeded(self, batch: list[Pending], runtime_s: float) -> None: ...
    def failed(self, batch: list[Pending], error: str) -> None: ...
    def revoked(self, dropped: list[Pending], reason: str) -> None: ...


class NoEvents:
    def started(self, batch: list[Pending]) -> None: ...
    def succeeded(self, batch: list[Pending], runtime_s: float) -> None: ...
    def failed(self, batch: list[Pending], error: str) -> None: ...
    def revoked(self, dropped: list[Pending], reason: str) -> None: ...


@dataclass
class Stats:
    num_batches: int = 0
    num_requests: int = 0
    last_batch_size: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    wasted_slots: int = 0  # slots run for requests whose client had gone
    wasted_ms: float = 0.0  # their share of the model's time
    num_taken_shut: int = 0  # brought by a pull sent before the gate shut
    num_handed_back: int = 0  # of those, put back at the front of the queue

    def waste(self, slots: int, share_ms: float) -> None:
        self.wasted_slots += slots
        self.wasted_ms += slots * share_ms

    def as_fields(self) -> dict[str, float]:
        fields: dict[str, float] = {
            "num_batches": self.num_batches,
            "num_requests": self.num_requests,
            "last_batch_size": self.last_batch_size,
            "wasted_slots": self.wasted_slots,
            "wasted_ms": round(self.wasted_ms, 1),
            "taken_shut": self.num_taken_shut,
            "handed_back": self.num_handed_back,
        }
        for reason in ("cancelled", "superseded", "expired", "gone"):
            fields[f"dropped_{reason}"] = self.dropped[reason]
        return fields


class _Control:
    """BatchControl for one running static batch."""

    def __init__(self, replica: Replica, batch: list[Pending]) -> None:
        self.replica = replica
        self.jobs = {pending.id: held(pending).job for pending in batch}

    def cancelled(self) -> set[str]:
        return set(self.replica.cancelled(self.jobs))

    def emit(self, request_id: str, text: str) -> None:
        self.replica.stream_text(self.jobs[request_id], text)

    def end_step(self) -> None:
        self.replica.engine_stepped()
        self.replica.flush_streams()
        self.replica.renew_lease_if_due()


class Replica:
    def __init__(
        self,
        name: str,
        model: str,
        engine: Engine,
        config: CollectorConfig,
        client: redis.Redis,
        clock: Clock,
        events: EventSink | None = None,
        wake: Callable[[], object] | None = None,
        pull_lead_ms: float = 40.0,
        heartbeat_s: float = 1.0,
        ttl_s: float = 3.0,
        envelope: Callable[[p.Job], str] | None = None,
        lease_ms: float = 300.0,
        stall_ms: float = 2000.0,
        max_clock_error_ms: float = 25.0,
        hand_back: bool = True,
    ) -> None:
        self.name = name
        self.model = model
        self.engine = engine
        self.collector = Collector(config)
        self.redis = client
        self.clock = clock
        self.events = events or NoEvents()
        self.wake = wake or (lambda: None)
        self.gate = PullGate(config.max_batch, pull_lead_ms)
        self.hand_back = hand_back  # what a pull sent before the gate shut brings goes back to the queue
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.stats = Stats()
        self.state = ReplicaState.STARTING  # changed only through control/core/lifecycle.py
        self.moving_to = ""  # the model a move loads once the replica is drained
        self.load_engine: Callable[[str], Engine] | None = None  # set by the worker: what a move needs
        self.switch_queue: Callable[[str, str], None] = lambda old, new: None
        self.is_polling: Callable[[], bool] = lambda: False  # the consumer has a pull outstanding
        self._quiet_since: float | None = None  # monotonic ms since a draining replica held nothing
        self.perf = BatchTimes()
        self.envelope = envelope or (lambda job: job.model_dump_json())  # what a sweep re-queues
        self.lease_ms = lease_ms
        self.stall_ms = stall_ms
        self.max_clock_error_ms = max_clock_error_ms
        self.why_not_ready = ""
        self._renew_at_ms = 0.0  # monotonic
        self._batch_started = 0.0  # monotonic ms of the running batch's start
        self._engine_since: float | None = None  # monotonic ms the engine's batch or step began; None between
        self._loop_times = [0.0, 0]  # continuous: ms spent in turns of the loop that stepped, and those turns
        self._arrivals = threading.Condition()
        self._unrecorded: list[p.Job] = []  # taken from the queue, not yet in the held hash
        self._recorder = threading.Thread(target=self._record, name=f"held-{name}", daemon=True)
        self._claim = client.register_script(failover.CLAIM_LUA)
        self._record_held = client.register_script(failover.RECORD_LUA)
        self._deliver = client.register_script(failover.DELIVER_LUA)
        self._stream = client.register_script(failover.STREAM_LUA)
        self._sent: dict[str, int] = {}  # attempt -> characters streamed so far
        self._chunks: list[EncodableT] = []  # STREAM_LUA arguments of the step's streamed text
        self._joined: dict[str, tuple[Pending, float]] = {}  # continuous: running requests, when each joined
        self._cond = threading.Condition()
        self._stopping = False
        self._stopped = threading.Event()
        loop = self._run_continuous if engine.continuous else self._run
        self._loop = threading.Thread(target=loop, name=f"batching-{name}", daemon=True)
        self._beat = threading.Thread(target=self._heartbeat, name=f"heartbeat-{name}", daemon=True)

    # -- life cycle ----------------------------------------------------------

    def start(self) -> None:
        self._take_over_name()
        self._sync_clock(samples=5)
        self.state = transition(self.state, ReplicaState.SERVING)  # ready unless `why_not_ready`
        self._renew_lease()
        self._publish_state()
        self._loop.start()
        self._beat.start()
        self._recorder.start()

    def _take_over_name(self) -> None:
        """A replica restarted under its old name first re-queues what the old one held
        (after its lease lapses), so the two never share a held hash."""
        pttl = self.redis.pttl(p.lease_key(self.name))
        if pttl > 0:
            time.sleep(pttl / 1000.0)
        requeued, expired = failover.release_replica(self.redis, self.name, self._min_run_ms())
        if requeued or expired:
            log.warning("took over %s: re-queued %d held requests, %d expired", self.name, requeued, expired)

    def _min_run_ms(self) -> float:
        return self.engine.expected_batch_ms() + self.collector.config.margin_ms

    def _sync_clock(self, samples: int = 1) -> None:
        """Read the broker's clock; a replica that cannot read it closely is not ready."""
        if not isinstance(self.clock, BrokerClock):
            return
        for _ in range(samples):
            self.clock.sync()
        error = self.clock.error_ms
        self.why_not_ready = (
            f"clock: offset to the broker known only to {error:.0f} ms (limit {self.max_clock_error_ms:.0f})"
            if error > self.max_clock_error_ms
            else ""
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop taking work, run what is buffered, leave the registry."""
        if can_transition(self.state, ReplicaState.STOPPING):
            self.state = transition(self.state, ReplicaState.STOPPING)
        with self._cond:
            self._stopping = True
            self.gate.stopping = True
            self._cond.notify_all()
        self._loop.join(timeout_s)
        self._stopped.set()
        self._beat.join(timeout_s)
        self._recorder.join(timeout_s)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(p.replica_key(self.name))
            pipe.srem(p.REPLICAS_KEY, self.name)
            pipe.delete(p.lease_key(self.name), p.held_key(self.name))
            pipe.srem(p.HOLDERS_KEY, self.name)
            pipe.zrem(p.idle_key(self.model), self.name)
            pipe.zrem(p.launch_key(self.model), self.name)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not leave the replica registry")

    @property
    def busy(self) -> bool:
        return self.gate.busy

    @busy.setter
    def busy(self, value: bool) -> None:
        self.gate.busy = value

    def wants_messages(self) -> bool:
        """May the consumer pull another request from the shared queue now (`PullGate`)?
        Read without the lock: a stale answer costs one message at most."""
        if not self._is_taking():
            return False
        if self.engine.continuous:
            return self.gate.wants_continuous(len(self.collector), self.engine.free_slots())
        return self.gate.wants(self.clock.now_ms(), len(self.collector), self.engine.expected_batch_ms())

    def reopens_at_ms(self) -> float | None:
        """When a shut gate opens again by itself (None: not before work leaves)."""
        if self.engine.continuous or not self._is_taking():
            return None
        return self.gate.reopens_at(self.clock.now_ms(), len(self.collector), self.engine.expected_batch_ms())

    def submit(self, job: p.Job) -> bool:
        """Buffer one request (called from the consumer's thread, right after it took the
        message from the queue); the recorder thread writes it into the held hash within
        `RECORD_MS`, so that a sweep can re-queue it if this replica dies. False: handed
        back to the queue instead (`_hands_back`)."""
        if self._hands_back(job):
            return False
        pending = self._pending(job)
        if self.engine.continuous:
            # A continuous engine takes requests one by one, tens a second: the record
            # is written right here, in the consumer's thread, before the request is
            # buffered. The recorder thread's grouping would leave it unrecorded while
            # the engine's step holds the interpreter, a window a kill falls into.
            self._write_held([job])
        with self._cond:
            if self.state == ReplicaState.DRAINED:  # a pull sent just before the drain: run it
                self.state = transition(self.state, ReplicaState.DRAINING)
            self.collector.add(pending)
            self._cond.notify()
        if not self.engine.continuous:
            self._hold([job])
        return True

    def _hands_back(self, job: p.Job) -> bool:
        """A pull sent before the gate shut (`kombu_internals.gate_pulls` lets it finish)
        brought a request this replica would not have pulled now: a peer frees first, or
        its buffer is full. Here it would wait for a batch to end; it goes back to the front
        of its queue instead, for the consumer that asks next (each consumer hands back
        at most the one message its last pull brings, so it does not circle). A replica
        that is draining keeps it and runs it; one that is stopping hands it back whatever
        `hand_back` says (its loop may have run its last batch, and a request kept then
        would wait for its deadline)."""
        if self._stopping:
            return self._push_back(job)
        if not self._is_taking() or self.wants_messages():
            return False
        self.stats.num_taken_shut += 1
        return self.hand_back and self._push_back(job)

    def _push_back(self, job: p.Job) -> bool:
        try:
            self.redis.rpush(p.queue_key(job.model, job.tier, job.behind), self.envelope(job))  # BRPOP's end
        except redis.RedisError:  # it runs here, a batch later; if the push did land (a timed-out
            return False  # reply), the claim at launch lets only one of the two copies run
        self.stats.num_handed_back += 1
        return True

    def _hold(self, jobs: list[p.Job]) -> None:
        """Hand requests to the recorder thread."""
        if not jobs:
            return
        with self._arrivals:
            self._unrecorded.extend(jobs)
            self._arrivals.notify()

    def _record(self) -> None:
        """Write arrivals into the held hash: one RECORD script call for what arrived within
        `RECORD_MS` of the first, so the consumer never waits for it and a pulled batch (a
        burst of messages) costs a few round trips, not one each."""
        while True:
            with self._arrivals:
                while not self._unrecorded and not self._stopped.is_set():
                    self._arrivals.wait(0.5)
                if not self._unrecorded:
                    return
            self._stopped.wait(RECORD_MS / 1000.0)
            with self._arrivals:
                jobs, self._unrecorded = self._unrecorded, []
            self._write_held(jobs)

    def _write_held(self, jobs: list[p.Job]) -> None:
        args: list[EncodableT] = [self.name]
        for job in jobs:
            args += [job.id, job.key, self._held_record(job)]
        try:  # only those still in flight: one answered meanwhile must not come back
            self._record_held(args=args)
        except redis.RedisError:
            log.warning("could not record %d requests as held", len(jobs))

    def _pending(self, job: p.Job) -> Pending:
        return Pending(
            job.id, job.tier, job.received_ms, job.deadline_ms, Held(job), self.clock.now_ms(), behind=job.behind
        )

    # -- the loop: wait, take, run, answer -------------------------------------

    def _run(self) -> None:
        while (due := self._wait()) is not None:
            batch: list[Pending] = []
            try:
                self.renew_lease_if_due()
                self._check_drained()
                self.collector.config.batch_ms = self.engine.expected_batch_ms()  # measured, where the engine can
                if due:
                    batch, dropped = self._take()
                    batch = self._settle(batch, dropped)
                    if batch:
                        self._execute(batch)
            except Exception:  # Redis away, a bad message: never let the loop die
                log.exception("batching loop error; %d requests in hand", len(batch))
                self._fail_quietly(batch)
                self._stopped.wait(0.1)

    def _fail_quietly(self, batch: list[Pending]) -> None:
        self.busy = False
        if not batch:
            return
        try:
            self._answer_failed(batch, "replica error")
        except Exception:
            log.exception("could not tell the gateways; their requests end at their deadlines")

    def _wait(self) -> bool | None:
        """Block until a batch is due (True) or the lease needs renewing (False);
        None once stopping with nothing left."""
        with self._cond:
            while True:
                wait = self.collector.wait_ms(self.clock.now_ms())
                if wait is None and self._stopping:
                    return None
                if wait == 0 or (wait is not None and self._is_flushing()):
                    return True
                renew_in = self._renew_at_ms - _monotonic_ms()
                if renew_in <= 0:
                    return False
                self._cond.wait(min(renew_in, wait if wait is not None else renew_in) / 1000.0)

    # -- lease and held records (control/broker/failover.py) ----------------------------------

    def _held_record(self, job: p.Job, message: str | None = None) -> str:
        queue, waiting = p.queue_key(job.model, job.tier, job.behind), p.waiting_key(job.model, job.tier, job.behind)
        return f"{job.deadline_ms:.0f}|{queue}|{waiting}|{job.key}|{message or self.envelope(job)}"

    def _lease_commands(self, pipe: redis.client.Pipeline) -> None:
        now = _monotonic_ms()
        # A step is renewed around, never during: the lease outlasts a few of the slowest.
        lease_ms = max(self.lease_ms, 4 * self.engine.expected_step_ms())
        late = now - (self._renew_at_ms + lease_ms - self.lease_ms / 3)
        if self._renew_at_ms and late > 0:
            log.warning("lease renewed %.0f ms after it lapsed (the loop stalled)", late)
        pipe.set(p.lease_key(self.name), 1, px=int(lease_ms))
        pipe.sadd(p.HOLDERS_KEY, self.name)
        self._renew_at_ms = now + self.lease_ms / 3

    def _renew_lease(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._lease_commands(pipe)
        pipe.execute()

    def renew_lease_if_due(self) -> None:
        """Called by the engine between steps: a batch longer than the lease keeps it.
        A broker that is away is not the engine's failure: the batch goes on."""
        if _monotonic_ms() >= self._renew_at_ms:
            try:
                self._renew_lease()
            except redis.RedisError:
                log.warning("could not renew the lease")

    def _take(self) -> tuple[list[Pending], dict[str, list[Pending]]]:
        with self._cond:
            ids = self.collector.ids()
            room = self.collector.num_free() if self._is_taking() else 0
            behind = self.collector.num_behind() if self._is_taking() else 0
        # One round trip: cancels for the whole buffer, and paid requests still in
        # the queue that would otherwise ride behind free ones already buffered (and
        # free ones in line behind buffered requests of a tenant beyond its share).
        reasons, late_paid = self._cancels_and_paid(ids, room, behind)
        with self._cond:
            now = self.clock.now_ms()
            dropped = self._sort_buffer(late_paid, reasons, now)
            due = self.collector.wait_ms(now) == 0 or self._is_flushing()
            batch = self.collector.pop_batch() if due else []
            if batch:
                self.gate.start(now, self.engine.expected_batch_ms())
                self._batch_started = _monotonic_ms()
        if late_paid:  # those launched now are recorded by the launch itself (`_settle`)
            launched = {pending.id for pending in batch}
            self._hold([job for job, _raw in late_paid if job.id not in launched])
        return batch, {reason: group for reason, group in dropped.items() if group}

    def _sort_buffer(
        self, late_paid: list[tuple[p.Job, str]], reasons: dict[str, str], now_ms: float
    ) -> dict[str, list[Pending]]:
        """Under the lock: paid requests taken late join the buffer; cancelled and expired
        ones leave it (returned by reason)."""
        dropped: dict[str, list[Pending]] = defaultdict(list)
        for job, raw in late_paid:
            pending = self._pending(job)
            pending.payload.message = raw
            self.collector.add(pending)
        for pending in self.collector.remove(set(reasons)):
            dropped[reasons[pending.id]].append(pending)
        dropped["expired"].extend(self.collector.pop_expired(now_ms))
        return dropped

    def _settle(self, batch: list[Pending], dropped: dict[str, list[Pending]]) -> list[Pending]:
        """Tell the waiting-room and the gateways which requests left the buffer, and
        claim the batch; returns the part of it this replica may run."""
        leaving = batch + [pending for group in dropped.values() for pending in group]
        if not leaving:
            return batch
        pipe = self.redis.pipeline(transaction=False)
        late: dict[FieldT, EncodableT] = {
            pd.id: self._held_record(held(pd).job, held(pd).message) for pd in batch if held(pd).message
        }
        if late:  # paid requests taken straight from the queue at this launch
            pipe.hset(p.held_key(self.name), mapping=late)
        self._leave_waiting(pipe, leaving)
        notices = [
            p.Dropped(id=pending.id, reason=reason, replica=self.name)
            for reason, group in dropped.items()
            for pending in group
        ]
        self._reply(pipe, notices, [held(pd).job for group in dropped.values() for pd in group])
        idle = p.idle_key(self.model)
        if batch:
            now = self.clock.now_ms()
            self._lease_commands(pipe)
            claim_ttl = int(max(pd.deadline_ms for pd in batch) - now) + 1000
            self._claim(args=[self.name, claim_ttl, *(pd.id for pd in batch)], client=pipe)
            pipe.zrem(idle, self.name)
            pipe.zcount(idle, now, "+inf")
            pipe.zadd(p.launch_key(self.model), {self.name: now})
            pipe.zrange(p.launch_key(self.model), 0, -1, withscores=True)
            *_, claimed, _, peers_idle, _, launches = pipe.execute()
            self.gate.peers(idle=peers_idle > 0, launches=self._others(launches))
            batch = self._keep_claimed(batch, claimed)
        else:
            pipe.execute()
        for reason, group in dropped.items():
            self.stats.dropped[reason] += len(group)
            self.events.revoked(group, reason)
        return batch

    def _leave_waiting(self, pipe: redis.client.Pipeline, leaving: list[Pending]) -> None:
        """Out of the waiting sets admission counts: the tier's (in line or behind other
        tenants', whichever list it came from) and its tenant's share."""
        by_set: dict[str, list[str]] = defaultdict(list)
        for pending in leaving:
            job = held(pending).job
            for behind in (False, True):
                by_set[p.waiting_key(self.model, pending.tier, behind)].append(pending.id)
            by_set[p.tenant_waiting_key(self.model, pending.tier, p.tenant_of(job.key))].append(pending.id)
        for key, ids in by_set.items():
            pipe.zrem(key, *ids)

    def _keep_claimed(self, batch: list[Pending], claimed: list[int]) -> list[Pending]:
        """A request another live replica claimed first (a re-queued copy) runs there."""
        if all(claimed):
            return batch
        lost = [pd.id for pd, ok in zip(batch, claimed, strict=True) if not ok]
        log.info("%d requests of the batch run on another replica", len(lost))
        try:
            self.redis.hdel(p.held_key(self.name), *lost)
        except redis.RedisError:
            pass  # a stale held entry is swept harmlessly: the claim shows who runs it
        kept = [pd for pd, ok in zip(batch, claimed, strict=True) if ok]
        if not kept and not self.engine.continuous:  # a continuous loop decides after its turn
            self.busy = False
            self._rejoin_idle()  # `_settle` took it out of the idle list for a batch it does not run
        return kept

    def _execute(self, batch: list[Pending]) -> None:
        jobs = [held(pending).job for pending in batch]
        self.events.started(batch)
        self.stats.last_batch_size = len(batch)  # shown while it runs
        start = self.clock.now_ms()
        with self._engine_running():
            outputs = self._run_isolating(jobs, _Control(self, batch))
        end = self.clock.now_ms()
        self.perf.add(self._batch_started, _monotonic_ms())
        self._answer(jobs, outputs, start, end)
        self.stats.num_batches += 1
        self.stats.num_requests += len(batch)
        self.stats.last_batch_size = len(batch)
        self.busy = False
        self.wake()
        self.events.succeeded(batch, (end - start) / 1000.0)

    def _run_isolating(self, jobs: list[p.Job], control: _Control) -> list[Output]:
        """Run a batch; if the engine raises, find the request that makes it raise by
        halving, so that it fails alone and the rest of the batch is answered."""
        try:
            return run_batch(self.engine, jobs, control)
        except Exception as exc:
            if len(jobs) == 1:
                log.warning("request %s failed in the engine: %r", jobs[0].id, exc)
                return [Output(jobs[0].id, "", "error", 0, 0, f"the engine failed on this request: {exc!r}")]
            log.warning("a batch of %d failed in the engine (%r); running it in halves", len(jobs), exc)
            mid = len(jobs) // 2
            return self._run_isolating(jobs[:mid], control) + self._run_isolating(jobs[mid:], control)

    def _answer(self, jobs: list[p.Job], outputs: list[Output], start: float, end: float) -> None:
        results = [self._result(job, out, len(jobs), start, end) for job, out in zip(jobs, outputs, strict=True)]
        for job in jobs:
            self._sent.pop(job.id, None)
        pipe = self.redis.pipeline(transaction=False)
        self._reply(pipe, results, jobs)
        traffic.record_done(pipe, self.model, ((job.tier, end - job.received_ms) for job in jobs), end)
        self._mark_idle(pipe)
        self._lease_commands(pipe)
        pipe.zrange(p.launch_key(self.model), 0, -1, withscores=True)
        replies = pipe.execute()
        self.stats.waste(int(replies[0][1]), (end - start) / len(jobs))  # DELIVER: results nobody waited for
        self.gate.peers(launches=self._others(replies[-1]))
        with self._cond:  # the phase of the next batch, now that this one is done
            self.collector.stagger_from(self.gate.peer_launches, len(jobs), self.clock.now_ms())

    def _result(self, job: p.Job, out: Output, batch_size: int, start: float, end: float) -> p.Result | p.Failed:
        if out.error:
            return p.Failed(
                id=job.id,
                message=out.error,
                replica=self.name,
                per_request=True,
                code=out.code,
                status=out.http_status,
            )
        return p.Result(
            id=job.id,
            text=out.text,
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            replica=self.name,
            backend=self.engine.name,
            batch_size=batch_size,
            batch_start_ms=start,
            batch_end_ms=end,
        )

    def _answer_failed(self, batch: list[Pending], message: str) -> None:
        jobs = [held(pending).job for pending in batch]
        failures = [p.Failed(id=job.id, message=message, replica=self.name) for job in jobs]
        pipe = self.redis.pipeline(transaction=False)
        self._reply(pipe, failures, jobs)
        self._mark_idle(pipe)
        pipe.execute()
        self.busy = False
        self.wake()
        self.events.failed(batch, message)

    def _others(self, launches: list[tuple[bytes, float]]) -> list[float]:
        """When the other replicas of the model last started a batch."""
        me = self.name.encode()
        return [float(t) for name, t in launches if name != me]

    def _mark_idle(self, pipe: redis.client.Pipeline, refresh_only: bool = False) -> None:
        """Tell peers this replica is idle; a heartbeat only refreshes an entry (XX), so
        one racing a batch start cannot put back what `_settle` took out."""
        stale_at = self.clock.now_ms() + self.ttl_s * 1000
        pipe.zadd(p.idle_key(self.model), {self.name: stale_at}, xx=refresh_only)

    def _reply(self, pipe: redis.client.Pipeline, items: list, jobs: list[p.Job]) -> None:
        """Queue the delivery of `items` onto `pipe`: each goes to the gateway that owns
        its request now, once (control/broker/failover.py, DELIVER_LUA)."""
        if not jobs:
            return
        args: list[EncodableT] = [self.name]
        for item, job in zip(items, jobs, strict=True):
            args += [job.key, job.id, job.keep_ms, item.kind, item.model_dump_json(), job.gateway]
        self._deliver(args=args, client=pipe)

    # -- streaming ------------------------------------------------------------------

    def stream_text(self, job: p.Job, text: str) -> None:
        """Queue new text of a streaming request; `flush_streams` sends a step's worth."""
        if not job.stream or not text:
            return
        offset = self._sent.get(job.id, 0)
        self._sent[job.id] = offset + len(text)
        chunk = p.Chunk(id=job.id, offset=offset, text=text)
        self._chunks += [job.key, job.id, chunk.model_dump_json()]

    def flush_streams(self) -> None:
        """One script call sends every chunk of the step to the gateways that own them."""
        if not self._chunks:
            return
        args, self._chunks = self._chunks, []
        try:
            self._stream(args=args)
        except redis.RedisError:
            log.warning("could not stream %d chunks", len(args) // 3)  # the answer carries the whole text

    # -- the continuous loop: schedule, step, deliver ----------------------------------

    def _run_continuous(self) -> None:
        """Requests join the engine between steps and leave when they finish."""
        while self._wait_for_work():
            try:
                started = _monotonic_ms()
                self.renew_lease_if_due()
                self._check_drained()
                self._admit()
                if self.engine.has_unfinished():
                    self._step()
                    self._loop_times[0] += _monotonic_ms() - started
                    self._loop_times[1] += 1
                self._idle_if_empty()
            except Exception:  # Redis away, a bad message: never let the loop die
                log.exception("continuous loop error; %d requests running", len(self._joined))
                self._fail_running()
                self._stopped.wait(0.1)

    def _idle_if_empty(self) -> None:
        """The engine holds nothing, whatever emptied it (the last request finished, was
        cancelled or expired, lost its claim or was refused): the replica is idle."""
        if not self.busy or self.engine.has_unfinished() or self._joined:
            return
        with self._cond:
            self.busy = False
        pipe = self.redis.pipeline(transaction=False)
        self._mark_idle(pipe)
        pipe.execute()

    def _wait_for_work(self) -> bool:
        """Block until there is a step to run, a request to admit or a lease to renew;
        False once stopping with nothing left."""
        with self._cond:
            while True:
                running = self.engine.has_unfinished()
                can_join = len(self.collector) > 0 and self.engine.free_slots() > 0
                if running or can_join:
                    return True
                if self._stopping and not self.collector:
                    return False
                renew_in = self._renew_at_ms - _monotonic_ms()
                if renew_in <= 0:
                    return True
                self._cond.wait(renew_in / 1000.0)

    def _admit(self) -> list[Pending]:
        """Drop what was cancelled or expired (buffered or running), claim what fits the
        free slots and add it to the engine."""
        self.collector.config.batch_ms = self.engine.expected_batch_ms()  # learned, not assumed
        with self._cond:
            ids = self.collector.ids()
            room = min(self.collector.num_free(), self.engine.free_slots()) if self._is_taking() else 0
        running = list(self._joined)
        reasons, late_paid = self._cancels_and_paid(ids + running, room)
        now = self.clock.now_ms()
        self._abort_running(reasons, now)
        with self._cond:
            dropped = self._sort_buffer(late_paid, reasons, now)
            batch = self.collector.pop_batch(limit=self.engine.free_slots())
            if batch:
                self.busy = True
        if late_paid:
            launched = {pending.id for pending in batch}
            self._write_held([job for job, _raw in late_paid if job.id not in launched])
        batch = self._settle(batch, {reason: group for reason, group in dropped.items() if group})
        return self._join(batch)

    def _join(self, batch: list[Pending]) -> list[Pending]:
        refused: list[tuple[Pending, p.Failed]] = []
        now = self.clock.now_ms()
        for pending in batch:
            job = held(pending).job
            if job.id in self._joined:  # a second copy of a running request (a rescue raced
                continue  # its record): it runs once; copies in one batch: `Collector.pop_batch`
            try:
                self.engine.add_request(job)
            except RequestError as err:
                failed = p.Failed(
                    id=job.id,
                    message=err.message,
                    replica=self.name,
                    per_request=True,
                    code=err.code,
                    status=err.status,
                )
                refused.append((pending, failed))
                continue
            self._joined[job.id] = (pending, now)
        if refused:
            pipe = self.redis.pipeline(transaction=False)
            self._reply(pipe, [failed for _pd, failed in refused], [held(pd).job for pd, _f in refused])
            pipe.execute()
        if batch:
            self.events.started([pending for pending in batch if pending.id in self._joined])
        return batch

    def _abort_running(self, reasons: dict[str, str], now_ms: float) -> None:
        """A running request whose client went (or whose deadline passed) leaves at this
        step: its slot is free for the next request."""
        gone: dict[str, list[Pending]] = defaultdict(list)
        running = max(1, len(self._joined))
        for attempt, (pending, joined) in list(self._joined.items()):
            reason = reasons.get(attempt) or ("expired" if now_ms > pending.deadline_ms else None)
            if reason is None:
                continue
            self.stats.waste(1, max(0.0, now_ms - joined) / running)  # ran until now for nobody
            self.engine.abort_request(attempt)
            del self._joined[attempt]
            self._sent.pop(attempt, None)
            gone[reason].append(pending)
        if not gone:
            return
        pipe = self.redis.pipeline(transaction=False)
        notices = [
            p.Dropped(id=pd.id, reason=reason, replica=self.name) for reason, group in gone.items() for pd in group
        ]
        self._reply(pipe, notices, [held(pd).job for group in gone.values() for pd in group])
        pipe.execute()
        for reason, group in gone.items():
            self.stats.dropped[reason] += len(group)
            self.events.revoked(group, reason)

    def _step(self) -> None:
        self._batch_started = _monotonic_ms()
        num_running = len(self._joined)
        with self._engine_running():
            outputs = self.engine.step()
        self.perf.add(self._batch_started, _monotonic_ms())
        finished: list[tuple[Pending, StepOutput]] = []
        for out in outputs:
            entry = self._joined.get(out.id)
            if entry is None:
                continue
            if out.is_finished:
                finished.append((entry[0], out))
            else:
                self.stream_text(held(entry[0]).job, out.delta)
        self.flush_streams()
        if finished:
            self._answer_finished(finished, num_running)
        self.wake()

    def _answer_finished(self, finished: list[tuple[Pending, StepOutput]], num_running: int) -> None:
        end = self.clock.now_ms()
        items: list[object] = []
        jobs: list[p.Job] = []
        shares: list[float] = []
        for pending, out in finished:
            _pd, start = self._joined.pop(out.id)
            self._sent.pop(out.id, None)
            job = held(pending).job
            output = Output.of(out)
            items.append(self._result(job, output, num_running, start, end))
            jobs.append(job)
            shares.append((end - start) / max(1, num_running))
        pipe = self.redis.pipeline(transaction=False)
        self._reply(pipe, items, jobs)
        traffic.record_done(pipe, self.model, ((job.tier, end - job.received_ms) for job in jobs), end)
        self._lease_commands(pipe)
        wasted = int(pipe.execute()[0][1])  # DELIVER: results nobody waited for
        self.stats.waste(wasted, sum(shares) / len(shares))
        self.stats.num_batches += 1
        self.stats.num_requests += len(jobs)
        self.stats.last_batch_size = num_running
        self.events.succeeded([pending for pending, _out in finished], (end - finished[0][0].arrived_ms) / 1000.0)

    def _fail_running(self) -> None:
        """The loop failed around a step: answer what runs (503, retry) and empty the engine."""
        batch = [pending for pending, _start in self._joined.values()]
        for attempt in list(self._joined):
            self.engine.abort_request(attempt)
        self._joined.clear()
        self._sent.clear()
        self._fail_quietly(batch)

    # -- cancels and the registry -------------------------------------------------

    def _cancel_reasons(self, ids: list[str]) -> dict[str, str]:
        return self._cancels_and_paid(ids, 0)[0]

    def _cancels_and_paid(
        self, ids: list[str], room: int, behind: int = 0
    ) -> tuple[dict[str, str], list[tuple[p.Job, str]]]:
        if not ids and not room and not behind:
            return {}, []
        pipe = self.redis.pipeline(transaction=False)
        if ids:
            pipe.mget([p.cancel_key(i) for i in ids])
        if room:
            pipe.rpop(p.queue_key(self.model, "paid"), room)
        if behind:
            pipe.rpop(p.queue_key(self.model, "free"), behind)
        results = pipe.execute()
        values = results[0] if ids else []
        reasons = {i: v.decode() for i, v in zip(ids, values, strict=True) if v is not None}
        raws = [raw for popped in results[1 if ids else 0 :] for raw in popped or []]
        jobs = []
        for raw in raws:
            try:
                jobs.append((job_from_message(raw), raw.decode()))
            except (ValueError, KeyError, TypeError, IndexError):
                log.warning("dropping a malformed paid message")
        if jobs:  # rare: late paid requests may have been cancelled while queued
            late = [job.id for job, _raw in jobs]
            # The client does not decode replies: the values are bytes.
            values = cast("list[bytes | None]", self.redis.mget([p.cancel_key(i) for i in late]))
            reasons.update({i: v.decode() for i, v in zip(late, values, strict=True) if v is not None})
        return reasons, jobs

    def cancelled(self, ids: Iterable[str]) -> list[str]:
        return list(self._cancel_reasons(list(ids)))

    def _heartbeat(self) -> None:
        stalled_beats = 0
        last = _monotonic_ms()
        while not self._stopped.wait(self.heartbeat_s):
            now = _monotonic_ms()
            if now - last > self.ttl_s * 1000 * 2 / 3:
                log.warning("heartbeat %.0f ms late: the registry may have dropped this replica", now - last)
            last = now
            stalled_beats = stalled_beats + 1 if self._is_stalled() else 0
            if stalled_beats >= 2:
                self._give_up_stalled()
            try:
                self._sync_clock()
                self._publish_state()
            except redis.RedisError:
                log.warning("heartbeat failed")

    @contextmanager
    def _engine_running(self) -> Iterator[None]:
        """The watchdog's window: the engine runs a step (a static batch reports each of
        its steps, `engine_stepped`). Only the engine can hang here; waiting for work, the
        broker or an aborted request cannot open it or leave it open."""
        self._engine_since = _monotonic_ms()
        try:
            yield
        finally:
            self._engine_since = None

    def engine_stepped(self) -> None:
        """A step of a static batch ended: the engine moves, however long its batch runs."""
        if self._engine_since is not None:
            self._engine_since = _monotonic_ms()

    def _engine_running_ms(self) -> float:
        since = self._engine_since  # read once: the loop thread clears it
        return 0.0 if since is None else _monotonic_ms() - since

    def _is_stalled(self) -> bool:
        """A step far past the time of a whole batch: the engine hangs."""
        return self._engine_running_ms() > self.engine.expected_batch_ms() + self.stall_ms

    def _give_up_stalled(self) -> None:
        """Say so, then exit: the lease lapses, the held requests are re-queued
        elsewhere, and the supervisor starts a fresh replica."""
        log.error(
            "batch running %.0f ms (expected %.0f): restarting",
            self._engine_running_ms(),
            self.engine.expected_batch_ms(),
        )
        if can_transition(self.state, ReplicaState.STALLED):
            self.state = transition(self.state, ReplicaState.STALLED)
        try:
            self._publish_state()
        finally:
            os._exit(3)

    def _engine_fields(self) -> dict[str, float]:
        stats = getattr(self.engine, "stats", None)
        if stats is None:
            return {}
        fields = {f"{ENGINE_PREFIX}{k}": round(v, 3) for k, v in _numeric(stats()).items()}
        if self.engine.continuous:  # the loop around the steps: admit, step, answer
            fields[f"{ENGINE_PREFIX}total_loop_ms"], fields[f"{ENGINE_PREFIX}total_loops"] = self._loop_times
        return fields

    def report(self) -> dict[str, EncodableT]:
        """What the replica publishes in the registry (and answers over remote control)."""
        with self._cond:
            buffered = len(self.collector)
        return {
            "model": self.model,
            "state": self.state.label,
            "held": buffered + self._num_running(),
            "moving_to": self.moving_to,
            "backend": self.engine.name,
            "max_batch": self.engine.max_batch,
            "batch_ms": self.engine.expected_batch_ms(),
            "buffered": buffered,
            "busy": int(self.busy),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "seen_ms": self.clock.now_ms(),
            "why_not_ready": self.why_not_ready,
            "clock_offset_ms": round(getattr(self.clock, "offset_ms", 0.0), 1),
            **self.stats.as_fields(),
            **self.perf.as_fields(_monotonic_ms()),
            **self._engine_fields(),
        }

    def _publish_state(self) -> None:
        fields = self.report()
        key = p.replica_key(self.name)
        pipe = self.redis.pipeline(transaction=False)
        # redis-py types the mapping's keys invariantly as FieldT, which refuses a dict[str, ...].
        pipe.hset(key, mapping=cast("dict[FieldT, EncodableT]", fields))
        pipe.pexpire(key, int(self.ttl_s * 1000))
        pipe.sadd(p.REPLICAS_KEY, self.name)
        if not self.busy and self.state.takes_work:
            self._mark_idle(pipe, refresh_only=self._loop.is_alive())
        pipe.execute()

    # -- operator actions: drain, resume, move (states: control/core/lifecycle.py) ----------

    def _is_taking(self) -> bool:
        return not self._stopping and self.state.takes_work

    def _is_flushing(self) -> bool:
        """Run what is buffered now, without waiting to fill a batch."""
        return self._stopping or not self.state.takes_work

    def _num_running(self) -> int:
        if self.engine.continuous:
            return len(self._joined)
        return self.stats.last_batch_size if self.busy else 0

    def _set_state(self, wanted: ReplicaState, only_from: ReplicaState | None = None) -> bool:
        """Move to `wanted` (IllegalTransition if the table forbids it); with `only_from`,
        only if the replica is in that state now (else False: another thread moved it)."""
        with self._cond:
            if only_from is not None and self.state != only_from:
                return False
            self.state = transition(self.state, wanted)
            self._quiet_since = None
            self._cond.notify_all()
        try:
            self._publish_state()
        except redis.RedisError:
            log.warning("could not publish the state %s", wanted.label)
        return True

    def drain(self) -> ReplicaState:
        """Take no new work; finish what is held; then report drained. Idempotent."""
        if self.state in (ReplicaState.DRAINING, ReplicaState.DRAINED):
            return self.state
        self._set_state(ReplicaState.DRAINING)
        try:  # peers must not count on this replica for the next batch
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(p.idle_key(self.model), self.name)
            pipe.zrem(p.launch_key(self.model), self.name)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not leave the idle and launch lists")
        return self.state

    def resume(self) -> ReplicaState:
        """Serve again (a drain is called off). Idempotent."""
        if self.state == ReplicaState.MOVING:
            raise ValueError("a moving replica serves again once its new model is loaded")
        if self.state != ReplicaState.SERVING:
            self.moving_to = ""
            self._set_state(ReplicaState.SERVING)
            self._rejoin_idle()
            self.wake()  # the consumer asks the gate again
        return self.state

    def _rejoin_idle(self) -> None:
        """Back in the model's idle list (a heartbeat only refreshes an entry), so peers
        leave new work to it as to any idle replica."""
        if self.busy:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            self._mark_idle(pipe)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not rejoin the idle list")

    def move(self, model: str) -> ReplicaState:
        """Drain, then load `model`, consume its queue instead and serve it."""
        if self.load_engine is None:
            raise IllegalTransition(self.state, ReplicaState.MOVING)
        if model == self.model and self.state == ReplicaState.SERVING:
            return self.state
        if self.state == ReplicaState.MOVING or not (
            self.state == ReplicaState.DRAINED or can_transition(self.state, ReplicaState.DRAINING)
        ):
            raise IllegalTransition(self.state, ReplicaState.MOVING)
        self.moving_to = model
        state = self.drain()
        self._check_drained()
        return state

    def _check_drained(self) -> None:
        """A draining replica that holds nothing, and whose consumer has no pull in
        flight, twice in a row at least 20 ms apart (a pull decided just before the gate
        shut may start a moment later), is drained; a drained one with a move to make
        makes it."""
        if self.state == ReplicaState.DRAINED and self.moving_to:
            self._start_move()
            return
        if self.state != ReplicaState.DRAINING:
            return
        with self._cond:
            quiet = not self.collector and not self.busy and not self._joined and not self.is_polling()
            now = _monotonic_ms()
            if not quiet:
                self._quiet_since = None
                return
            if self._quiet_since is None:
                self._quiet_since = now
                return
            if now - self._quiet_since < 20.0:
                return
        if self._set_state(ReplicaState.DRAINED, only_from=ReplicaState.DRAINING):
            log.info("replica %s drained", self.name)
            if self.moving_to:
                self._start_move()

    def _start_move(self) -> None:
        if not self.moving_to or not self._set_state(ReplicaState.MOVING, only_from=ReplicaState.DRAINED):
            return
        threading.Thread(target=self._move, name=f"move-{self.name}", daemon=True).start()

    def _move(self) -> None:
        """Load the other model (seconds for a real one: off the batching loop), switch
        the consumer to its queue, and serve it."""
        old, new = self.model, self.moving_to
        try:
            assert self.load_engine is not None
            engine = self.load_engine(new) if new != old else self.engine
            self._finish_old_model()
            self.switch_queue(p.queue_name(old), p.queue_name(new))
        except Exception:
            log.exception("could not move %s to %s; it stays drained on %s", self.name, new, old)
            self.moving_to = ""
            self._set_state(ReplicaState.DRAINED, only_from=ReplicaState.MOVING)
            return
        with self._cond:
            self.engine, self.model = engine, new
            self.collector.config.batch_ms = engine.expected_batch_ms()
            self.gate.peers(idle=True, launches=[])
        self.moving_to = ""
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(p.idle_key(old), self.name)
            pipe.set(p.assignment_key(self.name), new)  # kept across a restart (control/cli/main.py)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not record the move of %s to %s", self.name, new)
        self._set_state(ReplicaState.SERVING, only_from=ReplicaState.MOVING)
        self._rejoin_idle()
        log.info("replica %s moved from %s to %s", self.name, old, new)
        self.wake()

    def _finish_old_model(self, timeout_s: float = 30.0) -> None:
        """Run anything of the old model still here before its engine goes (none, unless a
        pull slipped past the drained check): the loop runs it, as the replica takes no work."""
        deadline = _monotonic_ms() + timeout_s * 1000
        while self.collector or self.busy or self._joined:
            if _monotonic_ms() > deadline:
                raise TimeoutError("requests of the old model still running")
            self._stopped.wait(0.01)


def _numeric(stats: dict[str, object]) -> dict[str, float]:
    return {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def held(pending: Pending) -> Held:
    return pending.payload


def _monotonic_ms() -> float:
    return time.monotonic() * 1000.0
