"""Prometheus metrics for `/metrics`: request counters and latency histograms, plus per-worker gauges
read from the pool at scrape time (so the request path never updates a gauge)."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess as prom_multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .workers import WorkerPool

PREFIX = "sglang_p2p_lb"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["role", "url"]
        healthy = GaugeMetricFamily(f"{PREFIX}_worker_healthy", "1 if the worker is routable, 0 if ejected", labels=labels)
        degraded = GaugeMetricFamily(f"{PREFIX}_worker_degraded", "1 if the worker fails its checks but is kept in rotation as the last of its role", labels=labels)
        reqs = GaugeMetricFamily(f"{PREFIX}_worker_inflight_requests", "Requests this LB has in flight on the worker", labels=labels)
        toks = GaugeMetricFamily(f"{PREFIX}_worker_outstanding_tokens", "Prompt tokens this LB has in flight on the worker", labels=labels)
        sel = GaugeMetricFamily(f"{PREFIX}_worker_selected", "Times the worker was picked", labels=labels)
        for w in self.pool:
            lv = [w.role, w.url]
            healthy.add_metric(lv, 1.0 if w.healthy else 0.0)
            degraded.add_metric(lv, 1.0 if w.degraded else 0.0)
            reqs.add_metric(lv, sum(w.inflight_reqs))
            toks.add_metric(lv, sum(w.inflight_tokens))
            sel.add_metric(lv, w.selected)
        return [healthy, degraded, reqs, toks, sel]


class Metrics:
    def __init__(self, pool: WorkerPool, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Client requests by route and final status", ["route", "status"], registry=r)
        self.duration = Histogram(f"{PREFIX}_request_duration_seconds", "Client request duration", ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram(f"{PREFIX}_time_to_first_byte_seconds", "Arrival to first response byte sent (streamed requests: TTFT)", ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.retries = Counter(f"{PREFIX}_retries", "Attempts retried on another pair, by the side that failed", ["side"], registry=r)
        self.upstream_errors = Counter(f"{PREFIX}_upstream_errors", "Failed legs by side and reason", ["side", "reason"], registry=r)
        self.disconnects = Counter(f"{PREFIX}_client_disconnects", "Clients that went away before the answer ended", registry=r)
        self.rejected = Counter(f"{PREFIX}_rejected", "Requests refused by the LB itself", ["reason"], registry=r)
        self.health_checks = Counter(f"{PREFIX}_health_checks", "Active health checks", ["role", "result"], registry=r)
        self.inflight = Gauge(f"{PREFIX}_inflight_requests", "Client requests being served", registry=r, multiprocess_mode="livesum")
        self.last_resort = Counter(f"{PREFIX}_last_resort", "Dispatches to ejected workers because no worker of the role was routable", ["role"], registry=r)
        self.ejections = Counter(f"{PREFIX}_worker_ejections", "Workers ejected after repeated failures", ["role"], registry=r)
        self._pool_collector = _PoolCollector(pool)
        r.register(self._pool_collector)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        # every process's files (this one's included) plus this process's view of the pool
        merged = CollectorRegistry()
        prom_multiprocess.MultiProcessCollector(merged)
        merged.register(self._pool_collector)
        return generate_latest(merged)
