"""A chaos run's report: the table printed, the JSON saved, the logs kept when it failed."""

from __future__ import annotations

import json

from control.bench.report import counts, figure_table, ms, print_table, settle_logs, without_logs
from control.chaos.analysis import FAST_503_MS


def finish(report: dict, json_path: str | None, keep_logs: bool = False) -> int:
    print_report(report)
    return save(report, json_path, keep_logs)


def save(report: dict, json_path: str | None, keep_logs: bool = False) -> int:
    """Save (without the logs' paths, which are this machine's), and keep the
    deployments' logs only when the run failed."""
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(without_logs(report), fh, indent=2)
    return 0 if settle_logs(report, keep_logs) else 1


def print_report(report: dict) -> None:
    spec = report["spec"]
    cells = f" in {spec['cells']} cells" if spec.get("cells", 1) > 1 else ""
    table = figure_table(
        f"keybatch chaos {report['scenario']}: {spec['replicas']} replicas{cells}, "
        f"{report['rps']:.0f} req/s ({spec['load']:.0%} of {report['capacity_rps']:.0f}), "
        f"{spec['paid_share']:.0%} paid, {spec['duration_s']:.0f} s"
    )
    for fault in report["faults"]:
        recover = "not recovered" if fault["recover_s"] is None else f"recovered in {fault['recover_s']:.1f} s"
        what = "; ".join(
            filter(None, [": ".join(filter(None, [fault["action"], ", ".join(fault["targets"])])), fault["note"]])
        )
        requeue = "" if fault["requeue_ms"] is None else f"; re-queued after {fault['requeue_ms']:.0f} ms"
        table.add_row(f"fault at {fault['at_s']:.2f} s", f"{what}{requeue}; {recover}", "")
    table.add_row("sent", str(report["sent"]), "")
    table.add_row("answered by status", counts(report["answered"]), "")
    table.add_row("lost (no HTTP answer)", f"{report['lost']} {counts(report['lost_by_error'])}".strip(), "0")
    wasted = "unknown" if report["wasted_results"] is None else f"{report['wasted_results']:.0f}"
    table.add_row("duplicated", f"{report['duplicated_answers']} answers; wasted results {wasted}", "0")
    if report["hung_up"]:
        table.add_row("hung up on purpose", str(report["hung_up"]), "")
    counters = report["server_counters"]
    table.add_row("gateway counters, delta", "unknown" if counters is None else counts(counters), "")
    recover = "not recovered" if report["recover_s"] is None else f"{report['recover_s']:.1f} s"
    table.add_row("time to recover (from the fault's end)", recover, "")
    table.add_row("pre-fault p99", ms(report["pre_fault_p99_ms"]), "")
    for name, title in (
        ("affected", "affected"),
        ("affected_with_budget", "  with a batch of budget left at the fault"),
        ("rest", "rest"),
    ):
        group = report[name]
        table.add_row(
            f"{title}: sent, statuses, p99", f"{group['sent']}; {counts(group['statuses'])}; {ms(group['p99_ms'])}", ""
        )
        table.add_row("  paid: statuses, p99", f"{counts(group['paid_statuses'])}; {ms(group['paid_p99_ms'])}", "")
    peer = report.get("peer")
    if peer:
        rate = f"{report['spec']['peer_load']:.0%} of {report['capacity_rps']:.0f}"
        table.add_row(
            f"peer region's own clients ({rate}): sent, statuses, p99",
            f"{peer['sent']}; {counts(peer['statuses'])}; {ms(peer['p99_ms'])}; lost {peer['lost']}, "
            f"duplicated {peer['duplicated']}",
            "",
        )
        table.add_row("  paid: statuses, p99", f"{counts(peer['paid_statuses'])}; {ms(peer['paid_p99_ms'])}", "")
    for cell, row in (report.get("cells") or {}).items():
        lost = " (its broker lost)" if row["lost_cell"] else ""
        table.add_row(
            f"cell {cell}{lost}: p99 before, during",
            f"{ms(row['p99_before_ms'])}, {ms(row['p99_during_ms'])} ({row['answered_200_during']} answered 200)",
            "",
        )
    s503 = report["status_503"]
    table.add_row("503s: count, p99", f"{s503['count']}; {ms(s503['p99_ms'])}", f"<= {FAST_503_MS:.0f} ms")
    if report["slowloris"]:
        table.add_row("slowloris", counts(report["slowloris"]), "")
    if report.get("idle_connections"):
        idle = report["idle_connections"]
        shown = {k: v for k, v in idle.items() if k not in ("outcomes", "paid_new_connection")}
        table.add_row("idle connections", counts(shown), "")
        table.add_row("  closed by the server", counts(idle["outcomes"]), "")
        probes = idle["paid_new_connection"]
        table.add_row(
            "  paid, each on a new connection",
            f"{probes['sent']}; {counts(probes['statuses'])}; p50 {ms(probes['p50_ms'])}, "
            f"p99 {ms(probes['p99_ms'])}, max {ms(probes['max_ms'])}",
            f"200 within {probes['budget_ms']:.0f} ms",
        )
    for d in report["deployments"]:
        left = ", ".join(d["left_running"]) or "nothing"
        table.add_row(f"stop ({d['name']})", f"exit {d['exit_code']} in {d['stop_s']:.1f} s; left running: {left}", "")
    verdict = "PASS" if report["ok"] else "FAIL: " + "; ".join(report["failed"])
    table.add_row("verdict", verdict, "lost 0, duplicated 0")
    print_table(table)
