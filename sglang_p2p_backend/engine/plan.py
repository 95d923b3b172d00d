"""Pure planning of a page transfer: which bytes move, in which order, in chunks that fit the staging budget.

A transfer moves page ids of one or more *groups*: group 0 is the KV pool (every KV region shares the same
page ids: MHA K and V per layer, MLA one region per layer, draft regions appended), groups 1.. are state
components, each with its own regions and slot ids. Prefill page ids pair positionally with decode page ids.

A `Chunk` is what crosses the wire in one message: a list of `Segment`s, each a range of a group's id list
times a range of its regions. Staging layout (the same on both sides, so nothing but the segments travels):
segments in order; inside a segment, region by region; inside a region, the segment's pages in order. The
prefill gathers into that layout and the decode scatters out of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np


class PlanError(ValueError):
    """The transfer cannot be planned as asked (the message names the setting to change)."""


@dataclass(frozen=True)
class Segment:
    group: int
    region_lo: int
    region_hi: int
    lo: int  # range into the group's id list of this transfer
    hi: int


@dataclass(frozen=True)
class Chunk:
    segments: tuple[Segment, ...]
    nbytes: int


def page_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Merge paired page ids into runs where both sides are consecutive.

    Returns an (n, 3) int64 array of (src_start, dst_start, length). Same splitting rule as SGLang's
    `group_concurrent_contiguous`, vectorised.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.shape != dst.shape:
        raise PlanError(f"prefill sends {src.size} pages but decode published {dst.size} destinations")
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return np.stack([src[starts], dst[starts], ends - starts], axis=1)


def is_contiguous(ids: np.ndarray) -> bool:
    """True if ids are n consecutive increasing integers (a slice copy replaces an indexed one)."""
    return ids.size > 0 and int(ids[-1]) - int(ids[0]) == ids.size - 1 and bool(np.all(np.diff(ids) == 1))


def segment_nbytes(seg: Segment, item_lens: Sequence[int]) -> int:
    return (seg.hi - seg.lo) * sum(item_lens[seg.region_lo : seg.region_hi])


def plan_chunks(group_item_lens: Sequence[Sequence[int]], group_counts: Sequence[int], budget: int) -> list[Chunk]:
    """Split a transfer of `group_counts[g]` ids of every group into chunks of at most `budget` bytes.

    Greedy: pages of all regions of a group go together while whole pages fit; a page wider than the whole
    budget is split by regions; a single region page wider than the budget is an error (never dropped).
    """
    if budget <= 0:
        raise PlanError(f"staging budget must be positive, got {budget}")
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
                fit = (budget - cur_bytes) // page_bytes
                if fit == 0:
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
            nbytes = n * group_item_lens[seg.group][r]
            yield seg, r, off, nbytes
            off += nbytes


def copy_descriptors(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    item_lens: Sequence[int],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One-sided writes for a group: (src_addr, dst_addr, length) per merged run per region, region-major."""
    runs = page_runs(src_ids, dst_ids)
    if len(src_ptrs) != len(dst_ptrs) or len(src_ptrs) != len(item_lens):
        raise PlanError(f"prefill has {len(src_ptrs)} regions, decode {len(dst_ptrs)}: layouts differ")
    srcs, dsts, lens = [], [], []
    for sp, dp, il in zip(src_ptrs, dst_ptrs, item_lens):
        srcs.append(sp + runs[:, 0] * il)
        dsts.append(dp + runs[:, 1] * il)
        lens.append(runs[:, 2] * il)
    if not srcs:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(srcs), np.concatenate(dsts), np.concatenate(lens)
