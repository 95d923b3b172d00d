"""The overlapped two-sided path (SGLANG_P2P_OVERLAP, on by default) on CPU: a sender gathering chunk i+1 into a
second staging slot while chunk i moves, a receiver posting chunk i+1's receive before landing chunk i.

NCCL channels have a side stream for this; here the tcp channel is wrapped so that receives complete later, on a
thread of their own in posting order (what a CUDA stream does), and says it has a side stream. CUDA's stream
calls are replaced by no-ops: what is tested is the order of receives, scatters, slots and reports, which is
the pipeline's own logic. The byte-exact GPU run is tests/gpu/test_engine_pipeline_nccl.py."""

import queue
import threading
import time
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from sglang_p2p_backend.engine.copy.copier import PageCopier
from sglang_p2p_backend.engine.pair import pipeline
from sglang_p2p_backend.engine.pair.pipeline import PairReceiver, PairSender
from sglang_p2p_backend.engine.pair.staging import StagingPool
from sglang_p2p_backend.engine.transport.base import Completion, PairComm, TransportError
from sglang_p2p_backend.engine.transport.tcp import TcpTransport

from support.cpu_pools import pools, rand


class _SideStream:
    """What the sender asks of a side stream, on CPU."""

    def __init__(self, log: list):
        self.log = log

    def wait_event(self, event) -> None:
        self.log.append(("side waits for a send", event))


class _Later(Completion):
    """A receive done by the comm's worker thread."""

    def __init__(self):
        self.finished = threading.Event()
        self.error = None
        self.event = None

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: float) -> None:
        if not self.finished.wait(timeout):
            raise TransportError(f"receive not done after {timeout}s")
        if self.error is not None:
            raise TransportError(str(self.error))


class LaterComm(PairComm):
    """A tcp channel whose receives run later, one after another on a worker thread (a CUDA stream's order)."""

    def __init__(self, inner: PairComm, log: list):
        self.inner, self.log = inner, log
        self.device = inner.device
        self.side_stream = _SideStream(log)
        self._work: "queue.SimpleQueue" = queue.SimpleQueue()
        self.hold = threading.Event()  # tests clear it to keep receives from finishing
        self.hold.set()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            buf, c = self._work.get()
            self.hold.wait()
            try:
                self.inner.recv(buf)
            except TransportError as e:
                c.error = e
            self.log.append(("received", buf.numel()))
            c.finished.set()

    fail_send_at = None  # tests: the send with this index raises, as a send on an aborted channel does

    def send(self, buf: torch.Tensor) -> Completion:
        self.sends = getattr(self, "sends", 0) + 1
        if self.fail_send_at is not None and self.sends > self.fail_send_at:
            raise TransportError("send failed (test)")
        c = self.inner.send(buf)
        c.event = ("sent", buf.data_ptr())
        self.log.append(("sent from slot", buf.data_ptr()))
        return c

    expect_s = None  # tests: each receive says it should end this far ahead (a transport's pace)
    fail_recv_at = None  # tests: the receive post with this index raises, as a post on a broken channel does

    def recv(self, buf: torch.Tensor) -> Completion:
        self.recvs = getattr(self, "recvs", 0) + 1
        if self.fail_recv_at is not None and self.recvs > self.fail_recv_at:
            raise TransportError("receive post failed (test)")
        c = _Later()
        if self.expect_s is not None:
            c.expected_end = time.monotonic() + self.expect_s
        self.log.append(("posted", buf.numel()))
        self._work.put((buf, c))
        return c

    def abort(self) -> None:
        self.inner.abort()


class LaterTransport(TcpTransport):
    def __init__(self, log: list, **kw):
        super().__init__(**kw)
        self.log = log
        self.comms: list = []

    def connect(self, unique_id: bytes, rank: int, timeout: float) -> PairComm:
        comm = LaterComm(super().connect(unique_id, rank, timeout), self.log)
        self.comms.append(comm)
        return comm


