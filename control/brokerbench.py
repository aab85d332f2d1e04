"""`keybatch bench broker`: what the live request path asks of Valkey per request, and how
many requests a second one Valkey core carries for that mix.

1. *Live.* A real deployment (`keybatch up --backend fixed --policy static`, the
   embedded Valkey) idles, then takes a Poisson load. Valkey's own counters (`INFO
   commandstats`, `INFO stats`, `INFO cpu`) are read around both; the idle rates times
   the load's length are taken off, and what is left is divided by the requests
   answered: commands, bytes in and out and Valkey CPU per request.
2. *Sample.* A second, shorter load runs under `MONITOR`, which names each call and
   the script behind each EVALSHA, and splits what a script does inside from what the
   clients send. The sample is also kept as a trace of the clients' commands.
3. *Replay.* The trace is sent again, pipelined, to a fresh Valkey (the same binary)
   with the project's scripts loaded, and that server's CPU is read around it:
   commands per CPU-second with the connection overhead pipelined away. Blocking pops
   become their non-blocking LMPOP (a replay has nobody to wait for).

One core carries 1 / (Valkey CPU per request) requests a second: the live figure is
the floor (one command per read, as under moderate load), the replay the ceiling.
docs/decisions/0015-broker-sharding.md turns them into shards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from api.gateway import ADMIT_LUA, CANCEL_LUA
from control import failover
from control.broker import EmbeddedBroker
from control.chaos import FREE_KEY, MODEL, PAID_KEY, Deployment, _child_env
from control.loadgen import LoadSpec, generate

WARMUP_S = 3.0
SCRIPTS = {
    "ADMIT": ADMIT_LUA,
    "CANCEL": CANCEL_LUA,
    "RECORD": failover.RECORD_LUA,
    "CLAIM": failover.CLAIM_LUA,
    "DELIVER": failover.DELIVER_LUA,
    "STREAM": failover.STREAM_LUA,
    "SWEEP_ONE": failover.SWEEP_ONE_LUA,
    "SWEEP_DEAD": failover.SWEEP_DEAD_LUA,
}
SCRIPT_BY_SHA = {hashlib.sha1(source.encode()).hexdigest(): name for name, source in SCRIPTS.items()}
# Commands a replay leaves out: connection set-up, subscriptions (their messages are
# PUBLISH's cost), and what only an operator or this bench sends.
NOT_REPLAYED = {
    "MONITOR", "SUBSCRIBE", "PSUBSCRIBE", "UNSUBSCRIBE", "PUNSUBSCRIBE", "CLIENT", "HELLO", "SELECT",
    "INFO", "AUTH", "QUIT", "RESET", "COMMAND", "CONFIG", "SCRIPT", "FLUSHALL", "DEBUG",
}  # fmt: skip
BLOCKING = {"BRPOP": "RIGHT", "BLPOP": "LEFT"}


@dataclass
class Snapshot:
    """Valkey's cumulative counters at one moment."""

    at_s: float
    calls: dict[str, int]  # by command, script calls inside included (INFO commandstats)
    commands: int  # total_commands_processed
    bytes_in: int
    bytes_out: int
    cpu_s: float  # used_cpu_user + used_cpu_sys


def snapshot(client: redis.Redis) -> Snapshot:
    stats, cpu, commandstats = client.info("stats"), client.info("cpu"), client.info("commandstats")
    calls = {name.removeprefix("cmdstat_").upper(): int(v["calls"]) for name, v in commandstats.items()}
    return Snapshot(
        time.monotonic(),
        calls,
        int(stats["total_commands_processed"]),
        int(stats["total_net_input_bytes"]),
        int(stats["total_net_output_bytes"]),
        float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
    )


@dataclass
class Rates:
    """Counter deltas over an interval, and its length."""

    seconds: float
    calls: dict[str, float]
    commands: float
    bytes_in: float
    bytes_out: float
    cpu_s: float

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> Rates:
        calls = {k: float(v - a.calls.get(k, 0)) for k, v in b.calls.items() if v > a.calls.get(k, 0)}
        return cls(
            b.at_s - a.at_s, calls, b.commands - a.commands, b.bytes_in - a.bytes_in, b.bytes_out - a.bytes_out,
            b.cpu_s - a.cpu_s,
        )  # fmt: skip

    def less(self, idle: Rates) -> Rates:
        """This interval with the idle rates over as long taken off (never below zero)."""
        k = self.seconds / idle.seconds
        calls = {c: max(0.0, n - k * idle.calls.get(c, 0)) for c, n in self.calls.items()}

        def less(mine: float, theirs: float) -> float:
            return max(0.0, mine - k * theirs)

        return Rates(
            self.seconds, calls, less(self.commands, idle.commands), less(self.bytes_in, idle.bytes_in),
            less(self.bytes_out, idle.bytes_out), less(self.cpu_s, idle.cpu_s),
        )  # fmt: skip


