"""`keybatch bench ops`: the operator's drain and move on a live deployment under load.

Each action gets its own `keybatch up --backend fixed --policy static` (control/bench/harness.py's
`Deployment`), warmed, then open-loop Poisson load at a share of kb-small's capacity
from a thread of this process (and, for a move, light load on kb-large). At `--action-at`
this process calls `Operator.drain` or `Operator.move` (control/fleet/operator.py) as an operator
would, then polls `Operator.snapshot()` until the replica is drained, or serving the other
model, and times it. The report counts every request sent by what answered it, and the
latency of the requests sent before the action, while it ran and after it was done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import uvloop

from control.bench.harness import MODEL, Deployment, DeploymentError, child_env
from control.bench.report import counts, figure_table, ms, outcome, print_table, settle_logs, timeline, without_logs
from control.core.memory import collector_paused
from control.core.settings import Settings
from control.fleet.operator import Operator, OperatorError
from control.load.generator import generate, run_spec
from control.load.spec import LoadSpec, Record
from control.load.summary import percentile

OTHER_MODEL = "kb-large"
PAID_KEY, FREE_KEY = "ops-paid", "ops-free"
ACTIONS = ("drain", "move")
POLL_S = 0.05  # between reads of the fleet while the action runs
CLIENT_SLACK_S = 5.0  # a client waits its deadline plus this, then counts the request lost
WARM_S = 1.0
START_DELAY_S = 0.2  # from building the load to its second 0


class OpsBenchError(Exception):
    """The run could not be set up: the deployment did not start, or is not what was planned."""


@dataclass(frozen=True)
class OpsSpec:
    action: str
    replicas: int = 4
    load: float = 0.7
    duration_s: float = 30.0
    action_at_s: float = 10.0
    other_load: float = 0.1  # move: kb-large's rate, as a share of one replica's capacity
    paid_share: float = 0.3
    seed: int = 1

    def problem(self) -> str | None:
        if self.replicas < 2:
            return "--replicas must be at least 2 (the last serving replica of a model is never drained)"
        if not 0 < self.load <= 10 or not 0 <= self.other_load <= 10 or not 0 <= self.paid_share <= 1:
            return "--load must be in (0, 10], --other-load in [0, 10] and --paid-share in [0, 1]"
        if not 0 < self.action_at_s < self.duration_s:
            return "--action-at must fall inside the load: 0 < action-at < duration"
        return None


@dataclass
class Observed:
    """What the operator saw: the command's answer and each state the replica showed."""

    replica: str
    command: str
    at_s: float = 0.0  # seconds since the load's second 0, when the command went out
    answered_s: float | None = None  # when the command returned
    answer: dict[str, Any] = field(default_factory=dict)
    states: list[dict[str, Any]] = field(default_factory=list)  # {"at_s", "state", "model"} on each change
    done_s: float | None = None  # when the replica showed the state the action aims at

    @property
    def took_s(self) -> float | None:
        return None if self.done_s is None else round(self.done_s - self.at_s, 3)


# -- the run ---------------------------------------------------------------------------


def run_ops(settings: Settings, args: argparse.Namespace) -> int:
    actions = list(ACTIONS) if args.action == "both" else [args.action]
    specs = [
        OpsSpec(
            action,
            args.replicas,
            args.load,
            args.duration,
            args.action_at,
            args.other_load,
            args.paid_share,
            args.seed,
        )
        for action in actions
    ]
    problem = next((p for p in (s.problem() for s in specs) if p), None)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    reports: dict[str, dict[str, Any]] = {}
    for spec in specs:
        try:
            reports[spec.action] = measure(settings, spec)
        except (OpsBenchError, DeploymentError) as exc:
            print(f"keybatch bench ops: {exc}", file=sys.stderr)
            return 2
        _print(reports[spec.action])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({action: without_logs(r) for action, r in reports.items()}, fh, indent=2)
    passed = [settle_logs(report) for report in reports.values()]
    return 0 if all(passed) else 1


