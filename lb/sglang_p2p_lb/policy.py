"""Pair-selection policies: pure scoring over the workers' load numbers, no I/O.

`load_aware` (default) scores prefill and decode candidates by load, then scores the *pair*: among the
prefills and decodes whose load is within a tolerance of the best, it prefers a pair on the same node
(KV moves over NVLink), then a pair that already has a live transfer channel, then the lowest observed
latency. `random` is mini_lb's behaviour; `round_robin` and `power_of_two` match sgl-router / smg's
per-side policies (power_of_two compares the same load numbers as load_aware). `prefix_aware` and the
smg-like `cache_aware` add prefix-cache affinity for the prefill (prefix_policy.py). `SplitPolicy` takes
the prefill from one policy and the decode from another (smg's `--prefill-policy` / `--decode-policy`).
policy_registry.py builds them by name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from .workers import Worker

@dataclass(frozen=True)
class Choice:
    prefill: Worker
    decode: Worker
    prefill_rank: int | None  # None: let the room decide (room % dp_size), as mini_lb does
    decode_rank: int | None
    prefill_tokens: int | None = None  # expected uncached prompt tokens, when the policy estimates a cache hit


@dataclass(frozen=True)
class PairContext:
    """What the pair score needs besides the workers: live P/D channels and freshness of polled loads."""

    live_channels: frozenset[tuple[str, str]] = frozenset()
    poll_max_age: float = 10.0
    now: float | None = None
    tokens: int = 0  # estimated prompt tokens of the request
    prompt: bytes = b""  # the prompt for prefix matching (payload.prompt_key)


@dataclass(frozen=True)
class LoadAwareParams:
    # Loads within this distance of the best count as "close" (tokens / running requests): absolute
    # floor or a fraction of the best, whichever is larger.
    prefill_tol_tokens: float = 256.0
    prefill_tol_frac: float = 0.10
    decode_tol_reqs: float = 2.0
    decode_tol_frac: float = 0.10
    # KV pressure: a decode at usage u costs kv_weight * u / (1 - u) extra running requests (kv_pressure), so
    # it is avoided well before it has to retract requests or keep new ones waiting for pages.
    kv_weight: float = 8.0
    same_node_bonus: int = 2
    live_channel_bonus: int = 1


class Policy(Protocol):
    name: str

    def choose(self, prefills: Sequence[Worker], decodes: Sequence[Worker], ctx: PairContext) -> Choice: ...


def best_rank(values: Sequence[float]) -> tuple[int, float]:
    """Index and value of the smallest entry (first on ties, so rank 0 of an idle server)."""
    i = min(range(len(values)), key=values.__getitem__)
    return i, values[i]


def prefill_cost(w: Worker, ctx: PairContext) -> tuple[int, float]:
    return best_rank([w.prefill_load(r, ctx.poll_max_age, ctx.now) for r in range(w.dp_size)])


#: above this KV use the pressure grows linearly (slope of u / (1 - u) there) instead of without bound, so
#: two over-full decodes still compare: the one asked for less wins
KV_KNEE = 0.95


def kv_pressure(u: float) -> float:
    """u / (1 - u) up to KV_KNEE, then on along its tangent: 0 when empty, 1 at half full, 19 at the knee."""
    if u <= KV_KNEE:
        return u / (1.0 - u)
    return KV_KNEE / (1.0 - KV_KNEE) + (u - KV_KNEE) / (1.0 - KV_KNEE) ** 2


def decode_running(w: Worker, ctx: PairContext) -> tuple[int, float]:
    """The decode's least-loaded rank and its running requests."""
    return best_rank([w.decode_load(r, ctx.poll_max_age, ctx.now) for r in range(w.dp_size)])


def decode_cost(w: Worker, ctx: PairContext, kv_weight: float) -> tuple[int, float]:
    rank, running = decode_running(w, ctx)
    return rank, running + kv_weight * kv_pressure(w.kv_usage(ctx.poll_max_age))


def _near_best(costs: Sequence[float], tol_abs: float, tol_frac: float) -> list[int]:
    lo = min(costs)
    limit = lo + max(tol_abs, tol_frac * lo)
    return [i for i, c in enumerate(costs) if c <= limit]


