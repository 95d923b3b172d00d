"""State components sliced over different attention TP (engine/copy/state_slices.py): the spans, their planning,
packing and one-sided writes, and what is refused.

Each TP rank's items are built as SGLang's MambaPool shards a model's state: per region, the model's whole item
is (outer rows, full sliced axis, bytes per index); a rank holds its contiguous shard of the axis, or of each of
GDN's q | k | v sub-blocks. Every pairing of SGLang's rank mapping must give each decode rank exactly its shard,
each byte written once, and touch nothing else. The spans are also checked against SGLang's own
`compute_mamba_state_slice_byte_blocks`, which its Mooncake backend sends by.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_p2p_backend.engine.copy.copier import copy_chunk
from sglang_p2p_backend.engine.copy.plan import copy_descriptors, plan_chunks
from sglang_p2p_backend.engine.copy.heads import PairHeads, heads_per_rank
from sglang_p2p_backend.engine.copy.state_slices import (
    PairSpans,
    Shards,
    StateSliceError,
    Window,
    elected,
    pair_spans,
    problem,
)
from sglang_p2p_backend.engine.wire.agreement import differences, local_agreement, pair_state_spans
from sglang_p2p_backend.engine.wire.checks import chunk_layout
from sglang_p2p_backend.engine.wire.messages import ChunkHeader, ChunkSegment

SLOTS = 6
# (full sliced axis, outer rows, bytes per index, GDN sub-blocks or ()): GDN conv [q|k|v] x (K-1), temporal
# heads, Kimi conv [K-1, q|k|v] (3 outer rows), a replicated item (axis 0)
REGIONS = [(64, 1, 6, (16, 16, 32)), (8, 1, 20, ()), (48, 3, 2, (16, 16, 16)), (0, 1, 40, ())]


def senders(src_tp: int, dst_tp: int, d: int) -> list[int]:
    """Prefill ranks SGLang's Common maps decode rank d to."""
    if dst_tp >= src_tp:
        return [d // (dst_tp // src_tp)]
    r = src_tp // dst_tp
    return list(range(d * r, (d + 1) * r))


def shard_index(full: int, groups: tuple, tp: int, rank: int) -> list[int]:
    """Indices of the model's sliced axis a TP rank holds (each sub-block sharded on its own)."""
    out, base = [], 0
    for g in groups or (full,):
        n = g // tp
        out += list(range(base + rank * n, base + (rank + 1) * n))
        base += g
    return out


def shards(tp: int) -> Shards:
    return Shards(tuple(outer * (full // tp if full else 1) * unit for full, outer, unit, _ in REGIONS),
                  tuple(full // tp for full, _, _, _ in REGIONS), tuple(o for _, o, _, _ in REGIONS),
                  tuple(g for _, _, _, g in REGIONS))


def model_items(seed: int) -> list[torch.Tensor]:
    """The model's whole state item per region: (slots, outer, full axis, unit) uint8."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (SLOTS, outer, max(full, 1), unit), dtype=torch.uint8, generator=g)
            for full, outer, unit, _ in REGIONS]


def rank_items(model: list[torch.Tensor], tp: int, rank: int) -> list[torch.Tensor]:
    """(slots, item bytes) per region: what TP rank `rank` holds."""
    out = []
    for t, (full, outer, unit, groups) in zip(model, REGIONS):
        part = t[:, :, shard_index(full, groups, tp, rank)] if full else t
        out.append(part.reshape(SLOTS, -1).clone())
    return out


PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize("src_tp,dst_tp", PAIRS)
@pytest.mark.parametrize("path", ["staging", "one-sided"])
def test_each_decode_rank_gets_exactly_its_shard_once(src_tp, dst_tp, path):
    model = model_items(7)
    src_ids, dst_ids = np.array([4, 1]), np.array([2, 5])
    for d in range(dst_tp):
        dst = [torch.full((SLOTS, n), 0xA5, dtype=torch.uint8) for n in shards(dst_tp).item_lens]
        for p in senders(src_tp, dst_tp, d):
            src = rank_items(model, src_tp, p)
            spans = pair_spans("mamba", shards(src_tp), src_tp, p, shards(dst_tp), dst_tp, d)
            if path == "staging":
                _through_staging(src, dst, src_ids, dst_ids, spans)
            else:
                _one_sided(src, dst, src_ids, dst_ids, spans, shards(dst_tp).item_lens)
        want = rank_items(model, dst_tp, d)
        for r, (got, exp) in enumerate(zip(dst, want)):
            assert torch.equal(got[dst_ids], exp[src_ids]), f"decode rank {d} region {r}"
            others = [i for i in range(SLOTS) if i not in dst_ids]
            assert bool((got[others] == 0xA5).all()), f"decode rank {d} region {r}: another slot changed"
        # each shard byte from exactly one writer: the writers' dst spans tile every item once
        for r in range(len(REGIONS)):
            covered = np.zeros(shards(dst_tp).item_lens[r], dtype=int)
            for p in senders(src_tp, dst_tp, d):
                for o, n in pair_spans("mamba", shards(src_tp), src_tp, p, shards(dst_tp), dst_tp, d).dst.spans[r]:
                    covered[o : o + n] += 1
            assert covered.tolist() == [1] * covered.size, f"decode rank {d} region {r}: {covered.tolist()}"


def _through_staging(src, dst, src_ids, dst_ids, spans: PairSpans) -> None:
    """Prefill packs (plan + gather), decode checks the header against its own spans and scatters."""
    budget = 1 << 20
    chunks = plan_chunks([[0], [t.shape[1] for t in src]], [0, len(src_ids)], budget, [None, spans.src])
    for chunk in chunks:
        staging = torch.zeros(budget, dtype=torch.uint8)
        copy_chunk(chunk, [[torch.zeros(1, 1, dtype=torch.uint8)], src], [np.zeros(0, np.int64), src_ids], staging,
                   scatter=False)
        segs = [ChunkSegment(s.group, s.region_lo, s.region_hi, dst_ids[s.lo : s.hi].astype(np.int32).tobytes())
                for s in chunk.segments]
        header = ChunkHeader("127.0.0.1:1", 0, 1, 0, 0, chunk.nbytes, segs)
        verdict = chunk_layout(header, [[1], [t.shape[1] for t in dst]], budget, state_spans=(spans.dst,))
        assert verdict.problem is None, verdict.problem
        copy_chunk(verdict.chunk, [[torch.zeros(1, 1, dtype=torch.uint8)], dst], verdict.ids, staging, scatter=True)


def _one_sided(src, dst, src_ids, dst_ids, spans: PairSpans, dst_lens) -> None:
    s, d, n = copy_descriptors([t.data_ptr() for t in src], [t.data_ptr() for t in dst], [t.shape[1] for t in src],
                               src_ids, dst_ids, spans, dst_lens)
    base_s = {t.data_ptr(): t for t in src}
    base_d = {t.data_ptr(): t for t in dst}

    def find(bases, addr):
        for p, t in bases.items():
            if p <= addr < p + t.numel():
                return t.view(-1), addr - p
        raise AssertionError(f"address {addr:#x} outside every region")

    for a, b, ln in zip(s.tolist(), d.tolist(), n.tolist()):
        (st, so), (dt, do) = find(base_s, a), find(base_d, b)
        assert do + ln <= dt.numel()
        dt[do : do + ln] = st[so : so + ln]


@pytest.mark.parametrize("src_tp,dst_tp", PAIRS)
def test_spans_are_sglangs_byte_blocks(src_tp, dst_tp):
    utils = pytest.importorskip("sglang.srt.disaggregation.utils")
    blocks = getattr(utils, "compute_mamba_state_slice_byte_blocks", None)
    if blocks is None:
        pytest.skip("this SGLang release has no compute_mamba_state_slice_byte_blocks")
    src, dst = shards(src_tp), shards(dst_tp)
    for d in range(dst_tp):
        for p in senders(src_tp, dst_tp, d):
            ours = pair_spans("mamba", src, src_tp, p, dst, dst_tp, d)
            for r in range(len(REGIONS)):
                if not src.dims[r] and not hasattr(utils, "should_send_replicated_state"):
                    continue  # SGLang 0.5.17 has no replicated-item marker (its pools never report a zero dim)
                theirs = blocks(src_item_len=src.item_lens[r], dst_item_len=dst.item_lens[r], src_dim=src.dims[r],
                                dst_dim=dst.dims[r], outer_count=src.outer[r], src_attn_tp_size=src_tp,
                                dst_attn_tp_size=dst_tp, dst_tp_rank_in_group=d, local_tp_rank_in_group=p,
                                conv_shard_groups=list(src.groups[r]) or None)
                assert [(s, n) for s, _, n in theirs] == list(ours.src.spans[r]), (p, d, r)
                assert [(o, n) for _, o, n in theirs] == list(ours.dst.spans[r]), (p, d, r)


def test_replicated_items_are_written_by_one_elected_source():
    assert [elected(4, p, 2) for p in range(4)] == [True, False, True, False]
    assert all(elected(1, 0, 4) for _ in range(4))
    sh = Shards((96,), (), (), ())
    for p in range(4):
        spans = pair_spans("qsa_pending", sh, 4, p, sh, 2, p // 2)
        assert spans.src.spans == (((0, 96),) if p % 2 == 0 else (),)
    assert pair_spans("qsa_pending", sh, 2, 2, sh, 2, 1) is None  # same TP: whole items, no spans


def test_what_cannot_be_sliced_is_named():
    good = shards(2)
    assert problem("mamba", good, 2, shards(1), 1) is None
    assert "a swa_ring component is not sliced over attention TP" in problem("swa_ring", good, 2, shards(1), 1)
    assert "not sliced by KV heads" in problem("block_scale_swa", good, 2, shards(1), 1)
    for kind in ("minimax_index_k", "minimax_dense_kv", "dsa", "c128_state", "request_row", "block_scale"):
        assert f"a {kind} component is not sliced over attention TP" in problem(kind, good, 2, shards(1), 1)
    one = shards(1)
    bad_groups = Shards(one.item_lens, one.dims, one.outer, ((16, 32, 16),) + one.groups[1:])
    assert "region 0: conv sub-blocks [16, 16, 32] (prefill) and [16, 32, 16] (decode)" in problem("mamba", good, 2, bad_groups, 1)
    short = Shards(one.item_lens, one.dims[:2], one.outer, one.groups)
    assert "the decode describes 4 regions with 2 state_dim_per_tensor" in problem("mamba", good, 2, short, 1)
    other = Shards((good.item_lens[0] * 2,) + good.item_lens[1:], good.dims, good.outer, good.groups)
    assert "region 0: items of 384 bytes" in problem("mamba", other, 2, one, 1)
    replicated_once = Shards(one.item_lens, one.dims[:3] + (5,), one.outer, one.groups)
    assert "region 3 is replicated on one side only" in problem("mamba", good, 2, replicated_once, 1)
    with pytest.raises(StateSliceError, match="prefill rank 0 of 4 does not serve decode rank 1 of 2"):
        pair_spans("mamba", shards(4), 4, 0, good, 2, 1)
    with pytest.raises(StateSliceError, match="neither divides the other"):
        pair_spans("mamba", good, 2, 0, good, 3, 0)


def _agreement(tp: int, kind: str = "mamba", **kw):
    sh = shards(tp)
    return local_agreement(page_size=1, kv_dtype="bfloat16", kv_item_lens=[16 * (4 // tp)], state_item_lens=[list(sh.item_lens)],
                           slot_bytes=1 << 20, auth=False, attn_tp_size=tp, kv_total_heads=4, state_types=[kind],
                           state_dims=[list(sh.dims)], state_outer_counts=[list(sh.outer)],
                           state_conv_groups=[[list(g) for g in sh.groups]], **kw)


def test_agreement_pairs_sliced_state_and_names_what_differs_with_both_values():
    p, d = _agreement(2), _agreement(1)
    assert differences(p, d, "prefill", "decode") == [] and differences(d, p, "decode", "prefill") == []
    assert pair_state_spans(p, 1, d, 0) == (pair_spans("mamba", shards(2), 2, 1, shards(1), 1, 0),)
    assert pair_state_spans(p, 1, _agreement(2), 1) == ()  # the same TP: whole items
    # types other than mamba are refused across TP on an MHA pool, naming the type and both TP sizes
    lines = differences(_agreement(2, "swa_ring"), _agreement(1, "swa_ring"), "prefill", "decode")
    assert any("state component 0 (swa_ring) cannot be sliced between prefill attention TP 2, decode 1" in x for x in lines), lines
    # hybrid MLA (replicated KV beside sharded state) is refused on both sides
    lines = differences(_agreement(2, hybrid_mla=True), _agreement(1), "prefill", "decode")
    assert any("hybrid-MLA" in x and "prefill attention TP 2, decode 1" in x for x in lines), lines
    lines = differences(_agreement(1), _agreement(2, hybrid_mla=True), "decode", "prefill")
    assert any("hybrid-MLA model (prefill" in x for x in lines), lines
    # CP/TP group sharing lays state over another TP than attention's
    lines = differences(_agreement(2, state_tp_size=4), _agreement(1), "prefill", "decode")
    assert any("lays state out over TP 4 but attention over TP 2" in x for x in lines), lines
    # the same attention TP: compared per slot as before, the per-tensor lists are not
    assert differences(_agreement(2), _agreement(2), "prefill", "decode") == []


# ------------------------------------------------------------------ SWA window pages sliced by KV heads
# SGLang's SWAKVPool window sub-pool on a TP rank: per region (K then V of each sliding-window layer), pages of
# PS token rows of the rank's heads of WHB bytes; the model's window is one tensor per region, each rank holds its
# heads of every row (contiguous blocks, or head rank // replicas)
PS, WHB, WREGIONS = 4, 6, 4
WINDOW_PAIRS = [(1, 2, 4), (2, 1, 4), (2, 4, 8), (4, 2, 8), (1, 4, 2), (4, 1, 2), (4, 2, 2), (2, 4, 2), (1, 4, 1)]


def window(total: int, layouts=("nhd", "nhd"), kv_head_bytes=(WHB,)) -> Window:
    return Window(total, PS, layouts, kv_head_bytes)


def window_shards(total: int, tp: int) -> Shards:
    n = heads_per_rank(total, tp)
    return Shards((PS * n * WHB,) * WREGIONS, (), (), ())


def window_rank_pages(model: list[torch.Tensor], total: int, tp: int, rank: int) -> list[torch.Tensor]:
    n = heads_per_rank(total, tp)
    first = rank * n if total >= tp else rank // (tp // total)
    return [m[:, :, first : first + n].reshape(SLOTS, -1).clone() for m in model]


@pytest.mark.parametrize("src_tp,dst_tp,total", WINDOW_PAIRS)
@pytest.mark.parametrize("path", ["staging", "one-sided"])
def test_each_decode_rank_gets_exactly_its_window_heads_once(src_tp, dst_tp, total, path):
    g = torch.Generator().manual_seed(11)
    model = [torch.randint(0, 255, (SLOTS, PS, total, WHB), dtype=torch.uint8, generator=g) for _ in range(WREGIONS)]
    src_ids, dst_ids = np.array([4, 1, 2]), np.array([2, 5, 3])
    src_sh, dst_sh = window_shards(total, src_tp), window_shards(total, dst_tp)
    for d in range(dst_tp):
        dst = [torch.full((SLOTS, n), 0xA5, dtype=torch.uint8) for n in dst_sh.item_lens]
        covered = np.zeros(heads_per_rank(total, dst_tp), dtype=int)
        for p in senders(src_tp, dst_tp, d):
            heads = pair_spans("swa", src_sh, src_tp, p, dst_sh, dst_tp, d, window(total))
            assert isinstance(heads, PairHeads)
            covered[heads.dst.lo : heads.dst.hi] += 1
            src = window_rank_pages(model, total, src_tp, p)
            if path == "staging":
                _through_staging(src, dst, src_ids, dst_ids, heads)
            else:
                _one_sided(src, dst, src_ids, dst_ids, heads, dst_sh.item_lens)
        assert covered.tolist() == [1] * covered.size, f"decode rank {d}: heads written {covered.tolist()} times"
        want = window_rank_pages(model, total, dst_tp, d)
        for r, (got, exp) in enumerate(zip(dst, want)):
            assert torch.equal(got[dst_ids], exp[src_ids]), f"decode rank {d} region {r}"
            others = [i for i in range(SLOTS) if i not in dst_ids]
            assert bool((got[others] == 0xA5).all()), f"decode rank {d} region {r}: another page changed"


def test_window_pairing_is_the_kv_heads_pairing():
    from sglang_p2p_backend.engine.copy.heads import pair_heads

    for src_tp, dst_tp, total in WINDOW_PAIRS:
        for d in range(dst_tp):
            for p in senders(src_tp, dst_tp, d):
                ours = pair_spans("swa", window_shards(total, src_tp), src_tp, p, window_shards(total, dst_tp),
                                  dst_tp, d, window(total))
                assert ours == pair_heads(total=total, page_size=PS, src_tp=src_tp, src_rank=p, dst_tp=dst_tp,
                                          dst_rank=d)
    assert pair_spans("swa", window_shards(4, 2), 2, 1, window_shards(4, 2), 2, 1, window(4)) is None  # whole pages


def test_what_cannot_be_sliced_by_heads_is_named():
    p, d = window_shards(4, 2), window_shards(4, 1)
    assert problem("swa", p, 2, d, 1, window(4)) is None
    assert "the KV head layout it is sliced by is unknown" in problem("swa", p, 2, d, 1, None)
    assert "the decode's window pages are 'hnd'" in problem("swa", p, 2, d, 1, window(4, ("nhd", "hnd")))
    assert "6 KV heads do not divide over attention TP 4" in problem("swa", window_shards(6, 4), 4, d, 1, window(6))
    fewer = Shards(d.item_lens[:3], (), (), ())
    assert "4 window regions on the prefill, 3 on the decode" in problem("swa", p, 2, fewer, 1, window(4))
    wider = Shards((d.item_lens[0] * 2,) + d.item_lens[1:], (), (), ())
    assert ("region 0: a head of one token is 6 bytes on the prefill (2 of 4 heads, pages of 48 bytes) and 12 on the "
            "decode (4 heads, pages of 192 bytes)") in problem("swa", p, 2, wider, 1, window(4))
    ragged = Shards((d.item_lens[0] + 1,) + d.item_lens[1:], (), (), ())
    assert "region 0: pages of 48 (prefill, 2 heads) and 97 (decode, 4 heads) bytes" in problem("swa", p, 2, ragged, 1, window(4))
    assert "a window head of 6 bytes is no KV head ([12] bytes)" in problem("swa", p, 2, d, 1, window(4, kv_head_bytes=(12,)))
    with pytest.raises(StateSliceError, match="prefill rank 0 of 4 does not serve decode rank 1 of 2"):
        pair_spans("swa", window_shards(4, 4), 4, 0, p, 2, 1, window(4))


def _swa_agreement(tp: int, total: int = 4, layout: str = "nhd", kinds=("swa",), swa_head: int = WHB,
                   knows_total: bool = True, **kw):
    n = heads_per_rank(total, tp)
    lens = {"swa": [PS * n * swa_head] * WREGIONS, "block_scale_swa": [PS * n] * 2}
    return local_agreement(page_size=PS, kv_dtype="bfloat16", kv_item_lens=[PS * n * WHB] * 2,
                           state_item_lens=[lens[k] for k in kinds], slot_bytes=1 << 20, auth=False, attn_tp_size=tp,
                           kv_total_heads=total if knows_total else 0, swa_kv_cache_layout=layout, state_types=list(kinds), **kw)


def test_agreement_pairs_the_window_by_kv_heads_and_names_what_differs_with_both_values():
    p, d = _swa_agreement(2), _swa_agreement(1, knows_total=False)  # a decode may not know the model's head count
    assert differences(p, d, "prefill", "decode") == [] and differences(d, p, "decode", "prefill") == []
    ours = pair_state_spans(p, 1, d, 0)
    assert len(ours) == 1 and isinstance(ours[0], PairHeads)
    assert (ours[0].src.lo, ours[0].src.hi, ours[0].dst.lo, ours[0].dst.hi) == (0, 2, 2, 4)
    assert pair_state_spans(p, 1, _swa_agreement(2), 1) == ()  # the same TP: whole pages
    # a window whose head is not a KV head (another head count in the window layers): refused on both sides
    for mine, theirs, me, them in ((p, _swa_agreement(1, swa_head=2 * WHB), "prefill", "decode"),
                                   (_swa_agreement(1, swa_head=2 * WHB), p, "decode", "prefill")):
        lines = differences(mine, theirs, me, them)
        assert any("state component 0 (swa) cannot be sliced between" in x and "region 0: a head of one token is 6 "
                   "bytes on the prefill" in x and "12 on the decode" in x for x in lines), lines
    # head-major window pages are not cut by heads (the layout label differs too: both named)
    lines = differences(_swa_agreement(2, layout="hnd"), _swa_agreement(1, layout="hnd"), "prefill", "decode")
    assert any("the prefill's window pages are 'hnd'" in x for x in lines), lines
    # the window's MXFP8 scales stay refused across TP, with the reason
    kinds = ("swa", "block_scale_swa")
    lines = differences(_swa_agreement(2, kinds=kinds), _swa_agreement(1, kinds=kinds), "prefill", "decode")
    assert not any("component 0" in x for x in lines), lines
    assert any("state component 1 (block_scale_swa) cannot be sliced between prefill attention TP 2, decode 1: the "
               "SWA window's MXFP8 scales are not sliced by KV heads" in x for x in lines), lines
