"""Decode rooms whose chunks' scatters are queued on the GPU behind their receives (SGLANG_P2P_DEVICE_SCATTER).

Such a scatter writes the room's pages once the bytes land, with no host step between, so it cannot be called
off when the room fails meanwhile (SGLang's abort, a prefill's failed Status, a dropped channel). SGLang hands a
failed room's pages to the next request (at once without its deferred release), so while any of a room's scatters
may still run, its failure waits: the room's status stays, and it turns Failed once the receivers saw them all
end (or their channel's work settle after an abort), or after the bound, logged. This object keeps the counts and
the waiting failures; the decode role (decode.py) decides and applies, and counts a scatter only under `lock`
after checking that its room is still wanted, so a failure either waits for it or comes before it is queued.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List


class ScatterGate:
    """Per room, the scatters queued on the GPU and not yet seen ended, and the failures waiting for them."""

    def __init__(self, bound_s: float, clock: Callable[[], float] = time.monotonic):
        self.bound_s = bound_s
        self._clock = clock
        #: held by the role across "still wanted? then count it" and "none queued? then fail it"
        self.lock = threading.RLock()
        self._queued: Dict[int, int] = {}
        self._waiting: Dict[int, float] = {}  # room -> when its waiting failure applies anyway
        self.total = 0  # scatters ever counted (tests, benchmarks: whether the mode engaged)

    def queued(self, room: int) -> None:
        """One more scatter of `room` on the GPU (the caller holds `lock` and checked that the room is wanted)."""
        with self.lock:
            self._queued[room] = self._queued.get(room, 0) + 1
            self.total += 1

    def ended(self, room: int) -> bool:
        """One of `room`'s scatters ended: True when that was its last and its failure waited (apply it now)."""
        with self.lock:
            left = self._queued.get(room, 0) - 1
            if left > 0:
                self._queued[room] = left
                return False
            self._queued.pop(room, None)
            return self._waiting.pop(room, None) is not None

    def defer(self, room: int) -> bool:
        """`room` fails: True when a scatter of it is still queued (the failure waits for `ended`), else False
        (apply it now). A failure already waiting keeps its bound."""
        with self.lock:
            if self._queued.get(room, 0) <= 0:
                return False
            self._waiting.setdefault(room, self._clock() + self.bound_s)
            return True

    def waiting(self, room: int) -> bool:
        """Whether `room`'s failure waits for its scatters (it wants no more chunks, and never turns Success)."""
        return room in self._waiting

    def pending(self, room: int) -> bool:
        """Whether a scatter of `room` may still write its pages."""
        return self._queued.get(room, 0) > 0

    def expired(self) -> List[int]:
        """Rooms whose failure waited past the bound: they are let go (their counts dropped) and returned."""
        now = self._clock()
        with self.lock:
            out = [room for room, deadline in self._waiting.items() if deadline <= now]
            for room in out:
                del self._waiting[room]
                self._queued.pop(room, None)
        return out

    def state(self) -> dict:
        """Rooms with a scatter still counted, rooms whose failure waits, and the scatters ever counted."""
        with self.lock:
            return {"pending": sorted(self._queued), "waiting": sorted(self._waiting), "total": self.total}

    def forget(self, room: int) -> None:
        """SGLang has the room's pages back (a Success, or its own deferred release after the drain)."""
        with self.lock:
            self._queued.pop(room, None)
            self._waiting.pop(room, None)
