"""When an operation queued on a pair's stream should end: the rate the link has shown, and the queue ahead of it.

A thread waiting for a chunk polls (engine/waiting.py); with its sleeps doubling up to 0.5 ms, a chunk that
ends just after a poll is seen up to 0.5 ms late, and the next receive is posted that much later: on NVLink,
where a 128 MiB chunk moves in ~0.5 ms, that is the link idle half the time. Knowing when the chunk should end,
the waiter sleeps until then in one piece (no wake-ups, no GIL taken from the scheduler) and polls finely only
from there. Pure bookkeeping, no CUDA: the transport feeds it each finished operation's bytes and GPU time.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Optional


class LinkPace:
    """The fastest rate of the last `window` operations of one pair stream, and when the stream's queue ends.

    The fastest, not the mean: an operation's GPU time includes any wait for the peer to post its half, so the
    mean underrates the link, and an end expected too late would make the waiter sleep past it. Expected too
    early only costs a few fine polls. Operations below `min_bytes` do not teach the rate (their time is
    launch latency, not bandwidth)."""

    #: rates below this are not a link's (a first operation that also connected, a peer that posted late)
    MIN_RATE = 100e6
    #: operations seen before the rate is trusted: one that waited long for its peer must not set it alone
    MIN_SAMPLES = 3

    def __init__(self, window: int = 32, min_bytes: int = 1 << 20):
        self._rates: deque[float] = deque(maxlen=window)
        self.min_bytes = min_bytes
        self._queue_end = 0.0  # monotonic time the operations queued so far should be done
        self._lock = threading.Lock()  # the posting thread and a waiting one

    def rate(self) -> Optional[float]:
        """Bytes per second, None until an operation taught one."""
        with self._lock:
            return max(self._rates) if len(self._rates) >= self.MIN_SAMPLES else None

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes >= self.min_bytes and seconds > 0 and nbytes / seconds >= self.MIN_RATE:
            with self._lock:
                self._rates.append(nbytes / seconds)

    def expect(self, now: float, nbytes: int) -> Optional[float]:
        """The monotonic time an operation of `nbytes` queued now should end: after what is queued before it,
        at the rate shown; None while no rate is known (then nothing is queued in the estimate either)."""
        rate = self.rate()
        if rate is None:
            return None
        with self._lock:
            self._queue_end = max(now, self._queue_end) + nbytes / rate
            return self._queue_end
