"""Control-channel messages between prefill and decode ranks (msgspec structs, msgpack on ZMQ).

Every message travels as two frames `[MAGIC, msgpack(msg)]` on a PUSH socket to the peer's PULL socket (the
one SGLang's CommonKVManager binds, `rank_port`), so it shares that socket with SGLang's own ABORT frames.
Messages from one prefill rank to one decode rank keep their order (one PUSH socket per endpoint, sent from
one transfer worker), which the two-sided data path relies on: CommInit, then ChunkHeaders in send order,
then AuxData, then Status. A one-sided (Mooncake) peer gets only Status: its chunks and aux row were written
into its memory before the Status was sent.

Peers are named by their control endpoint "ip:port" (`session`). Static bounds (lengths, signs) are part of
each struct and enforced by msgspec while decoding; bounds that depend on the receiver's pools and on the
sender's registration are checked in `checks.py` before a message is used. With a shared key the frames are
wrapped in an authenticated envelope first (`auth.py`).
"""

from __future__ import annotations

from typing import Annotated, Optional, Union

import msgspec
from msgspec import Meta

MAGIC = b"P2P1"
#: what both sides must speak; compared at registration (agreement.py)
# 3: head ranges (different attention TP on MHA pools); 4: CUDA IPC export (same host); 5: pair secrets (every
# message after registration carries the secret its receiver issued: pair_secret.py), aux rows in the agreement,
# RoomFailed; 6: refusals carry no pair secret, PeerReleased; 7: per-tensor state sharding in the agreement
# (state components sliced over attention TP: engine/copy/state_slices.py); 8: Status carries the room's chunk count;
# 9: frame lists between registered ranks packed into one ZMQ frame (packing.py); 10: several frame lists in one
# packed frame (a room's aux row and Status)
PROTOCOL_VERSION = 10

# static bounds of wire fields: generous for any deployment, small enough that nothing sized by them is costly
Session = Annotated[str, Meta(min_length=3, max_length=200)]
Room = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, Meta(ge=0, lt=1 << 31)]
Index = Annotated[int, Meta(ge=-1, lt=1 << 31)]
Rank = Annotated[int, Meta(ge=0, lt=1 << 16)]
Ids = Annotated[bytes, Meta(max_length=1 << 24)]  # int32 ids: 4M pages at most per message
Short = Annotated[str, Meta(max_length=4096)]
ItemLens = Annotated[list[Count], Meta(max_length=4096)]
Ptrs = Annotated[list[Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]], Meta(max_length=4096)]
Cap = Annotated[int, Meta(ge=-1, le=1024)]
Secret = Annotated[bytes, Meta(max_length=64)]


class Agreement(msgspec.Struct, kw_only=True):
    """Everything a prefill rank and a decode rank must agree on, exchanged at registration and compared on
    both sides (agreement.py names every difference with both values)."""

    protocol: int
    page_size: Count
    kv_dtype: Short
    kv_item_lens: ItemLens
    state_item_lens: Annotated[list[ItemLens], Meta(max_length=64)]
    #: bytes of one staging slot = the largest chunk either side sends or receives (two-sided transports)
    slot_bytes: Count
    #: whether control messages are authenticated (SGLANG_P2P_AUTH_KEY); peers disagreeing never get this far
    auth: bool
    #: MLA pool (replicated latent KV, whole pages at any TP) rather than MHA/GQA (heads split over TP)
    mla: bool = False
    #: this side's attention TP; with MHA and different sizes, pages move head ranges (heads.py)
    attn_tp_size: Annotated[int, Meta(ge=1, le=1 << 12)] = 1
    #: the model's KV head count (the prefill knows it from SGLang's KVArgs; 0 where unknown, e.g. a decode)
    kv_total_heads: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    #: bytes of one aux (metadata) row per aux buffer: the prefill writes its rows into the decode's
    aux_item_lens: ItemLens = msgspec.field(default_factory=list)
    #: SGLang's KV byte layout label (KVArgs.kv_layout, 0.5.23; "" for pools with only one layout)
    kv_layout: Short = ""
    #: the SWA sub-pool's physical layout (KVArgs.swa_kv_cache_layout, 0.5.23; "" without one)
    swa_kv_cache_layout: Short = ""
    #: "hnd" when SGLang's MHA pool keeps head-major pages (SGLANG_USE_HND_KVCACHE), "" for token-major rows
    mha_layout: Short = ""
    #: what each state component is (KVArgs.state_types, lower-case names, in KVArgs order)
    state_types: Annotated[list[Short], Meta(max_length=64)] = msgspec.field(default_factory=list)
    #: per state component and region, as SGLang's KVArgs gives them (empty where it gives none): the sliced
    #: axis's size on this rank (state_dim_per_tensor; 0: replicated over TP), the rows before it
    #: (state_slice_outer_counts), GDN's full conv sub-block dims (state_conv_shard_groups; [] for one block)
    state_dims: Annotated[list[ItemLens], Meta(max_length=64)] = msgspec.field(default_factory=list)
    state_outer_counts: Annotated[list[ItemLens], Meta(max_length=64)] = msgspec.field(default_factory=list)
    state_conv_groups: Annotated[list[Annotated[list[Annotated[list[Count], Meta(max_length=64)]], Meta(max_length=4096)]],
                                 Meta(max_length=64)] = msgspec.field(default_factory=list)
    #: the TP width SGLang lays state out over (Common's `state_tp_size`; 0: not reported, the attention TP)
    state_tp_size: Annotated[int, Meta(ge=0, le=1 << 12)] = 0
    #: SGLang's KVArgs.is_hybrid_mla_backend: MLA attention layers beside state layers (replicated KV, sharded state)
    hybrid_mla: bool = False


