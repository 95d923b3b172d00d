"""The communicator pool of one rank as its threads use it: a lock around `CommPool`, victims closed while the
lock is held, busy marks around transfers, and the settings (budget, cap ladder, cost table) from `EngineConfig`.

The prefill owns every pair's traffic, so only the prefill closes communicators: its own victims at admission,
idle ones a decode asks it to release (`close_if_idle`). The decode admits without evicting (`evict=False`)
and answers a prefill's offer with the cap it can afford, or "no room".
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator

from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.pair.comm_pool import H200_COST, H200_COST_NO_CUMEM, Admission, Cap, CommCost, CommPool, Decision


class NoRoom(RuntimeError):
    """No communicator fits this rank's (or the peer's) budget now: use another transport or try again."""


def cost_for(role: str, cumem: bool = True) -> CommCost:
    """The measured cost table of this GPU's role; without cuMem (NCCL_CUMEM_ENABLE=0) NCCL uses legacy IPC
    buffers, about twice the memory."""
    return (H200_COST if cumem else H200_COST_NO_CUMEM)[role]


def cap_to_wire(cap: Cap) -> int:
    return 0 if cap is None else int(cap)


def cap_from_wire(value: int) -> Cap:
    return None if value == 0 else int(value)


class CommBudget:
    """Thread-safe front of a `CommPool`. `close_peer(peer)` closes that peer's idle communicator; it is called
    with the lock held, so the peer's owner cannot start a transfer on it meanwhile."""

    def __init__(self, pool: CommPool, close_peer: Callable[[Hashable], None] = lambda peer: None):
        self.pool = pool
        self._close_peer = close_peer
        self._lock = threading.Lock()
        #: opened / evicted / released / no_room counts and the peak MB held, for logs, metrics and tests
        self.stats: Counter = Counter()
        self.peak_mb = 0.0

    @classmethod
    def from_config(
        cls, config: EngineConfig, role: str, close_peer: Callable[[Hashable], None] = lambda peer: None
    ) -> "CommBudget":
        """The pool of a "prefill" or "decode" rank with the configured budget, caps and cost table."""
        pool = CommPool(config.nccl_budget_mb, ladder=config.nccl_caps, cost=cost_for(role, config.nccl_cumem))
        return cls(pool, close_peer)

    def fits(self, peer: Hashable) -> bool:
        """Would `peer` get a communicator now (a live one, or a new one within budget)?"""
        with self._lock:
            return self.pool.would_admit(peer).action is not Admission.NO_FIT

    def admit(self, peer: Hashable, max_cap: Cap = None, *, evict: bool = True) -> Decision:
        """Commit a decision for `peer`; the victims are closed before this returns. Raises NoRoom."""
        with self._lock:
            try:
                d = self.pool.admit(peer, max_cap, evict=evict)
            except ValueError as e:  # the peer's cap is below every cap of this rank's ladder
                raise NoRoom(str(e)) from None
            if d.action is Admission.NO_FIT:
                self.stats["no_room"] += 1
                raise NoRoom(d.reason)
            for victim in d.victims:
                self.stats["evicted"] += 1
                self._close_peer(victim)
            self.peak_mb = max(self.peak_mb, self.pool.used_mb)
            return d

    def opened(self, peer: Hashable, cap: Cap) -> None:
        with self._lock:
            self.pool.opened(peer, cap)
            self.stats["opened"] += 1
            self.peak_mb = max(self.peak_mb, self.pool.used_mb)

    def closed(self, peer: Hashable) -> None:
        with self._lock:
            self.pool.closed(peer)

    def close_if_idle(self, peer: Hashable) -> bool:
        """Close the peer's communicator if it is up and idle (a decode short of room asked); True if closed."""
        with self._lock:
            if not self.pool.idle(peer):
                return False
            self.pool.closed(peer)
            self.stats["released"] += 1
            self._close_peer(peer)
            return True

    @contextmanager
    def using(self, peer: Hashable) -> Iterator[bool]:
        """Mark the peer's communicator busy for a transfer; yields False when it has none (closed meanwhile)."""
        with self._lock:
            live = peer in self.pool
            if live:
                self.pool.acquire(peer)
        try:
            yield live
        finally:
            if live:
                with self._lock:
                    self.pool.release(peer)

    def touch(self, peer: Hashable) -> None:
        """The peer's channel carries traffic now (the decode's view): most recently used."""
        with self._lock:
            if peer in self.pool:
                self.pool.acquire(peer)
                self.pool.release(peer)

    def idle_peers(self) -> list[Hashable]:
        """Peers with an idle communicator, least recently used first."""
        with self._lock:
            return [p for p in self.pool.live() if self.pool.idle(p)]

    def used_mb(self) -> float:
        with self._lock:
            return self.pool.used_mb
