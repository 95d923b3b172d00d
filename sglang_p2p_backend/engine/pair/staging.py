"""A bounded pool of staging buffers: back-pressure instead of dropping KV when space is short.

Chunks are planned to fit one slot; a sender or receiver that finds every slot busy waits for one (the
transfer slows down, nothing is dropped). A wait past `timeout` raises, so a stuck peer surfaces as a
failed room with a reason rather than a hang. Slots are allocated once, at first use.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch

from sglang_p2p_backend.engine.transport.base import TransportError


class StagingPool:
    def __init__(self, alloc: Callable[[int], torch.Tensor], slot_bytes: int, num_slots: int):
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"staging needs positive sizes, got {num_slots} slots of {slot_bytes} bytes")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._alloc = alloc
        self._free: list[torch.Tensor] = []
        self._created = 0
        self._cond = threading.Condition()
        self._closed = False
        self._waiting = 0  # acquire() calls waiting for a slot

    def acquire(self, timeout: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise TransportError("staging pool closed")
                if self._free:
                    return self._free.pop()
                if self._created < self.num_slots:
                    self._created += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(
                        f"no staging slot free for {timeout:.0f}s ({self.num_slots} x {self.slot_bytes >> 20} MiB "
                        f"busy); raise SGLANG_P2P_STAGING_MB or check the peer"
                    )
                self._waiting += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting -= 1
        return self._make()

    def try_acquire(self) -> Optional[torch.Tensor]:
        """A spare slot for an end that holds one already, else None; never waits. Spare means nobody waits for
        a slot and another one stays available after this, so a pair end whose peer stalls holds at most two
        slots and never the last: ends of other peers keep one to work with (isolation), and ends holding one
        slot each never wait on each other for a second."""
        with self._cond:
            available = len(self._free) + (self.num_slots - self._created)
            if self._closed or self._waiting or available < 2:
                return None
            if self._free:
                return self._free.pop()
            self._created += 1
        return self._make()

    def _make(self) -> torch.Tensor:
        """Allocate a slot counted as created; the count is given back if the allocation fails, which is a
        TransportError naming the size (the room fails; nothing else is left half done)."""
        try:
            buf = self._alloc(self.slot_bytes)
            if buf.is_cuda:
                # the allocator may hand back memory freed on this thread's stream with kernels still queued;
                # the slot is used on the pair's streams, which do not wait for that stream
                torch.cuda.current_stream(buf.device).synchronize()
            return buf
        except BaseException as e:
            with self._cond:
                self._created -= 1
                self._cond.notify()
            if isinstance(e, Exception) and not isinstance(e, TransportError):
                raise TransportError(f"could not allocate a staging slot of {self.slot_bytes >> 20} MiB: {e}; "
                                     f"lower SGLANG_P2P_STAGING_MB or free GPU memory") from e
            raise

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def has_waiters(self) -> bool:
        """Whether an acquire() is waiting for a slot (an end holding two gives one back)."""
        with self._cond:
            return self._waiting > 0

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._created - len(self._free)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._free.clear()
            self._cond.notify_all()
