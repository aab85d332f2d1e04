"""`keybatch fleet`, `drain`, `resume`, `move`, `rebalance`: control/fleet/operator.py in a terminal."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

import redis

from control.core.settings import Settings
from control.fleet.operator import ActionResult, FleetSnapshot, Operator, OperatorError
from control.policy.rebalance import Decision

PORT_HELP = "the deployment (`keybatch up`) whose gateway serves on this port: its operator credentials"


def add_fleet_args(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fleet = sub.add_parser("fleet", help="the replicas, their state and load, and the traffic per model")
    fleet.add_argument("--json", action="store_true", help="one JSON object")
    fleet.add_argument("--port", type=int, default=None, help=PORT_HELP)
    for name, text in (("drain", "stop a replica taking work; it finishes what it holds"), ("resume", "serve again")):
        p = sub.add_parser(name, help=text)
        p.add_argument("replica", help="its name, or the part before '@' when unique")
        p.add_argument("--json", action="store_true")
        p.add_argument("--port", type=int, default=None, help=PORT_HELP)
        if name == "drain":
            p.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for drained")
            p.add_argument("--force", action="store_true", help="even the last serving replica of its model")
    move = sub.add_parser("move", help="drain a replica, load another model there and serve it")
    move.add_argument("replica")
    move.add_argument("--model", required=True)
    move.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds until it serves")
    move.add_argument("--force", action="store_true", help="even the last serving replica of its model")
    move.add_argument("--json", action="store_true")
    move.add_argument("--port", type=int, default=None, help=PORT_HELP)
    reb = sub.add_parser("rebalance", help="share replicas between models by demand (once, or --auto)")
    reb.add_argument("--auto", action="store_true", help="keep rebalancing until Ctrl-C (with hysteresis)")
    reb.add_argument("--every", type=float, default=2.0, metavar="S")
    reb.add_argument("--json", action="store_true")
    reb.add_argument("--port", type=int, default=None, help=PORT_HELP)


def run_fleet_command(settings: Settings, args: argparse.Namespace) -> int:
    try:
        op = Operator(settings)
        return _COMMANDS[args.command](op, args)
    except OperatorError as exc:
        print(f"keybatch {args.command}: {exc}", file=sys.stderr)
        return 2
    except (redis.RedisError, RuntimeError) as exc:
        print(f"keybatch {args.command}: cannot reach the broker: {exc}", file=sys.stderr)
        return 1


def _fleet(op: Operator, args: argparse.Namespace) -> int:
    snap = op.snapshot()
    if args.json:
        print(json.dumps(snap.as_json(), indent=2))
    else:
        print(format_fleet(snap))
    return 0


def format_fleet(snap: FleetSnapshot) -> str:
    rows: list[tuple[str, ...]] = [
        (
            "REPLICA",
            "CELL",
            "HOST",
            "PID",
            "MODEL",
            "STATE",
            "HELD",
            "FILL",
            "DUTY",
            "CYCLE MS",
            "P50/P99 MS",
            "BEAT MS",
            "HEDGES/WON",
        )
    ]
    for r in snap.replicas:
        state = r.state_label + (f"->{r.moving_to}" if r.moving_to else "") + ("" if r.is_ready else "*")
        rows.append(
            (
                r.name,
                str(r.cell),
                r.host,
                str(r.pid),
                r.model,
                state,
                str(r.num_held),
                f"{r.batch_fill:.0%}",
                f"{r.utilization:.0%}",
                f"{r.cycle_ms:.0f}",
                f"{r.batch_p50_ms:.0f}/{r.batch_p99_ms:.0f}",
                f"{r.heartbeat_age_ms:.0f}",
                f"{r.hedged}/{r.hedge_wins}",
            )
        )
    lines = _table(rows) if snap.replicas else ["no replicas registered"]
    if any(not r.is_ready for r in snap.replicas):
        lines.append(
            "* takes no new work" + "".join(f"; {r.name}: {r.why_not_ready}" for r in snap.replicas if r.why_not_ready)
        )
    traffic: list[tuple[str, ...]] = [
        ("MODEL", "TIER", "QUEUED", "OLDEST MS", "IN/S", "DONE/S", "P50/P99 MS (END TO END)")
    ]
    for t in snap.traffic:
        lat = f"{t.p50_ms:.0f}/{t.p99_ms:.0f}" if t.p50_ms is not None and t.p99_ms is not None else "-"
        traffic.append(
            (
                t.model,
                t.tier,
                str(t.num_queued),
                f"{t.oldest_ms:.0f}",
                f"{t.arrival_rate:.1f}",
                f"{t.completion_rate:.1f}",
                lat,
            )
        )
    return "\n".join([*lines, "", *_table(traffic)])


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _report(result: ActionResult, as_json: bool) -> int:
    if as_json:
        print(json.dumps(result.as_json()))
    elif result.ok:
        print(f"{result.replica}: {result.state} ({result.model})")
    else:
        print(f"{result.replica}: {result.action} refused: {result.message} (state {result.state})", file=sys.stderr)
    return 0 if result.ok else 1


def _drain(op: Operator, args: argparse.Namespace) -> int:
    return _report(op.drain(args.replica, force=args.force, wait_s=args.wait), args.json)


def _resume(op: Operator, args: argparse.Namespace) -> int:
    return _report(op.resume(args.replica), args.json)


def _move(op: Operator, args: argparse.Namespace) -> int:
    return _report(op.move(args.replica, args.model, force=args.force, wait_s=args.wait), args.json)


def _rebalance(op: Operator, args: argparse.Namespace) -> int:
    stop = threading.Event()
    if args.auto:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    failed, last = False, ""
    try:
        for decisions, results in op.rebalance(auto=args.auto, every_s=args.every, stop=stop):
            lines = [_decision_line(d, args.json) for d in decisions]
            if "\n".join(lines) != last:  # --auto: a decision is printed when it changes
                print(*lines, sep="\n")
                last = "\n".join(lines)
            for r in results:
                failed |= _report(r, args.json) != 0
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    return 1 if failed else 0


def _decision_line(d: Decision, as_json: bool) -> str:
    if as_json:
        return json.dumps({"reason": d.reason, "replica": d.replica, "from": d.from_model, "to": d.to_model})
    return f"move {d.replica}: {d.from_model} -> {d.to_model}: {d.reason}" if d.is_move else d.reason


_COMMANDS = {"fleet": _fleet, "drain": _drain, "resume": _resume, "move": _move, "rebalance": _rebalance}
