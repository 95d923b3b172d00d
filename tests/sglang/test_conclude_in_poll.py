"""SGLANG_P2P_CONCLUDE_IN_POLL: a room whose last chunk SGLang's thread queued (`TransferWorkers.add`) is concluded
by SGLang's own poll of its sender once that copy ran, or by the chunk's worker if it got there first, never both
and never early: not before the copy ran, not before every earlier chunk's worker is done, the aux row always
ahead of the Status and in its frame, and nothing the poll sends waits on a peer (what would wait is left to the
worker, behind the chunk). The parts around the workers are small fakes (support/transfer_fakes.py); each test drives `add`, the poll
and the worker's turns itself, on this thread."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_p2p_backend.adapter.room_times import RoomTimes
from sglang_p2p_backend.adapter.transfer_workers import Conclude, TransferTask
from sglang_p2p_backend.engine.copy.stream_ops import CudaCallError

from support.knobs import assert_on_off_switch
from support.transfer_fakes import SESSION, FakeLaunch, drain, task, workers

AUX = ("AuxData", 7, 5, 9)  # this rank's aux row 5 into the decode's row 9
STATUS = ("Status", 7)


class Ran(FakeLaunch):
    """A copy that has run (`done`) before anyone waited for it."""

    def done(self) -> bool:
        return True


def last_chunk(**kw) -> TransferTask:
    return TransferTask(7, np.arange(3, 6, dtype=np.int32), slice(2, 5), True, 5, None, **kw)


def timed() -> tuple[RoomTimes, list]:
    """Room 7's steps timed (SGLANG_P2P_ROOM_TIMES=1), its first chunk queued: its line lands in the list."""
    lines: list = []
    times = RoomTimes(True, log=lines.append)
    times.mark(7, "queued")
    return times, lines


def test_the_poll_concludes_a_room_whose_last_copy_ran_aux_row_first_and_its_worker_only_waits():
    launch = Ran()
    times, lines = timed()
    w, status, failed, succeeded = workers(launch, conclude_in_poll=True, aux_index=9, times=times)
    w.add(last_chunk())
    w.conclude_launched(7)
    assert w.control.sent == [(SESSION, AUX, False), (SESSION, STATUS, False)]  # neither may wait on the decode
    assert w.control.frames == [("AuxData", "Status")]  # one frame, one send on SGLang's thread
    assert succeeded == [(7, True)] and status[7] == KVPoll.Success
    assert 7 not in w._finishing
    assert drain(w) == 1  # the worker woken for the copy: waits for it (its event goes back), concludes nothing
    assert launch.waits == 1 and succeeded == [(7, True)] and len(w.control.sent) == 2 and failed == []
    assert w.release.in_flight == {7: 0}  # counted in flight from `add` until its worker ended
    w.conclude_launched(7)  # SGLang polls again: nothing more
    assert len(w.control.sent) == 2
    times.seen(7)
    assert ", concluded " in lines[0] and lines[0].endswith(", by poll"), lines  # the line says who concluded