def measure(settings: Settings, spec: OpsSpec) -> dict[str, Any]:
    """One action on its own deployment; the report (stops the deployment whatever happens)."""
    # `up` spreads its replicas round robin over --models: kb-small named `replicas` times,
    # then kb-large once, gives that many kb-small replicas and one kb-large.
    models = [MODEL] * spec.replicas + ([OTHER_MODEL] if spec.action == "move" else [])
    deployment = Deployment(f"ops-{spec.action}", len(models), child_env(PAID_KEY, FREE_KEY), models=models)
    capacity = settings.max_batch * 1000.0 / settings.batch_ms  # one replica, requests a second
    try:
        deployment.start()
        operator = _operator(settings, deployment)
        _check_fleet(operator, models)
        for model in sorted(set(models)):
            generate(LoadSpec(deployment.url, 20.0, WARM_S, model, free_key=FREE_KEY, seed=99), show_progress=False)
        victim = sorted(r.name for r in operator.snapshot().serving(MODEL))[0]
        loads = _loads(deployment.url, spec, capacity, settings)
        records, observed = _drive(operator, spec, loads, victim)
    finally:
        stop = deployment.stop()
    return {
        "action": spec.action,
        "spec": asdict(spec),
        "command": _command_line(spec),
        "replica_capacity_rps": capacity,
        "rps": {load.model: load.rps for load in loads},
        "max_batch": settings.max_batch,
        "batch_ms": settings.batch_ms,
        "deadline_ms": settings.deadline_ms,
        "poll_s": POLL_S,
        **analyze(spec, records, observed),
        "deployment": stop,
        "logs": [deployment.log_path],
    }


def _operator(settings: Settings, deployment: Deployment) -> Operator:
    url = deployment.redis_url()
    if url is None:
        raise OpsBenchError(f"no broker URL found among the deployment's processes; log: {deployment.log_path}")
    return Operator(settings.model_copy(update={"redis_url": url, "broker_url": None}))


def _check_fleet(operator: Operator, models: list[str], timeout_s: float = 20.0) -> None:
    """Every planned replica serving and answering remote control (which also makes the
    operator's Celery app now, not at the action)."""
    wanted = Counter(models)
    deadline = time.monotonic() + timeout_s
    while True:
        serving = Counter(r.model for r in operator.snapshot().replicas if r.is_ready)
        listening = operator.live()
        if serving == wanted and len(listening) == len(models):
            return
        if time.monotonic() > deadline:
            raise OpsBenchError(
                f"wanted {dict(wanted)} serving, found {dict(serving)}; {len(listening)} replicas answer remote control"
            )
        time.sleep(0.2)


def _loads(url: str, spec: OpsSpec, capacity: float, settings: Settings) -> list[LoadSpec]:
    deadline_ms = settings.deadline_ms
    start_at = time.perf_counter() + START_DELAY_S
    prefix = f"ops-{secrets.token_hex(4)}"
    rates = {MODEL: spec.load * spec.replicas * capacity}
    if spec.action == "move" and spec.other_load > 0:
        rates[OTHER_MODEL] = spec.other_load * capacity
    return [
        LoadSpec(
            url,
            rps,
            spec.duration_s,
            model,
            spec.paid_share,
            PAID_KEY,
            FREE_KEY,
            seed=spec.seed + i,
            id_prefix=f"{prefix}-{model}",
            timeout_s=deadline_ms / 1000 + CLIENT_SLACK_S,
            start_at=start_at,
        )
        for i, (model, rps) in enumerate(rates.items())
    ]


