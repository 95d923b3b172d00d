"""A test-only proof that a room's KV arrived byte for byte, independent of the model's numerics.

Off unless SGLANG_P2P_TEST_KV_DIGEST=1. A prefill rank digests the pages it sent for a room (every KV region,
the room's source pages in send order; no aux or state) once the last chunk reached every decode rank, just
before its Success; a decode rank digests the room's destination pages once every prefill rank reported Success,
after the test-only corruption (kv_fault.py, so that control shows as a mismatch), just before its Success. Both
log one WARNING line (`format_line`), which e2e/kv_digest.py pairs by room. The digest is engine/copy/page_hash.py's
exact one, computed on the pool's device. It compares only where a page's bytes are whole on both sides (MLA at
any TP, MHA/GQA at the same attention TP and page size): the line says what the comparer needs to decide.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from sglang_p2p_backend.adapter.bounded import Bounded
from sglang_p2p_backend.engine.copy.page_hash import room_digest

logger = logging.getLogger(__name__)

#: rooms whose sent pages a prefill rank keeps at most (a room's entry goes at its Success or clear; this only
#: bounds what a room that never concludes could leave)
_ROOMS = 1 << 12


@dataclass(frozen=True)
class DigestLabel:
    """Who logs a digest: what the comparer pairs and judges comparability by."""

    role: str  # "prefill" or "decode"
    rank: int  # the engine rank within its server
    attn_tp_rank: int
    attn_tp_size: int
    mla: bool
    page_size: int


def format_line(label: DigestLabel, room: int, pages: int, digest: int) -> str:
    """The logged line: `p2p kv digest <role> room=R rank=E attn_tp=r/n mla=0|1 page=P pages=N digest=<hex>`."""
    return (f"p2p kv digest {label.role} room={room} rank={label.rank} attn_tp={label.attn_tp_rank}/"
            f"{label.attn_tp_size} mla={int(label.mla)} page={label.page_size} pages={pages} digest={digest:016x}")


class KVDigest:
    """One rank's digests: the prefill collects each room's source pages per chunk (`sent`) and logs them at
    its Success (`log_sent`); the decode logs the pages it holds (`log_held`)."""

    def __init__(self, label: DigestLabel, kv_views: Sequence[torch.Tensor]):
        self.label = label
        self.kv_views = kv_views  # (pages, page bytes) views of the KV regions only
        self._sent: "Bounded[int, list[np.ndarray]]" = Bounded(_ROOMS)

    def sent(self, room: int, kv_indices: np.ndarray) -> None:
        """A chunk of `room` is queued: its source pages come next in send order."""
        chunks = self._sent.get(room)
        if chunks is None:
            self._sent[room] = chunks = []  # through Bounded's __setitem__, which setdefault would skip
        chunks.append(np.asarray(kv_indices, dtype=np.int64).reshape(-1))

    def forget(self, room: int) -> None:
        """The room concluded or failed: nothing of it stays."""
        self._sent.pop(room, None)

    def log_sent(self, room: int) -> Optional[int]:
        """Digest and log the pages sent for `room` (None: no chunk of it was seen here)."""
        chunks = self._sent.pop(room, None)
        if chunks is None:
            return None
        return self._log(room, np.concatenate(chunks))

    def log_held(self, room: int, kv_ids: np.ndarray) -> Optional[int]:
        """Digest and log the pages `room` holds here, in the order the prefill sent into them."""
        return self._log(room, np.asarray(kv_ids, dtype=np.int64).reshape(-1))

    def _log(self, room: int, pages: np.ndarray) -> Optional[int]:
        """Digest and log; a digest that cannot be computed is logged as such (the comparer then misses that
        room and the check fails, visibly) and never changes the room's own outcome: this is a test tool."""
        try:
            digest = room_digest(self.kv_views, pages) if self.kv_views else 0
        except Exception as e:  # noqa: BLE001 - e.g. a CUDA error raised by the hash's first kernel
            logger.error("p2p kv digest %s room=%d not computed: %s: %s", self.label.role, room, type(e).__name__,
                         str(e).splitlines()[0] if str(e) else "")
            return None
        logger.warning("%s", format_line(self.label, room, len(pages), digest))
        return digest
