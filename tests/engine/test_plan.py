"""Pure planning: page runs, chunking under a staging budget, staging layout, one-sided descriptors."""

import numpy as np
import pytest

from sglang_p2p_backend.engine.config import ConfigError, EngineConfig
from sglang_p2p_backend.engine.copy.plan import (
    Chunk,
    PlanError,
    Segment,
    copy_descriptors,
    ids_out_of_range,
    out_of_range_id,
    is_contiguous,
    page_runs,
    plan_chunks,
    run_breaks,
    staging_blocks,
)

from support.knobs import config_with


def test_page_runs_split_where_either_side_breaks():
    src = np.array([5, 6, 7, 9, 10, 11, 12])
    dst = np.array([1, 2, 8, 9, 10, 30, 31])
    assert page_runs(src, dst).tolist() == [[5, 1, 2], [7, 8, 1], [9, 9, 2], [11, 30, 2]]
    assert page_runs(np.array([], int), np.array([], int)).shape == (0, 3)
    assert page_runs(src, dst, run_breaks(src, dst)).tolist() == page_runs(src, dst).tolist()
    # one run (a long prompt's contiguous pages): the same row the general path gives, as int64
    one = page_runs(np.arange(40, 48), np.arange(3, 11))
    assert one.tolist() == [[40, 3, 8]] and one.dtype == np.int64
    assert run_breaks(np.arange(40, 48), np.arange(3, 11)).size == 0
    with pytest.raises(PlanError, match="3 pages but decode published 2"):
        page_runs(np.array([1, 2, 3]), np.array([1, 2]))


def test_is_contiguous():
    assert is_contiguous(np.array([4, 5, 6]))
    assert not is_contiguous(np.array([4, 6, 5]))
    assert not is_contiguous(np.array([], dtype=int))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16, np.uint32, np.float64])
def test_ids_out_of_range_names_the_bad_ids_whatever_their_type(dtype):
    assert ids_out_of_range(np.array([0, 5, 63], dtype=dtype), 64) is None
    assert ids_out_of_range(np.array([], dtype=dtype), 64) is None
    assert ids_out_of_range(np.array([1, 64], dtype=dtype), 64) == "page id out of range [0, 64): min 1, max 64"
    if np.dtype(dtype).kind != "u":
        assert ids_out_of_range(np.array([-1, 3], dtype=dtype), 64) == "page id out of range [0, 64): min -1, max 3"
        most = np.iinfo(dtype).min if np.dtype(dtype).kind == "i" else -1e30
        assert ids_out_of_range(np.array([5, most], dtype=dtype), 64) is not None


def test_out_of_range_id_names_the_negative_id_first_else_the_largest():
    assert out_of_range_id(np.array([0, 5, 63], dtype=np.int32), 64) is None
    assert out_of_range_id(np.array([], dtype=np.int32), 64) is None
    assert out_of_range_id(np.array([70, 1, 64], dtype=np.int32), 64) == 70
    assert out_of_range_id(np.array([70, -3, 64], dtype=np.int64), 64) == -3
    assert out_of_range_id(np.array([-1], dtype=np.int16), 40_000) == -1


def test_ids_out_of_range_for_lists_non_contiguous_views_and_bounds_past_the_signed_range():
    assert ids_out_of_range([3, -2], 8) == "page id out of range [0, 8): min -2, max 3"
    strided = np.array([1, -7, 2, 100], dtype=np.int32)[::2]  # a view: every other id
    assert ids_out_of_range(strided, 8) is None and ids_out_of_range(strided[::-1], 2) is not None
    # a bound no unsigned reading can honour (int16 ids, 40,000 pages): min and max decide
    assert ids_out_of_range(np.array([-1], dtype=np.int16), 40_000) == "page id out of range [0, 40000): min -1, max -1"
    assert ids_out_of_range(np.array([30_000], dtype=np.int16), 40_000) is None


def covered(chunks, item_lens, counts):
    """Every (group, region, position) exactly once, in plan order."""
    seen = []
    for c in chunks:
        assert c.nbytes == sum(n for *_, n in staging_blocks(c, item_lens))
        for seg in c.segments:
            for r in range(seg.region_lo, seg.region_hi):
                seen += [(seg.group, r, p) for p in range(seg.lo, seg.hi)]
    want = [(g, r, p) for g, lens in enumerate(item_lens) for p in range(counts[g]) for r in range(len(lens))]
    assert sorted(seen) == sorted(want) and len(seen) == len(want)


