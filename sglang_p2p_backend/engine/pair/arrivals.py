"""Decode-side bookkeeping of what a prefill rank announced versus what has landed, per room.

With a two-sided transport the prefill's "Success" only means its sends completed; the decode must not
report Success before its own receives and scatters of every chunk the prefill announced before that status
(same ordered control channel). `ArrivalTracker` counts chunk headers as they are announced, counts them
again as they land, and holds a prefill's final status until the two counts meet. A chunk that failed to
land fails the room at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

Key = tuple[int, int]  # (room, prefill_rank)
Apply = Callable[[int, int, bool, str], None]  # (room, prefill_rank, success, reason)


@dataclass
class _Pending:
    announced: int = 0
    landed: int = 0
    final: Optional[tuple[bool, str]] = None
    failed: bool = False
    peers: set = field(default_factory=set)


class ArrivalTracker:
    def __init__(self, apply: Apply):
        self._apply = apply
        self._lock = threading.Lock()
        self._rooms: dict[Key, _Pending] = {}

    def announce(self, room: int, prefill_rank: int, peer: str) -> None:
        with self._lock:
            p = self._rooms.setdefault((room, prefill_rank), _Pending())
            p.announced += 1
            p.peers.add(peer)

    def landed(self, room: int, prefill_rank: int, error: Optional[str]) -> None:
        fire = None
        with self._lock:
            p = self._rooms.get((room, prefill_rank))
            if p is None:
                return
            p.landed += 1
            if error is not None and not p.failed:
                p.failed = True
                fire = (False, error)
            elif not p.failed and p.final is not None and p.landed >= p.announced:
                fire = p.final
            if p.landed >= p.announced and (p.failed or p.final is not None):
                del self._rooms[(room, prefill_rank)]
        if fire is not None:
            self._apply(room, prefill_rank, *fire)

    def final(self, room: int, prefill_rank: int, success: bool, reason: str) -> None:
        """The prefill rank concluded the room; applied once every announced chunk has landed."""
        fire = None
        with self._lock:
            p = self._rooms.get((room, prefill_rank))
            if p is None:
                fire = (success, reason)
            elif p.failed:
                if p.landed >= p.announced:
                    del self._rooms[(room, prefill_rank)]
                else:
                    p.final = (success, reason)
            elif not success or p.landed >= p.announced:
                # a failure is reported at once; chunks still in flight land and are dropped
                fire = (success, reason)
                p.failed = not success
                p.final = fire
                if p.landed >= p.announced:
                    del self._rooms[(room, prefill_rank)]
            else:
                p.final = (success, reason)
        if fire is not None:
            self._apply(room, prefill_rank, *fire)

    def peer_lost(self, peer: str, reason: str) -> None:
        """Fail every room still waiting on chunks from `peer`."""
        with self._lock:
            lost = [k for k, p in self._rooms.items() if peer in p.peers and p.landed < p.announced and not p.failed]
            for k in lost:
                del self._rooms[k]
        for room, rank in lost:
            self._apply(room, rank, False, reason)

    def forget(self, room: int) -> None:
        with self._lock:
            for k in [k for k in self._rooms if k[0] == room]:
                p = self._rooms[k]
                if p.landed >= p.announced:
                    del self._rooms[k]
                else:
                    p.failed = True  # chunks still in flight land (and are discarded) later

    def peers(self, room: int, prefill_rank: int) -> list[str]:
        """The peers that announced chunks of (room, prefill_rank) not all settled yet (none once every
        announced chunk landed and the room concluded)."""
        with self._lock:
            p = self._rooms.get((room, prefill_rank))
            return sorted(p.peers) if p is not None else []

    def pending(self) -> int:
        with self._lock:
            return len(self._rooms)
