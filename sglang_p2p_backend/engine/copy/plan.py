"""Pure planning of a page transfer: which bytes move, in which order, in chunks that fit the staging budget.

A transfer moves page ids of one or more *groups*: group 0 is the KV pool (every KV region shares the same
page ids: MHA K and V per layer, MLA one region per layer, draft regions appended), groups 1.. are state
components, each with its own regions and slot ids. Prefill page ids pair positionally with decode page ids.

A `Chunk` is what crosses the wire in one message: a list of `Segment`s, each a range of a group's id list
times a range of its regions. Staging layout (the same on both sides, so nothing but the segments travels):
segments in order; inside a segment, region by region; inside a region, the segment's pages in order. The
prefill gathers into that layout and the decode scatters out of it.

With different attention TP on the two sides (MHA/GQA), a KV segment names a head range (`heads.Heads`): a page
then contributes only those heads of each of its token rows, rows in order, so the staging holds exactly the
bytes the decode rank owns and chunks stay as large as with whole pages. Each side describes the range in its
own pool (the prefill's `src`, the decode's `dst`); the byte counts agree because a head is the same size on both.
A state segment may instead name byte spans of every region's item (`state_slices.Spans`: a mamba state sliced
over TP): an item then contributes those spans, in order, region by region. An SWA window's state segment names a head
range as a KV segment does (its pages are KV pages of the sliding-window layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

from sglang_p2p_backend.engine.copy.heads import Heads, PairHeads
from sglang_p2p_backend.engine.copy.state_slices import PairSpans, Spans

#: what a segment moves of each item: whole items (None), a head range (KV) or byte spans per region (state)
Slice = Optional[Union[Heads, Spans]]


class PlanError(ValueError):
    """The transfer cannot be planned as asked (the message names the setting to change)."""


@dataclass(frozen=True)
class Segment:
    group: int
    region_lo: int
    region_hi: int
    lo: int  # range into the group's id list of this transfer
    hi: int
    heads: Slice = None  # None: whole pages; else only these heads of every token row, or these spans of every item


@dataclass(frozen=True)
class Chunk:
    segments: tuple[Segment, ...]
    nbytes: int


def run_breaks(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Positions where a new run of paired page ids starts (after the first): where either side is not
    consecutive. len + 1 is the run count, which is all `ce_plan.choose` needs of a chunk."""
    # slices, not np.diff: the same arrays without np.diff's Python-level checks (a few us a call, on a hot path)
    src, dst = np.asarray(src), np.asarray(dst)
    return np.flatnonzero((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)) + 1


