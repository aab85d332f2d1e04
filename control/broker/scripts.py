"""Every script of control/broker/lua.py behind a small typed wrapper.

Each wrapper registers its script on a client, packs its arguments from named
parameters and unpacks the answer: no other module reads ARGV or builds an ARGV list.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, NamedTuple

import redis
from redis.typing import EncodableT

from control.broker import keys
from control.broker.lua import (
    ADMIT_LUA,
    CANCEL_LUA,
    CLAIM_LUA,
    DELIVER_LUA,
    HEDGE_LUA,
    RECORD_LUA,
    RESCUE_LUA,
    STREAM_LUA,
    SUPERSEDE_LUA,
    SWEEP_DEAD_LUA,
    SWEEP_ONE_LUA,
)

# -- the wrappers ---------------------------------------------------------------------


class DirectScript:
    """A Lua script called straight on a pooled connection.

    redis-py's command layer (argument filtering, retry wrapper, response
    callbacks, redis-py 8's operation timing) is a visible share of the
    gateway's CPU per request at the admission call alone (docs/decisions/0006);
    this packs, sends and reads on a connection from the same pool. The pool checks a
    connection before lending it (a server that closed it is noticed there); one
    that still fails at the send is dropped and the call sent once more on a
    fresh one. A failure after the send is not retried
    (the script may have run: admitting twice would refuse the request as a
    duplicate). A script the server forgot is loaded again.
    """

    def __init__(self, client: redis.Redis, source: str) -> None:
        self.script = client.register_script(source)
        self.pool = client.connection_pool

    def __call__(self, keys: Sequence[EncodableT], args: Sequence[EncodableT]) -> Any:
        try:
            return self._call(keys, args)
        except redis.exceptions.NoScriptError:
            self.script.sha = self.script.registered_client.script_load(self.script.script)
            return self._call(keys, args)

    def _call(self, keys: Sequence[EncodableT], args: Sequence[EncodableT]) -> Any:
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


class _Registered:
    """A script registered on a client through redis-py's command layer."""

    SOURCE: ClassVar[str]

    def __init__(self, client: redis.Redis) -> None:
        self._script = client.register_script(self.SOURCE)

    def _run(self, keys: Sequence[str], args: Sequence[EncodableT], pipe: redis.client.Pipeline | None = None) -> Any:
        return self._script(keys=keys, args=args, client=pipe)


class Admission(enum.IntEnum):
    """What the admission script answered."""

    ADMITTED = 1  # queued (extra: b"1" when behind other tenants' requests of its tier)
    ANSWERED = 2  # answered within the idempotency window (extra: the stored Result JSON)
    JOINED = 3  # a retry joined the attempt in flight (extra: that attempt's id)
    BODY_MISMATCH = 4  # the id is in flight or answered with another body
    TOO_DEEP = -1  # its queue position is past what its deadline allows
    TENANT_RATE_LIMITED = -2  # the tenant's token bucket is empty (extra: ms until a token)
    TENANT_QUEUE_FULL = -3  # the tenant holds its share of the queue


_ADMISSION = {status.value: status for status in Admission}


class AdmitAnswer(NamedTuple):
    status: Admission
    paid: int  # requests waiting in line, paid and free, and behind other tenants' ones
    # (-1: a list not counted, as it is not ahead of this request: the free ones for a paid
    # request, a tier's list behind for one in line)
    free: int
    paid_behind: int
    free_behind: int
    extra: bytes  # see `Admission`


class TenantTerms(NamedTuple):
    """A request counted against its tenant (control/policy/admission.py), in the order the
    admission script reads them. The tier's sets behind, the tenant's share of its tier
    (`keys.tenant_waiting_key`) and its bucket (`keys.bucket_key`) the script names itself
    from the request's key and tier."""

    queue_behind: str
    deepest_behind: int  # the deepest position a request behind may take
    fair_depth: int
    max_queued: int
    rate_per_s: float
    bucket_size: float
    stale_checks: int  # how many of the tenant's oldest entries to check are still waiting


class BumpTerms(NamedTuple):
    """ADMIT_BUMP: what the admission script needs to tell how many positions a waiting
    request's deadline still allows (`admission.max_depth` of what is left of it)."""

    interval_ms: float  # between batch starts, at the worst phase
    max_batch: int
    reach_ms: float  # a request starts by its deadline less this (the margin and a slot)


_NO_TENANT: tuple[EncodableT, ...] = ("",) * len(TenantTerms._fields)


