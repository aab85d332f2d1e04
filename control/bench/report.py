"""What a fault, operations or benchmark run prints and stores: the figure table, the
formatting of its cells, per-second timelines, and the logs a failed run keeps."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

    from control.load.spec import Record


def figure_table(title: str) -> Table:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value")
    table.add_column("target", justify="right")
    return table


def print_table(table: Table) -> None:
    from rich.console import Console

    Console(width=160).print(table)


def counts(counted: Mapping[str, Any]) -> str:
    """`a: 1, b: 2`, in the mapping's order."""
    return ", ".join(f"{k}: {v}" for k, v in counted.items())


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def outcome(r: Record) -> str:
    """What a client got: its status, the error that stood for one, or a hang-up of its own."""
    if r.hung_up:
        return "hung up"
    return str(r.status) if r.status else (r.error or "no answer")


def timeline(
    records: list[Record], duration_s: float, group: Callable[[list[Record]], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per second of sending: what the requests sent in it got, as `group` sums them up."""
    seconds: list[list[Record]] = [[] for _ in range(int(duration_s + 0.999))]
    for r in records:
        seconds[min(len(seconds) - 1, int(r.sent_s))].append(r)
    return [{"second": i, **group(rs)} for i, rs in enumerate(seconds)]


def without_logs(report: dict) -> dict:
    """A report as it is written: the logs' paths are this machine's, named on stderr, not stored."""
    return {k: v for k, v in report.items() if k != "logs"}


def settle_logs(report: dict, keep: bool = False) -> bool:
    """Keep the deployments' logs of a failed run (named on stderr), delete a passed one's
    unless `keep`; whether it passed."""
    if keep or not report["ok"]:
        print(f"logs kept: {', '.join(report['logs'])}", file=sys.stderr)
        return bool(report["ok"])
    for path in report["logs"]:
        os.unlink(path)
    return True


def write_sim_figures(path: str, args: Any, **figures: Any) -> None:
    """A simulator bench's figures as JSON: today's date, the checkout's commit and the
    command's arguments first."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"date": str(datetime.date.today()), "commit": commit, "args": vars(args), **figures}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