# -- MONITOR -------------------------------------------------------------------------

_ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b", '"': b'"', "\\": b"\\"}


def parse_monitor_line(line: str) -> tuple[str, list[bytes]] | None:
    """'<time> [<db> <client|lua>] "CMD" "arg" ...' -> (client or 'lua', [CMD, arg, ...]),
    undoing Valkey's quoting (sdscatrepr: \\n, \\", \\xHH ...)."""
    open_, close = line.find("["), line.find("]")
    if open_ < 0 or close < 0:
        return None
    source = line[open_ + 1 : close].split(" ", 1)[-1]
    args: list[bytes] = []
    i, text = close + 1, line
    while True:
        i = text.find('"', i)
        if i < 0:
            break
        out = bytearray()
        i += 1
        while text[i] != '"':
            if text[i] == "\\":
                nxt = text[i + 1]
                if nxt == "x":
                    out.append(int(text[i + 2 : i + 4], 16))
                    i += 4
                    continue
                out += _ESCAPES.get(nxt, nxt.encode())
                i += 2
                continue
            out += text[i].encode("latin-1", errors="replace")
            i += 1
        args.append(bytes(out))
        i += 1
    return source, args


@dataclass
class Sample:
    """What MONITOR saw: the clients' commands in order, and what scripts ran inside."""

    trace: list[list[bytes]] = field(default_factory=list)
    client_calls: Counter[str] = field(default_factory=Counter)
    client_bytes: Counter[str] = field(default_factory=Counter)  # request bytes by command (args only)
    script_calls: Counter[str] = field(default_factory=Counter)  # EVALSHA by script
    lua_calls: Counter[str] = field(default_factory=Counter)  # commands run inside scripts, by command
    lua_by_script: Counter[str] = field(default_factory=Counter)  # inner commands by the script that ran them
    _running: str = field(default="?", repr=False)  # the script whose inner commands come next

    def add(self, source: str, args: list[bytes]) -> None:
        if not args:
            return
        command = args[0].decode(errors="replace").upper()
        if source == "lua":
            self.lua_calls[command] += 1
            self.lua_by_script[self._running] += 1
            return
        if command in NOT_REPLAYED:
            return
        name = command
        if command == "EVALSHA" and len(args) > 1:
            name = self._running = SCRIPT_BY_SHA.get(args[1].decode(), "other script")
            self.script_calls[name] += 1
        self.client_calls[command] += 1
        self.client_bytes[name] += sum(len(a) for a in args)
        self.trace.append(args)


def monitor_during(url: str, run: Any) -> tuple[Sample, Any]:
    """Run `run()` while a MONITOR connection records; (what it saw, what run returned)."""
    sample = Sample()
    client = redis.Redis.from_url(url)
    conn = client.connection_pool.get_connection()
    conn.send_command("MONITOR")
    assert conn.read_response() in (b"OK", "OK")
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set() or conn.can_read(timeout=0.2):
            if not conn.can_read(timeout=0.2):
                continue
            raw = conn.read_response()
            line = raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)
            parsed = parse_monitor_line(line)
            if parsed:
                sample.add(*parsed)

    reader = threading.Thread(target=read, name="monitor", daemon=True)
    reader.start()
    try:
        result = run()
    finally:
        stop.set()
        reader.join(30)
        conn.disconnect()
        client.close()
    return sample, result


# -- replay --------------------------------------------------------------------------


def replayable(args: list[bytes]) -> list[bytes]:
    """A blocking pop as its non-blocking LMPOP; anything else as it was."""
    command = args[0].decode().upper()
    if command in BLOCKING:
        keys = args[1:-1]
        return [b"LMPOP", str(len(keys)).encode(), *keys, BLOCKING[command].encode()]
    return args


