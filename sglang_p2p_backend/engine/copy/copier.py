"""Pack a chunk's scattered pages into staging (prefill) and unpack staging into destination pages (decode).

The layout is `plan.staging_blocks`. `PageCopier` is built once per manager over a rank's registered pools and
picks the copy for each chunk: on CUDA the fused Triton kernel (`gather_cuda.FusedGather`, one launch per chunk
segment across all layer regions); on CPU, and for head-range segments on CUDA too (those are strided, which
the fused kernel does not do), `copy_chunk`: one torch copy per region. It is built up front because the CUDA
kernels are compiled and loaded then: loading one in the middle of a transfer can wait on the NCCL kernels in
flight, i.e. on the peer (docs/nccl.md, hazards).

In `copy_chunk` a segment whose ids are consecutive is one slice copy per region; otherwise one `index_select`
/ `index_copy_` per region. A segment with a head range (different attention TP on the two sides) copies the
same way through a strided view of the pages, (pages, rows, heads, head bytes) narrowed to the range: still one
copy per region, never one per page or per head; an SWA window's state segment (state_slices.py) is one too. A state segment with byte spans (a mamba state sliced over
TP: state_slices.py) copies each span of the items as its own column range of the staging block: one copy per
span and region (a few per request). On CUDA these run on the caller's current stream (the pair channel's), so
they order with the channel's send/recv.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from sglang_p2p_backend.engine.copy.heads import Heads
from sglang_p2p_backend.engine.copy.plan import Chunk, ids_out_of_range, is_contiguous, staging_blocks
from sglang_p2p_backend.engine.copy.state_slices import Spans

GroupViews = Sequence[Sequence[torch.Tensor]]  # [group][region] -> (num_items, item_len) uint8 view


def item_lens(views: GroupViews) -> list[list[int]]:
    """Bytes per page of every region, by group: the page layout `plan` works in."""
    return [[int(v.shape[1]) for v in regions] for regions in views]


class _Ids:
    """Per-segment id selection, converted to a device index tensor only when not a plain slice."""

    def __init__(self, ids: np.ndarray, device: torch.device):
        self.ids = ids
        self.device = device
        self._cache: dict[tuple[int, int], object] = {}

    def select(self, lo: int, hi: int):
        key = (lo, hi)
        sel = self._cache.get(key)
        if sel is None:
            part = self.ids[lo:hi]
            if is_contiguous(part):
                sel = slice(int(part[0]), int(part[-1]) + 1)
            else:
                sel = torch.from_numpy(np.ascontiguousarray(part, dtype=np.int64)).to(self.device, non_blocking=True)
            self._cache[key] = sel
        return sel


def _head_view(pages: torch.Tensor, heads: Heads) -> torch.Tensor:
    """(pages, rows, heads in range, head bytes): a strided view of the range in every page of a region."""
    hb = heads.head_bytes(int(pages.shape[1]))
    return pages.view(pages.shape[0], heads.rows, heads.local, hb)[:, :, heads.lo : heads.hi, :]


def copy_chunk(chunk: Chunk, views: GroupViews, ids: Sequence[np.ndarray], staging: torch.Tensor, *, scatter: bool) -> None:
    """Gather the chunk's pages (ids per group) from `views` into `staging[:chunk.nbytes]`, or with
    `scatter=True` copy staging back out into those pages."""
    sel = [_Ids(i, staging.device) for i in ids]
    for seg, r, off, nbytes in staging_blocks(chunk, item_lens(views)):
        pages = views[seg.group][r]
        if isinstance(seg.heads, Spans):
            if nbytes:  # a region nothing of which moves between these two ranks has no block
                    _copy_spans(pages, seg.heads.spans[r], staging[off : off + nbytes].view(seg.hi - seg.lo, -1),
                            sel[seg.group].select(seg.lo, seg.hi), scatter)
            continue
        if seg.heads is not None:
            pages = _head_view(pages, seg.heads)
        block = staging[off : off + nbytes].view(seg.hi - seg.lo, *pages.shape[1:])
        _move(pages, sel[seg.group].select(seg.lo, seg.hi), block, scatter)


def _copy_spans(items: torch.Tensor, spans, block: torch.Tensor, s, scatter: bool) -> None:
    """Each span (offset, bytes) of the selected items <-> its column range of `block` (items, sum of spans)."""
    col = 0
    for o, n in spans:
        _move(items[:, o : o + n], s, block[:, col : col + n], scatter)
        col += n


def _move(rows: torch.Tensor, s, block: torch.Tensor, scatter: bool) -> None:
    """`block` -> `rows[s]` (scatter) or `rows[s]` -> `block`; `s` a slice or an index tensor."""
    if isinstance(s, slice) and scatter:
        rows[s].copy_(block, non_blocking=True)
    elif isinstance(s, slice):
        block.copy_(rows[s], non_blocking=True)
    elif scatter:
        rows.index_copy_(0, s, block)
    elif block.is_contiguous():
        torch.index_select(rows, 0, s, out=block)
    else:  # a column range of the block: index_select cannot write into it
        block.copy_(rows.index_select(0, s), non_blocking=True)


class PageCopier:
    """Copies between one rank's registered pools (`views`) and staging, chunk by chunk."""

    def __init__(self, views: GroupViews):
        self.views = views
        self.item_lens = item_lens(views)
        #: the pools' device (None without a region): the receiver's thread makes it its current one
        self.device: Optional[torch.device] = next((v.device for regions in views for v in regions), None)
        #: pages every region of a group has (the bound of its ids), worked out once: `bad_ids` runs every send()
        self._pages = [min(int(v.shape[0]) for v in regions) if regions else 0 for regions in views]
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

    def bad_ids(self, ids: Sequence[np.ndarray]) -> Optional[str]:
        """What is wrong with a transfer's page ids (group g's must name pages of every region of g), None if
        nothing: checked before a chunk's header goes out, so a bad id fails its room, not the channel."""
        for g, part in enumerate(ids):
            if g >= len(self.views):
                return f"page ids for group {g}, which this rank's pools do not have"
            if len(part) == 0 or not self.views[g]:
                continue
            problem = ids_out_of_range(part, self._pages[g])
            if problem:
                return f"group {g} {problem}"
        return None

    def loaded_for(self, chunk: Chunk) -> bool:
        """Whether copying this chunk launches only kernels loaded up front: always on CPU; on CUDA only the fused
        kernel (FusedGather warms it up), not torch's copies, which CUDA loads lazily at their first launch."""
        return self._fused is None or self._fused_for(chunk) is not None  # no fused kernel: on CPU

    def gather(self, chunk: Chunk, ids: Sequence[np.ndarray], staging: torch.Tensor,
               dev_ids: Optional[Sequence[torch.Tensor]] = None) -> None:
        """`dev_ids`: the same ids on the device (`device_ids`), which the fused kernel then slices instead of
        uploading the chunk's own."""
        fused = self._fused_for(chunk)
        if fused is not None:
            fused.gather_chunk(chunk, ids if dev_ids is None else dev_ids, staging)
        else:
            copy_chunk(chunk, self.views, ids, staging, scatter=False)

    def device_ids(self, ids: Sequence[np.ndarray]) -> Optional[list[torch.Tensor]]:
        """A transfer's page ids, checked by `bad_ids` first, on the device in one upload a group (on the current
        stream), for `gather`: a sender uploads a room's ids once instead of once a chunk (pinning and the copy
        are ~60 us of host time a chunk on H200: bench/transfer/xfer_bench.py, nccl phases). None on CPU."""
        if self._fused is None:
            return None
        return [self._fused.upload_ids(part) for part in ids]

    def takes_device_ids(self, chunk: Chunk) -> bool:
        """Whether `gather` / `prepare_scatter` of this chunk use ids already on the device (`dev_ids`): the fused
        kernel's chunks; torch's copies (CPU, head ranges) take the host ids."""
        return self._fused_for(chunk) is not None

    def scatter(self, chunk: Chunk, ids: Sequence[np.ndarray], staging: torch.Tensor) -> None:
        self.prepare_scatter(chunk, ids, staging)()

    def prepare_scatter(self, chunk: Chunk, ids: Sequence[np.ndarray], staging: torch.Tensor,
                        dev_ids: Optional[Sequence] = None) -> Callable[[], object]:
        """`scatter` in two steps: with the fused kernel its checks and the page ids to the device now, on the
        current stream, and the returned call only launches (on this stream or one ordered after it); torch's
        copies do all their work in the call. `dev_ids`: the ids by group, those of a group already on the device
        (a slice of the room's one upload: room_ids.py) used as they are, the others uploaded; for the fused kernel
        only."""
        fused = self._fused_for(chunk)
        if fused is not None:
            return fused.prepare_chunk(chunk, ids if dev_ids is None else dev_ids, staging, scatter=True)
        return functools.partial(copy_chunk, chunk, self.views, ids, staging, scatter=True)
