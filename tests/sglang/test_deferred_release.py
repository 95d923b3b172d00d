"""Decode side of deferred decode KV release (SGLang 0.5.23+) with a two-sided channel, in one process.

With nccl/tcp the decode's own receiver thread scatters a prefill's chunks into the pages, so a prefill's
ABORT_ACK ("nothing of the room in flight here") counts only once that receiver thread finished every chunk
it was given before the ACK. The pair runs (test_pd_transfer.py) cannot stall a scatter on purpose; here a
callable queued on a real `PairReceiver` stands for a scatter still running.
"""

import threading
import time
from collections import Counter

import pytest

pytestmark = pytest.mark.sglang

common = pytest.importorskip("sglang.srt.disaggregation.common.conn")
if not hasattr(common, "AbortAck"):
    pytest.skip("this SGLang release has no deferred decode KV release (added in 0.5.23)", allow_module_level=True)

from sglang_p2p_backend.adapter.decode import DecodeKVManager, PrefillPeer  # noqa: E402
from sglang_p2p_backend.engine.config import EngineConfig  # noqa: E402
from sglang_p2p_backend.engine.pair.arrivals import ArrivalTracker  # noqa: E402
from sglang_p2p_backend.engine.pair.channels import PairReceivers  # noqa: E402
from sglang_p2p_backend.engine.pair.pipeline import PairReceiver  # noqa: E402

PEER = "10.0.0.1:5000"
ROOM, RANK = 7, 0


class _Copier:
    item_lens = [[8]]


def decode_manager():
    """Just the decode state `_on_sglang_frames` and SGLang's deferred-ACK helpers use."""
    mgr = DecodeKVManager.__new__(DecodeKVManager)
    mgr.enable_deferred_decode_kv_release = True
    mgr._deferred_abort_ack_tracker = {}
    mgr._deferred_abort_generation = 0
    mgr.two_sided = object()
    mgr.arrivals = ArrivalTracker(lambda *a: None)
    mgr.channels = PairReceivers(transport=None, staging=None, copier=_Copier(), session="decode", config=EngineConfig(),
                                 send=lambda *a: True, wanted=lambda room: False, on_chunk=lambda *a: None,
                                 check=lambda header: None)
    mgr.dropped = Counter()
    mgr.prefills = {PEER: PrefillPeer("accepted", 0.0, prefill_rank=RANK)}  # an ACK counts only from the rank it
    mgr._room_servers = {ROOM: frozenset({PEER})}  # names, for a room that rank was sent (test_abort_ack_sender.py)
    return mgr


@pytest.fixture
def receiver():
    r = PairReceiver(transport=None, staging=None, copier=_Copier(), peer_session=PEER, wanted=lambda room: False,
                     on_chunk=lambda *a: None, connect_timeout=1, io_timeout=1)
    yield r
    r.close()


def ack(room: int, generation: int) -> list:
    return common.AbortAck(room, RANK, generation).to_zmq()


def wait_for(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_ack_counts_only_after_the_receiver_finished_the_chunks_before_it(receiver):
    mgr = decode_manager()
    mgr.channels.receivers[PEER] = receiver
    generation = mgr.register_deferred_abort_room(ROOM)
    mgr.arrivals.announce(ROOM, RANK, PEER)  # a chunk of the room was announced and is being scattered
    scatter_may_end = threading.Event()
    receiver.submit(lambda: scatter_may_end.wait(5))
    mgr._on_sglang_frames(ack(ROOM, generation), PEER)
    time.sleep(0.2)
    assert not mgr.is_abort_release_safe(ROOM, 1), "ACK counted while a scatter of the room was still running"
    scatter_may_end.set()
    assert wait_for(lambda: mgr.is_abort_release_safe(ROOM, 1))


def test_ack_counts_at_once_without_chunks_in_flight_and_stale_generations_do_not(receiver):
    mgr = decode_manager()
    mgr.channels.receivers[PEER] = receiver
    receiver.submit(lambda: time.sleep(1))  # another room's chunk: must not delay this room's ACK
    old = mgr.register_deferred_abort_room(ROOM)
    generation = mgr.register_deferred_abort_room(ROOM)  # the room was aborted again (reused)
    mgr._on_sglang_frames(ack(ROOM, generation), None)  # without a prefill's pair secret: dropped
    assert not mgr.is_abort_release_safe(ROOM, 1) and mgr.dropped["unexpected"] == 1
    mgr._on_sglang_frames(ack(ROOM, old), PEER)
    assert not mgr.is_abort_release_safe(ROOM, 1)
    mgr._on_sglang_frames(ack(ROOM, generation), PEER)
    assert mgr.is_abort_release_safe(ROOM, 1)
