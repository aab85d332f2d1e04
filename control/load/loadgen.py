"""Open-loop load against a gateway (keybatch or any OpenAI-compatible completions
server), whatever its answers take.

Open loop means a slow server does not slow the arrivals down, so queueing shows
as it would with real users. Every request is counted once: a status code, or a
client-side error if no answer came.

Arrivals (`LoadSpec.arrivals`) have the simulator's shapes (`control.load.arrivals.rate_profile`):
`poisson` (flat), `bursts` (3x for 2 s of every 20 s), `diurnal` (one day compressed into
the run), drawn as a non-homogeneous Poisson process by thinning; `typing`: users in
typing sessions (`control.load.arrivals.typing_sessions`, the simulator's process), each
request sent with its session's `X-Session-Id` so that it supersedes the one before.
The whole schedule is drawn before the run from the seed (`schedule`). Requests go to a
mix of models that can move from one mix to another during the run (`mix_at`). Several
tenants (`TenantLoad`: a key each, its own rate, budget, prompt size and time window) run
side by side with `generate_tenants`; the report then has a row per tenant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import secrets
import sys
import textwrap
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import orjson
import uvloop
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from control.core.memory import collector_paused
from control.core.vocab import ARRIVALS, FREE, PAID, ArrivalProfile
from control.load.arrivals import rate_profile, typing_sessions
from control.load.httpclient import Answer, Client


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


def mix_at(spec: LoadSpec, at_s: float) -> dict[str, float]:
    """Each model's share of the requests sent at `at_s`."""
    start = spec.models or {spec.model: 1.0}
    if spec.shift_to is None:
        return start
    if spec.shift_over_s > 0:
        moved = min(1.0, max(0.0, (at_s - spec.shift_from_s) / spec.shift_over_s))
    else:
        moved = 1.0 if at_s >= spec.shift_from_s else 0.0
    names = list(start) + [m for m in spec.shift_to if m not in start]
    return {m: (1 - moved) * start.get(m, 0.0) + moved * spec.shift_to.get(m, 0.0) for m in names}


def _pick(mix: dict[str, float], rng: random.Random) -> str:
    names = list(mix)
    return names[0] if len(names) == 1 else rng.choices(names, weights=list(mix.values()))[0]


def rate_fn(spec: LoadSpec) -> Callable[[float], float]:
    """The offered rate (req/s) at a second of the run: the simulator's profile, and the spike."""
    profile = rate_profile("poisson" if spec.arrivals == "typing" else spec.arrivals, spec.rps, spec.duration_s)

    def rate(at_s: float) -> float:
        if spec.spike_rps and spec.spike_from_s <= at_s < spec.spike_to_s:
            return spec.spike_rps
        return float(profile(np.float64(at_s)))

    return rate


def thinned_times(
    rate: Callable[[float], float], seconds: float, rng: random.Random, grid_s: float = 0.01
) -> list[float]:
    """Arrival times (s) of a Poisson process whose rate follows `rate`, by thinning: candidates
    at the peak rate, each kept with probability rate(t) / peak (Lewis and Shedler)."""
    peak = max(rate(k * grid_s) for k in range(int(seconds / grid_s) + 1))
    times: list[float] = []
    t = rng.expovariate(peak)
    while t < seconds:
        if rng.random() * peak < rate(t):
            times.append(t)
        t += rng.expovariate(peak)
    return times


def schedule(spec: LoadSpec) -> list[Arrival]:
    """Every request of the run, in order of sending; the same seed gives the same schedule."""
    tiers = random.Random(spec.seed)
    models = random.Random(spec.seed + 2)  # apart, so a mix leaves the arrivals and tiers as they were

    def tier() -> str:
        if spec.api_key:
            return "key"
        return PAID if tiers.random() < spec.paid_share else FREE

    if spec.arrivals == "typing":
        sessions = typing_sessions(
            np.random.default_rng(spec.seed), spec.rps, spec.duration_s, spec.keystrokes, spec.pause_ms
        )
        starts: dict[int, tuple[str, str]] = {}  # a session keeps its tier and model
        out = []
        for t_ms, session in zip(sessions.t_ms.tolist(), sessions.session.tolist(), strict=True):
            if session not in starts:
                starts[session] = (tier(), _pick(mix_at(spec, t_ms / 1000), models))
            out.append(Arrival(t_ms / 1000, *starts[session], session=session))
        return out
    if spec.arrivals == "poisson":  # flat: exponential gaps at the rate of the moment (the spike's)
        out, at_s = [], 0.0
        while at_s < spec.duration_s:
            out.append(Arrival(at_s, tier(), _pick(mix_at(spec, at_s), models)))
            at_s += tiers.expovariate(_rate(spec, at_s))
        return out
    times = thinned_times(rate_fn(spec), spec.duration_s, tiers)
    return [Arrival(t, tier(), _pick(mix_at(spec, t), models)) for t in times]


