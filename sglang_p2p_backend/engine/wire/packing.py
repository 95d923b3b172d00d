"""One ZMQ frame for one or several whole frame lists, between ranks of a registered pair.

A control message to a registered peer is a list of four frames (pair secret, ours), seven with a key. pyzmq
gives up the GIL around each frame it sends and each it receives: a Status sent from SGLang's scheduler thread was
up to seven chances for a transfer worker to take that thread's GIL, each for up to a switch interval (with a key,
packing took 30% off a room's conclusion on the host alone: docs/bench.md, "A room's conclusion on the host"). A
room's aux row and Status go to their decode rank as one frame too (ControlChannel.send_now with both): one send,
syscall and GIL hand-over fewer on SGLang's thread, 30-45% of a conclusion with warm caches. Packed frame lists
travel as the single frame

    PACK_MAGIC + msgpack([[frame, ...], ...])

and are opened back into the same lists, in order, before anything else reads them (auth.py, pair_secret.py,
messages.py), each checked on its own as if it had come alone. Only frame lists that carry a pair secret are
packed: the peer holding it registered with this protocol version (messages.PROTOCOL_VERSION, compared at
registration), while a registration and its answer stay unpacked so that ranks of another version can read them
and refuse with both versions named. Hand-written framing because ZMQ's own (multipart) is what costs here;
msgspec does the encoding.
"""

from __future__ import annotations

from typing import Annotated, Sequence

import msgspec
from msgspec import Meta

from sglang_p2p_backend.engine.wire.messages import WireError

PACK_MAGIC = b"P2PK"
#: frames in one packed list, at most: the key's envelope (3), the pair secret (2), then ours (2) or SGLang's own
MAX_FRAMES = 32
#: frame lists in one packed frame, at most (a room's aux row and Status: 2)
MAX_LISTS = 8

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Annotated[list[Annotated[list[bytes], Meta(min_length=1, max_length=MAX_FRAMES)]],
                                             Meta(min_length=1, max_length=MAX_LISTS)])


def pack(frame_lists: Sequence[list[bytes]]) -> list[bytes]:
    """`frame_lists` (1 to MAX_LISTS of them) as one frame."""
    if not 1 <= len(frame_lists) <= MAX_LISTS:
        raise ValueError(f"{len(frame_lists)} frame lists do not go in one packed frame (1 to {MAX_LISTS})")
    return [PACK_MAGIC + _encoder.encode(frame_lists)]


def unpack(frames: list[bytes]) -> list[list[bytes]]:
    """The frame lists a packed frame holds, in order; any other frame list as the only one. Raises WireError for a
    packed frame that does not hold 1 to MAX_LISTS lists of 1 to MAX_FRAMES frames."""
    if len(frames) != 1 or not frames[0].startswith(PACK_MAGIC):
        return [frames]
    try:
        return _decoder.decode(memoryview(frames[0])[len(PACK_MAGIC):])
    except msgspec.DecodeError as e:  # ValidationError included
        raise WireError(f"packed frame lists: {e}") from None
