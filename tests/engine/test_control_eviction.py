"""A control socket closed because the channel holds `max_sockets` (least recently used first) still delivers what
was queued on it: a Status sent to one decode just before a message to another evicts its socket would otherwise be
dropped with it (ZMQ discards a closed socket's unsent messages at linger 0), and that room would wait on the
decode until its timeout. A rank opens sockets only to peers it serves or registers with, so this takes more than
SGLANG_P2P_MAX_PEERS of them. (The next
message to that peer goes on a new connection, so across an eviction it may overtake the evicted socket's: a
Status names the room's chunk count, and the decode holds a Success until that many landed,
tests/sglang/test_status_chunk_count.py.)"""

import zmq

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.control import ControlChannel


def _pull() -> tuple[zmq.Socket, str]:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"127.0.0.1:{port}"


def test_a_message_queued_on_an_evicted_socket_still_arrives():
    first, first_at = _pull()
    second, second_at = _pull()
    channel = ControlChannel(max_sockets=1)
    try:
        statuses = [wire.Status("prefill:1", room, 0, 2) for room in range(20)]
        for status in statuses:  # each send to the other endpoint evicts the socket of the one before
            channel.send(first_at, status)
            channel.send(second_at, status)
        assert channel.open_endpoints() == 1
        for sock in (first, second):
            got = []
            while len(got) < len(statuses) and sock.poll(5000):
                got.append(wire.decode(sock.recv_multipart()).room)
            assert sorted(got) == list(range(20))  # every one, none twice
    finally:
        channel.close()
        first.close()
        second.close()