def completions_path(url: str) -> str:
    """The completions path under a base URL: http://h:8000 and http://h:8000/v1 both work."""
    base = urlsplit(url).path.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\n\ndef list_python_files(root):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    "for i in range(10):\n    ",
    "async def fetch(session, url):\n    ",
]


@dataclass
class _Run:
    client: Client
    spec: LoadSpec
    t0: float  # time.perf_counter() of second 0
    path: str  # POST here
    sessions: str  # X-Session-Id prefix, new each run so that runs do not supersede each other


async def _one(run: _Run, arrival: Arrival, i: int, hangup: bool) -> Record:
    client, spec, t0, sent_s, tier = run.client, run.spec, run.t0, arrival.at_s, arrival.tier
    headers = {"Content-Type": "application/json"}
    key = spec.api_key or (spec.paid_key if tier == PAID else spec.free_key)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if spec.deadline_ms:
        headers["X-Deadline-Ms"] = str(spec.deadline_ms)
    session = f"{run.sessions}-{arrival.session}" if arrival.session >= 0 else ""
    if session:  # a server without sessions ignores it
        headers["X-Session-Id"] = session
    request_id = f"{spec.id_prefix}-{i}" if spec.id_prefix else ""
    if request_id:
        headers["X-Request-Id"] = request_id
    if spec.bodies:
        body = {"model": arrival.model, **spec.bodies[i % len(spec.bodies)]}
    else:
        prompt = _PROMPTS[i % len(_PROMPTS)] + f"# {i}\n"
        body = {"model": arrival.model, "prompt": prompt, "max_tokens": spec.max_tokens}
    if spec.stream:
        body["stream"] = True
    timeout_s = spec.timeout_s or (spec.deadline_ms or 60_000) / 1000 + 30
    start = time.perf_counter()
    retries = spec.retries
    while True:
        fresh = retries < spec.retries
        post = client.post(run.path, orjson.dumps(body), headers, timeout_s, fresh)
        try:
            answer = await (_hang_up(post, spec.hangup_ms / 1000) if hangup else post)
            break
        except (TimeoutError, OSError) as exc:  # ConnectionError is an OSError
            now = time.perf_counter()
            left_ms = (spec.deadline_ms or 600.0) - (now - start) * 1000
            if retries > 0 and not isinstance(exc, TimeoutError) and left_ms > 1:
                retries -= 1  # the gateway process holding the connection died: the retry joins the request
                headers["X-Deadline-Ms"] = str(int(left_ms))
                continue
            return Record(
                sent_s,
                tier,
                0,
                (now - start) * 1000,
                error=type(exc).__name__,
                id=request_id,
                answered_s=now - t0,
                model=arrival.model,
                session=session,
            )
    if answer is None:
        now = time.perf_counter()
        return Record(
            sent_s,
            tier,
            0,
            (now - start) * 1000,
            error="hangup",
            id=request_id,
            answered_s=now - t0,
            hung_up=True,
            model=arrival.model,
            session=session,
        )
    rec = Record(
        sent_s,
        tier,
        answer.status,
        (answer.done_s - start) * 1000,
        id=request_id,
        answered_s=answer.done_s - t0,
        model=arrival.model,
        session=session,
    )
    if answer.status != 200:
        rec.code = _error_code(answer.body)
    if answer.status == 200 and spec.stream:
        completion = _last_event(answer.body)
        if answer.first_data_s is not None:
            rec.ttft_ms = (answer.first_data_s - start) * 1000
        if completion is None or "keybatch" not in completion:
            rec.status, rec.error = 0, "stream ended without a completion"
            return rec
    elif answer.status == 200:
        completion = orjson.loads(answer.body)
    if answer.status == 200:
        assert completion is not None  # each 200 above set it
        rec.completion_tokens = completion.get("usage", {}).get("completion_tokens", 0)
        rec.prompt_tokens = completion.get("usage", {}).get("prompt_tokens", 0)
        rec.answer_id = completion.get("id", "")
        kb = completion.get("keybatch")  # another server (a peer under benchmark) has no timings
        if kb is not None:
            rec.queue_ms, rec.batch_ms, rec.batch_size = kb["queue_ms"], kb["batch_ms"], kb["batch_size"]
            rec.server_ms = kb["total_ms"]
    return rec


