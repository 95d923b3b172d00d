"""Outbound control channel: one ZMQ PUSH socket per peer endpoint, sends serialised per endpoint.

Inbound traffic arrives on the PULL socket SGLang's manager already binds; this is the other direction.
Sends are bounded by SNDTIMEO, so a dead peer makes a send fail (ControlError) instead of blocking a worker;
heartbeats do not wait at all (`block=False`), and `send_now` (SGLang's scheduler thread) does not even wait for
another thread's send on the same socket. The number of open sockets is capped: the least recently used
one is closed when a new endpoint would exceed `max_sockets` (ZMQ's own limit is 1,023 sockets a context), so
no stream of peers can exhaust file descriptors. With an `Authenticator` every frame list is sealed with the
endpoint's next counter, under the endpoint's lock, so counters reach the peer in order. Every frame list to a
peer that issued this rank a pair secret carries it (pair_secret.py), inside the authenticated envelope, and
travels packed into one ZMQ frame (packing.py) unless the channel is made with `pack=False`; several messages sent
together (a room's aux row and Status) share that frame.

Inbound, `limit_inbound` caps the size of one frame the receiving socket reads (ZMQ_MAXMSGSIZE, at
`max_frame_bytes` of the rank's pools): ZMQ drops a larger frame and disconnects its sender before anything of it
reaches the control thread, where msgspec's static bounds (up to 1 GiB of page ids in one RoomMetadata) would
only refuse it after it was read into memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Optional, Sequence

import zmq

from sglang_p2p_backend.engine.wire import messages
from sglang_p2p_backend.engine.wire.auth import Authenticator
from sglang_p2p_backend.engine.wire.packing import pack
from sglang_p2p_backend.engine.wire.pair_secret import seal


class ControlError(RuntimeError):
    pass


#: page ids travel as int32 (messages.Ids)
ID_BYTES = 4
#: a frame's bytes besides page ids and aux rows, at most, with room to spare: sessions and reasons (4 KiB each),
#: a registration's pointer lists (64 x 4,096 pointers: 2.4 MB at their static bounds), its agreement and CUDA IPC
#: export (4,096 handles: 0.3 MB), msgpack's headers. A real registration is a few kB
FRAME_OVERHEAD_BYTES = 8 << 20


def max_frame_bytes(kv_pages: int, state_slots: Sequence[int] = (), aux_row_bytes: int = 0) -> int:
    """The largest frame a legitimate control message to a rank with these pools can be, twice over.

    Page-id lists are the only part of a control message that grows with the deployment: a RoomMetadata (to the
    prefill) carries the destination ids of one room, a ChunkHeader (to the decode) those of one chunk, which is
    part of one room, each group at most once. A room fits the pools of both its ranks, so each id list holds at
    most the receiver's largest pool (`kv_pages`, or a state component's `state_slots`) ids, and a message one
    list per group (KV, then each state component). AuxData carries one row per aux buffer (`aux_row_bytes`:
    their sum, the same on both sides, compared at registration). Everything else is `FRAME_OVERHEAD_BYTES`."""
    largest = max([int(kv_pages), *map(int, state_slots), 0])
    ids = (1 + len(state_slots)) * largest
    return FRAME_OVERHEAD_BYTES + max(0, int(aux_row_bytes)) + 2 * ID_BYTES * ids


def limit_inbound(sock: zmq.Socket, max_bytes: int, wait_s: float = 5.0) -> Optional[str]:
    """Make the receiving socket `sock` drop frames over `max_bytes` (ZMQ_MAXMSGSIZE; its sender is disconnected,
    and reconnects) and return the endpoint it listens on then (None: not bound yet, the option holds for the bind
    to come). libzmq copies a socket's options into the listener when it binds, so a socket already bound (SGLang's
    manager binds its PULL socket in its own constructor) is bound again: call this before the endpoint is
    announced, since connections accepted before are dropped with the old listener. Between the unbind and the
    bind the port is free, and any process on the host may take it (a connection's ephemeral port, another
    server's random one): where it is still taken after `wait_s`, a TCP socket binds a free port on the same
    interface instead, and the caller announces that one."""
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_bytes))
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    endpoint = endpoint.decode() if isinstance(endpoint, bytes) else endpoint
    if not endpoint:
        return None
    sock.unbind(endpoint)
    deadline = time.monotonic() + wait_s
    while True:  # the old listener closes on ZMQ's I/O thread: its port may stay taken for a moment
        try:
            sock.bind(endpoint)
            return endpoint
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            if time.monotonic() > deadline:
                if not endpoint.startswith("tcp://"):
                    raise
                host = endpoint.rpartition(":")[0]
                return f"{host}:{sock.bind_to_random_port(host)}"
            time.sleep(0.01)


#: how long ZMQ keeps delivering what was queued on a socket closed to stay within `max_sockets` (least recently used)
EVICTED_LINGER_MS = 2000


class _Endpoint:
    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.lock = threading.Lock()


class ControlChannel:
    def __init__(self, send_timeout_s: float = 5.0, max_sockets: int = 512, auth: Optional[Authenticator] = None,
                 linger_ms: int = 0, pack: bool = True):
        self._ctx = zmq.Context.instance()
        #: frame lists that carry a pair secret go as one frame (off: a registration's answers, which a rank of
        #: another protocol version must read to learn it was refused)
        self._pack = pack
        self._linger_ms = linger_ms
        self._send_timeout_ms = int(send_timeout_s * 1000)
        self._max_sockets = max_sockets
        self._auth = auth
        self._sockets: "OrderedDict[str, _Endpoint]" = OrderedDict()
        #: endpoint -> the pair secret that peer issued to this rank (carried by every frame list to it)
        self._secrets: "OrderedDict[str, bytes]" = OrderedDict()
        self._lock = threading.Lock()

    def set_secret(self, endpoint: str, secret: Optional[bytes]) -> None:
        """From now on frame lists to `endpoint` carry `secret` (None: nothing, before a peer answered)."""
        with self._lock:
            if secret:
                self._secrets[endpoint] = secret
                self._secrets.move_to_end(endpoint)
                while len(self._secrets) > 2 * self._max_sockets:
                    self._secrets.popitem(last=False)
            else:
                self._secrets.pop(endpoint, None)

    def _endpoint(self, endpoint: str) -> _Endpoint:
        evicted = []
        with self._lock:
            entry = self._sockets.get(endpoint)
            if entry is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, self._linger_ms)
                sock.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
                if endpoint.startswith("["):
                    sock.setsockopt(zmq.IPV6, 1)
                try:
                    sock.connect(f"tcp://{endpoint}")
                except zmq.ZMQError:
                    sock.close()
                    raise
                entry = self._sockets[endpoint] = _Endpoint(sock)
                while len(self._sockets) > self._max_sockets:
                    evicted.append(self._sockets.popitem(last=False)[1])
            self._sockets.move_to_end(endpoint)
        for old in evicted:
            with old.lock:
                # a peer still live, unlike forget()'s: what was just queued for it (a room's Status) is delivered in
                # the background for a moment, where linger 0 would drop it and leave that room to its timeout
                old.sock.close(linger=EVICTED_LINGER_MS)
        return entry

    def send(self, endpoint: str, msg: messages.Message, block: bool = True) -> None:
        self.send_all(endpoint, (msg,), block)

    def send_all(self, endpoint: str, msgs: Sequence[messages.Message], block: bool = True) -> None:
        """Send `msgs` in order, in one frame where the endpoint's lists are packed (a room's aux row and Status);
        raises ControlError when one was not handed to ZMQ."""
        self._send(endpoint, [messages.encode(m) for m in msgs], block, wait_turn=True)

    def send_frames(self, endpoint: str, frames: list[bytes], block: bool = True) -> None:
        """Send one frame list; raises ControlError (never a bare ZMQError) when it was not handed to ZMQ."""
        self._send(endpoint, [frames], block, wait_turn=True)

    def send_now(self, endpoint: str, msg: messages.Message, *more: messages.Message) -> bool:
        """Send `msg` (and `more`, all or none: one packed frame) only if it goes without any wait: neither for
        another thread's send on the socket nor for room in its queue (SGLang's scheduler thread, which must never
        wait on a peer). False: nothing was sent, and what comes after it must wait for a thread that may block
        (also for several messages to an endpoint whose lists are not packed, which would go one by one)."""
        try:
            return self._send(endpoint, [messages.encode(m) for m in (msg, *more)], block=False, wait_turn=False)
        except ControlError:
            return False

    def _send(self, endpoint: str, frame_lists: list[list[bytes]], block: bool, wait_turn: bool) -> bool:
        """False where `wait_turn` is off and another thread is sending to `endpoint`, or where several lists
        would go one by one without waiting (nothing sent)."""
        try:
            entry = self._endpoint(endpoint)
            with self._lock:
                secret = self._secrets.get(endpoint)
            packed = bool(secret) and self._pack
            if not packed and len(frame_lists) > 1 and not wait_turn:
                return False  # one by one, the second could find no room after the first went
            frame_lists = [seal(frames, secret) for frames in frame_lists]
            if not entry.lock.acquire(blocking=wait_turn):
                return False
            try:
                if entry.sock.closed:  # evicted meanwhile: the next send opens a new one
                    raise ControlError(f"control socket to {endpoint} was recycled")
                if self._auth is not None:  # each list its own counter, in the order sent
                    frame_lists = [self._auth.seal(frames) for frames in frame_lists]
                if packed:
                    frame_lists = [pack(frame_lists)]
                for frames in frame_lists:
                    entry.sock.send_multipart(frames, flags=0 if block else zmq.NOBLOCK)
            finally:
                entry.lock.release()
            return True
        except zmq.ZMQError as e:
            raise ControlError(f"control message to {endpoint} not delivered: {e}") from e

    def open_endpoints(self) -> int:
        with self._lock:
            return len(self._sockets)

    def forget(self, endpoint: str) -> None:
        with self._lock:
            entry = self._sockets.pop(endpoint, None)
            self._secrets.pop(endpoint, None)
        if entry is not None:
            with entry.lock:
                entry.sock.close()

    def close(self) -> None:
        with self._lock:
            entries, self._sockets = list(self._sockets.values()), OrderedDict()
        for entry in entries:
            with entry.lock:
                entry.sock.close()
