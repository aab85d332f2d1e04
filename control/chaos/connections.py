"""The faults made of connections: slowloris (header bytes dribbled), idle connections (nothing
sent, reopened when closed) with paid probes on new connections beside them."""

from __future__ import annotations

import asyncio
import json
import resource
import time
from collections import Counter
from dataclasses import dataclass

from control.bench.harness import MODEL
from control.chaos.injection import Run
from control.chaos.spec import CLIENT_SLACK_S, PAID_KEY
from control.load.summary import percentile

SLOWLORIS_CONNECTIONS = 300
SLOWLORIS_BYTE_EVERY_S = 1.0
IDLE_CONNECTIONS = 2100
IDLE_ADDRESSES = 10  # 127.0.0.2 onwards (Linux routes 127/8 to lo): no one address's cap holds them back
IDLE_REOPEN_S = 0.1  # an idle connection the server closed is opened again after this
PROBE_EVERY_S, PROBE_BUDGET_MS = 0.25, 1000.0  # idle-connections: a paid request on a new connection


@dataclass
class _Dribbler:
    opened_s: float
    closed_s: float | None = None
    answer: str = ""  # the status line the server sent before closing, if any


async def dribble(run: Run, count: int, until_s: float) -> dict[str, object]:
    """`count` connections that send a request line, then one header byte a second."""
    host, port = "127.0.0.1", run.target.port
    results = await asyncio.gather(*(_dribble_one(run, host, port, until_s) for _ in range(count)))
    opened = [d for d in results if d is not None]
    closed = [d for d in opened if d.closed_s is not None]
    held_s = [d.closed_s - d.opened_s for d in closed if d.closed_s is not None]
    return {
        "connections": count,
        "refused": count - len(opened),
        "closed_by_server": len(closed),
        "still_open_at_end": len(opened) - len(closed),
        "first_closed_s": min((d.closed_s for d in closed if d.closed_s is not None), default=None),
        "held_p50_s": percentile(held_s, 50) if held_s else None,
        "held_max_s": max(held_s, default=None),
        "answers": dict(Counter(d.answer or "closed without an answer" for d in closed)),
    }


async def _dribble_one(run: Run, host: str, port: int, until_s: float) -> _Dribbler | None:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return None
    conn = _Dribbler(run.now_s())
    headers = b"".join(f"X-Dribble-{i}: {i}\r\n".encode() for i in range(1000))  # never the blank line
    reading = asyncio.ensure_future(reader.read(256))  # a byte or EOF: the server gave up on us
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: chaos\r\n")
        for sent in range(len(headers)):
            done, _ = await asyncio.wait({reading}, timeout=SLOWLORIS_BYTE_EVERY_S)
            if done:
                conn.closed_s = run.now_s()
                data = b"" if reading.exception() else reading.result()
                conn.answer = data.split(b"\r\n", 1)[0].decode("latin-1")
                return conn
            if run.now_s() >= until_s:
                return conn
            writer.write(headers[sent : sent + 1])
            await writer.drain()
    except (ConnectionError, OSError):
        conn.closed_s = run.now_s()
    finally:
        if reading.done() and not reading.cancelled():
            reading.exception()  # looked at, so asyncio does not report it as never retrieved
        reading.cancel()
        writer.close()
    return conn


# -- idle connections ------------------------------------------------------------------


async def hold_idle(run: Run, count: int, until_s: float) -> dict[str, object]:
    """`count` connections that send nothing, each opened again when the server closes it."""
    seen: Counter[str] = Counter()
    held_s: list[float] = []
    open_now = [0]
    samples: list[int] = []

    async def one(k: int) -> None:
        source = f"127.0.0.{2 + k % IDLE_ADDRESSES}"
        while run.now_s() < until_s:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", run.target.port, local_addr=(source, 0))
            except OSError as exc:
                seen[f"connect failed: {type(exc).__name__}"] += 1
                await asyncio.sleep(IDLE_REOPEN_S)
                continue
            opened_s = run.now_s()
            open_now[0] += 1
            try:
                data = await asyncio.wait_for(reader.read(256), max(0.0, until_s - opened_s))
                seen[data.split(b"\r\n", 1)[0].decode("latin-1") or "closed without an answer"] += 1
                held_s.append(run.now_s() - opened_s)
            except TimeoutError:
                seen["open at the end"] += 1
            except OSError:
                seen["reset"] += 1
            finally:
                open_now[0] -= 1
                writer.close()
            await asyncio.sleep(IDLE_REOPEN_S)

    async def sample() -> None:
        while run.now_s() < until_s:
            samples.append(open_now[0])
            await asyncio.sleep(0.5)

    probes: list[tuple[str, float]] = []

    async def probe() -> None:
        await asyncio.sleep(1.0)  # the idle connections open first
        while run.now_s() < until_s - 1.0:
            probes.append(await _paid_probe(run.target.port))
            await asyncio.sleep(PROBE_EVERY_S)

    await asyncio.gather(sample(), probe(), *(one(k) for k in range(count)))
    settled = samples[len(samples) // 4 :] or [0]  # after the first opens
    waits_ms = [t for _status, t in probes]
    return {
        "connections": count,
        "addresses": IDLE_ADDRESSES,
        "outcomes": dict(seen.most_common()),
        "held_p50_s": percentile(held_s, 50) if held_s else None,
        "open_at_once_min": min(settled),
        "open_at_once_median": sorted(settled)[len(settled) // 2],
        "paid_new_connection": {
            "sent": len(probes),
            "budget_ms": PROBE_BUDGET_MS,
            "statuses": dict(Counter(status for status, _t in probes)),
            "p50_ms": percentile(waits_ms, 50) if waits_ms else None,
            "p99_ms": percentile(waits_ms, 99) if waits_ms else None,
            "max_ms": max(waits_ms, default=None),
            "over_budget": sum(status != "200" or t > PROBE_BUDGET_MS for status, t in probes),
        },
    }


async def _paid_probe(port: int) -> tuple[str, float]:
    """One paid request on a new connection: its status and time to its answer (ms)."""
    body = json.dumps({"model": MODEL, "prompt": "def probe():\n    ", "max_tokens": 4}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {PAID_KEY}\r\nX-Deadline-Ms: {PROBE_BUDGET_MS:.0f}\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    started = time.perf_counter()
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head.encode() + body)
        line = await asyncio.wait_for(reader.readline(), PROBE_BUDGET_MS / 1000 + CLIENT_SLACK_S)
        status = line.split(b" ", 2)[1].decode("latin-1") if line.count(b" ") >= 2 else "closed"
    except (TimeoutError, OSError) as exc:
        status = type(exc).__name__
    finally:
        if writer is not None:
            writer.close()
    return status, (time.perf_counter() - started) * 1000


def raise_fd_limit() -> None:
    """Room for the idle connections' sockets in this process and in the deployment it starts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * IDLE_CONNECTIONS + 4096
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
