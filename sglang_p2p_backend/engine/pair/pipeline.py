"""The two-sided data path of one (prefill rank, decode rank) pair: gather -> send on prefill, recv -> scatter
on decode, chunk by chunk in the order the control channel announced them.

`PairSender` runs on the prefill's transfer worker that owns the peer (so its chunks stay ordered). The
channel is created on first use: the prefill makes a unique id, announces it with `CommInit`, and both ranks
join. Before each chunk's data the prefill sends a `ChunkHeader` carrying the destination ids, so the decode
needs no per-request state beyond "is this room still wanted".

`PairReceiver` is the decode's thread for one prefill peer. It receives every announced chunk even when the
room was aborted meanwhile (then it discards the bytes instead of scattering), so the channel stays in step.
A broken channel fails the rooms whose chunks it carried and is dropped; the prefill's next request makes a
new one (a higher `generation`).

On channels with a side stream (NCCL) the ends overlap (`overlap`, SGLANG_P2P_OVERLAP): the sender gathers chunk
i+1 into a second staging slot while chunk i moves, the receiver posts chunk i+1's receive before it scatters
chunk i and reports a chunk once its scatter is seen done, without waiting for it while it can post. A spare
slot is only ever taken when free and nobody waits for one (docs/design.md, two-sided path). With
`device_scatter` (SGLANG_P2P_DEVICE_SCATTER) the receiver queues a readied scatter on the GPU behind its receive,
counted for its room until seen ended (`on_queued`, `on_ended`: the decode holds the room's failure meanwhile).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.pair.comm_budget import cap_to_wire
from sglang_p2p_backend.engine.copy.copier import PageCopier
from sglang_p2p_backend.engine.copy.room_ids import RoomIds
from sglang_p2p_backend.engine.copy.stream_ops import on_stream
from sglang_p2p_backend.engine.wire.messages import ChunkHeader, ChunkSegment, CommInit, Message
from sglang_p2p_backend.engine.wire.checks import ChunkVerdict, chunk_layout
from sglang_p2p_backend.engine.copy.heads import PairHeads
from sglang_p2p_backend.engine.copy.state_slices import StatePlan
from sglang_p2p_backend.engine.copy.plan import Segment, plan_chunks
from sglang_p2p_backend.engine.pair.staging import StagingPool
from sglang_p2p_backend.engine.threads import enter_thread
from sglang_p2p_backend.engine.waiting import Deadline, wait_until
from sglang_p2p_backend.engine.transport.base import Completion, PairComm, TransportError, TwoSidedTransport

logger = logging.getLogger(__name__)


def _stream_ctx(comm: Optional[PairComm]) -> on_stream:
    return on_stream(comm.stream if comm is not None else None)


def _queued_end(stream: Optional["torch.cuda.Stream"]) -> Callable[[], bool]:
    """Whether the work queued on `stream` so far has ended, asked later by polling (None: no stream, nothing to
    wait for): a blocking stream sync could not time out if the peer died with a receive posted."""
    if stream is None:
        return _at_once
    event = torch.cuda.Event()
    event.record(stream)
    return event.query


def _at_once() -> bool:
    return True


def _queue_after(stream: "torch.cuda.Stream", received: Completion, run: Callable[[], object]) -> Callable[[], bool]:
    """Queue a readied scatter on `stream` behind a posted receive (a wait on the receive's event, then the launch),
    so the GPU starts it as the bytes land, with no host step between; returns its end, to poll."""
    with on_stream(stream):
        stream.wait_event(received.event)
        run()
    return _queued_end(stream)


def _never() -> bool:
    return False


def _settled(comm: PairComm, timeout: float) -> bool:
    """After an abort of `comm`: whether the work queued on its streams (sends, receives, and the gathers or
    scatters of its staging slots) has ended within `timeout`. A slot goes back to the pool only then: one
    handed on while a kernel still writes or reads it would mix another room's chunk with this one's bytes."""
    ended = [_queued_end(comm.stream), _queued_end(comm.side_stream)]
    return wait_until(lambda: all(e() for e in ended), timeout)


class _Posted(NamedTuple):
    """A chunk whose receive is posted: what landing it needs (`scatter`: the stream its scatter runs on, None
    without one; `prepared`: the scatter readied while the bytes move, None when the room was not wanted then)."""

    header: ChunkHeader
    verdict: ChunkVerdict
    buf: torch.Tensor
    done: Completion
    comm: PairComm
    deadline: float
    scatter: Optional["torch.cuda.Stream"] = None
    prepared: Optional[Callable[[], object]] = None
    #: its scatter queued on the GPU behind the receive (`device_scatter`): its end; None: launched at landing
    queued: Optional[Callable[[], bool]] = None
    queue_error: Optional[Exception] = None  # queueing it raised: landing fails the chunk


def _landing_wait(posted: _Posted) -> Deadline:
    """The schedule of a receiver's looks for the next header or the posted chunk's end: the waits of every
    other transfer thread (engine/waiting.py), first until the chunk should have landed where the transport
    knows (`expected_end`, NCCL's LinkPace; a header that comes earlier wakes the receiver)."""
    return Deadline(max(0.0, posted.deadline - time.monotonic()), getattr(posted.done, "expected_end", None))


class _PairEnd:
    """What both ends of a pair channel hold: the transport, staging, the page copier, timeouts, the channel."""

    def __init__(self, transport: TwoSidedTransport, staging: StagingPool, copier: PageCopier,
                 connect_timeout: float, io_timeout: float, overlap: bool = True):
        self.transport = transport
        #: SGLANG_P2P_OVERLAP: one chunk's gather or scatter overlaps the next chunk's transfer, in a second
        #: staging slot when one is free (channels with a side stream only, i.e. NCCL)
        self.overlap = overlap
        self.staging = staging
        self.copier = copier
        self.item_lens = copier.item_lens
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.comm: Optional[PairComm] = None
        self.generation = 0
        #: a benchmark's probe (bench/transfer/xfer_bench.py, NCCL phases): told (event, room) at each step of a
        #: chunk's way, to time the steps against one clock; None in service
        self.trace: Optional[Callable[[str, int], None]] = None

    def _mark(self, event: str, room: int) -> None:
        if self.trace is not None:
            self.trace(event, room)

    def _give_back(self, comm: PairComm, bufs: Sequence[torch.Tensor], peer: str) -> bool:
        """Slots used on an aborted channel back to the pool once the channel's work ended (gathers into them,
        sends out of them, receives and scatters); else kept out of use, logged, rather than carry one room's
        bytes into another room's chunk. Whether the work ended."""
        if _settled(comm, self.io_timeout):
            for buf in bufs:
                self.staging.release(buf)
            return True
        logger.error("p2pnccl: work on the pair channel of %s not finished %.0fs after it was aborted; %d "
                     "staging slot(s) kept out of use", peer, self.io_timeout, len(bufs))
        return False


class PairSender(_PairEnd):
    """Prefill side of one pair channel. Not thread-safe: one transfer worker owns it."""

    def __init__(
        self,
        *,
        transport: TwoSidedTransport,
        staging: StagingPool,
        copier: PageCopier,
        local_session: str,
        control: Callable[[Message], None],
        connect_timeout: float,
        io_timeout: float,
        overlap: bool = True,
        first_chunk: int = EngineConfig.first_chunk_mb << 20,
    ):
        super().__init__(transport, staging, copier, connect_timeout, io_timeout, overlap)
        self.local_session = local_session
        self.control = control
        #: SGLANG_P2P_FIRST_CHUNK_MB in bytes: the first chunk's cap of a transfer over one slot (0: no ramp)
        self.first_chunk = first_chunk

    def open(self, max_ctas: Optional[int] = -1) -> PairComm:
        """Make a new pair channel (capped at `max_ctas` channels on nccl; -1: the transport's default) and
        announce it; the decode joins when its receiver reaches the CommInit. Replaces any older channel."""
        self.reset()
        self.generation += 1
        uid = self.transport.new_unique_id(max_ctas)
        cap = -1 if max_ctas == -1 else cap_to_wire(max_ctas)
        self.control(CommInit(self.local_session, self.transport.name, uid, self.generation, cap))
        self.comm = self.transport.connect(uid, 0, self.connect_timeout)
        return self.comm

    def _ensure_comm(self) -> PairComm:
        return self.comm if self.comm is not None else self.open()

    def send(
        self,
        room: int,
        prefill_rank: int,
        src_ids: Sequence[np.ndarray],
        dst_ids: Sequence[np.ndarray],
        keep_going: Callable[[], bool] = lambda: True,
        next_seq: Optional[Callable[[], int]] = None,
        heads: Optional[PairHeads] = None,
        state: Sequence[Optional[StatePlan]] = (),
    ) -> int:
        """Move `src_ids[g]` of every group to the peer's `dst_ids[g]`; returns bytes sent. Stops between
        chunks once `keep_going()` is False (aborted room). `next_seq()` numbers the room's chunks across
        calls (the decode checks the sequence). `heads`: only that head range of the KV pages (group 0),
        packed into the same chunks; `state[c]`: only those spans of state component c's items. Raises
        TransportError; the channel is then dropped."""
        next_seq = next_seq or itertools.count().__next__
        for g, (s, d) in enumerate(zip(src_ids, dst_ids)):
            if len(s) != len(d):
                raise TransportError(
                    f"room {room}: group {g} has {len(s)} source ids but the decode published {len(d)} destinations"
                )
        problem = self.copier.bad_ids(src_ids)  # before any header goes out: fails the room, not the channel
        if problem:
            raise TransportError(f"room {room}: {problem}")
        slices = [heads.src if heads is not None else None, *(p.src if p is not None else None for p in state)]
        chunks = plan_chunks(self.item_lens, [len(s) for s in src_ids], self.staging.slot_bytes, slices,
                             self.first_chunk)
        if not chunks or not keep_going():
            return 0
        sent = 0
        self._mark("start", room)
        try:
            comm = self._ensure_comm()
            bufs = [self.staging.acquire(self.io_timeout)]
            ok = False
            try:
                side = comm.side_stream if self.overlap and len(chunks) > 1 else None
                if side is not None:  # a spare slot only: another end keeps one, and nobody waits for it
                    extra = self.staging.try_acquire()
                    if extra is not None:
                        bufs.append(extra)
                dev_ids = None
                last = None
                sends: list = [None] * len(bufs)  # the send out of each slot still to finish before refilling it
                for i, chunk in enumerate(chunks):
                    if not keep_going():
                        break
                    if len(bufs) == 2 and self.staging.has_waiters():
                        # another end has no slot: give back the one chunk i would refill, once its send is
                        # done, and go on with the other (serial on the channel's stream from here)
                        j = i % 2
                        if sends[j] is not None:
                            sends[j].wait(self.io_timeout)
                        self.staging.release(bufs.pop(j))
                        sends.pop(j)
                    j = i % len(bufs)
                    if len(bufs) == 2 and sends[j] is not None:
                        # chunk i's gather runs while chunk i-1 moves; the channel's stream waits for the gather
                        # (the transport orders a send after its caller's stream), the gather for the slot's
                        # previous send
                        side.wait_event(sends[j].event)
                    with on_stream(side) if len(bufs) == 2 else _stream_ctx(comm):
                        # the header first: the decode posts its receive while this end gathers (its hop and
                        # the post, ~0.3 ms, were on every chunk's path); the ids were checked above, so what
                        # fails after it is a CUDA error, which aborts the channel as a failed send does
                        segments = [_segment_msg(seg, dst_ids, heads) for seg in chunk.segments]
                        self._mark("header", room)  # handed to the control channel (its hop is the decode's "header")
                        self.control(
                            ChunkHeader(self.local_session, self.generation, room, prefill_rank, next_seq(),
                                        chunk.nbytes, segments)
                        )
                        self._mark("handed", room)
                        if i == 0:  # after the first header: the upload runs beside the decode's hop and post
                            dev_ids = self._device_ids(src_ids, comm, side if len(bufs) == 2 else None)
                        self.copier.gather(chunk, src_ids, bufs[j], dev_ids)
                        self._mark("gather", room)
                        last = sends[j] = comm.send(bufs[j][: chunk.nbytes])
                        self._mark("post", room)
                    sent += chunk.nbytes
                if last is not None:
                    last.wait(self.io_timeout)  # every gather came before a send that finished
                    self._mark("sent", room)
                ok = True
            finally:
                self._release(bufs, comm, ok)
        except TransportError:
            self.reset()
            raise
        return sent

    def _device_ids(self, src_ids: Sequence[np.ndarray], comm: PairComm,
                    side: Optional["torch.cuda.Stream"]) -> Optional[list]:
        """The room's page ids on the device, uploaded once on the stream of its first gather (the side stream
        with two slots, else the channel's) for every chunk's gather to slice; held for the channel's streams
        too, whichever a gather runs on (a slot given back moves the rest to the channel's stream). None on CPU."""
        with on_stream(side) if side is not None else _stream_ctx(comm):
            dev_ids = self.copier.device_ids(src_ids)
        for t in dev_ids or ():
            for stream in (comm.stream, side):
                if stream is not None:
                    t.record_stream(stream)
        return dev_ids

    def _release(self, bufs: list, comm: PairComm, ok: bool) -> None:
        """Give the slots back; after an error, with the channel aborted first (`_give_back`)."""
        if ok:
            for buf in bufs:
                self.staging.release(buf)
            return
        self.reset()
        comm.abort()  # the channel of this call, whichever `self.comm` is now (idempotent)
        self._give_back(comm, bufs, self.local_session)

    def reset(self) -> None:
        if self.comm is not None:
            self.comm.abort()
            self.comm = None

    close = reset

    def abort_channel(self, generation: Optional[int], reason: str) -> None:
        """Abort the channel (if it is still `generation`; None: whichever is up) from any thread: an op in
        flight on it fails now instead of at its timeout, and the owning worker drops the channel."""
        comm = self.comm
        if comm is not None and (generation is None or generation == self.generation):
            logger.warning("p2pnccl: aborting pair channel %d to %s: %s", self.generation, self.local_session, reason)
            comm.abort()

    def close_channel(self) -> Optional[int]:
        """Orderly release of an idle channel (the pool needs its memory); returns its generation, None if
        there was none. Local: the decode learns it from a CommClosed on the control channel."""
        if self.comm is None:
            return None
        comm, self.comm = self.comm, None
        comm.close()
        return self.generation


def _segment_msg(seg: Segment, dst_ids: Sequence[np.ndarray], heads: Optional[PairHeads] = None) -> ChunkSegment:
    """The wire form of a segment: the decode's ids, and the decode's head range when the segment has one."""
    ids = np.ascontiguousarray(dst_ids[seg.group][seg.lo : seg.hi], dtype=np.int32)
    lo, hi = (heads.dst.lo, heads.dst.hi) if seg.group == 0 and seg.heads is not None and heads is not None else (0, 0)
    return ChunkSegment(seg.group, seg.region_lo, seg.region_hi, ids.tobytes(), lo, hi)


ChunkDone = Callable[[int, int, Optional[str]], None]  # (room, prefill_rank, error or None)
_EMPTY = object()  # PairReceiver._queued: nothing queued


class _Landed(NamedTuple):
    """A chunk whose bytes are in and whose scatter is launched (or that needs none): reported, and its slot given
    back, once `ended()` says the scatter's work is done (`deadline`: when a scatter not done fails the chunk)."""

    posted: _Posted
    ended: Callable[[], bool]
    deadline: float
    scattered: bool  # its scatter was launched (not a dropped chunk of a room given up, or one that failed checks)


class PairReceiver(_PairEnd):
    """Decode side of one prefill peer: a thread that joins its channels and receives announced chunks.

    A chunk goes posted (its receive queued on the channel's stream, its scatter readied) -> landed (the receive
    seen done, the scatter launched) -> reported (the scatter seen done: the slot goes back, `on_chunk` is told),
    in announcement order. With the overlap the thread does not wait at any step while it can post the next
    receive: a spare slot is taken for it, and otherwise the oldest of its own chunks is moved on until one is
    free (a scatter at HBM speed first, then a receive), so the link is kept busy while earlier chunks scatter."""

    def __init__(
        self,
        *,
        transport: TwoSidedTransport,
        staging: StagingPool,
        copier: PageCopier,
        peer_session: str,
        wanted: Callable[[int], bool],
        on_chunk: ChunkDone,
        connect_timeout: float,
        io_timeout: float,
        on_channel: Callable[[Optional[CommInit]], None] = lambda init: None,
        on_refused: Callable[[ChunkHeader, str], None] = lambda header, reason: None,
        check: Optional[Callable[[ChunkHeader], ChunkVerdict]] = None,
        overlap: bool = True,
        device_scatter: bool = False,
        on_queued: Callable[[int], bool] = lambda room: True,
        on_ended: Callable[[int], None] = lambda room: None,
    ):
        super().__init__(transport, staging, copier, connect_timeout, io_timeout, overlap)
        self.peer_session = peer_session
        #: queue each readied scatter on the GPU behind its receive (overlapped chunks only). `on_queued(room)` is
        #: asked first and counts it where the room is still wanted (False: not queued, landing drops the chunk);
        #: `on_ended(room)` is told once it is seen ended, or its channel's work settled after an abort: never
        #: while it may still write the room's pages
        self.device_scatter = device_scatter
        self._queued_any = False  # logged once a receiver: the first scatter queued that way
        self.on_queued = on_queued
        self.on_ended = on_ended
        #: told the CommInit of a channel once joined, None once it is dropped (the decode's comm pool)
        self.on_channel = on_channel
        self.wanted = wanted
        self.on_chunk = on_chunk
        #: told a chunk whose bytes cannot be received in step (the channel was dropped): tell the prefill
        self.on_refused = on_refused
        #: a chunk header's checks, in this thread and in arrival order (default: the layout and staging only)
        self.check = check or (lambda h: chunk_layout(h, self.item_lens, staging.slot_bytes))
        self.broken_reason = ""
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        #: chunks whose receives are posted, oldest first, and chunks landed whose scatters may still run: each
        #: holds a staging slot (so there are as many as the slots this end may hold); this thread only
        self._posted: "collections.deque[_Posted]" = collections.deque()
        self._landed: "collections.deque[_Landed]" = collections.deque()
        self._posted_header: Optional[ChunkHeader] = None  # the header _receive last posted (error bookkeeping)
        #: items taken from the queue to look for headers behind a chunk and not handled there: handled next, first
        self._taken_back: "collections.deque[object]" = collections.deque()
        self.room_ids = RoomIds(copier)  # the rooms' published KV ids on the device, one upload a room
        self._thread = threading.Thread(target=self._run, name=f"p2p-recv-{peer_session}", daemon=True)
        self._thread.start()

    def submit(self, item: object) -> None:
        """Queue a CommInit, a ChunkHeader, or a callable to run once everything before it was handled."""
        self._queue.put(item)

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self._drop("receiver closed")

    def abort(self, reason: str) -> None:
        """The peer is dead: fail a receive in flight now (from any thread), then stop the thread."""
        comm = self.comm
        if comm is not None:
            comm.abort()
        self.close(timeout=1.0)
        self.broken_reason = reason

    def _drop(self, reason: str) -> None:
        if self.comm is not None:
            self.comm.abort()
            self.comm = None
            self.on_channel(None)
        self.broken_reason = reason

    def closed_by_peer(self, generation: int) -> None:
        """The prefill released channel `generation` (pool eviction); queued behind every chunk it sent on it."""
        self.submit(lambda: self._drop("closed by the prefill (communicator pool)") if generation == self.generation else None)

    def _run(self) -> None:
        enter_thread("p2p-recv", getattr(self.copier, "device", None))  # the decode's GPU (a stand-in copier: none)
        while True:
            item = self._next_item()
            try:
                if not isinstance(item, ChunkHeader):
                    self._settle()  # whatever follows a chunk sees it reported (a callable, a new channel)
                if item is None:
                    return
                if isinstance(item, CommInit):
                    self._join(item)
                elif isinstance(item, ChunkHeader):
                    self._take(item)
                else:
                    item()
            except Exception:  # a bug here must not kill the peer's thread silently
                logger.exception("p2p receiver for %s: unexpected error", self.peer_session)
                if item is None:
                    return

    def _next_item(self) -> object:
        """The next queued item. While chunks are in flight, the next header is taken as soon as it comes (its
        receive is then posted behind), and they move on without waiting for one once their work is done."""
        if self._taken_back:
            return self._taken_back.popleft()
        while self._posted or self._landed:
            # backing off: a stalled peer must not keep this thread waking (and taking the GIL from the
            # scheduler) thousands of times a second
            wait = self._wait_schedule()
            while True:
                try:
                    return self._queue.get(timeout=wait.next_pause())
                except queue.Empty:
                    try:
                        moved = self._progress()
                    except Exception:  # as in _run: logged, the thread goes on
                        logger.exception("p2p receiver for %s: unexpected error", self.peer_session)
                        moved = True
                    if moved:
                        break  # the schedule of what is in flight now
        return self._queue.get()

    def _wait_schedule(self) -> Deadline:
        """The looks for the next header or the oldest chunk's next step: until the oldest receive should have
        landed where the transport knows (`expected_end`, NCCL's LinkPace; a header that comes earlier wakes the
        receiver); a scatter launched (HBM speed: a 128 MiB chunk in 0.1-0.2 ms) is polled finely from the start,
        where doubling steps would see its end up to 0.1 ms late on every request's path."""
        if self._landed:
            return Deadline(max(0.0, self._landed[0].deadline - time.monotonic()), expected_end=time.monotonic())
        return _landing_wait(self._posted[0])

    def _progress(self) -> bool:
        """Move on what is done without waiting: report the landed chunks whose scatters ended, land the oldest
        receive if it is done (or past its deadline: landing fails it). Whether anything moved."""
        moved = False
        while True:
            now = time.monotonic()
            if self._landed and (self._landed[0].ended() or now > self._landed[0].deadline):
                self._report(self._landed.popleft())
            elif self._posted and (self._posted[0].done.done() or now > self._posted[0].deadline):
                self._land(self._posted.popleft())
            else:
                return moved
            moved = True

    def _settle(self) -> None:
        """Every chunk in flight landed and reported, in order (waiting for each)."""
        while self._posted or self._landed:
            self._move_oldest()

    def _move_oldest(self) -> None:
        """The oldest chunk in flight one step on, waiting for it: a landed one reported (its scatter, at HBM
        speed), else the oldest posted one landed (its receive, which waits for the peer)."""
        if self._landed:
            self._report(self._landed.popleft())
        else:
            self._land(self._posted.popleft())

    def _join(self, msg: CommInit) -> None:
        self._drop("replaced by a new pair channel")
        self.room_ids.clear()  # uploaded on the old channel's streams
        self.generation = msg.generation
        try:
            self.comm = self.transport.connect(msg.unique_id, 1, self.connect_timeout)
            self.broken_reason = ""
            self.on_channel(msg)
        except TransportError as e:
            self.broken_reason = f"could not join the pair channel of prefill {self.peer_session}: {e}"
            logger.warning(self.broken_reason)

    def _take(self, header: ChunkHeader) -> None:
        """One announced chunk, whatever goes wrong: a chunk whose receive cannot be posted as announced
        breaks the channel (the prefill's bytes would otherwise land under the next header) and fails."""
        self._mark("header", header.room)
        try:
            self._receive(header)
        except Exception as e:  # noqa: BLE001 - a bug or a CUDA error: the channel's order is not known any more
            logger.exception("p2p receiver for %s: chunk of room %d", self.peer_session, header.room)
            self._settle()
            if self._posted_header is not header:  # its receive was not posted: nothing lands it
                self._broken(f"pair channel with prefill {self.peer_session} dropped after an error: {e!r}")
                self.on_chunk(header.room, header.prefill_rank, self.broken_reason)

    def _checked(self, header: ChunkHeader) -> ChunkVerdict:
        """The header's checks: every header's, once and in arrival order (a room counts its chunks through them).
        Checks that raise fail the chunk, as checks that refuse it do."""
        try:
            verdict = self.check(header)
        except Exception as e:  # noqa: BLE001 - a bug in a check: this chunk fails, the channel stays in step
            logger.exception("p2p receiver for %s: checks of a chunk of room %d", self.peer_session, header.room)
            verdict = ChunkVerdict(None, [], f"room {header.room}: its checks failed: {e!r}")
        self._mark("checked", header.room)
        return verdict

    def _receive(self, header: ChunkHeader) -> None:
        """Post the receive of one announced chunk, check the chunk while its bytes move (a receive into staging
        needs only its size within a slot: the post is what the prefill's send waits for), then move on the
        chunks before it that are done. A chunk is scattered only if its checks passed and the room still wants
        it at landing; one that failed them is received into staging and dropped (the channel stays in step);
        one larger than a staging slot cannot be, so the channel is dropped and the prefill told."""
        self._posted_header = None
        if self.comm is None or header.generation != self.generation:
            self._checked(header)
            self._settle()
            reason = self.broken_reason or f"no pair channel with prefill {self.peer_session}"
            self.on_chunk(header.room, header.prefill_rank, reason)
            return
        if header.nbytes > self.staging.slot_bytes:
            verdict = self._checked(header)
            self._settle()
            reason = verdict.problem or f"room {header.room}: chunk larger than a staging slot"
            self._drop(reason)
            self.on_refused(header, reason)
            self.on_chunk(header.room, header.prefill_rank, reason)
            return
        comm = self.comm
        try:
            buf = self._slot()
            self._mark("slot", header.room)
            done = self._post(comm, header, buf)
        except TransportError as e:
            self._checked(header)
            self._settle()
            self._broken(f"pair channel with prefill {self.peer_session} broke: {e}")
            self.on_chunk(header.room, header.prefill_rank, self.broken_reason)
            return
        first = len(self._posted)
        overlaps = self._posted_checked(header, buf, done, comm)
        self._posted_header = header
        if overlaps:
            overlaps = self._receive_ahead(comm)
        # readied after every receive the queue allowed is posted: the link moves the next chunk while this end
        # readies the scatters (a readying is needed only by its chunk's landing)
        for k in range(first, len(self._posted)):
            p = self._posted[k]
            p = p._replace(prepared=self._prepare(p.header, p.verdict, p.buf, p.scatter))
            self._posted[k] = self._queue_early(p) if self._queues_early(p) else p
        if overlaps:
            self._progress()
        else:
            self._settle()  # nothing overlaps (CPU, SGLANG_P2P_OVERLAP=0, a scatter that may load a kernel)

    def _post(self, comm: PairComm, header: ChunkHeader, buf: torch.Tensor) -> Completion:
        """Post the receive of `header`'s bytes into `buf`; on failure the channel is aborted and `buf` goes back
        once its work ended (a post that failed may have queued part of the receive)."""
        try:
            with _stream_ctx(comm):
                done = comm.recv(buf[: header.nbytes])
            self._mark("post", header.room)
            return done
        except BaseException:
            comm.abort()
            self._give_back(comm, [buf], self.peer_session)
            raise

    def _posted_checked(self, header: ChunkHeader, buf: torch.Tensor, done: Completion, comm: PairComm) -> bool:
        """A chunk whose receive is posted: checked (in arrival order) and queued to land, its scatter not readied
        yet; whether the next receive may be posted before it lands (`_overlappable`)."""
        verdict = self._checked(header)
        overlaps = self._overlappable(comm, verdict)
        stream = comm.side_stream if overlaps else comm.stream
        self._posted.append(_Posted(header, verdict, buf, done, comm, time.monotonic() + self.io_timeout, stream))
        return overlaps

    def _receive_ahead(self, comm: PairComm) -> bool:
        """Post the receives of the headers already queued behind the chunk just posted, in order, while a spare
        slot is free (never waiting for one), each checked as it is posted; stops at anything else, which is
        handled next. Whether the last chunk posted overlaps the next receive. Only chunks that passed
        `_overlappable` have a receive posted behind them."""
        while True:
            item = self._taken_back.popleft() if self._taken_back else self._queued()
            if item is _EMPTY:
                return True
            buf = None
            if (isinstance(item, ChunkHeader) and comm is self.comm and item.generation == self.generation
                    and item.nbytes <= self.staging.slot_bytes):
                try:
                    buf = self.staging.try_acquire()
                except TransportError:  # a slot that cannot be allocated: `_take` meets it again and fails the chunk
                    buf = None
            if buf is None:
                self._taken_back.appendleft(item)  # the oldest item not handled: next in line
                return True
            self._mark("header", item.room)
            self._mark("slot", item.room)
            try:
                done = self._post(comm, item, buf)
            except TransportError as e:  # the channel is aborted: its chunks fail, and `_take` fails this one in order
                logger.warning("p2p receiver for %s: a receive posted ahead failed: %s", self.peer_session, e)
                self._taken_back.appendleft(item)
                return True
            if not self._posted_checked(item, buf, done, comm):
                return False

    def _queued(self) -> object:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return _EMPTY

    def _overlappable(self, comm: PairComm, verdict: ChunkVerdict) -> bool:
        """Whether the next chunk's receive may run while this one is scattered: on a channel with a side stream,
        and only for a scatter whose kernels are loaded already (loading a CUDA module can wait for the kernels
        running on the device, here the next receive, i.e. on the peer: docs/nccl.md, hazards)."""
        if not self.overlap or comm.side_stream is None:
            return False
        try:
            return verdict.chunk is None or self.copier.loaded_for(verdict.chunk)
        except Exception:  # noqa: BLE001 - not known: no overlap, the safe way
            logger.exception("p2p receiver for %s: whether a scatter's kernel is loaded", self.peer_session)
            return False

    def _prepare(self, header: ChunkHeader, verdict: ChunkVerdict, buf: torch.Tensor,
                 stream: Optional["torch.cuda.Stream"]) -> Optional[Callable[[], object]]:
        """The chunk's scatter readied while its bytes move (its checks, its page ids to the device on the stream
        it will run on), so that landing it is only the launch; None when the room is not wanted now or the
        readying failed (landing then scatters the whole way, and reports what fails)."""
        if verdict.chunk is None or not self.wanted(header.room):
            return None
        try:
            with on_stream(stream):
                run = self.copier.prepare_scatter(verdict.chunk, verdict.ids, buf, self._device_ids(verdict, stream))
            self._mark("readied", header.room)
            return run
        except Exception:  # noqa: BLE001 - landing repeats it and fails the chunk with the reason
            logger.debug("p2p receiver for %s: readying the scatter of room %d failed", self.peer_session,
                         header.room, exc_info=True)
            return None

    def _queues_early(self, p: _Posted) -> bool:
        """Whether `p`'s readied scatter goes on the GPU now (`device_scatter`): an overlapped chunk (the side
        stream, its kernel loaded) whose receive has an event to wait on."""
        return (self.device_scatter and p.prepared is not None and p.scatter is not None
                and p.scatter is p.comm.side_stream and getattr(p.done, "event", None) is not None)

    def _queue_early(self, p: _Posted) -> _Posted:
        """Queue `p`'s readied scatter behind its receive. Counted for its room first: from here on a failure of
        the room waits for this scatter's end, which `_report` (or an abort's settled streams) tells. A room no
        longer wanted is not counted, and its chunk is dropped at landing as without `device_scatter`."""
        if not self.on_queued(p.header.room):
            return p._replace(prepared=None)
        try:
            ended = _queue_after(p.scatter, p.done, p.prepared)
        except Exception as e:  # noqa: BLE001 - what reached the stream ends on its own; landing fails the chunk
            logger.error("p2p receiver for %s: queueing the scatter of room %d failed", self.peer_session,
                         p.header.room, exc_info=e)
            return p._replace(queued=_never, queue_error=e)
        self._mark("launched", p.header.room)
        if not self._queued_any:
            self._queued_any = True
            logger.info("p2pnccl: scatters of prefill %s are queued on the GPU behind their receives "
                        "(SGLANG_P2P_DEVICE_SCATTER=1)", self.peer_session)
        return p._replace(queued=ended)

    def _device_ids(self, verdict: ChunkVerdict, stream: Optional["torch.cuda.Stream"]) -> Optional[list]:
        """The chunk's ids by group with its KV run as a slice of the room's ids on the device (uploaded once a
        room, on `stream`, the current one), or None (each chunk uploads its own): for a chunk whose KV ids are
        the next run of the room's published list and whose scatter takes device ids."""
        if verdict.kv_run is None or not verdict.ids or not self.copier.takes_device_ids(verdict.chunk):
            return None
        kv_ids, start = verdict.kv_run
        run = self.room_ids.run(kv_ids, start, verdict.ids[0].size, stream)
        return None if run is None else [run, *verdict.ids[1:]]

    def _slot(self) -> torch.Tensor:
        """A staging slot for the next receive: a spare one, else one of this end's own once the oldest chunk in
        flight moved on (its scatter, at HBM speed, before a receive, which waits for the peer), else one waited
        for with none held. Never waits for a slot while holding one."""
        while self._posted or self._landed:
            buf = self.staging.try_acquire()
            if buf is not None:
                return buf
            self._move_oldest()
        return self.staging.acquire(self.io_timeout)

    def _land(self, p: _Posted) -> None:
        """Wait for a posted receive and launch its scatter (on the side stream, beside the channel's stream where
        the next receives run); the chunk is reported once the scatter ended (`_report`; without the overlap
        `_receive` waits for that before the next header). Any failure fails the chunk and drops the channel; the
        slot then goes back only once the channel's work on it ended."""
        try:
            p.done.wait(max(0.0, p.deadline - time.monotonic()))
            self._mark("landed", p.header.room)
            if p.queue_error is not None:
                raise p.queue_error
            ended, scattered = _at_once, False
            if p.queued is not None:  # queued behind the receive when readied: it runs since the bytes landed
                ended, scattered = p.queued, True
            elif p.verdict.chunk is not None and self.wanted(p.header.room):
                with on_stream(p.scatter):
                    if p.prepared is not None:
                        p.prepared()
                    else:
                        self.copier.scatter(p.verdict.chunk, p.verdict.ids, p.buf)
                    ended, scattered = _queued_end(p.scatter), True
                self._mark("launched", p.header.room)
        except Exception as e:  # noqa: BLE001 - TransportError, or a bug / CUDA error: the chunk fails either way
            self._failed(p, e)
            return
        # reported once its scatter is seen done (_progress, _slot, _settle; without the overlap _receive settles)
        self._landed.append(_Landed(p, ended, time.monotonic() + self.io_timeout, scattered))

    def _report(self, landed: _Landed) -> None:
        """A landed chunk's scatter ended (waited for to its deadline): its slot back, the chunk reported."""
        p = landed.posted
        if not wait_until(landed.ended, max(0.0, landed.deadline - time.monotonic()), time.monotonic()):
            self._failed(p, TransportError(f"scatter not done after {self.io_timeout:.1f}s (GPU stalled)"),
                         earlier=False)
            return
        if p.queued is not None:
            self.on_ended(p.header.room)
        if landed.scattered:
            self._mark("scattered", p.header.room)
        self.staging.release(p.buf)
        self.on_chunk(p.header.room, p.header.prefill_rank, p.verdict.problem)
        self._mark("reported", p.header.room)

    def _failed(self, p: _Posted, e: Exception, earlier: bool = True) -> None:
        """Chunk `p` failed landing or scattering: it fails and its channel is dropped. `earlier`: the landed
        chunks are before it (it failed landing), so they are reported first (their scatters end on their own);
        else they come after it (its scatter failed) and are reported after it, as the channel drops."""
        if not isinstance(e, TransportError):
            logger.error("p2p receiver for %s: landing a chunk of room %d", self.peer_session, p.header.room,
                         exc_info=e)
        while earlier and self._landed:
            self._report(self._landed.popleft())
        reason = f"pair channel with prefill {self.peer_session} broke: {e}"
        self.on_chunk(p.header.room, p.header.prefill_rank, reason)
        p.comm.abort()
        if p.comm is self.comm:
            self._broken(reason)
        self._gave_back(p)

    def _gave_back(self, p: _Posted) -> None:
        """`p`'s slot back once its aborted channel's work ended (`_give_back`); its scatter queued on the GPU
        (`device_scatter`) ended then too, whatever the receive left in the slot: its room is told. Work that
        does not end keeps the room counted (the decode's bound ends its wait, logged)."""
        if self._give_back(p.comm, [p.buf], self.peer_session) and p.queued is not None:
            self.on_ended(p.header.room)

    def _broken(self, reason: str) -> None:
        """Drop the channel: the chunks landed before report (their scatters are local work), the chunks posted
        on it fail (this thread)."""
        self._drop(reason)
        while self._landed:
            self._report(self._landed.popleft())
        while self._posted:
            posted = self._posted.popleft()
            self.on_chunk(posted.header.room, posted.header.prefill_rank, reason)
            self._gave_back(posted)
