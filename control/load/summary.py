"""A load run's figures: per tier and model, per window of sending time, and when p99 came within the SLO."""

from __future__ import annotations

import math
from typing import Any

from control.core.vocab import FREE, PAID
from control.load.spec import LoadSpec, Record


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def summarize(records: list[Record], duration_s: float | None = None) -> dict[str, dict[str, Any]]:
    """Figures per tier and for all requests. A superseded request (409 `superseded`: a newer
    one of its typing session took its place) is counted apart, not as an error: `ok_share`
    is the share of the others answered 200. Rates are over `duration_s` (default: until the
    last answer)."""
    out: dict[str, dict[str, Any]] = {}
    tiers = sorted({r.tier for r in records}, key=lambda t: (t != PAID, t != FREE, t))
    for tier in ("all", *tiers):
        rs = [r for r in records if tier == "all" or r.tier == tier]
        if not rs:
            continue
        ok = [r for r in rs if r.status == 200]
        shed = [r for r in rs if r.status == 429]
        superseded = sum(r.is_superseded for r in rs)
        seconds = duration_s or max(1e-9, max(r.answered_s for r in rs))
        out[tier] = {
            "sent": len(rs),
            "ok_share": len(ok) / max(1, len(rs) - superseded),
            "status_429": len(shed),
            "status_504": sum(r.status == 504 for r in rs),
            "superseded": superseded,
            "other": sum(r.status not in (200, 429, 504) and not r.is_superseded for r in rs),
            "no_answer": sum(r.status == 0 for r in rs),
            "statuses": _outcomes(rs),
            "codes": _codes(rs),
            "sent_rps": len(rs) / seconds,
            "ok_rps": len(ok) / seconds,
            "p50_ms": percentile([r.latency_ms for r in ok], 50),
            "p90_ms": percentile([r.latency_ms for r in ok], 90),
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


def _codes(records: list[Record]) -> dict[str, int]:
    """Answers by status and, for errors, their code ("429 tenant_queue_full")."""
    counts: dict[str, int] = {}
    for r in records:
        name = f"{r.status} {r.code}" if r.status not in (0, 200) and r.code else r.outcome
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _outcomes(records: list[Record]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return dict(sorted(counts.items()))


def by_model(records: list[Record], duration_s: float | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """`summarize` for each model's requests."""
    models = sorted({r.model for r in records})
    return {m: summarize([r for r in records if r.model == m], duration_s) for m in models}


def windows(records: list[Record], window_s: float, duration_s: float, key: str = "model") -> dict[str, list[dict]]:
    """Per model (key="model") or tier (key="tier"), and "all": one row per `window_s` of
    sending time: what was sent then and how it was answered (p50/p99 of its 200s)."""
    num = max(1, math.ceil(duration_s / window_s - 1e-9))
    groups: dict[str, list[list[Record]]] = {"all": [[] for _ in range(num)]}
    for r in records:
        k = min(num - 1, int(r.sent_s / window_s))
        groups["all"][k].append(r)
        groups.setdefault(getattr(r, key), [[] for _ in range(num)])[k].append(r)
    return {name: [_window(k * window_s, window_s, rs) for k, rs in enumerate(rows)] for name, rows in groups.items()}


def _window(start_s: float, window_s: float, rs: list[Record]) -> dict[str, Any]:
    ok = [r.latency_ms for r in rs if r.status == 200]
    return {
        "start_s": round(start_s, 3),
        "sent": len(rs),
        "offered_rps": len(rs) / window_s,
        "ok": len(ok),
        "p50_ms": percentile(ok, 50) if ok else None,
        "p99_ms": percentile(ok, 99) if ok else None,
        "status_429": sum(r.status == 429 for r in rs),
        "status_504": sum(r.status == 504 for r in rs),
        "superseded": sum(r.is_superseded for r in rs),
        "other": sum(r.status not in (0, 200, 429, 504) and not r.is_superseded for r in rs),
        "no_answer": sum(r.status == 0 for r in rs),
    }


def under_slo_from(rows: list[dict], slo_ms: float) -> float | None:
    """The start of the window from which every later window with requests had its p99 within
    `slo_ms` (and some 200s); None if the last such window missed it."""
    since: float | None = 0.0
    for row in rows:
        if row["sent"] == 0:
            continue
        missed = row["p99_ms"] is None or row["p99_ms"] > slo_ms
        if missed:
            since = None
        elif since is None:
            since = row["start_s"]
    return since


def report(spec: LoadSpec, records: list[Record], window_s: float = 5.0, slo_ms: float | None = None) -> dict[str, Any]:
    """What `keybatch load --json` writes, less the records."""
    per_model = windows(records, window_s, spec.duration_s, "model")
    per_tier = windows(records, window_s, spec.duration_s, "tier")
    by_window = {"window_s": window_s, "by_model": per_model, "by_tier": per_tier}
    out: dict[str, Any] = {
        "summary": summarize(records, spec.duration_s),
        "by_model": by_model(records, spec.duration_s),
        "windows": by_window,
    }
    if slo_ms is not None:
        out["slo"] = {
            "slo_ms": slo_ms,
            "p99_under_slo_from_s": {m: under_slo_from(rows, slo_ms) for m, rows in per_model.items()},
        }
    return out