def _drive(
    operator: Operator, spec: OpsSpec, loads: list[LoadSpec], victim: str
) -> tuple[dict[str, list[Record]], Observed]:
    """The load in a thread; the action and the polling from this one. Records by model."""
    origin = loads[0].start_at
    assert origin is not None
    results: list[list[Record]] = []
    failure: list[BaseException] = []

    def offer() -> None:
        async def together() -> list[list[Record]]:
            return list(await asyncio.gather(*(run_spec(load, show_progress=False) for load in loads)))

        try:
            with collector_paused():
                results.extend(uvloop.run(together()))
        except BaseException as exc:  # re-raised on the main thread
            failure.append(exc)

    thread = threading.Thread(target=offer, name="ops-load", daemon=True)
    thread.start()
    time.sleep(max(0.0, origin + spec.action_at_s - time.perf_counter()))
    observed = _act(operator, spec, victim, lambda: time.perf_counter() - origin)
    thread.join()
    if failure:
        raise failure[0]
    return {load.model: records for load, records in zip(loads, results, strict=True)}, observed


def _act(operator: Operator, spec: OpsSpec, victim: str, now_s: Callable[[], float]) -> Observed:
    target_model = OTHER_MODEL if spec.action == "move" else MODEL
    observed = Observed(victim, spec.action if spec.action == "drain" else f"move --model {target_model}")
    observed.at_s = now_s()
    try:
        if spec.action == "drain":
            result = operator.drain(victim)
        else:
            result = operator.move(victim, target_model)
        observed.answer = result.as_json()
    except OperatorError as exc:
        observed.answer = {"ok": False, "message": str(exc)}
    observed.answered_s = now_s()
    if not observed.answer.get("ok"):
        return observed
    end_s = spec.duration_s + CLIENT_SLACK_S
    last: tuple[str, str] | None = None
    while now_s() < end_s:
        info = next((r for r in operator.snapshot().replicas if r.name == victim), None)
        seen = (info.state_label, info.model) if info is not None else ("absent", "")
        if seen != last:
            observed.states.append({"at_s": round(now_s(), 3), "state": seen[0], "model": seen[1]})
            last = seen
        if info is not None and _reached(spec.action, info.state_label, info.model, target_model):
            observed.done_s = now_s()
            break
        time.sleep(POLL_S)
    return observed


def _reached(action: str, state: str, model: str, target_model: str) -> bool:
    return state == ("drained" if action == "drain" else "serving") and model == target_model


def _command_line(spec: OpsSpec) -> str:
    return (
        f"keybatch bench ops --action {spec.action} --replicas {spec.replicas} --load {spec.load:g} "
        f"--duration {spec.duration_s:g} --action-at {spec.action_at_s:g}"
        + (f" --other-load {spec.other_load:g}" if spec.action == "move" else "")
        + f" --paid-share {spec.paid_share:g} --seed {spec.seed}"
    )


# -- the report ------------------------------------------------------------------------


def _group(records: list[Record]) -> dict[str, Any]:
    ok = [r.latency_ms for r in records if r.status == 200]
    return {
        "sent": len(records),
        "statuses": dict(sorted(Counter(outcome(r) for r in records).items())),
        "p50_ms": percentile(ok, 50) if ok else None,
        "p99_ms": percentile(ok, 99) if ok else None,
    }