def page_runs(src: np.ndarray, dst: np.ndarray, breaks: Optional[np.ndarray] = None) -> np.ndarray:
    """Merge paired page ids into runs where both sides are consecutive.

    Returns an (n, 3) int64 array of (src_start, dst_start, length). Same splitting rule as SGLang's
    `group_concurrent_contiguous`, vectorised. `breaks`: `run_breaks` of the same ids, where the caller has it.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.shape != dst.shape:
        raise PlanError(f"prefill sends {src.size} pages but decode published {dst.size} destinations")
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if breaks is None:
        breaks = run_breaks(src, dst)
    if not breaks.size:  # one run (contiguous pages, the common case of a long prompt): no concatenation
        return np.array([[src[0], dst[0], src.size]], dtype=np.int64)
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return np.stack([src[starts], dst[starts], ends - starts], axis=1)


def is_contiguous(ids: np.ndarray) -> bool:
    """True if ids are n consecutive increasing integers (a slice copy replaces an indexed one)."""
    return ids.size > 0 and int(ids[-1]) - int(ids[0]) == ids.size - 1 and bool(np.all(np.diff(ids) == 1))


#: native signed id types -> (the unsigned type of their width, the bounds below which a negative id, read as
#: that type, is past the bound)
_UNSIGNED = {np.dtype(t): (np.dtype(u), 1 << (8 * np.dtype(t).itemsize - 1))
             for t, u in ((np.int8, np.uint8), (np.int16, np.uint16), (np.int32, np.uint32), (np.int64, np.uint64))}


def _bad_range(ids: np.ndarray, limit: int) -> Optional[tuple[int, int]]:
    """(min, max) of page ids that must lie in [0, limit) when some do not, else None (also for no ids). Checked in
    one pass over the ids (they are on every chunk's path): read as unsigned of their width a negative id is past
    any bound below 2**(bits-1); min and max only when something is wrong."""
    if len(ids) == 0:
        return None
    a = np.asarray(ids)
    unsigned = _UNSIGNED.get(a.dtype)
    if unsigned is not None and limit <= unsigned[1] and int(a.view(unsigned[0]).max()) < limit:
        return None
    lo, hi = int(np.min(a)), int(np.max(a))
    return (lo, hi) if lo < 0 or hi >= limit else None


def ids_out_of_range(ids: np.ndarray, limit: int) -> Optional[str]:
    """What is wrong with page ids that must lie in [0, limit), None if nothing (or no ids)."""
    bad = _bad_range(ids, limit)
    return None if bad is None else f"page id out of range [0, {limit}): min {bad[0]}, max {bad[1]}"


def out_of_range_id(ids: np.ndarray, limit: int) -> Optional[int]:
    """One page id outside [0, limit) (the smallest if one is negative, else the largest), None if none."""
    bad = _bad_range(ids, limit)
    return None if bad is None else (bad[0] if bad[0] < 0 else bad[1])


def moved_len(item_len: int, heads: Slice, region: int = 0) -> int:
    """Bytes one page of region `region` contributes: the whole page, only the head range, or the spans."""
    return item_len if heads is None else heads.moved(item_len, region)


def segment_nbytes(seg: Segment, item_lens: Sequence[int]) -> int:
    return (seg.hi - seg.lo) * sum(moved_len(item_lens[r], seg.heads, r) for r in range(seg.region_lo, seg.region_hi))


def plan_chunks(
    group_item_lens: Sequence[Sequence[int]],
    group_counts: Sequence[int],
    budget: int,
    heads: Sequence[Slice] = (),
    first: int = 0,
) -> list[Chunk]:
    """Split a transfer of `group_counts[g]` ids of every group into chunks of at most `budget` bytes.

    Greedy: pages of all regions of a group go together while whole pages fit; a page wider than the whole
    budget is split by regions; a single region page wider than the budget is an error (never dropped).
    `heads[g]` (when given and not None) moves only that head range (or those spans) of group g's pages (every
    segment of the group carries it). `first` (> 0): a transfer of more than `budget` bytes ramps up, its first
    chunk at most `first` bytes and each next at most twice the one before (`ramp_caps`).
    """
    if not any(h is not None for h in heads):  # whole pages: the lengths as they are, no call per layer
        return plan_chunks_whole(group_item_lens, group_counts, budget, first)
    planned = plan_chunks_whole(
        [[moved_len(x, heads[g] if g < len(heads) else None, r) for r, x in enumerate(lens)]
         for g, lens in enumerate(group_item_lens)],
        group_counts,
        budget,
        first,
    )
    return [
        Chunk(tuple(Segment(s.group, s.region_lo, s.region_hi, s.lo, s.hi, heads[s.group] if s.group < len(heads) else None)
                    for s in c.segments), c.nbytes)
        for c in planned
    ]


def ramp_caps(total: int, budget: int, first: int) -> Callable[[int], int]:
    """The byte cap of chunk i of a `total`-byte transfer: `budget`, except that a transfer of more than one budget
    starts at `first` bytes and doubles up to it. The link then starts after the gather of a short chunk instead of
    a whole slot's (the first chunk's gather is the one nothing overlaps: docs/nccl.md, a request's head), and
    the later chunks, larger, keep the per-chunk costs few."""
    if first <= 0 or first >= budget or total <= budget:
        return lambda i: budget
    return lambda i: min(budget, first << min(i, 62))


def plan_chunks_whole(group_item_lens: Sequence[Sequence[int]], group_counts: Sequence[int], budget: int,
                      first: int = 0) -> list[Chunk]:
    """`plan_chunks` of whole pages of `group_item_lens` bytes per region."""
    if budget <= 0:
        raise PlanError(f"staging budget must be positive, got {budget}")
    cap = ramp_caps(sum(sum(lens) * n for lens, n in zip(group_item_lens, group_counts)), budget, first)
    chunks: list[Chunk] = []
    cur: list[Segment] = []
    cur_bytes = 0

    def close() -> None:
        nonlocal cur, cur_bytes
        if cur:
            chunks.append(Chunk(tuple(cur), cur_bytes))
            cur, cur_bytes = [], 0

    for g, (item_lens, count) in enumerate(zip(group_item_lens, group_counts)):
        page_bytes = sum(item_lens)
        if count == 0 or page_bytes == 0:
            continue
        if page_bytes <= budget:
            pos = 0
            while pos < count:
                fit = (cap(len(chunks)) - cur_bytes) // page_bytes
                if fit <= 0:
                    if not cur:  # a page wider than this chunk's ramp cap (but within budget): one alone
                        fit = 1
                    else:
                        close()
                        continue
                n = min(fit, count - pos)
                cur.append(Segment(g, 0, len(item_lens), pos, pos + n))
                cur_bytes += n * page_bytes
                pos += n
            continue
        # one page of this group is wider than the budget: one page at a time, regions split
        close()
        widest = max(item_lens)
        if widest > budget:
            raise PlanError(
                f"one page of a region is {widest} bytes, more than the staging budget of {budget} bytes; "
                f"raise SGLANG_P2P_STAGING_MB"
            )
        for pos in range(count):
            r = 0
            while r < len(item_lens):
                r_hi, nbytes = r, 0
                while r_hi < len(item_lens) and nbytes + item_lens[r_hi] <= budget:
                    nbytes += item_lens[r_hi]
                    r_hi += 1
                chunks.append(Chunk((Segment(g, r, r_hi, pos, pos + 1),), nbytes))
                r = r_hi
    close()
    return chunks


def staging_blocks(chunk: Chunk, group_item_lens: Sequence[Sequence[int]]) -> Iterator[tuple[Segment, int, int, int]]:
    """Yield (segment, region, offset, nbytes) of every block of a chunk's staging layout, in order."""
    off = 0
    for seg in chunk.segments:
        n = seg.hi - seg.lo
        for r in range(seg.region_lo, seg.region_hi):
            nbytes = n * moved_len(group_item_lens[seg.group][r], seg.heads, r)
            yield seg, r, off, nbytes
            off += nbytes