class LoggingCopier(PageCopier):
    def __init__(self, views, log: list):
        super().__init__(views)
        self.log = log

    def prepare_scatter(self, chunk, ids, staging, dev_ids=None):
        """Logs when a scatter is readied ("prepared") and when it runs ("scatter")."""
        self.log.append(("prepared", staging.data_ptr()))
        run = super().prepare_scatter(chunk, ids, staging, dev_ids)

        def logged():
            self.log.append(("scatter", staging.data_ptr()))
            return run()

        return logged


@pytest.fixture
def cpu_streams(monkeypatch):
    """CUDA's stream context and stream wait as no-ops (the CPU channel's work is done when its calls return)."""
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(pipeline, "_queued_end", lambda stream: lambda: True)
    monkeypatch.setattr(pipeline, "_settled", lambda comm, timeout: True)


class OverlapPair:
    def __init__(self, slot_bytes=1024, slots=3, overlap=True, receiver_pool=None):
        self.log: list = []
        self.src_t, self.src_views = pools(fill=rand)
        self.dst_t, dst_views = pools()
        self.transport = LaterTransport(self.log, io_timeout=5.0)
        self.landed: list = []
        self.wanted = {5}
        self.recv_pool = receiver_pool or StagingPool(self.transport.alloc_staging, slot_bytes, slots)
        self.send_pool = StagingPool(self.transport.alloc_staging, slot_bytes, slots)
        self.receiver = PairReceiver(
            transport=self.transport, staging=self.recv_pool, copier=LoggingCopier([dst_views], self.log),
            peer_session="prefill:1", wanted=lambda room: room in self.wanted,
            on_chunk=lambda room, rank, err: self.landed.append((room, err)),
            connect_timeout=5, io_timeout=5.0, overlap=overlap)
        self.sender = PairSender(
            transport=self.transport, staging=self.send_pool, copier=PageCopier([self.src_views]),
            local_session="prefill:1", control=self.receiver.submit, connect_timeout=5, io_timeout=5.0,
            overlap=overlap)

    def drain(self):
        ev = threading.Event()
        self.receiver.submit(ev.set)
        assert ev.wait(10)

    def close(self):
        self.sender.close()
        self.receiver.close()
        self.transport.close()

    def pages_equal(self, src, dst) -> bool:
        s, d = torch.from_numpy(src.astype(np.int64)), torch.from_numpy(dst.astype(np.int64))
        return all(torch.equal(dt[d], st[s]) for st, dt in zip(self.src_t, self.dst_t))


def _ids(n, seed):
    rng = np.random.default_rng(seed)
    return rng.permutation(64)[:n].astype(np.int32), rng.permutation(64)[:n].astype(np.int32)


def _open(p: "OverlapPair") -> LaterComm:
    """Open the channel with a one-page room and return the receiver's end."""
    p.sender.send(5, 0, [np.array([63], np.int32)], [np.array([63], np.int32)])
    p.drain()
    p.log.clear()
    return p.receiver.comm


def _send_quietly(p: "OverlapPair", src, dst) -> None:
    """Room 5 from a thread of its own; a TransportError (the decode dropped the channel) is what some tests
    expect, and their assertions are on the receiver's side."""
    try:
        p.sender.send(5, 0, src, dst)
    except TransportError:
        pass


