"""Fakes around `TransferWorkers` for tests that drive `add`, SGLang's poll and the worker's step themselves, on one
thread: a same-host path whose launch answers as told, DeferredRelease's counting, a control channel that records
what is sent (and can refuse a send that would wait), and one room (7) with one decode rank."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_p2p_backend.adapter.transfer_workers import TransferInfo, TransferTask, TransferWorkers
from sglang_p2p_backend.engine.copy.launches import Launch

SESSION = "127.0.0.1:4001"


class FakeLaunch(Launch):
    def __init__(self, error: Exception | None = None):
        self.error, self.waits = error, 0

    def done(self) -> bool:
        return self.waits > 0

    def wait(self) -> None:
        self.waits += 1
        if self.error is not None:
            raise self.error


class FakeSameHost:
    """`launch` answers as told (a Launch, None for a refusal, or an exception); `send` records the worker's copy."""

    def __init__(self, answer):
        self.answer, self.launched, self.sent, self.is_mapped = answer, [], [], True
        self.alone: list[bool] = []  # each copy's `alone`, launched or sent

    def mapped(self, peer):
        return self.is_mapped

    def launch(self, peer, src, dst, unsettled, alone=False):
        self.launched.append((peer.session, src.tolist(), dst.tolist()))
        self.alone.append(alone)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def send(self, peer, src, dst, heads, unsettled, state=(), alone=False):
        self.sent.append((peer.session, [s.tolist() for s in src], [d.tolist() for d in dst]))
        self.alone.append(alone)
        return True

    def last_write(self):
        return None


class Counts:
    """DeferredRelease's counting, as the tests need it: begin/end per room, what ran at zero."""

    def __init__(self):
        self.in_flight, self.drained = {}, []

    def begin(self, room):
        self.in_flight[room] = self.in_flight.get(room, 0) + 1

    def end(self, room):
        self.in_flight[room] -= 1
        if not self.in_flight[room]:
            self.drained.append(room)

    def poison(self, room):
        raise AssertionError("nothing here fails unsettled")


class FakeControl:
    """The control channel: each message sent, in order, as (session, what, blocking), and in `frames` each call's
    messages together (what one frame carries); `busy`: the kinds whose `send_now` finds the socket busy or full
    (nothing of that call sent)."""

    def __init__(self):
        self.sent: list = []
        self.frames: list = []
        self.busy: set = set()

    def send(self, session, msg, block=True):
        self.send_all(session, (msg,), block)

    def send_all(self, session, msgs, block=True):
        self.frames.append(tuple(m[0] for m in msgs))
        self.sent.extend((session, msg, True) for msg in msgs)

    def send_now(self, session, *msgs) -> bool:
        if any(msg[0] in self.busy for msg in msgs):
            return False
        self.frames.append(tuple(m[0] for m in msgs))
        self.sent.extend((session, msg, False) for msg in msgs)
        return True


def workers(answer, *, route="cudaipc", heads=None, launch_in_add=True, alone=lambda room: False,
            conclude_in_poll=False, aux_index=-1, times=None):
    """Room 7 to one decode rank (`aux_index`: its aux row's index there, -1: none). `succeeded` lists each
    conclusion as (room, now), which marks the room Success and sends its Status (behind the aux row it is given) as
    the prefill's `_succeed` does: `now` only if it goes at once, else returned for a worker to send."""
    status = {7: KVPoll.WaitingForInput}
    info = TransferInfo(session=SESSION, room=7, dst_kv_indices=np.arange(100, 110, dtype=np.int32),
                        dst_aux_index=aux_index, dst_state_indices=[], required_dst_info_num=1, decode_prefix_len=0,
                        is_dummy=False)
    failed, succeeded = [], []
    control = FakeControl()

    def succeed(room, now=False, first=None):
        succeeded.append((room, now) if now else room)
        status[room] = KVPoll.Success
        msgs = ((first[SESSION],) if first else ()) + (("Status", room),)
        if not now:
            control.send_all(SESSION, msgs)
        elif not control.send_now(SESSION, *msgs):
            return lambda: control.send_all(SESSION, msgs)
        return None

    w = TransferWorkers(
        count=1, spawn=lambda step, name: None, request_status=status, destinations={7: {SESSION: info}},
        peers={SESSION: SimpleNamespace(session=SESSION)}, rejected={}, departed={}, heads={SESSION: heads},
        state={}, route=lambda s: route, channels=None, same_host=FakeSameHost(answer), released=lambda: None,
        one_sided=None, release=Counts(), control=control, session="p", prefill_rank=0, local=SimpleNamespace(state=[]),
        fail_room=lambda room, why: (failed.append((room, why)), status.__setitem__(room, KVPoll.Failed)),
        succeed=succeed, times=times, launch_in_add=launch_in_add, alone=alone, conclude_in_poll=conclude_in_poll)
    w._aux_message = lambda session, room, src, dst: ("AuxData", room, src, dst)  # the rows' bytes are not the point
    return w, status, failed, succeeded


def task(is_last=True, **kw) -> TransferTask:
    return TransferTask(7, np.arange(3, 6, dtype=np.int32), slice(2, 5), is_last, None, None, **kw)


def step(w: TransferWorkers) -> TransferTask:
    """The worker's turn: the task `add` queued, processed on this thread."""
    queued = w.shards[0].get_nowait()
    w.shards[0].put(queued)
    w._transfer_step(w.shards[0])
    return queued


def drain(w: TransferWorkers) -> int:
    """The worker's turns until its queue is empty, in order: how many items it took."""
    taken = 0
    while not w.shards[0].empty():
        w._transfer_step(w.shards[0])
        taken += 1
    return taken
