"""A load run's report on the terminal (tables) and as a picture (latency, rate and errors over time)."""

from __future__ import annotations

import math
import textwrap
from typing import Any


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


def print_statuses(summary: dict[str, dict[str, Any]]) -> None:
    """Each row's answers by status and error code (429 tenant_queue_full apart from overloaded)."""
    for name, row in summary.items():
        print(f"{name}: " + ", ".join(f"{k}: {v}" for k, v in row["codes"].items()))
