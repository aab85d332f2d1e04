"""What crosses processes: the job payload and the reply messages (the Redis key names
are made in control/broker/keys.py, the broker's records in control/broker/records.py).

The gateway writes a job into a Celery message; a replica answers the gateway
process that holds the connection by pushing one reply message per batch onto
that gateway's reply list (see docs/design.md, "How results come back").
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from control.core.vocab import FREE, PAID, DropReason, Tier

# Every key the request path uses carries one hash tag, so on a Valkey/Redis cluster they
# all hash to one slot and each Lua script (which reaches keys named inside it, not only
# KEYS[]) runs on one shard without a cross-slot error. Spreading the region over shards
# is by cells, each a tag of its own: docs/decisions/0015-broker-sharding.md.
HASH_TAG = "{kb}"
PREFIX = HASH_TAG
TASK_NAME = "keybatch.complete"
PAID_PRIORITY = 0  # kombu's Redis transport serves lower numbers first
FREE_PRIORITY = 6
# A tier's requests beyond their key's fair depth wait in a list of their own, served
# after the tier's others (and paid ones still before any free one): control/policy/admission.py.
BEHIND_STEP = 3
PRIORITY_STEPS = [PAID_PRIORITY, PAID_PRIORITY + BEHIND_STEP, FREE_PRIORITY, FREE_PRIORITY + BEHIND_STEP]
PRIORITY_SEP = ":"  # kombu's `sep` transport option: "<queue><sep><priority>"
# A replica's pull (kombu's BRPOP) waits this long on the broker before it is sent again
# (`kombu_internals.bound_pulls`).
# A replica that stops without a word (its host gone) leaves its last pull out, and the
# broker hands that pull the next arrival, which no one will run: this bounds how long.
# The broker ends a wait at its next tick (every 100 ms at the default hz 10), so a pull
# may stay out up to one tick longer. docs/decisions/0008-failover.md.
PULL_WAIT_S = 0.1
REPLY_TTL_S = 60
CANCEL_TTL_MS = 120_000


def queue_name(model: str) -> str:
    """The model's Celery queue, which is also the Redis list kombu keeps it in (tagged)."""
    return f"{PREFIX}.{model}"


def priority_of(tier: Tier) -> int:
    return PAID_PRIORITY if tier == PAID else FREE_PRIORITY


def is_behind(priority: object) -> bool:
    """Does a message of this kombu priority wait behind other tenants' requests?"""
    return priority in (PAID_PRIORITY + BEHIND_STEP, FREE_PRIORITY + BEHIND_STEP)


def tenant_of(key: str) -> str:
    """The tenant a request's key is scoped to ("<tenant>:<id>")."""
    return key.partition(":")[0]


class Job(BaseModel):
    """The payload of one Celery task: one completion request.

    `id` names this attempt (unique, unguessable, made by the gateway that admitted it);
    `key` is the request as its caller names it, scoped to the caller's tenant: a retry
    with the same key joins the attempt in flight, and its answer is kept `keep_ms`.
    """

    id: str
    key: str
    keep_ms: int = 0
    model: str
    prompt: str
    suffix: str | None = None
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = Field(default_factory=list)
    tier: Tier = FREE
    gateway: str
    received_ms: float  # when the gateway admitted it, epoch ms on the broker's clock
    deadline_ms: float  # after which nobody waits for it, on the broker's clock
    stream: bool = False
    # Queued behind other tenants' requests of its tier (its tenant held its fair depth):
    # told by the list it came from (its message's priority), not sent in the job itself.
    behind: bool = False
    # Sent on by a peer region (api/peers.py); `stranded`: admitted there, and forwarded
    # when that region lost its broker or replicas, with the rest of what waited: a burst.
    forwarded: bool = False
    stranded: bool = False


class Result(BaseModel):
    """One finished request, as a replica reports it to the gateway."""

    kind: Literal["result"] = "result"
    id: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    replica: str
    backend: str
    batch_size: int
    batch_start_ms: float
    batch_end_ms: float
    hedged: bool = False  # answered by a second copy (a hedge), not the request's own run
    reused: bool = False  # the rest of the session's last completion, typed through (no model run)


class Dropped(BaseModel):
    """A request a replica dropped before its batch ran."""

    kind: Literal["dropped"] = "dropped"
    id: str
    reason: DropReason
    replica: str


class Cancelled(BaseModel):
    """A cancel or supersede, routed to the gateway that holds the request."""

    kind: Literal["cancelled"] = "cancelled"
    id: str
    reason: DropReason


class Failed(BaseModel):
    """The engine raised for this request (`per_request`: on this request alone, which
    would fail again) or for its whole batch. `code` and `status` name a request the
    engine refused before it ran (a prompt too long for the model's context: 413)."""

    kind: Literal["failed"] = "failed"
    id: str
    message: str
    replica: str
    per_request: bool = False
    code: str | None = None
    status: int | None = None


class Chunk(BaseModel):
    """Streamed text of a request still running: `text` continues the completion at
    character `offset` (a re-run after failover repeats what was sent; the gateway
    sends only what is new)."""

    kind: Literal["chunk"] = "chunk"
    id: str
    offset: int
    text: str


class Reply(BaseModel):
    """One message on a gateway's reply list: everything one batch owes that gateway."""

    items: list[Annotated[Result | Dropped | Cancelled | Failed | Chunk, Field(discriminator="kind")]]
