"""A receiver's uploads of its rooms' published KV page ids, one a room, for every chunk's scatter to slice.

A prefill rank sends a room's KV destinations as consecutive runs of the list the decode published
(`checks.ChunkVerdict.kv_run`), so the decode can upload that list once when the room's first chunk is readied and
hand each chunk's scatter the slice its run covers, instead of pinning and uploading every chunk's own ids (about
half of the ~150-280 us a chunk's scatter took to ready on H200: docs/nccl.md). Entries are keyed by the published
array itself (held, so its id cannot be reused while cached; a retried room publishes a new one) and by the stream
the upload ran on (a tensor is only used on the stream that allocated it, so freeing it never races a kernel).
Bounded: the least recently used entry goes first, and a rank's last run of a room drops the room's entry.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np
import torch

from sglang_p2p_backend.engine.copy.copier import PageCopier

#: rooms whose ids one receiver keeps on the device at once: more than the rooms that interleave on one channel
#: (a room's entry goes when its last run was readied); a 128k-token room at page size 1 is 1 MiB
ROOMS_KEPT = 32


class RoomIds:
    """The device copies of the rooms' published KV ids for one receiver thread (not thread-safe)."""

    def __init__(self, copier: PageCopier, capacity: int = ROOMS_KEPT):
        self.copier = copier
        self.capacity = capacity
        self._kept: "collections.OrderedDict[tuple[int, int], tuple[np.ndarray, torch.Tensor]]" = collections.OrderedDict()
        self.uploads = 0  # how many lists went to the device (tests, benchmarks)

    def __len__(self) -> int:
        return len(self._kept)

    def run(self, kv_ids: np.ndarray, start: int, n: int, stream: Optional["torch.cuda.Stream"]) -> Optional[torch.Tensor]:
        """`kv_ids[start:start + n]` on the device, from the list's one upload on `stream` (made now on the first
        call, on the current stream, which must be `stream`); None where the copier takes host ids (CPU) or the list
        names a page outside this rank's pools (the chunk then takes the per-chunk path, whose checks report it)."""
        if not 0 <= start <= start + n <= kv_ids.size:
            raise IndexError(f"run {start}..{start + n} outside the room's {kv_ids.size} published KV ids")
        key = (id(kv_ids), 0 if stream is None else int(stream.cuda_stream))
        kept = self._kept.get(key)  # an entry holds its list, so a listed id is that very list
        if kept is None:
            if self.copier.bad_ids([kv_ids]) is not None:
                return None
            dev = self.copier.device_ids([kv_ids])
            if dev is None:
                return None
            kept = (kv_ids, dev[0])
            self.uploads += 1
            self._kept[key] = kept
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        self._kept.move_to_end(key)
        if start + n == kv_ids.size:  # the run that ends the list: no later chunk of this rank needs it
            del self._kept[key]
        return kept[1][start : start + n]

    def clear(self) -> None:
        self._kept.clear()
