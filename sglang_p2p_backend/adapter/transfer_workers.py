"""Prefill transfer workers: each room's chunks to its decode ranks over the transport `auto` picks per peer.

`add_transfer_request` (SGLang's sender calls it per send()) queues a task on the worker that owns the room's
decode peer (peers are sharded over SGLANG_P2P_WORKERS queues, so one peer's chunks stay ordered). A worker
moves the chunk to every real decode rank of the room: one copy kernel into a same-host decode's mapped pages
(same_host.py), two-sided over the pair channel (engine/pair/channels.py), or one-sided with Mooncake
(engine/transport/onesided.py), only the heads that rank owns when its attention TP differs
(engine/copy/heads.py; a rank holding a replica another rank sends moves no KV) and only its slice of each state
item (engine/copy/state_slices.py); after the last chunk, Status. A plain same-host chunk's copy is queued by
`add` itself, on SGLang's thread, and its worker only waits for it (SGLANG_P2P_IPC_LAUNCH; docs/design.md); when
such a chunk is a room's last, SGLang's poll concludes the room as soon as its copy ran, unless its worker got there
first (SGLANG_P2P_CONCLUDE_IN_POLL). Every task is counted in flight while it runs (deferred_release.py; a launched
one from `add`), so an aborted room's ACK waits for it. A traced
task (SGLang's --enable-trace) records a slice per chunk and one per decode rank in it (tracing.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_p2p_backend.adapter import tracing
from sglang_p2p_backend.adapter.deferred_release import DeferredRelease
from sglang_p2p_backend.adapter.room_times import RoomTimes
from sglang_p2p_backend.adapter.same_host import SameHostPath
from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.pair.channels import PairChannels
from sglang_p2p_backend.engine.pair.comm_budget import NoRoom
from sglang_p2p_backend.engine.wire.control import ControlChannel, ControlError
from sglang_p2p_backend.engine.copy.heads import PairHeads
from sglang_p2p_backend.engine.copy.launches import Launch
from sglang_p2p_backend.engine.copy.state_slices import StatePlan
from sglang_p2p_backend.engine.transport.local_memory import LocalMemory
from sglang_p2p_backend.engine.transport.onesided import OneSidedSender
from sglang_p2p_backend.engine.copy.plan import PlanError
from sglang_p2p_backend.engine.transport.base import TransportError

logger = logging.getLogger(__name__)

#: after a "no room for a communicator" answer, a peer is not offered NCCL again for this long
_NO_ROOM_BACKOFF_S = 0.05
_NO_IDS = np.zeros(0, dtype=np.int32)


class ChunkSeq:
    """Numbers a room's chunk headers to one decode rank (0, 1, ...; called by the one worker that owns the peer)
    and keeps how many it handed out: the count the room's Status names (`wire.Status.chunks`)."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self) -> int:
        seq, self.sent = self.sent, self.sent + 1
        return seq


@dataclass
class TransferInfo:
    """One decode rank's destinations for one room. Field names follow Mooncake's, which Common code reads
    (`endpoint`, `dst_port`, `is_dummy`, `required_dst_info_num`)."""

    session: str
    room: int
    dst_kv_indices: np.ndarray
    dst_aux_index: int
    dst_state_indices: List[np.ndarray]
    required_dst_info_num: int
    decode_prefix_len: int
    is_dummy: bool
    next_seq: ChunkSeq = field(default_factory=ChunkSeq)

    @property
    def endpoint(self) -> str:
        return self.session.rsplit(":", 1)[0]

    @property
    def dst_port(self) -> int:
        return int(self.session.rsplit(":", 1)[1])


