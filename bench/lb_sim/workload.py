"""Deterministic LB-benchmark workload: skewed prompt lengths and bursty arrivals (pure, seeded)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the start
    words: int  # prompt length; the simulator counts one token per word
    max_new_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    duration: float = 40.0
    short_median: int = 300  # most prompts: lognormal around this
    short_sigma: float = 0.6
    long_frac: float = 0.15  # the rest: long documents, uniform in [long_min, long_max]
    long_min: int = 3000
    long_max: int = 8000
    max_new_tokens: int = 8
    burst_factor: float = 3.0  # arrival rate during a burst, relative to the calm rate
    burst_frac: float = 0.25  # share of time spent in bursts
    period: float = 4.0  # one calm + burst cycle, seconds


def mean_prompt(spec: WorkloadSpec) -> float:
    short = spec.short_median * math.exp(spec.short_sigma**2 / 2)
    return (1 - spec.long_frac) * short + spec.long_frac * (spec.long_min + spec.long_max) / 2


def generate(spec: WorkloadSpec, rate: float, seed: int = 0) -> list[Request]:
    """Poisson arrivals whose rate alternates calm/burst with mean `rate` req/s over a cycle."""
    rng = random.Random(seed)
    # calm rate c, burst rate b*c: mean = c*(1-f) + b*c*f
    calm = rate / ((1 - spec.burst_frac) + spec.burst_factor * spec.burst_frac)
    out, t = [], 0.0
    while True:
        phase = (t % spec.period) / spec.period
        r = calm * (spec.burst_factor if phase >= 1 - spec.burst_frac else 1.0)
        t += rng.expovariate(r)
        if t >= spec.duration:
            return out
        if rng.random() < spec.long_frac:
            words = rng.randint(spec.long_min, spec.long_max)
        else:
            words = max(1, int(rng.lognormvariate(math.log(spec.short_median), spec.short_sigma)))
        out.append(Request(t, words, spec.max_new_tokens))


def prompt_text(words: int, rng: random.Random) -> str:
    # words of 1-7 letters: the simulator counts words, routers that estimate from bytes see ~5 bytes/word
    return " ".join("abcdefg"[: rng.randint(1, 7)] for _ in range(words))
