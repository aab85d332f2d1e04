"""One model replica: a buffer, a batching loop and the Redis glue around them.

No Celery here: the Celery consumer hands each request to `Replica.submit`
together with a callable that acknowledges its message. The loop thread waits
until the collector says a batch is due, checks the whole buffer for cancels in
one MGET, runs the engine, and answers every gateway in one pipelined write.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import redis

from control import protocol as p
from control.clock import Clock
from tasks.app import job_from_message
from tasks.collector import Collector, CollectorConfig, Pending
from tasks.engine import Engine, Output

log = logging.getLogger(__name__)

REPLY_TTL_S = 60


@dataclass
class Held:
    """What the replica keeps for a buffered request besides the policy fields."""

    job: p.Job


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

    def as_fields(self) -> dict[str, int]:
        fields = {
            "num_batches": self.num_batches,
            "num_requests": self.num_requests,
            "last_batch_size": self.last_batch_size,
        }
        for reason in ("cancelled", "superseded", "expired"):
            fields[f"dropped_{reason}"] = self.dropped[reason]
        return fields


class _Control:
    """BatchControl for one running batch."""

    def __init__(self, replica: Replica, batch: list[Pending]) -> None:
        self.replica = replica
        self.ids = [pending.id for pending in batch]

    def cancelled(self) -> set[str]:
        return set(self.replica.cancelled(self.ids))

    def emit(self, request_id: str, text: str) -> None:  # streaming comes with the hf engine
        pass


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
    ) -> None:
        self.name = name
        self.model = model
        self.engine = engine
        self.collector = Collector(config)
        self.redis = client
        self.clock = clock
        self.events = events or NoEvents()
        self.wake = wake or (lambda: None)
        self.pull_lead_ms = pull_lead_ms
        self._pull_at_ms = 0.0
        self._ends_at_ms = 0.0
        self._peer_idle = True  # until the first batch says otherwise
        self._peer_launches: list[float] = []  # when the model's other replicas last started
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.stats = Stats()
        self.state = "starting"
        self.busy = False
        self._cond = threading.Condition()
        self._stopping = False
        self._stopped = threading.Event()
        self._loop = threading.Thread(target=self._run, name=f"batching-{name}", daemon=True)
        self._beat = threading.Thread(target=self._heartbeat, name=f"heartbeat-{name}", daemon=True)

    # -- life cycle ----------------------------------------------------------

    def start(self) -> None:
        self.state = "ready"
        self._publish_state()
        self._loop.start()
        self._beat.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop taking work, run what is buffered, leave the registry."""
        self.state = "stopping"
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._loop.join(timeout_s)
        self._stopped.set()
        self._beat.join(timeout_s)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(p.replica_key(self.name)).srem(p.REPLICAS_KEY, self.name)
            pipe.zrem(p.idle_key(self.model), self.name)
            pipe.zrem(p.launch_key(self.model), self.name)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not leave the replica registry")

    def wants_messages(self) -> bool:
        """May the consumer pull another request from the shared queue now?

        An idle replica pulls up to two batches. A busy one pulls at most one
        next batch, and only while no other replica of its model frees before
        it: what arrives goes to whichever replica starts next. An idle peer
        takes everything (low load: idle replicas first). Either way a busy
        replica pulls from `pull_lead_ms` before it expects to be free. Read
        without the lock: a stale answer costs one message at most.
        """
        if self._stopping:
            return False
        limit = self.collector.config.max_batch
        if not self.busy:
            return len(self.collector) < 2 * limit
        if len(self.collector) >= limit:
            return False
        now = self.clock.now_ms()
        if now >= self._pull_at_ms:
            return True
        return not self._peer_idle and not self._peers_free_first(now)

    def _peers_free_first(self, now_ms: float) -> list[float]:
        """The expected ends of the peers' batches that fall between now and this replica's end."""
        batch_ms = self.engine.expected_batch_ms()
        ends = (t + batch_ms for t in self._peer_launches)
        return [end for end in ends if now_ms < end < self._ends_at_ms]

    def reopens_at_ms(self) -> float | None:
        """When a shut gate opens again by itself (None: not before work leaves)."""
        if not self.busy or self._stopping:
            return None
        if len(self.collector) >= self.collector.config.max_batch:
            return self._ends_at_ms
        first = self._peers_free_first(self.clock.now_ms())
        return min(self._pull_at_ms, max(first)) if first and not self._peer_idle else self._pull_at_ms

    def submit(self, job: p.Job) -> None:
        """Buffer one request (called from the consumer's thread)."""
        pending = self._pending(job)
        with self._cond:
            self.collector.add(pending)
            self._cond.notify()

    def _pending(self, job: p.Job) -> Pending:
        return Pending(job.id, job.tier, job.received_ms, job.deadline_ms, Held(job), self.clock.now_ms())

    # -- the loop: wait, take, run, answer -------------------------------------

    def _run(self) -> None:
        while self._wait_until_due():
            batch: list[Pending] = []
            try:
                batch, dropped = self._take()
                self._settle(batch, dropped)
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

    def _wait_until_due(self) -> bool:
        """Block until a batch is due; False once stopping with nothing left."""
        with self._cond:
            while True:
                wait = self.collector.wait_ms(self.clock.now_ms())
                if wait is None and self._stopping:
                    return False
                if wait == 0 or (wait is not None and self._stopping):
                    return True
                self._cond.wait(None if wait is None else wait / 1000.0)

    def _take(self) -> tuple[list[Pending], dict[str, list[Pending]]]:
        with self._cond:
            ids = self.collector.ids()
            room = 0 if self._stopping else self.collector.num_free()
        # One round trip: cancels for the whole buffer, and paid requests still in
        # the queue that would otherwise ride behind free ones already buffered.
        reasons, late_paid = self._cancels_and_paid(ids, room)
        dropped: dict[str, list[Pending]] = defaultdict(list)
        with self._cond:
            for job in late_paid:
                self.collector.add(self._pending(job))
            for pending in self.collector.remove(set(reasons)):
                dropped[reasons[pending.id]].append(pending)
            now = self.clock.now_ms()
            dropped["expired"].extend(self.collector.pop_expired(now))
            due = self.collector.wait_ms(now) == 0 or self._stopping
            batch = self.collector.pop_batch() if due else []
            if batch:
                self._ends_at_ms = now + self.engine.expected_batch_ms()
                self._pull_at_ms = self._ends_at_ms - self.pull_lead_ms
                self.busy = True
        return batch, {reason: group for reason, group in dropped.items() if group}

    def _settle(self, batch: list[Pending], dropped: dict[str, list[Pending]]) -> None:
        """Tell the waiting-room and the gateways which requests left the buffer."""
        leaving = batch + [pending for group in dropped.values() for pending in group]
        if not leaving:
            return
        pipe = self.redis.pipeline(transaction=False)
        by_tier: dict[str, list[str]] = defaultdict(list)
        for pending in leaving:
            by_tier[pending.tier].append(pending.id)
        for tier, ids in by_tier.items():
            pipe.zrem(p.waiting_key(self.model, tier), *ids)  # type: ignore[arg-type]
        notices = [
            p.Dropped(id=pending.id, reason=reason, replica=self.name)  # type: ignore[arg-type]
            for reason, group in dropped.items()
            for pending in group
        ]
        self._reply(pipe, notices, [held(pd).job for group in dropped.values() for pd in group])
        idle = p.idle_key(self.model)
        if batch:
            now = self.clock.now_ms()
            pipe.zrem(idle, self.name)
            pipe.zcount(idle, now, "+inf")
            pipe.zadd(p.launch_key(self.model), {self.name: now})
            pipe.zrange(p.launch_key(self.model), 0, -1, withscores=True)
        results = pipe.execute()
        if batch:
            self._peer_idle = results[-3] > 0
            self._peer_launches = self._others(results[-1])
        for reason, group in dropped.items():
            self.stats.dropped[reason] += len(group)
            self.events.revoked(group, reason)

    def _execute(self, batch: list[Pending]) -> None:
        jobs = [held(pending).job for pending in batch]
        self.events.started(batch)
        start = self.clock.now_ms()
        try:
            outputs = self.engine.run(jobs, _Control(self, batch))
        except Exception as exc:  # the engine failed: every request gets an error, not silence
            log.exception("batch failed")
            self._answer_failed(batch, repr(exc))
            return
        end = self.clock.now_ms()
        self._answer(jobs, outputs, start, end)
        self.stats.num_batches += 1
        self.stats.num_requests += len(batch)
        self.stats.last_batch_size = len(batch)
        self.busy = False
        self.wake()
        self.events.succeeded(batch, (end - start) / 1000.0)

    def _answer(self, jobs: list[p.Job], outputs: list[Output], start: float, end: float) -> None:
        results = [
            p.Result(
                id=out.id,
                text=out.text,
                finish_reason=out.finish_reason,
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                replica=self.name,
                backend=self.engine.name,
                batch_size=len(jobs),
                batch_start_ms=start,
                batch_end_ms=end,
            )
            for out in outputs
        ]
        pipe = self.redis.pipeline(transaction=False)
        self._reply(pipe, results, jobs)
        self._mark_idle(pipe)
        pipe.zrange(p.launch_key(self.model), 0, -1, withscores=True)
        self._peer_launches = self._others(pipe.execute()[-1])
        with self._cond:  # the phase of the next batch, now that this one is done
            self.collector.stagger_from(self._peer_launches, len(jobs), self.clock.now_ms())

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
        """Queue one reply message per gateway onto `pipe`; forget the owners."""
        by_gateway: dict[str, list] = defaultdict(list)
        for item, job in zip(items, jobs, strict=True):
            by_gateway[job.gateway].append(item)
        for gateway, group in by_gateway.items():
            key = p.reply_key(gateway)
            pipe.rpush(key, p.Reply(items=group).model_dump_json())
            pipe.expire(key, REPLY_TTL_S)
        if jobs:
            pipe.delete(*(p.owner_key(job.id) for job in jobs))

    # -- cancels and the registry -------------------------------------------------

    def _cancel_reasons(self, ids: list[str]) -> dict[str, str]:
        return self._cancels_and_paid(ids, 0)[0]

    def _cancels_and_paid(self, ids: list[str], room: int) -> tuple[dict[str, str], list[p.Job]]:
        if not ids and not room:
            return {}, []
        pipe = self.redis.pipeline(transaction=False)
        if ids:
            pipe.mget([p.cancel_key(i) for i in ids])
        if room:
            pipe.rpop(p.queue_key(self.model, "paid"), room)
        results = pipe.execute()
        values = results[0] if ids else []
        reasons = {i: v.decode() for i, v in zip(ids, values, strict=True) if v is not None}
        raws = (results[-1] or []) if room else []
        jobs = []
        for raw in raws:
            try:
                jobs.append(job_from_message(raw))
            except (ValueError, KeyError, TypeError, IndexError):
                log.warning("dropping a malformed paid message")
        if jobs:  # rare: late paid requests may have been cancelled while queued
            late = [job.id for job in jobs]
            values = self.redis.mget([p.cancel_key(i) for i in late])
            reasons.update({i: v.decode() for i, v in zip(late, values, strict=True) if v is not None})
        return reasons, jobs

    def cancelled(self, ids: Iterable[str]) -> list[str]:
        return list(self._cancel_reasons(list(ids)))

    def _heartbeat(self) -> None:
        while not self._stopped.wait(self.heartbeat_s):
            try:
                self._publish_state()
            except redis.RedisError:
                log.warning("heartbeat failed")

    def _publish_state(self) -> None:
        with self._cond:
            buffered = len(self.collector)
        fields = {
            "model": self.model,
            "state": self.state,
            "backend": self.engine.name,
            "max_batch": self.engine.max_batch,
            "batch_ms": self.engine.expected_batch_ms(),
            "buffered": buffered,
            "busy": int(self.busy),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "seen_ms": self.clock.now_ms(),
            **self.stats.as_fields(),
        }
        key = p.replica_key(self.name)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, int(self.ttl_s * 1000))
        pipe.sadd(p.REPLICAS_KEY, self.name)
        if not self.busy and self.state == "ready":
            self._mark_idle(pipe, refresh_only=self._loop.is_alive())
        pipe.execute()


def held(pending: Pending) -> Held:
    return pending.payload  # type: ignore[no-any-return]
