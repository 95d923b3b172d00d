"""Frame lists packed into one ZMQ frame (engine/wire/packing.py): between ranks of a registered pair (a pair
secret set for the endpoint) a frame list, or several sent together, go as one frame and are opened back into the
very lists they were, in order, key envelope and all; a registration's answers and anything to a peer without a
secret go as before, so ranks of another protocol version read them; a packed frame that does not hold a bounded
list of bounded lists of frames is refused."""

import msgspec
import pytest
import zmq

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.auth import AUTH_MAGIC, Authenticator
from sglang_p2p_backend.engine.wire.control import ControlChannel
from sglang_p2p_backend.engine.wire.packing import MAX_FRAMES, MAX_LISTS, PACK_MAGIC, pack, unpack
from sglang_p2p_backend.engine.wire.pair_secret import PAIR_MAGIC, open_frames

SECRET = b"s" * 16


def _pull() -> tuple[zmq.Socket, str]:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, f"127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(5000), "nothing arrived"
    return sock.recv_multipart()


def test_packed_lists_open_into_the_same_frames_in_order_and_other_lists_pass_as_they_are():
    frames = [b"P2PA", b"", b"x" * 70_000, bytes(range(256))]
    (one,) = pack([frames])
    assert one.startswith(PACK_MAGIC) and unpack([one]) == [frames]
    (two,) = pack([frames, [b"P2P1", b"status"]])
    assert unpack([two]) == [frames, [b"P2P1", b"status"]]
    assert unpack(frames) == [frames]  # several frames: not packed, the only list
    assert unpack([b"ABORT"]) == [[b"ABORT"]]  # one frame without the magic: as it is (SGLang's own, junk)
    for n in (0, MAX_LISTS + 1):
        with pytest.raises(ValueError, match=f"{n} frame lists"):
            pack([frames] * n)


@pytest.mark.parametrize("body,why", [
    (b"", "packed frame lists"),  # nothing after the magic
    (msgspec.msgpack.encode([]), "length >= 1"),
    (msgspec.msgpack.encode([[]]), "length >= 1"),  # an empty list inside
    (msgspec.msgpack.encode([[b"x"]] * (MAX_LISTS + 1)), f"length <= {MAX_LISTS}"),
    (msgspec.msgpack.encode([[b"x"] * (MAX_FRAMES + 1)]), f"length <= {MAX_FRAMES}"),
    (msgspec.msgpack.encode([["text", b"x"]]), "Expected `bytes`"),
    (msgspec.msgpack.encode([b"x", b"y"]), "Expected `array`"),  # protocol 9's one list of frames
    (b"\x91\xdd\xff\xff\xff\xff\xc4\x01x", "packed frame lists"),  # 2^32-1 frames claimed, one there
    (msgspec.msgpack.encode({"a": b"x"}), "Expected `array`"),
])
def test_a_packed_frame_that_is_not_a_bounded_list_of_frame_lists_is_refused_naming_why(body, why):
    with pytest.raises(wire.WireError, match="packed frame lists") as e:
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
        assert plain[0] == AUTH_MAGIC and len(plain) == 5 and unpack(plain) == [plain]
        channel.set_secret(at, SECRET)
        channel.send(at, status)
        assert channel.send_now(at, status)
        channel.send_frames(at, [b"ABORT", b"x"])  # SGLang's own frames ride the same way
        aux = wire.AuxData("prefill:1", 5, 3, [b"row"])
        assert channel.send_now(at, aux, status)  # a room's aux row and Status: one frame
        got = []
        for n in (1, 1, 1, 2):
            (one,) = _recv(sock)
            lists = unpack([one])
            assert len(lists) == n
            for frames in lists:
                sender, frames = opened.open(frames)  # each list its own tag and counter, in order: each opens
                secret, rest = open_frames(frames)
                assert sender == "prefill:1" and secret == SECRET
                got.append(rest)
        assert [wire.decode(f) for f in got[:2]] == [status, status]
        assert got[2] == [b"ABORT", b"x"]
        assert [wire.decode(f) for f in got[3:]] == [aux, status]
    finally:
        channel.forget(at)
        sock.close()


def test_a_channel_made_not_to_pack_sends_every_list_as_its_frames():
    # the prefill's answers to registrations: a decode of another protocol version must read its refusal
    sock, at = _pull()
    channel = ControlChannel(pack=False)
    try:
        channel.set_secret(at, SECRET)
        status = wire.Status("prefill:1", 5, 0, 4)
        channel.send(at, status)
        frames = _recv(sock)
        assert frames[:2] == [PAIR_MAGIC, SECRET] and wire.decode(frames[2:]).room == 5
        # several messages would go one by one: never from a thread that must not wait, all in turn from a worker
        assert not channel.send_now(at, wire.AuxData("prefill:1", 5, 3, [b"row"]), status)
        channel.send_all(at, [wire.AuxData("prefill:1", 5, 3, [b"row"]), status])
        assert wire.decode(_recv(sock)[2:]).aux_index == 3 and wire.decode(_recv(sock)[2:]) == status
        assert not sock.poll(100)
    finally:
        channel.forget(at)
        sock.close()
