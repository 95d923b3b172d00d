"""`--decision-log PATH`: one JSON line per routing decision, with what the policy saw of every candidate.

A run's client figures say which LB was faster, the servers' gauges where requests waited; this says why ours
sent each request where it did (for instance which decode a burst went to, and the in-flight count and KV use
each decode showed at that moment). Off by default. Each line is one unbuffered write of a whole line, so
a killed LB leaves whole lines behind; with `--workers N` each server process writes `PATH.<index>`.

A line: `t` (Unix time), `tokens` (the prompt estimate), `p`/`p_rank`, `d`/`d_rank` (the choice), `p_tokens`
(the prefill work expected after a cache hit, null without one), `prefills` ([url, outstanding prompt tokens of
its least-loaded rank]) and `decodes` ([url, running requests of its least-loaded rank, KV use]).
"""

from __future__ import annotations

import time
from typing import Sequence

import orjson

from .policy import Choice, PairContext, decode_running, prefill_cost
from .workers import Worker


class DecisionLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "ab", buffering=0)  # noqa: SIM115 - held for the LB's life, closed by close()

    def record(self, choice: Choice, prefills: Sequence[Worker], decodes: Sequence[Worker], ctx: PairContext) -> None:
        line = {
            "t": round(time.time(), 4),
            "tokens": ctx.tokens,
            "p": choice.prefill.url,
            "p_rank": choice.prefill_rank,
            "d": choice.decode.url,
            "d_rank": choice.decode_rank,
            "p_tokens": choice.prefill_tokens,
            # the loads as the policies score them: a prefill's least-loaded rank, a decode's and its KV use
            "prefills": [[w.url, round(prefill_cost(w, ctx)[1], 1)] for w in prefills],
            "decodes": [[w.url, round(decode_running(w, ctx)[1], 1), round(w.kv_usage(ctx.poll_max_age), 4)] for w in decodes],
        }
        self._f.write(orjson.dumps(line) + b"\n")

    def close(self) -> None:
        self._f.close()
