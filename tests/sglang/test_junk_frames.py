"""Frames a rank drops unparsed (not SGLang's, not ours) cost only their count: the drop's log line, rate-limited,
shows the frame count, their lengths and the first 64 bytes, and is formatted only when it is logged. A repr of a
64 MiB frame, made for every dropped one, held the control thread (and the GIL) for over a second."""

import logging
from collections import Counter

import pytest

from sglang_p2p_backend.adapter.decode import DecodeKVManager
from sglang_p2p_backend.adapter.prefill import PrefillKVManager

pytestmark = pytest.mark.sglang

SIZE = 4 << 20


class Junk(bytes):
    """A peer's junk frame that records what a drop reads of it; a repr of all of it fails the test."""

    read: list = []

    def __repr__(self):
        raise AssertionError(f"repr of a whole {len(self)}-byte frame")

    def __getitem__(self, key):
        Junk.read.append(key)
        return super().__getitem__(key)


def manager(cls):
    mgr = cls.__new__(cls)
    mgr.dropped = Counter()
    return mgr


@pytest.mark.parametrize("cls", [DecodeKVManager, PrefillKVManager])
def test_a_dropped_junk_frame_is_logged_by_its_size_and_first_bytes(cls, caplog):
    mgr, frame = manager(cls), Junk(b"J" * 100 + b"\0" * (SIZE - 100))
    with caplog.at_level(logging.WARNING):
        mgr._on_sglang_frames([frame, b"xy"], "10.0.0.1:5000")
    assert mgr.dropped["unexpected"] == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert f"2 frames of [{SIZE}, 2] bytes, the first starting {b'J' * 64!r}" in line and len(line) < 400, line


@pytest.mark.parametrize("cls", [DecodeKVManager, PrefillKVManager])
def test_a_junk_frame_past_the_log_limit_is_not_formatted(cls, caplog):
    mgr, frame = manager(cls), Junk(b"\0" * SIZE)
    mgr.dropped["unexpected"] = 20  # the first 20 are logged one by one, then every 1,000th
    Junk.read.clear()
    with caplog.at_level(logging.WARNING):
        mgr._on_sglang_frames([frame], "10.0.0.1:5000")
    assert mgr.dropped["unexpected"] == 21 and not caplog.records and Junk.read == []


@pytest.mark.parametrize("cls", [DecodeKVManager, PrefillKVManager])
def test_the_control_socket_drops_frames_past_what_the_ranks_pools_allow_at_the_same_endpoint(cls):
    """Both roles cap SGLang's control socket (bound by SGLang before p2pnccl sees it) at the largest frame their
    pools allow, bound again at the endpoint SGLang announced, once."""
    import types

    import zmq

    from sglang_p2p_backend.engine.wire.control import max_frame_bytes

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        mgr = manager(cls)
        mgr.server_socket, mgr.rank_port = sock, port  # as SGLang's CommonKVManager leaves them
        mgr.kv_args = types.SimpleNamespace(kv_data_ptrs=[1 << 20, 2 << 20], kv_data_lens=[64 * 1000, 64 * 900],
                                            kv_item_lens=[64, 64], state_data_ptrs=[[3 << 20]],
                                            state_data_lens=[[8 * 10]], state_item_lens=[[8]], aux_item_lens=[16, 32])
        mgr._limit_inbound()
        limit = max_frame_bytes(1000, [10], 48)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == limit
        assert sock.getsockopt(zmq.LAST_ENDPOINT).decode() == f"tcp://127.0.0.1:{port}" and mgr.rank_port == port
        mgr.kv_args.kv_data_lens = [64 * 5000, 64 * 900]
        mgr._limit_inbound()  # once: the endpoint is announced by then
        assert sock.getsockopt(zmq.MAXMSGSIZE) == limit
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"x" * (limit + 1))
        push.send(b"ok")
        assert sock.poll(3000) and sock.recv() == b"ok"  # the oversized frame never arrived
        push.close()
    finally:
        sock.close()


@pytest.mark.parametrize("cls", [DecodeKVManager, PrefillKVManager])
def test_a_port_taken_while_the_control_socket_is_bound_again_is_replaced_by_the_one_announced(cls, caplog,
                                                                                             monkeypatch):
    """Between the unbind and the bind of `_limit_inbound` another process may take the port SGLang chose. The rank
    then listens on a free port, and `rank_port`, which SGLang announces to the bootstrap server and to prefills
    (and p2pnccl makes its session of), names that one; the log says so. Before, the rank failed to start."""
    import functools
    import types

    import zmq

    from sglang_p2p_backend.adapter import manager as manager_module
    from sglang_p2p_backend.engine.wire import control
    from support.squatter import SquattedPull

    # the squatter holds the port for good: give up on it after 0.2 s instead of 5
    monkeypatch.setattr(manager_module, "limit_inbound", functools.partial(control.limit_inbound, wait_s=0.2))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL, socket_class=SquattedPull)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        mgr = manager(cls)
        mgr.server_socket, mgr.rank_port = sock, port
        mgr.kv_args = types.SimpleNamespace(kv_data_ptrs=[1 << 20], kv_data_lens=[64 * 1000], kv_item_lens=[64],
                                            aux_item_lens=[16])
        with caplog.at_level(logging.WARNING):
            mgr._limit_inbound()
        assert mgr.rank_port != port
        assert sock.getsockopt(zmq.LAST_ENDPOINT).decode() == f"tcp://127.0.0.1:{mgr.rank_port}"
        assert any(f"port {port} was taken" in r.getMessage() and f"port {mgr.rank_port} instead" in r.getMessage()
                   for r in caplog.records)
        push.connect(f"tcp://127.0.0.1:{mgr.rank_port}")
        push.send(b"ok")
        assert sock.poll(3000) and sock.recv() == b"ok"
    finally:
        push.close()
        sock.close()
        SquattedPull.squatter.close()
