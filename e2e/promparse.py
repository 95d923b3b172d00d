"""Read histogram sums and counts, and gauges and counters, out of Prometheus text exposition (SGLang's /metrics).

The KV transfer time per request comes from the prefill server's ``sglang:kv_transfer_latency_ms`` histogram
(SGLang observes it for every backend that subclasses its Common* classes: prefill's transfer-queue entry to
completion). A run's mean is the difference of two snapshots: (sum_after - sum_before) / (count_after - count_before).
"""
from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from typing import Iterator, Optional

KV_TRANSFER_LATENCY = "sglang:kv_transfer_latency_ms"
KV_TRANSFER_MB = "sglang:kv_transfer_total_mb"
#: a request's time in a scheduler's waiting queue until its first forward (SGLang observes the prefill's
#: waiting stage only here: its per-stage histogram leaves "prefill_waiting" out)
QUEUE_TIME = "sglang:queue_time_seconds"

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


@dataclass(frozen=True)
class HistogramTotals:
    sum: float
    count: float


def fetch(url: str, timeout: float = 5.0) -> Optional[str]:
    """A server's /metrics text; None when it does not answer within `timeout` (busy, dead or restarting: the
    caller counts a missing sample)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
            return r.read().decode(errors="replace")
    except Exception:  # noqa: BLE001 - any failure to read is a missing sample, never the caller's error
        return None


def _samples(text: str) -> Iterator[tuple[str, float]]:
    """(name, value) of every sample line, comments skipped."""
    for line in text.splitlines():
        if not line.startswith("#"):
            m = _SAMPLE.match(line)
            if m:
                yield m.group("name"), float(m.group("value"))


def sample_total(text: str, name: str) -> Optional[float]:
    """Sum of the samples named exactly ``name`` over all label sets (a gauge or counter, e.g. one per DP rank);
    None when the metric is absent, so a server that does not export it is not read as idle."""
    values = [v for n, v in _samples(text) if n == name]
    return sum(values) if values else None


def histogram_totals(text: str, name: str) -> Optional[HistogramTotals]:
    """Sum of ``name_sum`` and ``name_count`` over all label sets; None when the metric is absent."""
    s, c = sample_total(text, name + "_sum"), sample_total(text, name + "_count")
    return None if s is None and c is None else HistogramTotals(s or 0.0, c or 0.0)


_LABELED = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


def histogram_totals_by(text: str, name: str, label: str) -> dict[str, HistogramTotals]:
    """``name``'s sum and count per value of ``label``, summed over the other labels (e.g. SGLang's
    ``sglang:per_stage_req_latency_seconds`` per ``stage``, over DP ranks); empty when the metric is absent."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _LABELED.match(line)
        if not m or m.group("name") not in (name + "_sum", name + "_count"):
            continue
        labels = {x.group("key"): x.group("value") for x in _LABEL.finditer(m.group("labels"))}
        if label not in labels:
            continue
        acc = out.setdefault(labels[label], [0.0, 0.0])
        acc[0 if m.group("name").endswith("_sum") else 1] += float(m.group("value"))
    return {k: HistogramTotals(v[0], v[1]) for k, v in out.items()}


def total(parts: "list[Optional[HistogramTotals]]") -> Optional[HistogramTotals]:
    """Several servers' histograms as one (None when none of them has it)."""
    seen = [p for p in parts if p is not None]
    return HistogramTotals(sum(p.sum for p in seen), sum(p.count for p in seen)) if seen else None


def mean_between(before: Optional[HistogramTotals], after: Optional[HistogramTotals]) -> Optional[float]:
    """Mean of the observations made between two snapshots; None when nothing was observed."""
    if after is None:
        return None
    b = before or HistogramTotals(0.0, 0.0)
    n = after.count - b.count
    return (after.sum - b.sum) / n if n > 0 else None
