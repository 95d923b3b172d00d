"""Destinations of a room's next attempt that reach the prefill before its concluded attempt was cleared.

A decode may bootstrap the same room again (a retracted request) as soon as it concluded the first attempt, so
its RoomMetadata can reach this prefill rank while the first attempt's sender, concluded here, waits for the
scheduler to clear it. Merged into that attempt's destinations they would be wiped with them by the clear,
leaving the next sender in Bootstrapping until SGLang's timeout. They are kept here instead and published once
the old sender was cleared.
"""

from __future__ import annotations

import threading
from typing import Callable, List

from sglang_p2p_backend.adapter.bounded import Bounded
from sglang_p2p_backend.engine.wire import messages as wire

#: destinations kept per room (one per decode rank of the next attempt)
_PER_ROOM = 64


class NextAttempts:
    """`hold` and `release` run under one lock, so a RoomMetadata is either kept and published by the release,
    or sees the old attempt cleared."""

    def __init__(self, rooms: int):
        self._lock = threading.Lock()
        self._held: Bounded = Bounded(rooms)

    def hold(self, msg: wire.RoomMetadata, concluded: Callable[[], bool]) -> bool:
        """Keep `msg` when `concluded()` says its room's previous attempt is concluded and not yet cleared."""
        with self._lock:
            if not concluded():
                return False
            held = self._held.get(msg.room)
            if held is None:
                self._held[msg.room] = held = []
            if len(held) < _PER_ROOM:
                held.append(msg)
            return True

    def release(self, room: int, cleared: Callable[[], None]) -> List[wire.RoomMetadata]:
        """The old attempt of `room` is cleared (`cleared()` records it): what was kept for the next one."""
        with self._lock:
            cleared()
            return self._held.pop(room, [])
