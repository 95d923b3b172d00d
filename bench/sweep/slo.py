"""Service-level objectives and goodput.

A request is *good* when it succeeded, its TTFT is within the TTFT SLO and its mean inter-token latency
(= TPOT, (e2e - ttft) / (output_tokens - 1)) is within the ITL SLO.  Goodput is what the good requests
delivered per second of the run: requests/s and output tokens/s.  Defaults are the source material's SLOs:
TTFT < 2 s, ITL < 50 ms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    itl_s: float = 0.050


@dataclass(frozen=True)
class RequestSample:
    """One request as both tools report it; None when the tool did not record the value."""

    ok: bool
    ttft_s: float | None
    itl_s: float | None  # mean inter-token latency of the request (TPOT)
    output_tokens: int


@dataclass(frozen=True)
class Goodput:
    attainment: float  # fraction of all requests that met the SLOs
    requests_per_s: float
    output_tokens_per_s: float


def is_good(r: RequestSample, slo: Slo) -> bool:
    if not r.ok or r.ttft_s is None:
        return False
    # a one-token answer has no inter-token latency: only TTFT applies
    itl_ok = r.output_tokens <= 1 or (r.itl_s is not None and r.itl_s <= slo.itl_s)
    return r.ttft_s <= slo.ttft_s and itl_ok


def goodput(samples: Iterable[RequestSample], duration_s: float, slo: Slo) -> Goodput:
    samples = list(samples)
    if not samples or duration_s <= 0:
        return Goodput(0.0, 0.0, 0.0)
    good = [s for s in samples if is_good(s, slo)]
    return Goodput(
        attainment=len(good) / len(samples),
        requests_per_s=len(good) / duration_s,
        output_tokens_per_s=sum(s.output_tokens for s in good) / duration_s,
    )
