"""A hostile neighbour for tests: raw frames pushed at a rank's control socket on 127.0.0.1.

Forged messages are built with the real message types (so they decode), mutated ones are valid frames with
bytes flipped, cut or grown, from a seeded generator (reproducible). Every send is bounded in count and time.
A `Stranger` goes further: it listens at the address it claims, so it reads what a rank answers it and can
confirm a registration and keep heartbeating, as an attacker that owns addresses can.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Iterable, Optional

import msgspec
import numpy as np
import zmq

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.auth import AUTH_MAGIC
from sglang_p2p_backend.engine.wire.packing import PACK_MAGIC, pack, unpack
from sglang_p2p_backend.engine.wire.pair_secret import open_frames, seal


def push(endpoint: str, messages: Iterable[list[bytes]], pause_s: float = 0.0) -> int:
    """Send every frame list to `endpoint` ("ip:port") from one PUSH socket; returns how many were sent."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    sock.connect(f"tcp://{endpoint}")
    n = 0
    try:
        for frames in messages:
            sock.send_multipart(frames)
            n += 1
            if pause_s:
                time.sleep(pause_s)
    finally:
        sock.close()
    return n


def phantom(i: int) -> str:
    """A session nobody listens on (a port in the discard range of 127.0.0.1 that no test binds)."""
    return f"127.0.0.{2 + i // 60000}:{1024 + i % 60000}"


def forged_metadata(count: int, room: int = 1) -> list[list[bytes]]:
    """RoomMetadata from `count` sessions that never registered (to a prefill rank)."""
    ids = np.arange(4, dtype=np.int32).tobytes()
    return [
        wire.encode(wire.RoomMetadata(phantom(i), 1, room + i, ids, 1, [], 1, 0, False))
        for i in range(count)
    ]


def forged_offers(count: int) -> list[list[bytes]]:
    """CommOffers from `count` phantom prefill ranks (to a decode rank): each asks for channel budget."""
    return [wire.encode(wire.CommOffer(phantom(i), i + 1, 16)) for i in range(count)]


def forged_chunks(count: int, room: int = 1) -> list[list[bytes]]:
    """ChunkHeaders from `count` phantom prefill ranks (to a decode rank): each would start a receiver."""
    seg = wire.ChunkSegment(0, 0, 1, np.arange(4, dtype=np.int32).tobytes())
    return [wire.encode(wire.ChunkHeader(phantom(i), 1, room, 0, 0, 64, [seg])) for i in range(count)]


def mutated(frames: list[list[bytes]], count: int, seed: int = 0) -> list[list[bytes]]:
    """`count` mutations of the given valid frame lists: flipped bytes, cut or grown payloads, garbage
    msgpack, wrong frame counts, huge array headers; and packed into one frame (a registered pair's form,
    packing.py) with bytes flipped, a list header claiming 2^32-1 frame lists, or an inner one 2^32-1 frames."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        magic, body = rng.choice(frames)
        kind = i % 8
        if kind == 0:
            b = bytearray(body)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            out.append([magic, bytes(b)])
        elif kind == 1:
            out.append([magic, body[: rng.randrange(len(body))]])
        elif kind == 2:
            out.append([magic, body + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))])
        elif kind == 3:
            out.append([magic, bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))])
        elif kind == 4:
            out.append([magic, body, body][: rng.choice((1, 3))])
        elif kind == 5:  # an array header claiming 2^32-1 elements
            out.append([magic, b"\xdd\xff\xff\xff\xff" + body[:8]])
        elif kind == 6:
            b = bytearray(pack([[magic, body], [magic, body]][: rng.choice((1, 2))])[0])
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(PACK_MAGIC), len(b))] = rng.randrange(256)
            out.append([bytes(b)])
        else:
            out.append([PACK_MAGIC + rng.choice((b"", b"\x91")) + b"\xdd\xff\xff\xff\xff" + magic])
    return out


def encode_raw(obj: object) -> list[bytes]:
    """Our magic around any msgpack value (a message of a type the receiver does not know, say)."""
    return [wire.MAGIC, msgspec.msgpack.encode(obj)]


class Stranger:
    """A sender that really listens at the session it claims (127.0.0.1, a free port): it reads the answers a
    rank sends it (opened as a peer would, without checking any tag) and sends from one PUSH socket to one rank.
    `beat()` keeps heartbeating with the secret the rank issued it, from a thread, until `close()`."""

    def __init__(self, target: str):
        ctx = zmq.Context.instance()
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.session = f"127.0.0.1:{port}"
        self.out = ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 1000)
        self.out.setsockopt(zmq.SNDTIMEO, 2000)
        self.out.connect(f"tcp://{target}")
        self.secret: Optional[bytes] = None  # the one the rank issued this stranger, once it answered
        self.answer_frames: list[bytes] = []
        self._stop = threading.Event()
        self._beats: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def send(self, frames: list[bytes]) -> None:
        with self._lock:
            self.out.send_multipart(seal(frames, self.secret))

    def send_together(self, frame_lists: list[list[bytes]]) -> None:
        """Several frame lists in one packed frame, each with this stranger's secret, as a registered rank sends a
        room's aux row and Status (packing.py)."""
        with self._lock:
            self.out.send_multipart(pack([seal(frames, self.secret) for frames in frame_lists]))

    def answer(self, timeout_s: float = 10.0) -> tuple[Optional[bytes], wire.PeerAnswer]:
        """(the secret the answer carried for us, the answer); keeps the rank's secret for later sends."""
        if not self.inbox.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer at {self.session}")
        self.answer_frames = self.inbox.recv_multipart()  # as they came (a registration's answer is never packed)
        (frames,) = unpack(self.answer_frames)
        ours, inner = open_frames(frames[3:] if frames[0] == AUTH_MAGIC else frames)
        msg = wire.decode(inner)
        assert isinstance(msg, wire.PeerAnswer), msg
        self.secret = msg.secret or None
        return ours, msg

    def received(self, timeout_s: float = 0.5) -> list:
        """Every message of ours waiting in the inbox (heartbeats, statuses...), opened as `answer` does."""
        out = []
        while self.inbox.poll(int(timeout_s * 1000)):
            for frames in unpack(self.inbox.recv_multipart()):  # a registered pair's frame lists come packed
                out.append(wire.decode(open_frames(frames[3:] if frames[0] == AUTH_MAGIC else frames)[1]))
        return out

    def beat(self, interval_s: float = 0.5) -> None:
        """Confirm the registration and keep it alive, as a decode does."""
        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.send(wire.encode(wire.Heartbeat(self.session, 1)))

        self.send(wire.encode(wire.Heartbeat(self.session, 1)))
        self._beats = threading.Thread(target=loop, daemon=True)
        self._beats.start()

    def close(self) -> None:
        self._stop.set()
        if self._beats is not None:
            self._beats.join(5)
        self.inbox.close()
        self.out.close()