def _error_code(body: bytes) -> str:
    """The code of an OpenAI-shaped error body, "" for anything else (another server's page)."""
    try:
        error = orjson.loads(body).get("error")
        return str(error.get("code") or "") if isinstance(error, dict) else ""
    except (orjson.JSONDecodeError, AttributeError):
        return ""


def _last_event(body: bytes) -> dict | None:
    """The last data event before [DONE] of a stream (it carries usage and timings)."""
    events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    for data in reversed(events):
        if data != b"[DONE]":
            parsed = orjson.loads(data)
            return parsed if isinstance(parsed, dict) else None
    return None


async def _hang_up(post: Coroutine[Any, Any, Answer], after_s: float) -> Answer | None:
    """The answer if it comes within `after_s`, else None with the connection closed."""
    task = asyncio.ensure_future(post)
    done, _ = await asyncio.wait({task}, timeout=after_s)
    if done:
        return task.result()
    task.cancel()  # Client.post closes a connection whose request is outstanding
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _rate(spec: LoadSpec, at_s: float) -> float:
    return spec.spike_rps if spec.spike_rps and spec.spike_from_s <= at_s < spec.spike_to_s else spec.rps


async def run_spec(spec: LoadSpec, show_progress: bool = True) -> list[Record]:
    arrivals = schedule(spec)
    hangups = random.Random(spec.seed + 1)  # apart, so hang-ups leave the arrivals as they were
    client = Client(spec.url)
    tasks: list[asyncio.Task[Record]] = []
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
        TimeRemainingColumn(),
        disable=not show_progress,
        transient=True,
        refresh_per_second=2,  # each redraw takes the client's GIL for a while
    )
    try:
        with progress:
            shape = "" if spec.arrivals == "poisson" else f" {spec.arrivals}"
            bar = progress.add_task(f"{spec.rps:.0f} req/s{shape}", total=spec.duration_s)
            t0 = spec.start_at if spec.start_at is not None else time.perf_counter()
            run = _Run(client, spec, t0, completions_path(spec.url), f"load-{secrets.token_hex(4)}")
            for i, arrival in enumerate(arrivals):
                delay = arrival.at_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                hangup = spec.hangup_share > 0 and arrival.at_s >= spec.hangup_from_s
                hangup = hangup and hangups.random() < spec.hangup_share
                tasks.append(asyncio.create_task(_one(run, arrival, i, hangup)))
                if i % 64 == 63:
                    progress.update(bar, completed=min(spec.duration_s, time.perf_counter() - t0))
            return list(await asyncio.gather(*tasks))
    finally:
        client.close()


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


