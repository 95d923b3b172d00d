"""A test-only fault for end-to-end checks: KV that arrived intact is overwritten on the decode just before its
room reports Success, so a check can prove it notices wrong KV (its negative control).

Off unless SGLANG_P2P_TEST_CORRUPT_KV_FILE names a file. While that file exists, every room that completes on
this decode rank has an eighth of its destination pages (at least one, a run from the middle) zeroed in every KV
region (all layers); a check creates the file, sends its control requests, and removes it, without restarting
the server. One zeroed token of a 2,500-token prompt moved a tiny model's logprobs by only ~0.03 nats on the
4-GPU host, less than two TP layouts' rounding apart; an eighth of the context is what wrong KV looks like.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)


class KVCorruption:
    def __init__(self, flag_file: Optional[str], kv_views: Sequence[torch.Tensor], device: torch.device):
        self.flag_file = flag_file
        self.kv_views = kv_views  # (pages, page bytes) views of the KV regions
        self.device = device

    def apply(self, room: int, kv_ids: np.ndarray) -> list[int]:
        """Zero a run of the room's pages while the flag file exists; returns the pages zeroed."""
        if not self.flag_file or not kv_ids.size or not os.path.exists(self.flag_file):
            return []
        start = kv_ids.size // 2
        pages = [int(p) for p in kv_ids[start:start + max(1, kv_ids.size // 8)]]
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        for view in self.kv_views:
            view.index_fill_(0, index, 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # on the GPU before SGLang's forward reads the pages
        logger.warning("test fault (%s exists): zeroed %d pages of room %d from page %d in %d KV regions",
                       self.flag_file, len(pages), room, pages[0], len(self.kv_views))
        return pages
