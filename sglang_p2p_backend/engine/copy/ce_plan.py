"""Copy engines or the SM kernel for a same-host chunk, and the spans the copy engines take (pure, tested on CPU).

The same-host path (transport/cuda_ipc.py) copies a chunk either with one Triton launch (span_copy.py: one
upload and one launch whatever the page count, but it runs on the prefill GPU's SMs) or with the GPU's copy
engines (engine/copy/copy_engine.py: `cudaMemcpyBatchAsync`, or one `cudaMemcpyAsync` per span where the
runtime lacks it), which take no SMs from the forward pass but pay a setup per span. So the spans are made
as long as they can be first (`page_spans`: merged page runs of every region, then `coalesce`, which also
joins the regions of a pool that lie back to back in one allocation), and `choose` sends a chunk to the copy
engines only where its spans are long and few enough. (A copy cannot reach across allocations: the runtime
refuses one that does, bench/transfer/strided_allocations.py. Regions join only where a chunk holds every page of
one region and the next region continues it on both sides; SGLang's layers are separate allocations, but no
request holds page 0, the padding page, so their spans never join.)

`SGLANG_P2P_COPY_ENGINE` (engine/config.py) picks the mode: `split` (the default; per page run: `split_runs` sends
a chunk's long runs to the copy engines and leaves only its short ones to the kernel), `auto` (`choose`'s rule per
chunk, which leaves the whole chunk to the kernel once its mean span is short or its spans too many), `off` (the
kernel for every chunk) or `on` (the copy engines for every chunk). Both rules use the thresholds below, which come
from `bench/transfer/xfer_bench.py`:
- across two NVLinked H100s (bench/results/xfer_nvidia-h100-x4_2026-11-2{7_a,7_b,7_c,8}.json.gz, four runs), for at
  most 64 spans a chunk, the copy engines took 0.90-0.96 of the kernel's time with spans of 18-32 MiB, 0.83-1.10
  at 4.5-8 MiB and 0.98-1.08 at 2 MiB (a 1k-token MHA request); shorter spans lost (1.06-1.6x at 1.1 MiB, a
  1k-token MLA request), scattered pages by 10-100x (each span costs them host time);
- with both pools on one H100 (bench/results/xfer_nvidia-h100-x1_2026-11-27.json) they only matched the kernel,
  at 32 MiB spans. Why (1 x H200, bench/results/ce_lanes_nvidia-h200_2026-11-29_*): the engines take 2.6-2.7 us
  of GPU time a span on top of the bytes at about the copy's rate, so short spans lose however they are queued
  (one batch, a call a span, several streams alike), and a strided copy of every region at once runs on SMs there.
Their case is interference: a matmul on the prefill GPU ran 1.8-9% slower during copy-engine writes across GPUs
and 83-107% slower during kernel writes (1.4% against 181% on one GPU), and in serving the prefill's forward pass
is that matmul. So across GPUs `auto` takes them from a 2 MiB mean span up (to 1,024 spans a chunk), where they cost about
the kernel's time and none of its SMs; into the prefill's own GPU, where they are slower at every size below
32 MiB, from 16 MiB (to 64 spans).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from sglang_p2p_backend.engine.config import COPY_ENGINE_MODES as MODES
from sglang_p2p_backend.engine.copy.plan import copy_descriptors, page_runs, run_breaks

Descriptors = tuple[np.ndarray, np.ndarray, np.ndarray]  # (src addresses, dst addresses, lengths), int64

KERNEL = "kernel"
COPY_ENGINE = "copy_engine"
#: auto across GPUs: a chunk goes to the copy engines when its mean span is at least this many bytes (from 2 MiB
#: the two took about the same time; shorter spans, down to MHA pages of size 1 at 2 KiB a layer, stay on the
#: kernel). DeepSeek-shaped requests (61 layers of 1,152 bytes a token) qualify from ~1.8k contiguous tokens
CE_MIN_MEAN_SPAN_BYTES = 2 << 20
#: auto into the prefill's own GPU (the decode shares it): the copy engines were slower below 32 MiB spans there
CE_MIN_MEAN_SPAN_SAME_GPU_BYTES = 16 << 20
#: auto across GPUs, with cudaMemcpyBatchAsync: at most this many spans a chunk. At 2 MiB spans and more the
#: engines kept up with the kernel to 1,024 spans on 2 x H200 (bench/results/xfer_nvidia-h200-x2_2026-11-29_runs.*:
#: 16k-token MHA chunks in 2-16 runs a layer, 128-1,024 spans, 0.87-0.95 of one peer copy against the kernel's
#: 0.90-0.91; a matmul beside them -0.4-4% slower against 36-45%); SGLang's page-1 allocator hands a long prompt's
#: chunks out in a few runs a layer, hundreds of such spans, which the kernel had taken at a cap of 64
CE_MAX_SPANS_BATCHED = 1024
#: auto into the prefill's own GPU: there the engines lose to the kernel at every span count (see above)
CE_MAX_SPANS_SAME_GPU = 64
#: auto, without it (CUDA < 12.8): each span is one cudaMemcpyAsync call of a few microseconds of host time
CE_MAX_SPANS_UNBATCHED = 64


def coalesce(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> Descriptors:
    """Merge each span into the one before it where both its source and its destination continue it exactly;
    zero-length spans vanish. Order is kept; the bytes covered are the same."""
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst, dtype=np.int64).reshape(-1)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    if not (src.shape == dst.shape == lens.shape):
        raise ValueError(f"{src.size} sources, {dst.size} destinations and {lens.size} lengths do not pair up")
    keep = lens > 0
    if not keep.all():
        src, dst, lens = src[keep], dst[keep], lens[keep]
    if src.size < 2:
        return src, dst, lens
    ends_s, ends_d = src[:-1] + lens[:-1], dst[:-1] + lens[:-1]
    starts = np.concatenate(([0], np.flatnonzero((src[1:] != ends_s) | (dst[1:] != ends_d)) + 1))
    return src[starts], dst[starts], np.add.reduceat(lens, starts)


def page_spans(src_bases: Sequence[int], dst_bases: Sequence[int], item_bytes: Sequence[int],
               src_ids: np.ndarray, dst_ids: np.ndarray, runs: Optional[np.ndarray] = None) -> Descriptors:
    """The copy-engine spans of whole pages src_ids -> dst_ids of every region: merged page runs, region-major,
    coalesced across regions where the pool lies back to back. Equal to `coalesce(copy_descriptors(...))`.
    `runs`: `plan.page_runs` of the ids, where the caller has them."""
    src, dst, lens = copy_descriptors(src_bases, dst_bases, item_bytes, np.asarray(src_ids), np.asarray(dst_ids),
                                      runs=runs)
    regions = len(item_bytes)
    if regions < 2 or not lens.size:
        return src, dst, lens
    # inside a region the runs are already maximal (page_runs breaks only where a side is not consecutive), so
    # only a region's last run and the next region's first can join: look at those R - 1 pairs, not every span
    k = lens.size // regions
    last = np.arange(1, regions) * k - 1
    joins = (src[last] + lens[last] == src[last + 1]) & (dst[last] + lens[last] == dst[last + 1])
    return coalesce(src, dst, lens) if joins.any() else (src, dst, lens)


#: why `auto` left a chunk on the kernel (`route_and_reason`): its spans average under the mean threshold, or
#: they are more than the span cap (checked first)
SHORT_SPANS = "for short spans"
MANY_SPANS = "over the span cap"
#: why `split` and `auto` left a chunk whole to the kernel without asking their rule: it is the last chunk of the
#: only request on its prefill rank, bound for another GPU, so no forward pass runs beside its copy, and the kernel is
#: queued in a fraction of the copy engines' host time (SGLANG_P2P_ALONE_KERNEL)
ALONE = "alone on the GPU"


def choose(mode: str, spans: int, nbytes: int, batched: bool = True, min_mean_span: Optional[int] = None,
           max_spans: Optional[int] = None, same_gpu: bool = False) -> str:
    """`KERNEL` or `COPY_ENGINE` for a chunk of `spans` spans and `nbytes` bytes. `batched`: the runtime has
    cudaMemcpyBatchAsync (else every span is a call of its own). `same_gpu`: the destination is on the source's
    GPU. `min_mean_span` (bytes) and `max_spans` replace auto's thresholds (SGLANG_P2P_CE_MIN_SPAN_KIB,
    SGLANG_P2P_CE_MAX_SPANS) in both cases; None keeps this module's."""
    return route_and_reason(mode, spans, nbytes, batched, min_mean_span, max_spans, same_gpu)[0]


