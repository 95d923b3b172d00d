"""Decode-side bookkeeping of what a prefill rank announced versus what has landed, per room.

With a two-sided transport the prefill's "Success" only means its sends completed; the decode must not
report Success before its own receives and scatters of every chunk the prefill sent. `ArrivalTracker` counts
chunk headers as they are announced, counts them again as they land, and holds a prefill's final status until
the two counts meet and reach the count the status names (`wire.Status.chunks`): the control channel keeps order
per socket, but a socket closed for the peer cap still delivers what it queued while the next message goes out
on a new one, so a status can come before the room's last header. A chunk that failed to land fails the room at
once, and so does a Success naming fewer chunks than were announced.
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
    #: chunks the prefill rank's Success names: it holds until this many were announced
    expected: int = 0
    final: Optional[tuple[bool, str]] = None
    failed: bool = False
    peers: set = field(default_factory=set)

    @property
    def settled(self) -> bool:
        """Every chunk the prefill rank sent (as far as known) has landed."""
        return self.landed >= self.announced >= self.expected


class ArrivalTracker:
    def __init__(self, apply: Apply):
        self._apply = apply
        self._lock = threading.Lock()
        self._rooms: dict[Key, _Pending] = {}

    def announce(self, room: int, prefill_rank: int, peer: str) -> None:
        fire = None
        with self._lock:
            p = self._rooms.setdefault((room, prefill_rank), _Pending())
            p.announced += 1
            p.peers.add(peer)
            if p.final is not None and p.final[0] and not p.failed and p.announced > p.expected:
                p.failed = True  # a header after a Success that named fewer: the room cannot be trusted
                fire = (False, _more_than_said(room, p.expected, p.announced))
        if fire is not None:
            self._apply(room, prefill_rank, *fire)

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
            elif not p.failed and p.final is not None and p.settled:
                fire = p.final
            if p.landed >= p.announced and (p.failed or (p.final is not None and p.settled)):
                del self._rooms[(room, prefill_rank)]
        if fire is not None:
            self._apply(room, prefill_rank, *fire)

    def final(self, room: int, prefill_rank: int, success: bool, reason: str, chunks: int = 0,
              peer: Optional[str] = None) -> None:
        """The prefill rank concluded the room: a Success is applied once the `chunks` it names were announced and
        every announced chunk landed (a failure at once). `peer`: its session, whose loss fails a held room."""
        fire = None
        with self._lock:
            p = self._rooms.get((room, prefill_rank))
            if p is None and success and chunks > 0:  # its headers are still on their way
                p = self._rooms[(room, prefill_rank)] = _Pending(expected=chunks, final=(success, reason))
                if peer is not None:
                    p.peers.add(peer)
            elif p is None:
                fire = (success, reason)
            elif success and not p.failed and p.announced > chunks:
                fire = (False, _more_than_said(room, chunks, p.announced))
                p.failed, p.final = True, fire
                if p.landed >= p.announced:
                    del self._rooms[(room, prefill_rank)]
            elif p.failed:
                if p.landed >= p.announced:
                    del self._rooms[(room, prefill_rank)]
                else:
                    p.final = (success, reason)
            elif not success or p.landed >= p.announced >= chunks:
                # a failure is reported at once; chunks still in flight land and are dropped
                fire = (success, reason)
                p.failed = not success
                p.final = fire
                if p.landed >= p.announced:
                    del self._rooms[(room, prefill_rank)]
            else:
                p.final, p.expected = (success, reason), chunks
                if peer is not None:
                    p.peers.add(peer)
        if fire is not None:
            self._apply(room, prefill_rank, *fire)

    def peer_lost(self, peer: str, reason: str) -> None:
        """Fail every room still waiting on chunks from `peer`."""
        with self._lock:
            lost = [k for k, p in self._rooms.items() if peer in p.peers and not p.settled and not p.failed]
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


def _more_than_said(room: int, said: int, announced: int) -> str:
    return (f"prefill reported Success for room {room} after {said} chunk(s), but {announced} were announced here: "
            f"the room's chunks cannot be told apart")
