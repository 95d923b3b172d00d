"""Engine-style pipelined page transfer over one pair communicator: gather -> send on the prefill, recv ->
scatter on the decode, chunk by chunk through a few staging slots.

What the engine's pipeline should do on a GPU (and what the benchmark times):
- prefill: the gather stream first waits SGLang's prefill event (pages are final), then for chunk k waits until
  the send that last used the slot finished, gathers (one fused launch), and `comm.send` is issued with the
  gather stream current, so the send waits exactly for that gather; gather k+1 overlaps send k.
- decode: receives are posted up to `slots` chunks ahead; chunk k's scatter waits for its receive, and the
  receive that reuses chunk k's slot is posted right after that scatter, so it waits for it and nothing else.
Nothing blocks the host except NCCL's launch of each op; completion is an event.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from sglang_p2p_backend.engine.copy.gather_cuda import FusedGather
from sglang_p2p_backend.engine.transport.nccl import NcclPairComm


class StagingSlots:
    """`n` staging buffers of `nbytes` on the comm's device, each with the event of its last use."""

    def __init__(self, comm: NcclPairComm, nbytes: int, n: int):
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, device=comm.device) for _ in range(n)]
        self.last_use: list[Optional[torch.cuda.Event]] = [None] * n
        self.nbytes = nbytes


def _upload(ids: np.ndarray, limit: int, device: torch.device) -> torch.Tensor:
    """Page ids to the GPU once per transfer (range-checked here, so chunks can pass device slices). Pinned: a
    copy from pageable memory would make the host wait for everything queued on the stream first."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise IndexError(f"page id outside [0, {limit})")
    host = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).pin_memory()
    return host.to(device, non_blocking=True)


class PipelinedSender:
    def __init__(self, comm: NcclPairComm, fused: FusedGather, slots: StagingSlots, group: int = 0):
        self.comm, self.fused, self.slots, self.group = comm, fused, slots, group
        self.stream = torch.cuda.Stream(device=comm.device)

    def send(self, ids: np.ndarray, ranges: Sequence[tuple[int, int]], ready: Optional[torch.cuda.Event] = None):
        """Send pages `ids` (all regions of the group), chunked by `ranges`; returns the last send's completion."""
        table = self.fused.groups[self.group]
        done = None
        with torch.cuda.stream(self.stream):
            dev_ids = _upload(ids, min(table.num_items), self.comm.device)
            if ready is not None:
                self.stream.wait_event(ready)  # SGLang's prefill event: never read pages before it
            for k, (lo, hi) in enumerate(ranges):
                s = k % len(self.slots.bufs)
                if self.slots.last_use[s] is not None:
                    self.stream.wait_event(self.slots.last_use[s])
                buf = self.slots.bufs[s]
                nbytes = self.fused.copy(self.group, dev_ids[lo:hi], buf, scatter=False)
                done = self.comm.send(buf[:nbytes])
                self.slots.last_use[s] = done.event
        return done


class PipelinedReceiver:
    def __init__(self, comm: NcclPairComm, fused: FusedGather, slots: StagingSlots, group: int = 0):
        self.comm, self.fused, self.slots, self.group = comm, fused, slots, group
        self.stream = torch.cuda.Stream(device=comm.device)

    def recv(self, ids: np.ndarray, ranges: Sequence[tuple[int, int]]) -> torch.cuda.Event:
        """Post receives and scatters of pages `ids`; returns the event after the last scatter (D's Success)."""
        table = self.fused.groups[self.group]
        page_bytes = sum(table.item_lens)
        n_slots = len(self.slots.bufs)
        ops = {}
        with torch.cuda.stream(self.stream):
            dev_ids = _upload(ids, min(table.num_items), self.comm.device)

            def post(k: int) -> None:
                lo, hi = ranges[k]
                ops[k] = self.comm.recv(self.slots.bufs[k % n_slots][: (hi - lo) * page_bytes])

            for k in range(min(n_slots, len(ranges))):
                post(k)
            for k, (lo, hi) in enumerate(ranges):
                self.stream.wait_event(ops.pop(k).event)
                self.fused.copy(self.group, dev_ids[lo:hi], self.slots.bufs[k % n_slots], scatter=True)
                if k + n_slots < len(ranges):
                    post(k + n_slots)  # waits for the scatter just queued: the slot is free after it
            done = torch.cuda.Event()
            done.record(self.stream)
        return done


def wait_event(event: torch.cuda.Event, timeout: float) -> None:
    """Host wait by polling (a blocking cudaEventSynchronize could not time out)."""
    import time

    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"event not done after {timeout:.1f}s")
        time.sleep(0)
