"""What the Mooncake microbenchmark measures, as pure data: KV layouts, cases, and the page ids of each case.

Layouts follow SGLang's pools (docs/sglang-contract.md): MLA (DeepSeek-V3: 61 layers, one region per layer,
kv_lora 512 + rope 64 in bf16 = 1152 B per token) and MHA (Llama-3-8B: 32 layers, K then V = 64 regions,
8 KV heads x 128 x bf16 = 2048 B per token per region). Page size p makes a page `p x bytes_per_token`.
Modes: `scattered` (random distinct pages on both sides, so almost nothing merges: one descriptor per page
per region, the worst case) and `contiguous` (one run per region: the best case after merging, and close to
what the wire gives on this machine; a descriptor cannot span two registered regions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODES = ("scattered", "contiguous")


@dataclass(frozen=True)
class Layout:
    name: str
    regions: int
    bytes_per_token: int


LAYOUTS = {
    "mla": Layout("mla", 61, 1152),
    "mha": Layout("mha", 64, 2048),
}


@dataclass(frozen=True)
class Case:
    layout: Layout
    page_size: int
    tokens: int
    mode: str

    @property
    def item_len(self) -> int:
        return self.page_size * self.layout.bytes_per_token

    @property
    def pages(self) -> int:
        return -(-self.tokens // self.page_size)

    @property
    def nbytes(self) -> int:
        return self.pages * self.item_len * self.layout.regions


def pool_tokens(max_tokens: int, max_page: int) -> int:
    """Tokens per region in both pools: room to scatter the largest request (1.25x), whole pages of every size."""
    want = max_tokens * 5 // 4
    return -(-want // max_page) * max_page


def cases(layouts: list[str], page_sizes: list[int], tokens: list[int], modes: list[str]) -> list[Case]:
    out = []
    for name in layouts:
        for mode in modes:
            for p in page_sizes:
                out.extend(Case(LAYOUTS[name], p, t, mode) for t in tokens)
    return out


def page_ids(case: Case, pool_pages: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(src_ids, dst_ids) of the request's pages in the prefill and decode pools."""
    n = case.pages
    if n > pool_pages:
        raise ValueError(f"{n} pages do not fit a pool of {pool_pages}")
    if case.mode == "scattered":
        return rng.choice(pool_pages, n, replace=False), rng.choice(pool_pages, n, replace=False)
    start_s, start_d = (int(rng.integers(0, pool_pages - n + 1)) for _ in range(2))
    return np.arange(start_s, start_s + n), np.arange(start_d, start_d + n)
