"""Prometheus metrics of the gateway.

One process: its own registry. Several (gunicorn workers): each writes its values
to prometheus-client's multiprocess files, and /metrics sums them.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.errors import ApiError
from control.broker.registry import FleetViews
from control.broker.traffic import read_traffic
from control.core.settings import Settings

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 2.0, 5.0)
_OVERHEAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)


class Metrics:
    def __init__(self, fleet: FleetViews) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "keybatch_requests",
            "Completion requests answered, by status code",
            ["model", "tier", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "keybatch_e2e_request_latency_seconds",
            "End-to-end time inside the gateway for answered completions",
            ["model", "tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "keybatch_request_queue_time_seconds",
            "Time from admission to the start of the batch (or the engine step) that ran the request",
            ["model", "tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "keybatch_time_to_first_token_seconds",
            "Time from admission to the first streamed text",
            ["model", "tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "keybatch_overhead_seconds",
            "End-to-end time minus time inside the batch",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "keybatch_batch_size",
            "Batch size seen by answered requests",
            buckets=(1, 2, 4, 8, 16, 32, 48, 56, 64, 128),
            registry=r,
        )
        self.rejected = Counter(
            "keybatch_admission_rejected",
            "Requests refused at admission",
            ["model", "tier", "reason"],
            registry=r,
        )
        self.cancels = Counter(
            "keybatch_cancels",
            "Cancels and supersedes received",
            ["reason"],
            registry=r,
        )
        self.dropped = Counter(
            "keybatch_dropped_before_batch",
            "Requests a replica dropped before their batch ran (no batch slot taken)",
            ["reason"],
            registry=r,
        )
        self.hedged_answers = Counter(
            "keybatch_hedged_answers",
            "Requests answered by a second copy (a hedge) run in another batch's empty slot",
            ["model", "tier"],
            registry=r,
        )
        self.reused = Counter(
            "keybatch_reused_answers",
            "Requests answered with the rest of their session's last completion (typed through), without the model",
            ["model", "tier"],
            registry=r,
        )
        self.moved = Counter(
            "keybatch_requests_moved",
            "Waiting requests sent to another cell while their own cell's broker did not answer",
            registry=r,
        )
        self.inflight = Gauge(
            "keybatch_inflight", "Requests waiting in the gateway", registry=r, multiprocess_mode="livesum"
        )
        self._children: dict[tuple[object, ...], Any] = {}
        # What /metrics shows: this registry, or the sum of every process's files.
        self.exposition = r
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.exposition = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposition)
        self.exposition.register(_FleetCollector(fleet))

    def of(self, metric: Counter | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: prometheus-client checks and converts the
        labels and takes a lock on every call (the labels are few: configured models,
        tiers, statuses, reasons)."""
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


def _engine_families(fleet: FleetViews) -> Iterator[GaugeMetricFamily]:
    """Each engine counter a replica publishes, and the prefix cache's hit rate."""
    families: dict[str, GaugeMetricFamily] = {}
    hit_rate = GaugeMetricFamily(
        "keybatch_prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache / prompt tokens looked up, since the replica started",
        labels=["replica", "model"],
    )
    for rep in fleet.replicas:
        labels = [rep.name, rep.model]
        for key, value in sorted(rep.engine.items()):
            if key not in families:
                families[key] = GaugeMetricFamily(
                    f"keybatch_engine_{key}", f"The engine's {key.replace('_', ' ')}", labels=["replica", "model"]
                )
            families[key].add_metric(labels, value)
        queried = rep.engine.get("prefix_query_tokens", 0.0)
        if queried:
            hit_rate.add_metric(labels, rep.engine.get("prefix_hit_tokens", 0.0) / queried)
    yield from families.values()
    yield hit_rate


def _queue_families(fleet: FleetViews) -> Iterator[GaugeMetricFamily]:
    """Queue depth and the oldest waiting request per model and tier, read off every cell's
    broker at scrape time (the whole deployment, not this process)."""
    waiting = GaugeMetricFamily(
        "keybatch_num_requests_waiting", "Requests admitted and not yet in a batch", labels=["model", "tier"]
    )
    oldest = GaugeMetricFamily(
        "keybatch_oldest_waiting_seconds", "Age of the oldest request in the queue", labels=["model", "tier"]
    )
    models = sorted({rep.model for rep in fleet.replicas})
    clients = [view.client for view in fleet.views]
    try:
        rows = read_traffic(clients, models, window_s=1) if models else []
    except Exception:  # a scrape must answer even while a broker does not
        rows = []
    for row in rows:
        waiting.add_metric([row.model, row.tier], row.num_queued)
        oldest.add_metric([row.model, row.tier], row.oldest_ms / 1000)
    yield from (waiting, oldest)


