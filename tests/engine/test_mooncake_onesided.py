"""One-sided chunk descriptors (`engine/transport/onesided.py`): which bytes a chunk writes where, checked by applying
the descriptors to real host buffers, and that a chunk is exactly one transport `write`. Needs no Mooncake
(the PD suite runs the same path over real Mooncake tcp)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from sglang_p2p_backend.engine.copy.memory import Region
from sglang_p2p_backend.engine.wire.agreement import local_agreement
from sglang_p2p_backend.engine.wire.messages import PeerRegister
from sglang_p2p_backend.engine.transport.local_memory import LocalMemory
from sglang_p2p_backend.engine.transport.onesided import OneSidedSender, chunk_descriptors
from sglang_p2p_backend.engine.copy.plan import PlanError
from sglang_p2p_backend.engine.transport.base import OneSidedTransport, TransportError

PAGES, ITEM, REGIONS = 32, 48, 3
SLOTS, SLOT_ITEM = 4, 40
AUX_ROWS = 8
AUX_ITEMS = (16, 64)  # prefill row sizes; the decode has one buffer more and a wider second row


class Side:
    """Host buffers laid out as one rank's KV regions, one state component and aux buffers."""

    def __init__(self, seed: int, aux_items: tuple[int, ...]):
        rng = np.random.default_rng(seed)
        self.kv = [rng.integers(0, 256, PAGES * ITEM, dtype=np.uint8) for _ in range(REGIONS)]
        self.state = rng.integers(0, 256, SLOTS * SLOT_ITEM, dtype=np.uint8)
        self.aux = [rng.integers(0, 256, AUX_ROWS * n, dtype=np.uint8) for n in aux_items]
        self.aux_items = aux_items

    def memory(self) -> LocalMemory:
        return LocalMemory(
            kv=[Region(a.ctypes.data, a.size, ITEM) for a in self.kv],
            state=[[Region(self.state.ctypes.data, self.state.size, SLOT_ITEM)]],
            aux=[Region(a.ctypes.data, a.size, n) for a, n in zip(self.aux, self.aux_items)],
        )

    def register(self, mooncake_session: str = "127.0.0.1:1") -> PeerRegister:
        agreement = local_agreement(page_size=1, kv_dtype="bfloat16", kv_item_lens=[ITEM] * REGIONS,
                                    state_item_lens=[[SLOT_ITEM]], slot_bytes=1 << 20, auth=False)
        return PeerRegister(
            session="127.0.0.1:2", incarnation=1, hostname="h", engine_rank=0, attn_tp_size=1, agreement=agreement,
            kv_ptrs=[a.ctypes.data for a in self.kv], aux_ptrs=[a.ctypes.data for a in self.aux],
            aux_item_lens=list(self.aux_items), state_ptrs=[[self.state.ctypes.data]],
            kv_pages=PAGES, aux_rows=AUX_ROWS, state_slots=[SLOTS],
            transports=["mooncake"], mooncake_session=mooncake_session,
        )


class MemcpyTransport(OneSidedTransport):
    """Applies writes with memmove in this process and records every call."""

    name = "memcpy"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def register(self, regions) -> None:
        pass

    def session_id(self) -> str:
        return "local"

    def write(self, session, src, dst, lengths) -> None:
        self.calls.append((session, len(src)))
        for s, d, n in zip(src, dst, lengths):
            ctypes.memmove(int(d), int(s), int(n))


def test_last_chunk_is_one_write_of_runs_state_and_aux() -> None:
    p, d = Side(1, AUX_ITEMS), Side(2, AUX_ITEMS + (8,))
    d.aux[1] = np.zeros(AUX_ROWS * 96, dtype=np.uint8)  # decode rows of buffer 1 are wider: 96 B
    d.aux_items = (16, 96, 8)
    before = [a.copy() for a in d.kv]
    src = np.array([3, 4, 5, 9, 20], dtype=np.int32)
    dst = np.array([10, 11, 12, 0, 7], dtype=np.int32)  # runs: 3-5 -> 10-12, 9 -> 0, 20 -> 7
    t = MemcpyTransport()
    sent = OneSidedSender(t, p.memory()).send(d.register(), [src, np.array([2])], [dst, np.array([1])], aux=(5, 6))

    # 3 runs per region x 3 regions + 1 state slot + 2 aux rows (the common prefix of the aux buffers)
    assert t.calls == [("127.0.0.1:1", 3 * REGIONS + 1 + 2)]
    assert sent == 5 * ITEM * REGIONS + SLOT_ITEM + 16 + 64
    for r in range(REGIONS):
        got, want, old = d.kv[r].reshape(PAGES, ITEM), p.kv[r].reshape(PAGES, ITEM), before[r].reshape(PAGES, ITEM)
        assert np.array_equal(got[dst], want[src])
        untouched = np.setdiff1d(np.arange(PAGES), dst)
        assert np.array_equal(got[untouched], old[untouched])
    assert np.array_equal(d.state.reshape(SLOTS, SLOT_ITEM)[1], p.state.reshape(SLOTS, SLOT_ITEM)[2])
    assert np.array_equal(d.aux[0].reshape(AUX_ROWS, 16)[6], p.aux[0].reshape(AUX_ROWS, 16)[5])
    row = d.aux[1].reshape(AUX_ROWS, 96)[6]
    assert np.array_equal(row[:64], p.aux[1].reshape(AUX_ROWS, 64)[5]) and not row[64:].any()