def test_whole_pages_pack_up_to_the_budget_and_groups_share_chunks():
    item_lens = [[100] * 4, [50]]  # KV: 4 regions of 100 B/page; one state component
    chunks = plan_chunks(item_lens, [10, 1], budget=1000)
    # 400 B a page: two pages a chunk; the state slot rides in the last chunk's spare room
    assert [c.nbytes for c in chunks] == [800, 800, 800, 800, 850]
    assert chunks[-1].segments == (Segment(0, 0, 4, 8, 10), Segment(1, 0, 1, 0, 1))
    assert all(c.nbytes <= 1000 for c in chunks)
    covered(chunks, item_lens, [10, 1])


def test_a_transfer_over_one_budget_ramps_up_from_its_first_chunk():
    item_lens = [[100] * 4, [50]]  # 400 B a KV page
    chunks = plan_chunks(item_lens, [20, 1], budget=1600, first=400)
    # caps 400, 800, 1600, 1600, ...: 1, 2, 4, 4, 4, 4 pages, then 1 page and the state slot
    assert [c.nbytes for c in chunks] == [400, 800, 1600, 1600, 1600, 1600, 450]
    assert [(c.segments[0].lo, c.segments[0].hi) for c in chunks[:3]] == [(0, 1), (1, 3), (3, 7)]
    covered(chunks, item_lens, [20, 1])


def test_the_ramp_leaves_a_transfer_of_one_budget_and_a_cap_at_or_over_the_budget_alone():
    item_lens = [[100] * 4]
    assert [c.nbytes for c in plan_chunks(item_lens, [4], budget=1600, first=400)] == [1600]
    for first in (0, 1600, 5000):
        assert [c.nbytes for c in plan_chunks(item_lens, [8], budget=1600, first=first)] == [1600, 1600]


def test_a_page_wider_than_the_ramp_cap_goes_alone_then_the_ramp_goes_on():
    item_lens = [[300, 300]]  # 600 B a page, over the first cap of 250 B, within the budget
    chunks = plan_chunks(item_lens, [6], budget=1800, first=250)
    # caps 250 (one page anyway), 500 (one page), 1000 (one page), 1800 (three)
    assert [c.nbytes for c in chunks] == [600, 600, 600, 1800]
    covered(chunks, item_lens, [6])


def test_page_wider_than_budget_is_split_by_regions():
    item_lens = [[300, 300, 300]]
    chunks = plan_chunks(item_lens, [2], budget=650)
    assert [(c.segments[0].lo, c.segments[0].region_lo, c.segments[0].region_hi) for c in chunks] == [
        (0, 0, 2), (0, 2, 3), (1, 0, 2), (1, 2, 3)]
    covered(chunks, item_lens, [2])


def test_region_page_wider_than_budget_is_an_error_naming_the_knob():
    with pytest.raises(PlanError, match="SGLANG_P2P_STAGING_MB"):
        plan_chunks([[4096]], [1], budget=1000)


def test_empty_transfer_has_no_chunks():
    assert plan_chunks([[64] * 3], [0], budget=100) == []


def test_staging_layout_is_segment_then_region_then_page():
    chunk = Chunk((Segment(0, 1, 3, 2, 5), Segment(1, 0, 1, 0, 1)), 3 * 10 + 3 * 20 + 7)
    blocks = [(s.group, r, off, n) for s, r, off, n in staging_blocks(chunk, [[5, 10, 20], [7]])]
    assert blocks == [(0, 1, 0, 30), (0, 2, 30, 60), (1, 0, 90, 7)]


def test_copy_descriptors_merge_runs_per_region():
    src, dst, lens = copy_descriptors([1000, 5000], [90000, 70000], [16, 8], np.array([3, 4, 9]), np.array([0, 1, 2]))
    assert src.tolist() == [1000 + 3 * 16, 1000 + 9 * 16, 5000 + 3 * 8, 5000 + 9 * 8]
    assert dst.tolist() == [90000, 90000 + 2 * 16, 70000, 70000 + 2 * 8]
    assert lens.tolist() == [32, 16, 16, 8]
    with pytest.raises(PlanError, match="layouts differ"):
        copy_descriptors([1], [1, 2], [8], np.array([0]), np.array([0]))


@pytest.mark.parametrize("raw, want", [(None, 0), ("", 0), ("0", 0), ("8", 8 << 20)])
def test_first_chunk_knob(monkeypatch, raw, want):
    assert config_with(monkeypatch, "SGLANG_P2P_FIRST_CHUNK_MB", raw).first_chunk_bytes == want


@pytest.mark.parametrize("raw", ["big", "-4", "1.5"])
def test_first_chunk_knob_rejects_nonsense_naming_it(monkeypatch, raw):
    monkeypatch.setenv("SGLANG_P2P_FIRST_CHUNK_MB", raw)
    with pytest.raises(ConfigError, match="SGLANG_P2P_FIRST_CHUNK_MB"):
        EngineConfig.from_env()
