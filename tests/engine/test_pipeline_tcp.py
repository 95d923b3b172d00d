"""The two-sided data path over the CPU tcp transport: a PairSender and a PairReceiver in one process, the
control channel replaced by a direct hand-off in order (what the ordered ZMQ socket guarantees)."""

import threading

import numpy as np
import pytest
import torch

from sglang_p2p_backend.engine.copy.copier import PageCopier
from sglang_p2p_backend.engine.pair.pipeline import PairReceiver, PairSender
from sglang_p2p_backend.engine.pair.staging import StagingPool
from sglang_p2p_backend.engine.transport.base import TransportError
from sglang_p2p_backend.engine.transport.tcp import TcpTransport

from support.cpu_pools import pools, rand


class Pair:
    def __init__(self, slot_bytes=1024, slots=2, io_timeout=5.0):
        self.src_t, src_views = pools(fill=rand)
        self.dst_t, dst_views = pools()
        self.transport = TcpTransport(io_timeout=io_timeout)
        self.landed = []
        self.done = threading.Event()
        self.wanted = set()
        self.receiver = PairReceiver(
            transport=self.transport, staging=StagingPool(self.transport.alloc_staging, slot_bytes, slots),
            copier=PageCopier([dst_views]), peer_session="prefill:1", wanted=lambda room: room in self.wanted,
            on_chunk=lambda room, rank, err: self.landed.append((room, err)),
            connect_timeout=5, io_timeout=io_timeout)
        self.sender = PairSender(
            transport=self.transport, staging=StagingPool(self.transport.alloc_staging, slot_bytes, slots),
            copier=PageCopier([src_views]), local_session="prefill:1", control=self.receiver.submit,
            connect_timeout=5, io_timeout=io_timeout)

    def close(self):
        self.sender.close()
        self.receiver.close()
        self.transport.close()

    def drain(self):
        ev = threading.Event()
        self.receiver.submit(ev.set)
        assert ev.wait(10)


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_scattered_pages_land_exactly_and_nothing_else_changes(pair):
    rng = np.random.default_rng(0)
    src = rng.permutation(64)[:20].astype(np.int32)
    dst = rng.permutation(64)[:20].astype(np.int32)
    pair.wanted.add(5)
    sent = pair.sender.send(5, 0, [src], [dst])
    pair.drain()
    assert sent == 20 * 6 * 48
    # a page is 6 x 48 = 288 B, so a 1024 B slot carries 3 pages: 20 pages in 7 chunks
    assert [err for _, err in pair.landed] == [None] * 7
    untouched = sorted(set(range(64)) - set(dst.tolist()))
    for s_t, d_t in zip(pair.src_t, pair.dst_t):
        assert torch.equal(d_t[torch.from_numpy(dst.astype(np.int64))], s_t[torch.from_numpy(src.astype(np.int64))])
        assert bool((d_t[untouched] == 0xA5).all())


def test_unwanted_room_is_received_but_discarded_and_the_channel_stays_in_step(pair):
    src = np.arange(1, 11, dtype=np.int32)
    pair.sender.send(6, 0, [src], [src])  # room 6 not wanted (aborted): bytes drained, not scattered
    pair.wanted.add(7)
    pair.sender.send(7, 0, [src], [src + 20])
    pair.drain()
    assert all(bool((t[1:11] == 0xA5).all()) for t in pair.dst_t)
    assert all(torch.equal(d[21:31], s[1:11]) for s, d in zip(pair.src_t, pair.dst_t))


def test_mismatched_destination_count_is_refused_before_anything_moves(pair):
    with pytest.raises(TransportError, match="3 source ids but the decode published 2"):
        pair.sender.send(8, 0, [np.array([1, 2, 3], np.int32)], [np.array([1, 2], np.int32)])
    assert pair.sender.comm is None


