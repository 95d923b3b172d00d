"""A prefill rank this decode rank is registered with, but which does not serve a room, cannot affect that room:
its AuxData and chunk headers for it are dropped (counted, logged), never fail it, never count for it. A prefill
rank that serves the room must send exactly the aux rows registered, each of its buffer's row size: a shorter
or missing row would leave bytes of the slot's previous request behind, so the room fails naming both values.

Driven through the decode's inbound path (`_on_message`) and its own `_init_role` wiring, with a real pair
receiver for the two-sided case; no sockets, no transport (the receiver has no channel)."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from sglang.srt.disaggregation.base.conn import KVPoll
from support.decode_manager import bare_decode_manager

from sglang_p2p_backend.adapter.decode import PrefillPeer, published_room
from sglang_p2p_backend.engine.pair.liveness import PeerWatch
from sglang_p2p_backend.engine.wire import messages as wire

pytestmark = pytest.mark.sglang

ROOM, AUX_ROW = 23, 2
SERVER, STRANGER = "10.0.0.1:5000", "10.0.0.2:5000"  # rank 0 of the room's prefill server; rank 0 of another one
AUX_LENS = [8, 16]


class _Copier:
    item_lens = [[4, 4]]


@pytest.fixture
def decode():
    """A decode rank registered with both prefill ranks, the room published to SERVER only."""
    sent: list = []
    aux = [np.full(n * 4, 0xEE, dtype=np.uint8) for n in AUX_LENS]  # 4 rows each, the last request's bytes
    mgr = bare_decode_manager(
        two_sided=SimpleNamespace(name="tcp"), staging=SimpleNamespace(slot_bytes=1 << 10), copier=_Copier(),
        session="10.0.0.9:7000", watch=PeerWatch(timeout_s=30), broken=None,
        _control_send=lambda session, msg, block=True: sent.append((session, msg)), aux=aux,
        kv_args=SimpleNamespace(aux_data_ptrs=[a.ctypes.data for a in aux], aux_item_lens=AUX_LENS))
    for peer in (SERVER, STRANGER):
        mgr.prefills[peer] = PrefillPeer("accepted", time.monotonic(), prefill_rank=0)
    mgr.request_status[ROOM] = KVPoll.WaitingForInput
    mgr.publish(ROOM, published_room(np.arange(10, 20, dtype=np.int32), AUX_ROW, [], [SERVER]))
    mgr.sent = sent
    yield mgr
    mgr.channels.close()


def aux_row(mgr, i: int) -> bytes:
    n = AUX_LENS[i]
    return mgr.aux[i][AUX_ROW * n : (AUX_ROW + 1) * n].tobytes()


def chunk(session: str, seq: int = 0) -> wire.ChunkHeader:
    ids = np.array([10, 11], dtype=np.int32)
    return wire.ChunkHeader(session, 1, ROOM, 0, seq, ids.size * 8, [wire.ChunkSegment(0, 0, 2, ids.tobytes())])


def handled(mgr, session: str) -> None:
    """Wait until the receiver of `session` handled every chunk queued so far."""
    done = threading.Event()
    assert mgr.channels.after_queued([session], done.set)
    assert done.wait(5)


def test_aux_data_of_a_stranger_neither_fails_the_room_nor_lands(decode):
    decode._on_message(wire.AuxData(STRANGER, ROOM, AUX_ROW, [b"\x07" * 8, b"\x07" * 16]))
    assert decode.request_status[ROOM] == KVPoll.WaitingForInput and ROOM not in decode.failure_records
    assert aux_row(decode, 0) == b"\xee" * 8 and decode.sent == []
    assert decode.dropped["not-owner"] == 1
    decode._on_message(wire.AuxData(SERVER, ROOM, AUX_ROW, [b"\x01" * 8, b"\x02" * 16]))  # the room's own
    assert aux_row(decode, 0) == b"\x01" * 8 and aux_row(decode, 1) == b"\x02" * 16


def test_a_strangers_chunk_neither_counts_for_the_room_nor_fails_it(decode):
    verdicts, check = [], decode.channels.check
    decode.channels.check = lambda header: verdicts.append((header.session, check(header))) or verdicts[-1][1]
    scatter_may_end = threading.Event()
    decode.channels._receiver(SERVER).submit(lambda: scatter_may_end.wait(5))  # its receiver busy: chunk in flight
    decode._on_message(chunk(SERVER))  # the room's rank 0
    # rank 0 of another server: its receiver takes it in step (its bytes would follow), has no channel, reports it
    decode._on_message(chunk(STRANGER))
    handled(decode, STRANGER)
    assert decode.request_status[ROOM] == KVPoll.WaitingForInput and ROOM not in decode.failure_records
    assert decode.dropped["not-owner"] == 1
    assert decode.arrivals.peers(ROOM, 0) == [SERVER]  # only the room's own rank announced a chunk of it
    [(session, refused)] = verdicts
    assert session == STRANGER and refused.chunk is None and "does not serve this room" in refused.problem
    scatter_may_end.set()


@pytest.mark.parametrize("rows, named", [
    ([b"\x01" * 8], "1 aux rows for 2 aux buffers"),
    ([b"\x01" * 8, b"\x02" * 15], "aux row 1 of 15 bytes falls short of the buffer's 16-byte rows"),
    ([b"\x01" * 8, b"\x02" * 17], "aux row 1 of 17 bytes exceeds the buffer's 16-byte rows"),
])
def test_aux_rows_other_than_registered_fail_the_room_naming_both(decode, rows, named):
    decode._on_message(wire.AuxData(SERVER, ROOM, AUX_ROW, rows))
    assert decode.request_status[ROOM] == KVPoll.Failed
    assert named in decode.failure_records[ROOM], decode.failure_records
    assert aux_row(decode, 0) == b"\xee" * 8 and aux_row(decode, 1) == b"\xee" * 16  # nothing of it landed
    assert [type(m) for s, m in decode.sent] == [wire.RoomFailed] and decode.sent[0][0] == SERVER
