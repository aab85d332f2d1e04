"""Open-loop load: Poisson arrivals against a gateway, whatever its answers take.

Open loop means a slow server does not slow the arrivals down, so queueing shows
as it would with real users. Every request is counted once: a status code, or a
client-side error if no answer came.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import uvloop
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from control.httpclient import Answer, Client
from control.memory import collector_paused


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
    completion_tokens: int = 0

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


_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\n\ndef list_python_files(root):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    "for i in range(10):\n    ",
    "async def fetch(session, url):\n    ",
]


async def _one(client: Client, spec: LoadSpec, t0: float, sent_s: float, tier: str, i: int, hangup: bool) -> Record:
    headers = {"Content-Type": "application/json"}
    key = spec.paid_key if tier == "paid" else spec.free_key
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if spec.deadline_ms:
        headers["X-Deadline-Ms"] = str(spec.deadline_ms)
    request_id = f"{spec.id_prefix}-{i}" if spec.id_prefix else ""
    if request_id:
        headers["X-Request-Id"] = request_id
    if spec.bodies:
        body = {"model": spec.model, **spec.bodies[i % len(spec.bodies)]}
    else:
        body = {"model": spec.model, "prompt": _PROMPTS[i % len(_PROMPTS)] + f"# {i}\n", "max_tokens": spec.max_tokens}
    if spec.stream:
        body["stream"] = True
    timeout_s = spec.timeout_s or (spec.deadline_ms or 60_000) / 1000 + 30
    start = time.perf_counter()
    retries = spec.retries
    while True:
        fresh = retries < spec.retries
        post = client.post("/v1/completions", orjson.dumps(body), headers, timeout_s, fresh)
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
                sent_s, tier, 0, (now - start) * 1000, error=type(exc).__name__, id=request_id, answered_s=now - t0
            )
    if answer is None:
        now = time.perf_counter()
        return Record(
            sent_s, tier, 0, (now - start) * 1000, error="hangup", id=request_id, answered_s=now - t0, hung_up=True
        )
    rec = Record(
        sent_s, tier, answer.status, (answer.done_s - start) * 1000, id=request_id, answered_s=answer.done_s - t0
    )
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
        rec.answer_id = completion.get("id", "")
        kb = completion.get("keybatch")  # another server (a peer under benchmark) has no timings
        if kb is not None:
            rec.queue_ms, rec.batch_ms, rec.batch_size = kb["queue_ms"], kb["batch_ms"], kb["batch_size"]
            rec.server_ms = kb["total_ms"]
    return rec


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
    rng = random.Random(spec.seed)
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
            bar = progress.add_task(f"{spec.rps:.0f} req/s", total=spec.duration_s)
            t0 = spec.start_at if spec.start_at is not None else time.perf_counter()
            next_s, i = 0.0, 0
            while next_s < spec.duration_s:
                delay = next_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tier = "paid" if rng.random() < spec.paid_share else "free"
                hangup = spec.hangup_share > 0 and next_s >= spec.hangup_from_s and hangups.random() < spec.hangup_share
                tasks.append(asyncio.create_task(_one(client, spec, t0, next_s, tier, i, hangup)))
                i += 1
                next_s += rng.expovariate(_rate(spec, next_s))
                if i % 64 == 0:
                    progress.update(bar, completed=min(spec.duration_s, time.perf_counter() - t0))
            return list(await asyncio.gather(*tasks))
    finally:
        client.close()


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


def summarize(records: list[Record]) -> dict[str, dict[str, float]]:
    """Figures per tier and for all requests."""
    out: dict[str, dict[str, float]] = {}
    for tier in ("all", "paid", "free"):
        rs = [r for r in records if tier == "all" or r.tier == tier]
        if not rs:
            continue
        ok = [r for r in rs if r.status == 200]
        shed = [r for r in rs if r.status == 429]
        out[tier] = {
            "sent": len(rs),
            "ok_share": len(ok) / len(rs),
            "status_429": len(shed),
            "status_504": sum(r.status == 504 for r in rs),
            "other": sum(r.status not in (200, 429, 504) for r in rs),
            "no_answer": sum(r.status == 0 for r in rs),
            "p50_ms": percentile([r.latency_ms for r in ok], 50),
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


def print_summary(title: str, summary: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = [
        "sent",
        "ok_share",
        "status_429",
        "status_504",
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
    table.add_column("tier")
    for col in cols:
        table.add_column(col.replace("_", " "), justify="right")
    for tier, row in summary.items():
        table.add_row(tier, *(_fmt(col, row[col]) for col in cols))
    Console(width=170).print(table)


def _fmt(col: str, value: float) -> str:
    if col == "ok_share":
        return f"{value:.2%}"
    if isinstance(value, int) or col in ("sent",):
        return str(int(value))
    return f"{value:.1f}"


def run_load(args: argparse.Namespace) -> int:
    share = {"free": 0.0, "mixed": 0.3, "paid": 1.0}[args.profile]
    spec = LoadSpec(
        args.url, args.rps, args.duration, args.model, share, args.paid_key, args.free_key, deadline_ms=args.deadline_ms
    )
    records = generate(spec)
    summary = summarize(records)
    print_summary(f"keybatch load: {args.rps:.0f} req/s for {args.duration:.0f} s ({args.profile})", summary)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"spec": asdict(spec), "summary": summary, "records": [asdict(r) for r in records]}, fh)
    return 0