class IpcRegion(msgspec.Struct, array_like=True):
    """One KV/state region of a decode rank as CUDA IPC exports it: inside allocation `alloc` at `offset`."""

    ptr: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]  # the decode's address (what kv_ptrs/state_ptrs say)
    alloc: Annotated[int, Meta(ge=0, lt=4096)]
    offset: Annotated[int, Meta(ge=0, le=(1 << 62))]
    length: Annotated[int, Meta(ge=0, le=(1 << 62))]


class IpcExport(msgspec.Struct):
    """A decode rank's pools as CUDA IPC handles (transport/cuda_ipc.py): one handle per allocation, the regions
    in registration order (KV, then state components), and where the process runs."""

    device_uuid: Short
    boot_id: Short
    pid: Count
    handles: Annotated[list[Annotated[bytes, Meta(min_length=64, max_length=64)]], Meta(max_length=4096)]
    alloc_sizes: Annotated[list[Annotated[int, Meta(ge=0, le=(1 << 62))]], Meta(max_length=4096)]
    regions: Annotated[list[IpcRegion], Meta(max_length=8192)]


class PeerRegister(msgspec.Struct, tag=True):
    """Decode rank -> prefill rank, once per pair: where to send and what the decode pools look like."""

    session: Session
    #: the decode process's start (time_ns): a new value at the same session is a restarted process
    incarnation: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
    hostname: Short
    engine_rank: Count
    attn_tp_size: Count
    agreement: Agreement
    kv_ptrs: Ptrs
    aux_ptrs: Ptrs
    aux_item_lens: ItemLens
    state_ptrs: Annotated[list[Ptrs], Meta(max_length=64)]
    # the decode's pool sizes: the bounds every destination id it later sends is checked against
    kv_pages: Count
    aux_rows: Count
    state_slots: Annotated[list[Count], Meta(max_length=64)]
    transports: Annotated[list[Short], Meta(max_length=8)]  # what the decode receives with, preferred first
    # the decode's Mooncake session ("host:rpc_port") when it runs a Mooncake engine: then kv_ptrs, aux_ptrs
    # and state_ptrs are registered there and a prefill may write into them one-sidedly
    mooncake_session: Short = ""
    # the decode's pools exported through CUDA IPC, when it offers "cudaipc": a prefill on the same host maps
    # them once and copies into them directly
    ipc: Optional[IpcExport] = None
    #: the decode's pair secret for this registration: every later message of the prefill to it carries it
    secret: Secret = b""

    @property
    def page_size(self) -> int:
        return self.agreement.page_size

    @property
    def kv_item_lens(self) -> list[int]:
        return self.agreement.kv_item_lens


class PeerAnswer(msgspec.Struct, tag=True):
    """Prefill rank -> decode rank, answering PeerRegister: accepted (problem "") or refused and why, with the
    prefill's agreement so the decode compares too (a refusal carries the decode's own agreement with only the
    differing values replaced: a stranger learns nothing else; one that failed authentication, nothing of the
    prefill at all), and the prefill rank it will report Status as. Only an acceptance carries `secret`; the
    decode's first message after it (a Heartbeat carrying `secret`) confirms the registration."""

    session: Session
    incarnation: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
    prefill_rank: Rank
    agreement: Agreement
    problem: Short = ""
    #: the prefill's attention TP rank: which heads it holds (heads.py)
    attn_tp_rank: Count = 0
    #: the prefill's pair secret for this registration: every later message of the decode to it carries it
    secret: Secret = b""


class PeerReleased(msgspec.Struct, tag=True):
    """Prefill rank -> decode rank: its live registration, idle (no room the prefill's scheduler knows), gave its
    slot to a new one (SGLANG_P2P_MAX_PEERS); the decode registers again before its next room."""

    session: Session
    reason: Short


class Heartbeat(msgspec.Struct, tag=True):
    """Both ways, every SGLANG_P2P_PEER_TIMEOUT/4 seconds to every peer a rank holds rooms or a registration
    with: a peer silent for SGLANG_P2P_PEER_TIMEOUT is declared dead (liveness.py)."""

    session: Session
    incarnation: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]


