"""Deferred decode KV release (SGLang 0.5.23+) counts an ABORT_ACK only from the prefill rank it names, and only
for a room that rank was sent: SGLang hands an aborted room's pages on once it holds one ACK per prefill rank, so
one rank ACKing for another (or a rank of another prefill server ACKing for a room it never saw) would free pages
into which the silent rank's one-sided write may still land.

The room goes through the real receiver (`P2pNcclKVReceiver`: send_metadata, SGLang's abort, which forgets the
room before it arms the hold and sends ABORT, then clear) and the decode's inbound path for SGLang's frames; only
sockets are left out."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from sglang.srt.disaggregation.base.conn import KVPoll

pytestmark = pytest.mark.sglang

common = pytest.importorskip("sglang.srt.disaggregation.common.conn")
if not hasattr(common, "AbortAck"):
    pytest.skip("this SGLang release has no deferred decode KV release (added in 0.5.23)", allow_module_level=True)

from sglang_p2p_backend.adapter.conn import P2pNcclKVReceiver  # noqa: E402
from sglang_p2p_backend.adapter.decode import DecodeKVManager, PrefillPeer  # noqa: E402
from support.decode_manager import bare_decode_manager  # noqa: E402

ROOM = 41
P0, P1 = ("10.0.0.1", 5000), ("10.0.0.1", 5001)  # the room's prefill server: ranks 0 and 1
Q0 = ("10.0.0.2", 5000)  # rank 0 of another prefill server this decode rank is registered with


def session(rank_ip_port) -> str:
    return "%s:%d" % rank_ip_port


def decode_manager(sent: list) -> DecodeKVManager:
    """A decode manager through its own `_init_role` (no transports, no threads), registered with P0, P1 and Q0."""
    mgr = bare_decode_manager(
        enable_deferred_decode_kv_release=True, addr_to_rooms_tracker={"prefill:8998": set()},
        _deferred_abort_ack_tracker={}, _deferred_abort_generation=0,
        session="10.0.0.9:7000", incarnation=1, local_ip="10.0.0.9", rank_port=7000,
        control=SimpleNamespace(send_frames=lambda endpoint, frames, block=True: sent.append((endpoint, frames))))
    for rank, peer in [(0, P0), (1, P1), (0, Q0)]:
        mgr.prefills[session(peer)] = PrefillPeer("accepted", time.monotonic(), prefill_rank=rank)
    return mgr


def receiver(mgr: DecodeKVManager) -> P2pNcclKVReceiver:
    """The room's receiver after bootstrap: SGLang's Common state for it, its two prefill ranks."""
    r = P2pNcclKVReceiver.__new__(P2pNcclKVReceiver)
    r.kv_mgr, r.bootstrap_room, r.bootstrap_addr = mgr, ROOM, "prefill:8998"
    r.bootstrap_infos = [{"rank_ip": ip, "rank_port": port, "is_dummy": False} for ip, port in (P0, P1)]
    r.required_dst_info_num, r.init_time, r.conclude_state = 1, None, None
    r._owns_bootstrap_room, r.abort_notified, r._abort_generation = True, False, None
    r._lifecycle_lock = threading.RLock()
    mgr.addr_to_rooms_tracker[r.bootstrap_addr].add(ROOM)
    mgr.prefill_response_tracker[ROOM] = set()
    mgr.request_status[ROOM] = KVPoll.Bootstrapping
    return r


def ack(prefill_rank: int, generation: int) -> list:
    return common.AbortAck(ROOM, prefill_rank, generation).to_zmq()


def aborted_room():
    sent: list = []
    mgr = decode_manager(sent)
    r = receiver(mgr)
    r.send_metadata(np.arange(8, dtype=np.int32), aux_index=3)
    r.abort()  # SGLang's AbortReq: the room is forgotten, then the hold armed and ABORT sent to both ranks
    aborts = [endpoint for endpoint, frames in sent if frames[0] == b"ABORT"]
    assert aborts == [session(P0), session(P1)], sent
    return mgr, r, r._abort_generation


def test_an_ack_counts_only_for_its_senders_own_rank_of_a_room_it_was_sent():
    mgr, r, generation = aborted_room()
    required = len(r.bootstrap_infos)
    mgr._on_sglang_frames(ack(0, generation), session(P1))  # rank 1 ACKs for rank 0, whose write may still run
    mgr._on_sglang_frames(ack(1, generation), session(P1))  # its own: counts
    mgr._on_sglang_frames(ack(0, generation), session(Q0))  # rank 0 of a server that never had the room
    assert not mgr.is_abort_release_safe(ROOM, required), "pages released before prefill rank 0 drained"
    assert mgr._deferred_abort_ack_tracker[ROOM].prefill_ranks == {1}
    assert mgr.dropped["impersonation"] == 1 and mgr.dropped["not-owner"] == 1, mgr.dropped
    mgr._on_sglang_frames(ack(0, generation), session(P0))  # the real rank 0
    assert mgr.is_abort_release_safe(ROOM, required)


def test_who_may_ack_a_room_is_forgotten_when_sglang_releases_it():
    mgr, r, generation = aborted_room()
    mgr._on_sglang_frames(ack(0, generation), session(P0))
    mgr._on_sglang_frames(ack(1, generation), session(P1))
    assert mgr.is_abort_release_safe(ROOM, 2)
    mgr.clear_deferred_abort_state(ROOM)  # SGLang's _do_release, then the receiver's clear
    r.clear()
    generation = mgr.register_deferred_abort_room(ROOM)  # the id armed again, by a room P0 was never sent
    mgr._on_sglang_frames(ack(0, generation), session(P0))
    assert not mgr.is_abort_release_safe(ROOM, 1) and mgr.dropped["not-owner"] == 1
    assert ROOM not in mgr._room_servers and ROOM not in mgr.request_status  # nothing of the room left behind


def test_a_room_failed_on_the_decode_counts_its_acks_after_sglang_read_the_failure():
    """A transfer failure SGLang did not start by aborting: its decode reads the failure first (failure_exception,
    which clears the receiver), then arms the hold and sends ABORT (ensure_abort_notified(force_arm=True)); the
    ACKs come after the clear and must still count, or the pages wait for SGLang's release timeout."""
    sent: list = []
    mgr = decode_manager(sent)
    r = receiver(mgr)
    r.send_metadata(np.arange(8, dtype=np.int32), aux_index=3)
    mgr.room_failed(ROOM, "the decode's own check failed the room")
    with pytest.raises(Exception, match="own check failed"):
        r.failure_exception()  # SGLang's pop_transferred reads the reason; the receiver is cleared
    assert ROOM not in mgr.request_status
    r.ensure_abort_notified(force_arm=True)
    generation = r._abort_generation
    mgr._on_sglang_frames(ack(0, generation), session(P0))
    mgr._on_sglang_frames(ack(1, generation), session(P1))
    assert mgr.is_abort_release_safe(ROOM, 2) and not mgr.dropped, mgr.dropped
    mgr.clear_deferred_abort_state(ROOM)
    assert ROOM not in mgr._room_servers


def test_a_room_that_succeeded_leaves_no_ack_senders_behind():
    sent: list = []
    mgr = decode_manager(sent)
    r = receiver(mgr)
    r.send_metadata(np.arange(8, dtype=np.int32), aux_index=3)
    assert mgr._room_servers[ROOM] == {session(P0), session(P1)}
    mgr.request_status[ROOM] = KVPoll.Success
    r.conclude_state = KVPoll.Success
    r.clear()
    assert ROOM not in mgr._room_servers