def replay(trace: list[list[bytes]], rounds: int, chunk: int = 500) -> dict[str, float]:
    """Send the trace pipelined to a fresh Valkey `rounds` times (emptied between rounds);
    the server's CPU per command, best round (least disturbed by whatever else runs)."""
    commands = [replayable(args) for args in trace]
    per_command_us: list[float] = []
    with EmbeddedBroker() as broker:
        client = redis.Redis.from_url(broker.url)
        conn = client.connection_pool.get_connection()
        for _ in range(rounds):
            client.flushall()
            for source in SCRIPTS.values():
                client.script_load(source)
            before = snapshot(client)
            for start in range(0, len(commands), chunk):
                batch = commands[start : start + chunk]
                conn.send_packed_command(conn.pack_commands(batch))
                for _ in batch:
                    try:
                        conn.read_response()
                    except redis.ResponseError:
                        pass  # a replayed call may meet other state (a TTL passed): it still ran
            after = snapshot(client)
            per_command_us.append((after.cpu_s - before.cpu_s) * 1e6 / max(1, after.commands - before.commands))
        client.connection_pool.release(conn)
        client.close()
    return {
        "cpu_us_per_command_best": min(per_command_us),
        "cpu_us_per_command_median": statistics.median(per_command_us),
    }


# -- the run -------------------------------------------------------------------------


def _spec(url: str, args: argparse.Namespace, duration_s: float, seed: int) -> LoadSpec:
    return LoadSpec(
        url, args.rate, duration_s, model=MODEL, paid_share=args.paid_share, paid_key=PAID_KEY, free_key=FREE_KEY,
        seed=seed, id_prefix=f"bb{seed}" if args.own_ids else None,
    )  # fmt: skip


def _answered(records: list) -> int:
    return sum(r.status == 200 for r in records)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    deployment = Deployment("broker", args.workers, _child_env())
    deployment.start()
    try:
        generate(_spec(deployment.url, args, WARMUP_S, 7), show_progress=False)
        url = deployment.redis_url()
        assert url is not None, "the deployment did not pass a broker URL to its children"
        client = redis.Redis.from_url(url)
        a = snapshot(client)
        time.sleep(args.idle)
        b = snapshot(client)
        records = generate(_spec(deployment.url, args, args.duration, 1), show_progress=False)
        c = snapshot(client)
        sample, sampled = monitor_during(
            url, lambda: generate(_spec(deployment.url, args, args.sample, 2), show_progress=False)
        )
        client.close()
    finally:
        deployment.stop()
    idle, loaded = Rates.between(a, b), Rates.between(b, c)
    return {
        "idle": idle, "loaded": loaded, "work": loaded.less(idle), "answered": _answered(records),
        "sent": len(records), "sample": sample, "sample_answered": _answered(sampled),
    }  # fmt: skip


def report(args: argparse.Namespace, m: dict[str, Any], replayed: dict[str, float] | None) -> dict[str, Any]:
    work: Rates = m["work"]
    idle: Rates = m["idle"]
    sample: Sample = m["sample"]
    n, ns = max(1, m["answered"]), max(1, m["sample_answered"])
    live_cpu_us = work.cpu_s * 1e6 / n
    out: dict[str, Any] = {
        "command": f"keybatch bench broker --rate {args.rate:g} --duration {args.duration:g} --workers {args.workers} "
        f"--paid-share {args.paid_share:g} --sample {args.sample:g}" + ("" if args.own_ids else " --no-own-ids"),
        "offered_rps": args.rate,
        "answered": m["answered"],
        "sent": m["sent"],
        "per_request": {
            "client_commands": work.commands / n,
            "all_calls_scripts_inside_included": sum(work.calls.values()) / n,
            "bytes_in": work.bytes_in / n,
            "bytes_out": work.bytes_out / n,
            "valkey_cpu_us": live_cpu_us,
        },
        "calls_per_request_by_command": {k: v / n for k, v in sorted(work.calls.items(), key=lambda kv: -kv[1])},
        "idle_per_s": {
            "client_commands": idle.commands / idle.seconds,
            "bytes_in": idle.bytes_in / idle.seconds,
            "bytes_out": idle.bytes_out / idle.seconds,
            "valkey_cpu_share": idle.cpu_s / idle.seconds,
            "by_command": {k: v / idle.seconds for k, v in sorted(idle.calls.items(), key=lambda kv: -kv[1])},
        },
        "sample": {
            "answered": m["sample_answered"],
            "client_commands": sum(sample.client_calls.values()),
            "client_calls_per_request": {k: v / ns for k, v in sample.client_calls.most_common()},
            "script_calls_per_request": {k: v / ns for k, v in sample.script_calls.most_common()},
            "inner_commands_per_script_call": {
                k: sample.lua_by_script[k] / v for k, v in sample.script_calls.most_common() if v
            },
            "request_bytes_per_request": {k: v / ns for k, v in sample.client_bytes.most_common()},
        },
        "one_core_rps": {"live": 1e6 / live_cpu_us if live_cpu_us else None},
    }
    if replayed:
        per_request_us = replayed["cpu_us_per_command_best"] * sum(sample.client_calls.values()) / ns
        out["replay"] = {**replayed, "valkey_cpu_us_per_request": per_request_us}
        out["one_core_rps"]["replay"] = 1e6 / per_request_us
    out["sizing"] = sizing(args.target_rps, args.utilization, out["one_core_rps"], out["per_request"])
    return out