class RandomPolicy:
    """mini_lb: independent uniform choices, DP rank left to the room."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, prefills, decodes, ctx) -> Choice:
        return Choice(self.rng.choice(prefills), self.rng.choice(decodes), None, None)


class RoundRobinPolicy:
    """One counter per side (sgl-router's round_robin with prefill and decode policies both set)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._p = self._d = 0

    def choose(self, prefills, decodes, ctx) -> Choice:
        p, d = prefills[self._p % len(prefills)], decodes[self._d % len(decodes)]
        self._p += 1
        self._d += 1
        return Choice(p, d, None, None)


class PowerOfTwoPolicy:
    """Two random candidates per side, the less loaded wins; least-loaded DP rank."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None, kv_weight: float = LoadAwareParams.kv_weight) -> None:
        self.rng = rng or random.Random()
        self.kv_weight = kv_weight

    def _two(self, ws: Sequence[Worker]) -> Sequence[Worker]:
        return ws if len(ws) <= 2 else self.rng.sample(list(ws), 2)

    def choose(self, prefills, decodes, ctx) -> Choice:
        ps = [(prefill_cost(w, ctx), w) for w in self._two(prefills)]
        ds = [(decode_cost(w, ctx, self.kv_weight), w) for w in self._two(decodes)]
        (pr, _), p = min(ps, key=lambda x: x[0][1])
        (dr, _), d = min(ds, key=lambda x: x[0][1])
        return Choice(p, d, pr, dr)


class LoadAwarePolicy:
    """Least outstanding prefill work and least decode load, scored as a pair (see module docstring)."""

    name = "load_aware"

    def __init__(self, params: LoadAwareParams | None = None, rng: random.Random | None = None) -> None:
        self.params = params or LoadAwareParams()
        self.rng = rng or random.Random()

    def pair_bonus(self, p: Worker, d: Worker, ctx: PairContext) -> int:
        bonus = 0
        if p.node == d.node:
            bonus += self.params.same_node_bonus
        if (p.url, d.url) in ctx.live_channels:
            bonus += self.params.live_channel_bonus
        return bonus

    def choose(self, prefills, decodes, ctx) -> Choice:
        pc = [prefill_cost(w, ctx) for w in prefills]
        i, j, d_rank = self.pick(prefills, decodes, pc, ctx)
        return Choice(prefills[i], decodes[j], pc[i][0], d_rank)

    def pick(self, prefills: Sequence[Worker], decodes: Sequence[Worker], pc: Sequence[tuple[int, float]], ctx: PairContext, p_pref: Sequence[Any] | None = None) -> tuple[int, int, int]:
        """Indices of the best pair given each prefill's (rank, cost), and the decode's rank.

        `p_pref` (lower is better) ranks near-best prefills after the pair bonus and before latency.
        """
        prm = self.params
        dc = [decode_cost(w, ctx, prm.kv_weight) for w in decodes]
        p_near = _near_best([c for _, c in pc], prm.prefill_tol_tokens, prm.prefill_tol_frac)
        d_near = _near_best([c for _, c in dc], prm.decode_tol_reqs, prm.decode_tol_frac)
        p_scale = max(1.0, min(c for _, c in pc), prm.prefill_tol_tokens)
        d_scale = max(1.0, min(c for _, c in dc), prm.decode_tol_reqs)

        def key(ij: tuple[int, int]) -> tuple:
            i, j = ij
            p, d = prefills[i], decodes[j]
            # latency is a tie-break only; unknown latency ranks as best so new workers get tried
            lat = (p.latency or 0.0) + (d.latency or 0.0)
            # quantize so near-equal latencies do not beat the load comparison that follows
            pref = p_pref[i] if p_pref is not None else ()
            return (-self.pair_bonus(p, d, ctx), pref, round(lat, 3), pc[i][1] / p_scale + dc[j][1] / d_scale, self.rng.random())

        i, j = min(((i, j) for i in p_near for j in d_near), key=key)
        return i, j, dc[j][0]


class SplitPolicy:
    """The prefill (and its DP rank, and expected cache hit) from one policy, the decode from another.

    The decode policy sees only the chosen prefill, so its pair preferences (same node, live channel)
    are scored against the prefill that will really send the KV.
    """

    def __init__(self, prefill: Policy, decode: Policy) -> None:
        self.prefill, self.decode = prefill, decode
        self.name = f"prefill={prefill.name},decode={decode.name}"

    def choose(self, prefills, decodes, ctx) -> Choice:
        p = self.prefill.choose(prefills, decodes, ctx)
        d = self.decode.choose([p.prefill], decodes, ctx)
        return Choice(p.prefill, d.decode, p.prefill_rank, d.decode_rank, p.prefill_tokens)