class Admit:
    """Admit a request and enqueue its task message, or join the attempt in flight under
    its key, or find its stored answer: one round trip, on the gateway's hot path."""

    def __init__(self, client: redis.Redis) -> None:
        self._script = DirectScript(client, ADMIT_LUA)

    def __call__(
        self,
        *,
        owner_key: str,
        waiting_paid: str,
        waiting_free: str,
        queue: str,
        session: str | None,
        fingerprint: str,  # of the body, for retries ('' when the answer is not kept)
        ttl_ms: int,
        deadline_ms: float,
        attempt: str,
        tier: str,
        deepest: int,
        now_ms: float,
        message: str,
        keeps_answer: bool,  # its answer is kept for retries (under its owner key)
        gateway: str,
        tenant: TenantTerms | None,
        bump: BumpTerms | None = None,
    ) -> AdmitAnswer:
        """`owner_key` is `keys.owner_key` of the request's key: the script reads the key
        (and its tenant) from it."""
        names = [owner_key, waiting_paid, waiting_free, queue, session] if session else [
            owner_key, waiting_paid, waiting_free, queue
        ]  # fmt: skip
        args: list[EncodableT] = [
            fingerprint, ttl_ms, deadline_ms, attempt, tier, deepest, now_ms, message, "1" if keeps_answer else "",
            gateway,
        ]  # fmt: skip
        if tenant is not None:
            args += tenant
        if bump is not None:
            if tenant is None:
                args += _NO_TENANT
            args += bump
        reply = self._script(names, args)
        if len(reply) == 6:
            return AdmitAnswer(_ADMISSION[reply[0]], reply[1], reply[2], reply[3], reply[4], reply[5])
        return AdmitAnswer(_ADMISSION[reply[0]], reply[1], reply[2], 0, 0, reply[3])


class Cancel(_Registered):
    """Cancel the request with this key and tell the gateways that wait for it; '' for
    tenant, attempt or holder means any (see `cancel` in `LUA_LIB`). True if cancelled."""

    SOURCE = CANCEL_LUA

    def __call__(self, key: str, reason: str, tenant: str = "", attempt: str = "", holder: str = "") -> bool:
        return bool(self._run([keys.owner_key(key)], [key, reason, tenant, attempt, holder]))


class SweepReport(NamedTuple):
    swept: int  # replicas whose lapsed lease was swept now
    requeued: int
    expired: int
    deaths: int  # replicas ever swept, deployment-wide
    epoch: str = ""  # the keyspace's: another one means the broker lost what it held ("": unknown)


class SweepDead(_Registered):
    """Sweep every replica whose lease lapsed."""

    SOURCE = SWEEP_DEAD_LUA

    def __call__(self, min_ms: float, lock_ms: float = 0.0) -> SweepReport:
        """With `lock_ms`, a call within that long of another's sweeps nothing (and
        reports 0 swept); the one that sweeps leaves the registry in `keys.FLEET_KEY`."""
        swept, requeued, expired, deaths, epoch = self._run([keys.HOLDERS_KEY], [min_ms, int(lock_ms)])
        epoch = epoch.decode() if isinstance(epoch, bytes) else str(epoch)
        return SweepReport(int(swept), int(requeued), int(expired), int(deaths), epoch)


class Swept(NamedTuple):
    requeued: int
    expired: int


class SweepOne(_Registered):
    """Sweep one replica; None while its lease is alive."""

    SOURCE = SWEEP_ONE_LUA

    def __call__(self, replica: str, min_ms: float) -> Swept | None:
        requeued, expired = self._run([keys.held_key(replica)], [replica, min_ms])
        return None if int(requeued) < 0 else Swept(int(requeued), int(expired))


class RescueOffer(NamedTuple):
    """A request a gateway waits for, offered to RESCUE."""

    attempt: str
    key: str
    queue: str
    waiting: str
    deadline_ms: float
    received_ms: float  # (the message pushed again is the one its owner record keeps)


class Rescue(_Registered):
    """Push back the offered requests that a dead replica popped and never recorded."""

    SOURCE = RESCUE_LUA

    def __call__(self, min_ms: float, offers: Iterable[RescueOffer]) -> int:
        return int(self._run([keys.HOLDERS_KEY], _rescue_args(min_ms, 1, offers)))

    def look(self, min_ms: float, offers: Iterable[RescueOffer]) -> set[str]:
        """The attempts among `offers` that would be pushed back now; none is pushed."""
        seen = self._run([keys.HOLDERS_KEY], _rescue_args(min_ms, 0, offers))
        return {a.decode() if isinstance(a, bytes) else str(a) for a in seen}


