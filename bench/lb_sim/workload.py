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


@dataclass(frozen=True)
class SharedPrefixSpec:
    """Multi-turn chats over a few long few-shot / system prompts: most tokens of a request were seen before."""

    duration: float = 40.0
    n_prefixes: int = 12  # distinct system / few-shot prompts, chosen with Zipf-like weights 1/(k+1)
    prefix_words: int = 1500
    turns: int = 4  # turns per conversation; each resends the whole history
    question_words: int = 60
    answer_words: int = 40  # the assistant's reply, appended to the history for the next turn
    turn_gap: float = 3.0  # seconds between two turns of one conversation
    max_new_tokens: int = 8


@dataclass(frozen=True)
class ChatTurn:
    at: float
    text: str
    conversation: int
    turn: int


def mean_shared_prefix_prompt(spec: SharedPrefixSpec) -> float:
    per_turn = spec.question_words + spec.answer_words
    return spec.prefix_words + spec.question_words + per_turn * (spec.turns - 1) / 2


def shared_prefix(spec: SharedPrefixSpec, conversations_per_s: float, seed: int = 0) -> list[ChatTurn]:
    """Poisson conversation starts; turn t of a conversation comes t * turn_gap later (open loop, seeded)."""
    rng = random.Random(seed)
    prefixes = [prompt_text(spec.prefix_words, random.Random(seed * 1000 + k)) for k in range(spec.n_prefixes)]
    weights = [1.0 / (k + 1) for k in range(spec.n_prefixes)]
    out: list[ChatTurn] = []
    t, conv = 0.0, 0
    while True:
        t += rng.expovariate(conversations_per_s)
        if t >= spec.duration:
            return sorted(out, key=lambda r: r.at)
        history = prefixes[rng.choices(range(spec.n_prefixes), weights)[0]]
        for turn in range(spec.turns):
            at = t + turn * spec.turn_gap
            if at >= spec.duration:
                break
            history += " " + prompt_text(spec.question_words, rng)
            out.append(ChatTurn(at, history, conv, turn))
            history += " " + prompt_text(spec.answer_words, rng)
        conv += 1
