"""Which peers are alive: the time each watched peer was last heard from, and who has been silent too long.

Every message from a peer counts as a sign of life (heartbeats are only the floor when nothing else flows).
Pure bookkeeping: the manager's liveness thread sends the heartbeats, asks `expired()` each tick and fails
the rooms of the peers it returns. `SGLANG_P2P_PEER_TIMEOUT` (seconds, default 8) is the silence after which
a peer is dead; heartbeats go out every quarter of it, so one or two lost heartbeats are not a death, and
silence is checked twice a second, so a dead peer's rooms fail within timeout + 0.5 s (under 10 s at defaults).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

DEFAULT_PEER_TIMEOUT_S = 8.0


class PeerWatch:
    def __init__(self, timeout_s: float = DEFAULT_PEER_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.interval_s = timeout_s / 4
        self._clock = clock
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def watch(self, peer: str) -> None:
        """Start watching `peer` (it counts as heard from now) or refresh it."""
        with self._lock:
            self._last[peer] = self._clock()

    def seen(self, peer: str) -> None:
        """A message from `peer` arrived: refreshed if watched, ignored otherwise (no entry for strangers)."""
        with self._lock:
            if peer in self._last:
                self._last[peer] = self._clock()

    def forget(self, peer: str) -> None:
        with self._lock:
            self._last.pop(peer, None)

    def alive(self, peer: str) -> bool:
        with self._lock:
            last = self._last.get(peer)
            return last is not None and self._clock() - last <= self.timeout_s

    def silent_for(self, peer: str) -> Optional[float]:
        with self._lock:
            last = self._last.get(peer)
            return None if last is None else self._clock() - last

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._last)

    def expired(self) -> list[tuple[str, float]]:
        """Peers silent longer than the timeout, with their silence; they are no longer watched."""
        now = self._clock()
        with self._lock:
            dead = [(p, now - t) for p, t in self._last.items() if now - t > self.timeout_s]
            for p, _ in dead:
                del self._last[p]
        return dead
