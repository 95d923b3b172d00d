"""Prefill transfer workers: each room's chunks to its decode ranks over the transport `auto` picks per peer.

`add_transfer_request` (SGLang's sender calls it per send()) queues a task on the worker that owns the room's
decode peer (peers are sharded over SGLANG_P2P_WORKERS queues, so one peer's chunks stay ordered). A worker
moves the chunk to every real decode rank of the room: one copy kernel into a same-host decode's mapped pages
(prefill_ipc.py), two-sided over the pair channel (pair_channels.py), or one-sided with Mooncake
(engine/transport/onesided.py), only the heads that rank owns when its attention TP differs
(engine/copy/heads.py; a rank holding a replica another rank sends moves no KV); after the last chunk, Status. With SGLang 0.5.23's deferred
decode KV release, tasks in flight are counted per room, so an aborted room's ACK waits for them.
Mixed into `prefill.PrefillKVManager`, whose state it uses.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import numpy as np
import numpy.typing as npt

from sglang.srt.disaggregation.base.conn import KVPoll

try:  # deferred decode KV release (SGLang 0.5.23+)
    from sglang.srt.disaggregation.common.conn import AbortNotification
except ImportError:
    AbortNotification = None

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.pair.comm_budget import NoRoom
from sglang_p2p_backend.engine.wire.control import ControlError
from sglang_p2p_backend.engine.copy.heads import PairHeads
from sglang_p2p_backend.engine.transport.onesided import aux_descriptors
from sglang_p2p_backend.engine.copy.plan import PlanError
from sglang_p2p_backend.engine.transport.base import TransportError
from sglang_p2p_backend.engine.transport.select import Choice, PeerFacts

logger = logging.getLogger(__name__)

#: after a "no room for a communicator" answer, a peer is not offered NCCL again for this long
_NO_ROOM_BACKOFF_S = 0.05
_NO_IDS = np.zeros(0, dtype=np.int32)


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
    next_seq: Callable[[], int] = field(default_factory=lambda: itertools.count().__next__)

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


@dataclass
class ResetPeer:
    """Queued behind a peer's earlier chunks: drop its pair channel (re-registered, or dead)."""

    session: str



