"""Head ranges for different attention TP (engine/copy/heads.py), their planning, packing and one-sided writes.

Pools are built as SGLang's MHA pool per TP rank (token rows of the rank's heads); the model's global KV is
one tensor, each rank holds its heads of it. Every pairing of SGLang's rank mapping must give each decode
rank exactly its heads, each written once, and touch nothing else.
"""

import numpy as np
import pytest
import torch

from sglang_p2p_backend.engine.wire.agreement import differences, local_agreement
from sglang_p2p_backend.engine.wire.checks import chunk_layout
from sglang_p2p_backend.engine.copy.copier import copy_chunk
from sglang_p2p_backend.engine.copy.heads import HeadsError, heads_per_rank, pair_heads
from sglang_p2p_backend.engine.wire.messages import ChunkHeader, ChunkSegment
from sglang_p2p_backend.engine.copy.plan import copy_descriptors, plan_chunks

HB = 4  # bytes of one head of one token
PAGES = 12


def rank_heads(total: int, tp: int, rank: int) -> list[int]:
    """The global heads a TP rank holds (SGLang: contiguous blocks, or head rank // replicas)."""
    n = heads_per_rank(total, tp)
    first = rank * n if total >= tp else rank // (tp // total)
    return list(range(first, first + n))


def senders(src_tp: int, dst_tp: int, d: int) -> list[int]:
    """Prefill ranks Common maps decode rank d to."""
    if dst_tp >= src_tp:
        return [d // (dst_tp // src_tp)]
    r = src_tp // dst_tp
    return list(range(d * r, (d + 1) * r))


PAIRS = [(1, 2, 4), (2, 1, 4), (2, 4, 8), (4, 2, 8), (1, 4, 4), (4, 1, 2), (4, 2, 2), (4, 2, 1), (2, 4, 2), (1, 4, 2), (4, 8, 2)]


@pytest.mark.parametrize("src_tp,dst_tp,total", PAIRS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_every_decode_head_is_written_once_from_its_owner(src_tp, dst_tp, total, page_size):
    for d in range(dst_tp):
        want = rank_heads(total, dst_tp, d)
        written = []
        for p in senders(src_tp, dst_tp, d):
            ph = pair_heads(total=total, page_size=page_size, src_tp=src_tp, src_rank=p, dst_tp=dst_tp, dst_rank=d)
            assert ph.src.count == ph.dst.count
            src_global = rank_heads(total, src_tp, p)[ph.src.lo : ph.src.hi]
            dst_global = want[ph.dst.lo : ph.dst.hi]
            assert src_global == dst_global, (p, d, ph)
            written += dst_global
        assert sorted(written) == want, (d, written)  # every head once: replicas send nothing


def test_unpaired_ranks_and_bad_head_counts_are_refused():
    with pytest.raises(HeadsError):
        pair_heads(total=4, page_size=1, src_tp=2, src_rank=1, dst_tp=4, dst_rank=0)
    with pytest.raises(HeadsError, match="neither divides"):
        pair_heads(total=12, page_size=1, src_tp=2, src_rank=0, dst_tp=3, dst_rank=0)
    with pytest.raises(HeadsError, match="do not divide"):
        pair_heads(total=6, page_size=1, src_tp=1, src_rank=0, dst_tp=4, dst_rank=0)
    assert pair_heads(total=4, page_size=1, src_tp=2, src_rank=0, dst_tp=2, dst_rank=0) is None


def pools(total: int, tp: int, rank: int, page_size: int, regions: int, global_kv: list) -> list[torch.Tensor]:
    heads = rank_heads(total, tp, rank)
    return [g[:, :, heads, :].reshape(PAGES, -1).clone() for g in global_kv[:regions]]


@pytest.mark.parametrize("src_tp,dst_tp,total", [(1, 2, 4), (4, 2, 8), (4, 1, 2), (1, 4, 2)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_staging_and_one_sided_paths_land_exactly_the_heads(src_tp, dst_tp, total, page_size):
    regions = 4
    g = torch.Generator().manual_seed(src_tp * 100 + dst_tp * 10 + total)
    global_kv = [torch.randint(0, 256, (PAGES, page_size, total, HB), dtype=torch.uint8, generator=g) for _ in range(regions)]
    src_ids, dst_ids = np.array([3, 4, 5, 9, 1, 2]), np.array([2, 7, 8, 9, 10, 0])
    for d in range(dst_tp):
        want = pools(total, dst_tp, d, page_size, regions, global_kv)
        staged = [torch.full_like(t, 0xA5) for t in want]
        direct = [torch.full_like(t, 0xA5) for t in want]
        for p in senders(src_tp, dst_tp, d):
            src = pools(total, src_tp, p, page_size, regions, global_kv)
            ph = pair_heads(total=total, page_size=page_size, src_tp=src_tp, src_rank=p, dst_tp=dst_tp, dst_rank=d)
            if not ph.src.count:
                continue
            src_lens, dst_lens = [[int(t.shape[1]) for t in src]], [[int(t.shape[1]) for t in want]]
            budget = 3 * sum(ph.src.item_len(x) for x in src_lens[0])  # three pages of heads a chunk
            for c in plan_chunks(src_lens, [len(src_ids)], budget, [ph.src]):
                buf = torch.zeros(budget, dtype=torch.uint8)
                copy_chunk(c, [src], [src_ids], buf, scatter=False)
                seg = c.segments[0]
                ids = dst_ids[seg.lo : seg.hi].astype(np.int32)
                header = ChunkHeader("127.0.0.1:1", 0, 1, p, 0, c.nbytes,
                                     [ChunkSegment(0, seg.region_lo, seg.region_hi, ids.tobytes(), ph.dst.lo, ph.dst.hi)])
                verdict = chunk_layout(header, dst_lens, budget, kv_heads=ph.dst)
                assert verdict.problem is None, verdict.problem
                copy_chunk(verdict.chunk, [staged], verdict.ids, buf, scatter=True)
            s, t, n = copy_descriptors([x.data_ptr() for x in src], [x.data_ptr() for x in direct], src_lens[0],
                                       src_ids, dst_ids, ph, dst_lens[0])
            assert len(s) == regions * len(src_ids) * page_size  # one write per token row, never per head
            for a, b, k in zip(s, t, n):
                torch.from_numpy(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * int(k)).from_address(int(b))))[:] = \
                    torch.from_numpy(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * int(k)).from_address(int(a))))
        untouched = np.setdiff1d(np.arange(PAGES), dst_ids)
        for r in range(regions):
            for got in (staged, direct):
                assert torch.equal(got[r][dst_ids], want[r][src_ids]), (d, r)  # page src_ids[i] lands at dst_ids[i]
                assert bool((got[r][untouched] == 0xA5).all())


