"""SGLang adapter of the p2pnccl backend: KV manager, sender, receiver and bootstrap server.

Shaped like SGLang's Mooncake backend (`disaggregation/mooncake/conn.py`): the Common classes do bootstrap,
rank mapping, heartbeat and timeouts; this module adds one control thread per role on the manager's PULL
socket, prefill transfer queues sharded by decode peer (so one peer's chunks stay ordered), and translates
SGLang's calls into engine calls. The data path lives in `engine/` and imports nothing from SGLang.

Protocol (all on the ordered control channel, see engine/messages.py):
  decode -> prefill: PeerRegister once per pair (with the transports it receives with, and its Mooncake
  session when it runs one), RoomMetadata per request, SGLang's ABORT frames;
  prefill -> decode, two-sided peer (nccl, tcp): CommInit + ChunkHeader before each chunk's bytes on the
  pair channel, AuxData (host rows), then Status. The decode applies a prefill's Success only after its own
  receives of every chunk announced before it (engine/arrivals.py), and after the aux row, so SGLang's
  metadata gate passes;
  prefill -> decode, one-sided peer (mooncake): nothing but Status. Each chunk (its page runs of every
  region; on the last chunk the state slots and the aux row too) is one Mooncake batch write into the
  decode's registered memory, done before Status is sent (engine/onesided.py).
Which transport serves a decode rank is chosen per peer on the prefill (engine/transport/select.py, logged
once per peer); a process starts only the transports `SGLANG_P2P_TRANSPORT` needs (`process_transports`).

Release differences (SGLang 0.5.17 vs 0.5.23) are absorbed here: both have the Common manager state,
`update_status`, `record_failure`, `_prepare_send_indices`, the timeouts and the heartbeat; everything else
(status messages, polling, failure exceptions) is implemented here once for both.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import numpy.typing as npt
import torch
import zmq

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

try:  # deferred decode KV release (SGLang 0.5.23+); 0.5.17 has none of it and keeps the plain abort path
    from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG, AbortAck, AbortNotification
except ImportError:
    ABORT_ACK_TAG = AbortAck = AbortNotification = None

from sglang_p2p_backend.engine import messages as wire
from sglang_p2p_backend.engine.arrivals import ArrivalTracker
from sglang_p2p_backend.engine.comm_budget import CommBudget, NoRoom, cap_from_wire, cap_to_wire
from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.copier import PageCopier
from sglang_p2p_backend.engine.control import ControlChannel, ControlError
from sglang_p2p_backend.engine.memory import page_views, regions_from_lists
from sglang_p2p_backend.engine.onesided import LocalMemory, OneSidedSender, aux_descriptors
from sglang_p2p_backend.engine.pipeline import PairReceiver, PairSender
from sglang_p2p_backend.engine.plan import PlanError
from sglang_p2p_backend.engine.staging import StagingPool
from sglang_p2p_backend.engine.transport import one_sided_transport, two_sided_transport
from sglang_p2p_backend.engine.transport.base import OneSidedTransport, TransportError, TwoSidedTransport
from sglang_p2p_backend.engine.transport.select import (
    Choice,
    PeerFacts,
    TransportSelector,
    process_transports,
    rdma_present,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100
#: after a "no room for a communicator" answer, a peer is not offered NCCL again for this long
_NO_ROOM_BACKOFF_S = 0.05


def _ids(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.int32)


_NO_IDS = np.zeros(0, dtype=np.int32)


def _no_staging(nbytes: int) -> torch.Tensor:
    raise TransportError("this rank runs no two-sided transport (SGLANG_P2P_TRANSPORT=mooncake): no staging")


@dataclass
class TransferInfo:
    """One decode rank's destinations for one room (prefill side). Field names follow Mooncake's, which
    Common code reads (`endpoint`, `dst_port`, `is_dummy`, `required_dst_info_num`)."""

    session: str
    room: int
    dst_kv_indices: np.ndarray
    dst_aux_index: int
    dst_state_indices: List[np.ndarray]
    required_dst_info_num: int
    decode_prefix_len: int
    is_dummy: bool

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
class _ResetPeer:
    """Queued behind a peer's earlier chunks: drop its pair channel (the decode rank re-registered)."""

    session: str


@dataclass
class _Shard:
    queue: "queue.SimpleQueue[object]" = field(default_factory=queue.SimpleQueue)
    thread: Optional[threading.Thread] = None


