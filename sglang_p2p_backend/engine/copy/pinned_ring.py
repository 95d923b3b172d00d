"""Page-id uploads to one GPU through a ring of pinned host slots allocated once.

`torch.from_numpy(ids).pin_memory().to(device, non_blocking=True)` takes a block from torch's pinned-host
allocator, makes two tensors and copies twice on the host: ~50-65 us of host time an upload on the H200 host
(docs/nccl.md, session 29), paid once a room on each end, in the request's head. Here the ids are written
straight into one of a few pinned slots made at start and copied to a fresh device tensor on the current stream.
A slot is written again only once an event recorded behind its last copy has passed, so a copy still queued
never reads ids overwritten by a later upload. Nothing here waits: when the next slot's copy is still queued (behind
a receive from a slow peer, say) or the ids are larger than a slot, the upload takes the allocator's path as before,
so one peer's stalled stream never holds another peer's thread.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from sglang_p2p_backend.engine.copy.stream_ops import (EVENT_DISABLE_TIMING, check_call, cuda_libraries, event_done,
                                                       upload_untracked)

#: slots of the ring: more than the uploads in flight at once (a room's ids on each of a few streams)
SLOTS = 8
#: int64 ids a slot holds: a 64k-token room at page size 1 (512 KiB a slot, 4 MiB pinned a device)
SLOT_ITEMS = 1 << 16


class PinnedRing:
    """Uploads int64 id arrays to `device` on the calling thread's current stream there; thread-safe (one lock)."""

    def __init__(self, device: torch.device, slots: int = SLOTS, slot_items: int = SLOT_ITEMS):
        if slots < 1 or slot_items < 1:
            raise ValueError(f"a pinned ring needs at least one slot of one item, got {slots} x {slot_items}")
        self.device = device
        self.index = device.index or 0
        self.slot_items = slot_items
        self._host = torch.empty(slots * slot_items, dtype=torch.int64).pin_memory()
        self._host_np = self._host.numpy()
        # the copies and events go through the runtime itself, not torch (stream_ops.upload_untracked says why)
        self._rt = cuda_libraries()[0]
        self._events: list[ctypes.c_void_p] = []
        with torch.cuda.device(device):  # an event belongs to the device current at its creation
            for _ in range(slots):
                event = ctypes.c_void_p()
                check_call(self._rt, self._rt.cudaEventCreateWithFlags(ctypes.byref(event), EVENT_DISABLE_TIMING),
                           "cudaEventCreateWithFlags", self.index)
                self._events.append(event)  # kept for the process's life, as the pinned slots are
        self._next = 0
        self._lock = threading.Lock()
        self.fallbacks = 0  # uploads that took torch's allocator instead (tests, benchmarks)

    def _free(self, k: int) -> bool:
        """Whether slot k's last copy has run (a slot never used: its event never recorded reads as done)."""
        return event_done(self._rt, self._events[k], self.index)

    def upload(self, ids: np.ndarray) -> torch.Tensor:
        """`ids` as an int64 tensor on the device, its copy queued on the current stream (unchecked: the caller
        checks the range)."""
        part = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        n = part.size
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        with self._lock:
            k = self._next
            if n <= self.slot_items and self._free(k):
                self._next = (k + 1) % len(self._events)
                lo = k * self.slot_items
                self._host_np[lo : lo + n] = part
                dev = torch.empty(n, dtype=torch.int64, device=self.device)
                stream = torch._C._cuda_getCurrentRawStream(self.index)
                upload_untracked(self._rt, dev.data_ptr(), self._host.data_ptr() + 8 * lo, 8 * n, stream, self.index)
                check_call(self._rt, self._rt.cudaEventRecord(self._events[k], ctypes.c_void_p(stream)),
                           "cudaEventRecord", self.index)
                return dev
            self.fallbacks += 1
        # pinned: from pageable memory the copy would first wait for all work queued on the stream
        return torch.from_numpy(part).pin_memory().to(self.device, non_blocking=True)