def tenant_prompt(chars: int, i: int) -> str:
    """A code prompt of exactly `chars` characters (distinct per request)."""
    head = f"# request {i}\n"
    body = (_PROMPTS[i % len(_PROMPTS)] + "pass\n") * (chars // 20 + 1)
    return (head + body)[:chars]


def tenant_spec(base: LoadSpec, tenant: TenantLoad, seed: int) -> LoadSpec:
    """The LoadSpec of one tenant: the run's URL, model and length, the tenant's key and rate."""
    duration = min(tenant.for_s or base.duration_s, max(1e-3, base.duration_s - tenant.from_s))
    bodies = None
    if tenant.prompt_chars:
        bodies = [{"prompt": tenant_prompt(tenant.prompt_chars, i), "max_tokens": base.max_tokens} for i in range(16)]
    return LoadSpec(
        base.url,
        tenant.rps,
        duration,
        base.model,
        paid_share=0.0,
        api_key=tenant.key,
        free_key=None,
        max_tokens=base.max_tokens,
        seed=seed,
        deadline_ms=tenant.deadline_ms,
        bodies=bodies,
    )


def generate_tenants(base: LoadSpec, tenants: list[TenantLoad], show_progress: bool = False) -> list[Record]:
    """Every tenant's load side by side on one event loop; each record's `tier` is its
    tenant's name and its `sent_s` counts from the start of the whole run."""

    async def run_all() -> list[Record]:
        t0 = time.perf_counter()
        specs = [tenant_spec(base, t, base.seed + 10 * k) for k, t in enumerate(tenants)]
        for spec, t in zip(specs, tenants, strict=True):
            spec.start_at = t0 + t.from_s
        runs = await asyncio.gather(*(run_spec(spec, show_progress=False) for spec in specs))
        records = []
        for tenant, rs in zip(tenants, runs, strict=True):
            for r in rs:
                r.tier, r.sent_s = tenant.name, r.sent_s + tenant.from_s
            records.extend(rs)
        return records

    del show_progress  # one bar per tenant would fight over the terminal
    with collector_paused():
        return uvloop.run(run_all())


def generate(spec: LoadSpec, show_progress: bool = True) -> list[Record]:
    """Run the load on uvloop: the client shares the cores with what it measures, so
    the cheaper its event loop the less it disturbs the figures."""
    with collector_paused():
        return uvloop.run(run_spec(spec, show_progress))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def summarize(records: list[Record], duration_s: float | None = None) -> dict[str, dict[str, Any]]:
    """Figures per tier and for all requests. A superseded request (409 `superseded`: a newer
    one of its typing session took its place) is counted apart, not as an error: `ok_share`
    is the share of the others answered 200. Rates are over `duration_s` (default: until the
    last answer)."""
    out: dict[str, dict[str, Any]] = {}
    tiers = sorted({r.tier for r in records}, key=lambda t: (t != PAID, t != FREE, t))
    for tier in ("all", *tiers):
        rs = [r for r in records if tier == "all" or r.tier == tier]
        if not rs:
            continue
        ok = [r for r in rs if r.status == 200]
        shed = [r for r in rs if r.status == 429]
        superseded = sum(r.is_superseded for r in rs)
        seconds = duration_s or max(1e-9, max(r.answered_s for r in rs))
        out[tier] = {
            "sent": len(rs),
            "ok_share": len(ok) / max(1, len(rs) - superseded),
            "status_429": len(shed),
            "status_504": sum(r.status == 504 for r in rs),
            "superseded": superseded,
            "other": sum(r.status not in (200, 429, 504) and not r.is_superseded for r in rs),
            "no_answer": sum(r.status == 0 for r in rs),
            "statuses": _outcomes(rs),
            "codes": _codes(rs),
            "sent_rps": len(rs) / seconds,
            "ok_rps": len(ok) / seconds,
            "p50_ms": percentile([r.latency_ms for r in ok], 50),
            "p90_ms": percentile([r.latency_ms for r in ok], 90),
            "p99_ms": percentile([r.latency_ms for r in ok], 99),
            "p99_429_ms": percentile([r.latency_ms for r in shed], 99),
            "overhead_p50_ms": percentile([r.overhead_ms for r in ok], 50),
            "overhead_p99_ms": percentile([r.overhead_ms for r in ok], 99),
            "queue_p50_ms": percentile([r.queue_ms for r in ok], 50),
            "system_p50_ms": percentile([r.system_ms for r in ok], 50),
            "system_p99_ms": percentile([r.system_ms for r in ok], 99),
            "gateway_p50_ms": percentile([r.gateway_ms for r in ok], 50),
            "gateway_p99_ms": percentile([r.gateway_ms for r in ok], 99),
            "mean_batch": sum(r.batch_size for r in ok) / len(ok) if ok else float("nan"),
            "ttft_p50_ms": percentile([r.ttft_ms for r in ok if r.ttft_ms], 50),
            "ttft_p99_ms": percentile([r.ttft_ms for r in ok if r.ttft_ms], 99),
            "tokens_per_s": sum(r.completion_tokens for r in ok) / max(1e-9, max(r.answered_s for r in rs)),
        }
    return out


def _codes(records: list[Record]) -> dict[str, int]:
    """Answers by status and, for errors, their code ("429 tenant_queue_full")."""
    counts: dict[str, int] = {}
    for r in records:
        name = f"{r.status} {r.code}" if r.status not in (0, 200) and r.code else r.outcome
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _outcomes(records: list[Record]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return dict(sorted(counts.items()))


def by_model(records: list[Record], duration_s: float | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """`summarize` for each model's requests."""
    models = sorted({r.model for r in records})
    return {m: summarize([r for r in records if r.model == m], duration_s) for m in models}


def windows(records: list[Record], window_s: float, duration_s: float, key: str = "model") -> dict[str, list[dict]]:
    """Per model (key="model") or tier (key="tier"), and "all": one row per `window_s` of
    sending time: what was sent then and how it was answered (p50/p99 of its 200s)."""
    num = max(1, math.ceil(duration_s / window_s - 1e-9))
    groups: dict[str, list[list[Record]]] = {"all": [[] for _ in range(num)]}
    for r in records:
        k = min(num - 1, int(r.sent_s / window_s))
        groups["all"][k].append(r)
        groups.setdefault(getattr(r, key), [[] for _ in range(num)])[k].append(r)
    return {name: [_window(k * window_s, window_s, rs) for k, rs in enumerate(rows)] for name, rows in groups.items()}


def _window(start_s: float, window_s: float, rs: list[Record]) -> dict[str, Any]:
    ok = [r.latency_ms for r in rs if r.status == 200]
    return {
        "start_s": round(start_s, 3),
        "sent": len(rs),
        "offered_rps": len(rs) / window_s,
        "ok": len(ok),
        "p50_ms": percentile(ok, 50) if ok else None,
        "p99_ms": percentile(ok, 99) if ok else None,
        "status_429": sum(r.status == 429 for r in rs),
        "status_504": sum(r.status == 504 for r in rs),
        "superseded": sum(r.is_superseded for r in rs),
        "other": sum(r.status not in (0, 200, 429, 504) and not r.is_superseded for r in rs),
        "no_answer": sum(r.status == 0 for r in rs),
    }


def under_slo_from(rows: list[dict], slo_ms: float) -> float | None:
    """The start of the window from which every later window with requests had its p99 within
    `slo_ms` (and some 200s); None if the last such window missed it."""
    since: float | None = 0.0
    for row in rows:
        if row["sent"] == 0:
            continue
        missed = row["p99_ms"] is None or row["p99_ms"] > slo_ms
        if missed:
            since = None
        elif since is None:
            since = row["start_s"]
    return since


def report(spec: LoadSpec, records: list[Record], window_s: float = 5.0, slo_ms: float | None = None) -> dict[str, Any]:
    """What `keybatch load --json` writes, less the records."""
    per_model = windows(records, window_s, spec.duration_s, "model")
    per_tier = windows(records, window_s, spec.duration_s, "tier")
    by_window = {"window_s": window_s, "by_model": per_model, "by_tier": per_tier}
    out: dict[str, Any] = {
        "summary": summarize(records, spec.duration_s),
        "by_model": by_model(records, spec.duration_s),
        "windows": by_window,
    }
    if slo_ms is not None:
        out["slo"] = {
            "slo_ms": slo_ms,
            "p99_under_slo_from_s": {m: under_slo_from(rows, slo_ms) for m, rows in per_model.items()},
        }
    return out


def print_summary(title: str, summary: dict[str, dict[str, Any]], label: str = "tier") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = [
        "sent",
        "ok_share",
        "status_429",
        "status_504",
        "superseded",
        "other",
        "no_answer",
        "p50_ms",
        "p99_ms",
        "p99_429_ms",
        "queue_p50_ms",
        "system_p50_ms",
        "system_p99_ms",
        "mean_batch",
    ]
    if not any(row.get("superseded") for row in summary.values()):
        cols.remove("superseded")
    table.add_column(label)
    for col in cols:
        table.add_column(col.replace("_", " "), justify="right")
    for name, row in summary.items():
        table.add_row(name, *(_fmt(col, row[col]) for col in cols))
    Console(width=170).print(table)


def _fmt(col: str, value: float) -> str:
    if col == "ok_share":
        return f"{value:.2%}"
    if isinstance(value, int) or col in ("sent",):
        return str(int(value))
    return f"{value:.1f}"


def print_models(out: dict[str, Any]) -> None:
    """Per model and tier: sent, answered by status, p50/p90/p99, achieved rates."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="per model")
    for col in ("model", "tier", "sent", "sent/s", "200/s", "answered by status", "p50 ms", "p90 ms", "p99 ms"):
        table.add_column(col, justify="left" if col in ("model", "tier", "answered by status") else "right")
    for model, tiers in out["by_model"].items():
        for tier, row in tiers.items():
            statuses = ", ".join(f"{k}: {v}" for k, v in row["statuses"].items())
            figures = [f"{row[k]:.1f}" for k in ("sent_rps", "ok_rps", "p50_ms", "p90_ms", "p99_ms")]
            table.add_row(model, tier, str(row["sent"]), *figures[:2], statuses, *figures[2:])
    console = Console(width=170)
    console.print(table)
    if "slo" in out:
        slo = out["slo"]
        for model, since in slo["p99_under_slo_from_s"].items():
            when = "not by the end" if since is None else f"from {since:g} s on"
            per = f"per {out['windows']['window_s']:g} s window"
            console.print(f"{model}: p99 within {slo['slo_ms']:g} ms {per} {when}")


def plot(out: dict[str, Any], path: str, title: str) -> None:
    """Latency over time (p50 dashed, p99 solid, per window) per model, or per tier when one
    model is loaded; the offered rate; answers other than 200 by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = out["windows"]
    groups = w["by_model"] if len(w["by_model"]) > 2 else w["by_tier"]  # "all" and one model: by tier
    named = {name: rows for name, rows in groups.items() if name != "all"}
    fig, (lat, rate, bad) = plt.subplots(3, 1, figsize=(10, 8), sharex=True, height_ratios=(3, 2, 2))
    for k, (name, rows) in enumerate(named.items()):
        color = f"C{k}"
        x = [row["start_s"] + w["window_s"] / 2 for row in rows]
        for q, style in (("p99_ms", "-"), ("p50_ms", "--")):
            y = [math.nan if row[q] is None else row[q] for row in rows]
            lat.plot(x, y, style, color=color, marker=".", label=f"{name} {q[:3]}")
        rate.plot(x, [row["offered_rps"] for row in rows], color=color, marker=".", label=name)
    if "slo" in out:
        lat.axhline(out["slo"]["slo_ms"], color="red", linestyle=":", label="SLO")
    lat.set_ylabel("end to end (ms), answers 200")
    lat.set_title(textwrap.fill(title, 110), fontsize="medium")
    lat.legend(loc="upper left", fontsize="small", ncol=2)
    x = [row["start_s"] + w["window_s"] / 2 for row in groups["all"]]
    rate.plot(x, [row["offered_rps"] for row in groups["all"]], color="black", marker=".", label="all")
    rate.set_ylabel("offered (req/s)")
    rate.legend(loc="upper left", fontsize="small")
    rows = w["by_model"]["all"]
    x = [row["start_s"] + w["window_s"] / 2 for row in rows]
    bottom = [0] * len(rows)
    for kind in ("status_429", "status_504", "superseded", "other", "no_answer"):
        counts = [row[kind] for row in rows]
        bad.bar(x, counts, width=w["window_s"] * 0.8, bottom=bottom, label=kind.replace("status_", ""))
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    bad.set_ylabel(f"not 200 (per {w['window_s']:g} s)")
    bad.set_xlabel("seconds into the run (by when sent)")
    bad.legend(loc="upper left", fontsize="small", ncol=5)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


_PROFILE_SHARES = {"free": 0.0, "mixed": 0.3, "paid": 1.0}


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    """The LoadSpec `keybatch load` runs; ValueError with the reason for bad arguments."""
    share = args.paid_fraction if args.paid_fraction is not None else _PROFILE_SHARES[args.profile]
    if args.api_key and (args.paid_key or args.free_key or args.paid_fraction is not None or args.profile != "free"):
        raise ValueError("--api-key sends one key for every request: it takes no --paid-key, --free-key or paid share")
    if urlsplit(args.url).scheme != "http":
        raise ValueError(f"--url must be an http:// base URL, not {args.url!r}")
    if args.shift_to is None and (args.shift_from_s is not None or args.shift_over_s is not None):
        raise ValueError("--shift-from-s and --shift-over-s need --shift-to")
    if args.window_s <= 0:
        raise ValueError("--window-s must be above 0")
    models = parse_mix(args.models) if args.models else None
    shift_to = parse_mix(args.shift_to) if args.shift_to else None
    if shift_to is not None and models is None:
        models = {args.model: 1.0}
    return LoadSpec(
        args.url,
        args.rps,
        args.duration,
        args.model,
        share,
        args.paid_key,
        args.free_key,
        max_tokens=args.max_tokens,
        seed=args.seed,
        deadline_ms=args.deadline_ms,
        arrivals=args.arrivals,
        models=models,
        shift_to=shift_to,
        shift_from_s=args.shift_from_s or 0.0,
        shift_over_s=args.shift_over_s or 0.0,
        keystrokes=args.keystrokes,
        pause_ms=args.pause_ms,
        api_key=args.api_key,
    )


def _run_tenants(args: argparse.Namespace, spec: LoadSpec, tenants: list[TenantLoad]) -> int:
    print(f"keybatch load: {len(tenants)} tenants for {spec.duration_s:g} s ...", file=sys.stderr)
    records = generate_tenants(spec, tenants)
    out = report(spec, records, args.window_s, args.slo_ms)
    who = "; ".join(f"{t.name} {t.rps:g} req/s" + (f" {t.deadline_ms:g} ms" if t.deadline_ms else "") for t in tenants)
    print_summary(f"keybatch load by tenant, {spec.duration_s:g} s: {who}", out["summary"], label="tenant")
    print_statuses(out["summary"])
    if args.plot:
        plot(out, args.plot, who)
    if args.json:
        with open(args.json, "w") as fh:
            tenants_json = [asdict(t) for t in tenants]
            json.dump(
                {"spec": asdict(spec), "tenants": tenants_json, **out, "records": [asdict(r) for r in records]}, fh
            )
    return 0


def print_statuses(summary: dict[str, dict[str, Any]]) -> None:
    """Each row's answers by status and error code (429 tenant_queue_full apart from overloaded)."""
    for name, row in summary.items():
        print(f"{name}: " + ", ".join(f"{k}: {v}" for k, v in row["codes"].items()))


def run_load(args: argparse.Namespace) -> int:
    try:
        tenants = [parse_tenant(t) for t in args.tenant or []]
        if tenants and args.rps is not None:
            raise ValueError("--tenant gives each key its rate: it takes no --rps")
        if tenants:
            args.rps = sum(t.rps for t in tenants)
        elif args.rps is None:
            raise ValueError("--rps (or --tenant) is required")
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"keybatch load: {exc}", file=sys.stderr)
        return 2
    if tenants:
        return _run_tenants(args, spec, tenants)
    records = generate(spec)
    out = report(spec, records, args.window_s, args.slo_ms)
    mix = ", ".join(f"{m} {s:.0%}" for m, s in (spec.models or {spec.model: 1.0}).items())
    if spec.shift_to:
        to = ", ".join(f"{m} {s:.0%}" for m, s in spec.shift_to.items())
        mix += f" -> {to} from {spec.shift_from_s:g} s over {spec.shift_over_s:g} s"
    who = "one key" if spec.api_key else f"{spec.paid_share:.0%} paid"
    title = f"keybatch load: {spec.arrivals} {spec.rps:g} req/s for {spec.duration_s:g} s, {who}; {mix}"
    print_summary(title, out["summary"])
    print_models(out)
    if args.plot:
        plot(out, args.plot, title)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"spec": asdict(spec), **out, "records": [asdict(r) for r in records]}, fh)
    return 0
