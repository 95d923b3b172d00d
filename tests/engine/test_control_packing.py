"""Frame lists packed into one ZMQ frame (engine/wire/packing.py): between ranks of a registered pair (a pair
secret set for the endpoint) a frame list goes as one frame and is opened back into the very list it was, key
envelope and all; a registration's answers and anything to a peer without a secret go as before, so ranks of
another protocol version read them; a packed frame that does not hold a bounded list of frames is refused."""

import msgspec
import pytest
import zmq

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.auth import AUTH_MAGIC, Authenticator
from sglang_p2p_backend.engine.wire.control import ControlChannel
from sglang_p2p_backend.engine.wire.packing import MAX_FRAMES, PACK_MAGIC, pack, unpack
from sglang_p2p_backend.engine.wire.pair_secret import PAIR_MAGIC, open_frames

SECRET = b"s" * 16


def _pull() -> tuple[zmq.Socket, str]:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, f"127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(5000), "nothing arrived"
    return sock.recv_multipart()


def test_a_packed_list_opens_into_the_same_frames_and_other_lists_pass_as_they_are():
    frames = [b"P2PA", b"", b"x" * 70_000, bytes(range(256))]
    (one,) = pack(frames)
    assert one.startswith(PACK_MAGIC) and unpack([one]) == frames
    assert unpack(frames) == frames  # several frames: not packed
    assert unpack([b"ABORT"]) == [b"ABORT"]  # one frame without the magic: as it is (SGLang's own, junk)


@pytest.mark.parametrize("body,why", [
    (b"", "packed frame list"),  # nothing after the magic
    (msgspec.msgpack.encode([]), "length >= 1"),
    (msgspec.msgpack.encode([b"x"] * (MAX_FRAMES + 1)), f"length <= {MAX_FRAMES}"),
    (msgspec.msgpack.encode(["text", b"x"]), "Expected `bytes`"),
    (b"\xdd\xff\xff\xff\xff\xc4\x01x", "packed frame list"),  # 2^32-1 frames claimed, one there
    (msgspec.msgpack.encode({"a": b"x"}), "Expected `array`"),
])
def test_a_packed_frame_that_is_not_a_bounded_list_of_frames_is_refused_naming_why(body, why):
    with pytest.raises(wire.WireError, match="packed frame list") as e:
        unpack([PACK_MAGIC + body])
    assert why in str(e.value)


def test_a_registered_peers_frame_lists_go_as_one_frame_with_the_key_envelope_inside():
    sock, at = _pull()
    key = b"k" * 32
    channel = ControlChannel(auth=Authenticator(key, "prefill:1", 1))
    opened = Authenticator(key, "decode:1", 2)
    status = wire.Status("prefill:1", 5, 0, 4)
    try:
        channel.send(at, status)  # no secret yet (a registration): as before, the envelope's frames
        plain = _recv(sock)
        assert plain[0] == AUTH_MAGIC and len(plain) == 5 and unpack(plain) == plain
        channel.set_secret(at, SECRET)
        channel.send(at, status)
        assert channel.send_now(at, status)
        channel.send_frames(at, [b"ABORT", b"x"])  # SGLang's own frames ride the same way
        got = []
        for _ in range(3):
            (one,) = _recv(sock)
            sender, frames = opened.open(unpack([one]))  # the tag covers what was packed: it opens
            secret, rest = open_frames(frames)
            assert sender == "prefill:1" and secret == SECRET
            got.append(rest)
        assert [wire.decode(f) for f in got[:2]] == [status, status]
        assert got[2] == [b"ABORT", b"x"]
    finally:
        channel.forget(at)
        sock.close()


def test_a_channel_made_not_to_pack_sends_every_list_as_its_frames():
    # the prefill's answers to registrations: a decode of another protocol version must read its refusal
    sock, at = _pull()
    channel = ControlChannel(pack=False)
    try:
        channel.set_secret(at, SECRET)
        channel.send(at, wire.Status("prefill:1", 5, 0, 4))
        frames = _recv(sock)
        assert frames[:2] == [PAIR_MAGIC, SECRET] and wire.decode(frames[2:]).room == 5
    finally:
        channel.forget(at)
        sock.close()