def test_decode_refuses_heads_it_does_not_take_from_that_prefill():
    ph = pair_heads(total=4, page_size=2, src_tp=1, src_rank=0, dst_tp=2, dst_rank=1)
    lens = [[2 * 2 * HB] * 2]
    ids = np.array([1, 2], dtype=np.int32).tobytes()
    wrong = ChunkHeader("127.0.0.1:1", 0, 1, 0, 0, 2 * 2 * 2 * HB, [ChunkSegment(0, 0, 2, ids, 1, 2)])
    assert "takes heads 0..2" in chunk_layout(wrong, lens, 1 << 20, kv_heads=ph.dst).problem
    whole = ChunkHeader("127.0.0.1:1", 0, 1, 0, 0, 2 * 2 * 2 * 2 * HB, [ChunkSegment(0, 0, 2, ids)])
    assert chunk_layout(whole, lens, 1 << 20, kv_heads=ph.dst).problem is not None
    replica = pair_heads(total=2, page_size=2, src_tp=4, src_rank=1, dst_tp=2, dst_rank=0)
    assert replica.src.count == 0
    ok = ChunkHeader("127.0.0.1:1", 0, 1, 0, 0, 2 * 2 * 2 * HB, [ChunkSegment(0, 0, 2, ids, 0, 2)])
    assert "replica" in chunk_layout(ok, lens, 1 << 20, kv_heads=replica.dst).problem


def agreement(tp: int, heads: int, total: int = 0, page_size: int = 16, state=()):
    return local_agreement(page_size=page_size, kv_dtype="bfloat16", kv_item_lens=[page_size * heads * 256] * 8,
                           state_item_lens=list(state), slot_bytes=1 << 20, auth=False, attn_tp_size=tp,
                           kv_total_heads=total)


def test_agreement_compares_per_head_bytes_and_names_both_layouts():
    assert differences(agreement(2, 4, total=8), agreement(4, 2), "prefill", "decode") == []
    assert differences(agreement(4, 2), agreement(2, 4, total=8), "decode", "prefill") == []
    wrong = differences(agreement(2, 4, total=8), agreement(4, 4), "prefill", "decode")
    assert len(wrong) == 1 and "prefill attention TP 2" in wrong[0] and "decode attention TP 4" in wrong[0], wrong
    odd = differences(agreement(2, 3, total=6), agreement(4, 1), "prefill", "decode")
    assert "do not divide" in odd[0]
    state = differences(agreement(2, 4, total=8, state=[[64]]), agreement(4, 2, state=[[64]]), "prefill", "decode")
    assert "state components" in state[0]
    # equal TP: pages compared whole, as before
    assert differences(agreement(2, 4, total=8), agreement(2, 2), "prefill", "decode")
