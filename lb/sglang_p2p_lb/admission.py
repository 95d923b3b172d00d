"""Admission control: at most `max_concurrent` requests in flight, the next `queue_size` wait in FIFO order
for at most `queue_timeout` seconds (smg's `--max-concurrent-requests`, `--queue-size`, `--queue-timeout-secs`).

A request beyond the queue gets a 429 at once; one that waited `queue_timeout` without a slot gets a 503.
Both say why and carry Retry-After. A slot freed by a finished request goes straight to the oldest waiter,
so a burst cannot overtake requests that queued before it. A waiter whose client disconnects leaves the
queue (or hands back the slot it was just given).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class Rejection:
    status: int  # 429 queue full, 503 waited too long
    reason: str  # metrics label: queue_full | queue_timeout
    message: str
    retry_after: int


class Admission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout: float) -> None:
        self.max_concurrent, self.queue_size, self.queue_timeout = max_concurrent, max(0, queue_size), queue_timeout
        self.inflight = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _limited(self) -> bool:
        return self.max_concurrent > 0

    async def acquire(self) -> Rejection | None:
        """Take a slot (None) or say why not; the caller must `release()` every slot it got."""
        if not self._limited() or (self.inflight < self.max_concurrent and not self._waiters):
            self.inflight += 1
            return None
        if len(self._waiters) >= self.queue_size:
            what = f"{self.queue_size} more waiting (--queue-size)" if self.queue_size else "no queue (--queue-size 0)"
            return Rejection(429, "queue_full", f"load balancer at capacity: {self.inflight} requests in flight (--max-concurrent-requests {self.max_concurrent}) and {what}", 1)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait({fut}, timeout=self.queue_timeout)
        except asyncio.CancelledError:
            self._leave(fut)
            raise
        if fut.done():
            return None  # release() handed us its slot
        self._leave(fut)
        return Rejection(503, "queue_timeout", f"load balancer at capacity: no slot within --queue-timeout-secs {self.queue_timeout:g} ({self.inflight} in flight, {len(self._waiters)} waiting)", max(1, round(self.queue_timeout)))

    def _leave(self, fut: asyncio.Future) -> None:
        if fut.done() and not fut.cancelled():
            self.release()  # granted just as we gave up: pass the slot on
            return
        fut.cancel()
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter: inflight unchanged
                return
        self.inflight -= 1
