"""The prefill's model of SGLang's radix cache: per DP rank, an LRU prefix tree of pages (off by default)."""

from __future__ import annotations

from typing import Any

from sglang_p2p_lb.prefix_tree import PrefixTree, block_hashes

from .prompts import token_seqs


class RadixModel:
    """At most `capacity_tokens` per DP rank, in pages of `page_tokens`; capacity 0 caches nothing."""

    def __init__(self, capacity_tokens: int, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        pages = capacity_tokens // max(1, page_tokens)
        self._tree = PrefixTree(pages) if pages else None  # one tenant per DP rank

    def hashes(self, route: str, body: dict[str, Any]) -> list[list[int]]:
        """The page hashes of each item's prompt (none when nothing is cached)."""
        if self._tree is None:
            return []
        return [block_hashes(seq, self.page_tokens) for seq in token_seqs(route, body)]

    def hits(self, hashes: list[list[int]], sizes: list[int], rank: int) -> list[int]:
        """Cached tokens per item; at least one token of each prompt is always computed, as in SGLang."""
        if self._tree is None:
            return [0] * len(sizes)
        return [min(self._tree.match(h, rank) * self.page_tokens, max(0, s - 1)) for h, s in zip(hashes, sizes)]

    def insert(self, hashes: list[list[int]], rank: int) -> None:
        if self._tree is None:
            return
        for h in hashes:
            self._tree.insert(h, rank)
        self._tree.evict()

    def flush(self) -> None:
        if self._tree is not None:
            self._tree = PrefixTree(self._tree.max_size)
