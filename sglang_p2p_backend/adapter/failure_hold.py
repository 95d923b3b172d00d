"""Decode rooms failed on this side while a prefill rank may still write into their pages one-sided.

Without SGLang's deferred decode KV release (0.5.17 has none; 0.5.23 with it off) the scheduler frees a failed
room's pages at once, and a one-sided write (CUDA IPC, Mooncake: the prefill writes straight into them) cannot be
stopped from here: the next request given those pages would get the old room's bytes. So the decode role holds
a failure it starts (its own checks, a lost prefill, SGLang's heartbeat of the server, its waiting timeout): the
room's status stays, the prefill ranks that may write are told (RoomFailed), and the room turns Failed once each
answered (a Status it sends after its last write of the room ended), is known gone, or after
SGLANG_P2P_FAILURE_HOLD_S. This object only keeps the waits; the role decides and applies.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List


@dataclass
class _Hold:
    waiting: set
    deadline: float


class FailureHolds:
    """Per held room, the prefill ranks (sessions) whose answer it waits for, and until when at most."""

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic):
        self.hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._rooms: Dict[int, _Hold] = {}

    def begin(self, room: int, waiting: Iterable[str]) -> bool:
        """Hold `room` for `waiting`; False when it is held already (another thread failed it first)."""
        with self._lock:
            if room in self._rooms:
                return False
            self._rooms[room] = _Hold(set(waiting), self._clock() + self.hold_s)
            return True

    def held(self, room: int) -> bool:
        return room in self._rooms

    def answered(self, room: int, sessions: Iterable[str]) -> bool:
        """`sessions` wrote the last of `room`: True when the room waited for nothing else (its hold ended)."""
        with self._lock:
            hold = self._rooms.get(room)
            if hold is None:
                return False
            hold.waiting.difference_update(sessions)
            if hold.waiting:
                return False
            del self._rooms[room]
            return True

    def gone(self, session: str) -> List[int]:
        """Prefill rank `session` cannot write any more: the rooms whose hold ended with it."""
        with self._lock:
            rooms = [room for room, hold in self._rooms.items() if session in hold.waiting]
        return [room for room in rooms if self.answered(room, [session])]

    def expired(self, rooms: Iterable[int] = ()) -> List[int]:
        """Rooms (of `rooms`, or all) held past their bound: their holds end now."""
        now = self._clock()
        with self._lock:
            wanted = set(rooms) if rooms else self._rooms.keys()
            out = [room for room in list(wanted) if room in self._rooms and self._rooms[room].deadline <= now]
            for room in out:
                del self._rooms[room]
        return out

    def forget(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)


def process_gone(endpoint: str, timeout_s: float = 0.5) -> bool:
    """Whether the process behind control endpoint "ip:port" has exited: its port refuses connections (a frozen
    process's kernel still accepts them; a port taken over by another process counts as not gone)."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False