@dataclass
class TransferTask:
    room: int
    kv_indices: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: Optional[int]
    state_indices: Optional[list]
    wait_event: Any = None
    #: set: `kv_indices` is a host tensor whose values are valid once this event completed (read in `_process`)
    indices_event: Any = None
    #: set: the chunk is traced (SGLang's --enable-trace, tracing.py); None costs nothing
    trace: Optional[tracing.ChunkTrace] = None
    #: set: the chunk's copy was queued as it was handed over (`TransferWorkers.add`); its worker waits for it
    launch: Optional[Launch] = None
    #: counted in flight from `add` on (a launched chunk), not from when a worker takes it
    counted: bool = False
    #: the room's chunk queued before this one, until this one's worker finished (None: none, or it finished)
    previous: Optional["TransferTask"] = None
    #: its worker is done with it (set last): with one worker a shard, so is it with every earlier chunk of the room
    finished: bool = False
    #: a launched last chunk's: its room is concluded (aux row, Success, Status) by whoever takes this first, SGLang's
    #: poll or the chunk's worker
    claim: Optional[threading.Lock] = None


@dataclass
class Conclude:
    """Queued by SGLang's poll behind a room's last chunk: the rest of the room's conclusion, which could not go
    without waiting (a peer's control socket busy or full)."""

    room: int
    rest: Callable[[], None]


@dataclass
class ResetPeer:
    """Queued behind a peer's earlier chunks: drop its pair channel (re-registered, or dead)."""

    session: str


