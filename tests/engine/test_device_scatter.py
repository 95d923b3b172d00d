"""SGLANG_P2P_DEVICE_SCATTER on CPU: the decode's receiver queues each readied scatter behind its receive and
counts it for its room until it is seen ended, never telling the end before the scatter ran.

The overlapped tcp harness of test_pipeline_overlap.py stands in for the NCCL channel; a stand-in for the GPU's
stream order runs each queued scatter on a thread of its own once its receive finished (whatever the receive did,
as a GPU runs a kernel behind an event that an aborted receive still fires), and says the streams settled once
every queued scatter ran. The byte-exact GPU run is tests/gpu/test_engine_pipeline_nccl.py."""

import threading

import numpy as np
import pytest
import torch

from sglang_p2p_backend.engine.pair import pipeline
import test_pipeline_overlap
from test_pipeline_overlap import LaterComm, OverlapPair, _ids, _open, _until

cpu_streams = test_pipeline_overlap.cpu_streams  # the CUDA stream calls as no-ops (a fixture of that module)


class GpuOrder:
    """The GPU's order for scatters queued behind receives: each runs once its receive finished."""

    def __init__(self, events: list):
        self.events = events
        self.ran: list = []
        self.settles = True  # tests: False is a channel whose work never ends after its abort

    def queue_after(self, stream, received, run):
        done = threading.Event()

        def later():
            received.finished.wait(10)
            run()
            self.events.append(("ran",))
            done.set()

        self.ran.append(done)
        threading.Thread(target=later, daemon=True).start()
        return done.is_set

    def settled(self, comm, timeout) -> bool:
        return self.settles and all(d.wait(timeout) for d in self.ran)


def device_pair(monkeypatch, queued=None):
    """An overlapped pair whose receiver queues scatters on the stand-in GPU; its counts go to `events`."""
    events: list = []
    gpu = GpuOrder(events)
    monkeypatch.setattr(pipeline, "_queue_after", gpu.queue_after)
    monkeypatch.setattr(pipeline, "_settled", gpu.settled)
    orig = LaterComm.recv

    def recv_with_event(self, buf):  # an NCCL receive's completion carries the event a stream can wait on
        c = orig(self, buf)
        c.event = c
        return c

    monkeypatch.setattr(LaterComm, "recv", recv_with_event)
    p = OverlapPair()
    comm = _open(p)
    r = p.receiver
    r.device_scatter = True

    def on_queued(room):
        if queued is not None and not queued(room):
            return False
        events.append(("queued", room))
        return True

    r.on_queued = on_queued
    r.on_ended = lambda room: events.append(("ended", room))
    r.on_chunk = lambda room, rank, err: (events.append(("reported", room)), p.landed.append((room, err)))
    return p, comm, gpu, events


def _counts(events, upto=None):
    kinds = [e[0] for e in events[:upto]]
    return {k: kinds.count(k) for k in ("queued", "ran", "ended", "reported")}


def test_each_scatter_is_queued_before_its_bytes_land_and_its_end_told_only_after_it_ran(cpu_streams, monkeypatch):
    p, comm, gpu, events = device_pair(monkeypatch)
    try:
        comm.hold.clear()  # no receive finishes until the scatters behind them are queued
        p.log.clear()
        src, dst = _ids(20, 1)
        p.sender.send(5, 0, [src], [dst])
        _until(lambda: _counts(events)["queued"] >= 2, "two scatters queued")
        # queued while their receives were still posted: nothing received, nothing scattered yet
        assert not [e for e in p.log if e[0] in ("received", "scatter")], p.log
        assert _counts(events)["ran"] == 0
        comm.hold.set()
        p.drain()
        assert p.landed[1:] == [(5, None)] * 7
        assert p.pages_equal(src, dst)
        assert _counts(events) == {"queued": 7, "ran": 7, "ended": 7, "reported": 7}, events
        for i in range(len(events) + 1):  # in every prefix: told ended only after it ran, reported only after that
            c = _counts(events, i)
            assert c["reported"] <= c["ended"] <= c["ran"] <= c["queued"], events[:i]
        # every receive was followed by its scatter on the stand-in GPU, none launched again at landing
        assert [e[0] for e in p.log].count("scatter") == 7
        assert p.recv_pool.in_use == 0
    finally:
        p.close()


