"""Every Redis call a replica makes, and every key name and record it writes.

The rest of tasks/replica/ calls this module and never touches `redis`: the lease, the
held hash, the idle and launch lists, replies and streamed chunks (control/broker/scripts.py),
the registry entry and the claims. Key names come from control/broker/keys.py and records
are packed by control/broker/records.py. Each phase of the loop is one pipeline here,
so a request costs the broker what it did when the loop built them itself.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, cast

import redis
from redis.typing import EncodableT, FieldT

from control.broker import keys, records, scripts, traffic
from control.broker.envelope import job_from_message
from control.broker.leases import release_replica
from control.broker.lua import LISTENER_LUA, TAKE_QUEUED_LUA
from control.core import protocol as p
from control.core.vocab import FREE, PAID

log = logging.getLogger(__name__)

BrokerError = redis.RedisError  # what a call raises when the broker is away
Client = redis.Redis
Fields = dict[str, str | int | float]  # a registry entry (control/broker/records.py)

Reply = p.Result | p.Failed | p.Dropped


HEDGE_SCAN = 256  # members of the running set (running or buffered requests) a hedge reads at most, by deadline


class Taken(NamedTuple):
    reasons: dict[str, str]  # per id that has one, why it left (cancelled, superseded, ...)
    late: list[tuple[p.Job, str]]  # requests taken from the queue now, with their raw messages
    launches: list[float] | None  # the peers' latest launches, where asked
    copied: set[str]  # buffered requests another replica runs a copy of


class CopyWork(NamedTuple):
    idle: int  # replicas of the model in its idle list
    launched: int  # replicas of the model in its launch list (every one that ran a batch)
    running: list[tuple[bytes, float]]  # members of its running set a copy may still answer (member, deadline)


class Settled(NamedTuple):
    claimed: list[bool]  # per launched request: this replica runs it
    peers_idle: bool  # a peer is idle
    launches: list[float]  # when the peers last started a batch
    running: list[tuple[bytes, float]]  # the model's running or buffered requests a hedge may copy (member, deadline)


class Answered(NamedTuple):
    wasted: int  # results nobody waited for (answered already or gone)
    launches: list[float] | None  # the peers' launches, at a batch's end
    hedge_wins: int  # second copies that answered first
    hedge_wasted: int  # second copies whose request was answered already


@functools.lru_cache(maxsize=64)
def _fill_lists(model: str) -> tuple[str, ...]:
    """A model's queue lists in the order a take's fill pops them (made once per model)."""
    return (
        keys.queue_key(model, PAID),
        keys.queue_key(model, PAID, True),
        keys.queue_key(model, FREE),
        keys.queue_key(model, FREE, True),
    )


class ReplicaBroker:
    """One replica's side of the broker (its name is in most of the keys)."""

    def __init__(self, client: redis.Redis, name: str, envelope: Callable[[p.Job], str]) -> None:
        self.redis = client
        self.name = name
        self.envelope = envelope  # the queue message of a job: what a hand-back pushes
        self._claim = scripts.Claim(client)
        self._record_held = scripts.Record(client)
        self._deliver = scripts.Deliver(client)
        self._stream = scripts.Stream(client)
        self._take_queued = client.register_script(TAKE_QUEUED_LUA)
        self._hedge = scripts.Hedge(client)
        self._listener = client.register_script(LISTENER_LUA)

    # -- life cycle ------------------------------------------------------------

    def lease_left_ms(self) -> int:
        """What is left of a lease under this name (a replica restarted under it)."""
        return int(self.redis.pttl(keys.lease_key(self.name)))

    def release_held(self, min_run_ms: float) -> tuple[int, int]:
        """Re-queue what a replica under this name held: (re-queued, expired)."""
        return release_replica(self.redis, self.name, min_run_ms)

    def leave(self, model: str) -> None:
        """Out of the registry, the holders, the idle and launch lists; lease and held gone."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(keys.replica_key(self.name))
        pipe.srem(keys.REPLICAS_KEY, self.name)
        pipe.delete(keys.lease_key(self.name), keys.held_key(self.name))
        pipe.srem(keys.HOLDERS_KEY, self.name)
        pipe.zrem(keys.idle_key(model), self.name)
        pipe.zrem(keys.launch_key(model), self.name)
        pipe.delete(keys.pulse_key(self.name))
        pipe.hdel(keys.PULSES_KEY, self.name)
        pipe.execute()

    def pulse(self, ttl_ms: int) -> None:
        """Renew the replica's pulse key; where it had lapsed (or at the first), note again
        that a sweep should watch it: one command a pulse, two after a lapse."""
        if self.redis.set(keys.pulse_key(self.name), 1, px=ttl_ms, get=True) is None:
            self.redis.hset(keys.PULSES_KEY, self.name, 1)

    # -- the listener's turn (SINGLE_LISTENER) ------------------------------------------

    def take_listener(self, model: str, ttl_ms: int) -> bool:
        """The model's listener token, if no other replica holds it."""
        return bool(self.redis.set(keys.listener_key(model), self.name, nx=True, px=ttl_ms))

    def listener_holder(self, model: str) -> str:
        """The replica that holds the model's listener token ("": none)."""
        held = self.redis.get(keys.listener_key(model))
        return held.decode() if isinstance(held, bytes) else (held or "")

    def renew_listener(self, model: str, ttl_ms: int) -> bool:
        """Keep the token another `ttl_ms`; False: it is not this replica's any more."""
        return bool(self._listener([keys.listener_key(model), keys.listener_turn_key(model)], [self.name, ttl_ms]))

    def hand_on_listener(self, model: str) -> None:
        """Give the token up and wake one idle replica waiting for it."""
        self._listener([keys.listener_key(model), keys.listener_turn_key(model)], [self.name, ""])

    def await_listener(self, model: str, timeout_s: float) -> None:
        """Block until a holder hands the token on, or `timeout_s` passes."""
        self.redis.blpop([keys.listener_turn_key(model)], timeout=timeout_s)

    # -- intake: the held hash and the queue --------------------------------------

    def push_back(self, job: p.Job) -> None:
        """Back to the front of its queue (BRPOP's end), for the consumer that asks next."""
        self._push_front(self.redis, [job])

    def _push_front(self, client: redis.Redis | redis.client.Pipeline, jobs: Sequence[p.Job]) -> None:
        """Each job to the front of its queue, the first of `jobs` the first to be popped
        (RPUSH: the consumer pops from the right)."""
        fronts: dict[str, list[str]] = defaultdict(list)
        for job in reversed(jobs):
            fronts[keys.queue_key(job.model, job.tier, job.behind)].append(self.envelope(job))
        for queue, messages in fronts.items():
            client.rpush(queue, *messages)

    def record_held(self, jobs: list[p.Job], host: str | None = None) -> None:
        """Write arrivals into the held hash, in one RECORD call; only those still in
        flight: one answered meanwhile must not come back. With `host` (this replica's,
        where hedging is on) those not streamed join their model's running set too, for
        another host's batch to copy while they wait here. Logs a broker that is away."""
        if not jobs:
            return
        entries = [scripts.HeldEntry(job.id, self._held_record(job), self._member(job, host)) for job in jobs]
        try:
            self._record_held(self.name, entries, jobs[0].model)
        except redis.RedisError:
            log.warning("could not record %d requests as held", len(jobs))

    def _member(self, job: p.Job, host: str | None) -> str:
        if host is None or job.stream:  # a stream's text must come from one run
            return ""
        return records.pack_running(job.id, self.name, host, job.tier, job.max_tokens, job.key)

    def _held_record(self, job: p.Job) -> str:
        """Names the request; a sweep finds its message in the owner record."""
        queue = keys.queue_key(job.model, job.tier, job.behind)
        waiting = keys.waiting_key(job.model, job.tier, job.behind)
        return records.pack_held(job.deadline_ms, queue, waiting, job.key)

    def forget_held(self, ids: list[str]) -> None:
        """Held entries of requests another replica runs; a stale one is swept harmlessly."""
        try:
            self.redis.hdel(keys.held_key(self.name), *ids)
        except redis.RedisError:
            pass  # the claim shows who runs it

    # -- the lease -------------------------------------------------------------------

    def _lease(self, pipe: redis.client.Pipeline, lease_ms: float) -> None:
        pipe.set(keys.lease_key(self.name), 1, px=int(lease_ms))
        pipe.sadd(keys.HOLDERS_KEY, self.name)

    def renew_lease(self, lease_ms: float) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._lease(pipe, lease_ms)
        pipe.execute()

    # -- take: cancels and late paid requests ----------------------------------------

    def cancels_and_paid(
        self, model: str, ids: list[str], room: int, behind: int = 0, fill: int = 0
    ) -> tuple[dict[str, str], list[tuple[p.Job, str]]]:
        taken = self.take(model, ids, room, behind, fill)
        return taken.reasons, taken.late

    def take(
        self,
        model: str,
        ids: list[str],
        room: int,
        behind: int = 0,
        fill: int = 0,
        launches: bool = False,
        copied: Sequence[str] = (),
    ) -> Taken:
        """One round trip: the cancel reason of each of `ids` that has one, and requests
        still in the queue, with their raw messages: up to `room` paid ones (and `behind`
        free ones in line) that would otherwise ride behind requests already buffered, and
        up to `fill` more of any tier, paid first, for the seats the buffer leaves empty
        (what the consumer has not pulled yet rides this batch, not the next); with
        `launches`, the peers' latest launches too (as `settle` reads them); of `copied`
        (buffered requests that may expire at this take), those another replica runs a
        copy of."""
        if not ids and not room and not behind and not fill and not launches and not copied:
            return Taken({}, [], None, set())
        pipe = self.redis.pipeline(transaction=False)
        if copied:
            pipe.mget([keys.copy_key(i) for i in copied])
        if ids:
            pipe.mget([keys.cancel_key(i) for i in ids])
        if room or behind or fill:
            # The lists by rank, each with its group's cap: a paid request behind other paid
            # keys' ones ranks as paid (tasks/policy/collector.py), so both share the paid seats.
            lists = _fill_lists(model)
            paid, free, free_behind = room + fill, behind + fill, fill
            caps: list[EncodableT] = [room + behind + fill, paid, PAID, paid, PAID, free, FREE, free_behind, "behind"]
            self._take_queued(lists, caps, client=pipe)
        if launches:
            pipe.zrange(keys.launch_key(model), 0, -1, withscores=True)
        results = pipe.execute()
        peer_launches = self._others(results.pop()) if launches else None
        copies = results.pop(0) if copied else []
        running_copies = {i for i, v in zip(copied, copies, strict=True) if v is not None and v.decode() != self.name}
        values = results[0] if ids else []
        reasons = {i: v.decode() for i, v in zip(ids, values, strict=True) if v is not None}
        jobs = _jobs_of([raw for popped in results[1 if ids else 0 :] for raw in popped or []], "queued")
        if jobs:  # rare: late paid requests may have been cancelled while queued
            late = [job.id for job, _raw in jobs]
            # The client does not decode replies: the values are bytes.
            values = cast("list[bytes | None]", self.redis.mget([keys.cancel_key(i) for i in late]))
            reasons.update({i: v.decode() for i, v in zip(late, values, strict=True) if v is not None})
        return Taken(reasons, jobs, peer_launches, running_copies)

    # -- settle: who left the buffer, and the claim -------------------------------------

    def settle(
        self,
        model: str,
        launched: list[tuple[p.Job, str | None]],
        dropped: list[tuple[p.Job, str]],
        claim: tuple[float, int, float] | None,
        scan_from_ms: float | None = None,
        running: Sequence[tuple[str, float]] = (),
        handed_back: Sequence[p.Job] = (),
        to_copies: Sequence[p.Job] = (),
        host: str | None = None,
    ) -> Settled | None:
        """One pipeline: held records of paid requests taken at this launch (those with a
        message), out of the waiting sets for all that leave, Dropped notices, and with
        `claim` (lease ms, claim ttl ms, now) the claim of the launched requests, out of
        the idle list, into the launch list; with `scan_from_ms` too, the batch's requests
        into the model's running set (`running`: member, deadline), what is past its deadline
        out of it, and the running requests whose deadline is no earlier than `scan_from_ms`
        (what a hedge may copy). `handed_back` (earliest deadline first) leaves the held hash
        and goes back to the front of its queue, the earliest to be taken first; it stays
        in the waiting sets. `to_copies` can no longer finish a batch here but has a copy
        running on another replica: it leaves the held hash and the waiting sets with no
        notice, and the copy answers it. With `host` (where buffered requests joined the
        running set) what leaves the buffer unrun leaves the running set too. Returns what
        a claim answered, else None."""
        pipe = self.redis.pipeline(transaction=False)
        if handed_back or to_copies:
            pipe.hdel(keys.held_key(self.name), *[job.id for job in [*handed_back, *to_copies]])
        if handed_back:
            self._push_front(pipe, handed_back)
        unrun = [*handed_back, *to_copies, *(job for job, _reason in dropped)]
        members = [member for job in unrun if (member := self._member(job, host))]
        if members:
            pipe.zrem(keys.running_key(model), *members)
        late: dict[FieldT, EncodableT] = {job.id: self._held_record(job) for job, msg in launched if msg}
        if late:
            pipe.hset(keys.held_key(self.name), mapping=late)
        self._leave_waiting(
            pipe, model, [job for job, _msg in launched] + [job for job, _reason in dropped] + [*to_copies]
        )
        notices = [p.Dropped(id=job.id, reason=reason, replica=self.name) for job, reason in dropped]
        self._reply(pipe, notices, [job for job, _reason in dropped])
        if claim is None:
            pipe.execute()
            return None
        lease_ms, claim_ttl, now = claim
        idle, launches = keys.idle_key(model), keys.launch_key(model)
        self._lease(pipe, lease_ms)
        self._claim(self.name, claim_ttl, [job.id for job, _msg in launched], pipe=pipe)
        pipe.zrem(idle, self.name)
        pipe.zcount(idle, now, "+inf")
        pipe.zadd(launches, {self.name: now})
        pipe.zrange(launches, 0, -1, withscores=True)
        if scan_from_ms is not None:
            running_key = keys.running_key(model)
            pipe.zremrangebyscore(running_key, "-inf", int(now))
            if running:
                pipe.zadd(running_key, {member: int(deadline) for member, deadline in running})
            pipe.zrangebyscore(running_key, int(scan_from_ms), "+inf", 0, HEDGE_SCAN, withscores=True)
        replies = pipe.execute()
        found: list[tuple[bytes, float]] = []
        if scan_from_ms is not None:
            found = replies.pop()
            del replies[-(2 if running else 1) :]  # the trim and the adds
        *_, claimed, _, peers_idle, _, peer_launches = replies
        return Settled(scripts.Claim.answer(claimed), peers_idle > 0, self._others(peer_launches), found)

    def hedge(self, model: str, chosen: list[str], least_idle: int = 0) -> list[tuple[p.Job, str]]:
        """Take copies of the `chosen` members of the model's running set that still run
        where they were claimed, or (for a batch's empty slots, `least_idle` 0) wait buffered
        there unclaimed: their jobs and messages. `least_idle` > 0: for a batch of copies on
        this idle replica, taken only while that many of the model's replicas are idle, and
        this one then leaves the idle list."""
        return _jobs_of(self._hedge(model, self.name, chosen, least_idle) or [], "running")

    def copy_work(self, model: str, now_ms: float, scan_from_ms: float) -> CopyWork:
        """For an idle replica's batch of copies: how many replicas of the model are idle
        and how many have launched a batch, and the members of its running set (member,
        deadline) that a batch starting now could still answer in time (`scan_from_ms`),
        earliest deadline first."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zcount(keys.idle_key(model), now_ms, "+inf")
        pipe.zcard(keys.launch_key(model))
        pipe.zrangebyscore(keys.running_key(model), int(scan_from_ms), "+inf", 0, HEDGE_SCAN, withscores=True)
        idle, launched, running = pipe.execute()
        return CopyWork(int(idle), int(launched), running)

    def _leave_waiting(self, pipe: redis.client.Pipeline, model: str, leaving: list[p.Job]) -> None:
        """Out of the waiting sets admission counts: the tier's (in line or behind other
        tenants', whichever list it came from) and its tenant's share."""
        by_set: dict[str, list[str]] = defaultdict(list)
        for job in leaving:
            for behind in (False, True):
                by_set[keys.waiting_key(model, job.tier, behind)].append(job.id)
            by_set[keys.tenant_waiting_key(model, job.tier, p.tenant_of(job.key))].append(job.id)
        for key, ids in by_set.items():
            pipe.zrem(key, *ids)

    # -- deliver: answers, the idle list ----------------------------------------------

    def deliver(
        self,
        model: str,
        items: Sequence[Reply],
        jobs: list[p.Job],
        end_ms: float,
        lease_ms: float,
        idle_until_ms: float | None = None,
        copies: Sequence[bool] = (),
        running: Sequence[str] = (),
    ) -> Answered:
        """One pipeline: the answers, the model's traffic, the lease; with `idle_until_ms`
        (a batch's end) the idle list and the peers' launches too. `copies` flags the
        items that answer a second copy (a hedge): those go in a delivery of their own,
        which counts the ones that came first. `running`: this replica's members of the
        model's running set that leave it."""
        pipe = self.redis.pipeline(transaction=False)
        own, copied = self._reply_apart(pipe, items, jobs, copies)
        if running:
            pipe.zrem(keys.running_key(model), *running)
        flags = copies or [False] * len(jobs)
        done = ((job.tier, end_ms - job.received_ms) for job, copy in zip(jobs, flags, strict=True) if not copy)
        traffic.record_done(pipe, model, done, end_ms)
        if idle_until_ms is not None:
            self._idle(pipe, model, idle_until_ms)
        self._lease(pipe, lease_ms)
        if idle_until_ms is not None:
            pipe.zrange(keys.launch_key(model), 0, -1, withscores=True)
        replies = pipe.execute()
        wasted = scripts.Deliver.answer(replies[0]).wasted if own else 0  # results nobody waited for
        won = scripts.Deliver.answer(replies[1 if own else 0]).delivered if copied else 0
        launches = self._others(replies[-1]) if idle_until_ms is not None else None
        return Answered(wasted, launches, won, copied - won)

    def reply(
        self,
        items: Iterable[Reply],
        jobs: list[p.Job],
        idle: tuple[str, float] | None = None,
        copies: Sequence[bool] = (),
    ) -> None:
        """Send `items` (with `idle`, (model, until ms): and join the idle list; `copies`
        flags the items of second copies, sent apart: `deliver`)."""
        pipe = self.redis.pipeline(transaction=False)
        self._reply_apart(pipe, list(items), jobs, copies)
        if idle is not None:
            self._idle(pipe, *idle)
        pipe.execute()

    def _reply_apart(
        self, pipe: redis.client.Pipeline, items: Sequence[Reply], jobs: list[p.Job], copies: Sequence[bool]
    ) -> tuple[int, int]:
        """Queue the delivery of a batch's own items, then of its copies' (flagged in
        `copies`, empty: none) in a delivery of their own; returns how many of each."""
        flags = copies or [False] * len(jobs)
        own = [(item, job) for item, job, copy in zip(items, jobs, flags, strict=True) if not copy]
        copied = [(item, job) for item, job, copy in zip(items, jobs, flags, strict=True) if copy]
        for group, are_copies in ((own, False), (copied, True)):
            if group:
                self._reply(pipe, [item for item, _ in group], [job for _, job in group], copies=are_copies)
        return len(own), len(copied)

    def _reply(
        self, pipe: redis.client.Pipeline, items: Sequence[Reply], jobs: list[p.Job], copies: bool = False
    ) -> None:
        """Queue the delivery of `items` onto `pipe`: each goes to the gateway that owns
        its request now, once (control/broker/scripts.py's `Deliver`; `copies`: hedges)."""
        if not jobs:
            return
        deliveries = [
            scripts.Delivery(job.key, job.id, job.keep_ms, item.kind, item.model_dump_json(), _fallback(item, job))
            for item, job in zip(items, jobs, strict=True)
        ]
        self._deliver(self.name, deliveries, pipe=pipe, copies=copies)

    def _others(self, launches: list[tuple[bytes, float]]) -> list[float]:
        """When the other replicas of the model last started a batch."""
        me = self.name.encode()
        return [float(t) for name, t in launches if name != me]

    def mark_idle(self, model: str, until_ms: float) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._idle(pipe, model, until_ms)
        pipe.execute()

    def _idle(self, pipe: redis.client.Pipeline, model: str, until_ms: float, refresh_only: bool = False) -> None:
        """Tell peers this replica is idle; a heartbeat only refreshes an entry (XX), so
        one racing a batch start cannot put back what `settle` took out."""
        pipe.zadd(keys.idle_key(model), {self.name: until_ms}, xx=refresh_only)

    def leave_idle(self, model: str) -> None:
        """Out of the idle and launch lists: peers must not count on this replica."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(keys.idle_key(model), self.name)
        pipe.zrem(keys.launch_key(model), self.name)
        pipe.execute()

    # -- streaming ------------------------------------------------------------------------

    def stream(self, chunks: list[tuple[p.Job, p.Chunk]]) -> None:
        """One script call sends every chunk of a step to the gateways that own them."""
        self._stream([scripts.StreamChunk(job.key, job.id, chunk.model_dump_json()) for job, chunk in chunks])

    # -- registry, moves ---------------------------------------------------------------

    def publish(self, fields: Fields, ttl_s: float, idle: tuple[str, float, bool] | None = None) -> None:
        """The registry entry (with `idle`, (model, until ms, refresh only): the idle list).
        The entry's model's waiting sets lose their entries past deadline (`seen_ms`, the
        broker's now): admission counts past them without taking them out."""
        key = keys.replica_key(self.name)
        pipe = self.redis.pipeline(transaction=False)
        model, now_ms = str(fields["model"]), fields["seen_ms"]
        for tier in (PAID, FREE):
            for behind in (False, True):
                pipe.zremrangebyscore(keys.waiting_key(model, tier, behind), "-inf", now_ms)
        # redis-py types the mapping's keys invariantly as FieldT, which refuses a dict[str, ...].
        pipe.hset(key, mapping=cast("dict[FieldT, EncodableT]", fields))
        pipe.pexpire(key, int(ttl_s * 1000))
        pipe.sadd(keys.REPLICAS_KEY, self.name)
        if idle is not None:
            self._idle(pipe, idle[0], idle[1], refresh_only=idle[2])
        pipe.execute()

    def record_move(self, old: str, new: str) -> None:
        """Out of the old model's idle list; the new model kept across a restart (control/cli/main.py)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(keys.idle_key(old), self.name)
        pipe.set(keys.assignment_key(self.name), new)
        pipe.execute()


def _jobs_of(raws: Iterable[bytes], what: str) -> list[tuple[p.Job, str]]:
    """The jobs of queue messages taken by a script, with the messages; a malformed one
    is logged and dropped."""
    jobs = []
    for raw in raws:
        try:
            jobs.append((job_from_message(raw), raw.decode()))
        except (ValueError, KeyError, TypeError, IndexError):
            log.warning("dropping a malformed message of a %s request", what)
    return jobs


def _fallback(item: Reply, job: p.Job) -> str:
    """Only a drop notice goes to the admitting gateway when its request has no owner."""
    return job.gateway if item.kind == "dropped" else ""


# Answers a replica could not hand to its own cell's broker, sent through another cell.
#
# Every gateway process reads a reply list in each cell's broker (api/gateway.py), so an
# answer pushed onto its list in any cell reaches it. A replica whose broker died or stalled
# while a batch ran sends the batch's answers that way. The gateway has meanwhile sent those
# requests to another cell as well: whichever answer comes first is the one its client gets,
# and the other is dropped.
class FallbackReplies:
    """The other cells' brokers, tried in turn."""

    def __init__(self, clients: list[redis.Redis]) -> None:
        self.clients = clients

    def send(self, items: Sequence[Reply], jobs: list[p.Job]) -> bool:
        """Push each answer to the gateway that admitted its request, through the first
        other cell that takes them all. True if one did."""
        by_gateway: dict[str, list[Reply]] = {}
        for item, job in zip(items, jobs, strict=True):
            by_gateway.setdefault(job.gateway, []).append(item)
        for client in self.clients:
            pipe = client.pipeline(transaction=False)
            for gateway, answers in by_gateway.items():
                key = keys.reply_key(gateway)
                pipe.rpush(key, p.Reply(items=list(answers)).model_dump_json())
                pipe.expire(key, p.REPLY_TTL_S)
            try:
                pipe.execute()
                return True
            except redis.RedisError as exc:
                log.warning("another cell did not take the answers either: %s", exc)
        return False
