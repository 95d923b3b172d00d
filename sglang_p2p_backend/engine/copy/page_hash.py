"""An exact hash of KV pages, the same on any device: a page's bytes as integer words times fixed odd weights,
summed with wrap-around modulo 2**64. Integer arithmetic does not round, so one flipped bit changes it, and a GPU
and a CPU agree on it. The transfer benchmark compares the pages both of its processes hold with it
(bench/transfer/xfer_bench.py); the test-only KV digest compares a room's pages on both sides of a PD pair with
it (adapter/kv_digest.py).

numpy only at import: torch is imported by the functions that take tensors, because the benchmark sets its
environment before torch loads.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

#: the most bytes of one region gathered at once while hashing (a long room's pages of a layer are hashed in
#: batches, so a test-only digest never needs much more free memory than this)
BATCH_BYTES = 64 << 20


def hash_weights(words: int, region: int) -> np.ndarray:
    """Odd int64 weights of a page's words in region `region`: the page hash is sum(word * weight) over the
    page's words of every region, wrapping modulo 2**64, so it is exact and the same on any device."""
    return np.arange(words, dtype=np.int64) * 2 + 1 + 2 * region * words


def page_hash(pages_by_region: list[np.ndarray]) -> np.ndarray:
    """Hashes (int64, one per page) of pages given per region as (pages, words) int64 arrays: the reference the
    torch version (`pool_hash`) is tested against."""
    total = np.zeros(pages_by_region[0].shape[0] if pages_by_region else 0, dtype=np.int64)
    with np.errstate(over="ignore"):
        for r, words in enumerate(pages_by_region):
            total += (words * hash_weights(words.shape[1], r)).sum(axis=1)
    return total


@functools.lru_cache(maxsize=1024)
def _weights(words: int, region: int, device: "torch.device") -> "torch.Tensor":
    import torch

    return torch.from_numpy(hash_weights(words, region)).to(device)


def _words(pages: "torch.Tensor") -> "torch.Tensor":
    """(pages, item bytes) uint8 -> (pages, words) int64: 8-byte words, narrower ones widened when the item is
    not a multiple of 8 bytes (a tiny test pool)."""
    import torch

    item = pages.shape[1]
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if item % size == 0:
            return pages.view(dtype).to(torch.int64)
    return pages.to(torch.int64)


def pool_hash(regions: Sequence["torch.Tensor"], ids: np.ndarray, batch_bytes: int = BATCH_BYTES) -> "torch.Tensor":
    """int64 hashes of pages `ids` over every region ((pages, item bytes) uint8 views), computed on the regions'
    device; for 8-byte-multiple items equal to `page_hash` of the same pages' int64 words."""
    import torch

    device = regions[0].device if regions else torch.device("cpu")
    idx = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device)
    total = torch.zeros(len(idx), dtype=torch.int64, device=device)
    for r, region in enumerate(regions):
        if not region.shape[1] or not len(idx):
            continue
        step = max(1, batch_bytes // region.shape[1])
        for start in range(0, len(idx), step):
            words = _words(region.index_select(0, idx[start:start + step]))
            total[start:start + step] += (words * _weights(words.shape[1], r, device)).sum(dim=1)
    return total


def sequence_digest(page_hashes: "torch.Tensor") -> int:
    """One unsigned 64-bit value of page hashes in order: sum(hash_j * (2j + 1)) modulo 2**64, so pages in
    another order (or another page) give another value. Waits for the device (`item`)."""
    import torch

    odd = torch.arange(len(page_hashes), dtype=torch.int64, device=page_hashes.device) * 2 + 1
    return int((page_hashes * odd).sum().item()) & ((1 << 64) - 1)


def room_digest(regions: Sequence["torch.Tensor"], ids: np.ndarray) -> int:
    """The digest of pages `ids` (in this order) over every region, on the regions' device."""
    return sequence_digest(pool_hash(regions, ids))
