"""Which bytes of a state item a prefill rank sends a decode rank when their attention TP sizes differ.

SGLang shards a mamba/GDN state tensor over attention TP along one axis of its per-slot item and describes it in
KVArgs per state region: `state_dim_per_tensor` (this rank's size of the sliced axis; 0 marks an item replicated
over TP), `state_slice_outer_counts` (rows before that axis: Kimi's conv state is [K-1, dim]) and
`state_conv_shard_groups` (GDN's conv state is cat([q | k | v]), each sub-block sharded over TP on its own: the
full sub-block dims). The pairing follows SGLang 0.5.23's `compute_mamba_state_slice_byte_blocks`, which its
Mooncake backend's `_send_mamba_state_slice` uses, over SGLang's rank mapping (heads.py): decode TP > prefill TP
(scatter): decode rank d reads from prefill rank d // r the slice (d % r) of each (sub-)block; decode TP <
prefill TP (aggregation): decode rank d reads from prefill ranks [d * r, (d + 1) * r), each writing its shard at
its offset. A replicated item (dim 0) moves whole, from every source when scattering and from the first source
of each decode rank when aggregating (SGLang's `should_send_replicated_state`), so it is written once.

State types whose items are replicated over TP (QSA pending / compressed) move whole by the same election. The
SWA sub-pool's window (SGLang's `SWAKVPool.swa_kv_pool`, an MHA pool of the sliding-window layers) is laid out
like a KV page: per page, `page_size` token rows of this rank's KV heads, K regions then V regions. It is sliced
like the KV, by head ranges of every token row with the KV heads' pairing (heads.py), as SGLang 0.5.23's
Mooncake backend slices it (`_send_swa_state_slice` / Common `_get_mha_head_slice_blocks`): `pair_spans` then
answers a `heads.PairHeads` (`Window` carries what that needs beyond the item lengths). What SGLang's own
backends do not pair across TP (other types on an MHA model, the window's MXFP8 scales `block_scale_swa`,
MiniMax) is refused (`problem`).
Pure functions, no I/O: each side computes the same spans from both agreements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from sglang_p2p_backend.engine.copy.heads import HeadsError, PairHeads, heads_per_rank, layout_problem, pair_heads

#: state types sliced per tensor by state_dim_per_tensor (SGLang: StateType.MAMBA)
SLICED_TYPES = ("mamba",)
#: state types replicated over attention TP: whole items from one elected source (SGLang's QSA states)
REPLICATED_TYPES = ("qsa_pending", "qsa_compressed")
#: state types laid out like KV pages (token rows of KV heads), sliced by the KV heads' ranges (SGLang: StateType.SWA)
HEAD_SLICED_TYPES = ("swa",)
#: the window page layouts a head range can be cut out of (token-major rows: SGLang's "nhd"; "" where the release
#: has no label, 0.5.17, whose MHA pools are token-major unless SGLANG_USE_HND_KVCACHE, compared as mha_layout)
TOKEN_MAJOR_LAYOUTS = ("", "nhd")

Span = tuple[int, int]  # (byte offset in the item, bytes)


class StateSliceError(ValueError):
    """The two sides' state cannot be paired across their TP sizes (the message names both values)."""


@dataclass(frozen=True)
class Spans:
    """One side's byte spans of one item of every region of a state component, in staging order: `spans[r]`
    for region r (empty: nothing of that region moves between these two ranks)."""

    spans: tuple[tuple[Span, ...], ...]

    def moved(self, item_len: int, region: int) -> int:
        """Bytes one item of `region` contributes (`item_len` is implied by the spans)."""
        return sum(n for _, n in self.spans[region])


@dataclass(frozen=True)
class PairSpans:
    """What one prefill rank sends one decode rank of a component: `src` spans of its items into `dst` spans of
    the decode's (pairwise equal lengths)."""

    src: Spans
    dst: Spans

    @property
    def empty(self) -> bool:
        return not any(self.src.spans)


#: what one prefill rank sends one decode rank of a component sliced over TP: byte spans of each item, or (an SWA
#: window) the KV heads' range of each token row of its pages
StatePlan = Union[PairSpans, PairHeads]