class RoomMetadata(msgspec.Struct, tag=True):
    """Decode rank -> prefill rank, per request: the destination ids (empty for a dummy rank)."""

    session: Session
    #: the decode process that published it: a room of an older process is never written with newer pointers
    incarnation: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
    room: Room
    kv_ids: Ids  # int32 page ids, aligned with the prefill's page list from decode_prefix_len on
    aux_index: Index
    state_ids: Annotated[list[Ids], Meta(max_length=64)]  # int32 ids per state component, in KVArgs order
    required_dst_info_num: Annotated[int, Meta(ge=1, le=1 << 12)]
    decode_prefix_len: Count
    is_dummy: bool


class CommInit(msgspec.Struct, tag=True):
    """Prefill -> decode: join a new pair channel (two-sided transports). Replaces any older one."""

    session: Session
    transport: Short
    unique_id: Annotated[bytes, Meta(max_length=1024)]
    generation: Count
    #: channel cap both ranks use (0: NCCL's default, -1: not negotiated)
    cap: Cap = -1


class CommOffer(msgspec.Struct, tag=True):
    """Prefill -> decode: may we open a pair channel of `cap` channels (0: NCCL default)? Answered by CommAnswer."""

    session: Session
    offer: Count
    cap: Cap


class CommAnswer(msgspec.Struct, tag=True):
    """Decode -> prefill: the cap the decode's communicator budget affords (<= the offer), or -1 and why not."""

    session: Session
    offer: Count
    cap: Cap
    reason: Short = ""


class CommClosed(msgspec.Struct, tag=True):
    """Prefill -> decode: the pair channel `generation` was released (pool eviction); drop it after its chunks."""

    session: Session
    generation: Count


class ChunkRefused(msgspec.Struct, tag=True):
    """Decode -> prefill: a chunk on pair channel `generation` failed its checks; the decode dropped its end of
    the channel, so the prefill aborts its end too instead of waiting on a receive that will not come."""

    session: Session
    generation: Count
    room: Room
    reason: Short


class CommRelease(msgspec.Struct, tag=True):
    """Decode -> prefill: short of communicator memory; release our pair channel if it is idle."""

    session: Session


class ChunkSegment(msgspec.Struct, array_like=True):
    group: Annotated[int, Meta(ge=0, lt=64)]
    region_lo: Count
    region_hi: Count
    dst_ids: Ids  # int32 destination ids of this segment
    # heads [head_lo, head_hi) of every token row of the decode's pages (different attention TP, MHA); 0, 0: whole pages
    head_lo: Count = 0
    head_hi: Count = 0


class ChunkHeader(msgspec.Struct, tag=True):
    """Prefill -> decode: the next message on the pair channel carries these segments (two-sided)."""

    session: Session
    generation: Count
    room: Room
    prefill_rank: Rank
    #: index of this chunk among the room's chunks from this prefill rank (0, 1, ...)
    seq: Count
    nbytes: Annotated[int, Meta(ge=0, lt=1 << 40)]
    segments: Annotated[list[ChunkSegment], Meta(max_length=64)]


class AuxData(msgspec.Struct, tag=True):
    """Prefill -> decode: the request's aux (metadata) rows, one bytes per aux buffer (host memory)."""

    session: Session
    room: Room
    aux_index: Index
    rows: Annotated[list[Annotated[bytes, Meta(max_length=1 << 20)]], Meta(max_length=64)]


class RoomFailed(msgspec.Struct, tag=True):
    """Decode -> prefill: the decode failed `room` on its side (an invalid aux row, say); stop sending it."""

    session: Session
    room: Room
    reason: Short


class Status(msgspec.Struct, tag=True):
    """Prefill -> decode: the room concluded on this prefill rank (KVPoll value) with a reason on failure."""

    session: Session
    room: Room
    prefill_rank: Rank
    status: Annotated[int, Meta(ge=0, le=8)]
    reason: Short = ""
    #: how many ChunkHeaders of the room this prefill rank sent the receiving decode rank (two-sided chunks; 0 where
    #: every chunk went one-sided): the decode counts a Success only once that many were announced and landed, so
    #: a Status that overtook the room's last header (a new socket after an evicted one) waits for it
    chunks: Count = 0


Message = Union[
    PeerRegister, PeerAnswer, Heartbeat, RoomMetadata, CommInit, ChunkHeader, AuxData, Status,
    CommOffer, CommAnswer, CommClosed, CommRelease, ChunkRefused, RoomFailed, PeerReleased,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> list[bytes]:
    return [MAGIC, _encoder.encode(msg)]


class WireError(ValueError):
    """A message that must not be used: undecodable, out of its static bounds, or out of the receiver's."""


def ours(frames: list[bytes]) -> bool:
    return len(frames) >= 1 and frames[0] == MAGIC


def decode(frames: list[bytes]) -> Optional[Message]:
    """The message in `frames`, or None when the frames are not ours (SGLang's own frames). Raises WireError
    for frames of ours that do not decode into a valid message."""
    if not ours(frames):
        return None
    if len(frames) != 2:
        raise WireError(f"{len(frames)} frames, expected 2")
    try:
        return _decoder.decode(frames[1])
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # ValidationError included: out of static bounds
        raise WireError(str(e)) from None