def sizing(target_rps: float, utilization: float, one_core: dict[str, float | None], per_request: dict) -> dict:
    shards = {k: math.ceil(target_rps / (v * utilization)) for k, v in one_core.items() if v}
    return {
        "target_rps": target_rps,
        "utilization": utilization,
        "shards": shards,
        "network_in_mbit_s": target_rps * per_request["bytes_in"] * 8 / 1e6,
        "network_out_mbit_s": target_rps * per_request["bytes_out"] * 8 / 1e6,
    }


def print_report(out: dict[str, Any]) -> None:
    pr = out["per_request"]
    print(f"{out['answered']} of {out['sent']} answered at {out['offered_rps']:g} req/s offered")
    print(
        f"per request: {pr['client_commands']:.2f} commands from clients "
        f"({pr['all_calls_scripts_inside_included']:.2f} with the scripts' own), "
        f"{pr['bytes_in']:.0f} B in, {pr['bytes_out']:.0f} B out, "
        f"{pr['valkey_cpu_us']:.0f} us of Valkey CPU"
    )
    print(f"\n{'command (live, idle rate taken off)':40} {'calls/request':>14}")
    for name, v in out["calls_per_request_by_command"].items():
        if v >= 0.01:
            print(f"{name:40} {v:14.3f}")
    s = out["sample"]
    print(f"\nMONITOR sample: {s['answered']} answered, {s['client_commands']} client commands")
    print(f"{'client call':22} {'per request':>12} {'request bytes':>14} {'inner commands/call':>20}")
    names = list(s["client_calls_per_request"]) + list(s["script_calls_per_request"])
    for name in names:
        if name == "EVALSHA":
            continue
        per = s["script_calls_per_request"].get(name, s["client_calls_per_request"].get(name, 0.0))
        inner = s["inner_commands_per_script_call"].get(name)
        inner_text = f"{inner:20.1f}" if inner is not None else f"{'':20}"
        print(f"{name:22} {per:12.3f} {s['request_bytes_per_request'].get(name, 0.0):14.0f} {inner_text}")
    idle = out["idle_per_s"]
    print(f"\nidle (no load): {idle['client_commands']:.0f} commands/s, Valkey CPU {idle['valkey_cpu_share']:.1%}")
    one = out["one_core_rps"]
    print(f"\none Valkey core carries: {one['live']:,.0f} req/s (live, floor)", end="")
    if "replay" in out:
        print(f", {one['replay']:,.0f} req/s (replayed pipelined, ceiling)")
    else:
        print()
    sz = out["sizing"]
    shards = ", ".join(f"{k} {v}" for k, v in sz["shards"].items())
    print(
        f"at {sz['target_rps']:,.0f} req/s and {sz['utilization']:.0%} utilization: shards {shards}; network "
        f"{sz['network_in_mbit_s']:.0f} Mbit/s in, {sz['network_out_mbit_s']:.0f} Mbit/s out"
    )


def run_broker(args: argparse.Namespace) -> int:
    m = measure(args)
    replayed = replay(m["sample"].trace, args.replay_rounds) if args.replay_rounds > 0 else None
    out = report(args, m, replayed)
    print_report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0