def _until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_overlapped_chunks_land_exactly_and_each_receive_is_posted_before_the_previous_chunk_lands(cpu_streams):
    p = OverlapPair()
    try:
        comm = _open(p)
        comm.hold.clear()  # receives finish only once the sender queued every chunk: the order is then fixed
        steps: list = []
        p.receiver.trace = lambda step, room: steps.append(step)  # the benchmark's probe (nccl_phases)
        sent: list = []
        p.sender.trace = lambda step, room: sent.append(step)
        src, dst = _ids(20, 1)
        assert p.sender.send(5, 0, [src], [dst]) == 20 * 6 * 48
        # the receiver took the third header (and waits for the first receive) before any receive ends
        _until(lambda: steps.count("header") == 3, "the third header")
        comm.hold.set()
        p.drain()
        assert p.landed[1:] == [(5, None)] * 7  # 3 pages a 1 KiB slot: 7 chunks, all reported, in order
        assert p.pages_equal(src, dst)
        events = [e[0] for e in p.log if e[0] in ("posted", "prepared", "scatter")]
        # receive-ahead: chunk i+1's receive is posted before chunk i is scattered; each chunk's scatter is readied
        # (its ids on the device) before it lands, so landing it is only the launch. Whether chunk 1's receive
        # comes before chunk 0's readying depends on whether its header was queued when chunk 0's receive was
        # posted (test_headers_queued_behind_a_chunk_... makes that certain)
        assert events[:5] in (["posted", "prepared", "posted", "prepared", "scatter"],
                              ["posted", "posted", "prepared", "prepared", "scatter"]), events
        assert events.count("posted") == events.count("prepared") == events.count("scatter") == 7
        # a chunk is checked once its receive is posted, while its bytes move: the prefill's send waits only for
        # the post
        chunk = ["header", "slot", "post", "checked", "readied"]
        # two chunks posted hold the two slots this end may take of three (their receives held back); the third
        # chunk's header then moves the oldest on (lands it, waits for its scatter: the slot comes back) and posts
        # into that slot. From there the order depends on when each receive ends; every chunk's own steps keep
        # their order, and a chunk is reported only after its scatter is seen done
        land = ["landed", "launched", "scattered", "reported"]
        ahead = chunk[:4] * 2 + ["readied"] * 2  # chunk 1's header was queued when chunk 0's receive was posted
        assert steps[:10] in (chunk * 2, ahead), steps
        assert steps[10:19] == ["header", *land, *chunk[1:]], steps
        assert all(steps.count(step) == 7 for step in chunk + land) and steps[-4:] == land, steps
        assert all(steps.index("scattered", i) < steps.index("reported", i) for i, s in enumerate(steps)
                   if s == "launched")
        assert sent == ["start"] + ["header", "handed", "gather", "post"] * 7 + ["sent"], sent
        # the sender filled two slots in turn, each refilled only after waiting for its previous send
        slots = [e[1] for e in p.log if e[0] == "sent from slot"]
        assert len(set(slots)) == 2 and slots[:2] * 3 == slots[:6]
        assert sum(1 for e in p.log if e[0] == "side waits for a send") == 5
        assert p.recv_pool.in_use == 0 and p.send_pool.in_use == 0
    finally:
        p.close()


def test_headers_queued_behind_a_chunk_have_their_receives_posted_before_its_scatter_is_readied(cpu_streams):
    """Receive-ahead from the queue: a header already queued when a chunk's receive is posted gets its receive
    posted (and checked) before that chunk's scatter is readied, so the link moves the next chunk meanwhile; only
    into a spare slot (two of three here), the next header waits for a slot as before."""
    p = OverlapPair()
    try:
        comm = _open(p)
        comm.hold.clear()
        gate = threading.Event()
        p.receiver.submit(gate.wait)  # the receiver busy: the room's headers queue up behind
        steps: list = []
        p.receiver.trace = lambda step, room: steps.append(step)
        src, dst = _ids(20, 1)
        p.sender.send(5, 0, [src], [dst])
        gate.set()
        _until(lambda: steps.count("readied") == 2, "the first two chunks readied")
        chunk = ["header", "slot", "post", "checked"]
        assert steps[:10] == chunk * 2 + ["readied", "readied"], steps
        assert [e[0] for e in p.log if e[0] in ("posted", "prepared")] == ["posted", "posted", "prepared", "prepared"]
        assert p.recv_pool.in_use == 2  # the third slot stays for another peer
        comm.hold.set()
        p.drain()
        assert p.landed[1:] == [(5, None)] * 7 and p.pages_equal(src, dst)
        assert all(steps.count(step) == 7 for step in chunk + ["readied", "landed", "scattered", "reported"]), steps
        assert p.recv_pool.in_use == 0
    finally:
        p.close()


