"""`copy_descriptors` builds a chunk's one-sided descriptors with one broadcast over (region, run) instead of a
Python loop per layer: these tests hold it to the per-region loop it replaced (kept here as the reference), on
whole pages and on head slices, element for element and in the same order."""
from __future__ import annotations

import numpy as np
import pytest

from sglang_p2p_backend.engine.copy.heads import Heads, PairHeads
from sglang_p2p_backend.engine.copy.plan import PlanError, copy_descriptors, page_runs


def _loop_whole(src_ptrs, dst_ptrs, item_lens, src_ids, dst_ids):
    """The per-region loop copy_descriptors ran before (reference)."""
    runs = page_runs(src_ids, dst_ids)
    srcs, dsts, lens = [], [], []
    for sp, dp, il in zip(src_ptrs, dst_ptrs, item_lens):
        srcs.append(sp + runs[:, 0] * il)
        dsts.append(dp + runs[:, 1] * il)
        lens.append(runs[:, 2] * il)
    if not srcs:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e
    return np.concatenate(srcs), np.concatenate(dsts), np.concatenate(lens)


def _loop_heads(src_ptrs, dst_ptrs, src_lens, dst_lens, src_ids, dst_ids, heads):
    """The per-region loop _head_descriptors ran before (reference)."""
    src_ids = np.asarray(src_ids, dtype=np.int64).reshape(-1, 1)
    dst_ids = np.asarray(dst_ids, dtype=np.int64).reshape(-1, 1)
    rows = np.arange(heads.src.rows, dtype=np.int64).reshape(1, -1)
    srcs, dsts, lens = [], [], []
    for sp, dp, sl, dl in zip(src_ptrs, dst_ptrs, src_lens, dst_lens):
        hb = heads.src.head_bytes(sl)
        s = sp + src_ids * sl + rows * (sl // heads.src.rows) + heads.src.lo * hb
        d = dp + dst_ids * dl + rows * (dl // heads.dst.rows) + heads.dst.lo * hb
        srcs.append(s.reshape(-1))
        dsts.append(d.reshape(-1))
        lens.append(np.full(s.size, heads.src.count * hb, dtype=np.int64))
    return np.concatenate(srcs), np.concatenate(dsts), np.concatenate(lens)


def _same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == np.int64
        assert x.tolist() == y.tolist()


@pytest.mark.parametrize("regions, pages, seed", [(1, 1, 0), (3, 7, 1), (61, 130, 2), (64, 1024, 3)])
def test_whole_pages_equal_the_per_region_loop(regions, pages, seed):
    rng = np.random.default_rng(seed)
    src_ptrs = (np.arange(regions) * (1 << 32) + (1 << 40)).tolist()
    dst_ptrs = (np.arange(regions) * (1 << 32) + (1 << 44)).tolist()
    item_lens = rng.choice([2048, 4096, 73728], size=regions).tolist()
    src_ids = rng.permutation(2 * pages)[:pages]
    # half the destinations consecutive, so runs of several pages merge
    dst_ids = np.concatenate([np.arange(pages // 2) + 5, rng.permutation(4 * pages)[: pages - pages // 2] + pages])
    src_ids[: pages // 2] = np.arange(pages // 2) + 3
    _same(copy_descriptors(src_ptrs, dst_ptrs, item_lens, src_ids, dst_ids),
          _loop_whole(src_ptrs, dst_ptrs, item_lens, src_ids, dst_ids))


def test_whole_pages_exact_small_case():
    s, d, n = copy_descriptors([1000, 5000], [90000, 70000], [16, 8], np.array([3, 4, 9]), np.array([0, 1, 2]))
    assert s.tolist() == [1048, 1144, 5024, 5072]
    assert d.tolist() == [90000, 90032, 70000, 70016]
    assert n.tolist() == [32, 16, 16, 8]


def test_no_pages_or_no_regions_give_empty_int64_arrays():
    for args in (([], [], [], np.array([1]), np.array([2])), ([8], [16], [4], np.zeros(0), np.zeros(0))):
        out = copy_descriptors(*args)
        assert [a.tolist() for a in out] == [[], [], []]
        assert all(a.dtype == np.int64 for a in out)


@pytest.mark.parametrize("src_tp_heads, dst_heads, rows, regions", [
    ((8, 0, 4), (4, 0, 4), 1, 4),    # prefill holds 8 heads, decode rank takes 4 of them at its 0
    ((8, 4, 8), (4, 0, 4), 16, 64),  # the upper half, page size 16, 64 regions
    ((2, 0, 2), (4, 2, 4), 16, 3),   # decode TP smaller: two heads written at offset 2 of 4
])
def test_head_slices_equal_the_per_region_loop(src_tp_heads, dst_heads, rows, regions):
    src = Heads(rows, *src_tp_heads)
    dst = Heads(rows, *dst_heads)
    heads = PairHeads(src, dst)
    head_bytes = 256
    src_lens = [rows * src.local * head_bytes] * regions
    dst_lens = [rows * dst.local * head_bytes] * regions
    rng = np.random.default_rng(7)
    src_ids, dst_ids = rng.permutation(40)[:9], rng.permutation(50)[:9]
    src_ptrs = (np.arange(regions) * (1 << 30) + (1 << 40)).tolist()
    dst_ptrs = (np.arange(regions) * (1 << 30) + (1 << 42)).tolist()
    got = copy_descriptors(src_ptrs, dst_ptrs, src_lens, src_ids, dst_ids, heads, dst_lens)
    _same(got, _loop_heads(src_ptrs, dst_ptrs, src_lens, dst_lens, src_ids, dst_ids, heads))
    assert got[0].size == regions * 9 * rows


def test_head_slices_exact_small_case():
    heads = PairHeads(Heads(2, 4, 2, 4), Heads(2, 2, 0, 2))  # rows of 4 heads; the decode takes heads 2, 3
    s, d, n = copy_descriptors([0], [10000], [64], np.array([1]), np.array([3]), heads, [32])
    # head bytes 8: page 1 of the prefill starts at 64, rows 32 bytes apart, heads 2-3 at +16
    assert s.tolist() == [80, 112]
    assert d.tolist() == [10096, 10112]
    assert n.tolist() == [16, 16]


def test_head_bytes_that_differ_name_both():
    heads = PairHeads(Heads(1, 2, 0, 1), Heads(1, 1, 0, 1))
    with pytest.raises(PlanError, match="a head is 16 bytes on the prefill but 8 on the decode"):
        copy_descriptors([0, 0], [0, 0], [32, 32], np.array([0]), np.array([0]), heads, [8, 8])