class P2pNcclKVManager(CommonKVManager):
    # SGLang 0.5.23+ may hold an aborted room's decode pages until every prefill rank ACKs that no write
    # into them is in flight (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE); unused by 0.5.17
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: Optional[bool] = False,
        **kwargs: Any,
    ):
        self.config = EngineConfig.from_env()
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.session = f"{self.local_ip}:{self.rank_port}"
        self.hostname = socket.gethostname()
        self.prefill_rank = self.attn_tp_rank * (self.pp_size * self.attn_cp_size) + (
            self.pp_rank * self.attn_cp_size + self.attn_cp_rank
        )
        self.device = self._kv_device(args)
        self.kv_regions = regions_from_lists(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
        self.state_regions = [
            regions_from_lists(p, n, i)
            for p, n, i in zip(
                getattr(args, "state_data_ptrs", []) or [],
                getattr(args, "state_data_lens", []) or [],
                getattr(args, "state_item_lens", []) or [],
            )
        ]
        self.views = [page_views(self.kv_regions, self.device)] + [
            page_views(r, self.device) for r in self.state_regions
        ]
        self.copier = PageCopier(self.views)
        aux = regions_from_lists(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        self.local_memory = LocalMemory(self.kv_regions, self.state_regions, aux)
        self.transports = process_transports(
            self.config.transport,
            gpu=self.device.type == "cuda",
            rdma_present=rdma_present(),
            mooncake_available=importlib.util.find_spec("mooncake") is not None,
        )
        self.two_sided: Optional[TwoSidedTransport] = None
        if self.transports.two_sided:
            self.two_sided = two_sided_transport(
                self.transports.two_sided, self.device, self.local_ip, self.config.io_timeout
            )
        self.staging = StagingPool(
            self.two_sided.alloc_staging if self.two_sided else _no_staging,
            self.config.slot_bytes,
            self.config.staging_slots,
        )
        self.one_sided: Optional[OneSidedTransport] = None
        if self.transports.mooncake:
            self.one_sided = one_sided_transport(
                self.transports.mooncake,
                self.local_ip,
                getattr(args, "ib_device", None),
                int(getattr(args, "gpu_id", 0) or 0),
                self.config.io_timeout,
            )
            # both sides register: the decode so the prefill may write into it, the prefill so RDMA may read
            # its sources; aux rows included (they travel in the last chunk's batch)
            self.one_sided.register(self.local_memory.regions())
        self.control = ControlChannel()
        # prefill: orders "a write of room r starts" against "r is aborted, ACK if nothing is in flight"
        self._flight_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._init_prefill()
        else:
            self._init_decode()

    # ------------------------------------------------------------------ common
    def _kv_device(self, args: KVArgs) -> torch.device:
        if self.config.transport != "tcp" and torch.cuda.is_available():
            return torch.device("cuda", int(getattr(args, "gpu_id", 0) or 0))
        return torch.device("cpu")

    def _spawn(self, target, name: str, *a) -> threading.Thread:
        t = threading.Thread(target=target, args=a, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _control_send(self, session: str, msg: wire.Message) -> None:
        """Best effort: a peer that cannot be reached is logged; its rooms fail by their own timeouts."""
        try:
            self.control.send(session, msg)
        except ControlError as e:
            logger.warning("p2pnccl: %s", e)

    def _control_loop(self, handle) -> None:
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            frames = self.server_socket.recv_multipart()
            try:
                handle(frames)
            except Exception:
                logger.exception("p2pnccl control thread: error handling a message")

    def close(self) -> None:
        """Stop this manager's threads and release its channels, staging and sockets (tests, shutdown)."""
        if self._stop.is_set():
            return
        self._stop.set()
        # unblock anything waiting on a peer first (pending accepts, staging waits), then stop the threads
        if self.two_sided is not None:
            self.two_sided.close()
        self.staging.close()
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            for shard in self.shards:
                shard.queue.put(None)
            for t in self._threads:
                t.join(timeout=5)
            for sender in list(self.senders.values()):
                sender.close()
        else:
            for receiver in list(self.receivers.values()):
                receiver.close()
            for t in self._threads:
                t.join(timeout=5)
        # after the workers stopped: deregistering memory under a running write is not safe
        if self.one_sided is not None:
            self.one_sided.close()
        self.control.close()

    # ------------------------------------------------------------------ prefill
    def _init_prefill(self) -> None:
        self.decode_peers: Dict[str, wire.PeerRegister] = {}
        self.rejected_peers: Dict[str, str] = {}
        self.senders: Dict[str, PairSender] = {}
        self.selector = TransportSelector(self.config.transport)
        # pair communicators live within a GPU-memory budget (engine/comm_budget.py); `auto` asks it whether
        # one more fits before choosing NCCL over Mooncake for a peer
        self.comm_budget = CommBudget.from_env("prefill", self._evict_pair) if self.two_sided else None
        self._offers: Dict[int, "queue.Queue[wire.CommAnswer]"] = {}
        self._offer_ids = itertools.count(1)
        self._no_room_until: Dict[str, float] = {}
        self.nccl_admits: Callable[[str], bool] = self._nccl_admits
        self.one_sided_sender = OneSidedSender(self.one_sided, self.local_memory) if self.one_sided else None
        self.shards = [_Shard() for _ in range(self.config.workers)]
        for i, shard in enumerate(self.shards):
            shard.thread = self._spawn(self._transfer_worker, f"p2p-transfer-{i}", shard)
        self._spawn(self._control_loop, "p2p-prefill-control", self._handle_prefill_frames)

    def _handle_prefill_frames(self, frames: List[bytes]) -> None:
        msg = wire.decode(frames)
        if msg is None:
            if frames and frames[0] == b"ABORT":
                self._on_decode_abort(frames)
            return
        if isinstance(msg, wire.PeerRegister):
            self._on_register(msg)
        elif isinstance(msg, wire.RoomMetadata):
            self._on_metadata(msg)
        elif isinstance(msg, wire.CommAnswer):
            answer = self._offers.get(msg.offer)
            if answer is not None:
                answer.put(msg)
        elif isinstance(msg, wire.CommRelease) and self.comm_budget is not None:
            if self.comm_budget.close_if_idle(msg.session):
                logger.info("p2pnccl: released the idle pair channel of decode rank %s (its budget is full)", msg.session)

    def _check_peer(self, reg: wire.PeerRegister) -> Optional[str]:
        args = self.kv_args
        if reg.page_size != args.page_size:
            return f"page size differs: prefill --page-size {args.page_size}, decode {reg.page_size}; launch both with the same --page-size"
        if reg.kv_dtype != str(args.kv_cache_dtype_str):
            return f"KV cache dtype differs: prefill {args.kv_cache_dtype_str}, decode {reg.kv_dtype}; launch both with the same --kv-cache-dtype"
        if list(reg.kv_item_lens) != [r.item_len for r in self.kv_regions]:
            return (
                f"KV layout differs: prefill has {len(self.kv_regions)} regions of "
                f"{sorted({r.item_len for r in self.kv_regions})} bytes per page, decode {len(reg.kv_item_lens)} of "
                f"{sorted(set(reg.kv_item_lens))}; prefill and decode must run the same model, TP and page size"
            )
        if [list(x) for x in reg.state_item_lens] != [[r.item_len for r in comp] for comp in self.state_regions]:
            return "state component layout differs between prefill and decode (same model and TP needed)"
        if not self._common_transports(reg):
            return (
                f"no transport in common: this prefill rank moves pages with {self.transports.names()}, the decode "
                f"rank receives with {list(reg.transports)}; set the same SGLANG_P2P_TRANSPORT on prefill and decode"
            )
        return None

    def _common_transports(self, reg: wire.PeerRegister) -> List[str]:
        offered = [t for t in reg.transports if t != "mooncake" or reg.mooncake_session]
        return [t for t in self.transports.names() if t in offered]

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
        )
        return self.selector.choose(session, facts)

    def _nccl_admits(self, session: str) -> bool:
        if time.monotonic() < self._no_room_until.get(session, 0.0):
            return False
        return self.comm_budget is None or self.comm_budget.fits(session)

    def _evict_pair(self, session: str) -> None:
        """Close the idle pair channel of `session` for the pool (called with the pool's lock held, so the
        owning worker cannot start a transfer on it) and tell the decode, which drops its end in order."""
        sender = self.senders.get(session)
        generation = sender.close_channel() if sender is not None else None
        if generation is not None:
            self._control_send(session, wire.CommClosed(self.session, generation))

    def _open_pair(self, session: str, sender: PairSender) -> None:
        """Admit a new pair channel in this rank's budget, agree its cap with the decode's budget, open it.
        Raises NoRoom when either side has no room now, TransportError when it cannot be opened."""
        decision = self.comm_budget.admit(session)
        try:
            offer = next(self._offer_ids)
            answers: "queue.Queue[wire.CommAnswer]" = queue.Queue(1)
            self._offers[offer] = answers
            try:
                self.control.send(session, wire.CommOffer(self.session, offer, cap_to_wire(decision.cap)))
                answer = answers.get(timeout=self.config.connect_timeout)
            except queue.Empty:
                raise TransportError(
                    f"decode rank {session} did not answer the pair-channel offer within "
                    f"{self.config.connect_timeout:.0f}s (SGLANG_P2P_CONNECT_TIMEOUT)"
                ) from None
            finally:
                self._offers.pop(offer, None)
            if answer.cap < 0:
                raise NoRoom(f"decode rank {session}: {answer.reason}")
            cap = cap_from_wire(answer.cap)
            sender.open(cap)
            self.comm_budget.opened(session, cap)
        except BaseException:
            self.comm_budget.closed(session)
            raise

    def _send_two_sided(self, session: str, room: int, src: list, dst: list, alive: Callable[[], bool]) -> None:
        """Send over the peer's pair channel, opening one within the budget when it has none (or lost it)."""
        sender = self._pair_sender(session)
        try:
            while alive():
                with self.comm_budget.using(session) as live:
                    if live and sender.comm is not None:
                        sender.send(room, self.prefill_rank, src, dst, keep_going=alive)
                        return
                if live:  # the pool counts a channel the sender lost: forget it before opening a new one
                    self.comm_budget.closed(session)
                self._open_pair(session, sender)
        except TransportError:
            self.comm_budget.closed(session)
            raise

    def _send_one_sided(self, room: int, peer: wire.PeerRegister, src: list, dst: list, aux: Optional[tuple]) -> None:
        try:
            self.one_sided_sender.send(peer, src, dst, aux)
        except PlanError:
            raise  # found before any byte moved
        except BaseException:
            self._poison_unsettled(room)
            raise

    def _deliver(self, session: str, room: int, src: list, dst: list, aux: Optional[tuple], alive: Callable[[], bool]) -> None:
        """One chunk to one decode rank over the transport `auto` picks now. Lack of communicator memory never
        fails it: the peer goes to Mooncake when it can, else the chunk waits for room (until the room ends)."""
        waiting_since = None
        while alive():
            if self._route(session).transport == "mooncake":
                self._send_one_sided(room, self.decode_peers[session], src, dst, aux)
                return
            try:
                self._send_two_sided(session, room, src, dst, alive)
            except NoRoom as e:
                self._no_room_until[session] = time.monotonic() + _NO_ROOM_BACKOFF_S
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

    def _on_register(self, reg: wire.PeerRegister) -> None:
        problem = self._check_peer(reg)
        if problem:
            logger.error("p2pnccl: decode rank %s rejected: %s", reg.session, problem)
            self.rejected_peers[reg.session] = problem
            self.decode_peers.pop(reg.session, None)
            return
        self.rejected_peers.pop(reg.session, None)
        self.decode_peers[reg.session] = reg
        self.selector.forget(reg.session)
        if self.one_sided is not None and reg.mooncake_session:
            # a failed Mooncake session is skipped until its decode rank registers again: now
            self.one_sided.peer_registered(reg.mooncake_session)
        # a re-registration means the decode rank restarted: its old pair channel is gone; the owning worker
        # creates a fresh one on its next chunk
        self._shard_of(reg.session).queue.put(_ResetPeer(reg.session))

    def _on_metadata(self, msg: wire.RoomMetadata) -> None:
        room = msg.room
        problem = self.rejected_peers.get(msg.session)
        info = TransferInfo(
            session=msg.session,
            room=room,
            dst_kv_indices=_ids(msg.kv_ids),
            dst_aux_index=msg.aux_index,
            dst_state_indices=[_ids(x) for x in msg.state_ids],
            required_dst_info_num=msg.required_dst_info_num,
            decode_prefix_len=msg.decode_prefix_len,
            is_dummy=msg.is_dummy,
        )
        infos = self.transfer_infos.setdefault(room, {})
        infos[msg.session] = info
        if problem:
            self._fail_room(room, f"decode rank {msg.session} rejected: {problem}")
            return
        if not msg.is_dummy and msg.session not in self.decode_peers:
            self._fail_room(room, f"decode rank {msg.session} sent metadata before registering")
            return
        if len(infos) == msg.required_dst_info_num:
            self.resolve_kv_replica_factor(infos)
            self.req_to_decode_prefix_len[room] = msg.decode_prefix_len
            self.update_status(room, KVPoll.WaitingForInput)

    def _on_decode_abort(self, frames: List[bytes]) -> None:
        """A decode rank aborted `room`: fail it here. With deferred decode KV release (0.5.23+) the decode
        holds the room's pages until this rank ACKs; the ACK goes out once no write of the room is in flight
        (now, or when the last in-flight task of the room ends: `_flight_end`)."""
        target = None
        if AbortNotification is not None:
            note = AbortNotification.from_zmq(frames)
            if note is None:
                return
            room, who = note.room, f"{note.decode_ip}:{note.decode_port}"
            if self._deferred_release():
                target = note.deferred_ack_target()  # None for a decode that did not arm (no generation)
        else:
            try:
                room = int(frames[1])
                who = f"{frames[2].decode()}:{frames[3].decode()}"
            except (IndexError, ValueError):
                logger.warning("p2pnccl: malformed ABORT frames %r", frames[:4])
                return
        # under the flight lock: a task that starts after this block sees Failed before its first write,
        # one that started before it is counted in _staging_outstanding, so the ACK waits for it
        with self._flight_lock:
            if room in self.request_status:
                self.record_failure(room, f"Aborted by decode rank {who}")
                self.update_status(room, KVPoll.Failed)
            if target is not None:
                self.register_deferred_ack_target(room, target)
        if target is not None:
            self._maybe_ack_drained_abort(room)

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

    def _fail_room(self, room: int, reason: str) -> None:
        """Fail `room` here and tell every real decode rank of it (once)."""
        already = self.request_status.get(room) == KVPoll.Failed
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
        self.update_status(room, KVPoll.Failed)
        if not already:
            self._notify_decode(room, KVPoll.Failed, reason)

    def _notify_decode(self, room: int, status: int, reason: str = "") -> None:
        for info in list((self.transfer_infos.get(room) or {}).values()):
            if info.is_dummy:
                continue
            try:
                self.control.send(info.session, wire.Status(self.session, room, self.prefill_rank, int(status), reason))
            except ControlError as e:
                logger.warning("p2pnccl: room %s: %s", room, e)

    def notify_aborted(self, room: int) -> None:
        self._notify_decode(room, KVPoll.Failed, "Aborted on prefill by AbortReq")

    def _shard_of(self, session: str) -> _Shard:
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
        self._shard_of(real[0] if real else "").queue.put(task)

    def _transfer_worker(self, shard: _Shard) -> None:
        while True:
            task = shard.queue.get()
            if task is None:
                return
            if isinstance(task, _ResetPeer):
                sender = self.senders.pop(task.session, None)
                if sender is not None:
                    sender.close()
                if self.comm_budget is not None:
                    self.comm_budget.closed(task.session)
                continue
            self._flight_begin(task.room)
            try:
                self._process(task)
            except Exception as e:  # anything unexpected still ends the room with a reason
                logger.exception("p2pnccl: transfer of room %s failed", task.room)
                self._fail_room(task.room, f"prefill transfer error: {e!r}")
            finally:
                self._flight_end(task.room)

    def _pair_sender(self, session: str) -> PairSender:
        sender = self.senders.get(session)
        if sender is None:
            sender = self.senders[session] = PairSender(
                transport=self.two_sided,
                staging=self.staging,
                copier=self.copier,
                local_session=self.session,
                control=lambda m, s=session: self.control.send(s, m),
                connect_timeout=self.config.connect_timeout,
                io_timeout=self.config.io_timeout,
            )
        return sender

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
            peer = self.decode_peers.get(session)
            if peer is None:
                reason = self.rejected_peers.get(session, "it is not registered")
                self._fail_room(room, f"decode rank {session} cannot receive: {reason}")
                return
            src, dst = [task.kv_indices], [info.dst_kv_indices[task.index_slice]]
            if task.is_last and task.state_indices:
                # group g is state component g-1 on both paths: a component without ids moves nothing
                for c, ids in enumerate(task.state_indices[: len(self.state_regions)]):
                    usable = ids is not None and c < len(info.dst_state_indices)
                    src.append(np.asarray(ids, dtype=np.int32).reshape(-1) if usable else _NO_IDS)
                    dst.append(info.dst_state_indices[c] if usable else _NO_IDS)
            aux = (task.aux_index, info.dst_aux_index) if task.is_last and _has_aux(task, info) else None
            try:
                self._deliver(session, room, src, dst, aux, alive)
            except (TransportError, ControlError, PlanError) as e:
                self._fail_room(room, f"KV transfer to decode rank {session} failed: {e}")
                return
        if task.is_last and alive():
            self._notify_decode(room, KVPoll.Success)
            self.update_status(room, KVPoll.Success)

    def _send_aux(self, session: str, room: int, src_index: int, dst_index: int) -> None:
        """The aux rows as host bytes on the control channel (two-sided peers: NCCL cannot reach host memory)."""
        src, _, lens = aux_descriptors(self.local_memory.aux, self.decode_peers[session], src_index, dst_index)
        rows = [ctypes.string_at(int(a), int(n)) for a, n in zip(src, lens)]
        self.control.send(session, wire.AuxData(room, dst_index, rows))

    # ------------------------------------------------------------------ decode
    def _init_decode(self) -> None:
        self.receivers: Dict[str, PairReceiver] = {}
        self.live_rooms: set = set()
        self.incompatible_prefills: Dict[str, str] = {}
        self.arrivals = ArrivalTracker(self._apply_prefill_final)
        # the decode admits pair channels within its own budget but never closes one: the prefill owns the
        # pair's traffic, so the decode asks it to release an idle channel instead (CommRelease)
        self.comm_budget = CommBudget.from_env("decode") if self.two_sided else None
        self._spawn(self._control_loop, "p2p-decode-control", self._handle_decode_frames)
        self._start_heartbeat_checker_thread()

    def registration(self) -> wire.PeerRegister:
        args = self.kv_args
        return wire.PeerRegister(
            session=self.session,
            hostname=self.hostname,
            engine_rank=int(args.engine_rank),
            attn_tp_size=int(self.attn_tp_size),
            page_size=int(args.page_size),
            kv_dtype=str(args.kv_cache_dtype_str),
            kv_ptrs=[int(p) for p in args.kv_data_ptrs],
            kv_item_lens=[int(x) for x in args.kv_item_lens],
            aux_ptrs=[int(p) for p in args.aux_data_ptrs],
            aux_item_lens=[int(x) for x in args.aux_item_lens],
            state_ptrs=[[r.ptr for r in comp] for comp in self.state_regions],
            state_item_lens=[[r.item_len for r in comp] for comp in self.state_regions],
            transports=self.transports.names(),
            mooncake_session=self.one_sided.session_id() if self.one_sided else "",
        )

    def _receiver(self, session: str) -> PairReceiver:
        receiver = self.receivers.get(session)
        if receiver is None:
            receiver = self.receivers[session] = PairReceiver(
                transport=self.two_sided,
                staging=self.staging,
                copier=self.copier,
                peer_session=session,
                wanted=self.room_wanted,
                on_chunk=self.arrivals.landed,
                connect_timeout=self.config.connect_timeout,
                io_timeout=self.config.io_timeout,
                on_channel=lambda init, s=session: self._channel_changed(s, init),
            )
        return receiver

    def room_wanted(self, room: int) -> bool:
        return room in self.live_rooms and self.request_status.get(room) not in (None, KVPoll.Failed)

    def forget_room(self, room: int) -> None:
        self.live_rooms.discard(room)
        self.arrivals.forget(room)

    def _handle_decode_frames(self, frames: List[bytes]) -> None:
        msg = wire.decode(frames)
        if msg is None:
            if ABORT_ACK_TAG is not None and frames and frames[0] == ABORT_ACK_TAG:
                self._on_abort_ack(frames)
            return
        if isinstance(msg, (wire.CommInit, wire.ChunkHeader)) and self.two_sided is None:
            # cannot happen with a compatible prefill (it saw our transports at registration); fail, do not hang
            if isinstance(msg, wire.ChunkHeader):
                reason = f"prefill {msg.session} sent two-sided chunks but this decode rank runs only {self.transports.names()}"
                self.arrivals.final(msg.room, msg.prefill_rank, False, reason)
        elif isinstance(msg, wire.CommOffer):
            self._on_offer(msg)
        elif isinstance(msg, wire.CommInit):
            self._receiver(msg.session).submit(msg)
        elif isinstance(msg, wire.ChunkHeader):
            self.arrivals.announce(msg.room, msg.prefill_rank, msg.session)
            self.comm_budget.touch(msg.session)
            self._receiver(msg.session).submit(msg)
        elif isinstance(msg, wire.CommClosed):
            receiver = self.receivers.get(msg.session)
            if receiver is not None:
                receiver.closed_by_peer(msg.generation)
        elif isinstance(msg, wire.AuxData):
            self._write_aux(msg)
        elif isinstance(msg, wire.Status):
            self.arrivals.final(msg.room, msg.prefill_rank, msg.status == KVPoll.Success, msg.reason)

    def _on_abort_ack(self, frames: List[bytes]) -> None:
        """A prefill rank's writes into an aborted room drained (SGLang 0.5.23+ deferred release). Chunks of a
        two-sided channel are scattered into the pages by this rank's receiver thread of that prefill, so the
        ACK counts only once that thread finished every chunk queued before it; otherwise at once."""
        ack = AbortAck.from_zmq(frames) if self.enable_deferred_decode_kv_release else None
        peers = self.arrivals.peers(ack.room, ack.prefill_rank) if ack is not None else []
        receivers = [self.receivers[p] for p in peers if p in self.receivers]
        if not receivers:
            self.handle_abort_ack_message(frames)
            return
        left, lock = [len(receivers)], threading.Lock()

        def drained() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.handle_abort_ack_message(frames)  # note_abort_ack for the armed generation

        for receiver in receivers:
            receiver.submit(drained)

    def _on_offer(self, msg: wire.CommOffer) -> None:
        """A prefill wants a pair channel: answer the cap this rank's budget affords, or no room (and ask the
        least recently used prefill with an idle channel to release it, so a retry finds room)."""
        if self.comm_budget is None:
            answer = wire.CommAnswer(self.session, msg.offer, -1, f"this decode rank runs no two-sided transport ({self.transports.names()})")
        else:
            # a new offer replaces this prefill's channel (its receiver drops the old one at the CommInit)
            self.comm_budget.closed(msg.session)
            try:
                decision = self.comm_budget.admit(msg.session, cap_from_wire(msg.cap), evict=False)
                answer = wire.CommAnswer(self.session, msg.offer, cap_to_wire(decision.cap))
            except NoRoom as e:
                answer = wire.CommAnswer(self.session, msg.offer, -1, f"decode communicator budget full: {e}")
                others = [p for p in self.comm_budget.idle_peers() if p != msg.session]
                if others:
                    self._control_send(others[0], wire.CommRelease(self.session))
        self._control_send(msg.session, answer)

    def _channel_changed(self, session: str, init: Optional[wire.CommInit]) -> None:
        """The receiver of `session` joined a channel (`init`) or dropped one (None): keep the budget true.
        (Receivers exist only where a two-sided transport runs, so there is a budget.)"""
        if init is None:
            self.comm_budget.closed(session)
        else:
            self.comm_budget.opened(session, cap_from_wire(init.cap) if init.cap >= 0 else -1)

    def _write_aux(self, msg: wire.AuxData) -> None:
        if not self.room_wanted(msg.room) or msg.aux_index < 0:
            return
        args = self.kv_args
        for ptr, item_len, row in zip(args.aux_data_ptrs, args.aux_item_lens, msg.rows):
            ctypes.memmove(ptr + item_len * msg.aux_index, row, min(len(row), item_len))

    def _apply_prefill_final(self, room: int, prefill_rank: int, success: bool, reason: str) -> None:
        if room not in self.request_status:
            return
        if not success:
            self.record_failure(room, reason or "Failed to get kvcache from prefill instance, it might be dead")
            self.update_status(room, KVPoll.Failed)
            return
        done = self.prefill_response_tracker[room]
        done.add(prefill_rank)
        if len(done) >= self.required_prefill_response_num_table.get(room, 1):
            self.update_status(room, KVPoll.Success)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Common's check, plus what p2pnccl cannot do; a mismatch fails the requests instead of raising
        into the decode scheduler."""
        if bootstrap_addr in self.incompatible_prefills:
            self._fail_rooms_of(bootstrap_addr, self.incompatible_prefills[bootstrap_addr])
            return False
        try:
            ok = super().try_ensure_parallel_info(bootstrap_addr)
        except RuntimeError as e:
            return self._mark_incompatible(bootstrap_addr, str(e))
        info = self.prefill_info_table.get(bootstrap_addr) if ok else None
        if info is not None and not self.is_mla_backend and info.attn_tp_size != self.attn_tp_size:
            self.prefill_info_table.pop(bootstrap_addr, None)
            return self._mark_incompatible(
                bootstrap_addr,
                f"p2pnccl does not slice MHA heads: prefill attention TP is {info.attn_tp_size} but decode "
                f"attention TP is {self.attn_tp_size}; launch both with the same --tp (or --disaggregation-"
                f"transfer-backend mooncake, which slices heads)",
            )
        return ok

    def _mark_incompatible(self, bootstrap_addr: str, reason: str) -> bool:
        logger.error("p2pnccl: prefill %s cannot serve this decode: %s", bootstrap_addr, reason)
        self.incompatible_prefills[bootstrap_addr] = reason
        self._fail_rooms_of(bootstrap_addr, reason)
        return False

    def _fail_rooms_of(self, bootstrap_addr: str, reason: str) -> None:
        for room in list(self.addr_to_rooms_tracker.get(bootstrap_addr, ())):
            if self.request_status.get(room) not in (None, KVPoll.Success, KVPoll.Failed):
                self.record_failure(room, reason)
                self.update_status(room, KVPoll.Failed)


def _has_aux(task: TransferTask, info: TransferInfo) -> bool:
    return task.aux_index is not None and info.dst_aux_index >= 0


def _latched_poll(obj, timed_state: int, check_timeout) -> KVPoll:
    """Poll shared by sender and receiver: a concluded state sticks (SGLang polls after conclusion), and
    SGLang's own timeout applies while the room sits in `timed_state`."""
    if obj.conclude_state is not None:
        return obj.conclude_state
    status = obj.kv_mgr.request_status.get(obj.bootstrap_room, KVPoll.Failed)
    if status in (KVPoll.Success, KVPoll.Failed):
        obj.conclude_state = status
    elif status == timed_state:
        timed_out = check_timeout()
        if timed_out is not None:
            return timed_out
    return status


def _raise_failure(obj, mgr: P2pNcclKVManager) -> None:
    if obj.conclude_state is None:
        obj.conclude_state = KVPoll.Failed
    obj.clear()
    with mgr.failure_lock:
        reason = mgr.failure_records.pop(obj.bootstrap_room, None)
    propagated = reason is None
    raise KVTransferError(
        obj.bootstrap_room, reason or "Failed due to an unknown reason from another rank", is_from_another_rank=propagated
    )


class P2pNcclKVSender(CommonKVSender):
    def __init__(self, mgr: P2pNcclKVManager, bootstrap_addr: str, bootstrap_room: int, *args: Any, **kwargs: Any):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        if getattr(self, "init_time", None) is None:
            self.init_time = time.time()

    def send(self, kv_indices: npt.NDArray[np.int32], state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None, **kwargs: Any):
        if self.conclude_state is not None:
            return
        kv_indices, index_slice, is_last, skip = self._prepare_send_indices(kv_indices, state_indices)
        if skip:
            return
        wait_event = kwargs.get("wait_event") or getattr(self, "_early_send_wait_event", None)
        self.kv_mgr.add_transfer_request(
            self.bootstrap_room,
            kv_indices,
            index_slice,
            is_last,
            aux_index=self.aux_index if is_last else None,
            state_indices=state_indices if is_last else None,
            num_kv_tokens=num_kv_tokens,
            wait_event=wait_event,
        )
        self._record_transfer_indices(kv_indices, state_indices)

    def poll(self) -> KVPoll:
        return _latched_poll(self, KVPoll.Bootstrapping, self._check_bootstrap_timeout)

    def failure_exception(self):
        _raise_failure(self, self.kv_mgr)

    def abort(self):
        super().abort()
        self.kv_mgr.notify_aborted(self.bootstrap_room)


class P2pNcclKVReceiver(CommonKVReceiver):
    def __init__(self, mgr: P2pNcclKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None, **kwargs: Any):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, **kwargs)
        reason = mgr.incompatible_prefills.get(bootstrap_addr)
        if reason:
            mgr.record_failure(bootstrap_room, reason)
            mgr.update_status(bootstrap_room, KVPoll.Failed)

    def _register_kv_args(self) -> bool:
        reg = self.kv_mgr.registration()
        for info in self.bootstrap_infos:
            endpoint = f"{info['rank_ip']}:{info['rank_port']}"
            try:
                self.kv_mgr.control.send(endpoint, reg)
            except ControlError as e:
                self.kv_mgr.record_failure(self.bootstrap_room, f"registering with prefill rank {endpoint} failed: {e}")
                self.conclude_state = KVPoll.Failed
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                return False
        return True

    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        decode_prefix_len: Optional[int] = None,
        destination: Any = None,
        device_kv_indices: Any = None,
        **kwargs: Any,
    ):
        if destination is not None and getattr(destination, "value", destination) != "device":
            raise NotImplementedError("p2pnccl receives into device KV pages only (no decode host receive)")
        mgr: P2pNcclKVManager = self.kv_mgr
        room = self.bootstrap_room
        if getattr(self, "bootstrap_infos", None) is None:
            mgr.record_failure(room, f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}")
            mgr.update_status(room, KVPoll.Failed)
            return
        mgr.live_rooms.add(room)
        ids = np.asarray(kv_indices, dtype=np.int32).tobytes()
        states = [np.asarray(s if s is not None else [], dtype=np.int32).reshape(-1).tobytes() for s in (state_indices or [])]
        for info in self.bootstrap_infos:
            dummy = bool(info.get("is_dummy", False))
            msg = wire.RoomMetadata(
                session=mgr.session,
                room=room,
                kv_ids=b"" if dummy else ids,
                aux_index=-1 if dummy or aux_index is None else int(aux_index),
                state_ids=[] if dummy else states,
                required_dst_info_num=int(self.required_dst_info_num),
                decode_prefix_len=int(decode_prefix_len or 0),
                is_dummy=dummy,
            )
            endpoint = f"{info['rank_ip']}:{info['rank_port']}"
            try:
                mgr.control.send(endpoint, msg)
            except ControlError as e:
                mgr.record_failure(room, f"send_metadata to prefill rank {endpoint} failed: {e}")
                self.conclude_state = KVPoll.Failed
                mgr.update_status(room, KVPoll.Failed)
                return
        self.init_time = time.time()

    def poll(self) -> KVPoll:
        return _latched_poll(self, KVPoll.WaitingForInput, self._check_waiting_timeout)

    def failure_exception(self):
        _raise_failure(self, self.kv_mgr)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_room(self.bootstrap_room)

    def abort(self):
        super().abort()
        self.kv_mgr.forget_room(self.bootstrap_room)


class P2pNcclKVBootstrapServer(CommonKVBootstrapServer):
    pass