class TransferWorkers:
    """The prefill's transfer queues (one per worker thread, peers sharded over them) and what a worker does
    with a task. What it reads of the prefill role comes in through the constructor: SGLang's room states
    (`request_status`) and each room's destinations (`destinations`); the live decode registrations (`peers`),
    why a decode rank was refused (`rejected`) or stopped being live (`departed`), the heads each takes
    (`heads`) and its spans of every state component's items (`state`, empty: whole items); which transport
    serves a peer now (`route`) and the transports themselves; `alone(room)`: whether `room` is the only request
    on this rank (no forward pass will run beside its last chunk's copy); `fail_room(room, reason)` and `succeed(room)`
    (this rank's state, then Status to the decode ranks; with `now`, SGLang's poll: a Status that would wait is
    not sent but returned, as what sends it); `times`, where each room's steps are timed (room_times.py);
    `conclude_in_poll`: SGLang's poll may conclude a room whose last chunk `add` queued (`conclude_launched`).
    `spawn(step, name)` runs `step` on a thread until the manager closes."""

    def __init__(
        self,
        *,
        count: int,
        spawn: Callable[[Callable[[], None], str], Any],
        request_status: Mapping[int, KVPoll],
        destinations: Mapping[int, Dict[str, TransferInfo]],
        peers: Mapping[str, wire.PeerRegister],
        rejected: Mapping[str, str],
        departed: Mapping[str, str],
        heads: Mapping[str, Optional[PairHeads]],
        state: Mapping[str, Sequence[Optional[StatePlan]]],
        route: Callable[[str], str],
        channels: Optional[PairChannels],
        same_host: SameHostPath,
        released: Callable[[], Optional[str]],
        one_sided: Optional[OneSidedSender],
        release: DeferredRelease,
        control: ControlChannel,
        session: str,
        prefill_rank: int,
        local: LocalMemory,
        fail_room: Callable[[int, str], None],
        succeed: Callable[..., Optional[Callable[[], None]]],
        times: Optional[RoomTimes] = None,
        launch_in_add: bool = False,
        alone: Callable[[int], bool] = lambda room: False,
        conclude_in_poll: bool = False,
    ):
        self.request_status = request_status
        self.destinations = destinations
        self.peers = peers
        self.rejected = rejected
        self.departed = departed
        self.heads = heads
        self.state = state
        self.route = route
        self.channels = channels
        self.same_host = same_host
        #: why the pools may not be read now (SGLang released the KV memory), None when they may
        self.released = released
        self.one_sided = one_sided
        self.release = release
        self.control = control
        self.session = session
        self.prefill_rank = prefill_rank
        self.local = local
        self.fail_room = fail_room
        self.succeed = succeed
        #: each room's steps timed (SGLANG_P2P_ROOM_TIMES; off: nothing recorded)
        self.times = times or RoomTimes(False)
        #: SGLANG_P2P_IPC_LAUNCH=scheduler: a same-host chunk's copy is queued by `add`, on SGLang's thread
        self.launch_in_add = launch_in_add
        self.alone = alone
        self.conclude_in_poll = conclude_in_poll
        # both only on SGLang's thread (`add`, `conclude_launched`, `forget`): no lock
        #: room -> its latest chunk queued, until its last is (each chunk links the one before: `previous`)
        self._latest: Dict[int, TransferTask] = {}
        #: room -> its last chunk, queued by `add`, until SGLang's poll concluded the room or found its worker had
        self._finishing: Dict[int, TransferTask] = {}
        #: rooms SGLang's poll concluded (the rest their workers did)
        self.concluded_in_poll = 0
        self.shards: List["queue.SimpleQueue[object]"] = [queue.SimpleQueue() for _ in range(count)]
        for i, shard in enumerate(self.shards):
            spawn(lambda s=shard: self._transfer_step(s), f"p2p-transfer-{i}")

    def _shard_of(self, session: str) -> "queue.SimpleQueue[object]":
        return self.shards[sum(session.encode()) % len(self.shards)]

    def reset_peer(self, session: str) -> None:
        """Queue a reset behind the peer's earlier chunks: its pair channel and IPC mapping go before its next."""
        self._shard_of(session).put(ResetPeer(session))

    def stop(self) -> None:
        """Wake every worker so it sees the manager stopping."""
        for shard in self.shards:
            shard.put(None)

    def add(self, task: TransferTask) -> None:
        """Queue a chunk of a live room with destinations on the worker that owns its first real decode rank."""
        status = self.request_status.get(task.room)
        if status is None or status == KVPoll.Failed:
            return
        infos = self.destinations.get(task.room)
        if not infos:
            return
        real = sorted(s for s, i in infos.items() if not i.is_dummy)
        task.previous = self._latest.pop(task.room, None)
        if not task.is_last:
            self._latest[task.room] = task
        if self.launch_in_add and len(real) == 1:
            self._launch(task, infos[real[0]])
            if task.is_last and task.launch is not None and self.conclude_in_poll:
                task.claim = threading.Lock()
                self._finishing[task.room] = task
        self._shard_of(real[0] if real else "").put(task)

    def rooms_held(self) -> List[int]:
        """Rooms with an entry in the tables kept for SGLang's poll (none once every sender was cleared)."""
        return sorted(set(self._latest) | set(self._finishing))

    def forget(self, room: int) -> None:
        """SGLang cleared the room's sender (its thread): nothing of it is left to conclude from its poll."""
        self._latest.pop(room, None)
        self._finishing.pop(room, None)

    def conclude_launched(self, room: int) -> None:
        """SGLang's poll, on its thread: conclude `room` here if its last chunk's copy was queued by `add` and has
        run, its worker has not taken the conclusion, and every earlier chunk's worker is done. The aux row is read,
        Success marked, and the aux row and Status go in one frame if they go without waiting; if not, they are
        queued for the worker that owns the peer, behind the chunk. Its worker, woken for the copy, then finds the
        room taken. Saves the worker's wake-up and its wait for the GIL after the copy (docs/serving.md, session 39).
        Anything else (a copy still running or failed, a room ended, a peer gone, the pools released) is the
        worker's."""
        task = self._finishing.get(room)
        if task is None:
            return
        if task.claim.locked():  # its worker took it
            del self._finishing[room]
            return
        previous = task.previous
        if previous is not None and not previous.finished:
            return
        try:
            if not task.launch.done():
                self.times.mark(room, "looked")  # how late this loop comes back to the copy's end (room times)
                return
        except Exception:  # noqa: BLE001 - a failed copy: its worker fails the room, naming CUDA's error
            return
        infos = self.destinations.get(room) or {}
        real = [info for info in list(infos.values()) if not info.is_dummy]
        if (len(real) != 1 or real[0].session not in self.peers or self.released() is not None
                or self.request_status.get(room) in (None, KVPoll.Failed, KVPoll.Success)):
            return
        if not task.claim.acquire(blocking=False):
            return
        del self._finishing[room]
        self.concluded_in_poll += 1
        self.times.by_poll(room)
        info = real[0]
        session = info.session
        self.times.mark(room, "written")
        self.times.mark_copy(room, task.launch)
        aux = self._aux(task, info)
        try:
            first = None if aux is None else {session: self._aux_message(session, room, *aux)}
            rest = self.succeed(room, now=True, first=first)  # the aux row and the Status in one frame
        except Exception as e:  # noqa: BLE001 - never into SGLang's scheduler: the worker fails the room, as its own
            logger.exception("p2pnccl: concluding room %s failed", room)
            why = f"prefill transfer error: {e!r}"
            self._shard_of(session).put(Conclude(room, lambda: self.fail_room(room, why)))
            return
        if rest is not None:
            self._shard_of(session).put(Conclude(room, rest))
            return
        self.times.mark(room, "concluded")

    def _launch(self, task: TransferTask, info: TransferInfo) -> None:
        """Queue the chunk's copy here, on SGLang's scheduler thread, which holds the GIL already: a worker woken
        for it first waits for the GIL, then plans and queues it as slowly (docs/serving.md, session 37). Only the
        plain case: whole pages of KV, no state, to one decode rank on the same-host path already mapped, nothing
        to wait for first. Anything else, or any error, leaves the chunk to its worker, which copies it (again) and reports
        what fails; the chunk is counted in flight from here, so an abort's ACK waits for the copy."""
        session = info.session
        if (task.wait_event is not None or (task.is_last and task.state_indices) or session not in self.peers
                or self.heads.get(session) is not None or self.released() is not None):
            return
        try:
            if task.indices_event is not None:  # the page ids' copy from the device: only when it already ran
                query = getattr(task.indices_event, "query", None)
                if query is None or not query():
                    return
                task.indices_event = None
                task.kv_indices = np.array(task.kv_indices, dtype=np.int32, copy=True)
            # a peer this path has not mapped (another host, or its first chunk) is its worker's: no routing here
            if not self.same_host.mapped(self.peers[session]) or self.route(session) != "cudaipc":
                return
            self.times.mark(task.room, "ready")
        except Exception as e:  # noqa: BLE001 - never into SGLang's scheduler: the worker copies it and reports
            logger.debug("p2pnccl: room %s chunk left to its worker: %r", task.room, e)
            return
        self.release.begin(task.room)  # before the copy is queued: an abort racing it must wait for it
        try:
            task.launch = self.same_host.launch(self.peers[session], task.kv_indices,
                                                info.dst_kv_indices[task.index_slice],
                                                lambda: self.release.poison(task.room), self._alone(task))
        except Exception as e:  # noqa: BLE001 - as above (a launch that raises left nothing running)
            logger.debug("p2pnccl: room %s chunk left to its worker: %r", task.room, e)
        if task.launch is None:  # nothing queued: counted again when its worker takes it
            self.release.end(task.room)
            return
        task.counted = True
        self.times.mark_write(task.room, self.same_host.last_write)
        self.times.mark(task.room, "returned")

    def _transfer_step(self, shard: "queue.SimpleQueue[object]") -> None:
        task = shard.get()
        if task is None:
            return
        if isinstance(task, ResetPeer):
            if self.channels is not None:
                self.channels.reset(task.session)
            self.same_host.reset(task.session)
            return
        if isinstance(task, Conclude):
            try:
                task.rest()
            except Exception as e:  # noqa: BLE001 - as a chunk's: the room ends with a reason
                logger.exception("p2pnccl: concluding room %s failed", task.room)
                self.fail_room(task.room, f"prefill transfer error: {e!r}")
            return
        self.times.mark(task.room, "picked")
        if not task.counted:
            self.release.begin(task.room)
        if task.trace is not None:
            tracing.worker_start(task.trace)
        try:
            self._process(task)
        except Exception as e:  # anything unexpected still ends the room with a reason
            logger.exception("p2pnccl: transfer of room %s failed", task.room)
            self.fail_room(task.room, f"prefill transfer error: {e!r}")
        finally:
            if task.trace is not None:
                tracing.worker_end(task.trace)
            self.release.end(task.room)
            task.previous, task.finished = None, True

    def _process(self, task: TransferTask) -> None:
        room = task.room
        launched, failed = task.launch, None
        if launched is not None:  # before anything may end the task: the pages stay in use until the copy ran
            try:
                launched.wait()
            except Exception as e:  # noqa: BLE001 - a copy that failed fails the room below
                failed = e
            if task.claim is not None and not task.claim.acquire(blocking=False):
                return  # SGLang's poll concluded the room (what it could not send is queued behind this)
        if task.wait_event is not None:
            task.wait_event.synchronize()
        infos = self.destinations.get(room)
        if infos is None or self.request_status.get(room) in (None, KVPoll.Failed):
            return
        why = self.released()
        if why is not None:  # counted in flight before this check: a release waits for what passed it
            self.fail_room(room, why)
            return
        if task.indices_event is not None:  # the page ids' copy from the device: read them once it ended
            task.indices_event.synchronize()
            task.indices_event = None
            task.kv_indices = np.array(task.kv_indices, dtype=np.int32, copy=True)
        if launched is None:
            self.times.mark(room, "ready")  # a launched chunk was ready when `add` queued it
        alive = lambda: self.request_status.get(room) not in (None, KVPoll.Failed)  # noqa: E731
        first: Dict[str, wire.AuxData] = {}  # decode rank -> the room's aux row, sent in its Status's frame
        for session, info in list(infos.items()):
            if info.is_dummy:
                continue
            if not alive():
                return
            if session not in self.peers:
                self.fail_room(room, f"decode rank {session} cannot receive: {self._why_gone(session)}")
                return
            heads = self.heads.get(session)
            if heads is not None and not heads.src.count:
                # a replica of heads another prefill rank sends this decode rank: no KV, only aux and Status
                src, dst = [_NO_IDS], [_NO_IDS]
            else:
                src, dst = [task.kv_indices], [info.dst_kv_indices[task.index_slice]]
            if task.is_last and task.state_indices:
                # group g is state component g-1 on both paths: a component without ids moves nothing
                for c, ids in enumerate(task.state_indices[: len(self.local.state)]):
                    usable = ids is not None and c < len(info.dst_state_indices)
                    src.append(np.asarray(ids, dtype=np.int32).reshape(-1) if usable else _NO_IDS)
                    dst.append(info.dst_state_indices[c] if usable else _NO_IDS)
            aux = self._aux(task, info)
            if launched is not None:  # its only real decode rank: the copy ran (or failed) above
                if failed is not None:
                    self.fail_room(room, f"KV transfer to decode rank {session} failed: {failed}")
                    return
                # written once the copy ran, before the aux row: where SGLang's poll marks it (conclude_launched)
                self.times.mark(room, "written")
                self.times.mark_copy(room, launched)
                if aux is not None:  # goes with the Status, in one frame (the room's only real decode rank)
                    first[session] = self._aux_message(session, room, *aux)
                continue
            started = time.perf_counter()
            try:
                aux_msg = self._deliver(info, src, dst, aux, alive, heads, self.state.get(session, ()),
                                        self._alone(task))
                if aux_msg is not None:
                    first[session] = aux_msg
            except (TransportError, ControlError, PlanError) as e:
                self.fail_room(room, f"KV transfer to decode rank {session} failed: {e}")
                return
            finally:
                if task.trace is not None:
                    tracing.session_slice(task.trace, started, session)
        if launched is None:
            self.times.mark(room, "written")
        if task.is_last and alive():
            self.succeed(room, first=first or None)
            self.times.mark(room, "concluded")

    def _why_gone(self, session: str) -> str:
        """Why a decode rank is not live here: refused, declared dead or released (recorded before it left the
        live table, so a worker racing its departure names the cause), else never registered."""
        return self.rejected.get(session) or self.departed.get(session) or "it is not registered"

    def _alone(self, task: TransferTask) -> bool:
        """Whether no forward pass runs beside this chunk's copy: the last chunk of the only request on this rank
        (an earlier chunk's next forward pass is queued behind it)."""
        return task.is_last and self.alone(task.room)

    def _deliver(self, info: TransferInfo, src: list, dst: list, aux: Optional[tuple], alive: Callable[[], bool],
                 heads: Optional[PairHeads] = None, state: Sequence[Optional[StatePlan]] = (),
                 alone: bool = False) -> Optional[wire.AuxData]:
        """One chunk to one decode rank over the transport `auto` picks now (`heads`: only that head range of
        the KV pages; `state[c]`: only those spans of state component c's items). Lack of communicator memory
        never fails it: the peer goes to Mooncake when it can, else the chunk waits for room (until the room ends).
        `alone`: no forward pass runs beside its copy (the same-host path's quickest route). Returns the chunk's
        aux row as the message that carries it ahead of the Status where it goes on the control channel (the
        same-host and NCCL paths: neither reaches host memory); Mooncake writes it with the KV."""
        session, room = info.session, info.room
        unsettled = lambda: self.release.poison(room)  # noqa: E731
        waiting_since = None
        while alive():
            peer = self.peers.get(session)
            if peer is None:
                raise TransportError(self._why_gone(session))
            route = self.route(session)
            if route == "cudaipc":
                if not self.same_host.send(peer, src, dst, heads, unsettled, state, alone):
                    continue  # not mappable after all: routed again (NCCL)
                self.times.mark_write(room, self.same_host.last_write)
                return None if aux is None else self._aux_message(session, room, *aux)
            if route == "mooncake":
                self.one_sided.send(peer, src, dst, aux, heads, unsettled, state)
                return None
            try:
                self.channels.send(session, room, self.prefill_rank, src, dst, info.next_seq, alive, heads, state)
            except NoRoom as e:
                self.channels.no_room_until[session] = time.monotonic() + _NO_ROOM_BACKOFF_S
                if waiting_since is None:
                    waiting_since = time.monotonic()
                    logger.info("p2pnccl: room %s waits for a pair channel to decode rank %s: %s", room, session, e)
                if self.route(session) != "mooncake":
                    time.sleep(_NO_ROOM_BACKOFF_S)
                continue
            if waiting_since is not None:
                logger.info("p2pnccl: room %s got a pair channel after %.2fs", room, time.monotonic() - waiting_since)
            return None if aux is None else self._aux_message(session, room, *aux)
        return None

    @staticmethod
    def _aux(task: TransferTask, info: TransferInfo) -> Optional[tuple]:
        """(this rank's aux index, the decode's) where the chunk carries the room's aux row to `info`'s rank."""
        if task.is_last and task.aux_index is not None and info.dst_aux_index >= 0:
            return task.aux_index, info.dst_aux_index
        return None

    def _aux_message(self, session: str, room: int, src_index: int, dst_index: int) -> wire.AuxData:
        """The aux rows as host bytes for the control channel (two-sided and same-host peers: neither NCCL nor
        CUDA IPC reaches host memory), read now: SGLang may reuse the row once the room's Success is marked."""
        # every buffer both sides have, each row at the shorter of the two sides' row sizes (as aux_descriptors)
        lens = [min(r.item_len, n) for r, n in zip(self.local.aux, self.peers[session].aux_item_lens)]
        return wire.AuxData(self.session, room, dst_index, self.local.aux_row(src_index, lens))
