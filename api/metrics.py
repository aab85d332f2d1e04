"""Prometheus metrics of the gateway.

One process: its own registry. Several (gunicorn workers): each writes its values
to prometheus-client's multiprocess files, and /metrics sums them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from control.fleet import FleetView

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 2.0, 5.0)
_OVERHEAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)


class Metrics:
    def __init__(self, fleet: FleetView) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "keybatch_requests",
            "Completion requests answered, by status code",
            ["model", "tier", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "keybatch_request_seconds",
            "End-to-end time inside the gateway for answered completions",
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
        self.inflight = Gauge(
            "keybatch_inflight", "Requests waiting in the gateway", registry=r, multiprocess_mode="livesum"
        )
        # What /metrics shows: this registry, or the sum of every process's files.
        self.exposition = r
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.exposition = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposition)
        self.exposition.register(_FleetCollector(fleet))


def _engine_families(fleet: FleetView) -> Iterator[GaugeMetricFamily]:
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


class _FleetCollector(Collector):
    """Replica figures from the registry the gateway already keeps a copy of."""

    def __init__(self, fleet: FleetView) -> None:
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
        for rep in self.fleet.replicas:
            labels = [rep.name, rep.model]
            ready.add_metric(labels, float(rep.is_ready))
            batches.add_metric(labels, rep.num_batches)
            served.add_metric(labels, rep.num_requests)
            buffered.add_metric(labels, rep.buffered)
            for reason, n in rep.dropped.items():
                dropped.add_metric([*labels, reason], n)
        yield from _engine_families(self.fleet)
        wasted = CounterMetricFamily(
            "keybatch_wasted_results",
            "Results run for a request already answered (a re-queued copy) or whose client had gone",
            value=self.fleet.num_wasted,
        )
        yield from (ready, batches, served, buffered, dropped, wasted)