class _FleetCollector(Collector):
    """Replica figures from the registry the gateway already keeps a copy of."""

    def __init__(self, fleet: FleetViews) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily("keybatch_replica_ready", "1 if the replica takes work", labels=["replica", "model"])
        batches = GaugeMetricFamily(
            "keybatch_replica_batches", "Batches run by the replica", labels=["replica", "model"]
        )
        served = GaugeMetricFamily(
            "keybatch_replica_requests", "Requests run by the replica", labels=["replica", "model"]
        )
        buffered = GaugeMetricFamily(
            "keybatch_replica_buffered", "Requests in the replica's buffer", labels=["replica", "model"]
        )
        dropped = GaugeMetricFamily(
            "keybatch_replica_dropped",
            "Requests the replica dropped before a batch",
            labels=["replica", "model", "reason"],
        )
        running = GaugeMetricFamily(
            "keybatch_num_requests_running",
            "Requests a replica holds: buffered for its next batch, or running (slots in use on a continuous engine)",
            labels=["replica", "model"],
        )
        batch_now = GaugeMetricFamily(
            "keybatch_batch_current_size", "Size of the replica's last batch (running requests at its last step)",
            labels=["replica", "model"],
        )  # fmt: skip
        duration = GaugeMetricFamily(
            "keybatch_batch_duration_seconds",
            "A batch (static) or an engine step (continuous) on the replica, recent quantiles",
            labels=["replica", "model", "quantile"],
        )
        utilization = GaugeMetricFamily(
            "keybatch_replica_utilization",
            "Share of the last 10 s the replica's engine spent running batches or steps (its duty cycle)",
            labels=["replica", "model"],
        )
        duty = GaugeMetricFamily(
            "keybatch_replica_duty_cycle",
            "The engine's busy time over wall time in the last 10 s (the same figure as keybatch_replica_utilization)",
            labels=["replica", "model"],
        )
        cycle = GaugeMetricFamily(
            "keybatch_replica_cycle_seconds",
            "A batch slot's measured time on the replica (median of recent ones): what admission predicts with",
            labels=["replica", "model"],
        )
        wasted_slots = CounterMetricFamily(
            "keybatch_wasted_slots",
            "Batch slots spent on requests whose client had gone (cancelled, superseded, hung up, expired)",
            labels=["replica", "model"],
        )
        wasted_seconds = CounterMetricFamily(
            "keybatch_wasted_model_seconds",
            "Model time spent on requests whose client had gone (each request's share of its batches or steps)",
            labels=["replica", "model"],
        )
        hedged = CounterMetricFamily(
            "keybatch_hedged",
            "Second copies (hedges) run in a static batch's empty slots, of requests another host runs or holds",
            labels=["replica", "model"],
        )
        hedge_wins = CounterMetricFamily(
            "keybatch_hedge_wins", "Second copies that answered their request first", labels=["replica", "model"]
        )
        hedge_wasted = CounterMetricFamily(
            "keybatch_hedge_wasted_slots",
            "Second copies whose request was answered first (or had gone): slots that cost nothing more",
            labels=["replica", "model"],
        )
        for rep in self.fleet.replicas:
            labels = [rep.name, rep.model]
            hedged.add_metric(labels, rep.hedged)
            hedge_wins.add_metric(labels, rep.hedge_wins)
            hedge_wasted.add_metric(labels, rep.hedge_wasted)
            ready.add_metric(labels, float(rep.is_ready))
            batches.add_metric(labels, rep.num_batches)
            served.add_metric(labels, rep.num_requests)
            buffered.add_metric(labels, rep.buffered)
            for reason, n in rep.dropped.items():
                dropped.add_metric([*labels, reason], n)
            running.add_metric(labels, rep.num_held)
            batch_now.add_metric(labels, rep.last_batch_size)
            duration.add_metric([*labels, "0.5"], rep.batch_p50_ms / 1000)
            duration.add_metric([*labels, "0.99"], rep.batch_p99_ms / 1000)
            utilization.add_metric(labels, rep.utilization)
            duty.add_metric(labels, rep.utilization)
            cycle.add_metric(labels, rep.cycle_ms / 1000)
            wasted_slots.add_metric(labels, rep.wasted_slots)
            wasted_seconds.add_metric(labels, rep.wasted_ms / 1000)
        yield from (running, batch_now, duration, utilization, duty, cycle, wasted_slots, wasted_seconds)
        yield from (hedged, hedge_wins, hedge_wasted)
        yield from _queue_families(self.fleet)
        yield from _engine_families(self.fleet)
        wasted = CounterMetricFamily(
            "keybatch_wasted_results",
            "Results run for a request already answered (a re-queued copy) or whose client had gone",
            value=self.fleet.num_wasted,
        )
        copies_wasted = CounterMetricFamily(
            "keybatch_hedge_copies_wasted",
            "Second copies (hedges) run for a request answered first by its own run, cancelled or expired, "
            "whole deployment (kept in the broker: a replica's restart does not reset it)",
            value=self.fleet.num_hedge_wasted,
        )
        yield from (ready, batches, served, buffered, dropped, wasted, copies_wasted)


def scrape_allowed(settings: Settings, authorization: str | None) -> bool:
    """Whether this caller may read operator data (/metrics, the detail of /readyz): with a
    scrape token set, the token; without one, anyone while anonymous access is on."""
    if settings.metrics_token is None:
        return settings.allow_anonymous
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(
        token.strip().encode(), settings.metrics_token.encode()
    )


def check_scrape(settings: Settings, authorization: str | None) -> None:
    if scrape_allowed(settings, authorization):
        return
    if settings.metrics_token is None:
        raise ApiError(
            401,
            "/metrics needs a scrape token (KEYBATCH_METRICS_TOKEN) when anonymous access is off",
            "missing_scrape_token",
        )
    raise ApiError(401, "a valid scrape token is required (Authorization: Bearer TOKEN)", "invalid_scrape_token")
