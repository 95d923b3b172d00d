"""A prefill rank's Status names how many chunk headers of the room it sent each decode rank, and a decode rank
counts a Success only once that many were announced and landed. The control channel keeps order per socket, but a
socket closed for the peer cap still delivers its queue while the next message goes out on a new one, so a Status
can come before the room's last header; on a decode rank that also has one-sided peers no page check at Success
stands behind it (`_pages_missing` covers two-sided-only ranks).

The decode is driven through its inbound path (`_on_message`) and its own `_init_role` wiring, a one-sided path
present (so not two-sided only); chunks land as the receiver reports them (`arrivals.landed`). The prefill's
Status is built by its own `_status_sender` from the room's destinations."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from sglang.srt.disaggregation.base.conn import KVPoll
from support.decode_manager import bare_decode_manager

from sglang_p2p_backend.adapter.decode import PrefillPeer, published_room
from sglang_p2p_backend.adapter.prefill import PrefillKVManager
from sglang_p2p_backend.adapter.transfer_workers import TransferInfo
from sglang_p2p_backend.engine.pair.liveness import PeerWatch
from sglang_p2p_backend.engine.wire import messages as wire

pytestmark = pytest.mark.sglang

ROOM = 31
PREFILL, DECODE = "10.0.0.1:5000", "10.0.0.9:7000"


class _Copier:
    item_lens = [[4, 4]]


@pytest.fixture
def decode():
    """A decode rank with a two-sided and a one-sided path, registered with PREFILL, ROOM published to it."""
    mgr = bare_decode_manager(
        two_sided=SimpleNamespace(name="tcp"), one_sided=SimpleNamespace(name="mooncake"),
        staging=SimpleNamespace(slot_bytes=1 << 10), copier=_Copier(), session=DECODE,
        watch=PeerWatch(timeout_s=30), broken=None, _control_send=lambda session, msg, block=True: None,
        kv_args=SimpleNamespace(aux_data_ptrs=[], aux_item_lens=[]))
    mgr.prefills[PREFILL] = PrefillPeer("accepted", time.monotonic(), prefill_rank=0)
    mgr.request_status[ROOM], mgr.prefill_response_tracker[ROOM] = KVPoll.WaitingForInput, set()  # its receiver's
    mgr.publish(ROOM, published_room(np.arange(10, 20, dtype=np.int32), None, [], [PREFILL]))
    yield mgr
    mgr.channels.close()


def success(chunks: int) -> wire.Status:
    return wire.Status(PREFILL, ROOM, 0, int(KVPoll.Success), "", chunks)


def test_the_decode_is_not_two_sided_only_here(decode):
    assert decode.two_sided_only is False  # so no page check at Success would catch a missing chunk


def test_a_success_ahead_of_the_rooms_last_header_waits_for_it(decode):
    decode.arrivals.announce(ROOM, 0, PREFILL)  # header 0 (what _on_chunk does), and its bytes landed
    decode.arrivals.landed(ROOM, 0, None)
    decode._on_message(success(2))  # on the new socket, while header 1 is still queued on the evicted one
    assert decode.request_status[ROOM] == KVPoll.WaitingForInput
    decode.arrivals.announce(ROOM, 0, PREFILL)
    assert decode.request_status[ROOM] == KVPoll.WaitingForInput  # announced, not yet landed
    decode.arrivals.landed(ROOM, 0, None)
    assert decode.request_status[ROOM] == KVPoll.Success and decode.arrivals.pending() == 0


def test_a_success_naming_fewer_chunks_than_arrived_fails_the_room(decode):
    for _ in range(2):
        decode.arrivals.announce(ROOM, 0, PREFILL)
        decode.arrivals.landed(ROOM, 0, None)
    decode._on_message(success(1))
    assert decode.request_status[ROOM] == KVPoll.Failed
    assert "after 1 chunk(s), but 2 were announced" in decode.failure_records[ROOM]


def test_a_success_waiting_for_headers_fails_when_its_prefill_is_lost(decode):
    decode._on_message(success(1))
    assert decode.request_status[ROOM] == KVPoll.WaitingForInput
    decode.arrivals.peer_lost(PREFILL, f"prefill rank {PREFILL} stopped answering")
    assert decode.request_status[ROOM] == KVPoll.Failed and "stopped answering" in decode.failure_records[ROOM]


def test_a_one_sided_success_names_no_chunks_and_counts_at_once(decode):
    decode._on_message(success(0))
    assert decode.request_status[ROOM] == KVPoll.Success


def test_the_prefills_status_names_the_headers_each_decode_rank_was_sent():
    """Two decode ranks of one room: three chunk headers to the first (two-sided), none to the second (its
    chunks went one-sided), a dummy that is sent nothing."""
    sent = []
    mgr = PrefillKVManager.__new__(PrefillKVManager)
    mgr.session, mgr.prefill_rank = PREFILL, 0
    mgr._control_send_all = lambda session, msgs, block=True: sent.extend((session, msg) for msg in msgs)
    infos = {s: TransferInfo(s, ROOM, np.arange(4), 0, [], 2, 0, is_dummy=(s == "10.0.0.7:7000"))
             for s in (DECODE, "10.0.0.8:7000", "10.0.0.7:7000")}
    mgr.transfer_infos = {ROOM: infos}
    mgr.decode_peers = {DECODE: None, "10.0.0.8:7000": None, "10.0.0.7:7000": None}
    assert [infos[DECODE].next_seq() for _ in range(3)] == [0, 1, 2]  # the headers' seq, as the pipeline takes them
    mgr._status_sender(ROOM, KVPoll.Success)()
    assert [(s, m.status, m.chunks) for s, m in sent] == [(DECODE, int(KVPoll.Success), 3),
                                                           ("10.0.0.8:7000", int(KVPoll.Success), 0)]