def test_dead_receiver_surfaces_as_transport_error_and_a_new_channel_follows():
    p = Pair(io_timeout=2.0)
    try:
        p.wanted.add(9)
        ids = np.arange(1, 33, dtype=np.int32)
        p.sender.send(9, 0, [ids], [ids])
        p.drain()
        p.receiver.comm.abort()  # the decode side's channel dies
        with pytest.raises(TransportError):
            for _ in range(50):  # the kernel buffers a little before the reset shows
                p.sender.send(9, 0, [ids], [ids])
        assert p.sender.comm is None
        gen = p.sender.generation
        p.sender.send(10, 0, [ids[:4]], [ids[:4]])  # a fresh channel, generation + 1
        p.drain()
        assert p.sender.generation == gen + 1 and p.landed[-1] == (10, None)
    finally:
        p.close()


def test_staging_pool_back_pressure_times_out_with_the_knob_named():
    pool = StagingPool(lambda n: torch.empty(n, dtype=torch.uint8), 16, 1)
    buf = pool.acquire(1)
    with pytest.raises(TransportError, match="SGLANG_P2P_STAGING_MB"):
        pool.acquire(0.2)
    threading.Timer(0.1, pool.release, args=(buf,)).start()
    assert pool.acquire(2) is buf


def test_a_bad_source_id_fails_its_room_before_any_header_and_the_channel_stays(pair):
    src = np.arange(1, 11, dtype=np.int32)
    pair.wanted.update({8, 9})
    pair.sender.send(8, 0, [src], [src])
    generation = pair.sender.generation
    with pytest.raises(TransportError, match=r"room 9: group 0 page id out of range \[0, 64\): min 1, max 64"):
        pair.sender.send(9, 0, [np.append(src, 64).astype(np.int32)], [np.arange(30, 41, dtype=np.int32)])
    pair.drain()
    assert [room for room, _ in pair.landed] == [8] * len(pair.landed)  # nothing of room 9 announced
    assert pair.sender.comm is not None and pair.sender.generation == generation
    pair.sender.send(9, 0, [src], [src + 40])  # the same channel carries the next request
    pair.drain()
    assert all(torch.equal(d[41:51], s[1:11]) for s, d in zip(pair.src_t, pair.dst_t))


def test_each_chunk_header_goes_out_before_its_gather():
    """The decode posts a chunk's receive while the prefill gathers it: the header is handed to the control
    channel first."""
    steps = []

    class Recording(PageCopier):
        def gather(self, chunk, ids, staging, dev_ids=None):
            steps.append("gather")
            super().gather(chunk, ids, staging, dev_ids)

    p = Pair()
    try:
        p.sender.copier = Recording(p.sender.copier.views)
        control = p.sender.control
        p.sender.control = lambda msg: (steps.append(type(msg).__name__), control(msg))
        p.wanted.add(3)
        src = np.arange(0, 7, dtype=np.int32)
        p.sender.send(3, 0, [src], [src])  # 7 pages of 288 B in 1024 B slots: 3 chunks
        p.drain()
        assert [s for s in steps if s != "CommInit"] == ["ChunkHeader", "gather"] * 3
        assert [err for _, err in p.landed] == [None] * 3
    finally:
        p.close()


def test_a_ramped_transfer_lands_exactly_in_growing_chunks(pair):
    """SGLANG_P2P_FIRST_CHUNK_MB: a transfer over one slot starts with a short chunk and doubles up to a slot;
    the decode checks and lands each as it does whole slots."""
    sizes = []
    control = pair.sender.control
    pair.sender.control = lambda msg: (sizes.append(getattr(msg, "nbytes", None)), control(msg))
    pair.sender.first_chunk = 288  # one 288 B page, then 576, then 1024 B slots (3 pages)
    rng = np.random.default_rng(1)
    src = rng.permutation(64)[:20].astype(np.int32)
    dst = rng.permutation(64)[:20].astype(np.int32)
    pair.wanted.add(4)
    assert pair.sender.send(4, 0, [src], [dst]) == 20 * 288
    pair.drain()
    assert [n for n in sizes if n is not None] == [288, 576, 864, 864, 864, 864, 864, 576]
    assert [err for _, err in pair.landed] == [None] * 8
    for s_t, d_t in zip(pair.src_t, pair.dst_t):
        assert torch.equal(d_t[torch.from_numpy(dst.astype(np.int64))], s_t[torch.from_numpy(src.astype(np.int64))])
