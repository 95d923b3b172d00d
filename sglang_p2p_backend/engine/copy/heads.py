"""Which KV heads of a page a prefill rank sends a decode rank when their attention TP sizes differ (MHA/GQA).

An MHA pool region holds, per page, `page_size` token rows of `local` heads of `head_bytes` each (SGLang's
`MHATokenToKVPool`: [tokens, heads, head_dim] per layer K and V), so a head range of a page is `page_size`
strided runs. Each TP rank holds `max(1, total // tp)` heads: heads [rank * n, (rank + 1) * n) when there are at
least as many heads as ranks, else head `rank // (tp // total)` (replicated heads, as SGLang's
`get_attention_tp_rank // num_kv_head_replicas`).

The pairing follows SGLang's rank mapping (Common `_resolve_rank_mapping`) and head placement (Common
`compute_head_slice_params`, what Mooncake's `send_kvcache_slice` uses): decode TP > prefill TP: decode rank d
reads from prefill rank d // r and takes its own heads out of that rank's; decode TP < prefill TP: decode rank d
reads from prefill ranks [d * r, (d + 1) * r), each writing its heads at their offset in the decode's rows. With
replicated heads on the prefill, several of those ranks hold the same head: only the first sends it, the others
send no KV (they still report Status: Common counts every one), so each decode head is written once.
Pure functions, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class HeadsError(ValueError):
    """The two TP layouts cannot be paired head by head (the message names both)."""


@dataclass(frozen=True)
class Heads:
    """Heads [lo, hi) of the `local` heads of each of a page's `rows` token rows, on one side of a pair."""

    rows: int  # token rows per page (the page size)
    local: int  # heads one token row holds on this side
    lo: int
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo

    def item_len(self, item_len: int) -> int:
        """Bytes of this head range of one page of a region whose whole page is `item_len` bytes."""
        return item_len // self.local * self.count

    def moved(self, item_len: int, region: int) -> int:
        """`item_len` of any region (a head range is the same in every region of a group; plan.moved_len)."""
        return self.item_len(item_len)

    def head_bytes(self, item_len: int) -> int:
        return item_len // (self.rows * self.local)


@dataclass(frozen=True)
class PairHeads:
    """What one prefill rank sends one decode rank: `src` heads of its rows into `dst` heads of the decode's.
    An empty range (count 0) means this prefill rank holds a replica another rank sends: it sends no KV."""

    src: Heads
    dst: Heads


def heads_per_rank(total: int, tp: int) -> int:
    return max(1, total // tp)


def layout_problem(total: int, tp: int) -> Optional[str]:
    """Why `total` KV heads cannot be spread over `tp` ranks as SGLang spreads them, or None."""
    if total <= 0:
        return "the KV head count is unknown"
    if total >= tp and total % tp:
        return f"{total} KV heads do not divide over attention TP {tp}"
    if total < tp and tp % total:
        return f"attention TP {tp} is not a multiple of the {total} KV heads"
    return None


def pair_heads(*, total: int, page_size: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> Optional[PairHeads]:
    """The heads prefill rank `src_rank` (of `src_tp`) sends decode rank `dst_rank` (of `dst_tp`); None when both
    TP sizes are equal (whole pages move). Raises HeadsError when the pair cannot exist in SGLang's mapping."""
    if src_tp == dst_tp:
        return None
    big, small = max(src_tp, dst_tp), min(src_tp, dst_tp)
    if big % small:
        raise HeadsError(f"prefill attention TP {src_tp} and decode attention TP {dst_tp}: neither divides the other")
    for tp in (src_tp, dst_tp):
        problem = layout_problem(total, tp)
        if problem:
            raise HeadsError(problem)
    src_rank, dst_rank = src_rank % src_tp, dst_rank % dst_tp
    src_n, dst_n = heads_per_rank(total, src_tp), heads_per_rank(total, dst_tp)
    ratio = big // small
    if src_tp > dst_tp:
        if src_rank // ratio != dst_rank:
            raise HeadsError(f"prefill rank {src_rank} of {src_tp} does not serve decode rank {dst_rank} of {dst_tp}")
        src_repl = max(1, src_tp // total)
        dst_lo = (src_rank // src_repl * src_n) % dst_n
        # the first rank of each replica group among this decode rank's sources sends the head, the rest none
        replica = src_rank % ratio != 0 and (src_rank - 1) // src_repl == src_rank // src_repl
        n = 0 if replica else src_n
        return PairHeads(Heads(page_size, src_n, 0, n), Heads(page_size, dst_n, dst_lo, dst_lo + n))
    if dst_rank // ratio != src_rank:
        raise HeadsError(f"decode rank {dst_rank} of {dst_tp} does not read from prefill rank {src_rank} of {src_tp}")
    dst_repl = max(1, dst_tp // total)
    src_lo = (dst_rank // dst_repl * dst_n) % src_n
    return PairHeads(Heads(page_size, src_n, src_lo, src_lo + dst_n), Heads(page_size, dst_n, 0, dst_n))
