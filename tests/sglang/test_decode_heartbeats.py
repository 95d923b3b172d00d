"""A decode rank sends heartbeats only to prefill ranks that answered its registration. The answer carries the
pair secret every later frame must hold; a heartbeat sent before it reaches the prefill without the secret and is
dropped there as a stranger's (seen when both servers start within milliseconds of each other)."""

import time

import pytest

pytestmark = pytest.mark.sglang

pytest.importorskip("sglang.srt.disaggregation.common.conn")

from sglang_p2p_backend.adapter.decode import DecodeKVManager, PrefillPeer  # noqa: E402
from sglang_p2p_backend.engine.pair.liveness import PeerWatch  # noqa: E402


def test_heartbeats_wait_for_the_prefills_answer():
    mgr = DecodeKVManager.__new__(DecodeKVManager)  # just the state heartbeat_peers reads
    mgr.watch = PeerWatch(timeout_s=5)
    mgr.prefills = {}
    for endpoint, state in [("10.0.0.1:5000", "pending"), ("10.0.0.2:5000", "accepted")]:
        mgr.watch.watch(endpoint)
        mgr.prefills[endpoint] = PrefillPeer(state, time.monotonic())
    assert mgr.heartbeat_peers() == ["10.0.0.2:5000"]
    mgr.prefills["10.0.0.1:5000"].state = "accepted"  # its answer arrived
    assert sorted(mgr.heartbeat_peers()) == ["10.0.0.1:5000", "10.0.0.2:5000"]
