"""The gateway's side of the request path: admit, enqueue, wait, and route replies.

Each gateway process has an id and one reply list in Redis. Replicas push one
message per batch onto it; one listener thread here reads it and wakes the
waiting requests through an in-process map from request id to waiter. Cancels
and supersedes are routed the same way, to whichever gateway holds the request.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from celery import Celery

from api.errors import ApiError
from api.metrics import Metrics
from control import admission
from control import protocol as p
from control.admission import Capacity, Limits, Verdict
from control.clock import Clock
from control.fleet import FleetView
from control.settings import Settings
from tasks.app import TaskMessages

log = logging.getLogger(__name__)

CANCEL_TTL_MS = 120_000
FRESH_DEPTH_MS = 20.0  # queue depths seen this recently are trusted to refuse without Redis

# Shared by both scripts: mark a request cancelled and tell the gateway holding it.
# The owner value is "<gateway>|<waiting set>|<tenant>". A cancel from a client only
# finds requests of its own tenant ('' matches any: the gateway's own expiry).
_CANCEL_FN = """
local function cancel(id, reason, tenant)
  local owner = redis.call('GET', 'kb:req:' .. id)
  if not owner then return 0 end
  local a = string.find(owner, '|', 1, true)
  local b = string.find(owner, '|', a + 1, true)
  local gateway, waiting, who = owner:sub(1, a - 1), owner:sub(a + 1, b - 1), owner:sub(b + 1)
  if tenant ~= '' and tenant ~= who then return 0 end
  redis.call('SET', 'kb:cancel:' .. id, reason, 'PX', CANCEL_TTL_MS)
  redis.call('DEL', 'kb:req:' .. id)
  redis.call('ZREM', waiting, id)
  local key = 'kb:reply:' .. gateway
  redis.call('RPUSH', key, cjson.encode({items = {{kind = 'cancelled', id = id, reason = reason}}}))
  redis.call('EXPIRE', key, 60)
  return 1
end
""".replace("CANCEL_TTL_MS", str(CANCEL_TTL_MS))

CANCEL_LUA = _CANCEL_FN + "return cancel(ARGV[1], ARGV[2], ARGV[3])"

# KEYS: owner, waiting paid, waiting free, queue list, [session];
# ARGV: owner value, ttl ms, deadline, id, tier, max position, now, task message.
# Returns {status, paid waiting, free waiting}; status 1 admitted, 0 already in flight, -1 too deep.
ADMIT_LUA = (
    _CANCEL_FN
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[7])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[7])
local paid = redis.call('ZCARD', KEYS[2])
local free = redis.call('ZCARD', KEYS[3])
local position = paid + 1
local own = KEYS[2]
if ARGV[5] == 'free' then
  position = position + free
  own = KEYS[3]
end
if position > tonumber(ARGV[6]) then return {-1, paid, free} end
if redis.call('EXISTS', 'kb:cancel:' .. ARGV[4]) == 1 then return {0, paid, free} end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {0, paid, free} end
redis.call('ZADD', own, ARGV[3], ARGV[4])
redis.call('LPUSH', KEYS[4], ARGV[8])
if KEYS[5] then
  local previous = redis.call('SET', KEYS[5], ARGV[4], 'GET', 'PX', ARGV[2])
  if previous and previous ~= ARGV[4] then cancel(previous, 'superseded', '') end
end
return {1, paid, free}
"""
)


class DirectScript:
    """A Lua script called straight on a pooled connection.

    redis-py's command layer (argument filtering, retry wrapper, response
    callbacks, redis-py 8's operation timing) costs ~70 us per call here, a
    tenth of the gateway's CPU per request at the admission call alone; this
    packs, sends and reads on a connection from the same pool. The pool checks a
    connection before lending it (a server that closed it is noticed there); one
    that still fails at the send is dropped and the call sent once more on a
    fresh one. A failure after the send is not retried
    (the script may have run: admitting twice would refuse the request as a
    duplicate). A script the server forgot is loaded again.
    """

    def __init__(self, client: redis.Redis, source: str) -> None:
        self.script = client.register_script(source)
        self.pool = client.connection_pool

    def __call__(self, keys: list[str], args: list[object]) -> object:
        try:
            return self._call(keys, args)
        except redis.exceptions.NoScriptError:
            self.script.sha = self.script.registered_client.script_load(self.script.script)
            return self._call(keys, args)

    def _call(self, keys: list[str], args: list[object]) -> object:
        command = ("EVALSHA", self.script.sha, len(keys), *keys, *args)
        conn = self.pool.get_connection()
        try:
            try:
                conn.send_packed_command(conn.pack_command(*command))
            except (redis.ConnectionError, redis.TimeoutError):
                conn.disconnect()  # not sent: once more, on a new connection
                conn.send_packed_command(conn.pack_command(*command))
            return conn.read_response()
        except (redis.ConnectionError, redis.TimeoutError):
            conn.disconnect()
            raise
        finally:
            self.pool.release(conn)