def test_empty_state_group_and_no_aux_write_only_kv() -> None:
    p, d = Side(3, AUX_ITEMS), Side(4, AUX_ITEMS)
    empty = np.zeros(0, dtype=np.int32)
    s, _, n = chunk_descriptors(p.memory(), d.register(), [np.arange(4), empty], [np.arange(4, 8), empty])
    assert len(s) == REGIONS and list(n) == [4 * ITEM] * REGIONS  # one merged run per region


def test_ids_that_do_not_pair_up_are_refused_before_any_write() -> None:
    p, d = Side(5, AUX_ITEMS), Side(6, AUX_ITEMS)
    t = MemcpyTransport()
    with pytest.raises(PlanError, match="prefill sends 3 pages but decode published 2"):
        OneSidedSender(t, p.memory()).send(d.register(), [np.arange(3)], [np.arange(2)])
    with pytest.raises(PlanError, match="state component 1 is not registered"):
        OneSidedSender(t, p.memory()).send(d.register(), [np.arange(1), np.arange(1), np.arange(1)],
                                            [np.arange(1), np.arange(1), np.arange(1)])
    assert t.calls == []


def test_peer_without_mooncake_memory_is_refused() -> None:
    p, d = Side(7, AUX_ITEMS), Side(8, AUX_ITEMS)
    with pytest.raises(TransportError, match="registered no Mooncake memory"):
        OneSidedSender(MemcpyTransport(), p.memory()).send(d.register(mooncake_session=""), [np.arange(1)], [np.arange(1)])


def test_local_memory_lists_every_region_for_registration() -> None:
    m = Side(9, AUX_ITEMS).memory()
    assert len(m.regions()) == REGIONS + 1 + len(AUX_ITEMS)
    assert all(length > 0 for _, length in m.regions())


class PageTableMemcpy(MemcpyTransport):
    """A `PageTableTransport` (the CUDA IPC path's shape): whole pages applied page by page, every call recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.page_calls: list[tuple] = []
        self.alone: list[bool] = []

    def write_pages(self, session, src_bases, dst_bases, item_bytes, src_ids, dst_ids, src_pages, dst_pages,
                    alone=False) -> int:
        self.page_calls.append((src_bases, item_bytes, src_pages))
        self.alone.append(alone)
        for s, d, n in zip(src_bases, dst_bases, item_bytes):
            for a, b in zip(np.asarray(src_ids).tolist(), np.asarray(dst_ids).tolist()):
                ctypes.memmove(int(d) + b * n, int(s) + a * n, n)
        return len(src_ids) * sum(item_bytes)


def test_a_whole_page_chunk_is_one_page_table_write_its_regions_read_once_per_registration() -> None:
    prefill, decode = Side(1, AUX_ITEMS), Side(2, AUX_ITEMS)
    local, peer, t = prefill.memory(), decode.register(), PageTableMemcpy()
    sender = OneSidedSender(t, local, whole_pages=True)
    src, dst = np.array([3, 4, 9], dtype=np.int32), np.array([0, 1, 30], dtype=np.int32)
    assert sender.send(peer, [src], [dst]) == 3 * ITEM * REGIONS
    assert sender.send(peer, [src + 1], [dst + 1], state=()) == 3 * ITEM * REGIONS
    # no state, no aux: nothing but the page-table write (no empty descriptor batch after it)
    assert t.calls == [] and len(t.page_calls) == 2
    for r in range(REGIONS):
        for a, b in zip([3, 4, 5, 9, 10], [0, 1, 2, 30, 31]):
            assert bytes(decode.kv[r][b * ITEM:(b + 1) * ITEM]) == bytes(prefill.kv[r][a * ITEM:(a + 1) * ITEM])
    # the regions as write_pages takes them, made once: the same objects every chunk
    (bases, items, pages), second = t.page_calls[0], t.page_calls[1]
    assert bases == tuple(a.ctypes.data for a in prefill.kv) and items == (ITEM,) * REGIONS and pages == PAGES
    assert second[0] is bases and second[1] is items
    # another list of regions (a memory registered again): read afresh
    sender.local = prefill.memory()
    sender.send(peer, [src], [dst])
    assert t.page_calls[-1][0] is not bases and t.page_calls[-1][0] == bases
    # an aux row still goes as descriptors after the pages
    sender.send(peer, [src], [dst], aux=(1, 2))
    assert len(t.calls) == 1
    # the caller's word that no forward pass runs beside this chunk reaches the page-table write
    sender.send(peer, [src], [dst], alone=True)
    assert t.alone == [False] * 4 + [True]