@dataclass(frozen=True)
class Shards:
    """One side's description of a component's regions (KVArgs, per region): item bytes, the sliced axis's size
    on this rank (0: replicated), rows before that axis, and GDN's full sub-block dims (empty: one block)."""

    item_lens: tuple[int, ...]
    dims: tuple[int, ...]
    outer: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Window:
    """What pairing a window by KV heads needs beyond its item lengths, from both agreements: the model's KV head
    count (SGLang's total_kv_head_num, the prefill's), the page size, each side's window layout label
    (KVArgs.swa_kv_cache_layout) and the bytes of one KV head of one token of the KV regions (the prefill's; -1
    where a KV page does not split into whole heads). SGLang's SWAKVPool builds its window sub-pool with the KV's
    heads, head dim and dtype, so a window head is a KV head: a window whose head is not is not this layout."""

    total: int
    page_size: int
    layouts: tuple[str, str]
    kv_head_bytes: tuple[int, ...]


def _window_problem(src_lens: Sequence[int], src_tp: int, dst_lens: Sequence[int], dst_tp: int,
                    window: Optional[Window]) -> Optional[str]:
    if window is None:
        return "the KV head layout it is sliced by is unknown (an MLA pool)"
    for side, layout in zip(("prefill", "decode"), window.layouts):
        if layout not in TOKEN_MAJOR_LAYOUTS:
            return (f"the {side}'s window pages are {layout!r} (KVArgs.swa_kv_cache_layout): p2pnccl slices only "
                    f"token-major (nhd) pages by heads")
    big, small = max(src_tp, dst_tp), min(src_tp, dst_tp)
    if small < 1 or big % small:
        return f"prefill attention TP {src_tp} and decode attention TP {dst_tp}: neither divides the other"
    for tp in (src_tp, dst_tp):
        why = layout_problem(window.total, tp)
        if why:
            return why
    if window.page_size < 1:
        return f"page size {window.page_size}"
    if len(src_lens) != len(dst_lens) or not src_lens:
        return f"{len(src_lens)} window regions on the prefill, {len(dst_lens)} on the decode"
    s_n, d_n, rows = heads_per_rank(window.total, src_tp), heads_per_rank(window.total, dst_tp), window.page_size
    for i, (s_len, d_len) in enumerate(zip(src_lens, dst_lens)):
        if s_len <= 0 or d_len <= 0 or s_len % (rows * s_n) or d_len % (rows * d_n):
            return (f"region {i}: pages of {s_len} (prefill, {s_n} heads) and {d_len} (decode, {d_n} heads) bytes "
                    f"do not split into {rows} token rows of whole heads")
        s_hb, d_hb = s_len // (rows * s_n), d_len // (rows * d_n)
        if s_hb != d_hb:
            return (f"region {i}: a head of one token is {s_hb} bytes on the prefill ({s_n} of {window.total} heads, "
                    f"pages of {s_len} bytes) and {d_hb} on the decode ({d_n} heads, pages of {d_len} bytes)")
        if s_hb not in window.kv_head_bytes:
            return (f"region {i}: a window head of {s_hb} bytes is no KV head ({sorted(set(window.kv_head_bytes))} "
                    f"bytes): the window does not hold the KV's {window.total} heads")
    return None


