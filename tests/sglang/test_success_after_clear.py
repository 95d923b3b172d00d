"""A prefill rank's Success that races SGLang's clear() of the room: the decode applies it on its control or
receiver thread (`_apply_prefill_final`), checking the room's status first, while clear() on the scheduler thread
pops the status and then SGLang's set of ranks that reported Success. A Success applied after both is dropped:
never a KeyError on the receiver thread (0.5.23's dict: the pair channel would be dropped, failing whatever room
it carried), never the set made again (0.5.17's defaultdict: a leak, and a reused room id would start with a rank
counted). Both SGLang trackers are run under whichever release is installed; the clear is the real receiver's.

The interleaving is forced: the room's status table runs the receiver's clear() right after the status was read."""

import threading
from collections import defaultdict

import numpy as np
import pytest

from sglang.srt.disaggregation.base.conn import KVPoll
from support.decode_manager import bare_decode_manager

from sglang_p2p_backend.adapter.conn import P2pNcclKVReceiver
from sglang_p2p_backend.adapter.decode import published_room

pytestmark = pytest.mark.sglang

ROOM, PREFILL = 57, "10.0.0.1:5000"


class Interleaved(dict):
    """The status table: reading ROOM's status runs `step` right after (once)."""

    step = None

    def get(self, key, *default):
        value = super().get(key, *default)
        if key == ROOM and self.step is not None:
            step, self.step = self.step, None
            step()
        return value


def room(tracker: str):
    """A decode rank with ROOM published to one prefill rank, and the room's receiver; `tracker`: which SGLang
    release's table of ranks that reported Success (0.5.17 creates a room's set on first use, 0.5.23 with its
    receiver)."""
    mgr = bare_decode_manager(
        request_status=Interleaved(), required_prefill_response_num_table={ROOM: 1},
        prefill_response_tracker=defaultdict(set) if tracker == "0.5.17" else {ROOM: set()},
        addr_to_rooms_tracker=defaultdict(set, {"prefill:8998": {ROOM}}))
    mgr.request_status[ROOM] = KVPoll.WaitingForInput
    mgr.publish(ROOM, published_room(np.arange(4, dtype=np.int32), 1, [], [PREFILL]))
    r = P2pNcclKVReceiver.__new__(P2pNcclKVReceiver)
    r.kv_mgr, r.bootstrap_room, r.bootstrap_addr = mgr, ROOM, "prefill:8998"
    r.conclude_state, r._owns_bootstrap_room, r.abort_notified = None, True, False
    r._lifecycle_lock = threading.RLock()
    return mgr, r


@pytest.mark.parametrize("tracker", ["0.5.17", "0.5.23"])
def test_a_success_after_the_room_was_cleared_is_dropped(tracker):
    mgr, receiver = room(tracker)
    mgr.request_status.step = receiver.clear  # the scheduler clears the room right after the status was read
    mgr.arrivals.final(ROOM, 0, True, "")  # the prefill's Success, on the thread that reads the control channel
    assert ROOM not in mgr.prefill_response_tracker, "the cleared room's Success set was made again"
    assert ROOM not in mgr.request_status


@pytest.mark.parametrize("tracker", ["0.5.17", "0.5.23"])
def test_a_success_before_the_clear_still_counts(tracker):
    mgr, receiver = room(tracker)
    mgr.arrivals.final(ROOM, 0, True, "")
    assert mgr.request_status[ROOM] == KVPoll.Success and mgr.prefill_response_tracker[ROOM] == {0}
    receiver.clear()
    assert ROOM not in mgr.prefill_response_tracker and ROOM not in mgr.request_status
