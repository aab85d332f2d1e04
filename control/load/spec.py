"""What a load run is (`LoadSpec`, `TenantLoad`), one request of its schedule (`Arrival`), and what
it records of each request (`Record`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from control.core.vocab import ARRIVALS, ArrivalProfile


@dataclass
class Record:
    sent_s: float  # seconds since the run started
    tier: str
    status: int  # 0: no answer (client error)
    latency_ms: float
    queue_ms: float = 0.0
    batch_ms: float = 0.0
    batch_size: int = 0
    server_ms: float = 0.0  # the gateway's own total (received -> answer ready)
    error: str = ""
    id: str = ""  # the X-Request-Id sent (LoadSpec.id_prefix), else ""
    answer_id: str = ""  # the id of the completion that came back (200 only)
    answered_s: float = 0.0  # seconds since the run started: answer parsed, error or hang-up
    hung_up: bool = False  # the client closed its connection on purpose (LoadSpec.hangup_share)
    ttft_ms: float = 0.0  # streams: time to the first event with text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    session: str = ""  # the X-Session-Id sent (typing), else ""
    code: str = ""  # the error's code of an answer other than 200 (409: "superseded", "cancelled"...)
    cell: int = -1  # the cell that carried a 200 (-1: not said)

    @property
    def is_superseded(self) -> bool:
        """A newer request of its typing session took its place: expected, not an error."""
        return self.status == 409 and self.code == "superseded"

    @property
    def outcome(self) -> str:
        """The status as a report counts it: "200", "409 superseded", "429", "no answer"..."""
        if self.status == 0:
            return "no answer"
        return f"{self.status} {self.code}" if self.status == 409 and self.code else str(self.status)

    @property
    def overhead_ms(self) -> float:
        """End to end minus time inside the batch (includes waiting for a free replica)."""
        return self.latency_ms - self.batch_ms

    @property
    def gateway_ms(self) -> float:
        """The part of the system overhead spent inside the gateway process."""
        return self.server_ms - self.queue_ms - self.batch_ms

    @property
    def system_ms(self) -> float:
        """End to end minus queueing and the batch: HTTP, admission, enqueue, routing back."""
        return self.latency_ms - self.queue_ms - self.batch_ms


@dataclass
class LoadSpec:
    url: str
    rps: float
    duration_s: float
    model: str = "kb-small"
    paid_share: float = 0.0
    paid_key: str | None = None
    free_key: str | None = None
    max_tokens: int = 16
    seed: int = 1
    deadline_ms: float | None = None
    id_prefix: str | None = None  # send X-Request-Id "<prefix>-<i>" and record it
    timeout_s: float | None = None  # client gives up (default: the deadline + 30 s)
    start_at: float | None = None  # time.perf_counter() of second 0, to line other events up with sent_s
    # A share of the requests sent from `hangup_from_s` on close their connection
    # `hangup_ms` after sending (a user typing on); drawn apart from the arrivals.
    hangup_share: float = 0.0
    hangup_from_s: float = 0.0
    hangup_ms: float = 100.0
    spike_rps: float = 0.0  # the arrival rate from spike_from_s to spike_to_s (0: no spike)
    spike_from_s: float = 0.0
    spike_to_s: float = 0.0
    retries: int = 0  # resend after a broken connection, same X-Request-Id, within the budget (as an IDE does)
    bodies: list[dict] | None = None  # request bodies to send in turn (prompt, max_tokens, ...); default: short ones
    stream: bool = False  # ask for server-sent events and record the time to the first token
    arrivals: ArrivalProfile = "poisson"
    # Model mix {name: share}; None: `model` alone. It moves linearly to `shift_to` from
    # `shift_from_s` to `shift_from_s + shift_over_s`.
    models: dict[str, float] | None = None
    shift_to: dict[str, float] | None = None
    shift_from_s: float = 0.0
    shift_over_s: float = 0.0
    keystrokes: float = 6.0  # typing: requests per session on average
    pause_ms: float = 350.0  # typing: a pause is 100 ms + exponential of this mean
    api_key: str | None = None  # one key for every request (tier "key"); paid_share, paid_key, free_key unused

    def __post_init__(self) -> None:
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, not {self.arrivals!r}")
        if not (self.rps > 0 and self.duration_s > 0):
            raise ValueError("the rate and the duration must be above 0")
        if not 0.0 <= self.paid_share <= 1.0:
            raise ValueError(f"the paid share must be within 0..1, not {self.paid_share}")
        if self.shift_to is not None and self.models is None:
            raise ValueError("a shift needs a mix to start from (models)")
        if self.shift_from_s < 0 or self.shift_over_s < 0:
            raise ValueError("the shift's start and length must be 0 or more")
        if self.keystrokes < 1 or self.pause_ms < 0:
            raise ValueError("keystrokes must be at least 1 and the pause 0 or more")


@dataclass(frozen=True)
class Arrival:
    """One request of the schedule."""

    at_s: float  # seconds after the start
    tier: str  # "paid", "free", or "key" (LoadSpec.api_key)
    model: str
    session: int = -1  # typing: the session it belongs to (its X-Session-Id), else -1


def parse_mix(text: str) -> dict[str, float]:
    """ "kb-small=0.8,kb-large=0.2" -> {"kb-small": 0.8, "kb-large": 0.2}, shares summing to 1."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, sep, share = part.strip().partition("=")
        try:
            value = float(share) if sep else math.nan
        except ValueError:
            value = math.nan
        if not name or not value >= 0 or math.isinf(value) or name in mix:
            raise ValueError(f"a mix is MODEL=SHARE,MODEL=SHARE with shares of 0 or more, each model once: {text!r}")
        mix[name] = value
    total = sum(mix.values())
    if total <= 0:
        raise ValueError(f"a mix needs a share above 0: {text!r}")
    return {name: value / total for name, value in mix.items()}