def _check_ranks(src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> int:
    """The ratio of the larger TP size to the smaller; raises when the pair is not in SGLang's mapping."""
    big, small = max(src_tp, dst_tp), min(src_tp, dst_tp)
    if small < 1 or big % small:
        raise StateSliceError(f"prefill attention TP {src_tp} and decode attention TP {dst_tp}: neither divides the other")
    ratio = big // small
    if src_tp > dst_tp and src_rank // ratio != dst_rank:
        raise StateSliceError(f"prefill rank {src_rank} of {src_tp} does not serve decode rank {dst_rank} of {dst_tp}")
    if dst_tp > src_tp and dst_rank // ratio != src_rank:
        raise StateSliceError(f"decode rank {dst_rank} of {dst_tp} does not read from prefill rank {src_rank} of {src_tp}")
    return ratio


def elected(src_tp: int, src_rank: int, dst_tp: int) -> bool:
    """Whether prefill rank `src_rank` writes an item replicated over TP to the decode ranks it serves (SGLang's
    `should_send_replicated_state`): always when scattering, the first of each group when aggregating."""
    return src_tp <= dst_tp or src_rank % (src_tp // dst_tp) == 0


def _region_problem(i: int, src: Shards, src_tp: int, dst: Shards, dst_tp: int) -> Optional[str]:
    s_len, d_len, s_dim, d_dim = src.item_lens[i], dst.item_lens[i], src.dims[i], dst.dims[i]
    where = f"region {i}"
    if (s_dim == 0) != (d_dim == 0):
        return f"{where} is replicated on one side only (state_dim_per_tensor prefill {s_dim}, decode {d_dim})"
    if s_dim == 0:
        return None if s_len == d_len else f"{where}: replicated items of {s_len} (prefill) and {d_len} (decode) bytes"
    if s_dim * src_tp != d_dim * dst_tp:
        return (f"{where}: sliced axis of {s_dim} x TP {src_tp} on the prefill, {d_dim} x TP {dst_tp} on the decode "
                f"(state_dim_per_tensor): not the same tensor")
    if src.outer[i] != dst.outer[i] or src.outer[i] < 1:
        return f"{where}: {src.outer[i]} (prefill) and {dst.outer[i]} (decode) rows before the sliced axis (state_slice_outer_counts)"
    outer = src.outer[i]
    if s_len % (s_dim * outer) or d_len % (d_dim * outer) or s_len // (s_dim * outer) != d_len // (d_dim * outer):
        return (f"{where}: items of {s_len} bytes over {outer} x {s_dim} (prefill) and {d_len} bytes over {outer} x "
                f"{d_dim} (decode) are not the same bytes per slice")
    if src.groups[i] != dst.groups[i]:
        return (f"{where}: conv sub-blocks {list(src.groups[i])} (prefill) and {list(dst.groups[i])} (decode) "
                f"(state_conv_shard_groups)")
    groups = src.groups[i]
    if groups and (sum(groups) != s_dim * src_tp or any(g % src_tp or g % dst_tp for g in groups)):
        return (f"{where}: conv sub-blocks {list(groups)} do not shard evenly over TP {src_tp} and {dst_tp} into the "
                f"sliced axis of {s_dim * src_tp}")
    return None


def problem(kind: str, src: Shards, src_tp: int, dst: Shards, dst_tp: int,
            window: Optional[Window] = None) -> Optional[str]:
    """Why a component of type `kind` cannot be paired between these two TP sizes, or None. `src` is the
    prefill's description, `dst` the decode's; every list is checked against the region count first (they
    arrive over the network). `window`: the KV head layout an SWA window is sliced by."""
    if kind in REPLICATED_TYPES:
        if src.item_lens != dst.item_lens:
            return f"replicated {kind} items of {list(src.item_lens)} (prefill) and {list(dst.item_lens)} (decode) bytes"
        return None
    if kind in HEAD_SLICED_TYPES:
        return _window_problem(src.item_lens, src_tp, dst.item_lens, dst_tp, window)
    if kind == "block_scale_swa":
        return ("the SWA window's MXFP8 scales are not sliced by KV heads (SGLang may lay them out interleaved per "
                "page, mxfp8_sf_interleaved; its Mooncake backend refuses them across TP too)")
    if kind not in SLICED_TYPES:
        return (f"a {kind} component is not sliced over attention TP (SGLang's own backends refuse it on an MHA/GQA "
                f"model too)")
    n = len(src.item_lens)
    for side, sh in (("prefill", src), ("decode", dst)):
        counts = (len(sh.item_lens), len(sh.dims), len(sh.outer), len(sh.groups))
        if len(sh.item_lens) != n or len(set(counts)) != 1:
            return (f"the {side} describes {counts[0]} regions with {counts[1]} state_dim_per_tensor, {counts[2]} "
                    f"state_slice_outer_counts and {counts[3]} state_conv_shard_groups entries (the prefill has {n} "
                    f"regions)")
        if any(d < 0 for d in sh.dims) or any(o < 0 for o in sh.outer) or any(g <= 0 for gs in sh.groups for g in gs):
            return f"the {side}'s state_dim_per_tensor, state_slice_outer_counts or conv sub-blocks are not positive"
    for i in range(n):
        why = _region_problem(i, src, src_tp, dst, dst_tp)
        if why:
            return why
    return None


def _dim_blocks(s_dim: int, d_dim: int, src_tp: int, dst_tp: int, src_rank: int, dst_rank: int,
                groups: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, count) along the sliced axis (SGLang's `compute_mamba_state_slice_blocks`)."""
    blocks: list[tuple[int, int, int]] = []
    if src_tp > dst_tp:  # aggregation: this prefill rank's shard at its offset in the decode's
        writer = src_rank % (src_tp // dst_tp)
        if not groups:
            return [(0, writer * s_dim, s_dim)]
        s_off = d_off = 0
        for full in groups:
            s_sub, d_sub = full // src_tp, full // dst_tp
            blocks.append((s_off, d_off + writer * s_sub, s_sub))
            s_off, d_off = s_off + s_sub, d_off + d_sub
        return blocks
    if not groups:  # scatter: the decode rank's slice out of the prefill rank's
        return [((dst_rank * d_dim) % s_dim, 0, d_dim)]
    s_off = d_off = 0
    for full in groups:
        s_sub, d_sub = full // src_tp, full // dst_tp
        blocks.append((s_off + (dst_rank * d_sub) % s_sub, d_off, d_sub))
        s_off, d_off = s_off + s_sub, d_off + d_sub
    return blocks


def pair_spans(kind: str, src: Shards, src_tp: int, src_rank: int, dst: Shards, dst_tp: int,
               dst_rank: int, window: Optional[Window] = None) -> Optional[StatePlan]:
    """The spans prefill rank `src_rank` (of `src_tp`) sends decode rank `dst_rank` (of `dst_tp`) of every item
    of a component; for an SWA window, the head range of every token row of its pages (the KV heads' pairing:
    an empty range from a prefill rank holding a replica another rank sends); None when both TP sizes are equal
    (whole items move). Raises StateSliceError when the component cannot be paired or the two ranks are not
    paired by SGLang's mapping."""
    if src_tp == dst_tp:
        return None
    src_rank, dst_rank = src_rank % src_tp, dst_rank % dst_tp
    _check_ranks(src_tp, src_rank, dst_tp, dst_rank)
    why = problem(kind, src, src_tp, dst, dst_tp, window)
    if why:
        raise StateSliceError(why)
    if kind in HEAD_SLICED_TYPES:
        try:
            return pair_heads(total=window.total, page_size=window.page_size, src_tp=src_tp, src_rank=src_rank,
                              dst_tp=dst_tp, dst_rank=dst_rank)
        except HeadsError as e:
            raise StateSliceError(str(e)) from e
    send_replicated = elected(src_tp, src_rank, dst_tp)
    src_spans, dst_spans = [], []
    for i, s_len in enumerate(src.item_lens):
        if kind in REPLICATED_TYPES or src.dims[i] == 0:
            whole = ((0, s_len),) if send_replicated and s_len else ()
            src_spans.append(whole)
            dst_spans.append(whole)
            continue
        outer = src.outer[i]
        s_row, d_row = s_len // outer, dst.item_lens[i] // outer
        unit = s_row // src.dims[i]  # bytes of one index of the sliced axis (the same on both sides)
        blocks = _dim_blocks(src.dims[i], dst.dims[i], src_tp, dst_tp, src_rank, dst_rank, src.groups[i])
        src_spans.append(tuple((o * s_row + s * unit, n * unit) for o in range(outer) for s, _, n in blocks))
        dst_spans.append(tuple((o * d_row + d * unit, n * unit) for o in range(outer) for _, d, n in blocks))
    return PairSpans(Spans(tuple(src_spans)), Spans(tuple(dst_spans)))
