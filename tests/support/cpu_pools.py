"""Small KV pools in host memory for the two-sided pipeline tests: regions of pages filled with 0xA5 (a
destination) or with seeded random bytes (a source)."""

import torch

from sglang_p2p_backend.engine.copy.memory import Region, page_views

CPU = torch.device("cpu")


def pools(num_regions=6, pages=64, item_len=48, fill=None):
    ts = [torch.full((pages, item_len), 0xA5, dtype=torch.uint8) if fill is None else fill(i, pages, item_len)
          for i in range(num_regions)]
    regions = [Region(t.data_ptr(), t.numel(), item_len) for t in ts]
    return ts, page_views(regions, CPU)


def rand(i, pages, item_len):
    return torch.randint(0, 256, (pages, item_len), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
