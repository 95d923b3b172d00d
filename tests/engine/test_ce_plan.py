"""The copy-engine planning: span coalescing, the spans of whole pages, a chunk's shape from its ids, and the
per-chunk rule with its thresholds (engine/copy/ce_plan.py)."""
from __future__ import annotations

import numpy as np
import pytest

from sglang_p2p_backend.engine.copy import ce_plan
from sglang_p2p_backend.engine.copy.ce_plan import (COPY_ENGINE, KERNEL, choose, coalesce, page_chunk_shape,
                                                   page_spans)
from sglang_p2p_backend.engine.copy.plan import copy_descriptors, page_runs, run_breaks


def _lists(d):
    return [a.tolist() for a in d]


def test_coalesce_joins_spans_continued_on_both_sides_only():
    src = [0, 100, 200, 1000, 1100]
    dst = [5000, 5100, 9000, 9100, 9200]
    lens = [100, 100, 100, 100, 100]
    # 0->5000 and 100->5100 continue each other; 200->9000 breaks on the destination; 1000->9100 breaks on the
    # source (200 + 100 != 1000); 1100->9200 continues 1000->9100
    assert _lists(coalesce(src, dst, lens)) == [[0, 200, 1000], [5000, 9000, 9100], [200, 100, 200]]


def test_coalesce_drops_empty_spans_and_keeps_singletons():
    assert _lists(coalesce([8, 16, 24], [80, 96, 88], [8, 0, 8])) == [[8, 24], [80, 88], [8, 8]]
    assert _lists(coalesce([8], [80], [8])) == [[8], [80], [8]]
    assert _lists(coalesce([], [], [])) == [[], [], []]
    with pytest.raises(ValueError, match="do not pair up"):
        coalesce([1, 2], [3], [4, 5])


def test_page_spans_of_a_pool_laid_back_to_back_become_one_span_for_contiguous_pages():
    # 3 regions of 10 pages of 64 bytes, each region right after the previous one on both sides (one
    # allocation), and the whole pool moved page for page: one span of everything
    item, pages = 64, 10
    src_bases = [1 << 20, (1 << 20) + item * pages, (1 << 20) + 2 * item * pages]
    dst_bases = [1 << 24, (1 << 24) + item * pages, (1 << 24) + 2 * item * pages]
    ids = np.arange(pages)
    assert _lists(page_spans(src_bases, dst_bases, [item] * 3, ids, ids)) == [[1 << 20], [1 << 24], [3 * item * pages]]


def test_page_spans_of_scattered_pages_keep_region_major_runs():
    src_bases, dst_bases, items = [0, 10000], [50000, 90000], [16, 32]
    src_ids, dst_ids = np.array([0, 1, 2, 7]), np.array([4, 5, 9, 1])
    # runs: (0->4, 2 pages), (2->9, 1), (7->1, 1); regions are not back to back, so nothing joins across them
    assert _lists(page_spans(src_bases, dst_bases, items, src_ids, dst_ids)) == [
        [0, 32, 112, 10000, 10064, 10224],
        [50064, 50144, 50016, 90128, 90288, 90032],
        [32, 16, 16, 64, 32, 32],
    ]
    # the same bytes as the one-sided descriptors
    s, d, n = copy_descriptors(src_bases, dst_bases, items, src_ids, dst_ids)
    assert sorted(zip(s.tolist(), d.tolist(), n.tolist())) == sorted(zip(*_lists(page_spans(src_bases, dst_bases, items, src_ids, dst_ids))))


def test_page_chunk_shape_counts_runs_times_regions_and_bytes():
    assert page_chunk_shape(np.array([0, 1, 2, 7]), np.array([4, 5, 9, 1]), [16, 32]) == (6, 4 * 48)
    assert page_chunk_shape(np.arange(64), np.arange(64) + 100, [73728] * 61) == (61, 64 * 61 * 73728)
    assert page_chunk_shape(np.zeros(0), np.zeros(0), [8]) == (0, 0)


def test_off_and_on_ignore_the_shape():
    assert choose("off", 1, 1 << 30) == KERNEL
    assert choose("on", 1_000_000, 2048 * 1_000_000) == COPY_ENGINE
    assert choose("on", 0, 0) == KERNEL  # nothing to copy: nothing to choose
    with pytest.raises(ValueError, match="not one of split, auto, off, on"):
        choose("sometimes", 1, 1)


