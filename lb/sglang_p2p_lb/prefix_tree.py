"""An approximate per-worker prefix tree: which prompt prefixes were sent to which worker (pure, no I/O).

SGLang keeps a radix cache of recent prompts on every server; the LB cannot see it, so it remembers what
it routed where, as sgl-router / smg's `cache_aware` does. A prompt is cut into fixed blocks and each
block is named by a hash chained over all blocks before it, so block i's hash stands for the whole
prefix up to block i: a set of such hashes per worker is a radix tree flattened to its nodes. Matching
walks the prompt's chain until the first block the worker has not seen. Each worker's set is an LRU,
refreshed root-last on insert, so eviction trims leaves before the prefixes they hang from, as a radix
cache does. The simulated worker (simworker/radix.py) uses the same structure as its model of SGLang's radix cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Sequence

# 64 bytes of UTF-8 is ~16 tokens, SGLang's usual page size; a shorter tail is not matched (approximate)
BLOCK_BYTES = 64


def block_hashes(key: Sequence, block: int = BLOCK_BYTES) -> list[int]:
    """Chained hashes of the full blocks of `key` (bytes, str, or a list of tokens)."""
    out: list[int] = []
    h = 0
    as_tuple = isinstance(key, list)
    for i in range(0, len(key) - block + 1, block):
        chunk = key[i : i + block]
        h = hash((h, tuple(chunk) if as_tuple else chunk))
        out.append(h)
    return out


class PrefixTree:
    """Block hashes per tenant (a worker, or a worker's DP rank) with LRU eviction beyond `max_size` each."""

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self.max_size = max_size
        self._tenants: dict[Hashable, OrderedDict[int, None]] = {}

    def match(self, hashes: Sequence[int], tenant: Hashable) -> int:
        """Number of leading blocks of the chain that `tenant` holds."""
        seen = self._tenants.get(tenant)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int], tenant: Hashable) -> None:
        """Record that `tenant` now holds this chain; its prefix ends up most recently used."""
        seen = self._tenants.setdefault(tenant, OrderedDict())
        for h in reversed(hashes):
            seen[h] = None
            seen.move_to_end(h)
        # a hard bound between eviction rounds, so memory stays bounded whatever the interval
        if len(seen) > 2 * self.max_size:
            self._trim(seen)

    def _trim(self, seen: OrderedDict[int, None]) -> int:
        n = 0
        while len(seen) > self.max_size:
            seen.popitem(last=False)
            n += 1
        return n

    def evict(self) -> int:
        """Trim every tenant to max_size, least recently used first; returns the entries dropped."""
        return sum(self._trim(seen) for seen in self._tenants.values())

    def retain(self, tenants: Iterable[Hashable]) -> None:
        """Forget tenants not in `tenants` (removed workers)."""
        keep = set(tenants)
        for t in [t for t in self._tenants if t not in keep]:
            del self._tenants[t]

    def size(self, tenant: Hashable) -> int:
        return len(self._tenants.get(tenant, ()))

    def tenants(self) -> list[Hashable]:
        return list(self._tenants)
