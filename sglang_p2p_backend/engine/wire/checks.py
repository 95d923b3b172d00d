"""Checks of every wire field against the receiver's own bounds, before anything is used.

msgspec already enforced each message's static bounds while decoding (messages.py). What is checked here needs
local facts: the receiver's pool sizes and layout, what a registered peer declared, what the decode published
for a room. Each function takes a decoded message and those facts and returns the validated values, or raises
`WireError` naming the field; the caller drops the message with a log line naming the peer, and fails the
room if it knows it. Pure functions, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from sglang_p2p_backend.engine.copy.heads import Heads
from sglang_p2p_backend.engine.wire.messages import AuxData, ChunkHeader, ChunkSegment, PeerRegister, RoomMetadata, WireError
from sglang_p2p_backend.engine.copy.plan import Chunk, Segment, Slice, moved_len, out_of_range_id

_KV_POLL_SUCCESS, _KV_POLL_FAILED = 4, 0  # SGLang's KVPoll values a Status may carry


def ids(raw: bytes, limit: int, name: str) -> np.ndarray:
    """int32 ids from `raw`, each in [0, limit)."""
    if len(raw) % 4:
        raise WireError(f"{name}: {len(raw)} bytes is not a whole number of int32 ids")
    out = np.frombuffer(raw, dtype=np.int32)
    bad = out_of_range_id(out, limit)
    if bad is not None:
        raise WireError(f"{name}: id {bad} outside the pool's 0..{limit - 1}")
    return out


@dataclass(frozen=True)
class Destinations:
    """A RoomMetadata after its checks (prefill side)."""

    kv_ids: np.ndarray
    state_ids: list[np.ndarray]


def room_metadata(msg: RoomMetadata, peer: PeerRegister) -> Destinations:
    """The destinations of a RoomMetadata from the registered decode rank `peer`, within the pools it
    declared at registration (so a one-sided write can never leave them)."""
    if msg.session != peer.session:
        raise WireError(f"session {msg.session!r} is not the registered {peer.session!r}")
    if not -1 <= msg.aux_index < peer.aux_rows:
        raise WireError(f"aux_index {msg.aux_index} outside the decode's {peer.aux_rows} aux rows")
    if len(msg.state_ids) > len(peer.state_slots):
        raise WireError(f"state_ids names {len(msg.state_ids)} state components, the decode registered {len(peer.state_slots)}")
    kv = ids(msg.kv_ids, peer.kv_pages, "kv_ids")
    states = [ids(raw, peer.state_slots[c], f"state_ids[{c}]") for c, raw in enumerate(msg.state_ids)]
    return Destinations(kv, states)


@dataclass
class Published:
    """What a decode rank published for one room: the only pages and slots a chunk of it may write."""

    kv_ids: np.ndarray
    aux_index: int
    state_ids: list[np.ndarray]
    prefills: frozenset  # sessions of the prefill ranks that serve the room
    next_seq: dict = field(default_factory=dict)  # prefill_rank -> index of its next chunk
    received: list = field(default_factory=list)  # KV destination ids of the chunks that passed their checks
    #: prefill_rank -> how many KV destination ids its accepted chunks carried: where its next run starts
    next_kv: dict = field(default_factory=dict)
    _sorted: list = field(default_factory=list)

    def allowed(self, group: int) -> np.ndarray:
        if not self._sorted:
            self._sorted = [np.unique(self.kv_ids)] + [np.unique(s) for s in self.state_ids]
        return self._sorted[group] if group < len(self._sorted) else np.zeros(0, dtype=np.int32)

    def kv_run(self, ids: np.ndarray, prefill_rank: int) -> Optional[int]:
        """Where `ids` start in the room's KV ids when they are exactly the run after this prefill rank's earlier
        chunks (how a prefill rank sends them: in their published order, chunk after chunk), else None."""
        start = self.next_kv.get(prefill_rank, 0)
        return start if np.array_equal(self.kv_ids[start : start + ids.size], ids) else None

    def publishes(self, group: int, ids: np.ndarray, prefill_rank: int) -> bool:
        """Whether every id of `ids` is a page (group 0) or state item of group `group` this room published. The
        KV run after the rank's earlier chunks is compared first (one pass over n ids, where a sort of the room's
        ids and a search of every id were on each chunk's path); anything else is looked up among all of them,
        sorted once a room."""
        if group == 0 and self.kv_run(ids, prefill_rank) is not None:
            return True
        return _subset(ids, self.allowed(group))


@dataclass(frozen=True)
class ChunkVerdict:
    """A checked chunk header: the layout and ids to scatter, or why it must not be scattered. `in_step` is
    False when its bytes cannot even be received into a staging slot (the pair channel must be dropped)."""

    chunk: Optional[Chunk]
    ids: list[np.ndarray]
    problem: Optional[str] = None
    in_step: bool = True
    #: (the room's published KV ids, start) when the chunk's KV destinations are exactly `kv_ids[start:start + n]`
    #: of them: a receiver may then take them from one upload of the room's ids instead of uploading each chunk's
    kv_run: Optional[tuple[np.ndarray, int]] = None


def _subset(d: np.ndarray, allowed: np.ndarray) -> bool:
    if not d.size:
        return True
    if not allowed.size:
        return False
    pos = np.searchsorted(allowed, d)
    return bool(np.all(pos < allowed.size) and np.all(allowed[np.minimum(pos, allowed.size - 1)] == d))


def _segment_heads(s: ChunkSegment, kv_heads: Optional[Heads],
                   state_spans: Sequence[Slice] = ()) -> Slice:
    """What a segment writes of each item: exactly `kv_heads` (the heads this decode rank takes from that prefill
    rank) for the KV group when the TP sizes differ, exactly `state_spans[c]` of state component c when it is
    sliced between these two ranks (byte spans, or an SWA window's head range) (its spans follow from both agreements: nothing about them travels), whole
    items otherwise."""
    if s.group != 0 or kv_heads is None:
        if s.head_lo or s.head_hi:
            raise WireError(f"group {s.group} names heads {s.head_lo}..{s.head_hi}, but moves whole pages between these ranks")
        return state_spans[s.group - 1] if 0 < s.group <= len(state_spans) else None
    if not kv_heads.count:
        raise WireError("KV from a prefill rank that holds a replica of heads another prefill rank sends")
    if (s.head_lo, s.head_hi) != (kv_heads.lo, kv_heads.hi):
        raise WireError(f"KV of heads {s.head_lo}..{s.head_hi}, but this decode rank takes heads {kv_heads.lo}.."
                        f"{kv_heads.hi} of its {kv_heads.local} from that prefill rank")
    return kv_heads


def chunk_layout(
    header: ChunkHeader,
    item_lens: Sequence[Sequence[int]],
    slot_bytes: int,
    published: Optional[Callable[[int, np.ndarray], bool]] = None,
    kv_heads: Optional[Heads] = None,
    state_spans: Sequence[Slice] = (),
) -> ChunkVerdict:
    """Check a chunk against the receiver's layout and staging: exact byte count, at most one slot, groups and
    regions it has; with `published` ((group, ids) -> whether the room published them all), every destination
    id a published one; KV segments write exactly the head range `kv_heads` (None: whole pages), state segments
    exactly `state_spans` of their component (None: whole items)."""
    if header.nbytes > slot_bytes:
        return ChunkVerdict(None, [], f"room {header.room}: chunk of {header.nbytes} bytes exceeds this decode rank's "
                            f"staging slot of {slot_bytes} bytes", in_step=False)
    try:
        segs, out = [], [np.zeros(0, dtype=np.int32) for _ in item_lens]
        nbytes = 0
        for s in header.segments:
            if s.group >= len(item_lens) or not (0 <= s.region_lo <= s.region_hi <= len(item_lens[s.group])):
                raise WireError(f"segment names group {s.group} regions {s.region_lo}..{s.region_hi}, which this decode rank does not have")
            if out[s.group].size:
                raise WireError(f"chunk carries group {s.group} twice")
            if len(s.dst_ids) % 4:
                raise WireError(f"group {s.group} destinations are not whole int32 ids")
            d = np.frombuffer(s.dst_ids, dtype=np.int32)
            if published is not None and not published(s.group, d):
                raise WireError(f"group {s.group} destinations are not pages this room published")
            heads = _segment_heads(s, kv_heads, state_spans)
            segs.append(Segment(s.group, s.region_lo, s.region_hi, 0, d.size, heads))
            out[s.group] = d
            lens = item_lens[s.group]
            per_item = (sum(lens[s.region_lo : s.region_hi]) if heads is None  # whole items: no loop over layers
                        else sum(moved_len(lens[r], heads, r) for r in range(s.region_lo, s.region_hi)))
            nbytes += d.size * per_item
        if nbytes != header.nbytes:
            raise WireError(f"chunk of {header.nbytes} bytes does not match this decode rank's layout ({nbytes} "
                            f"bytes): prefill and decode KV layouts differ")
    except WireError as e:
        return ChunkVerdict(None, [], f"room {header.room}: {e}")
    return ChunkVerdict(Chunk(tuple(segs), nbytes), out)


def chunk_header(
    header: ChunkHeader,
    item_lens: Sequence[Sequence[int]],
    slot_bytes: int,
    published: Optional[Published],
    kv_heads: Optional[Heads] = None,
    state_spans: Sequence[Slice] = (),
) -> ChunkVerdict:
    """`chunk_layout`, and the room's own rules: the room waits for KV from this prefill, the chunk is next in
    its sequence, and it writes only pages the room published (only the heads `kv_heads`, when given)."""
    problem = None
    if published is None:
        problem = "room is not waiting for KV on this decode rank"
    elif header.session not in published.prefills:
        problem = f"prefill {header.session} does not serve this room"
    else:
        expected = published.next_seq.get(header.prefill_rank, 0)
        if header.seq != expected:
            problem = f"chunk {header.seq} arrived where chunk {expected} was expected"
        else:
            published.next_seq[header.prefill_rank] = expected + 1
    if problem is not None:
        verdict = chunk_layout(header, item_lens, slot_bytes)  # can its bytes still be received in step?
        return ChunkVerdict(None, [], f"room {header.room}: {problem}", verdict.in_step)
    rank = header.prefill_rank
    runs: list[int] = []  # where the KV run starts, when the chunk's KV ids are the run after the rank's earlier ones

    def publishes(group: int, ids: np.ndarray) -> bool:  # Published.publishes, keeping where the run starts
        start = published.kv_run(ids, rank) if group == 0 else None
        if start is None:
            return _subset(ids, published.allowed(group))
        runs.append(start)
        return True

    verdict = chunk_layout(header, item_lens, slot_bytes, publishes, kv_heads, state_spans)
    if verdict.chunk is None or not verdict.ids:
        return verdict
    published.next_kv[rank] = published.next_kv.get(rank, 0) + verdict.ids[0].size
    if runs and verdict.ids[0].size:
        verdict = ChunkVerdict(verdict.chunk, verdict.ids, kv_run=(published.kv_ids, runs[0]))
    return verdict


def aux_data(msg: AuxData, item_lens: Sequence[int], published: Optional[Published]) -> None:
    """The aux rows go to the row the decode published for the room: one per aux buffer, each exactly that
    buffer's row size (both sides agreed on them at registration), so no byte of the slot's previous request
    stays behind."""
    if published is None:
        raise WireError("room is not waiting for KV on this decode rank")
    if msg.session not in published.prefills:
        raise WireError(f"prefill {msg.session} does not serve this room")
    if msg.aux_index != published.aux_index or msg.aux_index < 0:
        raise WireError(f"aux_index {msg.aux_index} is not the room's row {published.aux_index}")
    if len(msg.rows) != len(item_lens):
        raise WireError(f"{len(msg.rows)} aux rows for {len(item_lens)} aux buffers")
    for i, (row, n) in enumerate(zip(msg.rows, item_lens)):
        if len(row) > n:
            raise WireError(f"aux row {i} of {len(row)} bytes exceeds the buffer's {n}-byte rows")
        if len(row) < n:
            raise WireError(f"aux row {i} of {len(row)} bytes falls short of the buffer's {n}-byte rows")


class Unparsed:
    """What a log line shows of frames no decoder took (a peer's junk may be a frame of many MiB): their count,
    the first lengths and the first 64 bytes, formatted only when the line is logged (`%s`)."""

    __slots__ = ("frames", "what")

    def __init__(self, frames: Sequence[bytes], what: str):
        self.frames, self.what = frames, what

    def __str__(self) -> str:
        frames = self.frames
        lens = ", ".join(str(len(f)) for f in frames[:8]) + (", ..." if len(frames) > 8 else "")
        head = bytes(frames[0][:64]) if frames else b""
        return f"{self.what}: {len(frames)} frames of [{lens}] bytes, the first starting {head!r}"


def status(value: int) -> bool:
    """True for Success, False for Failed; anything else is not a final status."""
    if value not in (_KV_POLL_SUCCESS, _KV_POLL_FAILED):
        raise WireError(f"status {value} is neither Success nor Failed")
    return value == _KV_POLL_SUCCESS
