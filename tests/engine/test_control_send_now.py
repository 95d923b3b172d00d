"""`ControlChannel.send_now`, the send SGLang's scheduler thread may make (a room concluded in its poll): it goes at
once or not at all. It never waits for another thread's send on the same socket, nor for room in a queue a peer
stopped reading; what it did not send was not sent (and, with a key, spent no counter the peer would miss)."""

import threading

import zmq

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.auth import Authenticator
from sglang_p2p_backend.engine.wire.control import ControlChannel
from sglang_p2p_backend.engine.wire.pair_secret import open_frames


def _pull() -> tuple[zmq.Socket, str]:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"127.0.0.1:{port}"


def _status(room: int) -> wire.Status:
    return wire.Status("prefill:1", room, 0, 4)


def test_it_sends_at_once_and_steps_aside_while_another_thread_sends_on_the_socket():
    sock, at = _pull()
    key = b"k" * 32
    channel = ControlChannel(auth=Authenticator(key, "prefill:1", 1))
    opened = Authenticator(key, "decode:1", 2)
    try:
        assert channel.send_now(at, _status(1))
        entry = channel._endpoint(at)
        holder_in, release = threading.Event(), threading.Event()

        def hold() -> None:  # another thread in the middle of a (blocking) send to that peer
            with entry.lock:
                holder_in.set()
                release.wait(5)

        holder = threading.Thread(target=hold)
        holder.start()
        assert holder_in.wait(5)
        assert not channel.send_now(at, _status(2))  # returns at once: the lock is not waited for
        release.set()
        holder.join(5)
        assert channel.send_now(at, _status(3))
        got = []
        while len(got) < 2 and sock.poll(5000):
            got.append(wire.decode(open_frames(opened.open(sock.recv_multipart())[1])[1]).room)
        assert got == [1, 3]  # the refused one never went; the counters still rise, so the peer takes the next
        assert not sock.poll(100)
    finally:
        channel.close()
        sock.close()


def test_a_queue_nobody_reads_refuses_it_instead_of_waiting_for_the_send_timeout():
    sock, at = _pull()  # bound, so the connection stands, but never read
    channel = ControlChannel(send_timeout_s=30.0)
    try:
        channel._endpoint(at).sock.setsockopt(zmq.SNDHWM, 4)
        sent = 0
        for room in range(200_000):  # the peer's receive buffer, then this socket's queue, fill up
            if not channel.send_now(at, wire.AuxData("prefill:1", room, 0, [b"x" * 4096])):
                break
            sent += 1
        else:
            raise AssertionError("200,000 rows of 4 KiB went to a peer that reads nothing")
        assert sent > 0
    finally:
        channel.close()
        sock.close()
