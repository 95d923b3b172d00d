"""KV pool layouts as SGLang lays them out, for the transfer benchmark and GPU tests.

MLA (DeepSeek V3): one region per layer, 61 layers x 576 values (kv_lora_rank 512 + rope 64) of bf16 per token.
MHA (Llama-3-8B-like): K and V regions per layer, 32 layers x 8 KV heads x 128 of bf16 per token.
A region is (num_pages, page_size * per-token bytes) uint8: a page of every region shares one page id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Layout:
    name: str
    regions: int
    token_bytes: int  # per region

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page id across all regions."""
        return self.regions * page_size * self.token_bytes


MLA = Layout("mla", 61, 576 * 2)
MHA = Layout("mha", 64, 8 * 128 * 2)
LAYOUTS = {"mla": MLA, "mha": MHA}


def alloc_pool(layout: Layout, page_size: int, num_pages: int, device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation holding every region (as SGLang's per-layer buffers, but contiguous so a fill is one
    kernel); returns it and the per-region (num_pages, item_len) uint8 views."""
    item = page_size * layout.token_bytes
    whole = torch.empty((layout.regions, num_pages, item), dtype=torch.uint8, device=device)
    return whole, [whole[r] for r in range(layout.regions)]


def fill_pattern(whole: torch.Tensor, salt: int) -> None:
    """Every int32 word gets a value derived from its position and `salt`, so a misplaced page, region or byte
    range shows up; cheap to recompute on the receiver for any page."""
    per_region = whole[0].numel() // 4
    for r in range(whole.shape[0]):  # region by region: the index temporaries stay small
        idx = torch.arange(r * per_region, (r + 1) * per_region, device=whole.device, dtype=torch.int64)
        whole[r].view(torch.int32).view(-1).copy_(((idx * 2654435761 + salt * 40503) & 0x7FFFFFFF).to(torch.int32))


def expected_pages(whole_shape: tuple, region: int, page_ids: torch.Tensor, salt: int) -> torch.Tensor:
    """The pattern `fill_pattern` wrote into pages `page_ids` of `region` of a pool shaped `whole_shape`."""
    _, num_pages, item = whole_shape
    words = item // 4
    base = (region * num_pages + page_ids.to(torch.int64)) * words
    idx = base[:, None] + torch.arange(words, device=page_ids.device, dtype=torch.int64)[None, :]
    return ((idx * 2654435761 + salt * 40503) & 0x7FFFFFFF).to(torch.int32)


def verify_pages(whole: torch.Tensor, dst_ids: torch.Tensor, src_ids: torch.Tensor, src_shape: tuple, salt: int) -> bool:
    """True if pages `dst_ids` of every region of `whole` hold the source pool's pattern of pages `src_ids`."""
    for r in range(whole.shape[0]):
        got = whole[r].index_select(0, dst_ids).view(torch.int32)
        if not torch.equal(got, expected_pages(src_shape, r, src_ids, salt)):
            return False
    return True


def pick_pages(num_pages: int, n: int, seed: int) -> np.ndarray:
    """`n` distinct page ids in random order (scattered, as a busy pool hands them out)."""
    return np.random.default_rng(seed).permutation(num_pages)[:n].astype(np.int64)


def chunk_ranges(n_pages: int, page_bytes: int, budget: int) -> list[tuple[int, int]]:
    """Split pages [0, n) into consecutive ranges of at most `budget` bytes (whole pages, all regions)."""
    per = max(1, budget // page_bytes)
    return [(lo, min(lo + per, n_pages)) for lo in range(0, n_pages, per)]
