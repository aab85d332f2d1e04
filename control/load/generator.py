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

import asyncio
import contextlib
import random
import secrets
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
import uvloop
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from control.core.memory import collector_paused
from control.core.vocab import PAID
from control.load.httpclient import Answer, Client
from control.load.schedule import schedule
from control.load.spec import Arrival, LoadSpec, Record, TenantLoad


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


@dataclass
class _Request:
    """One arrival as sent: its headers, its body, and the ids it carries."""

    arrival: Arrival
    headers: dict[str, str]
    body: dict[str, Any]
    request_id: str  # the X-Request-Id sent, else ""
    session: str  # the X-Session-Id sent, else ""

    def record(self, status: int, latency_ms: float, answered_s: float, **fields: Any) -> Record:
        arrival = self.arrival
        return Record(
            arrival.at_s,
            arrival.tier,
            status,
            latency_ms,
            id=self.request_id,
            answered_s=answered_s,
            model=arrival.model,
            session=self.session,
            **fields,
        )


async def _one(run: _Run, arrival: Arrival, i: int, hangup: bool) -> Record:
    """Send one arrival and record how it was answered (or not)."""
    request = _request(run, arrival, i)
    start = time.perf_counter()
    try:
        answer = await _send(run, request, hangup, start)
    except (TimeoutError, OSError) as exc:  # ConnectionError is an OSError
        now = time.perf_counter()
        return request.record(0, (now - start) * 1000, now - run.t0, error=type(exc).__name__)
    if answer is None:
        now = time.perf_counter()
        return request.record(0, (now - start) * 1000, now - run.t0, error="hangup", hung_up=True)
    return _answered(run, request, answer, start)


def _request(run: _Run, arrival: Arrival, i: int) -> _Request:
    """The headers (key, deadline, session, request id) and the body of the i-th request."""
    spec = run.spec
    headers = {"Content-Type": "application/json"}
    key = spec.api_key or (spec.paid_key if arrival.tier == PAID else spec.free_key)
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
    return _Request(arrival, headers, body, request_id, session)


async def _send(run: _Run, request: _Request, hangup: bool, start: float) -> Answer | None:
    """POST it; None: hung up on purpose. A broken connection is sent again (same request id,
    what is left of the deadline) while `spec.retries` last; a timeout, or a failure past
    them, raises."""
    spec = run.spec
    timeout_s = spec.timeout_s or (spec.deadline_ms or 60_000) / 1000 + 30
    retries = spec.retries
    while True:
        fresh = retries < spec.retries
        post = run.client.post(run.path, orjson.dumps(request.body), request.headers, timeout_s, fresh)
        try:
            return await (_hang_up(post, spec.hangup_ms / 1000) if hangup else post)
        except (TimeoutError, OSError) as exc:
            left_ms = (spec.deadline_ms or 600.0) - (time.perf_counter() - start) * 1000
            if retries > 0 and not isinstance(exc, TimeoutError) and left_ms > 1:
                retries -= 1  # the gateway process holding the connection died: the retry joins the request
                request.headers["X-Deadline-Ms"] = str(int(left_ms))
                continue
            raise


def _answered(run: _Run, request: _Request, answer: Answer, start: float) -> Record:
    """The record of an answer: its status and error code, or a 200's usage and timings."""
    rec = request.record(answer.status, (answer.done_s - start) * 1000, answer.done_s - run.t0)
    if answer.status != 200:
        rec.code = _error_code(answer.body)
        return rec
    if run.spec.stream:
        completion = _last_event(answer.body)
        if answer.first_data_s is not None:
            rec.ttft_ms = (answer.first_data_s - start) * 1000
        if completion is None or "keybatch" not in completion:
            rec.status, rec.error = 0, "stream ended without a completion"
            return rec
    else:
        completion = orjson.loads(answer.body)
    _add_completion(rec, completion)
    return rec


def _add_completion(rec: Record, completion: dict[str, Any]) -> None:
    """A 200's token counts, its completion's id, and keybatch's own timings when it has them."""
    rec.completion_tokens = completion.get("usage", {}).get("completion_tokens", 0)
    rec.prompt_tokens = completion.get("usage", {}).get("prompt_tokens", 0)
    rec.answer_id = completion.get("id", "")
    kb = completion.get("keybatch")  # another server (a peer under benchmark) has no timings
    if kb is not None:
        rec.queue_ms, rec.batch_ms, rec.batch_size = kb["queue_ms"], kb["batch_ms"], kb["batch_size"]
        rec.server_ms = kb["total_ms"]
        rec.cell = kb.get("cell", -1)


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
