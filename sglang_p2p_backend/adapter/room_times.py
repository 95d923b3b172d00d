"""The prefill's steps of each room's transfer, timed (SGLANG_P2P_ROOM_TIMES=1): one log line a room when SGLang's
poll first sees its Success, each step as milliseconds from the room's first chunk queued, where SGLang's
`kv_transfer_latency_ms` starts. In service that figure is a few times the write alone (docs/serving.md); the line
says which step holds the rest. Off (the default) nothing is recorded.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

#: a room's steps in order: its first chunk queued (SGLang's send()), its last chunk queued, that chunk taken by a
#: transfer worker, its waits (SGLang's event, the page ids' copy) ended, its copy queued on the GPU (the same-host
#: path only: planning before it is host time, the rest the device's and the wait's), written to every decode rank,
#: the room concluded here (Success marked, Status sent) and Success seen by SGLang's poll. `concluded` is missing
#: where the poll saw the Success first (it is marked before the Status goes)
STEPS = ("queued", "last_queued", "picked", "ready", "launched", "written", "concluded", "seen")
#: the prefix of the log line (e2e/room_times.py reads it back)
PREFIX = "p2pnccl: room times"


class RoomTimes:
    """Per room, when each step happened: `queued` of its first chunk, the other steps of its latest chunk (each
    chunk's replace the one's before); at most `limit` rooms, the oldest dropped first (a room that fails is never
    seen, and its clear forgets it)."""

    def __init__(self, enabled: bool, limit: int = 4096, clock: Callable[[], float] = time.perf_counter,
                 log: Callable[[str], None] = logger.info):
        self.enabled = enabled
        self.limit = limit
        self._clock = clock
        self._log = log
        self._lock = threading.Lock()
        self._rooms: "collections.OrderedDict[int, dict[str, float]]" = collections.OrderedDict()

    def mark(self, room: int, step: str, when: Optional[Callable[[], Optional[float]]] = None) -> None:
        """Step `step` of `room` now, or at `when()` (a time the clock's, asked only while timing; None: not
        known, nothing marked); `queued` opens the room (its later chunks' count as `last_queued`)."""
        if not self.enabled:
            return
        now = self._clock() if when is None else when()
        if now is None:
            return
        with self._lock:
            times = self._rooms.get(room)
            if times is None:
                if step != "queued":
                    return  # a room opened before this was on, or dropped for the bound
                times = self._rooms[room] = {"chunks": 0.0}
                if len(self._rooms) > self.limit:
                    self._rooms.popitem(last=False)
            if when is not None and now < times.get("ready", now):
                return  # a time from before this chunk was ready: not this chunk's (a write that queued nothing)
            if step == "queued":
                times.setdefault("queued", now)
                times["last_queued"] = now
                times["chunks"] += 1
            else:
                times[step] = now

    def seen(self, room: int) -> Optional[str]:
        """SGLang's poll saw `room` succeed: its line (also logged), and the room forgotten; None when not timed."""
        if not self.enabled:
            return None
        self.mark(room, "seen")
        with self._lock:
            times = self._rooms.pop(room, None)
        if times is None or "queued" not in times:
            return None
        line = line_of(room, times)
        self._log(line)
        return line

    def forget(self, room: int) -> None:
        if self.enabled:
            with self._lock:
                self._rooms.pop(room, None)


def line_of(room: int, times: dict[str, float]) -> str:
    """`PREFIX room R chunks N: step ms, ...` (the steps it reached, from its first chunk queued)."""
    t0 = times["queued"]
    steps = ", ".join(f"{s} {1e3 * (times[s] - t0):.3f}" for s in STEPS[1:] if s in times)
    return f"{PREFIX} {room} chunks {int(times['chunks'])}: {steps}"
