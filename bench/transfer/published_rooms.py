"""A benchmark decode's chunk checks as the decode adapter makes them: against the chunk's room and its sequence.

Every room publishes the same destinations (one request's pages, sent again and again), each in a list of its own,
as every room the decode adapter publishes has: the receiver keys its device copy of a room's ids by that list
(engine/copy/room_ids.py), so rooms sharing one array would find each other's upload. Used by xfer_bench.py's and
engine_pair.py's decodes, with `QueuedScatters` for SGLANG_P2P_DEVICE_SCATTER's counts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from sglang_p2p_backend.engine.wire import checks
from sglang_p2p_backend.engine.wire.messages import ChunkHeader


class PublishedRooms:
    """Rooms published at their first chunk with `ids`; the last `keep` are kept (a room's chunks come one after
    another, so a room is never looked up again once later rooms came). `published`: how many rooms were."""

    def __init__(self, ids: np.ndarray, keep: int = 8):
        self.ids = np.ascontiguousarray(ids, dtype=np.int32)
        self.keep = keep
        self.published = 0
        self._rooms: dict[int, checks.Published] = {}

    def check(self, header: ChunkHeader, item_lens: Sequence[Sequence[int]], slot_bytes: int) -> checks.ChunkVerdict:
        room: Optional[checks.Published] = self._rooms.get(header.room)
        if room is None:
            room = self._rooms[header.room] = checks.Published(self.ids.copy(), -1, [], frozenset({header.session}))
            self.published += 1
            while len(self._rooms) > self.keep:
                self._rooms.pop(next(iter(self._rooms)))
        return checks.chunk_header(header, item_lens, slot_bytes, room)


class QueuedScatters:
    """SGLANG_P2P_DEVICE_SCATTER's counts of one benchmark receiver, told on its thread: what the decode adapter
    keeps per room (adapter/scatter_gate.py), here in all (every room is wanted). `receiver_args()`: the
    receiver's arguments for the mode the environment names."""

    def __init__(self) -> None:
        self.queued = self.ended = 0

    def on_queued(self, room: int) -> bool:
        self.queued += 1
        return True

    def on_ended(self, room: int) -> None:
        self.ended += 1

    def receiver_args(self) -> dict:
        from sglang_p2p_backend.engine.config import EngineConfig

        return {"device_scatter": EngineConfig.from_env().device_scatter, "on_queued": self.on_queued,
                "on_ended": self.on_ended}
