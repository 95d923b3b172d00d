"""Whole-page same-host copies: the page table the kernel reads, the spans it amounts to, and the checks the
transport makes before a launch (ids inside both pools, id arrays that pair up, destination regions inside the
decode's export), run with the shared-memory stand-in of CUDA IPC: real bytes between two pools, nothing
written when a check fails."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_p2p_backend.engine.copy.memory import Region
from sglang_p2p_backend.engine.copy.plan import copy_descriptors
from sglang_p2p_backend.engine.copy.span_copy import RegionTables, expand_pages, page_table
from sglang_p2p_backend.engine.transport import cuda_ipc
from sglang_p2p_backend.engine.transport.base import TransportError
from support.shm_ipc import ShmBackend

ITEM = 48  # bytes of one page in a region (3 words of 16)
REGIONS = 3
PAGES = 40  # pages of every region, both sides


def test_page_table_rows_and_expansion_match_the_descriptor_plan():
    table = page_table([1000, 5000], [9000, 13000], [32, 64], word=8)
    assert table.tolist() == [[1000, 9000, 32, 4], [5000, 13000, 64, 8]]
    src_ids, dst_ids = np.array([3, 4, 9]), np.array([7, 8, 2])
    s, d, n = expand_pages([1000, 5000], [9000, 13000], [32, 64], src_ids, dst_ids)
    assert s.tolist() == [1096, 1128, 1288, 5192, 5256, 5576]
    assert d.tolist() == [9224, 9256, 9064, 13448, 13512, 13128]
    assert n.tolist() == [32, 32, 32, 64, 64, 64]
    # the same bytes as the one-sided plan, whose runs merge adjacent pages (3,4 -> 7,8)
    ps, pd, pn = copy_descriptors([1000, 5000], [9000, 13000], [32, 64], src_ids, dst_ids)
    covered = lambda a, b, c: sorted((x + k, y + k) for x, y, m in zip(a, b, c) for k in range(0, m, 8))  # noqa: E731
    assert covered(s, d, n) == covered(ps, pd, pn)


@pytest.fixture
def pair():
    """A decode pool exported through the stand-in and mapped by a 'prefill' transport in this process."""
    shm = ShmBackend()
    cuda_ipc.use_backend(shm)
    try:
        cpu = torch.device("cpu")
        dst_pool = shm.allocate(REGIONS * PAGES * ITEM)
        dst_pool.zero_()
        src_pool = torch.arange(REGIONS * PAGES * ITEM, dtype=torch.int64).remainder(251).to(torch.uint8) + 1
        dst_regions = [(dst_pool.data_ptr() + r * PAGES * ITEM, PAGES * ITEM) for r in range(REGIONS)]
        decode = cuda_ipc.CudaIpcTransport(cpu)
        decode.register(dst_regions)
        prefill = cuda_ipc.CudaIpcTransport(cpu)
        prefill.open_peer("d", decode.export)
        src_bases = [src_pool.data_ptr() + r * PAGES * ITEM for r in range(REGIONS)]
        dst_bases = [p for p, _ in dst_regions]
        yield prefill, src_pool, dst_pool, src_bases, dst_bases
        prefill.close()
    finally:
        cuda_ipc.use_backend(None)
        shm.close()


def _page(pool: torch.Tensor, region: int, page: int) -> bytes:
    start = (region * PAGES + page) * ITEM
    return pool[start:start + ITEM].numpy().tobytes()


def test_pages_land_in_every_region_and_nothing_else_changes(pair):
    tr, src, dst, sb, db = pair
    src_ids, dst_ids = np.array([0, 5, 6, 39], dtype=np.int32), np.array([39, 1, 2, 20], dtype=np.int32)
    moved = tr.write_pages("d", sb, db, [ITEM] * REGIONS, src_ids, dst_ids, PAGES, PAGES)
    assert moved == 4 * REGIONS * ITEM
    for r in range(REGIONS):
        for s_id, d_id in zip(src_ids, dst_ids):
            assert _page(dst, r, int(d_id)) == _page(src, r, int(s_id))
        untouched = set(range(PAGES)) - set(int(x) for x in dst_ids)
        assert all(_page(dst, r, p) == bytes(ITEM) for p in untouched)


@pytest.mark.parametrize("src_ids, dst_ids, match", [
    ([1, 2], [3, PAGES], rf"destination page {PAGES} is outside the pool's {PAGES} pages"),
    ([1, 2], [-1, 3], "destination page -1 is outside"),
    ([1, PAGES + 7], [3, 4], rf"source page {PAGES + 7} is outside"),
    ([1, 2, 3], [3, 4], "3 source pages but 2 destination pages"),
])
def test_ids_outside_a_pool_or_unpaired_are_refused_and_nothing_moves(pair, src_ids, dst_ids, match):
    tr, src, dst, sb, db = pair
    with pytest.raises(TransportError, match=match):
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array(src_ids), np.array(dst_ids), PAGES, PAGES)
    assert not dst.any()


def test_a_destination_pool_larger_than_the_export_is_refused_before_any_copy(pair):
    tr, src, dst, sb, db = pair
    # the decode claims one page more per region than it exported: the last region would run past the export
    with pytest.raises(TransportError, match="outside every region the decode exported"):
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([0]), np.array([0]), PAGES, PAGES + 1)
    with pytest.raises(TransportError, match="do not pair up"):
        tr.write_pages("d", sb, db[:2], [ITEM] * REGIONS, np.array([0]), np.array([0]), PAGES, PAGES)
    with pytest.raises(TransportError, match="not mapped"):
        tr.write_pages("nobody", sb, db, [ITEM] * REGIONS, np.array([0]), np.array([0]), PAGES, PAGES)
    assert not dst.any()
    assert tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([], dtype=np.int32),
                          np.array([], dtype=np.int32), PAGES, PAGES) == 0


def test_regions_with_their_own_item_sizes():
    src = [Region(0, 0, 16), Region(0, 0, 64)]
    s, d, n = expand_pages([r.ptr for r in src], [100, 200], [r.item_len for r in src], np.array([2]), np.array([1]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([32, 128], [116, 264], [16, 64])


def test_a_peer_is_translated_once_and_every_chunk_still_checked(pair, monkeypatch):
    """The pools' translation is kept per peer: later chunks reuse it, but a chunk naming other pools, or one
    after the peer was mapped again, is checked against the export anew (and refused where it does not fit)."""
    tr, src, dst, sb, db = pair
    calls = []
    translate = cuda_ipc.RegionTable.translate
    monkeypatch.setattr(cuda_ipc.RegionTable, "translate", lambda self, d, n: calls.append(len(d)) or translate(self, d, n))
    items = [ITEM] * REGIONS
    for k in range(3):
        tr.write_pages("d", list(sb), list(db), list(items), np.array([k]), np.array([k + 10]), PAGES, PAGES)
    assert calls == [REGIONS]  # three chunks, one translation
    plan = tr.plan_pages("d", sb, db, items, np.array([1]), np.array([2]), PAGES, PAGES)
    assert not any(a.flags.writeable for a in (plan.src_bases, plan.dst_bases, plan.item_bytes))
    # other pools (a pool one page longer than exported): translated again and refused, nothing moves
    before = dst.clone()
    with pytest.raises(TransportError, match="outside every region the decode exported"):
        tr.write_pages("d", sb, db, items, np.array([0]), np.array([0]), PAGES, PAGES + 1)
    assert calls == [REGIONS, REGIONS] and torch.equal(dst, before)
    # the page ids are still checked on a chunk whose pools were translated before
    with pytest.raises(TransportError, match=f"destination page {PAGES} is outside"):
        tr.write_pages("d", sb, db, items, np.array([0]), np.array([PAGES]), PAGES, PAGES)
    # mapped again (a restarted decode): the first chunk after it translates against the new mapping
    export = tr._peers["d"].export  # noqa: SLF001
    tr.open_peer("d", export)
    tr.write_pages("d", sb, db, items, np.array([5]), np.array([6]), PAGES, PAGES)
    assert calls == [REGIONS, REGIONS, REGIONS]
    for r in range(REGIONS):
        assert _page(dst, r, 6) == _page(src, r, 5)
    tr.forget_peer("d")
    assert "d" not in tr._pools  # noqa: SLF001
    tr.open_peer("d", export)
    tr.write_pages("d", sb, db, items, np.array([7]), np.array([8]), PAGES, PAGES)
    tr.close()
    assert tr._pools == {}  # noqa: SLF001


def test_the_kernel_table_is_made_once_for_the_same_read_only_pools_and_anew_otherwise():
    tables = RegionTables()
    frozen = [np.array(v, dtype=np.int64) for v in ([1000, 5000], [9000, 13000], [32, 64])]
    for a in frozen:
        a.flags.writeable = False
    first = tables.get(*frozen)
    assert first[0] == 8 and first[1].tolist() == [[1000, 9000, 32, 4], [5000, 13000, 64, 8]]
    assert first[2:] == (8, 96)  # widest item in words, bytes a page of every region
    assert tables.get(*frozen) is first  # a peer's next chunk: the same arrays, the same table
    # equal values in other arrays, a caller's lists, or a read-only view of a writable array: made anew, and
    # a changed list gets its own table
    assert tables.get(*[a.copy() for a in frozen]) is not first
    lists = [[1000, 5000], [9000, 13000], [32, 64]]
    assert tables.get(*lists)[1].tolist() == first[1].tolist()
    lists[2][1] = 16
    assert tables.get(*lists)[1].tolist() == [[1000, 9000, 32, 4], [5000, 13000, 16, 2]]
    backing = np.array([1000, 5000], dtype=np.int64)
    view = backing[:]
    view.flags.writeable = False
    made = tables.get(view, frozen[1], frozen[2])
    backing[0] = 2000  # the view's values change under it: no table may be kept for it
    assert tables.get(view, frozen[1], frozen[2]) is not made
    assert tables.get(view, frozen[1], frozen[2])[1][0, 0] == 2000
