"""A decode room's failure waits while a scatter of its chunks is queued on the GPU (SGLANG_P2P_DEVICE_SCATTER,
adapter/scatter_gate.py): the counts themselves, then through the decode's KV manager and SGLang's receiver
(abort, waiting timeout, a prefill's failed Status), so SGLang never sees Failed, and never hands the pages on,
while such a scatter may still write them."""

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_p2p_backend.adapter.conn import P2pNcclKVReceiver
from sglang_p2p_backend.adapter.scatter_gate import ScatterGate
from sglang_p2p_backend.engine.wire import checks
from support.decode_manager import bare_decode_manager
from support.clock import Clock

ROOM = 7


def test_a_failure_waits_for_the_last_queued_scatter_of_its_room_only():
    gate = ScatterGate(30.0)
    gate.queued(ROOM)
    gate.queued(ROOM)
    gate.queued(ROOM + 1)
    assert not gate.defer(ROOM + 2)  # nothing queued: fail it now
    assert gate.defer(ROOM) and gate.waiting(ROOM) and not gate.waiting(ROOM + 1)
    assert not gate.ended(ROOM) and gate.pending(ROOM)  # one still queued
    assert gate.ended(ROOM) and not gate.waiting(ROOM) and not gate.pending(ROOM)  # the last: apply it now
    assert not gate.ended(ROOM + 1)  # its room's failure did not wait: nothing to apply
    assert not gate.pending(ROOM + 1)


def test_a_waiting_failure_applies_at_its_bound_and_drops_the_rooms_counts():
    clock = Clock()
    gate = ScatterGate(5.0, clock)
    gate.queued(ROOM)
    gate.defer(ROOM)
    clock.now += 3
    gate.defer(ROOM)  # a second failure keeps the first one's bound
    assert gate.expired() == []
    clock.now += 2
    assert gate.expired() == [ROOM] and not gate.pending(ROOM) and not gate.waiting(ROOM)
    assert not gate.ended(ROOM)  # a late end of a room let go applies nothing


class _Copier:
    item_lens = [[8]]


def manager():
    """A decode rank that receives two-sided (a tcp channel stands for NCCL): no one-sided hold of its own."""
    mgr = bare_decode_manager(
        two_sided=SimpleNamespace(name="tcp"), staging=SimpleNamespace(slot_bytes=1 << 10), copier=_Copier(),
        session="10.0.0.9:7000", broken=None, _control_send=lambda session, msg, block=True: True)
    mgr.enable_deferred_decode_kv_release = False  # SGLang frees a failed room's pages at once (0.5.17's way)
    mgr.live_rooms[ROOM] = checks.Published(np.arange(4, dtype=np.int32), 0, [], frozenset())
    mgr.request_status[ROOM] = KVPoll.WaitingForInput
    return mgr


def receiver(mgr):
    r = P2pNcclKVReceiver.__new__(P2pNcclKVReceiver)
    r.kv_mgr, r.bootstrap_room, r.conclude_state = mgr, ROOM, None
    r.init_time = time.time() - 10_000  # SGLang's waiting timeout long passed
    r._owns_bootstrap_room = r.abort_notified = True  # SGLang's notification to the prefill ranks: not here
    r.ensure_abort_notified = lambda **kw: None  # 0.5.23's abort tells the prefill ranks through SGLang's sockets
    return r


def test_a_failure_of_a_room_with_a_queued_scatter_shows_only_once_the_scatter_ended():
    mgr = manager()
    assert mgr._scatter_queued(ROOM)
    mgr.room_failed(ROOM, "prefill said the room failed")
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput  # SGLang may not take the pages back yet
    assert not mgr.room_wanted(ROOM) and not mgr._scatter_queued(ROOM)  # no later chunk of it is queued
    mgr.room_failed(ROOM, "a second reason")
    mgr.update_status(ROOM, KVPoll.Success)  # its chunks all landed: a failing room never turns Success
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput
    mgr._scatter_ended(ROOM)
    assert mgr.request_status[ROOM] == KVPoll.Failed
    assert mgr.failure_records[ROOM] == "prefill said the room failed"


def test_a_room_that_failed_first_is_never_counted_and_fails_at_once():
    mgr = manager()
    mgr.room_failed(ROOM, "failed before its chunk was readied")
    assert mgr.request_status[ROOM] == KVPoll.Failed
    assert not mgr._scatter_queued(ROOM) and not mgr.scatters_pending(ROOM)


def test_sglangs_abort_and_waiting_timeout_wait_for_the_queued_scatter(caplog):
    mgr = manager()
    r = receiver(mgr)
    mgr.waiting_timeout = 1
    assert mgr._scatter_queued(ROOM)
    r.abort()
    assert r.conclude_state is None and r.poll() == KVPoll.WaitingForInput  # SGLang keeps the pages
    assert r._check_waiting_timeout() is None  # its timeout waits too
    assert mgr.failure_records[ROOM] == "Aborted by AbortReq."
    mgr._scatter_ended(ROOM)
    assert r.poll() == KVPoll.Failed and r.conclude_state == KVPoll.Failed


def test_an_abort_with_nothing_queued_is_sglangs_own_and_no_scatter_is_counted_after_it():
    mgr = manager()
    r = receiver(mgr)
    # the look at its counts and the room forgotten are one step under the gate's lock: a receiver readying a
    # chunk of it now finds it unwanted, so nothing of it is queued once SGLang may take its pages back
    assert not mgr.hold_abort(ROOM, "Aborted by AbortReq.") and ROOM not in mgr.live_rooms
    assert not mgr._scatter_queued(ROOM)
    r.abort()
    assert r.conclude_state == KVPoll.Failed and mgr.request_status[ROOM] == KVPoll.Failed


def test_a_scatter_never_seen_to_end_fails_its_room_at_the_bound_logged(caplog):
    mgr = manager()
    clock = Clock()
    mgr.scatter_gate = ScatterGate(5.0, clock)
    assert mgr._scatter_queued(ROOM)
    mgr.room_failed(ROOM, "channel broke")
    mgr._sweep()
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput
    clock.now += 5
    with caplog.at_level(logging.ERROR):
        mgr._sweep()
    assert mgr.request_status[ROOM] == KVPoll.Failed
    assert "was not seen to end" in caplog.text


@pytest.mark.parametrize("deferred", [True, False])
def test_with_sglangs_deferred_release_an_abort_is_sglangs_own(deferred):
    """With deferred release SGLang holds an aborted room's pages until every prefill rank ACKed, and an ACK counts
    only after the receivers drained (test_deferred_release.py): the abort need not wait here."""
    mgr = manager()
    mgr.enable_deferred_decode_kv_release = deferred
    r = receiver(mgr)
    assert mgr._scatter_queued(ROOM)
    r.abort()
    assert (r.conclude_state == KVPoll.Failed) is deferred
