"""Control-channel messages between prefill and decode ranks (msgspec structs, msgpack on ZMQ).

Every message travels as two frames `[MAGIC, msgpack(msg)]` on a PUSH socket to the peer's PULL socket (the
one SGLang's CommonKVManager binds, `rank_port`), so it shares that socket with SGLang's own ABORT frames.
Messages from one prefill rank to one decode rank keep their order (one PUSH socket per endpoint, sent from
one transfer worker), which the two-sided data path relies on: CommInit, then ChunkHeaders in send order,
then AuxData, then Status. A one-sided (Mooncake) peer gets only Status: its chunks and aux row were written
into its memory before the Status was sent.

Peers are named by their control endpoint "ip:port" (`session`).
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

MAGIC = b"P2P1"


class PeerRegister(msgspec.Struct, tag=True):
    """Decode rank -> prefill rank, once per pair: where to send and what the decode pools look like."""

    session: str
    hostname: str
    engine_rank: int
    attn_tp_size: int
    page_size: int
    kv_dtype: str
    kv_ptrs: list[int]
    kv_item_lens: list[int]
    aux_ptrs: list[int]
    aux_item_lens: list[int]
    state_ptrs: list[list[int]]
    state_item_lens: list[list[int]]
    transports: list[str]  # what the decode can receive with, preferred first ("nccl"/"tcp", "mooncake")
    # the decode's Mooncake session ("host:rpc_port") when it runs a Mooncake engine: then kv_ptrs, aux_ptrs
    # and state_ptrs are registered there and a prefill may write into them one-sidedly
    mooncake_session: str = ""


class RoomMetadata(msgspec.Struct, tag=True):
    """Decode rank -> prefill rank, per request: the destination ids (empty for a dummy rank)."""

    session: str
    room: int
    kv_ids: bytes  # int32 page ids, aligned with the prefill's page list from decode_prefix_len on
    aux_index: int
    state_ids: list[bytes]  # int32 ids per state component, in KVArgs order
    required_dst_info_num: int
    decode_prefix_len: int
    is_dummy: bool


class CommInit(msgspec.Struct, tag=True):
    """Prefill -> decode: join a new pair channel (two-sided transports). Replaces any older one."""

    session: str
    transport: str
    unique_id: bytes
    generation: int
    #: channel cap both ranks use (0: NCCL's default, -1: not negotiated)
    cap: int = -1


class CommOffer(msgspec.Struct, tag=True):
    """Prefill -> decode: may we open a pair channel of `cap` channels (0: NCCL default)? Answered by CommAnswer."""

    session: str
    offer: int
    cap: int


class CommAnswer(msgspec.Struct, tag=True):
    """Decode -> prefill: the cap the decode's communicator budget affords (<= the offer), or -1 and why not."""

    session: str
    offer: int
    cap: int
    reason: str = ""


class CommClosed(msgspec.Struct, tag=True):
    """Prefill -> decode: the pair channel `generation` was released (pool eviction); drop it after its chunks."""

    session: str
    generation: int


class CommRelease(msgspec.Struct, tag=True):
    """Decode -> prefill: short of communicator memory; release our pair channel if it is idle."""

    session: str


class ChunkSegment(msgspec.Struct, array_like=True):
    group: int
    region_lo: int
    region_hi: int
    dst_ids: bytes  # int32 destination ids of this segment


class ChunkHeader(msgspec.Struct, tag=True):
    """Prefill -> decode: the next message on the pair channel carries these segments (two-sided)."""

    session: str
    generation: int
    room: int
    prefill_rank: int
    nbytes: int
    segments: list[ChunkSegment]


class AuxData(msgspec.Struct, tag=True):
    """Prefill -> decode: the request's aux (metadata) rows, one bytes per aux buffer (host memory)."""

    room: int
    aux_index: int
    rows: list[bytes]


class Status(msgspec.Struct, tag=True):
    """Prefill -> decode: the room concluded on this prefill rank (KVPoll value) with a reason on failure."""

    session: str
    room: int
    prefill_rank: int
    status: int
    reason: str = ""


Message = Union[
    PeerRegister, RoomMetadata, CommInit, ChunkHeader, AuxData, Status, CommOffer, CommAnswer, CommClosed, CommRelease
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> list[bytes]:
    return [MAGIC, _encoder.encode(msg)]


def decode(frames: list[bytes]) -> Optional[Message]:
    """The message in `frames`, or None when the frames are not ours (SGLang's own frames)."""
    if len(frames) != 2 or frames[0] != MAGIC:
        return None
    return _decoder.decode(frames[1])
