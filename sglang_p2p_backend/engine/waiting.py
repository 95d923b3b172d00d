"""Waiting for GPU work (a CUDA event, an NCCL status) from a Python thread without a blocking call.

A blocking stream or event sync cannot time out when the peer died with a receive posted, so the transfer
threads poll. Polling with `time.sleep(0)` keeps the thread runnable: every iteration asks for the GIL back,
and inside an SGLang scheduler that GIL is the one its CPU-bound launch loop needs, so a spinning transfer
thread taxes every decode or prefill step while a chunk is in flight. `Deadline.pause` therefore sleeps, in
steps that double from `FIRST_S` to `MAX_S`: a chunk that is done at once is seen within tens of
microseconds, a long one costs a wake-up every `MAX_S`, not a spin. A wait that knows when its work should end
(`expected_end`, transport/link_pace.py) sleeps until then in one piece and starts the doubling from there, so
it is neither late by up to `MAX_S` nor awake while the work runs; for `FINE_AFTER_S` after that sleep it polls
every `FIRST_S` before it backs off, since the work is due (and an end expected early, as a sender's is when its
peer posts late, would otherwise be seen up to a doubled step late).
"""
from __future__ import annotations

import time
from typing import Callable, Optional


class Deadline:
    """A timeout and a backoff for one wait."""

    FIRST_S = 20e-6
    MAX_S = 0.5e-3
    #: the longest sleep until an expected end: an estimate gone wrong costs at most this once per wait
    PACED_MAX_S = 5e-3
    #: after the sleep until an expected end, polls stay at FIRST_S this long before they double: a send's end
    #: is expected from the link's rate and its own queue, and comes later by however long the receiver took to
    #: post its half (a header's hop and an NCCL launch, ~0.1-0.3 ms), where doubling steps would see it up to
    #: one step (0.16-0.32 ms by then) late. Bounded, so an estimate gone wrong costs ~50 wake-ups once
    FINE_AFTER_S = 1e-3

    def __init__(self, timeout: float, expected_end: Optional[float] = None):
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self._next = self.FIRST_S
        #: monotonic time the awaited work should be done: the first pause sleeps until then (not past the deadline)
        self._expected = expected_end
        self._fine_until = 0.0  # polls every FIRST_S until then (FINE_AFTER_S past a paced sleep)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def next_pause(self) -> float:
        """How long the next pause lasts, the schedule moved on by one: until the expected end (once), then
        FIRST_S for FINE_AFTER_S, then doubling to MAX_S. For a waiter that waits on something else than a
        sleep (the decode's receiver waits on its queue, which a header wakes)."""
        now = time.monotonic()
        if self._expected is not None:
            ahead = min(self._expected - now, self.deadline - now, self.PACED_MAX_S)
            self._expected = None
            self._fine_until = now + max(ahead, 0.0) + self.FINE_AFTER_S
            if ahead > self.FIRST_S:
                return ahead
        if now < self._fine_until:
            return self.FIRST_S
        step = self._next
        self._next = min(self._next * 2, self.MAX_S)
        return step

    def pause(self) -> None:
        time.sleep(self.next_pause())


def wait_until(done: Callable[[], bool], timeout: float, expected_end: Optional[float] = None) -> bool:
    """Poll `done` with backoff until it is true (True) or `timeout` seconds passed (False); `expected_end` as
    for Deadline (now or earlier: fine polls from the start)."""
    wait = Deadline(timeout, expected_end)
    while not done():
        if wait.left() <= 0:
            return False
        wait.pause()
    return True
