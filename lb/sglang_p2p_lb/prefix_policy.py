"""Prefix-cache affinity for the prefill, traded off against load: `prefix_aware`, and smg's `cache_aware`.

SGLang prefill servers keep a radix cache, so a prompt whose prefix a server holds is prefilled faster
there. Both policies remember what they routed where in an approximate prefix tree per worker and DP rank
(prefix_tree.py); both take sgl-router / smg's flags (`--cache-threshold`, `--balance-abs-threshold`,
`--balance-rel-threshold`, `--eviction-interval-secs`, `--max-tree-size`).

`prefix_aware` (ours) scores each prefill rank by the prompt tokens it would have to work through before
this request's KV is ready: its outstanding uncached tokens plus this prompt's tokens minus the part
expected in its cache. So a cache hit wins while the holder's queue is shorter than the work the hit
saves, and a hot prefix spills to other servers as soon as its holder's queue grows past that (a hit
costs only its uncached tokens in the holder's load, so the trade-off is made in one unit). In PD a hit is not
free: the whole prompt's KV still leaves the prefill that holds it, and attention still reads the prefix;
`cached_cost` charges that share of every cached token (0, the default: a hit costs nothing). Matches
below `cache_threshold` of the prompt count as misses; among prefills of near-equal cost the longer expected
hit wins, then the smaller tree (where a new prefix evicts least), and when request loads are imbalanced by both
balance thresholds cache affinity is dropped for pure load, as in smg. The decode and the pair
preferences (same node, live channel) are load_aware's.

`cache_aware` is the smg / sgl-router behaviour, a baseline: imbalanced -> least requests; else the
worker with the longest match if its share reaches `cache_threshold`, else the one with the smallest
tree. It ignores how much work the hit saves against the holder's queue.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .policy import Choice, LoadAwarePolicy, LoadAwareParams, PairContext, decode_cost
from .prefix_tree import BLOCK_BYTES, PrefixTree, block_hashes
from .workers import Worker


@dataclass(frozen=True)
class PrefixParams:
    # sgl-router's launch_router defaults, except max_tree_size: ours counts 64-byte blocks per worker
    # (2^18 blocks = 16 MiB of prompt text, several times a large server's radix cache), not characters.
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval: float = 120.0
    max_tree_size: int = 1 << 18
    # ours (prefix_aware only): the share of a cached token's cost still charged to the prefill that holds it
    cached_cost: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cached_cost <= 1.0:
            raise ValueError(f"cached token cost must be in [0, 1] (a share of an uncached token's), got {self.cached_cost}")


def request_load(w: Worker, ctx: PairContext) -> float:
    """Requests in flight on a worker (all ranks): the unit of smg's balance thresholds."""
    return sum(w.decode_load(r, ctx.poll_max_age, ctx.now) for r in range(w.dp_size))


def imbalanced(loads: Sequence[float], abs_threshold: float, rel_threshold: float) -> bool:
    """smg's rule: both (max - min) > abs and max > rel * min."""
    if len(loads) < 2:
        return False
    lo, hi = min(loads), max(loads)
    return hi - lo > abs_threshold and hi > rel_threshold * lo


def cached_share(matched_blocks: int, prompt_bytes: int) -> float:
    return min(1.0, matched_blocks * BLOCK_BYTES / prompt_bytes) if prompt_bytes else 0.0


# tree sizes (blocks) and expected hits (tokens) within these steps count as equal in the tie-breaks
TREE_SIZE_QUANTUM = 64
CACHED_QUANTUM = 64


class _TreeOwner:
    """The prefix tree and its periodic trim, shared by both policies."""

    def __init__(self, prefix: PrefixParams | None, clock: Callable[[], float]) -> None:
        self.prefix = prefix or PrefixParams()
        self.tree = PrefixTree(self.prefix.max_tree_size)
        self._clock = clock
        self._last_evict = clock()

    def maybe_evict(self, prefills: Sequence[Worker]) -> None:
        """Every eviction interval: trim each tree, and forget workers no longer routable (removed or
        ejected: a worker that comes back after a restart has lost its cache anyway)."""
        now = self._clock()
        if now - self._last_evict >= self.prefix.eviction_interval:
            self._last_evict = now
            urls = {w.url for w in prefills}
            self.tree.retain(t for t in self.tree.tenants() if t[0] in urls)
            self.tree.evict()


