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

from control.bench.harness import FREE_KEY, MODEL, PAID_KEY, Deployment, child_env
from control.broker import keys, lua
from control.fleet.valkey import EmbeddedBroker
from control.load.generator import generate
from control.load.spec import LoadSpec

WARMUP_S = 3.0
SCRIPTS = {name: source for name, source in lua.SOURCES.items() if name != "RESCUE"}
SCRIPT_BY_SHA = {hashlib.sha1(source.encode()).hexdigest(): name for name, source in SCRIPTS.items()}
# Commands a replay leaves out: connection set-up, subscriptions (their messages are
# PUBLISH's cost), and what only an operator or this bench sends.
NOT_REPLAYED = {
    "MONITOR", "SUBSCRIBE", "PSUBSCRIBE", "UNSUBSCRIBE", "PUNSUBSCRIBE", "CLIENT", "HELLO", "SELECT",
    "INFO", "AUTH", "QUIT", "RESET", "COMMAND", "CONFIG", "SCRIPT", "FLUSHALL", "DEBUG", "ECHO",
}  # fmt: skip
BLOCKING = {"BRPOP": "RIGHT", "BLPOP": "LEFT"}
END_MARKER = b"keybatch-bench-broker-end"


@dataclass
class Snapshot:
    """Valkey's cumulative counters at one moment."""

    at_s: float
    calls: dict[str, int]  # by command, script calls inside included (INFO commandstats)
    usec: dict[str, int]  # time spent executing each command (a script's inner commands in its EVALSHA too)
    commands: int  # total_commands_processed
    bytes_in: int
    bytes_out: int
    cpu_s: float  # used_cpu_user + used_cpu_sys