def _rescue_args(min_ms: float, push: int, offers: Iterable[RescueOffer]) -> list[EncodableT]:
    args: list[EncodableT] = [min_ms, push]
    for offer in offers:
        args += offer
    return args


class HeldEntry(NamedTuple):
    attempt: str
    record: str  # control/broker/records.py's `pack_held`: it names the request's key
    member: str = ""  # its entry in the model's running set (`pack_running`), if copies may be made of it


class Record(_Registered):
    """Write the held records of requests still in flight under their attempt, and their
    members of `model`'s running set."""

    SOURCE = RECORD_LUA

    def __call__(self, replica: str, entries: Iterable[HeldEntry], model: str = "") -> int:
        args: list[EncodableT] = [replica, model]
        for entry in entries:
            args += entry
        return int(self._run([keys.held_key(replica)], args))


class Claim(_Registered):
    """Claim attempts for a replica's batch; with `pipe` the call is queued on it (its
    answer, for `answer`, comes with the pipeline's)."""

    SOURCE = CLAIM_LUA

    def __call__(
        self, replica: str, ttl_ms: int, attempts: Iterable[str], pipe: redis.client.Pipeline | None = None
    ) -> list[bool] | None:
        raw = self._run([keys.HOLDERS_KEY], [replica, ttl_ms, *attempts], pipe)
        return None if pipe is not None else self.answer(raw)

    @staticmethod
    def answer(raw: Iterable[int]) -> list[bool]:
        """Per attempt, in order: claimed."""
        return [bool(flag) for flag in raw]


class Hedge(_Registered):
    """Take second copies of the `chosen` members of the model's running set for a batch's
    empty slots (control/broker/lua.py's `HEDGE_LUA`): their queue messages."""

    SOURCE = HEDGE_LUA

    def __call__(self, model: str, replica: str, chosen: Sequence[str], least_idle: int = 0) -> list[bytes]:
        """`least_idle` > 0: copies for an idle replica's batch of its own (claimed requests
        only, while that many of the model's replicas are idle; it then leaves the idle list)."""
        run_keys = [keys.running_key(model), keys.idle_key(model)]
        return list(self._run(run_keys, [model, replica, least_idle, *chosen]))


class Supersede(_Registered):
    """A request answered without admission takes its session's place; returns whether
    it superseded a request in flight."""

    SOURCE = SUPERSEDE_LUA

    def __call__(self, session_key: str, request_key: str, ttl_ms: int) -> bool:
        return bool(self._run([session_key], [request_key, ttl_ms]))


class Delivery(NamedTuple):
    """One item a replica owes a request's gateways."""

    key: str
    attempt: str
    keep_ms: int  # how long a result is kept for retries (0: not kept)
    kind: str  # the item's `kind`
    item: str  # its JSON
    fallback_gateway: str  # the gateway that admitted it, for a drop notice with no owner ('' for other kinds)


class Delivered(NamedTuple):
    delivered: int
    wasted: int


class Deliver(_Registered):
    """Answer each request once, to the gateways that wait for it now; with `pipe` the
    call is queued on it (its answer, for `answer`, comes with the pipeline's)."""

    SOURCE = DELIVER_LUA

    def __call__(
        self,
        replica: str,
        items: Iterable[Delivery],
        pipe: redis.client.Pipeline | None = None,
        copies: bool = False,
    ) -> Delivered | None:
        """`copies`: the items are second copies (hedges): a wasted one is counted apart."""
        args: list[EncodableT] = [replica]
        for item in items:
            args += item
        names = [keys.held_key(replica)] + ([keys.HEDGE_WASTED_KEY] if copies else [])
        raw = self._run(names, args, pipe)
        return None if pipe is not None else self.answer(raw)

    @staticmethod
    def answer(raw: Sequence[int]) -> Delivered:
        return Delivered(int(raw[0]), int(raw[1]))


class StreamChunk(NamedTuple):
    key: str
    attempt: str
    chunk: str  # the Chunk's JSON


class Stream(_Registered):
    """Send streamed text to the gateways of requests still owned by the attempt that
    produced it; how many gateways were sent to."""

    SOURCE = STREAM_LUA

    def __call__(self, chunks: Iterable[StreamChunk]) -> int:
        args: list[EncodableT] = []
        for chunk in chunks:
            args += chunk
        return int(self._run([keys.HOLDERS_KEY], args))