class TransferWorkers:
    def _deferred_release(self) -> bool:
        """SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is on and the release has the machinery (0.5.23+)."""
        return AbortNotification is not None and bool(getattr(self, "enable_deferred_decode_kv_release", False))

    def _flight_begin(self, room: int) -> None:
        """A transfer task of `room` starts: counted before `_process` checks the room is alive."""
        if self._deferred_release():
            with self._flight_lock:
                self._staging_outstanding[room] += 1

    def _flight_end(self, room: int) -> None:
        """A transfer task of `room` ended; the last one of an aborted room sends the held ACKs."""
        if not self._deferred_release():
            return
        with self._flight_lock:
            left = self._staging_outstanding.get(room, 0) - 1
            if left > 0:
                self._staging_outstanding[room] = left
            else:
                self._staging_outstanding.pop(room, None)
        if left <= 0:
            self._maybe_ack_drained_abort(room)  # pops the targets: at most one ACK per abort

    def _poison_unsettled(self, room: int) -> None:
        """A write into the decode's pages failed in a way that cannot prove it stopped (a Mooncake batch
        may still run after its sync call returned an error): never ACK; the decode falls back to its
        release timeout."""
        if self._deferred_release():
            with self._flight_lock:
                self.poison_deferred_ack_room(room)

    # ------------------------------------------------------------------ transfers
    def _shard_of(self, session: str) -> "queue.SimpleQueue[object]":
        return self.shards[sum(session.encode()) % len(self.shards)]

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        num_kv_tokens: Optional[int] = None,
        *,
        wait_event: Any = None,
        **_: Any,
    ) -> None:
        status = self.request_status.get(bootstrap_room)
        if status is None or status == KVPoll.Failed:
            return
        infos = self.transfer_infos.get(bootstrap_room)
        if not infos:
            return
        task = TransferTask(
            bootstrap_room,
            np.array(kv_indices, dtype=np.int32, copy=True),
            index_slice,
            is_last_chunk,
            aux_index,
            state_indices,
            wait_event,
        )
        real = sorted(s for s, i in infos.items() if not i.is_dummy)
        self._shard_of(real[0] if real else "").put(task)

    def _transfer_step(self, shard: "queue.SimpleQueue[object]") -> None:
        task = shard.get()
        if task is None:
            return
        if isinstance(task, ResetPeer):
            if self.channels is not None:
                self.channels.reset(task.session)
            self._ipc_reset(task.session)
            return
        self._flight_begin(task.room)
        try:
            self._process(task)
        except Exception as e:  # anything unexpected still ends the room with a reason
            logger.exception("p2pnccl: transfer of room %s failed", task.room)
            self._fail_room(task.room, f"prefill transfer error: {e!r}")
        finally:
            self._flight_end(task.room)

    def _process(self, task: TransferTask) -> None:
        room = task.room
        if task.wait_event is not None:
            task.wait_event.synchronize()
        infos = self.transfer_infos.get(room)
        if infos is None or self.request_status.get(room) in (None, KVPoll.Failed):
            return
        alive = lambda: self.request_status.get(room) not in (None, KVPoll.Failed)  # noqa: E731
        for session, info in list(infos.items()):
            if info.is_dummy:
                continue
            if not alive():
                return
            if session not in self.decode_peers:
                reason = self.rejected_peers.get(session, "it is not registered (or was declared dead)")
                self._fail_room(room, f"decode rank {session} cannot receive: {reason}")
                return
            heads = self.peer_heads.get(session)
            if heads is not None and not heads.src.count:
                # a replica of heads another prefill rank sends this decode rank: no KV, only aux and Status
                src, dst = [_NO_IDS], [_NO_IDS]
            else:
                src, dst = [task.kv_indices], [info.dst_kv_indices[task.index_slice]]
            if task.is_last and task.state_indices:
                # group g is state component g-1 on both paths: a component without ids moves nothing
                for c, ids in enumerate(task.state_indices[: len(self.state_regions)]):
                    usable = ids is not None and c < len(info.dst_state_indices)
                    src.append(np.asarray(ids, dtype=np.int32).reshape(-1) if usable else _NO_IDS)
                    dst.append(info.dst_state_indices[c] if usable else _NO_IDS)
            aux = (task.aux_index, info.dst_aux_index) if task.is_last and task.aux_index is not None and info.dst_aux_index >= 0 else None
            try:
                self._deliver(info, src, dst, aux, alive, heads)
            except (TransportError, ControlError, PlanError) as e:
                self._fail_room(room, f"KV transfer to decode rank {session} failed: {e}")
                return
        if task.is_last and alive():
            self._notify_decode(room, KVPoll.Success)
            self.update_status(room, KVPoll.Success)

    def _route(self, session: str) -> Choice:
        """Which transport serves this decode rank now (logged once per peer, and when it changes)."""
        reg = self.decode_peers[session]
        facts = PeerFacts(
            same_host=reg.hostname == self.hostname,
            rdma_present=self.transports.mooncake == "rdma",
            nccl_fits=lambda: self.nccl_admits(session),
            gpu=self.device.type == "cuda",
            mooncake_available=self.one_sided is not None,
            peer_offers=tuple(self._common_transports(reg)),
            ipc=lambda: self._ipc_usable(session),
        )
        return self.selector.choose(session, facts)

    def _common_transports(self, reg: wire.PeerRegister) -> List[str]:
        offered = [t for t in reg.transports if (t != "mooncake" or reg.mooncake_session) and (t != "cudaipc" or reg.ipc)]
        return [t for t in self.transports.names() if t in offered]

    def _deliver(self, info: TransferInfo, src: list, dst: list, aux: Optional[tuple], alive: Callable[[], bool],
                 heads: Optional[PairHeads] = None) -> None:
        """One chunk to one decode rank over the transport `auto` picks now (`heads`: only that head range of
        the KV pages). Lack of communicator memory never fails it: the peer goes to Mooncake when it can, else
        the chunk waits for room (until the room ends)."""
        session, room = info.session, info.room
        waiting_since = None
        while alive():
            peer = self.decode_peers.get(session)
            if peer is None:
                raise TransportError(f"decode rank {session} was declared dead")
            route = self._route(session).transport
            if route == "cudaipc":
                if self._send_ipc(room, peer, src, dst, aux, heads):
                    return
                continue  # not mappable after all: routed again (NCCL)
            if route == "mooncake":
                self._send_one_sided(room, peer, src, dst, aux, heads)
                return
            try:
                self.channels.send(session, room, self.prefill_rank, src, dst, info.next_seq, alive, heads)
            except NoRoom as e:
                self.channels.no_room_until[session] = time.monotonic() + _NO_ROOM_BACKOFF_S
                if waiting_since is None:
                    waiting_since = time.monotonic()
                    logger.info("p2pnccl: room %s waits for a pair channel to decode rank %s: %s", room, session, e)
                if self._route(session).transport != "mooncake":
                    time.sleep(_NO_ROOM_BACKOFF_S)
                continue
            if waiting_since is not None:
                logger.info("p2pnccl: room %s got a pair channel after %.2fs", room, time.monotonic() - waiting_since)
            if aux is not None and alive():
                self._send_aux(session, room, *aux)
            return

    def _send_one_sided(self, room: int, peer: wire.PeerRegister, src: list, dst: list, aux: Optional[tuple],
                        heads: Optional[PairHeads] = None) -> None:
        try:
            self.one_sided_sender.send(peer, src, dst, aux, heads)
        except PlanError:
            raise  # found before any byte moved
        except BaseException:
            self._poison_unsettled(room)
            raise

    def _send_aux(self, session: str, room: int, src_index: int, dst_index: int) -> None:
        """The aux rows as host bytes on the control channel (two-sided peers: NCCL cannot reach host memory)."""
        src, _, lens = aux_descriptors(self.local_memory.aux, self.decode_peers[session], src_index, dst_index)
        rows = [ctypes.string_at(int(a), int(n)) for a, n in zip(src, lens)]
        self.control.send(session, wire.AuxData(self.session, room, dst_index, rows))
