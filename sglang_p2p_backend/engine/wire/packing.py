"""One ZMQ frame for a whole frame list, between ranks of a registered pair.

A control message to a registered peer is a list of four frames (pair secret, ours), seven with a key. pyzmq
gives up the GIL around each frame it sends and each it receives: a Status sent from SGLang's scheduler thread was
up to seven chances for a transfer worker to take that thread's GIL, each for up to a switch interval (with a key,
packing took 30% off a room's conclusion on the host alone: docs/bench.md, "A room's conclusion on the host"). A
packed list travels as the single frame

    PACK_MAGIC + msgpack([frame, ...])

and is opened back into the same list before anything else reads it (auth.py, pair_secret.py, messages.py).
Only frame lists that carry a pair secret are packed: the peer holding it registered with this protocol version
(messages.PROTOCOL_VERSION, compared at registration), while a registration and its answer stay unpacked so that
ranks of another version can read them and refuse with both versions named. Hand-written framing because ZMQ's
own (multipart) is what costs here; msgspec does the encoding.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from sglang_p2p_backend.engine.wire.messages import WireError

PACK_MAGIC = b"P2PK"
#: frames in one packed list, at most: the key's envelope (3), the pair secret (2), then ours (2) or SGLang's own
MAX_FRAMES = 32

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Annotated[list[bytes], Meta(min_length=1, max_length=MAX_FRAMES)])


def pack(frames: list[bytes]) -> list[bytes]:
    """`frames` as one frame."""
    return [PACK_MAGIC + _encoder.encode(frames)]


def unpack(frames: list[bytes]) -> list[bytes]:
    """The frame list a packed frame holds; any other frame list as it is. Raises WireError for a packed frame
    that does not hold a list of 1 to MAX_FRAMES frames."""
    if len(frames) != 1 or not frames[0].startswith(PACK_MAGIC):
        return frames
    try:
        return _decoder.decode(memoryview(frames[0])[len(PACK_MAGIC):])
    except msgspec.DecodeError as e:  # ValidationError included
        raise WireError(f"packed frame list: {e}") from None
