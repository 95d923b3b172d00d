"""The fused Triton gather/scatter against torch's index_select, byte for byte, on one GPU."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from sglang_p2p_backend.engine.copy.gather_cuda import FusedGather  # noqa: E402

LAYOUTS = {"mla": (61, 576 * 2), "mha": (64, 8 * 128 * 2)}  # regions, bytes per token and region


def _pool(regions: int, pages: int, item: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, 256, (pages, item), generator=g, device="cuda", dtype=torch.uint8) for _ in range(regions)]


@pytest.mark.parametrize("max_programs", [None, 16], ids=["grid", "persistent"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gather_then_scatter_matches_index_select(layout, page_size, max_programs):
    regions, token_bytes = LAYOUTS[layout]
    item = page_size * token_bytes
    pages = 1024 // page_size
    src = _pool(regions, pages, item, 1)
    dst = _pool(regions, pages, item, 2)
    before = [d.clone() for d in dst]
    rng = np.random.default_rng(page_size)
    n = pages // 2 + 1
    src_ids, dst_ids = rng.permutation(pages)[:n], rng.permutation(pages)[:n]
    staging = torch.full((n * item * regions,), 0xAB, dtype=torch.uint8, device="cuda")

    assert FusedGather([src], max_programs=max_programs).copy(0, src_ids, staging, scatter=False) == staging.numel()
    ref = torch.cat([s.index_select(0, torch.from_numpy(src_ids).cuda()).flatten() for s in src])
    assert torch.equal(staging, ref)

    FusedGather([dst], max_programs=max_programs).copy(0, dst_ids, staging, scatter=True)
    for s, d, b in zip(src, dst, before):
        b[torch.from_numpy(dst_ids).cuda()] = s[torch.from_numpy(src_ids).cuda()]
        assert torch.equal(d, b)  # written pages hold the source, the others are untouched


def test_chunk_of_several_groups_and_region_slices_in_plan_layout():
    """Segments in order; inside one, region by region; inside a region, the pages in order (plan.py)."""
    kv = _pool(4, 32, 16 * 1152, 3)
    state = [torch.randint(0, 256, (8, n), device="cuda", dtype=torch.uint8) for n in (4096, 40)]
    fused = FusedGather([kv, state])
    ids = [np.array([5, 1, 30, 2, 9]), np.array([7, 0])]
    seg = SimpleNamespace
    chunk = SimpleNamespace(segments=(
        seg(group=0, region_lo=1, region_hi=3, lo=1, hi=4),
        seg(group=1, region_lo=0, region_hi=2, lo=0, hi=2),
    ))
    staging = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    nbytes = fused.gather_chunk(chunk, ids, staging[4:])  # 4-byte aligned staging: smaller words
    parts = [kv[r][torch.tensor([1, 30, 2], device="cuda")].flatten() for r in (1, 2)]
    parts += [state[r][torch.tensor([7, 0], device="cuda")].flatten() for r in (0, 1)]
    ref = torch.cat(parts)
    assert nbytes == ref.numel() and torch.equal(staging[4 : 4 + nbytes], ref)

    kv2 = [torch.zeros_like(x) for x in kv]
    state2 = [torch.zeros_like(x) for x in state]
    assert FusedGather([kv2, state2]).scatter_chunk(chunk, ids, staging[4:]) == nbytes
    for r in (1, 2):
        assert torch.equal(kv2[r][torch.tensor([1, 30, 2], device="cuda")], kv[r][torch.tensor([1, 30, 2], device="cuda")])
    assert int(kv2[0].sum()) == 0 and int(kv2[3].sum()) == 0
    assert torch.equal(state2[1][[7, 0]], state[1][[7, 0]])


def test_out_of_range_ids_are_refused_before_any_copy():
    fused = FusedGather([_pool(2, 8, 1152, 4)])
    staging = torch.empty(1 << 16, dtype=torch.uint8, device="cuda")
    with pytest.raises(IndexError):
        fused.copy(0, np.array([0, 8]), staging, scatter=True)
    with pytest.raises(IndexError):
        fused.copy(0, np.array([0]), staging, scatter=False, region_lo=1, region_hi=3)


def test_a_variant_once_compiled_is_launched_directly_and_moves_the_same_bytes():
    """After the warmup (and after the JIT's first launch of any other variant) the kernel is called compiled
    (`FusedGather._launch_direct`). A variant is the constants, the word type and each pointer's 16-byte
    alignment: a staging slot 8 or 4 bytes off a 16-byte boundary is its own variant (4: 4-byte words). Every
    gather matches index_select and every scatter puts the pages back where they belong."""
    regions, token_bytes = LAYOUTS["mla"]
    item = 16 * token_bytes
    src, dst = _pool(regions, 64, item, 5), _pool(regions, 64, item, 6)
    gather, scatter = FusedGather([src]), FusedGather([dst])
    launched: list[bool] = []
    for f in (gather, scatter):
        direct = f._launch_direct  # noqa: SLF001
        f._launch_direct = lambda *a, _d=direct: (launched.append(True), _d(*a))  # noqa: SLF001
    rng = np.random.default_rng(9)
    n = 11
    nbytes = n * item * regions
    big = torch.empty(nbytes + 64, dtype=torch.uint8, device="cuda")
    offsets = [0, 8, 16, 4, 0, 8, 4]
    for k, off in enumerate(offsets):
        src_ids, dst_ids = rng.permutation(64)[:n], rng.permutation(64)[:n]
        staging = big[off:off + nbytes]
        staging.fill_(0xCD)
        before = len(launched)
        gather.copy(0, src_ids, staging, scatter=False)
        ref = torch.cat([s.index_select(0, torch.from_numpy(src_ids).cuda()).flatten() for s in src])
        assert torch.equal(staging, ref), (k, off)
        want = [d.clone() for d in dst]
        scatter.copy(0, dst_ids, staging, scatter=True)
        for s, d, w in zip(src, dst, want):
            w[torch.from_numpy(dst_ids).cuda()] = s[torch.from_numpy(src_ids).cuda()]
            assert torch.equal(d, w), (k, off)
        # 16-byte aligned slots: the warmup's variant; 8 and 4 off: the JIT on their first use, direct after it
        first_of_its_kind = off in (8, 4) and off not in offsets[:k]
        assert len(launched) - before == (0 if first_of_its_kind else 2), (k, off)
    # every kept variant goes straight to its launcher (triton_launch.DirectLaunch)
    kept = [k for f in (gather, scatter) for k in f._compiled.values()]  # noqa: SLF001
    assert kept and all(k.direct for k in kept)


def test_a_scatter_readied_on_its_stream_and_launched_after_its_bytes_land_writes_them_exactly():
    """The receiver's split (`FusedGather.prepare_chunk`): the ids go to the device on the scatter's stream while
    the staging is still being filled on another stream (the receive); the launch comes after that stream's
    event. The pages get the staging's final bytes; a readied scatter never launched writes nothing."""
    regions, token_bytes = LAYOUTS["mha"]
    item = token_bytes
    src, dst = _pool(regions, 256, item, 7), _pool(regions, 256, item, 8)
    fused = FusedGather([dst])
    rng = np.random.default_rng(11)
    n = 100
    src_ids, dst_ids, unused_ids = rng.permutation(256)[:n], rng.permutation(256)[:n], rng.permutation(256)[:n]
    chunk = SimpleNamespace(segments=(SimpleNamespace(group=0, region_lo=0, region_hi=regions, lo=0, hi=n),))
    staging = torch.full((n * item * regions,), 0xEE, dtype=torch.uint8, device="cuda")
    want = [d.clone() for d in dst]
    receive, side = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(receive):
        torch.cuda._sleep(20_000_000)  # the bytes take a while to land (~10 ms)
        landed_bytes = torch.cat([s.index_select(0, torch.from_numpy(src_ids).cuda()).flatten() for s in src])
        staging.copy_(landed_bytes)
        landed = torch.cuda.Event()
        landed.record()
    with torch.cuda.stream(side):
        run = fused.prepare_chunk(chunk, [dst_ids], staging, scatter=True)
        never = fused.prepare_chunk(chunk, [unused_ids], staging, scatter=True)  # its room given up: not launched
    landed.synchronize()  # the receiver's host wait for the receive
    with torch.cuda.stream(side):
        assert run() == staging.numel()
    side.synchronize()
    del never
    for s, d, w in zip(src, dst, want):
        w[torch.from_numpy(dst_ids).cuda()] = s[torch.from_numpy(src_ids).cuda()]
        assert torch.equal(d, w)


def test_chunks_gathered_from_slices_of_ids_uploaded_once_match_their_own_uploads():
    """A sender uploads a room's ids once (PageCopier.device_ids) and every chunk's gather slices them: the bytes
    are those of each chunk uploading its own ids, on the stream the gathers run on."""
    from sglang_p2p_backend.engine.copy.copier import PageCopier
    from sglang_p2p_backend.engine.copy.plan import plan_chunks

    kv = _pool(8, 256, 4096, 4)
    copier = PageCopier([kv])
    ids = [np.random.default_rng(5).permutation(256)[:200].astype(np.int32)]
    chunks = plan_chunks(copier.item_lens, [200], 8 * 4096 * 48)  # 48 pages a chunk: 5 chunks
    assert len(chunks) == 5
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dev_ids = copier.device_ids(ids)
        for chunk in chunks:
            own = torch.zeros(chunk.nbytes, dtype=torch.uint8, device="cuda")
            sliced = torch.zeros_like(own)
            copier.gather(chunk, ids, own)
            copier.gather(chunk, ids, sliced, dev_ids)
            side.synchronize()
            assert torch.equal(own, sliced) and bool(own.any())


def test_chunks_scattered_from_slices_of_a_rooms_one_upload_write_their_pages_exactly():
    """The decode scatters each chunk of a room from a slice of the room's published ids uploaded once on the
    scatter's stream (RoomIds): the pages written are those of each chunk uploading its own ids, the room's list
    goes up once and leaves the cache with its last run; a list naming a page outside the pools is not uploaded."""
    from sglang_p2p_backend.engine.copy.copier import PageCopier
    from sglang_p2p_backend.engine.copy.plan import Chunk, plan_chunks
    from sglang_p2p_backend.engine.copy.room_ids import RoomIds

    torch.manual_seed(3)
    own_pool, sliced_pool = _pool(8, 256, 4096, 4), _pool(8, 256, 4096, 4)  # the same seed: the same bytes
    copier, sliced_copier = PageCopier([own_pool]), PageCopier([sliced_pool])
    room = np.random.default_rng(7).permutation(256)[:200].astype(np.int32)
    chunks = plan_chunks(copier.item_lens, [200], 8 * 4096 * 48)  # 48 pages a chunk: 5 runs of the room's list
    room_ids = RoomIds(sliced_copier)
    side = torch.cuda.Stream()
    start = 0
    with torch.cuda.stream(side):
        for chunk in chunks:
            n = chunk.segments[0].hi - chunk.segments[0].lo
            run = room[start : start + n]
            staging = torch.randint(0, 256, (chunk.nbytes,), dtype=torch.uint8, device="cuda")
            # the decode's view of the chunk: its ids are the header's, from 0 (checks.chunk_layout)
            local = Chunk(tuple(dataclasses.replace(s, lo=0, hi=n) for s in chunk.segments), chunk.nbytes)
            copier.prepare_scatter(local, [run], staging)()
            dev = room_ids.run(room, start, n, side)
            assert dev is not None and dev.is_cuda and dev.numel() == n
            sliced_copier.prepare_scatter(local, [run], staging, [dev])()
            start += n
    side.synchronize()
    assert start == room.size and room_ids.uploads == 1 and len(room_ids) == 0
    for a, b in zip(own_pool, sliced_pool):
        assert torch.equal(a, b)
    bad = room.copy()
    bad[3] = 256  # one past the pool
    with torch.cuda.stream(side):
        assert room_ids.run(bad, 0, 10, side) is None
    assert room_ids.uploads == 1
