"""A test-only fault for end-to-end checks: KV that arrived intact is overwritten on the decode just before its
room reports Success, so a check can prove it notices wrong KV (its negative control).

Off unless SGLANG_P2P_TEST_CORRUPT_KV_FILE names a file. While that file exists, every room that completes on
this decode rank has its middle destination page zeroed in every KV region (all layers); a check creates the
file, sends its control requests, and removes it, without restarting the server.
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

    def apply(self, room: int, kv_ids: np.ndarray) -> Optional[int]:
        """Zero one of the room's pages while the flag file exists; returns the page, or None."""
        if not self.flag_file or not kv_ids.size or not os.path.exists(self.flag_file):
            return None
        page = int(kv_ids[kv_ids.size // 2])
        for view in self.kv_views:
            view[page].zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # on the GPU before SGLang's forward reads the page
        logger.warning("test fault (%s exists): zeroed page %d of room %d in %d KV regions",
                       self.flag_file, page, room, len(self.kv_views))
        return page