class Ticks:
    """A clock one millisecond further on at each reading."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1e-3
        return self.t


@pytest.mark.parametrize("by_poll", [True, False], ids=["poll", "worker"])
def test_either_concluder_marks_the_room_written_when_it_finds_the_copy_done_before_its_aux_row_goes(by_poll):
    # the room line's written -> concluded is the same span whoever concludes: the aux row, Success and Status
    ticks, lines = Ticks(), []
    times = RoomTimes(True, clock=ticks, log=lines.append)
    times.mark(7, "queued")
    w, _, _, succeeded = workers(Ran() if by_poll else FakeLaunch(), conclude_in_poll=True, aux_index=9, times=times)
    sent_at = {}

    def tick_then(real, session, msgs):
        at = 1e3 * (ticks() - 1e-3)  # ms from the room's first chunk queued
        sent_at.update({m[0]: at for m in msgs})
        return real(session, *msgs) if real is send_now else real(session, msgs)

    send_now, send_all = w.control.send_now, w.control.send_all
    w.control.send_now = lambda session, *msgs: tick_then(send_now, session, msgs)
    w.control.send_all = lambda session, msgs, block=True: tick_then(send_all, session, msgs)
    w.add(last_chunk())
    w.conclude_launched(7)
    drain(w)
    assert len(succeeded) == 1 and w.control.frames == [("AuxData", "Status")]
    line = times.seen(7)
    at = {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+)", line.split(": ", 1)[1])}
    assert at["written"] < sent_at["AuxData"] == sent_at["Status"] < at["concluded"], (line, sent_at)
    assert line.endswith(", by poll") == by_poll, line


def test_a_copy_still_running_is_not_concluded_and_the_worker_that_gets_there_first_concludes_it_once():
    launch = FakeLaunch()  # done only once waited for
    times, lines = timed()
    w, status, failed, succeeded = workers(launch, conclude_in_poll=True, aux_index=9, times=times)
    w.add(last_chunk())
    w.conclude_launched(7)
    w.conclude_launched(7)
    assert w.control.sent == [] and succeeded == [] and status[7] == KVPoll.WaitingForInput
    drain(w)
    assert w.control.sent == [(SESSION, AUX, True), (SESSION, STATUS, True)] and succeeded == [7]
    assert w.control.frames == [("AuxData", "Status")]  # the worker's conclusion: one frame too
    w.conclude_launched(7)  # the copy has run now, but its worker took the room: the poll only forgets it
    assert succeeded == [7] and len(w.control.sent) == 2 and 7 not in w._finishing
    times.seen(7)
    assert "concluded" in lines[0] and "by poll" not in lines[0], lines
    # the poll's two looks at the running copy, the last one timed (its third found the room taken: no look)
    assert re.search(r", looked [0-9.]+, written ", lines[0]) and lines[0].endswith(", looks 2"), lines


def test_the_polls_looks_at_a_running_copy_are_counted_and_the_last_one_timed_before_it_concludes():
    # `looked -> written` bounds how late SGLang's loop came back to the copy's end (docs/serving.md)
    ticks, lines = Ticks(), []
    times = RoomTimes(True, clock=ticks, log=lines.append)
    times.mark(7, "queued")
    launch = FakeLaunch()
    w, _, _, succeeded = workers(launch, conclude_in_poll=True, aux_index=9, times=times)
    w.add(last_chunk())
    for _ in range(3):
        w.conclude_launched(7)  # still running: three looks
    launch.done = lambda: True
    w.conclude_launched(7)
    assert succeeded == [(7, True)]
    line = times.seen(7)
    at = {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+)", line.split(": ", 1)[1])}
    assert at["looks"] == 3 and at["looked"] < at["written"] < at["concluded"], line
    assert line.endswith(", looks 3, by poll"), line
    times.mark(8, "queued")
    times.mark(8, "looked")
    times.mark(8, "ready")  # a later chunk ready: the looks were at an earlier chunk's copy, forgotten
    times.mark(8, "written")
    assert "look" not in times.seen(8)


def test_the_poll_waits_for_every_earlier_chunks_worker():
    """An earlier chunk may have been left to its worker (its copy not queued by SGLang's thread, or queued on
    another stream): the last copy having run proves nothing of it."""
    w, status, failed, succeeded = workers(None, conclude_in_poll=True)  # the first chunk's launch refused
    first = task(is_last=False)
    w.add(first)
    w.same_host.answer = Ran()
    last = task()
    w.add(last)
    assert last.previous is first and last.launch is w.same_host.answer
    w.conclude_launched(7)
    assert succeeded == []  # the first chunk's worker has not copied it yet
    w._transfer_step(w.shards[0])  # it copies the first chunk
    assert first.finished and w.same_host.sent == [(SESSION, [[3, 4, 5]], [[102, 103, 104]])]
    assert last.previous is first  # kept until the last chunk's own worker is done
    w.conclude_launched(7)
    assert succeeded == [(7, True)]
    drain(w)
    assert succeeded == [(7, True)] and last.previous is None and last.finished


def test_a_failed_copy_is_left_to_its_worker_which_fails_the_room_naming_the_error():
    class Failed(FakeLaunch):
        def done(self) -> bool:
            raise CudaCallError("cudaEventQuery on cuda:0 failed: an illegal memory access (error 700)")

    w, status, failed, succeeded = workers(Failed(CudaCallError("error 700")), conclude_in_poll=True)
    w.add(last_chunk())
    w.conclude_launched(7)  # never raises into SGLang's scheduler
    assert succeeded == [] and w.control.sent == []
    drain(w)
    assert succeeded == [] and len(failed) == 1 and "error 700" in failed[0][1] and status[7] == KVPoll.Failed


@pytest.mark.parametrize("case", ["failed", "peer gone", "released"])
def test_a_room_the_poll_cannot_conclude_plainly_is_left_to_its_worker(case):
    w, status, failed, succeeded = workers(Ran(), conclude_in_poll=True)
    w.add(last_chunk())
    if case == "failed":
        status[7] = KVPoll.Failed
    elif case == "peer gone":
        w.peers = {}
    else:
        w.released = lambda: "SGLang released the KV memory"
    w.conclude_launched(7)
    assert succeeded == [] and w.control.sent == [] and 7 in w._finishing
    drain(w)
    if case == "failed":
        assert succeeded == [] and failed == []  # ended meanwhile: the worker only waited for the copy
    else:  # the worker fails it, naming why
        assert succeeded == [] and len(failed) == 1
        assert ("not registered" if case == "peer gone" else "released the KV memory") in failed[0][1]


@pytest.mark.parametrize("busy", ["AuxData", "Status"])
def test_an_aux_row_and_status_that_would_wait_go_together_from_the_worker_after_success_was_marked(busy):
    w, status, failed, succeeded = workers(Ran(), conclude_in_poll=True, aux_index=9)
    w.control.busy = {busy}  # the decode's socket is busy or full
    w.add(last_chunk())
    w.conclude_launched(7)
    # the aux row was read and Success marked (SGLang may reuse the row now); nothing half sent
    assert w.control.sent == [] and succeeded == [(7, True)] and status[7] == KVPoll.Success
    w._transfer_step(w.shards[0])  # the chunk: its worker waits for the copy and finds the room taken
    assert w.control.sent == []
    rest = w.shards[0].get_nowait()
    assert isinstance(rest, Conclude) and w.shards[0].empty()
    w.shards[0].put(rest)
    assert drain(w) == 1
    assert w.control.sent == [(SESSION, AUX, True), (SESSION, STATUS, True)] and succeeded == [(7, True)]
    assert w.control.frames == [("AuxData", "Status")]


def test_a_conclusion_the_worker_cannot_send_fails_the_room_with_the_reason():
    w, status, failed, succeeded = workers(Ran(), conclude_in_poll=True, aux_index=9)
    w.control.busy = {"AuxData"}

    def refused(session, msgs, block=True):
        raise RuntimeError("control message to 127.0.0.1:4001 not delivered: Resource temporarily unavailable")

    w.control.send_all = refused
    w.add(last_chunk())
    w.conclude_launched(7)
    drain(w)
    assert succeeded == [(7, True)] and failed and "not delivered" in failed[0][1] and status[7] == KVPoll.Failed


def test_an_error_in_the_polls_conclusion_never_reaches_sglangs_thread_and_its_worker_fails_the_room():
    w, status, failed, succeeded = workers(Ran(), conclude_in_poll=True, aux_index=9)

    def out_of_bounds(session, room, src, dst):
        raise ValueError("aux index 9 is outside the decode's 4 aux rows")

    w._aux_message = out_of_bounds
    w.add(last_chunk())
    w.conclude_launched(7)  # raises nothing into SGLang's poll
    assert w.control.sent == [] and succeeded == [] and failed == []
    assert drain(w) == 2  # the chunk (the room taken), then its failure, from the worker
    assert succeeded == [] and len(failed) == 1 and "outside the decode's 4 aux rows" in failed[0][1]


def test_with_the_knob_off_or_a_chunk_left_to_its_worker_the_poll_does_nothing():
    for kw in ({"conclude_in_poll": False}, {"conclude_in_poll": True, "launch_in_add": False}):
        w, status, failed, succeeded = workers(Ran(), **kw)
        w.add(last_chunk())
        assert w._finishing == {}
        w.conclude_launched(7)
        assert succeeded == []
        drain(w)
        assert succeeded == [7]


def test_a_cleared_sender_forgets_its_room_and_a_next_attempt_of_the_room_is_not_confused_with_it():
    w, status, failed, succeeded = workers(Ran(), conclude_in_poll=True)
    w.add(task(is_last=False))
    w.add(last_chunk())
    w.conclude_launched(7)  # the first chunk's worker has not run: not concluded
    w.forget(7)  # SGLang cleared the sender (an abort)
    assert w._finishing == {} and w._latest == {}
    status[7] = KVPoll.WaitingForInput  # the room's next attempt, while the old one's worker has not run yet
    second = last_chunk()
    w.add(second)
    assert second.previous is None and w._finishing[7] is second
    drain(w)  # the old attempt's two chunks and the new one's: each worker concludes its own, once
    assert succeeded == [7, 7] and w._finishing[7] is second
    w.conclude_launched(7)
    assert w._finishing == {} and succeeded == [7, 7]


def test_the_poll_and_the_worker_racing_for_one_room_conclude_it_exactly_once():
    for _ in range(200):
        w, status, failed, succeeded = workers(Ran(), conclude_in_poll=True, aux_index=9)
        w.add(last_chunk())
        worker = threading.Thread(target=drain, args=(w,))
        worker.start()
        w.conclude_launched(7)
        worker.join(5)
        assert len(succeeded) == 1 and [m[0] for _, m, _ in w.control.sent] == ["AuxData", "Status"]


def test_the_knob_reads_from_the_environment(monkeypatch):
    assert_on_off_switch(monkeypatch, "SGLANG_P2P_CONCLUDE_IN_POLL", "conclude_in_poll")


def test_the_prefills_status_sender_in_the_poll_sends_what_goes_now_and_returns_the_rest_for_a_worker():
    """`PrefillKVManager._succeed(now=True)`: Success marked first, each decode rank's Status sent only if it goes
    at once; the returned sender sends the others (blocking, as a worker may)."""
    from types import SimpleNamespace

    from sglang_p2p_backend.adapter.prefill import PrefillKVManager
    from sglang_p2p_backend.adapter.transfer_workers import TransferInfo

    def info(session):
        return TransferInfo(session, 7, np.arange(2, dtype=np.int32), -1, [], 2, 0, False)

    sent, marked = [], []
    control = SimpleNamespace(send_now=lambda s, *msgs: s != "d:2" and not sent.append((s, msgs[-1].status, "now")))
    m = SimpleNamespace(transfer_infos={7: {"d:1": info("d:1"), "d:2": info("d:2")}}, decode_peers={"d:1": 0, "d:2": 0},
                        control=control, session="p:1", prefill_rank=0, kv_digest=None,
                        _control_send_all=lambda s, msgs, block=True: sent.append((s, msgs[-1].status, "worker")),
                        update_status=lambda room, status: marked.append((room, status, len(sent))))
    m._status_sender = lambda *a, **kw: PrefillKVManager._status_sender(m, *a, **kw)
    rest = PrefillKVManager._succeed(m, 7, now=True)
    assert marked == [(7, KVPoll.Success, 0)]  # marked before any Status went
    assert sent == [("d:1", int(KVPoll.Success), "now")] and rest is not None
    rest()
    assert sent[-1] == ("d:2", int(KVPoll.Success), "worker")
    sent.clear()
    assert PrefillKVManager._succeed(m, 7) is None  # a worker's own conclusion: every Status sent, nothing left
    assert sent == [("d:1", int(KVPoll.Success), "worker"), ("d:2", int(KVPoll.Success), "worker")]


@pytest.mark.parametrize("by_poll", [True, False], ids=["poll", "worker"])
def test_either_concluder_puts_the_launched_copys_device_time_on_the_room_line(by_poll):
    """A timed launch (SGLANG_P2P_ROOM_TIMES) gives its copy's device time; whoever concludes the room puts it on the
    line (`gpu_copy`), so the line says how long after the copy's end it was seen. An untimed launch adds nothing,
    and a launch whose reading fails costs the conclusion nothing."""
    for gpu_ms, expect in [(lambda: 0.375, ", gpu_copy 0.375"), (lambda: None, None), (lambda: 1 / 0, None)]:
        times, lines = timed()
        launch = Ran() if by_poll else FakeLaunch()
        launch.gpu_ms = gpu_ms
        w, _, _, succeeded = workers(launch, conclude_in_poll=True, aux_index=9, times=times)
        w.add(last_chunk())
        w.conclude_launched(7)
        drain(w)
        assert len(succeeded) == 1
        times.seen(7)
        assert ("gpu_copy" in lines[0]) == (expect is not None) and (expect is None or expect in lines[0]), lines
        assert lines[0].endswith(", by poll") == by_poll, lines
