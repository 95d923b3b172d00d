"""Which live decode registration of a prefill rank gives its slot up when SGLANG_P2P_MAX_PEERS are live.

A slot is earned by work, not by answering at an address: a peer that carries a room the prefill's scheduler
knows (a sender exists for it) is never displaced. Among the idle ones, those that never carried such a room go
first (oldest confirmation first), then those idle longest. So senders that answer at as many addresses as they
like displace only each other and idle decodes (which are told, and register again), never a decode at work.
"""

from __future__ import annotations

import time
from typing import Collection, Dict, Iterable, Optional

from sglang_p2p_backend.adapter.bounded import Bounded


class PeerSlots:
    """When each live peer was confirmed and last carried a known room; not thread-safe (the control thread's)."""

    def __init__(self, limit: int):
        self._since: Dict[str, float] = Bounded(2 * limit)
        self._worked: Dict[str, float] = Bounded(2 * limit)

    def confirmed(self, session: str) -> None:
        self._since[session] = time.monotonic()
        self._worked.pop(session, None)  # a new registration earns its slot again

    def worked(self, sessions: Iterable[str]) -> None:
        now = time.monotonic()
        for session in sessions:
            if session in self._since:
                self._worked[session] = now

    def forget(self, session: str) -> None:
        self._since.pop(session, None)
        self._worked.pop(session, None)

    def victim(self, live: Iterable[str], busy: Collection[str]) -> Optional[str]:
        """The live peer to release for a new one, or None when every live peer carries a known room."""
        idle = [s for s in live if s not in busy]
        if not idle:
            return None
        return min(idle, key=lambda s: (s in self._worked, self._worked.get(s, self._since.get(s, 0.0))))
