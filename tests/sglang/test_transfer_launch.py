"""SGLANG_P2P_IPC_LAUNCH=scheduler: a same-host chunk's copy queued by `TransferWorkers.add` on SGLang's thread,
its worker waiting for it. Which chunks go so, how each is counted in flight (an abort's ACK waits for exactly
the copies queued), and what the worker does with a copy that failed or a room that ended meanwhile. The parts
around the workers are small fakes: each test drives `add` and the worker's step itself, on this thread."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_p2p_backend.adapter.transfer_workers import TransferTask
from sglang_p2p_backend.engine.copy.stream_ops import CudaCallError

from support.knobs import assert_on_off_switch
from support.transfer_fakes import SESSION, FakeLaunch, step, task, workers

def test_a_plain_chunk_is_queued_in_add_counted_from_there_and_its_worker_only_waits_and_concludes():
    launch = FakeLaunch()
    w, status, failed, succeeded = workers(launch)
    t = task()
    w.add(t)
    # queued here with the chunk's own ids and its slice of the decode's: counted in flight until its worker ends
    assert w.same_host.launched == [(SESSION, [3, 4, 5], [102, 103, 104])]
    assert t.launch is launch and t.counted and w.release.in_flight == {7: 1}
    step(w)
    assert launch.waits == 1 and w.same_host.sent == []  # waited for, not copied again
    assert succeeded == [7] and failed == []
    assert w.release.in_flight == {7: 0} and w.release.drained == [7]


@pytest.mark.parametrize("answer", [None, RuntimeError("cudaMemcpyBatchAsync refused")], ids=["refused", "raised"])
def test_a_launch_refused_or_raising_is_not_counted_and_its_worker_copies_the_chunk(answer):
    w, status, failed, succeeded = workers(answer)
    t = task()
    w.add(t)  # an exception never reaches SGLang's thread
    assert t.launch is None and not t.counted
    assert w.release.in_flight == {7: 0} and w.release.drained == [7]  # nothing in flight: an ACK may go at once
    step(w)
    assert w.same_host.sent == [(SESSION, [[3, 4, 5]], [[102, 103, 104]])]
    assert succeeded == [7] and failed == []


@pytest.mark.parametrize("case", ["state", "heads", "wait_event", "nccl", "ids_copy_running", "off", "unmapped"])
def test_chunks_other_than_plain_whole_pages_to_one_mapped_same_host_rank_go_to_the_worker(case):
    kw, heads, route = {}, None, "cudaipc"
    if case == "state":
        kw = {"state_indices": [np.array([1])]}
    elif case == "wait_event":
        kw = {"wait_event": SimpleNamespace(synchronize=lambda: None)}
    elif case == "ids_copy_running":
        kw = {"indices_event": SimpleNamespace(query=lambda: False, synchronize=lambda: None)}
    elif case == "heads":
        heads = SimpleNamespace(src=SimpleNamespace(count=2))
    elif case == "nccl":
        route = "nccl"
    w, *_ = workers(FakeLaunch(), route=route, heads=heads, launch_in_add=case != "off")
    w.same_host.is_mapped = case != "unmapped"
    routed = []
    w.route = lambda s: routed.append(s) or route
    t = TransferTask(7, np.arange(3, 6, dtype=np.int32), slice(2, 5), True, None, kw.get("state_indices"),
                     kw.get("wait_event"), kw.get("indices_event"))
    w.add(t)
    assert w.same_host.launched == [] and t.launch is None and w.release.in_flight == {}
    if case == "unmapped":  # not this path's peer (yet): SGLang's thread does not even route it
        assert routed == []


def test_page_ids_whose_copy_already_ran_are_read_and_the_chunk_is_queued_in_add():
    ids = np.array([3, 4, 5], dtype=np.int64)  # SGLang's host tensor, its copy from the device ended
    w, *_ = workers(FakeLaunch())
    t = TransferTask(7, ids, slice(2, 5), True, None, None, None, SimpleNamespace(query=lambda: True))
    w.add(t)
    assert w.same_host.launched == [(SESSION, [3, 4, 5], [102, 103, 104])]
    assert t.indices_event is None and t.kv_indices.dtype == np.int32


def test_a_failed_copy_fails_the_room_naming_the_decode_rank_and_ends_its_count():
    launch = FakeLaunch(CudaCallError("cudaEventSynchronize on cuda:0 failed: an illegal memory access (error 700)"))
    w, status, failed, succeeded = workers(launch)
    w.add(task())
    step(w)
    assert succeeded == [] and len(failed) == 1
    room, why = failed[0]
    assert room == 7 and why.startswith(f"KV transfer to decode rank {SESSION} failed: ") and "error 700" in why
    assert w.release.in_flight == {7: 0}


def test_a_room_that_ended_while_its_copy_ran_is_waited_for_before_its_count_ends():
    launch = FakeLaunch()
    w, status, failed, succeeded = workers(launch)
    w.add(task())
    status[7] = KVPoll.Failed  # aborted meanwhile: the copy still runs into the decode's pages
    step(w)
    assert launch.waits == 1 and succeeded == [] and failed == []
    assert w.release.drained == [7]  # the ACK's moment: after the wait


class FakeIpc:
    """The transport's mapping calls: which export each session has mapped, and what the last launch into a
    session had done when its mapping was dropped or replaced."""

    def __init__(self, launches: list):
        self.maps, self.launches, self.dropped = {}, launches, []

    def mapped(self, session, export):
        return self.maps.get(session) is export

    def forget_peer(self, session):
        self.dropped.append((session, [ln.waits for ln in self.launches]))
        self.maps.pop(session, None)

    def open_peer(self, session, export):
        self.forget_peer(session)
        self.maps[session] = export


class LaunchingBackend:
    """cuda_ipc's backend as SameHostPath.launch uses it: each launch runs its write and returns a FakeLaunch."""

    def __init__(self, launches: list):
        self.launches = launches

    def launch(self, device, write, timed=False):
        self.launches.append(FakeLaunch())
        return write(), self.launches[-1]