def test_auto_rule_at_its_thresholds():
    mean, most = ce_plan.CE_MIN_MEAN_SPAN_BYTES, ce_plan.CE_MAX_SPANS_BATCHED
    assert choose("auto", 61, 61 * mean) == COPY_ENGINE  # exactly the mean threshold
    assert choose("auto", 61, 61 * mean - 1) == KERNEL
    assert choose("auto", most, most * mean) == COPY_ENGINE
    assert choose("auto", most + 1, (most + 1) * mean * 4) == KERNEL  # too many spans however long
    few = ce_plan.CE_MAX_SPANS_UNBATCHED
    assert choose("auto", few, few * mean, batched=False) == COPY_ENGINE
    assert choose("auto", few + 1, (few + 1) * mean, batched=False) == KERNEL


def test_auto_thresholds_given_replace_the_shipped_ones():
    """SGLANG_P2P_CE_MIN_SPAN_KIB / SGLANG_P2P_CE_MAX_SPANS: MLA at 61 layers, page 1, a contiguous 1k-token
    request is 61 spans of 1.1 MiB; the shipped 2 MiB mean keeps it on the kernel, a 1 MiB one sends it to the
    copy engines (into the prefill's own GPU too), and a span cap below 61 keeps it on the kernel again."""
    span = 1024 * 1152
    assert choose("auto", 61, 61 * span) == KERNEL
    assert choose("auto", 61, 61 * span, min_mean_span=1 << 20) == COPY_ENGINE
    assert choose("auto", 61, 61 * span, min_mean_span=1 << 20, same_gpu=True) == COPY_ENGINE
    assert choose("auto", 61, 61 * span, min_mean_span=1 << 20, max_spans=60) == KERNEL
    # the span cap decides a 4k-token request scattered into 4 runs a layer (244 spans of 1.1 MiB)
    assert choose("auto", 244, 4 * 61 * span, min_mean_span=1 << 20) == COPY_ENGINE  # under the shipped 1,024
    assert choose("auto", 244, 4 * 61 * span, min_mean_span=1 << 20, max_spans=200) == KERNEL
    assert choose("auto", 244, 4 * 61 * span, min_mean_span=1 << 20, max_spans=256) == COPY_ENGINE
    assert choose("auto", 244, 4 * 61 * span, batched=False, min_mean_span=1 << 20, max_spans=256) == COPY_ENGINE
    assert choose("off", 61, 61 * span, min_mean_span=1) == KERNEL  # the thresholds are auto's only


def test_into_the_prefills_own_gpu_the_copy_engines_need_longer_spans():
    """Across GPUs the copy engines take a chunk from a 2 MiB mean span; into the same GPU, where they were slower
    below 32 MiB spans, from 16 MiB."""
    across, same = ce_plan.CE_MIN_MEAN_SPAN_BYTES, ce_plan.CE_MIN_MEAN_SPAN_SAME_GPU_BYTES
    assert (across, same) == (2 << 20, 16 << 20)
    assert choose("auto", 61, 61 * across) == COPY_ENGINE
    assert choose("auto", 61, 61 * across, same_gpu=True) == KERNEL
    assert choose("auto", 61, 61 * same, same_gpu=True) == COPY_ENGINE
    assert choose("auto", 61, 61 * same - 1, same_gpu=True) == KERNEL


def test_across_gpus_hundreds_of_long_spans_take_the_copy_engines_into_the_same_gpu_not():
    """A chunk in a few runs a layer (SGLang's page-1 allocator after a while) is hundreds of MiB-long spans:
    across GPUs the copy engines take it up to 1,024 spans, into the prefill's own GPU only up to 64."""
    across, same = ce_plan.CE_MAX_SPANS_BATCHED, ce_plan.CE_MAX_SPANS_SAME_GPU
    assert (across, same) == (1024, 64)
    big = 32 << 20  # long enough for either destination's mean
    assert choose("auto", across, across * big) == COPY_ENGINE
    assert choose("auto", across + 1, (across + 1) * big) == KERNEL
    assert choose("auto", same, same * big, same_gpu=True) == COPY_ENGINE
    assert choose("auto", same + 1, (same + 1) * big, same_gpu=True) == KERNEL
    assert choose("auto", same + 1, (same + 1) * big, same_gpu=True, max_spans=across) == COPY_ENGINE
    # chunks of MHA at page 1 (64 regions of 2 KiB a token) landing in a few runs a layer: 8k tokens in 2 and 4
    # runs (spans of 8 and 4 MiB), 16k in 16 (1,024 spans of 2 MiB) take the copy engines; 8k in 16 runs is
    # spans of 1 MiB, too short, and 16k in 32 runs, 2,048 spans, too many
    regions, item = 64, 2048
    for n, runs, want in ((8192, 2, COPY_ENGINE), (8192, 4, COPY_ENGINE), (16384, 16, COPY_ENGINE),
                          (8192, 16, KERNEL), (16384, 32, KERNEL)):
        cut = np.linspace(0, n, runs + 1).astype(int)
        dst = np.concatenate([np.arange(cut[i], cut[i + 1]) + 3 * i for i in range(runs)])
        spans, nbytes = page_chunk_shape(np.arange(n), dst, [item] * regions)
        assert spans == runs * regions
        assert choose("auto", spans, nbytes) == want, (n, runs)
        assert choose("auto", spans, nbytes, same_gpu=True) == KERNEL