def analyze(spec: OpsSpec, by_model: dict[str, list[Record]], observed: Observed) -> dict[str, Any]:
    """Before: sent before the command went out; during: from it until the replica showed
    the state aimed at (to the end of the load if it never did); after: the rest."""
    start = observed.at_s
    end = observed.done_s if observed.done_s is not None else spec.duration_s
    windows = {
        "before": lambda r: r.sent_s < start,
        "during": lambda r: start <= r.sent_s <= end,
        "after": lambda r: r.sent_s > end,
    }
    by_window = {
        window: {model: _group([r for r in records if inside(r)]) for model, records in by_model.items()}
        for window, inside in windows.items()
    }
    records = [r for model_records in by_model.values() for r in model_records]
    lost = [r for r in records if r.status == 0]
    failed = [r for r in records if r.status not in (0, 200)]
    crossed = sum(1 for r in records if r.status == 200 and r.answer_id != r.id)
    reasons = []
    if not observed.answer.get("ok"):
        reasons.append(f"the {spec.action} command failed: {observed.answer.get('message') or observed.answer}")
    elif observed.done_s is None:
        reasons.append(f"{observed.replica} never showed {'drained' if spec.action == 'drain' else 'serving'}")
    if lost:
        reasons.append(f"{len(lost)} requests lost")
    if failed:
        where = Counter(next(w for w, inside in windows.items() if inside(r)) for r in failed)
        when = ", ".join(f"{n} sent {w}" for w, n in where.items())
        reasons.append(f"{len(failed)} requests answered with an error ({when} the action)")
    if crossed:
        reasons.append(f"{crossed} answers carried another request's id")
    return {
        "replica": observed.replica,
        "operator_command": observed.command,
        "action_at_s": round(observed.at_s, 3),
        "command_answered_ms": None
        if observed.answered_s is None
        else round((observed.answered_s - observed.at_s) * 1000, 1),
        "command_answer": observed.answer,
        "states_seen": observed.states,
        "time_to_done_s": observed.took_s,
        "done": "drained" if spec.action == "drain" else f"serving {OTHER_MODEL}",
        "sent": len(records),
        "answered": dict(sorted(Counter(str(r.status) for r in records if r.status).items())),
        "lost": len(lost),
        "lost_by_error": dict(Counter(r.error for r in lost)),
        "failed": len(failed),
        "duplicated": crossed,
        "windows": by_window,
        "timeline": {model: timeline(rs, spec.duration_s, _group) for model, rs in by_model.items()},
        "failed_reasons": reasons,
        "ok": not reasons,
    }


def _print(report: dict[str, Any]) -> None:
    spec = report["spec"]
    rates = ", ".join(f"{model} {rps:.0f} req/s" for model, rps in report["rps"].items())
    table = figure_table(
        f"keybatch bench ops {report['action']}: {spec['replicas']} kb-small replicas"
        + (f" + 1 {OTHER_MODEL}" if report["action"] == "move" else "")
        + f", {report['max_batch']} per {report['batch_ms']:.0f} ms (fixed); {rates}, "
        f"{spec['paid_share']:.0%} paid, {spec['duration_s']:.0f} s"
    )
    answer = report["command_answer"]
    table.add_row(
        f"{report['operator_command']} {report['replica']} at {report['action_at_s']:.2f} s",
        f"answered {ms(report['command_answered_ms'])}: "
        + (f"{answer.get('state')} ({answer.get('model')})" if answer.get("ok") else str(answer.get("message"))),
        "",
    )
    states = " -> ".join(f"{s['state']} ({s['model']}) at {s['at_s']:.2f} s" for s in report["states_seen"])
    table.add_row("states seen", states or "-", "")
    took = report["time_to_done_s"]
    table.add_row(f"time to {report['done']}", "never" if took is None else f"{took:.2f} s", "")
    table.add_row("sent", str(report["sent"]), "")
    table.add_row("answered by status", counts(report["answered"]), "")
    table.add_row("lost (no HTTP answer)", f"{report['lost']} {counts(report['lost_by_error'])}".strip(), "0")
    table.add_row("failed (answered with an error)", str(report["failed"]), "0")
    table.add_row("answers with another request's id", str(report["duplicated"]), "0")
    for window, groups in report["windows"].items():
        for model, g in groups.items():
            table.add_row(
                f"{window}: {model}",
                f"{g['sent']} sent; {counts(g['statuses'])}; p50 {ms(g['p50_ms'])}, p99 {ms(g['p99_ms'])}",
                "",
            )
    d = report["deployment"]
    left = ", ".join(d["left_running"]) or "nothing"
    table.add_row("stop", f"exit {d['exit_code']} in {d['stop_s']:.1f} s; left running: {left}", "")
    verdict = "PASS" if report["ok"] else "FAIL: " + "; ".join(report["failed_reasons"])
    table.add_row("verdict", verdict, "lost 0, failed 0")
    print_table(table)
