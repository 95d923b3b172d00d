"""The receiving control socket drops frames larger than the largest legitimate control message (ZMQ_MAXMSGSIZE
from engine/wire/control.py's `max_frame_bytes`) before they are read: a RoomMetadata within msgspec's static
bounds (16 MiB of page ids a list) but above what the rank's pools allow never reaches the handler, while the
largest page lists those pools allow do, and the sender's later messages still arrive. The socket is bound
before the limit is set, as SGLang binds the manager's PULL socket before p2pnccl sees it."""

import threading

import zmq

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.control import ID_BYTES, ControlChannel, limit_inbound, max_frame_bytes
from support.squatter import SquattedPull

KV_PAGES, STATE_SLOTS, AUX_ROW_BYTES = 100_000, [512, 100_000], 4096
DECODE = "127.0.0.1:9"


class Receiver:
    """A bound PULL socket and a thread handing each decoded message to `handled`, as the manager's control
    thread does."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")  # bound first, as SGLang does
        self.handled, self.arrived, self.stop = [], threading.Condition(), threading.Event()

    def start(self):
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.is_set():
            if self.sock.poll(50, zmq.POLLIN):
                msg = wire.decode(self.sock.recv_multipart())
                with self.arrived:
                    self.handled.append(msg)
                    self.arrived.notify_all()

    def wait_for(self, room, timeout=10.0):
        with self.arrived:
            self.arrived.wait_for(lambda: any(m.room == room for m in self.handled), timeout)
        return [m for m in self.handled if m.room == room]

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def ids(n):
    return bytes(ID_BYTES * n)


def metadata(room, kv_ids, state_ids=()):
    return wire.RoomMetadata(DECODE, 1, room, ids(kv_ids), 0, [ids(n) for n in state_ids], 1, 0, False)


def test_a_frame_above_the_pools_bound_never_reaches_the_handler_and_the_largest_real_one_does():
    limit = max_frame_bytes(KV_PAGES, STATE_SLOTS, AUX_ROW_BYTES)
    largest = metadata(1, KV_PAGES, [KV_PAGES, KV_PAGES])  # every list as long as the largest pool
    oversize = metadata(2, (1 << 24) // ID_BYTES)  # 16 MiB of ids: msgspec's static bound, not these pools'
    assert len(wire.encode(largest)[1]) <= limit < len(wire.encode(oversize)[1])
    assert wire.decode(wire.encode(oversize)).room == 2  # static bounds alone would let it be read and used

    receiver = Receiver()
    limit_inbound(receiver.sock, limit)
    receiver.start()
    channel = ControlChannel()
    try:
        endpoint = f"127.0.0.1:{receiver.port}"
        channel.send(endpoint, largest)
        assert len(receiver.wait_for(1)) == 1
        channel.send(endpoint, oversize)
        channel.send(endpoint, metadata(3, 16))  # the sender reconnects: what follows still arrives
        assert len(receiver.wait_for(3)) == 1
        assert receiver.wait_for(2, timeout=0.5) == []
        assert [m.room for m in receiver.handled] == [1, 3]
    finally:
        channel.close()
        receiver.close()


def test_the_bound_follows_the_pools():
    base = max_frame_bytes(0)
    # twice the ids of one list per group, int32 each
    assert max_frame_bytes(1000) - base == 2 * 4 * 1000
    assert max_frame_bytes(1000, [10, 5000]) - base == 2 * 4 * 3 * 5000
    assert max_frame_bytes(1000, aux_row_bytes=777) - base == 2 * 4 * 1000 + 777


def test_a_port_taken_while_the_listener_is_bound_again_moves_it_to_a_free_one_with_the_limit():
    """limit_inbound unbinds and binds again; another process may take the port in between. The socket then
    listens on a free port of the same interface, says which, and the frame limit holds there too."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL, socket_class=SquattedPull)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    pushes = [ctx.socket(zmq.PUSH) for _ in range(2)]
    try:
        bound = limit_inbound(sock, 1000, wait_s=0.2)
        assert bound.startswith("tcp://127.0.0.1:") and bound != f"tcp://127.0.0.1:{port}"
        assert sock.getsockopt(zmq.LAST_ENDPOINT).decode() == bound
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 1000
        for push in pushes:
            push.setsockopt(zmq.LINGER, 0)
            push.connect(bound)
        pushes[0].send(b"x" * 1001)
        assert not sock.poll(500)  # the oversized frame never arrives
        pushes[1].send(b"x" * 1000)
        assert sock.poll(3000) and sock.recv() == b"x" * 1000  # one at the limit does, at the new port
    finally:
        for push in pushes:
            push.close()
        sock.close()
        SquattedPull.squatter.close()


def test_a_socket_not_bound_yet_takes_the_limit_for_its_bind_to_come():
    sock = zmq.Context.instance().socket(zmq.PULL)
    try:
        assert limit_inbound(sock, 1234) is None
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 1234
    finally:
        sock.close()
