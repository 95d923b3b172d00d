"""The prefill's bootstrap-side record of KV transfers: decodes wait on a room until its prefill ends."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class RoomRegistry:
    """Prefill-side record of KV transfers, read by decodes through the bootstrap server."""

    def __init__(self, ttl: float = 300.0) -> None:
        self._rooms: dict[int, tuple[asyncio.Event, list[Any]]] = {}
        self._ttl = ttl

    def _entry(self, room: int) -> tuple[asyncio.Event, list[Any]]:
        if room not in self._rooms:
            # [status, dp_rank, created, cached tokens]; status None until the prefill ends
            self._rooms[room] = (asyncio.Event(), [None, None, time.monotonic(), 0])
        return self._rooms[room]

    def finish(self, room: int, ok: bool, rank: int, cached: int = 0) -> None:
        ev, st = self._entry(room)
        st[0], st[1], st[3] = ("ok" if ok else "failed"), rank, cached
        ev.set()

    def cached(self, room: int) -> int:
        return self._rooms[room][1][3] if room in self._rooms else 0

    async def wait(self, room: int, timeout: float) -> tuple[str, int | None]:
        ev, st = self._entry(room)
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            return "timeout", None
        return st[0], st[1]

    def expire(self) -> None:
        cutoff = time.monotonic() - self._ttl
        for room in [r for r, (_, st) in self._rooms.items() if st[2] < cutoff]:
            del self._rooms[room]