def test_an_item_queued_between_headers_stops_the_receive_ahead_and_runs_after_the_chunks_before_it(cpu_streams):
    """Anything but a header behind the chunk just posted (a callable, a new channel, the close) ends the look
    ahead and keeps its place: it runs once the chunks announced before it are reported, before the headers after
    it are taken."""
    p = OverlapPair(slots=6)
    try:
        comm = _open(p)
        comm.hold.clear()
        gate = threading.Event()
        p.receiver.submit(gate.wait)
        order: list = []
        p.receiver.trace = lambda step, room: order.append(step) if step in ("header", "reported") else None
        headers = []

        def control(msg):  # the callable goes in behind the room's second header
            p.receiver.submit(msg)
            headers.append(msg)
            if len(headers) == 2:
                p.receiver.submit(lambda: order.append("callable"))

        p.sender.control = control
        src, dst = _ids(9, 4)  # three chunks of three pages
        p.sender.send(5, 0, [src], [dst])
        gate.set()
        _until(lambda: order.count("header") == 2, "the first two headers")
        comm.hold.set()
        p.drain()
        assert order == ["header", "header", "reported", "reported", "callable", "header", "reported"], order
        assert p.landed[1:] == [(5, None)] * 3 and p.pages_equal(src, dst) and p.recv_pool.in_use == 0
    finally:
        p.close()


def test_a_receive_ahead_whose_post_fails_fails_every_chunk_in_order_and_returns_the_slots(cpu_streams):
    """The receive posted ahead fails (the channel broke): the chunk before it, posted on that channel, fails at
    landing, the failed one and the rest of the room fail in announcement order, once each; no slot is kept."""
    p = OverlapPair()
    try:
        comm = _open(p)
        comm.hold.clear()
        comm.recvs, comm.fail_recv_at = 0, 1  # the room's first receive posts, the one ahead of it fails
        gate = threading.Event()
        p.receiver.submit(gate.wait)
        src, dst = _ids(9, 5)  # three chunks of three pages
        sender = threading.Thread(target=_send_quietly, args=(p, [src], [dst]))
        sender.start()
        _until(lambda: p.receiver._queue.qsize() >= 3, "the room's three headers queued")
        gate.set()
        # chunk 0's receive posted, chunk 1's posted ahead and failed, then again as the next item: chunk 0 still
        # held in flight, so it can only fail with its channel
        _until(lambda: comm.recvs >= 3, "chunk 1's receive refused twice")
        comm.hold.set()
        sender.join(15)
        p.drain()
        reports = p.landed[1:]
        assert [room for room, _ in reports] == [5, 5, 5] and all(err for _, err in reports), reports
        assert "receive post failed (test)" not in reports[0][1]  # chunk 0: lost with the aborted channel
        assert all("broke: receive post failed (test)" in err for _, err in reports[1:]), reports
        assert p.receiver.comm is None and p.recv_pool.in_use == 0
        assert all(bool((t[torch.from_numpy(dst.astype(np.int64))] == 0xA5).all()) for t in p.dst_t)  # none landed
    finally:
        p.close()


def test_a_chunk_is_reported_only_once_its_queued_ended_and_the_next_receive_is_posted_meanwhile(cpu_streams,
                                                                                                   monkeypatch):
    """The receiver does not wait for a launched scatter while it can post the next receive: the chunk keeps its
    slot and its report until the scatter is seen done."""
    ended = threading.Event()
    monkeypatch.setattr(pipeline, "_queued_end", lambda stream: ended.is_set)
    p = OverlapPair(slots=4)
    try:
        ended.set()
        _open(p)
        ended.clear()  # from here on no scatter is seen done
        src, dst = _ids(6, 7)  # two chunks of three pages
        p.sender.send(5, 0, [src], [dst])
        _until(lambda: sum(1 for e in p.log if e[0] == "scatter") == 2, "both chunks landed and their scatters launched")
        threading.Event().wait(0.1)
        # the second receive was posted with the first chunk unreported: nothing is reported, both slots held
        assert [e[0] for e in p.log].count("posted") == 2
        assert p.landed[1:] == [] and p.recv_pool.in_use == 2
        ended.set()
        _until(lambda: len(p.landed) == 3, "both chunks reported")
        assert p.landed[1:] == [(5, None)] * 2 and p.pages_equal(src, dst) and p.recv_pool.in_use == 0
    finally:
        ended.set()
        p.close()


