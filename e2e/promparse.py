"""Read histogram sums and counts, and gauges and counters, out of Prometheus text exposition (SGLang's /metrics).

The KV transfer time per request comes from the prefill server's ``sglang:kv_transfer_latency_ms`` histogram
(SGLang observes it for every backend that subclasses its Common* classes: prefill's transfer-queue entry to
completion). A run's mean is the difference of two snapshots: (sum_after - sum_before) / (count_after - count_before).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

KV_TRANSFER_LATENCY = "sglang:kv_transfer_latency_ms"
KV_TRANSFER_MB = "sglang:kv_transfer_total_mb"

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


@dataclass(frozen=True)
class HistogramTotals:
    sum: float
    count: float


def histogram_totals(text: str, name: str) -> Optional[HistogramTotals]:
    """Sum of ``name_sum`` and ``name_count`` over all label sets; None when the metric is absent."""
    total = {"_sum": 0.0, "_count": 0.0}
    seen = False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or not m.group("name").startswith(name):
            continue
        suffix = m.group("name")[len(name):]
        if suffix in total:
            total[suffix] += float(m.group("value"))
            seen = True
    return HistogramTotals(total["_sum"], total["_count"]) if seen else None


def sample_total(text: str, name: str) -> Optional[float]:
    """Sum of the samples named exactly ``name`` over all label sets (a gauge or counter, e.g. one per DP rank);
    None when the metric is absent, so a server that does not export it is not read as idle."""
    out: Optional[float] = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m and m.group("name") == name:
            out = (out or 0.0) + float(m.group("value"))
    return out


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