def test_the_rule_says_which_threshold_kept_a_chunk_on_the_kernel():
    from sglang_p2p_backend.engine.copy.ce_plan import MANY_SPANS, SHORT_SPANS, route_and_reason

    mean, most = ce_plan.CE_MIN_MEAN_SPAN_BYTES, ce_plan.CE_MAX_SPANS_BATCHED
    assert route_and_reason("auto", 64, 64 * mean) == (COPY_ENGINE, "")
    assert route_and_reason("auto", 64, 64 * mean - 1) == (KERNEL, SHORT_SPANS)
    assert route_and_reason("auto", most + 1, (most + 1) * mean * 4) == (KERNEL, MANY_SPANS)
    assert route_and_reason("auto", most + 1, 1) == (KERNEL, MANY_SPANS)  # the cap is checked first
    assert route_and_reason("off", 64, 64 * mean) == (KERNEL, "")  # no threshold: the operator's choice
    assert route_and_reason("on", 10**6, 1) == (COPY_ENGINE, "")


@pytest.mark.parametrize("layout, tokens, page, scattered, want", [
    # MLA, 61 layers, page 64 (72 KiB a page and layer): contiguous 4k tokens is 61 spans of 4.5 MiB, above the
    # 2 MiB mean across GPUs (where the copy engines took 0.94-1.01 of the kernel's time)
    ("mla", 4096, 64, False, COPY_ENGINE),
    # contiguous 1k: 61 spans of 1.1 MiB, below it (1.06-1.6x the kernel's time)
    ("mla", 1024, 64, False, KERNEL),
    # contiguous 16k: 61 spans of 18 MiB -> copy engines (0.93-0.96 of the kernel's time across two H100s)
    ("mla", 16384, 64, False, COPY_ENGINE),
    # scattered 4k: 64 x 61 = 3,904 spans of 72 KiB, too many and too short
    ("mla", 4096, 64, True, KERNEL),
    # MHA page 1 (2 KiB a token and region) scattered: 262,144 spans of 2 KiB -> the kernel
    ("mha", 4096, 1, True, KERNEL),
    # MHA page 16 scattered 16k: 1,024 x 64 = 65,536 spans of 32 KiB -> the kernel
    ("mha", 16384, 16, True, KERNEL),
    # MHA page 16 contiguous 16k: 64 spans of 32 MiB -> copy engines
    ("mha", 16384, 16, False, COPY_ENGINE),
    # contiguous 4k: 64 spans of 8 MiB, even across two H100s (0.83-1.10) -> the copy engines, which take no SMs
    ("mha", 4096, 16, False, COPY_ENGINE),
    # contiguous 1k: 64 spans of 2 MiB, even too (0.98-1.08) -> the copy engines
    ("mha", 1024, 16, False, COPY_ENGINE),
])
def test_auto_on_the_benchmark_shapes(layout, tokens, page, scattered, want):
    regions, token_bytes = (61, 1152) if layout == "mla" else (64, 2048)
    n = tokens // page
    src = np.arange(n)
    dst = np.random.default_rng(0).permutation(4 * n)[:n] if scattered else np.arange(n) + 7
    spans, nbytes = page_chunk_shape(src, dst, [page * token_bytes] * regions)
    assert nbytes == tokens * regions * token_bytes
    assert choose("auto", spans, nbytes) == want


