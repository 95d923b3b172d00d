"""A decode's own failure of a room held while a prefill may still write it one-sided (adapter/failure_hold.py):
the waits themselves, how a lost prefill is told gone from frozen, and both through SGLang's classes."""

import socket

import pytest
from test_pd_transfer import IPC_ENV, assert_clean, failed_reason

from sglang_p2p_backend.adapter.failure_hold import FailureHolds, process_gone
from sglang_p2p_backend.testing.launch import PairRun
from support.clock import Clock

ROOM = 7


def test_a_hold_ends_with_the_last_answer_or_the_last_writer_gone():
    holds = FailureHolds(30.0)
    assert holds.begin(ROOM, {"a", "b"}) and holds.begin(ROOM + 1, {"b"})
    assert not holds.begin(ROOM, {"c"})  # held already: its waits stay
    assert not holds.answered(ROOM, ["a", "c"]) and holds.held(ROOM)
    assert holds.gone("b") == [ROOM, ROOM + 1]
    assert not holds.held(ROOM) and not holds.answered(ROOM, ["b"])  # ended once, not again


def test_a_hold_ends_at_its_bound_for_that_room_only():
    clock = Clock()
    holds = FailureHolds(5.0, clock)
    holds.begin(ROOM, {"a"})
    clock.now += 3
    holds.begin(ROOM + 1, {"a"})
    assert holds.expired() == []
    clock.now += 2
    assert holds.expired([ROOM + 1]) == [] and holds.expired([ROOM]) == [ROOM]
    clock.now += 3
    assert holds.expired() == [ROOM + 1] and not holds.held(ROOM + 1)


def test_a_process_is_gone_only_when_its_port_refuses_connections():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()  # never accepts: a frozen process's kernel still completes connections
    endpoint = "127.0.0.1:%d" % listening.getsockname()[1]
    assert not process_gone(endpoint)
    listening.close()
    assert process_gone(endpoint)


POOL = {"layout": "mha", "num_layers": 2, "page_size": 4, "num_pages": 400}
HOLD_S = 5.0
# the backend's hold without SGLang's deferred release (0.5.17 has none): a lost prefill seen by liveness in 2 s
ENV = {**IPC_ENV, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "0", "SGLANG_P2P_FAILURE_HOLD_S": str(HOLD_S),
       "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "60"}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["stop_after_chunks", "exit_after_chunks"])
def test_a_lost_prefill_fails_its_rooms_at_once_only_when_its_process_is_gone(fault):
    # the prefill goes silent after its first chunk of room 7301: SIGSTOPped it may resume a write into the
    # room's pages, so the decode holds the failure to SGLANG_P2P_FAILURE_HOLD_S; exited, its port refuses
    # connections and its mapping is gone with it, so the room fails when liveness declares it dead
    plan = {"pool": POOL, "requests": [{"room": 7301, "tokens": 4 * 40, "chunk_pages": 4}], "deadline_s": 40,
            "faults": {"prefill": {"chunk_delay_s": 0.3, fault: 1}}}
    run = PairRun(plan, env=ENV)
    result = run.wait(60, roles=("decode",))
    d = result["decode"]
    r = d["requests"]["7301"]
    assert "stopped answering" in failed_reason(d, 7301), r
    seconds = r["ended_at"] - r["metadata_at_wall"]
    peer_timeout = float(ENV["SGLANG_P2P_PEER_TIMEOUT"])
    if fault == "stop_after_chunks":
        assert seconds >= peer_timeout + HOLD_S - 0.5, r
    else:
        assert seconds < peer_timeout + 2.5, r
    assert d["untouched_violations"] == []
    assert_clean(d)