def test_a_scatter_that_never_ends_fails_its_chunk_after_the_io_timeout_and_drops_the_channel(cpu_streams,
                                                                                              monkeypatch):
    ended = threading.Event()
    monkeypatch.setattr(pipeline, "_queued_end", lambda stream: ended.is_set)
    p = OverlapPair()
    try:
        ended.set()
        _open(p)
        ended.clear()
        p.receiver.io_timeout = 0.3
        p.sender.send(5, 0, [np.array([10, 11], np.int32)], [np.array([20, 21], np.int32)])
        _until(lambda: len(p.landed) == 2, "the chunk to fail")
        p.drain()  # the chunk is reported before its channel is dropped: what follows sees both
        room, err = p.landed[1]
        assert room == 5 and "scatter not done after 0.3s (GPU stalled)" in err, err
        assert p.receiver.comm is None and p.recv_pool.in_use == 0
    finally:
        ended.set()
        p.close()


def test_without_overlap_every_chunk_lands_before_the_next_receive_is_posted(cpu_streams):
    p = OverlapPair(overlap=False)
    try:
        src, dst = _ids(9, 2)
        p.sender.send(5, 0, [src], [dst])
        p.drain()
        events = [e[0] for e in p.log if e[0] in ("posted", "scatter")]
        assert events == ["posted", "scatter"] * 3
        assert len({e[1] for e in p.log if e[0] == "sent from slot"}) == 1
        assert p.pages_equal(src, dst)
    finally:
        p.close()


def test_a_room_abandoned_while_its_chunk_is_in_flight_is_not_scattered(cpu_streams):
    p = OverlapPair()
    try:
        comm = _open(p)
        comm.hold.clear()  # the receive stays in flight
        src, dst = np.array([40, 41], np.int32), np.array([50, 51], np.int32)
        p.sender.send(5, 0, [src], [dst])
        _until(lambda: any(e[0] == "posted" for e in p.log), "the receive to be posted")
        p.wanted.discard(5)  # the decode gave the room up meanwhile: its pages may belong to another room now
        comm.hold.set()
        p.drain()
        assert all(bool((t[50:52] == 0xA5).all()) for t in p.dst_t)  # nothing written into them
        assert not any(e[0] == "scatter" for e in p.log)
        assert p.landed[-1] == (5, None) and p.recv_pool.in_use == 0
    finally:
        p.close()


def test_a_room_given_up_before_its_receive_is_posted_is_neither_readied_nor_scattered(cpu_streams):
    p = OverlapPair()
    try:
        _open(p)
        p.wanted.discard(5)
        src, dst = _ids(9, 3)
        p.sender.send(5, 0, [src], [dst])
        p.drain()
        assert [e[0] for e in p.log if e[0] in ("posted", "prepared", "scatter")] == ["posted"] * 3
        assert all(bool((t[torch.from_numpy(dst.astype(np.int64))] == 0xA5).all()) for t in p.dst_t)
        assert p.landed[1:] == [(5, None)] * 3 and p.recv_pool.in_use == 0
    finally:
        p.close()


def test_a_scatter_that_cannot_be_readied_is_done_at_landing_and_its_error_fails_the_chunk(cpu_streams):
    p = OverlapPair()
    fails = []

    def broken(chunk, ids, staging, dev_ids=None):
        fails.append(len(fails))
        if len(fails) > 1:  # readied once (chunk 0), then the ids cannot go to the device: at post and at landing
            raise RuntimeError("CUDA error: out of memory (test)")
        return PageCopier.prepare_scatter(p.receiver.copier, chunk, ids, staging, dev_ids)

    try:
        _open(p)
        p.receiver.copier.prepare_scatter = broken
        src, dst = _ids(6, 4)
        _send_quietly(p, [src], [dst])
        p.drain()
        reports = p.landed[1:]
        assert reports[0] == (5, None) and p.pages_equal(src[:3], dst[:3])
        assert "out of memory (test)" in reports[1][1] and p.receiver.comm is None
        assert all(bool((t[torch.from_numpy(dst[3:].astype(np.int64))] == 0xA5).all()) for t in p.dst_t)
        assert p.recv_pool.in_use == 0
    finally:
        p.close()


