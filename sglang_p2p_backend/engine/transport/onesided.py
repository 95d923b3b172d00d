"""One-sided chunk writes: a chunk's merged page runs of every KV region, its state slots and the aux row,
as one batch of (src, dst, len) descriptors written straight into the decode's registered memory.

The prefill's transfer worker that owns the peer calls `OneSidedSender.send` once per SGLang chunk (so one
peer's chunks stay in order), then, after the last chunk, sends Status on the control channel. `write`
returns only once the bytes are in the decode's memory (RDMA: the RC write completed; Mooncake tcp: the
target acknowledged after applying them, which Mooncake's tcp framing v2, in 0.3.13, does), so that Status
cannot overtake its data. The decode announced no chunks for such a peer and applies the Status at once
(engine/pair/arrivals.py). The aux row goes in the last chunk's batch too, so SGLang's metadata gate (the
`bootstrap_room` row) opens no earlier than the KV has landed.

The same sender drives the same-host CUDA IPC path (transport/cuda_ipc.py): there a peer is addressed by its
control session, whole KV pages go with one page-table launch (`whole_pages`), and the aux row travels on the
control channel instead (IPC reaches device memory only).

Groups follow `plan.py`: group 0 is the KV pool (the decode's `kv_ptrs`), group g >= 1 is state component
g-1 (`state_ptrs[g-1]`). Item lengths were compared at registration, so one length serves both sides, except
for KV pages with different attention TP: then the prefill writes its head range of every token row into the
decode's (one descriptor per row and region, as Mooncake's `send_kvcache_slice`), with the decode's page size
from its registration.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from sglang_p2p_backend.engine.copy.memory import Region
from sglang_p2p_backend.engine.transport.local_memory import LocalMemory
from sglang_p2p_backend.engine.wire.messages import PeerRegister
from sglang_p2p_backend.engine.copy.heads import PairHeads
from sglang_p2p_backend.engine.copy.state_slices import StatePlan
from sglang_p2p_backend.engine.copy.plan import PlanError, copy_descriptors
from sglang_p2p_backend.engine.transport.base import OneSidedTransport, TransportError

Descriptors = tuple[np.ndarray, np.ndarray, np.ndarray]  # (src addresses, dst addresses, lengths)


def _group(local: LocalMemory, peer: PeerRegister, g: int) -> tuple[list[int], list[int], list[int]]:
    """(source bases, destination bases, item lengths) of group `g`."""
    if g == 0:
        regions, dst = local.kv, peer.kv_ptrs
    elif g - 1 < min(len(local.state), len(peer.state_ptrs)):
        regions, dst = local.state[g - 1], peer.state_ptrs[g - 1]
    else:
        raise PlanError(f"state component {g - 1} is not registered on both sides")
    return [r.ptr for r in regions], list(dst), [r.item_len for r in regions]


def aux_descriptors(aux: Sequence[Region], peer: PeerRegister, src_index: int, dst_index: int) -> Descriptors:
    """The request's aux row of every buffer both sides have (the common prefix, as SGLang's
    `check_peer_aux_buffer_count` allows), each row at its own side's row size."""
    rows = list(zip(aux, peer.aux_ptrs, peer.aux_item_lens))
    src = np.array([r.ptr + r.item_len * src_index for r, _, _ in rows], dtype=np.int64)
    dst = np.array([d + d_len * dst_index for _, d, d_len in rows], dtype=np.int64)
    lens = np.array([min(r.item_len, d_len) for r, _, d_len in rows], dtype=np.int64)
    return src, dst, lens


def chunk_descriptors(
    local: LocalMemory,
    peer: PeerRegister,
    src_ids: Sequence[np.ndarray],
    dst_ids: Sequence[np.ndarray],
    aux: Optional[tuple[int, int]] = None,
    heads: Optional[PairHeads] = None,
    state: Sequence[Optional[StatePlan]] = (),
) -> Descriptors:
    """Every descriptor of one chunk: per group, merged page runs region-major (with `heads`, the KV group's
    head range of every token row instead; with `state[c]`, those spans of state component c's items); then the
    aux row (`aux` = (prefill row, decode row)) when given."""
    parts: list[Descriptors] = []
    for g, (s, d) in enumerate(zip(src_ids, dst_ids)):
        src_ptrs, dst_ptrs, item_lens = _group(local, peer, g)
        if g == 0:
            sliced, dst_lens = heads, peer.kv_item_lens
        else:
            sliced = state[g - 1] if g - 1 < len(state) else None
            # the decode's own item sizes: they differ from ours when the component is sliced over TP
            dst_lens = peer.agreement.state_item_lens[g - 1] if sliced is not None else None
        parts.append(copy_descriptors(src_ptrs, dst_ptrs, item_lens, np.asarray(s), np.asarray(d), sliced,
                                      dst_lens if sliced is not None else None))
    if aux is not None:
        parts.append(aux_descriptors(local.aux, peer, *aux))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