@dataclass(frozen=True)
class TenantLoad:
    """One key's own open-loop load within a run (its records' `tier` is its name)."""

    name: str
    key: str | None  # None: no Authorization header (anonymous)
    rps: float
    deadline_ms: float | None = None
    prompt_chars: int = 0  # 0: the short default prompts
    from_s: float = 0.0  # starts this long into the run
    for_s: float | None = None  # and lasts this long (default: to the end)

    def __post_init__(self) -> None:
        if not self.name or self.rps <= 0 or self.prompt_chars < 0 or self.from_s < 0:
            raise ValueError(f"tenant {self.name!r}: a name, a rate above 0, sizes and times of 0 or more")
        if self.for_s is not None and self.for_s <= 0:
            raise ValueError(f"tenant {self.name!r}: for-s must be above 0")


_TENANT_FIELDS = {"name", "key", "rps", "deadline-ms", "prompt-chars", "from-s", "for-s"}


def parse_tenant(text: str) -> TenantLoad:
    """ "name=flood,key=K,rps=96,deadline-ms=30000,prompt-chars=32000" -> TenantLoad (key=-: none)."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in _TENANT_FIELDS or name in fields:
            raise ValueError(
                f"a tenant is name=N,key=K,rps=R[,deadline-ms=D][,prompt-chars=C][,from-s=S][,for-s=S]: {text!r}"
            )
        fields[name] = value
    if not {"name", "key", "rps"} <= fields.keys():
        raise ValueError(f"a tenant needs name, key and rps: {text!r}")
    try:
        return TenantLoad(
            fields["name"],
            None if fields["key"] == "-" else fields["key"],
            float(fields["rps"]),
            float(fields["deadline-ms"]) if "deadline-ms" in fields else None,
            int(fields.get("prompt-chars", "0")),
            float(fields.get("from-s", "0")),
            float(fields["for-s"]) if "for-s" in fields else None,
        )
    except ValueError as exc:
        raise ValueError(f"tenant {text!r}: {exc}") from None