def test_two_receivers_sharing_two_slots_never_wait_on_each_other(cpu_streams):
    """Each receiver holds one slot with a chunk in flight when its next header comes; neither waits for a
    second slot (it lands its own chunk first), so neither waits for the other."""
    shared = StagingPool(lambda n: torch.empty(n, dtype=torch.uint8), 1024, 2)
    a, b = OverlapPair(receiver_pool=shared), OverlapPair(receiver_pool=shared)
    try:
        comms = [_open(a), _open(b)]
        for c in comms:
            c.hold.clear()
        first = np.array([60, 61, 62], np.int32)  # one chunk each: each receiver posts it and holds one slot
        for p in (a, b):
            p.sender.send(5, 0, [first], [first])
        _until(lambda: shared.in_use == 2, "each receiver to hold a slot")
        src, dst = _ids(20, 4)
        src, dst = src[~np.isin(dst, first)], dst[~np.isin(dst, first)]
        for p in (a, b):
            p.sender.send(5, 0, [src], [dst])  # tcp buffers the bytes: both senders are done
        threading.Event().wait(0.2)  # both receivers now have their next header and no free slot
        for c in comms:
            c.hold.set()
        a.drain(), b.drain()
        assert a.landed[1:] == b.landed[1:] == [(5, None)] * (1 + -(-len(src) // 3))
        assert a.pages_equal(src, dst) and b.pages_equal(src, dst)
        assert shared.in_use == 0
    finally:
        a.close()
        b.close()


def test_a_channel_breaking_with_a_chunk_in_flight_fails_both_chunks_in_order_and_returns_the_slots(cpu_streams):
    p = OverlapPair()
    try:
        comm = _open(p)
        comm.hold.clear()
        src, dst = _ids(20, 5)
        sender = threading.Thread(target=p.sender.send, args=(5, 0, [src], [dst]))
        sender.start()
        # two receives posted (both slots), the receiver waiting for the first; every chunk already sent (into the
        # socket's buffer: a sender still writing when the channel dies would stop short of announcing them all)
        _until(lambda: sum(1 for e in p.log if e[0] == "posted") == 2, "two posted receives")
        _until(lambda: sum(1 for e in p.log if e[0] == "sent from slot") == 7, "every chunk sent")
        comm.inner.abort()  # the channel dies with both in flight
        comm.hold.set()
        sender.join(15)
        p.drain()
        assert len(p.landed) == 1 + 7
        errors = [err for _, err in p.landed[1:]]
        assert all(e and "broke" in e for e in errors), p.landed
        assert p.recv_pool.in_use == 0
        assert p.receiver.comm is None
        assert not any(e[0] == "scatter" for e in p.log)
    finally:
        p.close()


def test_overlap_is_on_by_default_and_sglang_p2p_overlap_turns_it_off(monkeypatch):
    from sglang_p2p_backend.engine.config import ConfigError, EngineConfig

    monkeypatch.delenv("SGLANG_P2P_OVERLAP", raising=False)
    assert EngineConfig.from_env().overlap is True
    monkeypatch.setenv("SGLANG_P2P_OVERLAP", "0")
    assert EngineConfig.from_env().overlap is False
    monkeypatch.setenv("SGLANG_P2P_OVERLAP", "yes")
    with pytest.raises(ConfigError, match="SGLANG_P2P_OVERLAP"):
        EngineConfig.from_env()


def test_try_acquire_takes_a_spare_slot_never_the_last_one():
    pool = StagingPool(lambda n: torch.empty(n, dtype=torch.uint8), 16, 3)
    first = pool.acquire(1)
    assert not pool.has_waiters()
    second = pool.try_acquire()
    assert second is not None and pool.try_acquire() is None  # one left: it stays for another end
    third = pool.acquire(1)  # which another end then gets at once
    waiter = threading.Thread(target=lambda: pool.release(pool.acquire(5)))
    waiter.start()
    _until(pool.has_waiters, "the waiter")
    pool.release(second)
    waiter.join(5)
    pool.release(first), pool.release(third)
    assert pool.in_use == 0
    assert StagingPool(lambda n: torch.empty(n, dtype=torch.uint8), 16, 2).try_acquire() is not None
    two = StagingPool(lambda n: torch.empty(n, dtype=torch.uint8), 16, 2)
    held = two.acquire(1)
    assert two.try_acquire() is None  # two slots: a second would be the last
    two.release(held)
    # a waiter is first in line: between a release and the waiter taking the slot (the count acquire keeps
    # while it waits), try_acquire leaves the free slot alone
    pool = StagingPool(lambda n: torch.empty(n, dtype=torch.uint8), 16, 3)
    mine = pool.acquire(1)
    pool._waiting = 1  # noqa: SLF001 - an acquire() woken by a release, not yet back in the lock
    assert pool.try_acquire() is None and pool.has_waiters()
    pool._waiting = 0  # noqa: SLF001
    extra = pool.try_acquire()
    assert extra is not None
    pool.release(extra), pool.release(mine)


class GatedCopier(PageCopier):
    """The sender's copier, stopped before the gather of chunk `at` until `go` is set."""

    def __init__(self, views, at: int):
        super().__init__(views)
        self.at, self.n = at, 0
        self.reached, self.go = threading.Event(), threading.Event()

    def gather(self, chunk, ids, staging, dev_ids=None):
        if self.n == self.at:
            self.reached.set()
            assert self.go.wait(10)
        self.n += 1
        return super().gather(chunk, ids, staging, dev_ids)


def test_a_sender_holding_two_slots_gives_one_back_to_an_end_that_waits(cpu_streams):
    p = OverlapPair()
    try:
        _open(p)
        gated = p.sender.copier = GatedCopier([p.src_views], at=3)
        src, dst = _ids(20, 6)
        sender = threading.Thread(target=p.sender.send, args=(5, 0, [src], [dst]))
        sender.start()
        assert gated.reached.wait(10)  # chunks 0-2 went out through both slots
        third = p.send_pool.acquire(1)  # another end takes the slot left: the next one to come has to wait
        got = []
        waiter = threading.Thread(target=lambda: got.append(p.send_pool.acquire(5)))
        waiter.start()
        _until(p.send_pool.has_waiters, "another end waiting for a slot")
        gated.go.set()
        waiter.join(10)
        assert got, "the waiting end never got a slot while the sender went on"
        sender.join(10)
        assert not sender.is_alive()
        p.send_pool.release(got[0]), p.send_pool.release(third)
        p.drain()
        assert p.landed[1:] == [(5, None)] * 7
        slots = [e[1] for e in p.log if e[0] == "sent from slot"]
        assert len(set(slots[:3])) == 2 and len(set(slots[3:])) == 1  # one slot after giving one back
        assert p.send_pool.in_use == 0 and p.recv_pool.in_use == 0
    finally:
        p.close()


def test_a_staging_slot_that_cannot_be_allocated_fails_its_chunk_and_the_channel_not_the_next_chunk(cpu_streams):
    """The receiver's spare slot is allocated mid-transfer; if that fails (out of memory) the chunk's receive is
    never posted, so the channel is dropped: the prefill's bytes must not land under the next header."""
    made, refused = [], threading.Event()

    def alloc(n):
        if made:  # the slot of the channel's first room is the only one that can be had
            refused.set()
            raise RuntimeError("CUDA out of memory (test)")
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    p = OverlapPair(receiver_pool=StagingPool(alloc, 1024, 3))
    try:
        comm = _open(p)
        comm.hold.clear()  # chunk 0 stays posted while chunk 1's header asks for the spare slot
        src, dst = _ids(20, 7)
        sender = threading.Thread(target=_send_quietly, args=(p, [src], [dst]))
        sender.start()
        assert refused.wait(10)
        comm.hold.set()  # chunk 0 can land now
        sender.join(15)
        p.drain()
        reports = p.landed[1:]
        assert reports[0] == (5, None)  # chunk 0: received and scattered before the failure
        assert reports[1][1] and "could not allocate a staging slot" in reports[1][1]
        assert all(err for _, err in reports[1:]) and p.receiver.comm is None
        assert p.pages_equal(src[:3], dst[:3])  # what was reported landed exactly
        assert all(bool((t[torch.from_numpy(dst[3:].astype(np.int64))] == 0xA5).all()) for t in p.dst_t)
        assert p.recv_pool.in_use == 0
    finally:
        p.close()


def test_a_header_check_that_raises_fails_that_chunk_alone_and_reports_every_chunk_once(cpu_streams):
    """Its receive was posted before the checks ran (the channel stays in step): its bytes land in staging and
    are dropped, it is reported failed with the error, and the chunks after it land as announced."""
    p = OverlapPair()
    try:
        _open(p)
        checked = []
        plain = p.receiver.check

        def check(header):
            checked.append(header)
            if len(checked) == 3:
                raise ValueError("a bug in a check (test)")
            return plain(header)

        p.receiver.check = check
        src, dst = _ids(20, 8)
        _send_quietly(p, [src], [dst])
        p.drain()
        reports = p.landed[1:]
        assert len(reports) == len(checked) == 7  # every announced chunk reported once, in order
        assert reports[:2] == [(5, None)] * 2 and reports[3:] == [(5, None)] * 4
        assert "its checks failed: ValueError('a bug in a check (test)')" in reports[2][1]
        assert p.receiver.comm is not None  # the channel stayed in step
        landed = np.r_[0:6, 9:20]  # 3 pages a chunk: the third chunk's pages 6-8 were not written
        assert p.pages_equal(src[landed], dst[landed])
        assert all(bool((t[torch.from_numpy(dst[6:9].astype(np.int64))] == 0xA5).all()) for t in p.dst_t)
        assert p.recv_pool.in_use == 0
    finally:
        p.close()


@pytest.mark.parametrize("settled", [True, False])
def test_a_sender_error_gives_its_two_slots_back_only_once_the_channel_work_ended(cpu_streams, monkeypatch, settled):
    monkeypatch.setattr(pipeline, "_settled", lambda comm, timeout: settled)
    p = OverlapPair()
    try:
        _open(p)
        p.sender.comm.fail_send_at = 3
        src, dst = _ids(20, 9)
        with pytest.raises(TransportError, match="send failed"):
            p.sender.send(5, 0, [src], [dst])
        assert p.sender.comm is None  # the channel was dropped
        # settled: both slots back; not settled: kept out of use rather than handed to another room
        assert p.send_pool.in_use == (0 if settled else 2)
    finally:
        p.close()


def test_no_receive_ahead_past_a_chunk_whose_scatter_may_load_a_kernel(cpu_streams):
    """Loading a CUDA module can wait for the kernels running, here the next chunk's receive (on the peer):
    a chunk whose scatter is not the preloaded kernel lands before the next receive is posted."""
    p = OverlapPair()
    try:
        comm = _open(p)
        p.receiver.copier.loaded_for = lambda chunk: False
        comm.hold.clear()
        src, dst = _ids(9, 10)
        p.sender.send(5, 0, [src], [dst])
        comm.hold.set()
        p.drain()
        assert [e[0] for e in p.log if e[0] in ("posted", "scatter")] == ["posted", "scatter"] * 3
        assert p.landed[1:] == [(5, None)] * 3 and p.pages_equal(src, dst)
    finally:
        p.close()


def test_a_wrong_expected_end_does_not_hold_chunks_back(cpu_streams):
    """Receives that claim to end 30 s ahead (a pace learned wrong): the receiver still lands every chunk as soon
    as its bytes are in, since a header wakes it and no wait for an expected end lasts over 5 ms."""
    p = OverlapPair()
    try:
        comm = _open(p)
        comm.expect_s = 30.0
        src, dst = _ids(20, 3)
        t0 = time.monotonic()
        assert p.sender.send(5, 0, [src], [dst]) == 20 * 6 * 48
        _until(lambda: len(p.landed) >= 1 + 7, "every chunk of the room to land")
        assert time.monotonic() - t0 < 3.0
        assert p.landed[1:] == [(5, None)] * 7 and p.pages_equal(src, dst)  # 3 pages a 1 KiB slot: 7 chunks
    finally:
        p.close()
