"""Page copies between a rank's registered pools and staging: the fused Triton kernel on CUDA (one launch per
chunk segment across all layer regions), one torch copy per region on CPU and for head-range segments
(different attention TP) on CUDA too: those are strided, which the fused kernel does not do. Built once per manager, because the
CUDA kernels are compiled and loaded up front: loading one in the middle of a transfer can wait on the NCCL
kernels in flight, i.e. on the peer (docs/nccl.md, hazards)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sglang_p2p_backend.engine.copy.gather import GroupViews, copy_chunk
from sglang_p2p_backend.engine.copy.plan import Chunk


class PageCopier:
    def __init__(self, views: GroupViews):
        self.views = views
        self.item_lens = [[int(v.shape[1]) for v in regions] for regions in views]
        on_cuda = any(v.is_cuda for regions in views for v in regions)
        self._fused = None
        if on_cuda:
            from sglang_p2p_backend.engine.copy.gather_cuda import FusedGather

            self._fused = FusedGather(views)

    def _fused_for(self, chunk: Chunk):
        """The fused kernel when it can move this chunk (whole pages on CUDA), else None (torch copies)."""
        if self._fused is None or any(seg.heads is not None for seg in chunk.segments):
            return None
        return self._fused

    def gather(self, chunk: Chunk, ids: Sequence[np.ndarray], staging: torch.Tensor) -> None:
        fused = self._fused_for(chunk)
        if fused is not None:
            fused.gather_chunk(chunk, ids, staging)
        else:
            copy_chunk(chunk, self.views, ids, staging, scatter=False)

    def scatter(self, chunk: Chunk, ids: Sequence[np.ndarray], staging: torch.Tensor) -> None:
        fused = self._fused_for(chunk)
        if fused is not None:
            fused.scatter_chunk(chunk, ids, staging)
        else:
            copy_chunk(chunk, self.views, ids, staging, scatter=True)