_NO_IDS = np.zeros(0, dtype=np.int32)


def mooncake_address(peer: PeerRegister) -> str:
    """Where Mooncake writes to reach `peer`: the engine session it registered."""
    if not peer.mooncake_session:
        raise TransportError(f"decode rank {peer.session} registered no Mooncake memory")
    return peer.mooncake_session


def session_address(peer: PeerRegister) -> str:
    """Where CUDA IPC writes to reach `peer`: its mapping is kept under its control session."""
    return peer.session


class PageTableTransport(Protocol):
    """A one-sided transport that copies whole pages from a page-id table in one launch (CUDA IPC)."""

    def write_pages(self, session: str, src_bases: Sequence[int], dst_bases: Sequence[int], item_bytes: Sequence[int],
                    src_ids: np.ndarray, dst_ids: np.ndarray, src_pages: int, dst_pages: int,
                    alone: bool = False) -> int: ...


def _nothing() -> None:
    return None


class OneSidedSender:
    """Writes chunks to any peer that registered one-sided memory. Thread-safe as far as the transport is
    (Mooncake serialises writes per peer); each peer's chunks come from the one worker that owns it.

    `address` names the peer to the transport. `settled` are the errors after which no byte of the chunk can
    still be moving: a Mooncake batch may still run after its sync call returned a TransportError, a CUDA IPC
    copy was synchronised or never started. `whole_pages` (a `PageTableTransport`): KV pages without a head
    range go as one page-table write, the rest as descriptors."""

    def __init__(
        self,
        transport: OneSidedTransport,
        local: LocalMemory,
        address: Callable[[PeerRegister], str] = mooncake_address,
        settled: tuple[type[BaseException], ...] = (PlanError,),
        whole_pages: bool = False,
    ):
        self.transport = transport
        self.local = local
        self.address = address
        self.settled = settled
        self.whole_pages = whole_pages
        #: `_kv_pool`'s answer for the list `local.kv` it was made from
        self._kv: Optional[tuple[list, tuple[int, ...], tuple[int, ...], int]] = None

    def send(
        self,
        peer: PeerRegister,
        src_ids: Sequence[np.ndarray],
        dst_ids: Sequence[np.ndarray],
        aux: Optional[tuple[int, int]] = None,
        heads: Optional[PairHeads] = None,
        unsettled: Callable[[], None] = _nothing,
        state: Sequence[Optional[StatePlan]] = (),
        alone: bool = False,
    ) -> int:
        """One batch write of the chunk (and aux row); returns bytes written. Raises PlanError when the ids
        do not pair up, TransportError when the write fails (Mooncake then skips the peer until it registers
        again). Any error but a `settled` one calls `unsettled` before it propagates. `alone`: no forward pass
        runs beside this chunk's copy (a page-table transport may then take its quickest route)."""
        try:
            session = self.address(peer)
            moved = 0
            if self.whole_pages and heads is None:
                moved = self._write_kv_pages(session, peer, src_ids[0], dst_ids[0], alone)
                if aux is None and not any(len(ids) for ids in src_ids[1:]):
                    return moved  # nothing else in the chunk
                src_ids, dst_ids = [_NO_IDS, *src_ids[1:]], [_NO_IDS, *dst_ids[1:]]
            src, dst, lens = chunk_descriptors(self.local, peer, src_ids, dst_ids, aux, heads, state)
            if len(src):
                self.transport.write(session, src, dst, lens)
            return moved + int(lens.sum())
        except self.settled:
            raise
        except BaseException:
            unsettled()
            raise

    def _write_kv_pages(self, session: str, peer: PeerRegister, src: np.ndarray, dst: np.ndarray,
                        alone: bool = False) -> int:
        """Whole KV pages src -> dst of every region in one launch (ids as SGLang gave them)."""
        bases, items, pages_a_region = self._kv_pool()
        pages: PageTableTransport = self.transport  # type: ignore[assignment]
        return pages.write_pages(session, bases, peer.kv_ptrs, items, src, dst, pages_a_region, peer.kv_pages, alone)

    def _kv_pool(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """This rank's KV regions as `write_pages` takes them: bases, item sizes, the fewest items a region has.
        Made again only when `local.kv` is another list (the regions are fixed once registered): rebuilt per
        chunk, these were a third of a chunk's host time with 64 regions."""
        kv = self.local.kv
        cached = self._kv
        if cached is None or cached[0] is not kv:
            cached = self._kv = (kv, tuple(r.ptr for r in kv), tuple(r.item_len for r in kv),
                                 min((r.num_items for r in kv), default=0))
        return cached[1], cached[2], cached[3]