@pytest.mark.parametrize("back_to_back", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_page_spans_equal_coalescing_every_descriptor(seed, back_to_back):
    """page_spans looks only at region boundaries: it must give what coalescing every span gives."""
    rng = np.random.default_rng(seed)
    regions, pages, item = int(rng.integers(1, 6)), 12, 32
    stride = pages * item if back_to_back else pages * item + 64
    src_bases = [4096 + r * stride for r in range(regions)]
    dst_bases = [1 << 20 | r * stride for r in range(regions)]
    n = int(rng.integers(1, pages + 1))
    if seed % 2:  # runs that touch the pools' ends, so boundaries can join when the pool is back to back
        src_ids, dst_ids = np.arange(pages - n, pages), np.arange(pages - n, pages)
        src_ids = np.concatenate([src_ids[-1:] * 0, src_ids[1:]]) if n > 1 else src_ids
        dst_ids = np.concatenate([dst_ids[-1:] * 0, dst_ids[1:]]) if n > 1 else dst_ids
    else:
        src_ids, dst_ids = rng.permutation(pages)[:n], rng.permutation(pages)[:n]
    items = [item] * regions
    want = coalesce(*copy_descriptors(src_bases, dst_bases, items, src_ids, dst_ids))
    assert _lists(page_spans(src_bases, dst_bases, items, src_ids, dst_ids)) == _lists(want)
    # the transport's way: the breaks found once, for the rule and then for the runs
    breaks = run_breaks(np.asarray(src_ids, np.int64), np.asarray(dst_ids, np.int64))
    runs = page_runs(src_ids, dst_ids, breaks)
    assert _lists(page_spans(src_bases, dst_bases, items, src_ids, dst_ids, runs=runs)) == _lists(want)
    assert page_chunk_shape(src_ids, dst_ids, items, breaks) == page_chunk_shape(src_ids, dst_ids, items)


def test_split_sends_the_long_runs_to_the_copy_engines_and_leaves_the_short_ones():
    # runs of 1, 8, 2 and 5 pages; 64-byte items in 3 regions; a span must be >= 256 bytes (4 pages)
    src = np.array([0, 10, 11, 12, 13, 14, 15, 16, 17, 30, 31, 40, 41, 42, 43, 44])
    dst = src + 100
    cut = ce_plan.split_runs(page_runs(src, dst)[:, 2], [64] * 3, 256, 1024)
    assert cut.engines.tolist() == [False] + [True] * 8 + [False] * 2 + [True] * 5
    assert (cut.picked.tolist(), cut.kernel_runs) == ([1, 3], 2)


def test_split_keeps_the_longest_runs_within_the_span_cap_in_their_order():
    src = np.array([0, 1, 2, 3, 10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 24])  # runs of 4, 6 and 5 pages
    lens = page_runs(src, src)[:, 2]
    cut = ce_plan.split_runs(lens, [64, 64], 4 * 64, 4)  # 2 regions: 2 runs at most
    assert cut.engines.tolist() == [False] * 4 + [True] * 11
    assert (cut.picked.tolist(), cut.kernel_runs) == ([1, 2], 1)
    # the span threshold follows the smallest item: 64 x 4 pages < 512
    assert not ce_plan.split_runs(lens, [64, 4096], 512, 1024).picked.size
    empty = ce_plan.split_runs(np.zeros(0, np.int64), [64], 1, 1)
    assert empty.engines.size == 0 and (empty.picked.size, empty.kernel_runs) == (0, 0)


def test_split_mode_follows_auto_for_chunks_it_does_not_cut():
    assert choose("split", 3, 3 * (2 << 20)) == COPY_ENGINE
    assert choose("split", 3, 3 * 1024) == KERNEL
    assert ce_plan.thresholds() == (ce_plan.CE_MAX_SPANS_BATCHED, ce_plan.CE_MIN_MEAN_SPAN_BYTES)
    assert ce_plan.thresholds(same_gpu=True, max_spans=7) == (7, ce_plan.CE_MIN_MEAN_SPAN_SAME_GPU_BYTES)


def test_route_split_builds_runs_only_where_one_can_reach_the_threshold():
    items = [64] * 3
    # 2 pages can never hold a run of 4: nothing looked for, one kernel span a region, unless asked for exact spans
    short = ce_plan.route_split(np.array([4, 9]), np.array([0, 1]), items, 256, 1024)
    assert (short.runs, short.cut, short.kernel_spans, short.engines_take_any) == (None, None, 3, False)
    assert ce_plan.route_split(np.array([4, 9]), np.array([0, 1]), items, 256, 1024, exact=True).kernel_spans == 6
    # 6 pages in runs of 3 and 3: long enough in all, but no run reaches 4 pages, which may_hold_run sees without
    # the breaks; exact, the breaks are found (2 runs)
    src = np.array([0, 1, 2, 10, 11, 12])
    none = ce_plan.route_split(src, src + 50, items, 256, 1024)
    assert (none.runs, none.cut, none.kernel_spans) == (None, None, 3)
    assert ce_plan.route_split(src, src + 50, items, 256, 1024, exact=True).kernel_spans == 6
    # ids out of order pass both first looks (every second id 2 apart, the ends 3 apart) though their runs are 1, 1
    # and 2 pages: the breaks then say no run reaches 4, and no runs are built
    odd = ce_plan.route_split(np.array([0, 5, 2, 3]), np.array([0, 5, 2, 3]) + 50, items, 256, 1024)
    assert (odd.runs, odd.cut, odd.kernel_spans) == (None, None, 9)
    # runs of 1, 8, 2 and 5 pages: the 8 and the 5 go to the copy engines, as split_runs cuts them
    src = np.array([0, 10, 11, 12, 13, 14, 15, 16, 17, 30, 31, 40, 41, 42, 43, 44])
    route = ce_plan.route_split(src, src + 100, items, 256, 1024)
    assert route.engines_take_any and route.runs.tolist() == page_runs(src, src + 100).tolist()
    assert (route.cut.picked.tolist(), route.cut.kernel_runs, route.kernel_spans) == ([1, 3], 2, 12)
    empty = ce_plan.route_split(np.zeros(0, np.int64), np.zeros(0, np.int64), items, 1, 1)
    assert (empty.cut, empty.kernel_spans) == (None, 3)


def test_run_helpers_agree_with_the_runs_themselves_on_random_ids():
    """may_hold_run never rules out a chunk that holds a run of the length asked (it may let one through that
    does not), longest_run is the longest of page_runs, run_pages the fewest pages reaching the span."""
    rng = np.random.default_rng(7)
    for _ in range(400):
        n = int(rng.integers(1, 60))
        # runs of random lengths at random places, sometimes out of order, sometimes one side shuffled
        lens = rng.integers(1, 12, size=n)
        src = np.concatenate([np.arange(k) + int(rng.integers(0, 10_000)) for k in lens])[:n].astype(np.int64)
        dst = src + 5_000 if rng.random() < 0.7 else rng.permutation(src) + 5_000
        runs = page_runs(src, dst)
        longest = int(runs[:, 2].max())
        assert ce_plan.longest_run(run_breaks(src, dst), src.size) == longest
        for need in range(1, 14):
            if longest >= need:
                assert ce_plan.may_hold_run(src, dst, need), (src.tolist(), dst.tolist(), need)
    assert not ce_plan.may_hold_run(np.arange(3), np.arange(3), 4)
    assert ce_plan.may_hold_run(np.arange(3), np.arange(3), 3)
    assert [ce_plan.run_pages([64, 32], b) for b in (0, 1, 32, 33, 64, 65)] == [1, 1, 1, 2, 2, 3]
    # a region of empty items never reaches a span: such a chunk stays whole on the kernel
    assert ce_plan.run_pages([], 1 << 20) == ce_plan.run_pages([64, 0], 1) == ce_plan.NO_RUN
    empty_region = ce_plan.route_split(np.arange(8), np.arange(8), [64, 0], 64, 1024, exact=True)
    assert (empty_region.cut, empty_region.kernel_spans) == (None, 2)


def test_may_hold_run_finds_one_planted_run_at_every_offset_and_none_one_page_short():
    """Its first look at every (need // 2)-th id only must not miss a run that starts anywhere: one run of exactly
    `need` pages planted at each offset among scattered pages is found, and one page shorter is not."""
    rng = np.random.default_rng(11)
    for need in (4, 5, 16, 33, 64):
        n = 4 * need + 7
        # ids with gaps of at least 2 on both sides, shuffled: no run of 2 anywhere but the planted one
        base = rng.permutation(np.arange(0, 40 * n, 2, dtype=np.int64))[:n]
        other = rng.permutation(np.arange(1, 40 * n, 2, dtype=np.int64))[:n]
        for length, found in ((need, True), (need - 1, False)):
            for at in range(n - length + 1):
                src, dst = base.copy(), other.copy()
                src[at:at + length] = 100 * n + np.arange(length)
                dst[at:at + length] = 200 * n + np.arange(length)
                assert ce_plan.may_hold_run(src, dst, need) is found, (need, length, at)


def test_split_runs_one_run_and_many_cut_as_the_rule_says():
    """The single-run shortcut and the general path give what the rule says: runs whose every region span
    reaches min_span, the longest first up to max_spans // regions of them."""
    rng = np.random.default_rng(3)
    items = [48, 64]
    for _ in range(300):
        lens = rng.integers(1, 40, size=int(rng.integers(1, 6)))
        min_span, max_spans = int(rng.integers(1, 2_000)), int(rng.integers(0, 9))
        cut = ce_plan.split_runs(lens, items, min_span, max_spans)
        long = [i for i, k in enumerate(lens) if k * 48 >= min_span]
        want = sorted(sorted(long, key=lambda i: -lens[i])[:max_spans // 2])
        assert cut.picked.tolist() == want and cut.kernel_runs == lens.size - len(want)
        assert cut.engines.tolist() == [i in want for i, k in enumerate(lens) for _ in range(k)]