def copy_descriptors(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    item_lens: Sequence[int],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    heads: Optional[Union[PairHeads, PairSpans]] = None,
    dst_item_lens: Optional[Sequence[int]] = None,
    runs: Optional[np.ndarray] = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One-sided writes for a group: (src_addr, dst_addr, length) per merged run per region, region-major.
    With `heads`, one write per token row of every page instead (the head range is strided), or one per span of
    every item (`PairSpans`), `dst_item_lens` being the decode's page (item) sizes. `runs`: `page_runs` of the
    ids, where the caller has them (whole pages only)."""
    if len(src_ptrs) != len(dst_ptrs) or len(src_ptrs) != len(item_lens):
        raise PlanError(f"prefill has {len(src_ptrs)} regions, decode {len(dst_ptrs)}: layouts differ")
    if isinstance(heads, PairSpans):
        return _span_descriptors(src_ptrs, dst_ptrs, item_lens, dst_item_lens or item_lens, src_ids, dst_ids, heads)
    if heads is not None:
        return _head_descriptors(src_ptrs, dst_ptrs, item_lens, dst_item_lens or item_lens, src_ids, dst_ids, heads)
    if runs is None:
        runs = page_runs(src_ids, dst_ids)
    empty = np.zeros(0, dtype=np.int64)
    if not len(src_ptrs) or not len(runs):
        return empty, empty, empty
    # one broadcast over (region, run), region-major: no Python loop per layer on the chunk's hot path
    items = np.asarray(item_lens, dtype=np.int64).reshape(-1, 1)
    src = np.asarray(src_ptrs, dtype=np.int64).reshape(-1, 1) + runs[:, 0] * items
    dst = np.asarray(dst_ptrs, dtype=np.int64).reshape(-1, 1) + runs[:, 1] * items
    return src.reshape(-1), dst.reshape(-1), (runs[:, 2] * items).reshape(-1)


def _id_pair(src_ids: np.ndarray, dst_ids: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Both id lists as flat int64, refused unless they pair one to one."""
    src = np.asarray(src_ids, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_ids, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise PlanError(f"prefill sends {src.size} {what} but decode published {dst.size} destinations")
    return src, dst


def _head_descriptors(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    src_lens: Sequence[int],
    dst_lens: Sequence[int],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    heads: PairHeads,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per region, per page, per token row: the head range's bytes (as Mooncake's `send_kvcache_slice`)."""
    src_ids, dst_ids = _id_pair(src_ids, dst_ids, "pages")
    empty = np.zeros(0, dtype=np.int64)
    if not src_ids.size or not heads.src.count:
        return empty, empty, empty
    if len(dst_lens) != len(src_lens):
        raise PlanError(f"prefill has {len(src_lens)} regions, decode {len(dst_lens)}: layouts differ")
    # (region, page, row) broadcast, region-major then page then row: one array op per term, none per layer
    sl = np.asarray(src_lens, dtype=np.int64).reshape(-1, 1, 1)
    dl = np.asarray(dst_lens, dtype=np.int64).reshape(-1, 1, 1)
    hb, dst_hb = heads.src.head_bytes(sl), heads.dst.head_bytes(dl)
    if (hb != dst_hb).any():
        r = int(np.flatnonzero((hb != dst_hb).reshape(-1))[0])
        raise PlanError(f"a head is {int(hb.reshape(-1)[r])} bytes on the prefill but {int(dst_hb.reshape(-1)[r])} "
                        f"on the decode")
    rows = np.arange(heads.src.rows, dtype=np.int64).reshape(1, 1, -1)
    s_ids, d_ids = src_ids.reshape(1, -1, 1), dst_ids.reshape(1, -1, 1)
    s = np.asarray(src_ptrs, dtype=np.int64).reshape(-1, 1, 1) + s_ids * sl + rows * (sl // heads.src.rows) + heads.src.lo * hb
    d = np.asarray(dst_ptrs, dtype=np.int64).reshape(-1, 1, 1) + d_ids * dl + rows * (dl // heads.dst.rows) + heads.dst.lo * hb
    n = np.broadcast_to(heads.src.count * hb, s.shape)
    return s.reshape(-1), d.reshape(-1), np.ascontiguousarray(n).reshape(-1)


def _span_descriptors(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    src_lens: Sequence[int],
    dst_lens: Sequence[int],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    spans: PairSpans,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per region, per item, per span: the span's bytes (as Mooncake's `_send_mamba_state_slice`)."""
    src_ids, dst_ids = _id_pair(src_ids, dst_ids, "items")
    if len(spans.src.spans) != len(src_ptrs) or len(spans.dst.spans) != len(dst_ptrs) or len(dst_lens) != len(dst_ptrs):
        raise PlanError(f"state spans name {len(spans.src.spans)} regions, the component has {len(src_ptrs)}")
    srcs, dsts, lens = [], [], []
    for r, (sp, dp, sl, dl) in enumerate(zip(src_ptrs, dst_ptrs, src_lens, dst_lens)):
        for (so, n), (do, m) in zip(spans.src.spans[r], spans.dst.spans[r]):
            if n != m or so < 0 or do < 0 or so + n > sl or do + n > dl:
                raise PlanError(f"state region {r}: span {so}+{n} -> {do}+{m} outside items of {sl} and {dl} bytes")
            srcs.append(sp + src_ids * sl + so)
            dsts.append(dp + dst_ids * dl + do)
            lens.append(np.full(src_ids.size, n, dtype=np.int64))
    if not srcs:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(srcs), np.concatenate(dsts), np.concatenate(lens)
