"""Prefill side of the same-host path: whether a decode rank's pools can be mapped here, and the chunk copy.

A decode rank that offers `cudaipc` sent its pools' CUDA IPC export in its registration. `_ipc_usable` (asked by
`auto` for a same-host peer) checks that the export matches what the decode registered and that this process
can reach its GPU; the first chunk maps it (in the worker that owns the peer, so mapping, copies and unmapping
never race). A peer whose export cannot be mapped is remembered with the reason (logged once) and served by
NCCL from then on, until it registers again. `ResetPeer` (re-registration, death) unmaps the old process's
memory before any chunk of the new one is sent, so no stale mapping is ever written through.
Mixed into `prefill.PrefillKVManager`, whose state it uses.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.copy.heads import PairHeads
from sglang_p2p_backend.engine.transport.onesided import chunk_descriptors
from sglang_p2p_backend.engine.copy.plan import PlanError
from sglang_p2p_backend.engine.transport.base import TransportError
from sglang_p2p_backend.engine.transport.cuda_ipc import IpcUnavailable, check_export, reachable

logger = logging.getLogger(__name__)

_NO_IDS = np.zeros(0, dtype=np.int32)


def registered_regions(reg: wire.PeerRegister) -> list[tuple[int, int]]:
    """(address, bytes) of every region a decode registered (KV, then state components), as its pool sizes say:
    what its IPC export must cover."""
    kv = [(p, reg.kv_pages * n) for p, n in zip(reg.kv_ptrs, reg.kv_item_lens)]
    state = [
        (p, slots * n)
        for ptrs, lens, slots in zip(reg.state_ptrs, reg.agreement.state_item_lens, reg.state_slots)
        for p, n in zip(ptrs, lens)
    ]
    return kv + state


class SameHostPath:
    def _ipc_problem(self, reg: wire.PeerRegister) -> Optional[str]:
        """Why this rank cannot copy into decode rank `reg` through CUDA IPC (None: it can try to map it)."""
        if self.ipc is None:
            return "this prefill rank runs no CUDA IPC path"
        if reg.ipc is None:
            return f"decode rank {reg.session} exports no CUDA IPC memory (its log says why)"
        return reachable(reg.ipc, self.device) or check_export(reg.ipc, registered_regions(reg))

    def _ipc_usable(self, session: str) -> bool:
        """`auto`'s question for a same-host peer (asked every chunk): checked once per registration, a negative
        answer logged once."""
        reg = self.decode_peers.get(session)
        if reg is None or session in self.ipc_failed:
            return False
        if self.ipc_checked.get(session) is reg:
            return True
        problem = self._ipc_problem(reg)
        if problem is not None:
            self._ipc_off(session, problem)
            return False
        self.ipc_checked[session] = reg
        return True

    def _ipc_off(self, session: str, problem: str) -> None:
        self.ipc_failed[session] = problem
        logger.warning("p2pnccl: CUDA IPC path to decode rank %s off, NCCL serves it: %s", session, problem)

    def _ipc_reset(self, session: str) -> None:
        """Worker side of ResetPeer: the old process's memory is unmapped before anything else is sent."""
        if self.ipc is not None:
            self.ipc.forget_peer(session)

    def _send_ipc(self, room: int, peer: wire.PeerRegister, src: list, dst: list, aux: Optional[tuple],
                  heads: Optional[PairHeads] = None) -> bool:
        """Copy one chunk into the decode's pages and wait for it; then the aux row on the control channel.
        False: the peer cannot be mapped (now remembered) and the caller routes again; TransportError when
        `cudaipc` is forced or the copy failed."""
        session = peer.session
        if not self.ipc.mapped(session, peer.ipc):
            try:
                self.ipc.open_peer(session, peer.ipc)
            except IpcUnavailable as e:
                self._ipc_off(session, f"mapping its pools failed: {e}")
                # with SGLANG_P2P_TRANSPORT=cudaipc on either side there is no other transport to this decode
                if self._common_transports(peer) == ["cudaipc"]:
                    raise TransportError(f"decode rank {session} is reachable only through CUDA IPC "
                                         f"(SGLANG_P2P_TRANSPORT=cudaipc), which failed here: {e}; use auto or nccl") from e
                return False
        try:
            if heads is None:
                # whole KV pages: one page-table launch (ids as SGLang gave them); state components as spans
                kv = self.local_memory.kv
                self.ipc.write_pages(session, [r.ptr for r in kv], peer.kv_ptrs, [r.item_len for r in kv],
                                     src[0], dst[0], min((r.num_items for r in kv), default=0), peer.kv_pages)
                src, dst = [_NO_IDS, *src[1:]], [_NO_IDS, *dst[1:]]
            descriptors = chunk_descriptors(self.local_memory, peer, src, dst, None, heads)  # PlanError: nothing moved
            if len(descriptors[0]):
                self.ipc.write(session, *descriptors)
        except (PlanError, TransportError):
            raise  # refused before anything moved (bounds, layout), or the mapping is gone: the room fails
        except BaseException:
            self._poison_unsettled(room)
            raise
        if aux is not None:
            self._send_aux(session, room, *aux)
        return True