@dataclass
class Waiter:
    """One request waiting in this process for its reply."""

    job: p.Job
    event: threading.Event = field(default_factory=threading.Event)
    item: p.Result | p.Dropped | p.Cancelled | p.Failed | None = None

    def resolve(self, item: p.Result | p.Dropped | p.Cancelled | p.Failed) -> None:
        if self.item is None:
            self.item = item
            self.event.set()


class Gateway:
    def __init__(self, settings: Settings, client: redis.Redis, celery: Celery, clock: Clock) -> None:
        self.settings = settings
        self.redis = client
        self.celery = celery
        self.clock = clock
        self.id = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
        self.fleet = FleetView(client)
        self.metrics = Metrics(self.fleet)
        self.limits = Limits(settings.max_queue_paid, settings.max_queue_free, settings.deadline_margin_ms)
        self.waiters: dict[str, Waiter] = {}
        self._depth: dict[str, tuple[int, int, float]] = {}  # model -> paid, free waiting, when seen
        self._paid_rate: dict[str, admission.RateMeter] = {}  # paid admissions per model (this process)
        # Set by the server: False once this process was told to stop (it then
        # finishes what it holds but admits nothing new, and /readyz says so).
        self.is_serving: Callable[[], bool] = lambda: True
        self._lock = threading.Lock()
        self._started = False
        self._admit = DirectScript(client, ADMIT_LUA)
        self._task_message = TaskMessages(celery)
        self._cancel = client.register_script(CANCEL_LUA)

    def start(self) -> None:
        """Start the listener and the fleet view (once, in the serving process)."""
        if self._started:  # every request asks: no lock once started
            return
        with self._lock:  # held through the first registry read: no request sees an empty fleet
            if self._started:
                return
            self.fleet.start()
            threading.Thread(target=self._listen, name="reply-listener", daemon=True).start()
            self._started = True

    # -- submit ----------------------------------------------------------------

    def submit(self, job: p.Job, session_id: str | None, tenant: str = "anonymous") -> Waiter:
        """Admit and enqueue one request; raise ApiError if it cannot be taken."""
        self.start()
        if not self.is_serving():
            raise ApiError(503, "the gateway is shutting down", "shutting_down", retry_after_s=1)
        budget = job.deadline_ms - job.received_ms
        capacity = self.fleet.capacity(job.model)
        verdict, position = admission.check(budget, capacity, self.limits), 0
        if verdict == Verdict.ADMIT:
            now = self.clock.now_ms()
            # Each process sees its share of the paid traffic (connections spread evenly).
            meter = self._paid_rate.setdefault(job.model, admission.RateMeter())
            paid_rate = meter.rate(now) * self.settings.api_processes
            deepest = admission.max_position(job.tier, budget, capacity, self.limits, paid_rate)
            position = self._recent_position(job)
            if position > deepest:  # the queue was this deep a moment ago: refuse without a round trip
                verdict = Verdict.OVERLOADED
        if verdict == Verdict.ADMIT:
            waiter = Waiter(job)
            with self._lock:
                if job.id in self.waiters:
                    raise _in_flight(job.id)
                self.waiters[job.id] = waiter  # before the enqueue: a reply may come at once
            verdict = Verdict.OVERLOADED  # until the enqueue says otherwise (or raises)
            try:
                verdict, position = self._enqueue(job, session_id, deepest, tenant)
            finally:
                if verdict != Verdict.ADMIT:
                    with self._lock:
                        self.waiters.pop(job.id, None)
            if verdict == Verdict.ADMIT:
                if job.tier == "paid":
                    self._paid_rate[job.model].add(now)
                self.metrics.inflight.inc()
                return waiter
        self.metrics.rejected.labels(job.model, job.tier, verdict.name.lower()).inc()
        raise _refusal(verdict, budget, capacity, self.limits, position)

    def _recent_position(self, job: p.Job) -> int:
        """The request's queue position by the last admission's counts, if they are fresh."""
        paid, free, at_ms = self._depth.get(job.model, (0, 0, 0.0))
        if self.clock.now_ms() - at_ms > FRESH_DEPTH_MS:
            return 0
        return admission.position(job.tier, paid, free)

    def _enqueue(self, job: p.Job, session_id: str | None, deepest: int, tenant: str) -> tuple[Verdict, int]:
        """One round trip admits the request and enqueues its Celery task, or neither."""
        keys = [
            p.owner_key(job.id),
            p.waiting_key(job.model, "paid"),
            p.waiting_key(job.model, "free"),
            p.queue_key(job.model, job.tier),
        ]
        if session_id:
            keys.append(p.session_key(f"{tenant}:{session_id}"))
        ttl = int(job.deadline_ms - job.received_ms) + 5_000
        message = self._task_message(job)
        owner = f"{self.id}|{p.waiting_key(job.model, job.tier)}|{tenant}"
        args = [owner, ttl, job.deadline_ms, job.id, job.tier, deepest, self.clock.now_ms(), message]
        try:
            status, paid, free = self._admit(keys, args)  # type: ignore[misc]
        except redis.RedisError as exc:
            raise _broker_down(exc) from exc
        self._depth[job.model] = (paid, free, self.clock.now_ms())
        if status == 0:
            raise _in_flight(job.id)
        verdict = Verdict.OVERLOADED if status == -1 else Verdict.ADMIT
        return verdict, admission.position(job.tier, paid, free)

    # -- waiting, cancel, give up ----------------------------------------------------

    def wait(self, waiter: Waiter) -> None:
        """Block until the reply, a cancel, or the deadline (then give the request up)."""
        timeout_s = max(0.0, (waiter.job.deadline_ms - self.clock.now_ms()) / 1000.0)
        try:
            if not waiter.event.wait(timeout_s):
                waiter.resolve(p.Dropped(id=waiter.job.id, reason="expired", replica=""))
                try:  # so that a replica which has not started it drops it
                    self.cancel(waiter.job.id, "expired")
                except ApiError:
                    pass  # the broker is away; the answer is a 504 all the same
        finally:
            with self._lock:
                self.waiters.pop(waiter.job.id, None)
            self.metrics.inflight.dec()

    def cancel(self, request_id: str, reason: str, tenant: str = "") -> bool:
        """Cancel a request in flight on any gateway; False if none of `tenant`'s ('' any) is."""
        try:
            found = bool(self._cancel(args=[request_id, reason, tenant]))
        except redis.RedisError as exc:
            raise _broker_down(exc) from exc
        return found

    # -- replies ---------------------------------------------------------------------

    def _listen(self) -> None:
        key = p.reply_key(self.id)
        client = self.redis
        backlog: list[bytes] = []
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
                log.warning("reply listener lost Redis; retrying")
                threading.Event().wait(0.2)
                continue
            for raw in raws:
                try:
                    self._deliver(p.Reply.model_validate_json(raw))
                except Exception:  # one bad message must not stop the listener
                    log.exception("could not deliver a reply message")
            try:
                backlog = client.lpop(key, 256) or []
            except redis.RedisError:
                backlog = []

    def _deliver(self, reply: p.Reply) -> None:
        for item in reply.items:
            if isinstance(item, p.Dropped):
                self.metrics.dropped.labels(item.reason).inc()
            elif isinstance(item, p.Cancelled):
                self.metrics.cancels.labels(item.reason).inc()
            waiter = self.waiters.get(item.id)
            if waiter is None:
                if isinstance(item, p.Result):
                    self.metrics.wasted.inc()
                continue
            if isinstance(item, p.Result) and waiter.item is not None:
                self.metrics.wasted.inc()  # it came back after the client was answered
            waiter.resolve(item)

    def readiness(self) -> dict[str, int]:
        """Ready replicas per configured model."""
        self.start()
        counts = dict.fromkeys(self.settings.models, 0)
        for rep in self.fleet.replicas:
            if rep.is_ready and rep.model in counts:
                counts[rep.model] += 1
        return counts


def _in_flight(request_id: str) -> ApiError:
    return ApiError(
        409, f"request id {request_id} is in flight or was cancelled in the last two minutes", "request_in_flight"
    )


def _broker_down(exc: BaseException) -> ApiError:
    log.warning("broker unreachable: %r", exc)
    return ApiError(503, "the broker is unreachable; retry shortly", "broker_unavailable", retry_after_s=1)


def _refusal(verdict: Verdict, budget_ms: float, capacity: Capacity, limits: Limits, position: int) -> ApiError:
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