class PrefixAwarePolicy(LoadAwarePolicy, _TreeOwner):
    name = "prefix_aware"

    def __init__(self, prefix: PrefixParams | None = None, params: LoadAwareParams | None = None, rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        LoadAwarePolicy.__init__(self, params, rng)
        _TreeOwner.__init__(self, prefix, clock)

    def rank_costs(self, w: Worker, hashes: Sequence[int], ctx: PairContext, affinity: bool) -> list[tuple[float, float]]:
        """(cost, expected cached tokens) of each DP rank of one prefill."""
        out = []
        for r in range(w.dp_size):
            share = cached_share(self.tree.match(hashes, (w.url, r)), len(ctx.prompt)) if affinity else 0.0
            cached = ctx.tokens * share if share >= self.prefix.cache_threshold else 0.0
            out.append((w.prefill_load(r, ctx.poll_max_age, ctx.now) + self.work(ctx.tokens, cached), cached))
        return out

    def work(self, tokens: float, cached: float) -> float:
        """A request's prefill work in uncached-token units: its uncached tokens and `cached_cost` of the rest."""
        return tokens - cached * (1.0 - self.prefix.cached_cost)

    def choose(self, prefills, decodes, ctx) -> Choice:
        self.maybe_evict(prefills)
        hashes = block_hashes(ctx.prompt)
        affinity = bool(hashes) and not imbalanced([request_load(w, ctx) for w in prefills], self.prefix.balance_abs_threshold, self.prefix.balance_rel_threshold)
        pc, cached = [], []
        for w in prefills:
            costs = self.rank_costs(w, hashes, ctx, affinity)
            r = min(range(len(costs)), key=lambda k: costs[k][0])  # first on ties: rank 0 of an idle server
            pc.append((r, costs[r][0]))
            cached.append(costs[r][1])
        # among near-equal costs: the longer expected hit (moving a prefix within the tolerance only
        # copies it into a second cache, evicting others), then the smaller tree (smg's rule for a miss:
        # a new prefix goes where it evicts least, so the caches split the working set). Latency must
        # not decide here: the server with the most hits looks fastest per token.
        prefs = [(-round(c / CACHED_QUANTUM), self.tree.size((w.url, r)) // TREE_SIZE_QUANTUM) for c, w, (r, _) in zip(cached, prefills, pc)]
        i, j, d_rank = self.pick(prefills, decodes, pc, ctx, prefs)
        if hashes:
            self.tree.insert(hashes, (prefills[i].url, pc[i][0]))
        return Choice(prefills[i], decodes[j], pc[i][0], d_rank, prefill_tokens=max(1, round(self.work(ctx.tokens, cached[i]))) if cached[i] else None)


class CacheAwarePolicy(_TreeOwner):
    """smg / sgl-router cache_aware for the prefill (see module docstring); the least-loaded decode."""

    name = "cache_aware"

    def __init__(self, prefix: PrefixParams | None = None, params: LoadAwareParams | None = None, rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(prefix, clock)
        self.kv_weight = (params or LoadAwareParams()).kv_weight
        self.rng = rng or random.Random()

    def choose(self, prefills, decodes, ctx) -> Choice:
        self.maybe_evict(prefills)
        hashes = block_hashes(ctx.prompt)
        loads = [request_load(w, ctx) for w in prefills]
        if not hashes or imbalanced(loads, self.prefix.balance_abs_threshold, self.prefix.balance_rel_threshold):
            i = min(range(len(prefills)), key=lambda k: (loads[k], self.rng.random()))
        else:
            shares = [cached_share(self.tree.match(hashes, (w.url, 0)), len(ctx.prompt)) for w in prefills]
            best = max(range(len(prefills)), key=lambda k: (shares[k], self.rng.random()))
            if shares[best] >= self.prefix.cache_threshold:
                i = best
            else:
                i = min(range(len(prefills)), key=lambda k: (self.tree.size((prefills[k].url, 0)), self.rng.random()))
        if hashes:
            self.tree.insert(hashes, (prefills[i].url, 0))
        dc = [decode_cost(w, ctx, self.kv_weight) for w in decodes]
        j = min(range(len(decodes)), key=lambda k: (dc[k][1], self.rng.random()))
        return Choice(prefills[i], decodes[j], None, dc[j][0])
