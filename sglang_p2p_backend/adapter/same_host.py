"""Prefill side of the same-host path: whether a decode rank's pools can be mapped here, and the chunk copy.

A decode rank that offers `cudaipc` sent its pools' CUDA IPC export in its registration. `usable` (asked by
`auto` for a same-host peer) checks that the export matches what the decode registered and that this process
can reach its GPU; the first chunk maps it (in the worker that owns the peer, so mapping, copies and unmapping
never race). A peer whose export cannot be mapped is remembered with the reason (logged once) and served by
NCCL from then on, until it registers again. `ResetPeer` (re-registration, death) unmaps the old process's
memory before any chunk of the new one is sent, so no stale mapping is ever written through. The chunk itself
goes through the one-sided sender (engine/transport/onesided.py) that Mooncake uses too.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, List, Mapping, Optional, Sequence

import numpy as np
import torch

from sglang_p2p_backend.adapter.bounded import Bounded
from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.copy.heads import PairHeads
from sglang_p2p_backend.engine.copy.state_slices import StatePlan
from sglang_p2p_backend.engine.transport.local_memory import LocalMemory
from sglang_p2p_backend.engine.transport.onesided import OneSidedSender, session_address
from sglang_p2p_backend.engine.copy.plan import PlanError
from sglang_p2p_backend.engine.transport.base import TransportError
from sglang_p2p_backend.engine.copy.launches import Launch
from sglang_p2p_backend.engine.transport.cuda_ipc import (CudaIpcTransport, IpcUnavailable, WriteMarks, backend,
                                                          check_export, reachable)

logger = logging.getLogger(__name__)


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
    """The per-peer state of the CUDA IPC path: which decode ranks passed the check, which cannot be mapped
    (and why), and the mappings themselves (in the transport). `ipc`: this rank's IPC transport (None: the
    path is off); `peers`: the live decode registrations; `common_transports(reg)`: the transports this rank
    and `reg` share."""

    def __init__(
        self,
        ipc: Optional[CudaIpcTransport],
        local: LocalMemory,
        device: torch.device,
        peers: Mapping[str, wire.PeerRegister],
        common_transports: Callable[[wire.PeerRegister], List[str]],
        max_peers: int,
    ):
        self.ipc = ipc
        self.device = device
        self._peers = peers
        self._common_transports = common_transports
        # an IPC copy is synchronised before it returns: a TransportError proves nothing is still writing
        self._sender = (OneSidedSender(ipc, local, session_address, settled=(PlanError, TransportError), whole_pages=True)
                        if ipc is not None else None)
        #: decode ranks the CUDA IPC path cannot serve (why), until they register again
        self.failed: dict[str, str] = Bounded(max_peers)
        self._checked: dict[str, wire.PeerRegister] = Bounded(max_peers)  # registrations that passed
        # a peer's memory is (un)mapped only once no launch into it is running: `launch` holds this while it
        # checks the mapping and queues; a worker holds it while it waits for the peer's last launch and
        # (un)maps (`_settled`)
        self._mapping = threading.Lock()
        #: each peer's last launch (SGLang's thread has at most one running: cuda_ipc's `launch`)
        self._launched: dict[str, Launch] = Bounded(max_peers)
        #: launches also time their copies on the device (SGLANG_P2P_ROOM_TIMES: the room line's `gpu_copy`)
        self.timed = False

    def problem(self, reg: wire.PeerRegister) -> Optional[str]:
        """Why this rank cannot copy into decode rank `reg` through CUDA IPC (None: it can try to map it)."""
        if self.ipc is None:
            return "this prefill rank runs no CUDA IPC path"
        if reg.ipc is None:
            return f"decode rank {reg.session} exports no CUDA IPC memory (its log says why)"
        return reachable(reg.ipc, self.device) or check_export(reg.ipc, registered_regions(reg))

    def usable(self, session: str) -> bool:
        """`auto`'s question for a same-host peer (asked every chunk): checked once per registration, a negative
        answer logged once."""
        reg = self._peers.get(session)
        if reg is None or session in self.failed:
            return False
        if self._checked.get(session) is reg:
            return True
        problem = self.problem(reg)
        if problem is not None:
            self._off(session, problem)
            return False
        self._checked[session] = reg
        return True

    def _off(self, session: str, problem: str) -> None:
        self.failed[session] = problem
        logger.warning("p2pnccl: CUDA IPC path to decode rank %s off, NCCL serves it: %s", session, problem)

    def registered(self, session: str) -> None:
        """A new decode process registered as `session`: its export is checked afresh."""
        self.failed.pop(session, None)

    def forget(self, session: str) -> None:
        """Decode rank `session` is dead: its registration's check no longer holds."""
        self._checked.pop(session, None)

    def reset(self, session: str) -> None:
        """Worker side of ResetPeer: the old process's memory is unmapped before anything else is sent (after
        the last launch into it ran)."""
        if self.ipc is not None:
            with self._mapping:
                self._settled(session)
                self.ipc.forget_peer(session)

    def _settled(self, session: str) -> None:
        """Wait for the peer's last launch (under `_mapping`); a copy that failed is its own chunk's worker's to
        report."""
        launched = self._launched.pop(session, None)
        if launched is not None:
            try:
                launched.wait()
            except Exception as e:  # noqa: BLE001 - reported where that chunk's worker waits for it
                logger.debug("p2pnccl: a launch into decode rank %s failed: %r", session, e)

    def send(self, peer: wire.PeerRegister, src: list, dst: list, heads: Optional[PairHeads],
             unsettled: Callable[[], None], state: Sequence[Optional[StatePlan]] = (), alone: bool = False) -> bool:
        """Copy one chunk into the decode's pages and wait for it (the aux row is the caller's: it goes on the
        control channel). False: the peer cannot be mapped (now remembered) and the caller routes again;
        TransportError when `cudaipc` is forced or the copy failed; `unsettled` is called when a failed copy
        cannot prove it stopped. `alone`: no forward pass runs beside this copy (the transport's quickest route)."""
        session = peer.session
        if not self.ipc.mapped(session, peer.ipc):
            try:
                with self._mapping:  # a new process behind the session: the old mapping goes once idle
                    self._settled(session)
                    self.ipc.open_peer(session, peer.ipc)
            except IpcUnavailable as e:
                self._off(session, f"mapping its pools failed: {e}")
                # with SGLANG_P2P_TRANSPORT=cudaipc on either side there is no other transport to this decode
                if self._common_transports(peer) == ["cudaipc"]:
                    raise TransportError(f"decode rank {session} is reachable only through CUDA IPC "
                                         f"(SGLANG_P2P_TRANSPORT=cudaipc), which failed here: {e}; use auto or nccl") from e
                return False
        self._sender.send(peer, src, dst, None, heads, unsettled, state, alone)
        return True

    def mapped(self, peer: wire.PeerRegister) -> bool:
        """Whether this registration of the peer is mapped here (a dict lookup: SGLang's thread asks it first)."""
        return self.ipc is not None and self.ipc.mapped(peer.session, peer.ipc)

    def launch(self, peer: wire.PeerRegister, src: np.ndarray, dst: np.ndarray,
               unsettled: Callable[[], None], alone: bool = False) -> Optional[Launch]:
        """The KV pages `src` -> `dst` of one chunk queued on this thread, whole pages to a peer already mapped,
        the wait left to the returned Launch (SGLANG_P2P_IPC_LAUNCH=scheduler: SGLang's thread queues, the
        worker waits). None, nothing queued, where the peer is not mapped yet (its worker maps it), a worker
        (un)maps a peer at this moment, or this thread cannot launch now (cuda_ipc's `launch`); errors as
        `send`'s, with nothing left running (`alone` as `send`'s). Never waits: it runs on SGLang's scheduler
        thread."""
        if self.ipc is None or not self._mapping.acquire(blocking=False):  # a worker (un)maps a peer now
            return None
        try:
            if not self.mapped(peer):
                return None
            got = backend().launch(self.device, lambda: self._sender.send(peer, [src], [dst], None, None, unsettled,
                                                                          alone=alone), timed=self.timed)
            if got is None:
                return None
            self._launched[peer.session] = got[1]
            return got[1]
        finally:
            self._mapping.release()

    def last_write(self) -> Optional[WriteMarks]:
        """This thread's last chunk copy's host steps (planned, queued on the device before its wait; None where
        the backend does not record them): a room's time from its copy queued to its end is the device's."""
        return backend().last_write()
