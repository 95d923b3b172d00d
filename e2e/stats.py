"""Latency and throughput figures of one load run (closed loop, fixed concurrency)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class RequestRecord:
    ok: bool
    ttft_s: Optional[float]  # request sent -> first token seen by the client
    e2e_s: Optional[float]
    output_tokens: int
    error: str = ""


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x * 1e3, 3)


def summarize_run(records: Sequence[RequestRecord], duration_s: float) -> dict[str, object]:
    """TTFT p50/p99 and mean (ms), end-to-end p50 (ms), output and request throughput (per second of the run).

    Failed requests count in num_failed and nowhere else; throughput is successful output tokens / wall time.
    """
    good = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in good if r.ttft_s is not None]
    e2e = [r.e2e_s for r in good if r.e2e_s is not None]
    out_tokens = sum(r.output_tokens for r in good)
    errors = sorted({r.error for r in records if not r.ok and r.error})
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(good),
        "duration_s": round(duration_s, 3),
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "ttft_ms_mean": _ms(sum(ttft) / len(ttft)) if ttft else None,
        "e2e_ms_p50": _ms(percentile(e2e, 50)),
        "output_tokens": out_tokens,
        "output_throughput": round(out_tokens / duration_s, 2) if duration_s > 0 else None,
        "request_throughput": round(len(good) / duration_s, 3) if duration_s > 0 else None,
        "errors": errors[:5],
    }