#: the mode that cuts a whole-page chunk by its page runs (`split_runs`)
SPLIT = "split"


def thresholds(batched: bool = True, same_gpu: bool = False, min_mean_span: Optional[int] = None,
               max_spans: Optional[int] = None) -> tuple[int, int]:
    """(most spans, least mean span in bytes) the copy engines take of a chunk: the knobs' values where set
    (SGLANG_P2P_CE_MAX_SPANS, SGLANG_P2P_CE_MIN_SPAN_KIB), else this module's for the runtime and destination."""
    limit = max_spans or (CE_MAX_SPANS_UNBATCHED if not batched else
                          CE_MAX_SPANS_SAME_GPU if same_gpu else CE_MAX_SPANS_BATCHED)
    mean = min_mean_span or (CE_MIN_MEAN_SPAN_SAME_GPU_BYTES if same_gpu else CE_MIN_MEAN_SPAN_BYTES)
    return limit, mean


class Split(NamedTuple):
    """A whole-page chunk cut by its page runs (`split_runs`)."""

    #: per page of the chunk, whether the copy engines take it (its run is one they take)
    engines: np.ndarray
    #: the indices of the runs the copy engines take, in order (rows of the chunk's `plan.page_runs`)
    picked: np.ndarray
    #: how many runs the kernel keeps (a run is one span a region)
    kernel_runs: int