def same_host_path(monkeypatch):
    from sglang_p2p_backend.adapter import same_host

    launches: list = []
    monkeypatch.setattr(same_host, "backend", lambda: LaunchingBackend(launches))
    ipc = FakeIpc(launches)
    path = same_host.SameHostPath(None, SimpleNamespace(kv=[], state=[], aux=[]), None, {}, lambda reg: [], 8)
    path.ipc = ipc
    path._sender = SimpleNamespace(send=lambda *a, **kw: 0)
    return path, ipc, launches


def test_a_peers_memory_is_unmapped_or_replaced_only_after_its_last_launch_ran(monkeypatch):
    path, ipc, launches = same_host_path(monkeypatch)
    old, new = SimpleNamespace(session=SESSION, ipc=object()), SimpleNamespace(session=SESSION, ipc=object())
    ids = np.arange(3, dtype=np.int32)
    assert path.launch(old, ids, ids, lambda: None) is None and launches == []  # not mapped yet: its worker maps
    ipc.maps[SESSION] = old.ipc
    first = path.launch(old, ids, ids, lambda: None)
    assert first is launches[0] and first.waits == 0
    path.reset(SESSION)  # ResetPeer: the old process's mapping goes once the launch into it ran
    assert ipc.dropped == [(SESSION, [1])]
    ipc.maps[SESSION] = old.ipc
    path.launch(old, ids, ids, lambda: None)
    path.send(new, [ids], [ids], None, lambda: None)  # a new process behind the session: mapped afresh, after it
    assert ipc.dropped[-1] == (SESSION, [1, 1]) and ipc.maps[SESSION] is new.ipc


def test_a_launch_never_waits_for_a_worker_that_maps_a_peer(monkeypatch):
    path, ipc, launches = same_host_path(monkeypatch)
    peer = SimpleNamespace(session=SESSION, ipc=object())
    ipc.maps[SESSION] = peer.ipc
    with path._mapping:  # a worker (un)mapping a peer now: SGLang's thread leaves the chunk to its worker
        assert path.launch(peer, np.arange(3), np.arange(3), lambda: None) is None
    assert launches == [] and path.launch(peer, np.arange(3), np.arange(3), lambda: None) is launches[0]


@pytest.mark.parametrize("launch_in_add", [True, False], ids=["launched", "worker"])
def test_only_the_last_chunk_of_the_only_request_is_copied_as_alone(launch_in_add):
    """`alone` reaches the copy (SGLang's thread's launch or the worker's) only for a room's last chunk, and only
    while the prefill says the room is its only request: an earlier chunk's next forward pass, or another
    request's, runs beside the copy."""
    only: set = {7}
    w, status, failed, succeeded = workers(None if not launch_in_add else FakeLaunch(), launch_in_add=launch_in_add,
                                           alone=lambda room: only == {room})
    for t, others in ((task(is_last=False), set()), (task(), {8}), (task(), set())):
        only.clear()
        only.update({7} | others)
        w.add(t)
        step(w)
    assert w.same_host.alone == [False, False, True]
    assert succeeded == [7, 7] and failed == []


def test_the_prefill_counts_a_room_alone_while_it_is_the_only_request_with_a_sender_and_the_knob_turns_it_off(
        monkeypatch):
    from sglang_p2p_backend.adapter.prefill import PrefillKVManager

    alone = PrefillKVManager._alone
    assert alone(SimpleNamespace(owned_rooms={7}), 7)
    assert not alone(SimpleNamespace(owned_rooms={7, 8}), 7)  # another request is bootstrapping, waiting or sending
    assert not alone(SimpleNamespace(owned_rooms={8}), 7) and not alone(SimpleNamespace(owned_rooms=set()), 7)
    assert_on_off_switch(monkeypatch, "SGLANG_P2P_ALONE_KERNEL", "alone_kernel")


@pytest.mark.parametrize("launch_in_add", [True, False], ids=["queued-in-add", "copied-by-worker"])
def test_a_rooms_aux_row_goes_in_its_status_frame_whoever_copied_its_last_chunk(launch_in_add):
    """One send for the room's end, on the worker too: the aux row (this rank's row 5, the decode's row 9) then the
    Status, in one frame, after the copy."""
    w, status, failed, succeeded = workers(FakeLaunch(), launch_in_add=launch_in_add, aux_index=9)
    w.add(TransferTask(7, np.arange(3, 6, dtype=np.int32), slice(2, 5), True, 5, None))
    step(w)
    assert (w.same_host.sent == []) == launch_in_add  # the worker copied it itself, or waited for the launch
    assert w.control.sent == [(SESSION, ("AuxData", 7, 5, 9), True), (SESSION, ("Status", 7), True)]
    assert w.control.frames == [("AuxData", "Status")] and succeeded == [7] and failed == []