def snapshot(client: redis.Redis) -> Snapshot:
    stats, cpu, commandstats = client.info("stats"), client.info("cpu"), client.info("commandstats")
    calls = {name.removeprefix("cmdstat_").upper(): int(v["calls"]) for name, v in commandstats.items()}
    usec = {name.removeprefix("cmdstat_").upper(): int(v["usec"]) for name, v in commandstats.items()}
    return Snapshot(
        time.monotonic(),
        calls,
        usec,
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
    usec: dict[str, float]
    commands: float
    bytes_in: float
    bytes_out: float
    cpu_s: float

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> Rates:
        calls = {k: float(v - a.calls.get(k, 0)) for k, v in b.calls.items() if v > a.calls.get(k, 0)}
        usec = {k: float(v - a.usec.get(k, 0)) for k, v in b.usec.items() if v > a.usec.get(k, 0)}
        return cls(
            b.at_s - a.at_s, calls, usec, b.commands - a.commands, b.bytes_in - a.bytes_in, b.bytes_out - a.bytes_out,
            b.cpu_s - a.cpu_s,
        )  # fmt: skip

    def less(self, idle: Rates) -> Rates:
        """This interval with the idle rates over as long taken off (never below zero)."""
        k = self.seconds / idle.seconds
        calls = {c: max(0.0, n - k * idle.calls.get(c, 0)) for c, n in self.calls.items()}
        usec = {c: max(0.0, n - k * idle.usec.get(c, 0)) for c, n in self.usec.items()}

        def less(mine: float, theirs: float) -> float:
            return max(0.0, mine - k * theirs)

        return Rates(
            self.seconds, calls, usec, less(self.commands, idle.commands), less(self.bytes_in, idle.bytes_in),
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


# What runs by the clock, not per request: the gateways' sweep and registry reads, the
# replicas' leases and heartbeats (with the trim of their model's waiting sets), clock
# reads. (name, key kind); "" stands for any.
BACKGROUND = {
    ("SWEEP_DEAD", ""), ("SWEEP_ONE", ""), ("SMEMBERS", "replicas"), ("HGETALL", "replica"), ("EXISTS", "lease"),
    ("SET", "lease"), ("SADD", "holders"), ("SADD", "replicas"), ("HSET", "replica"), ("EXPIRE", "replica"),
    ("PEXPIRE", "replica"), ("DEL", "replica"), ("GET", "stats"), ("TIME", ""), ("PING", ""),
    ("ZREMRANGEBYSCORE", "waiting"),
}  # fmt: skip


def key_kind(key: bytes) -> str:
    """'{kb}:lease:r1' -> 'lease'; '{kb}.kb-small:9' -> 'queue'; anything else: its first part."""
    text = key.decode(errors="replace")
    if text.startswith(f"{keys.PREFIX}."):
        return "queue"
    return text.removeprefix(f"{keys.PREFIX}:").split(":", 1)[0]


def is_background(name: str, kind: str) -> bool:
    return (name, "") in BACKGROUND or (name, kind) in BACKGROUND


@dataclass
class Sample:
    """What MONITOR saw: the clients' commands in order, and what scripts ran inside."""

    trace: list[list[bytes]] = field(default_factory=list)  # the request path's commands
    background: list[list[bytes]] = field(default_factory=list)  # the clock's
    seconds: float = 0.0
    client_calls: Counter[str] = field(default_factory=Counter)  # by command, or by script for EVALSHA
    client_kinds: Counter[str] = field(default_factory=Counter)  # by "command key-kind"
    client_bytes: Counter[str] = field(default_factory=Counter)  # request bytes (args only)
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
        name, kind = command, key_kind(args[1]) if len(args) > 1 else ""
        if command == "EVALSHA" and len(args) > 1:
            name = self._running = SCRIPT_BY_SHA.get(args[1].decode(), "other script")
            kind = ""
        self.client_calls[name] += 1
        self.client_kinds[f"{name} {kind}".strip()] += 1
        self.client_bytes[name] += sum(len(a) for a in args)
        (self.background if is_background(name, kind) else self.trace).append(args)


def monitor_during(url: str, run: Any, drain_s: float = 300.0) -> tuple[Sample, Any]:
    """Run `run()` while a MONITOR connection records; (what it saw, what run returned).
    The lines are kept raw and parsed afterwards, and the reader reads on to a marker
    sent after the run: MONITOR's stream can run behind the commands it reports."""
    sample = Sample()
    client = redis.Redis.from_url(url)
    conn = client.connection_pool.get_connection()
    conn.send_command("MONITOR")
    assert conn.read_response() in (b"OK", "OK")
    lines: list[bytes] = []

    def read() -> None:
        while True:
            raw = conn.read_response()
            line = raw if isinstance(raw, bytes) else str(raw).encode("latin-1")
            if END_MARKER in line:
                return
            lines.append(line)

    reader = threading.Thread(target=read, name="monitor", daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        result = run()
    finally:
        sample.seconds = time.monotonic() - started
        client.echo(END_MARKER.decode())
        reader.join(drain_s)
        conn.disconnect()
        client.close()
    for line in lines:
        parsed = parse_monitor_line(line.decode("latin-1"))
        if parsed:
            sample.add(*parsed)
    return sample, result


# -- replay --------------------------------------------------------------------------


def replayable(args: list[bytes]) -> list[bytes]:
    """A blocking pop as its non-blocking LMPOP; anything else as it was."""
    command = args[0].decode().upper()
    if command in BLOCKING:
        keys = args[1:-1]
        return [b"LMPOP", str(len(keys)).encode(), *keys, BLOCKING[command].encode()]
    return args


def replay(trace: list[list[bytes]], rounds: int, chunk: int) -> dict[str, float]:
    """Send the trace to a fresh Valkey `rounds` times (emptied between rounds), `chunk`
    commands a round trip: the server's CPU seconds for the whole trace, best round (the
    least disturbed by whatever else runs) and median."""
    commands = [replayable(args) for args in trace]
    cpu_s: list[float] = []
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
            cpu_s.append(snapshot(client).cpu_s - before.cpu_s)
        client.connection_pool.release(conn)
        client.close()
    return {"cpu_s_best": min(cpu_s), "cpu_s_median": statistics.median(cpu_s), "commands": len(commands)}


# -- the run -------------------------------------------------------------------------


def _spec(url: str, args: argparse.Namespace, duration_s: float, seed: int) -> LoadSpec:
    return LoadSpec(
        url, args.rate, duration_s, model=MODEL, paid_share=args.paid_share, paid_key=PAID_KEY, free_key=FREE_KEY,
        seed=seed, id_prefix=f"bb{seed}" if args.own_ids else None,
    )  # fmt: skip


def _answered(records: list) -> int:
    return sum(r.status == 200 for r in records)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    deployment = Deployment("broker", args.workers, child_env())
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


def report(args: argparse.Namespace, m: dict[str, Any], replays: dict[str, dict[str, float]]) -> dict[str, Any]:
    work: Rates = m["work"]
    idle: Rates = m["idle"]
    sample: Sample = m["sample"]
    # The sample counts per admission call, one per request that reached Redis: MONITOR
    # slows Valkey, so fewer of the sample's requests may end 200 than reached it.
    n, ns = max(1, m["answered"]), max(1, sample.client_calls.get("ADMIT", 0))
    live_cpu_us = work.cpu_s * 1e6 / n
    inner = sum(sample.lua_calls.values())
    by_kind = sample.client_kinds.most_common()
    out: dict[str, Any] = {
        "command": f"keybatch bench broker --rate {args.rate:g} --duration {args.duration:g} --workers {args.workers} "
        f"--paid-share {args.paid_share:g} --sample {args.sample:g}" + ("" if args.own_ids else " --no-own-ids"),
        "offered_rps": args.rate,
        "answered": m["answered"],
        "sent": m["sent"],
        "per_request": {  # the load's counters less the idle rates, over the requests answered
            "commands_scripts_inside_included": work.commands / n,
            "evalsha": work.calls.get("EVALSHA", 0.0) / n,
            "bytes_in": work.bytes_in / n,
            "bytes_out": work.bytes_out / n,
            "valkey_cpu_us": live_cpu_us,
            "executing_evalsha_us": work.usec.get("EVALSHA", 0.0) / n,
        },
        "calls_per_request_by_command": {k: v / n for k, v in sorted(work.calls.items(), key=lambda kv: -kv[1])},
        "usec_per_call_by_command": {k: work.usec.get(k, 0.0) / v for k, v in work.calls.items() if v},
        "idle_per_s": {
            "commands": idle.commands / idle.seconds,
            "bytes_in": idle.bytes_in / idle.seconds,
            "bytes_out": idle.bytes_out / idle.seconds,
            "valkey_cpu_share": idle.cpu_s / idle.seconds,
            "by_command": {k: v / idle.seconds for k, v in sorted(idle.calls.items(), key=lambda kv: -kv[1])},
        },
        "sample": {
            "seconds": sample.seconds,
            "answered": m["sample_answered"],
            "admitted_or_refused_by_script": ns,
            "request_path_commands_per_request": len(sample.trace) / ns,
            "background_commands_per_s": len(sample.background) / max(sample.seconds, 1e-9),
            "inner_commands_per_request": inner / ns,
            "client_calls_per_request": {k: v / ns for k, v in by_kind if not is_background(*_split(k))},
            "background_calls_per_s": {k: v / sample.seconds for k, v in by_kind if is_background(*_split(k))},
            "inner_commands_per_script_call": {
                k: sample.lua_by_script[k] / sample.client_calls[k]
                for k in sample.lua_by_script
                if k in sample.client_calls
            },
            "request_bytes_per_request": {k: v / ns for k, v in sample.client_bytes.most_common()},
        },
        "one_core_rps": {"live": 1e6 / live_cpu_us if live_cpu_us else None},
        "replays": {},
    }
    for name, replayed in replays.items():
        per_request_us = replayed["cpu_s_best"] * 1e6 / ns
        out["replays"][name] = {**replayed, "valkey_cpu_us_per_request": per_request_us}
        out["one_core_rps"][f"replay {name}"] = 1e6 / per_request_us
    out["sizing"] = sizing(args.target_rps, args.utilization, out["one_core_rps"], out["per_request"])
    return out


def _split(name_kind: str) -> tuple[str, str]:
    name, _, kind = name_kind.partition(" ")
    return name, kind


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
        f"per request (idle rates taken off): {pr['commands_scripts_inside_included']:.1f} commands, the scripts' "
        f"own included ({pr['evalsha']:.2f} EVALSHA), {pr['bytes_in']:.0f} B in, {pr['bytes_out']:.0f} B out, "
        f"{pr['valkey_cpu_us']:.0f} us of Valkey CPU"
    )
    s = out["sample"]
    print(
        f"\nMONITOR sample, {s['admitted_or_refused_by_script']} requests through ADMIT "
        f"({s['answered']} answered 200): "
        f"{s['request_path_commands_per_request']:.2f} client commands and "
        f"{s['inner_commands_per_request']:.1f} script-inner commands per request"
    )
    print(f"{'client call (key kind)':28} {'per request':>12} {'inner/call':>11}")
    for name, per in s["client_calls_per_request"].items():
        inner = s["inner_commands_per_script_call"].get(name)
        print(f"{name:28} {per:12.3f} {'' if inner is None else f'{inner:11.1f}'}")
    print(f"{'clock-driven call':28} {'per second':>12}")
    for name, per_s in s["background_calls_per_s"].items():
        print(f"{name:28} {per_s:12.1f}")
    idle = out["idle_per_s"]
    print(f"\nidle (no load): {idle['commands']:.0f} commands/s, Valkey CPU {idle['valkey_cpu_share']:.1%}")
    print("\none Valkey core carries (requests/s):")
    for name, rps in out["one_core_rps"].items():
        print(f"  {name:24} {rps:10,.0f}")
    sz = out["sizing"]
    shards = ", ".join(f"{k} {v}" for k, v in sz["shards"].items())
    print(
        f"at {sz['target_rps']:,.0f} req/s and {sz['utilization']:.0%} of a core: shards {shards}; network "
        f"{sz['network_in_mbit_s']:.0f} Mbit/s in, {sz['network_out_mbit_s']:.0f} Mbit/s out"
    )


def run_broker(args: argparse.Namespace) -> int:
    m = measure(args)
    replays = {}
    if args.replay_rounds > 0:
        trace = m["sample"].trace
        replays["pipelined"] = replay(trace, args.replay_rounds, chunk=500)
        replays["one by one"] = replay(trace, args.replay_rounds, chunk=1)
    out = report(args, m, replays)
    print_report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0
