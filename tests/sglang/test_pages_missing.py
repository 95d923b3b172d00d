"""A decode rank that receives only two-sided turns a room Success only once every page it published arrived
(`DecodeKVManager._pages_missing`): the usual case (one prefill rank's chunks in published order) is one
comparison, anything else a set difference, and a page that never came fails the room with the count."""

import types

import numpy as np
import pytest

from sglang_p2p_backend.adapter.decode import DecodeKVManager
from sglang_p2p_backend.engine.wire import checks

pytestmark = pytest.mark.sglang

ROOM = 12


def missing(received: list, kv=range(100, 110), prefills=("p:1",), two_sided_only=True):
    pub = checks.Published(np.array(list(kv), dtype=np.int32), 0, [], frozenset(prefills))
    pub.received.extend(np.array(r, dtype=np.int32) for r in received)
    mgr = types.SimpleNamespace(live_rooms={ROOM: pub}, two_sided_only=two_sided_only)
    return DecodeKVManager._pages_missing(mgr, ROOM)


@pytest.mark.parametrize("received", [
    [range(100, 104), range(104, 110)],                            # in published order
    [range(104, 110), range(100, 104)],                            # chunks in another order
    [range(100, 110), range(100, 110)],                            # two prefill ranks, each every page
    [[109, 100, 101, 102, 103, 104, 105, 106, 107, 108]],          # one chunk, shuffled
])
def test_every_published_page_arrived(received):
    assert missing(received) is None


@pytest.mark.parametrize("received, absent", [
    ([range(100, 104), range(105, 110)], 1),
    ([range(100, 109)], 1),
    ([], 10),
    ([range(100, 105), range(100, 105)], 5),  # two ranks, the same half twice
])
def test_a_page_that_never_arrived_fails_the_room_with_the_count(received, absent):
    assert missing(received) == (f"prefill reported Success for room {ROOM}, but {absent} of its 10 published "
                                 f"pages never arrived")


def test_only_a_rank_that_receives_two_sided_only_counts_pages():
    assert missing([], two_sided_only=False) is None  # one-sided writers are not seen arriving here