def split_runs(lens: np.ndarray, item_bytes: Sequence[int], min_span: int, max_spans: int) -> Split:
    """`split` mode: the copy engines take the runs of a chunk's pages whose every region span is at least
    `min_span` bytes (run length times the region's item size), the longest first, up to `max_spans` spans (one a
    region a run); the SM kernel takes the rest. In a page pool fragmented by mixed traffic a chunk's runs range from
    single pages to thousands, and `auto`, judging the chunk by its mean span and span count, left all of it to the
    kernel (36-59% of the bytes in the two-GPU serving runs: docs/serving.md); here the kernel keeps only the short
    runs, whose bytes are few. `lens`: the chunk's run lengths in pages (`plan.page_runs(...)[:, 2]`)."""
    return _cut(np.asarray(lens, dtype=np.int64), run_pages(item_bytes, min_span), max_spans // max(1, len(item_bytes)))


def _cut(lens: np.ndarray, need: int, most: int) -> Split:
    """`split_runs` with its thresholds worked out: runs of at least `need` pages, at most `most` of them."""
    if lens.size == 1:  # one run (a contiguous chunk): no search
        take = bool(lens[0] >= need) and most >= 1
        return Split(np.full(int(lens[0]), take), np.arange(int(take), dtype=np.int64), int(not take))
    picked = np.flatnonzero(lens >= need)
    if picked.size > most:  # the longest runs carry the most bytes: those go, the rest stay on the kernel
        picked = np.sort(picked[np.argsort(-lens[picked], kind="stable")[:most]])
    chosen = np.zeros(lens.size, dtype=bool)
    chosen[picked] = True
    return Split(np.repeat(chosen, lens), picked, int(lens.size - picked.size))


#: `run_pages` where no run can reach the span: a region of empty items (or none at all)
NO_RUN = 1 << 62


def run_pages(item_bytes: Sequence[int], min_span: int) -> int:
    """The fewest pages a run needs for every region's span of it to reach `min_span` bytes (at least 1;
    `NO_RUN` where a region's items are empty, since its spans never grow)."""
    if min_span <= 0:
        return 1
    return pages_reaching(int(np.asarray(item_bytes, dtype=np.int64).min()) if len(item_bytes) else 0, min_span)


def pages_reaching(least_item: int, min_span: int) -> int:
    """`run_pages` of a pool whose smallest item is `least_item` bytes (a transport keeps it per pool, so the
    chunk's route does not reduce the item sizes again)."""
    if min_span <= 0:
        return 1
    return -(-int(min_span) // least_item) if least_item > 0 else NO_RUN


def longest_run(breaks: np.ndarray, n: int) -> int:
    """The longest run of n paired page ids whose runs start at `breaks` (`plan.run_breaks`)."""
    if not breaks.size:
        return n
    longest = max(int(breaks[0]), n - int(breaks[-1]))
    return max(longest, int((breaks[1:] - breaks[:-1]).max())) if breaks.size > 1 else longest


def may_hold_run(src_ids: np.ndarray, dst_ids: np.ndarray, need: int) -> bool:
    """False only where no run of `need` consecutive pages on both sides can be among the ids: a run of that
    length from position i has ids[i + need - 1] - ids[i] == need - 1 on both sides. Cheaper than finding the
    breaks (one subtraction a side, no index array), so a scattered chunk is ruled out first."""
    k = need - 1
    if k <= 0:
        return src_ids.size > 0
    if src_ids.size <= k:
        return False
    # a run over `need` positions holds a multiple m of s = need // 2 with m + s inside it too, so its ids differ
    # by s there on both sides: every s-th id alone (a few dozen for a 16k-page chunk) rules out most chunks
    s = need // 2
    if s >= 2:
        a, b = src_ids[::s], dst_ids[::s]
        if not ((a[1:] - a[:-1] == s) & (b[1:] - b[:-1] == s)).any():
            return False
    return bool(((src_ids[k:] - src_ids[:-k] == k) & (dst_ids[k:] - dst_ids[:-k] == k)).any())


class SplitRoute(NamedTuple):
    """How `split` copies one whole-page chunk (`route_split`)."""

    #: the chunk's page runs (`plan.page_runs`), built only where one of them can reach the span threshold
    runs: Optional[np.ndarray]
    #: those runs cut between the two routes (`split_runs`); None without `runs`
    cut: Optional[Split]
    #: the kernel's spans where it takes the whole chunk: exact where the breaks were looked for, else one a region
    kernel_spans: int

    @property
    def engines_take_any(self) -> bool:
        return self.cut is not None and bool(self.cut.picked.size)


def route_split(src_ids: np.ndarray, dst_ids: np.ndarray, item_bytes: Sequence[int], min_span: int, max_spans: int,
                exact: bool = False, need: Optional[int] = None) -> SplitRoute:
    """`split` mode's plan for a whole-page chunk: its runs and their cut (`split_runs`) where one run can reach
    `min_span` bytes a region. The runs are built only there: not for a chunk too short to hold such a run (every
    128-token request), nor for one that `may_hold_run` rules out (scattered pages). It runs between a write's
    checks and its copy, on every chunk, so it is a handful of array operations (docs/bench.md: its host time).
    `exact`: look for the breaks anyway, for `kernel_spans` exact (the route log's first line). `need`:
    `run_pages(item_bytes, min_span)`, where the caller keeps it."""
    s, d = np.asarray(src_ids), np.asarray(dst_ids)
    n, regions = int(s.size), max(1, len(item_bytes))
    if need is None:
        need = run_pages(item_bytes, min_span)
    if not n or (not exact and (n < need or not may_hold_run(s, d, need))):
        return SplitRoute(None, None, regions)
    breaks = run_breaks(s, d)
    kernel_spans = regions * (int(breaks.size) + 1)
    if longest_run(breaks, n) < need:
        return SplitRoute(None, None, kernel_spans)
    runs = page_runs(s, d, breaks)
    return SplitRoute(runs, _cut(runs[:, 2], need, max_spans // regions), kernel_spans)


def route_and_reason(mode: str, spans: int, nbytes: int, batched: bool = True, min_mean_span: Optional[int] = None,
                     max_spans: Optional[int] = None, same_gpu: bool = False) -> tuple[str, str]:
    """`choose`'s route, and why `auto` left the chunk on the kernel (`MANY_SPANS`, `SHORT_SPANS`; "" otherwise),
    so the route tally can say which threshold held a serving run's chunks back."""
    if mode == "off" or spans <= 0:
        return KERNEL, ""
    if mode == "on":
        return COPY_ENGINE, ""
    if mode not in ("auto", SPLIT):  # a chunk `split` does not cut (spans, not pages) follows auto's rule
        raise ValueError(f"copy engine mode {mode!r} is not one of {', '.join(MODES)}")
    limit, mean = thresholds(batched, same_gpu, min_mean_span, max_spans)
    if spans > limit:
        return KERNEL, MANY_SPANS
    if nbytes < mean * spans:
        return KERNEL, SHORT_SPANS
    return COPY_ENGINE, ""


def page_chunk_shape(src_ids: np.ndarray, dst_ids: np.ndarray, item_bytes: Sequence[int],
                     breaks: Optional[np.ndarray] = None) -> tuple[int, int]:
    """(spans, bytes) of a whole-page chunk before cross-region coalescing (an upper bound on the spans), from
    the ids alone: what `choose` needs, without building a descriptor. `breaks`: `plan.run_breaks` of the ids,
    where the caller has them (it then builds the runs from the same breaks)."""
    s = np.asarray(src_ids, dtype=np.int64).reshape(-1)
    d = np.asarray(dst_ids, dtype=np.int64).reshape(-1)
    if not s.size:
        return 0, 0
    runs = 1 + int((run_breaks(s, d) if breaks is None else breaks).size)
    items = np.asarray(item_bytes, dtype=np.int64)
    return runs * int(items.size), int(s.size) * int(items.sum())
