"""What a chaos run's records and counters show: lost and crossed answers, recovery after each
fault, the requests the faults caught against the rest."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict

from control.bench.report import outcome, timeline
from control.chaos.injection import Injection, Run
from control.chaos.spec import ChaosSpec
from control.core.settings import Settings
from control.core.vocab import PAID
from control.load.spec import Record
from control.load.summary import percentile

WINDOW_S = 1.0  # recovery is judged on windows of this length after the fault
P99_SLACK = 1.10  # ...whose p99 is within 10% of the pre-fault p99
FAST_503_MS = 100.0
CELL_WINDOW_S = 5.0  # cell-loss: each cell's p99 over this long from the fault's end, against before it
# The deployments run with the default settings: a request that names no budget gets this
# one, and a replica keeps this margin before a deadline.
DEFAULT_BUDGET_MS: float = Settings.model_fields["deadline_ms"].default
MARGIN_MS: float = Settings.model_fields["deadline_margin_ms"].default


# The gateway's counters the report shows as deltas over the load (summed over labels).
COUNTERS = {
    "keybatch_wasted_results_total": "wasted_results",
    "keybatch_cancels_total": "cancels",
    "keybatch_dropped_before_batch_total": "dropped_before_batch",
    "keybatch_hedged_answers_total": "hedged_answers",
    "keybatch_hedge_copies_wasted_total": "hedge_copies_wasted",
}


def read_counters(url: str) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None  # the gateway is gone: the figures are unknown, not zero
    values = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in text.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in COUNTERS:
            values[COUNTERS[name]] += float(line.rpartition(" ")[2])
    return values


def counters_delta(
    before: list[dict[str, float] | None], after: list[dict[str, float] | None]
) -> dict[str, float] | None:
    """What the deployments' counters moved by; None when a gateway could not be read.
    A counter that went down was reset (the wasted-results count lives in the broker,
    which a broker restart empties): what it counted since is the delta, a lower bound."""
    if any(v is None for v in [*before, *after]):
        return None
    pairs = [(a, b) for a, b in zip(after, before, strict=True) if a is not None and b is not None]
    return {key: sum(a[key] - b[key] if a[key] >= b[key] else a[key] for a, b in pairs) for key in COUNTERS.values()}


def _group(records: list[Record]) -> dict[str, object]:
    ok = [r.latency_ms for r in records if r.status == 200]
    paid = [r.latency_ms for r in records if r.status == 200 and r.tier == PAID]
    return {
        "sent": len(records),
        "statuses": dict(sorted(Counter(outcome(r) for r in records).items())),
        "p99_ms": percentile(ok, 99) if ok else None,
        "paid_p99_ms": percentile(paid, 99) if paid else None,
        "paid_statuses": dict(sorted(Counter(outcome(r) for r in records if r.tier == PAID).items())),
        "errors": dict(sorted(Counter(f"{r.status} {r.code}" for r in records if r.status not in (0, 200)).items())),
    }


def _healthy(window: list[Record], baseline_p99: float) -> bool:
    ok = [r.latency_ms for r in window if r.status == 200]
    return bool(ok) and all(r.status in (200, 429) for r in window) and percentile(ok, 99) <= P99_SLACK * baseline_p99


def recovery_s(records: list[Record], fault_s: float, until_s: float, baseline_p99: float | None) -> float | None:
    """Seconds from the fault to the start of the first whole window after it in which
    every request sent got 200 or 429 and the p99 is back near the pre-fault p99."""
    if baseline_p99 is None:
        return None
    start = fault_s
    while start + WINDOW_S <= until_s:
        window = [r for r in records if start <= r.sent_s < start + WINDOW_S and not r.hung_up]
        if _healthy(window, baseline_p99):
            return round(start - fault_s, 3)
        start += WINDOW_S
    return None


def _affected(records: list[Record], injections: list[Injection], ends: list[float]) -> set[int]:
    """In flight at a fault, or sent from it until recovery (or its window's end)."""
    hit = set()
    for injection, end in zip(injections, ends, strict=True):
        ended = injection.ended_s or injection.at_s
        until = ended + injection.recover_s if injection.recover_s is not None else end
        for i, r in enumerate(records):
            if (r.sent_s < injection.at_s < r.answered_s) or injection.at_s <= r.sent_s < until:
                hit.add(i)
    return hit


def short_of_a_batch(records: list[Record], injections: list[Injection], budget_ms: float, batch_ms: float) -> set[int]:
    """In flight at a fault with less than one batch (and the margin) of its budget left:
    no replica, here or in a peer region, can start it then and finish in time."""
    short = set()
    for injection in injections:
        for i, r in enumerate(records):
            if r.sent_s < injection.at_s < r.answered_s:
                if budget_ms - 1000.0 * (injection.at_s - r.sent_s) < batch_ms + MARGIN_MS:
                    short.add(i)
    return short


def analyze(
    spec: ChaosSpec,
    records: list[Record],
    run: Run,
    counters: dict[str, float] | None,
    peer_records: list[Record] | None = None,
) -> dict[str, object]:
    """`peer_records`: the peer region's own clients (`--peer-load`), judged lost and
    crossed as strictly as the rest, and summed apart."""
    injections = run.injections
    wasted = counters["wasted_results"] if counters is not None else None
    first = injections[0].at_s if injections else spec.duration_s
    before = [r.latency_ms for r in records if r.sent_s < first and r.status == 200]
    baseline = percentile(before, 99) if before else None
    ends = [nxt.at_s for nxt in injections[1:]] + [spec.duration_s]
    for injection, end in zip(injections, ends, strict=True):  # from the fault's end, if it lasts
        injection.recover_s = recovery_s(records, injection.ended_s or injection.at_s, end, baseline)
    hit = _affected(records, injections, ends)
    short = short_of_a_batch(records, injections, spec.deadline_ms or DEFAULT_BUDGET_MS, run.batch_ms)
    lost, crossed = _lost_and_crossed(records)
    # Wasted results (a copy run for a request answered already, or for a client that was
    # answered 503 or hung up) cost model time but reach no client: reported, not failed.
    peer = peer_records or []
    peer_lost, peer_crossed = _lost_and_crossed(peer)
    failed = _verdict(len(lost) + len(peer_lost), crossed + peer_crossed)
    probes = run.idle["paid_new_connection"] if run.idle else None
    if isinstance(probes, dict) and probes["over_budget"]:
        failed.append(f"{probes['over_budget']} paid requests on new connections not answered 200 within budget")
    s503 = [r.latency_ms for r in records if r.status == 503]
    recovered = [i.recover_s for i in injections]
    return {
        "sent": len(records),
        "answered": dict(sorted(Counter(str(r.status) for r in records if r.status).items())),
        "lost": len(lost),
        "lost_by_error": dict(Counter(r.error for r in lost)),
        "hung_up": sum(r.hung_up for r in records),
        "duplicated": crossed,
        "duplicated_answers": crossed,
        "wasted_results": wasted,
        "server_counters": counters,
        "faults": [asdict(i) for i in injections],
        "recover_s": None if not recovered or None in recovered else max(r for r in recovered if r is not None),
        "requeue_ms_median": _median([i.requeue_ms for i in injections if i.requeue_ms is not None]),
        "pre_fault_p99_ms": baseline,
        "affected": _group([r for i, r in enumerate(records) if i in hit]),
        # Those of them with at least one batch of their budget left at the fault.
        "affected_with_budget": _group([r for i, r in enumerate(records) if i in hit and i not in short]),
        "rest": _group([r for i, r in enumerate(records) if i not in hit]),
        "peer": {**_group(peer), "lost": len(peer_lost), "duplicated": peer_crossed} if peer_records else None,
        "status_503": {
            "count": len(s503),
            "p99_ms": percentile(s503, 99) if s503 else None,
            f"over_{FAST_503_MS:.0f}ms": sum(t > FAST_503_MS for t in s503),
        },
        "slowloris": run.slowloris,
        "idle_connections": run.idle,
        "cells": _cells(records, injections) if spec.cells > 1 else None,
        "timeline": timeline(records, spec.duration_s, _group),
        "failed": failed,
        "ok": not failed,
    }


def _cells(records: list[Record], injections: list[Injection]) -> dict[str, dict[str, object]]:
    """Per cell that answered: the p99 of its 200s sent before the first fault, and of
    those sent from each fault until `CELL_WINDOW_S` after its end (a request a silent
    cell's gateway moved counts for the cell that answered it)."""
    first = injections[0].at_s if injections else float("inf")
    out: dict[str, dict[str, object]] = {}
    for cell in sorted({r.cell for r in records if r.status == 200 and r.cell >= 0}):
        ok = [r for r in records if r.status == 200 and r.cell == cell]
        before = [r.latency_ms for r in ok if r.sent_s < first]
        during = [
            r.latency_ms for r in ok for i in injections if i.at_s <= r.sent_s < (i.ended_s or i.at_s) + CELL_WINDOW_S
        ]
        out[str(cell)] = {
            "lost_cell": any(i.cell == cell for i in injections),
            "answered_200": len(ok),
            "p99_before_ms": percentile(before, 99) if before else None,
            "p99_during_ms": percentile(during, 99) if during else None,
            "answered_200_during": len(during),
        }
    return out


def _lost_and_crossed(records: list[Record]) -> tuple[list[Record], int]:
    """The requests no HTTP answer reached (not hung up on purpose), and how many 200s
    carried another request's id: a reply routed to the wrong client, or a second answer
    to an earlier request read off a reused connection."""
    lost = [r for r in records if r.status == 0 and not r.hung_up]
    return lost, sum(1 for r in records if r.status == 200 and r.id and r.answer_id != r.id)


def _median(values: list[float]) -> float | None:
    return percentile(values, 50) if values else None


def _verdict(lost: int, crossed: int) -> list[str]:
    """Why the run fails, if it does: lost == 0 and duplicated == 0 must both be shown."""
    reasons = []
    if lost:
        reasons.append(f"{lost} requests lost")
    if crossed:
        reasons.append(f"{crossed} answers carried another request's id")
    return reasons