def test_a_room_that_failed_before_its_scatter_was_counted_is_not_queued_and_its_chunk_is_dropped(cpu_streams,
                                                                                                  monkeypatch):
    def fails_now(room):  # the room failed between readying and queueing: the decode refuses to count it
        p.wanted.discard(room)
        return False

    p, comm, gpu, events = device_pair(monkeypatch, queued=lambda room: fails_now(room))
    try:
        before = [t.clone() for t in p.dst_t]
        src, dst = _ids(6, 2)
        p.sender.send(5, 0, [src], [dst])
        p.drain()
        assert [e[0] for e in events] == ["reported"] * 2 and p.landed[1:] == [(5, None)] * 2
        assert gpu.ran == []  # nothing queued on the GPU
        assert all(torch.equal(a, b) for a, b in zip(before, p.dst_t))  # and nothing written at landing either
    finally:
        p.close()


@pytest.mark.parametrize("settles", [True, False])
def test_an_aborted_channel_tells_its_queued_scatters_ended_only_once_its_work_settled(cpu_streams, monkeypatch,
                                                                                       settles):
    p, comm, gpu, events = device_pair(monkeypatch)
    gpu.settles = settles
    try:
        comm.hold.clear()
        src, dst = _ids(20, 3)
        sender = threading.Thread(target=lambda: _send_quietly(p, src, dst), daemon=True)
        sender.start()
        _until(lambda: _counts(events)["queued"] >= 2, "two scatters queued")
        p.receiver.comm.abort()  # the prefill died: its receives fail, the scatters behind them still run
        comm.hold.set()
        sender.join(10)
        p.drain()
        # every scatter queued ran (a chunk posted on the aborted channel before its failure was seen included)
        _until(lambda: _counts(events)["ran"] == _counts(events)["queued"], "the queued scatters ran")
        errors = [err for room, err in p.landed[1:] if err]
        assert errors and all("broke" in err for err in errors), p.landed
        c = _counts(events)
        assert c["queued"] >= 2
        if settles:
            assert c["ended"] == c["queued"], events
            for i in range(len(events) + 1):
                d = _counts(events, i)
                assert d["ended"] <= d["ran"], events[:i]
        else:  # work that never ends keeps its rooms counted: the decode's bound ends their wait
            assert c["ended"] == 0, events
    finally:
        p.close()


def _send_quietly(p, src, dst) -> None:
    try:
        p.sender.send(5, 0, [src], [dst])
    except Exception:  # noqa: BLE001 - the decode dropped the channel: asserted on the receiver's side
        pass


def test_off_by_default_the_scatter_is_launched_at_landing(cpu_streams, monkeypatch):
    queued = []
    monkeypatch.setattr(pipeline, "_queue_after", lambda *a: queued.append(a))
    p = OverlapPair()
    try:
        _open(p)
        assert p.receiver.device_scatter is False
        src, dst = _ids(10, 4)
        p.sender.send(5, 0, [src], [dst])
        p.drain()
        assert p.pages_equal(src, dst) and queued == []
    finally:
        p.close()


def test_the_knob_reaches_a_receiver_only_where_its_rooms_are_counted(monkeypatch):
    from sglang_p2p_backend.engine.config import EngineConfig
    from sglang_p2p_backend.engine.pair.channels import PairReceivers

    monkeypatch.setenv("SGLANG_P2P_DEVICE_SCATTER", "1")
    config = EngineConfig.from_env()
    assert config.device_scatter is True

    class _Copier:
        item_lens = [[8]]

    def receivers(**kw):
        return PairReceivers(transport=None, staging=None, copier=_Copier(), session="decode", config=config,
                             send=lambda *a: True, wanted=lambda room: True, on_chunk=lambda *a: None,
                             check=lambda header: None, **kw)

    counted = receivers(on_queued=lambda room: True)
    uncounted = receivers()
    try:
        assert counted._receiver("p").device_scatter is True
        assert uncounted._receiver("p").device_scatter is False
    finally:
        counted.close()
        uncounted.close()
    monkeypatch.setenv("SGLANG_P2P_DEVICE_SCATTER", "2")
    with pytest.raises(Exception, match="SGLANG_P2P_DEVICE_SCATTER"):
        EngineConfig.from_env()
    np.testing.assert_equal(EngineConfig().device_scatter, False)
