"""Decode role of the p2pnccl KV manager: registration with prefill ranks, destinations, arrivals.

A decode rank registers with each prefill rank it needs (PeerRegister: its agreement, pools, transports and a
fresh pair secret) and reads the answer (PeerAnswer, which must carry that secret), comparing the prefill's
agreement itself, so a mismatch is refused and logged on both sides with both values. What it sends a prefill
rank before the answer (destinations, SGLang's ABORT) is held until then: after an acceptance it confirms the
registration (a Heartbeat carrying the prefill's secret) and sends them; after a refusal it sends them all the
same, so the prefill fails its side of those rooms at once. Only accepted prefill ranks are heard, and only
with the secret this rank issued them (engine/wire/pair_secret.py): chunk headers, channel offers, aux
rows and statuses of anyone else are dropped without a thread, socket or table entry. Every chunk is checked
before its bytes are scattered (engine/wire/checks.py): exact size, in sequence, and only into pages the room
published (with a different attention TP, only the heads of this rank that prefill rank owns: engine/copy/heads.py);
a chunk that fails fails its room and never lands elsewhere. A room's Success counts only from the prefill ranks
it was published to, and on a rank that receives only two-sided, only once every published page has landed; the
aux rows and chunks of a prefill rank that does not serve a room are dropped, and an ABORT_ACK counts only for the
sender's own rank of a room it was sent. A prefill silent for
SGLANG_P2P_PEER_TIMEOUT is dead: its rooms fail with the reason, its receiver's channel is aborted and its
thread, budget and socket are released; the next request registers again. Without SGLang's deferred release, a
failure this rank starts of a room a prefill may write one-sided is held until those prefill ranks answered that
no write is in flight (failure_hold.py), so SGLang does not hand the room's pages on under a running write.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import msgspec
import numpy as np

from sglang.srt.disaggregation.base.conn import KVPoll

try:  # deferred decode KV release (SGLang 0.5.23+)
    from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG, AbortAck
except ImportError:
    ABORT_ACK_TAG = AbortAck = None

from sglang_p2p_backend.engine.wire import checks
from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.agreement import differences, pair_state_spans
from sglang_p2p_backend.engine.pair.arrivals import ArrivalTracker
from sglang_p2p_backend.engine.copy.heads import Heads, HeadsError, pair_heads
from sglang_p2p_backend.engine.copy.state_slices import StateSliceError
from sglang_p2p_backend.engine.pair.channels import PairReceivers
from sglang_p2p_backend.engine.wire.control import ControlError
from sglang_p2p_backend.engine.transport.base import TransportError
from sglang_p2p_backend.adapter.bounded import Bounded
from sglang_p2p_backend.adapter.failure_hold import FailureHolds, process_gone
from sglang_p2p_backend.adapter.kv_fault import KVCorruption
from sglang_p2p_backend.adapter.scatter_gate import ScatterGate
from sglang_p2p_backend.adapter.manager import P2pNcclKVManagerBase
from sglang_p2p_backend.adapter.server_ranks import rank_endpoints

logger = logging.getLogger(__name__)

#: a prefill rank that refused this decode rank is asked again no sooner than this (it may be fixed or restarted)
_RETRY_REFUSED_S = 5.0
#: frame lists held for one prefill rank while its answer is awaited (rooms published meanwhile, aborts)
_HELD_MAX = 4096
#: the prefill rank a chunk of a room its sender does not serve is received under: outside every wire Rank, so
#: nothing its receiver reports of it (refused, channel lost) reaches a room's arrivals
_NOT_SERVING = 1 << 16
#: rooms whose ABORT_ACK senders are kept at most: failed rooms SGLang may still hold (their pages wait for the
#: ACKs or SGLang's release timeout); far more than a decode rank runs at once
_ROOM_SERVERS_MAX = 65536


@dataclass
class PrefillPeer:
    """This decode rank's registration with one prefill rank."""

    state: str  # "pending" (registered, no answer yet), "accepted", "refused"
    since: float
    reason: str = ""
    prefill_rank: int = -1
    incarnation: int = -1
    #: the heads of this rank's rows the prefill writes (different attention TP, MHA/GQA); None: whole pages
    kv_heads: Optional[Heads] = None
    #: the spans of this rank's state items the prefill writes, per component (different attention TP); (): whole
    state_spans: tuple = ()
    #: frame lists for the prefill held until its answer (then sent, carrying its secret)
    held: list = field(default_factory=list)


class DecodeKVManager(P2pNcclKVManagerBase):
    _role = "decode"

    def _init_role(self) -> None:
        self.prefills: Dict[str, PrefillPeer] = {}
        #: a registration's state turning and its held frames going out, against SGLang's thread holding or sending
        #: (`send_to_prefill`): nothing is appended to a list already sent, nor sent ahead of what was held
        self._held_lock = threading.Lock()
        #: rooms waiting for KV: what each published (the only pages its chunks may write)
        self.live_rooms: Dict[int, checks.Published] = {}
        #: the RoomMetadata each live room sent each prefill rank: sent again when that rank released us
        self._room_frames: Dict[int, Dict[str, List[bytes]]] = {}
        #: every prefill rank each room's destinations went to (dummies too: each ACKs an abort), the only ranks
        #: whose ABORT_ACK counts for it (SGLang 0.5.23's deferred release). A failed room's entry outlives its
        #: receiver's clear(): SGLang reads the failure (failure_exception, which clears) before it arms the hold
        #: and sends ABORT, so the ACKs come after; it goes with clear_deferred_abort_state, or as the oldest
        self._room_servers: Bounded = Bounded(_ROOM_SERVERS_MAX)
        #: bootstrap address -> (why SGLang's check refused that prefill server, when): retried after a while
        self.incompatible_prefills: Dict[str, tuple[str, float]] = {}
        #: rooms of a refused prefill server its ranks were told of, and those ranks (per bootstrap address)
        self._told_rooms: Dict[int, float] = {}
        self._refused_ranks: Dict[str, List[str]] = {}
        #: a rank that receives only two-sided sees every page land, so a Success must cover every published page
        self.two_sided_only = self.two_sided is not None and self.one_sided is None and self.ipc is None
        #: failures held while a prefill may still write one-sided (failure_hold.py); SGLang's deferred decode
        #: KV release, where on, holds the pages itself (armed for every failed transfer, ACKed after the drain)
        self.holds = FailureHolds(self.config.failure_hold_s)
        self.hold_failures = not self.two_sided_only and not getattr(self, "enable_deferred_decode_kv_release", False)
        #: prefill ranks declared dead whose process may still run (a frozen one), as long as a hold may wait
        self._maybe_writing: Dict[str, float] = {}
        self.arrivals = ArrivalTracker(self._apply_prefill_final)
        #: SGLANG_P2P_DEVICE_SCATTER: a room's failure waits while a scatter of its chunks is queued on the GPU
        #: (scatter_gate.py); bounded by the wait for its receive and for the channel's work after an abort
        self.scatter_gate = ScatterGate(self.config.failure_hold_s + 2 * self.config.io_timeout)
        self.kv_fault = KVCorruption(self.config.test_corrupt_kv_file, self.views[0], self.device)
        self.channels = PairReceivers(
            self.two_sided, self.staging, self.copier, self.session, self.config, send=self._control_send,
            wanted=self.room_wanted, on_chunk=self.arrivals.landed, check=self._check_chunk,
            on_queued=self._scatter_queued, on_ended=self._scatter_ended,
        ) if self.two_sided else None
        self.comm_budget = self.channels.budget if self.channels else None
        if self.ipc is not None:
            # exported once: KV regions, then state components' regions (the order of kv_ptrs, state_ptrs)
            self.ipc.register(self.local_memory.pool_regions())
            if self.ipc.export is None and self.config.transport == "cudaipc":
                raise TransportError(f"SGLANG_P2P_TRANSPORT=cudaipc, but this decode rank's KV pool cannot be exported "
                                     f"through CUDA IPC: {self.ipc.unavailable}; use SGLANG_P2P_TRANSPORT=auto or nccl")
        self._start_heartbeat_checker_thread()

    # ------------------------------------------------------------------ registration
    def registration(self) -> wire.PeerRegister:
        args = self.kv_args
        export = self.ipc.export if self.ipc is not None else None
        return wire.PeerRegister(
            session=self.session,
            incarnation=self.incarnation,
            hostname=self.hostname,
            engine_rank=int(args.engine_rank),
            attn_tp_size=int(self.attn_tp_size),
            agreement=self.agreement,
            kv_ptrs=[int(p) for p in args.kv_data_ptrs],
            aux_ptrs=[int(p) for p in args.aux_data_ptrs],
            aux_item_lens=[int(x) for x in args.aux_item_lens],
            state_ptrs=[[r.ptr for r in comp] for comp in self.state_regions],
            kv_pages=min((r.num_items for r in self.kv_regions), default=0),
            aux_rows=min((r.num_items for r in self.local_memory.aux), default=0),
            state_slots=[min((r.num_items for r in comp), default=0) for comp in self.state_regions],
            transports=[t for t in self.transports.names() if t != "cudaipc" or export is not None],
            mooncake_session=self.one_sided.session_id() if self.one_sided else "",
            ipc=export,
        )

    def ensure_registered(self, endpoint: str) -> None:
        """Register with prefill rank `endpoint` unless a registration is pending or accepted (a refused or
        dead one is tried again: the prefill may have been fixed or restarted). Raises ControlError."""
        peer = self.prefills.get(endpoint)
        if peer is not None and (peer.state in ("pending", "accepted") or time.monotonic() - peer.since < _RETRY_REFUSED_S):
            return
        self.prefills[endpoint] = PrefillPeer("pending", time.monotonic())
        self.watch.watch(endpoint)
        self.control.set_secret(endpoint, None)  # its secret of an earlier registration is void
        reg = self.registration()
        reg.secret = self.issued.issue(endpoint)
        self.control.send(endpoint, reg)

    def heartbeat_peers(self) -> List[str]:
        """Watched prefill ranks that answered the registration: before its answer (and the pair secret in it) a
        heartbeat would reach the prefill without the secret and be dropped as a stranger's."""
        return [p for p in self.watch.peers() if getattr(self.prefills.get(p), "state", "") != "pending"]

    def send_to_prefill(self, endpoint: str, frames: List[bytes], block: bool = True) -> None:
        """Send to prefill rank `endpoint`, or hold until it answered the registration. Raises ControlError."""
        with self._held_lock:
            peer = self.prefills.get(endpoint)
            if peer is not None and peer.state == "pending":
                if len(peer.held) >= _HELD_MAX:
                    raise ControlError(f"prefill rank {endpoint} has not answered the registration; {_HELD_MAX} "
                                       "messages wait")
                peer.held.append(frames)
                return
        self.control.send_frames(endpoint, frames, block)

    def send_room(self, endpoint: str, room: int, frames: List[bytes]) -> None:
        """Publish `room`'s destinations to prefill rank `endpoint` (kept while the room lives). Raises
        ControlError."""
        self._room_frames.setdefault(room, {})[endpoint] = frames
        if getattr(self, "enable_deferred_decode_kv_release", False):  # only ABORT_ACKs read it (0.5.23+)
            self._room_servers[room] = self._room_servers.get(room, frozenset()) | {endpoint}
        self.send_to_prefill(endpoint, frames)

    def _released(self, endpoint: str, reason: str) -> None:
        """Prefill rank `endpoint` gave this idle registration's slot to another decode rank: forget it, and if
        rooms still wait for that rank, register again now and publish them again (one that crossed the release
        was dropped there)."""
        logger.warning("p2pnccl: %s", reason)
        self.prefills.pop(endpoint, None)
        self._writer_gone(endpoint)  # it released an idle registration: none of our rooms is written there
        self.watch.forget(endpoint)
        if self.channels is not None:
            self.channels.peer_dead(endpoint, reason)
        self.control.forget(endpoint)
        self.issued.forget(endpoint)
        rooms = [r for r, sent in self._room_frames.items() if endpoint in sent and self.room_wanted(r)]
        try:
            for room in rooms:
                self.ensure_registered(endpoint)
                self.send_to_prefill(endpoint, self._room_frames[room][endpoint])
        except ControlError as e:
            for room in rooms:
                self.room_failed(room, f"registering again with prefill rank {endpoint} failed: {e}")

    def _release_held(self, endpoint: str, peer: PrefillPeer, state: str) -> None:
        """The registration answered: its state turns to `state` and what waited for the answer goes out, in
        order, before anything SGLang's thread sends once it reads the new state. Under the lock SGLang's thread
        takes to send (`send_to_prefill`), so none of these waits for the socket's room: a frame that finds its
        queue full (a prefill that stopped reading) is logged, as a failed send, and its room left to the timeouts
        that end a silent peer's rooms."""
        with self._held_lock:
            peer.state = state
            held, peer.held = peer.held, []
            for frames in held:
                try:
                    self.control.send_frames(endpoint, frames, block=False)
                except ControlError as e:
                    logger.warning("p2pnccl: %s", e)

    def _admit(self, msg: wire.Message, secret: Optional[bytes]) -> bool:
        if self.issued.matches(msg.session, secret):
            return True
        # an older release cannot carry our secret: its refusal is heard (it names both protocol versions)
        peer = self.prefills.get(msg.session)
        return (isinstance(msg, wire.PeerAnswer) and secret is None and bool(msg.problem) and peer is not None
                and peer.state == "pending" and msg.agreement.protocol != self.agreement.protocol)

    def _unauthenticated(self, frames: List[bytes], problem: str) -> None:
        """Keys differ: the prefill's refusal (carrying our secret, so from the rank we registered with) counts."""
        secret, msg = self._unauthenticated_message(frames)
        if isinstance(msg, wire.PeerAnswer) and msg.problem and self.issued.matches(msg.session, secret):
            self._on_answer(msg)

    def _on_answer(self, msg: wire.PeerAnswer) -> None:
        peer = self.prefills.get(msg.session)
        if peer is None or peer.state == "refused" or (peer.state == "accepted" and not msg.problem):
            self.drop("unexpected", msg.session, "PeerAnswer to no pending registration")
            return
        reason = msg.problem or "; ".join(differences(self.agreement, msg.agreement, "decode", "prefill"))
        kv_heads, state_spans = None, ()
        if not reason:
            try:
                kv_heads = self._heads_from(msg)
            except HeadsError as e:
                reason = f"KV heads cannot be paired: {e}"
            try:
                # the same spans the prefill computed, from both agreements (nothing about them travels per chunk)
                state_spans = tuple(p.dst if p is not None else None for p in
                                    pair_state_spans(msg.agreement, msg.attn_tp_rank, self.agreement, self.attn_tp_rank))
            except StateSliceError as e:
                reason = "; ".join(filter(None, (reason, f"state cannot be paired: {e}")))
        self.control.set_secret(msg.session, msg.secret)
        if reason:
            logger.error("p2pnccl: prefill rank %s cannot serve this decode rank: %s", msg.session, reason)
            peer.reason, peer.since = reason, time.monotonic()
            self._release_held(msg.session, peer, "refused")  # the prefill fails its side of these rooms
            self.watch.forget(msg.session)
            self._fail_rooms_served_by(msg.session, f"prefill rank {msg.session} refused this decode rank: {reason}")
            self._writer_gone(msg.session)
            return
        peer.prefill_rank, peer.incarnation = msg.prefill_rank, msg.incarnation
        peer.kv_heads = kv_heads
        peer.state_spans = state_spans
        # confirms the registration from our address: the prefill makes us a live peer on reading it. Sent before
        # the state turns: SGLang's thread sends straight once it reads "accepted", and a frame of it ahead of
        # this confirmation reached a prefill that did not know our secret yet, which dropped it as a stranger's
        # (an ABORT so lost left the prefill's side of its room to SGLang's bootstrap timeout)
        self._control_send(msg.session, wire.Heartbeat(self.session, self.incarnation))
        self._release_held(msg.session, peer, "accepted")

    def _heads_from(self, msg: wire.PeerAnswer) -> Optional[Heads]:
        """The heads prefill rank `msg` writes into this rank's rows (the same pairing it computed). Raises
        HeadsError."""
        theirs = msg.agreement
        if self.agreement.mla or theirs.mla:
            return None
        heads = pair_heads(total=max(self.kv_total_heads, theirs.kv_total_heads), page_size=self.agreement.page_size,
                           src_tp=theirs.attn_tp_size, src_rank=msg.attn_tp_rank, dst_tp=self.attn_tp_size,
                           dst_rank=self.attn_tp_rank)
        return heads.dst if heads is not None else None

    def publish(self, room: int, published: checks.Published) -> None:
        self.live_rooms[room] = published
        self._room_servers.pop(room, None)  # this attempt's: send_room adds each rank it goes to

    def refusal(self, endpoint: str) -> Optional[str]:
        """Why prefill rank `endpoint` refused this decode rank, if it did (rooms to it fail at once)."""
        peer = self.prefills.get(endpoint)
        return f"prefill rank {endpoint} refused this decode rank: {peer.reason}" if peer and peer.state == "refused" else None

    def room_wanted(self, room: int) -> bool:
        return (room in self.live_rooms and self.request_status.get(room) not in (None, KVPoll.Failed)
                and not self.scatter_gate.waiting(room))

    def forget_room(self, room: int, succeeded: bool = False) -> None:
        """SGLang has the room's pages now (cleared or aborted). `succeeded`: it concluded Success, so no abort
        of it can follow and nobody ACKs it."""
        self.holds.forget(room)
        self.scatter_gate.forget(room)
        self.live_rooms.pop(room, None)
        self._room_frames.pop(room, None)
        self.arrivals.forget(room)
        if succeeded:
            self._room_servers.pop(room, None)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """SGLang released a held room's pages (decode.py `_do_release`): its ACKs count no more."""
        clear = getattr(super(), "clear_deferred_abort_state", None)  # SGLang 0.5.23+
        if clear is not None:
            clear(bootstrap_room)
        self._room_servers.pop(bootstrap_room, None)

    def _stop_transfers(self, reason: str) -> None:
        """Released: rooms still waiting for KV fail (SGLang releases a decode with none: its transfer queue must be
        empty), their one-sided writers told as for any failure of ours; none is published until the resume
        (`refuse_released`), and a late chunk of a failed room is received and dropped, never scattered."""
        for room in list(self.live_rooms):
            self.room_failed(room, reason)

    def refuse_released(self, room: int, endpoints: List[str]) -> None:
        """SGLang opened `room` while the pools are released: it fails before anything is published, and its
        prefill ranks are told (RoomFailed), so their senders fail now rather than at their bootstrap timeout."""
        reason = self.kv_released or "this rank's KV memory is released"
        self.room_failed(room, reason)
        frames = wire.encode(wire.RoomFailed(self.session, room, reason))
        for endpoint in endpoints:
            try:
                self.ensure_registered(endpoint)
                self.send_to_prefill(endpoint, frames, block=False)
            except ControlError as e:
                logger.warning("p2pnccl: %s", e)  # that rank's sender ends by its own timeout

    def _memory_resumed(self) -> None:
        """SGLang resumed the pools (manager.py `register_buffer_to_engine`). Prefills mapped them through CUDA IPC
        at registration; torch_memory_saver's memory, the only kind a pause frees, is never exportable, so the
        export should still name them: checked, since a stale mapping would be wrong KV reported as Success."""
        changed = self.ipc.export_changed(self.local_memory.pool_regions()) if self.ipc is not None else None
        if changed:
            self._fatal(f"p2pnccl: this decode rank's KV pools were exported through CUDA IPC and {changed} after "
                        "release/resume_memory_occupation; prefills would write the old memory: restart this "
                        "server, or run it with SGLANG_P2P_TRANSPORT=nccl")

    def _fail_rooms_served_by(self, session: str, reason: str) -> None:
        for room, pub in list(self.live_rooms.items()):
            if session in pub.prefills:
                self.room_failed(room, reason)

    # ------------------------------------------------------------------ inbound
    def _on_message(self, msg: wire.Message) -> None:
        session = msg.session
        peer = self.prefills.get(session)
        if isinstance(msg, wire.PeerAnswer):
            self._on_answer(msg)
            return
        if peer is None or peer.state != "accepted":
            self.drop("unregistered", session, f"{type(msg).__name__} from a prefill rank this decode rank is not registered with")
            return
        if isinstance(msg, wire.Heartbeat):
            if msg.incarnation == peer.incarnation:
                self.watch.seen(session)
            return
        self.watch.seen(session)
        if isinstance(msg, (wire.CommOffer, wire.CommInit, wire.ChunkHeader, wire.CommClosed)) and self.channels is None:
            # cannot happen with a compatible prefill (it saw our transports at registration); fail, do not hang
            self.drop("unexpected", session, f"{type(msg).__name__}: this decode rank runs only {self.transports.names()}")
            if isinstance(msg, wire.ChunkHeader):
                self.room_failed(msg.room, f"prefill {session} sent two-sided chunks but this decode rank runs only {self.transports.names()}")
        elif isinstance(msg, wire.CommOffer):
            self.channels.offered(msg)
        elif isinstance(msg, wire.CommInit):
            if msg.transport != self.two_sided.name:
                self.drop("bounds", session, f"CommInit for transport {msg.transport!r}, this rank runs {self.two_sided.name}")
            else:
                self.channels.joined(msg)
        elif isinstance(msg, wire.ChunkHeader):
            self._on_chunk(msg, peer)
        elif isinstance(msg, wire.CommClosed):
            self.channels.closed_by_peer(msg)
        elif isinstance(msg, wire.AuxData):
            self._on_aux(msg)
        elif isinstance(msg, wire.Status):
            self._on_status(msg, peer)
        elif isinstance(msg, wire.PeerReleased):
            self._released(session, msg.reason)
        else:
            self.drop("unexpected", session, f"{type(msg).__name__} is not for a decode rank")

    def _on_chunk(self, msg: wire.ChunkHeader, peer: PrefillPeer) -> None:
        published = self.live_rooms.get(msg.room)
        if published is not None and msg.session not in published.prefills:
            self.drop("not-owner", msg.session, f"chunk of room {msg.room}, which it does not serve")
            # its bytes follow on its channel: received in step and dropped, under a rank no room waits on
            msg = msgspec.structs.replace(msg, prefill_rank=_NOT_SERVING)
        elif published is not None and msg.prefill_rank == peer.prefill_rank:
            self.arrivals.announce(msg.room, msg.prefill_rank, msg.session)
        self.channels.chunk(msg)

    def _check_chunk(self, header: wire.ChunkHeader) -> checks.ChunkVerdict:
        """The receiver's checks of a chunk (its thread, arrival order): the room's published pages and sequence."""
        if header.prefill_rank == _NOT_SERVING:  # logged by _on_chunk
            in_step = checks.chunk_header(header, self.copier.item_lens, self.staging.slot_bytes, None).in_step
            return checks.ChunkVerdict(None, [], f"room {header.room}: prefill {header.session} does not serve this "
                                                 f"room", in_step)
        peer = self.prefills.get(header.session)
        rank_ok = peer is not None and header.prefill_rank == peer.prefill_rank
        published = self.live_rooms.get(header.room) if rank_ok else None
        verdict = checks.chunk_header(header, self.copier.item_lens, self.staging.slot_bytes, published,
                                      peer.kv_heads if peer is not None else None,
                                      peer.state_spans if peer is not None else ())
        if verdict.chunk is not None and published is not None and verdict.ids:
            published.received.append(verdict.ids[0])  # scattered before its arrival counts (ArrivalTracker)
        if verdict.problem and (published is not None or not rank_ok):
            logger.error("p2pnccl: chunk from prefill %s refused: %s", header.session, verdict.problem)
        return verdict

    def _on_aux(self, msg: wire.AuxData) -> None:
        published = self.live_rooms.get(msg.room)
        if published is None:
            return  # a late row of a concluded room
        if msg.session not in published.prefills:  # a stranger to the room may not fail it
            self.drop("not-owner", msg.session, f"AuxData of room {msg.room}, which it does not serve")
            return
        try:
            checks.aux_data(msg, self.kv_args.aux_item_lens, published)
        except wire.WireError as e:
            self.drop("bounds", msg.session, f"AuxData of room {msg.room}: {e}")
            reason = f"prefill {msg.session} sent an invalid aux row: {e}"
            self.room_failed(msg.room, reason)
            if not self.holds.held(msg.room):  # it stops sending the room
                self._control_send(msg.session, wire.RoomFailed(self.session, msg.room, reason), block=False)
            return
        if not self.room_wanted(msg.room):
            return
        for ptr, item_len, row in zip(self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens, msg.rows):
            ctypes.memmove(ptr + item_len * msg.aux_index, row, len(row))

    def _on_status(self, msg: wire.Status, peer: PrefillPeer) -> None:
        published = self.live_rooms.get(msg.room)
        try:
            success = checks.status(msg.status)
            if msg.prefill_rank != peer.prefill_rank:
                raise wire.WireError(f"prefill_rank {msg.prefill_rank} is not the registered {peer.prefill_rank}")
        except wire.WireError as e:
            self.drop("bounds", msg.session, f"Status of room {msg.room}: {e}")
            return
        if published is None or msg.session not in published.prefills:
            return  # a late status of a concluded room, or of a room this prefill does not serve
        self.arrivals.final(msg.room, msg.prefill_rank, success, msg.reason, msg.chunks, msg.session)

    def _on_sglang_frames(self, frames: List[bytes], sender: Optional[str]) -> None:
        if ABORT_ACK_TAG is not None and frames and frames[0] == ABORT_ACK_TAG and sender is not None:
            self._on_abort_ack(frames, sender)
        else:  # a junk frame may be many MiB: summarised only if the rate-limited line is logged
            self.drop("unexpected", sender or "?", checks.Unparsed(frames, "frames not for a decode rank"))

    def _on_abort_ack(self, frames: List[bytes], sender: str) -> None:
        """A prefill rank's writes into an aborted room drained (SGLang 0.5.23+ deferred release). Chunks of a
        two-sided channel are scattered into the pages by this rank's receiver thread of that prefill, so the
        ACK counts only once that thread finished every chunk queued before it; otherwise at once. Only the
        sender's own rank of a room it was sent counts: SGLang frees the pages once it holds one ACK per rank."""
        ack = AbortAck.from_zmq(frames) if self.enable_deferred_decode_kv_release else None
        if ack is not None and not self._acks_for_itself(ack, sender):
            return
        peers = self.arrivals.peers(ack.room, ack.prefill_rank) if ack is not None else []
        done = functools.partial(self.handle_abort_ack_message, frames)  # note_abort_ack for the armed generation
        if self.channels is None or not self.channels.after_queued(peers, done):
            done()

    def _acks_for_itself(self, ack: AbortAck, sender: str) -> bool:
        """Whether `sender` may ACK `ack` (dropped, logged, if not): its registered rank, a room it was sent. Another
        rank's ACK would let SGLang hand the pages on while that rank's one-sided write may still land."""
        peer = self.prefills.get(sender)
        if peer is None or peer.state != "accepted":
            self.drop("unregistered", sender, f"ABORT_ACK of room {ack.room} from a prefill rank this decode rank is "
                                              f"not registered with")
        elif ack.prefill_rank != peer.prefill_rank:
            self.drop("impersonation", sender, f"ABORT_ACK of room {ack.room} for prefill rank {ack.prefill_rank}, "
                                               f"but it is prefill rank {peer.prefill_rank}")
        elif sender not in self._room_servers.get(ack.room, ()):
            self.drop("not-owner", sender, f"ABORT_ACK of room {ack.room}, which it does not serve")
        else:
            return True
        return False

    # ------------------------------------------------------------------ liveness
    def _peer_dead(self, session: str, reason: str) -> None:
        peer = self.prefills.pop(session, None)
        if peer is None:
            return
        if peer.state == "pending":
            reason = (f"prefill rank {session} never answered the registration ({reason}); check that it runs "
                      f"and that both sides set the same SGLANG_P2P_AUTH_KEY")
        logger.error("p2pnccl: %s", reason)
        if peer.state == "pending" or not self.hold_failures or process_gone(session):
            self._writer_gone(session)  # never had our destinations, or its process (and mapping) is gone
        else:  # silent, not gone (frozen?): its write may resume, so its rooms' holds run to their bound
            self._maybe_writing[session] = time.monotonic()
        self._fail_rooms_served_by(session, reason)
        self._forget_routes_to(session)
        self.arrivals.peer_lost(session, reason)
        if self.channels is not None:
            self.channels.peer_dead(session, reason)
        self.control.forget(session)
        self.issued.forget(session)

    def _forget_routes_to(self, session: str) -> None:
        """SGLang's receivers keep a prefill server's rank endpoints per bootstrap address (`connection_pool`) until
        its heartbeat fails, which it never does when the server was replaced behind the same address (a restarted
        pod behind a Service answers its health checks): drop those naming the dead rank, and the server's parallel
        info, so the next request looks them up again and reaches the new process."""
        with self.connection_lock:
            stale = [key for key, infos in self.connection_pool.items()
                     if any(f"{i.get('rank_ip')}:{i.get('rank_port')}" == session for i in infos)]
            for key in stale:
                del self.connection_pool[key]
                self.prefill_info_table.pop(key.split("_", 1)[0], None)  # key: "<bootstrap addr>_<dp>_<cp>_<tp>"

    def _close_role(self) -> None:
        if self.channels is not None:
            self.channels.close()

    # ------------------------------------------------------------------ status
    def _apply_prefill_final(self, room: int, prefill_rank: int, success: bool, reason: str) -> None:
        if self.request_status.get(room) in (None, KVPoll.Failed) or self.scatter_gate.waiting(room):
            return  # concluded (or failing); a failed room never turns Success (SGLang 0.5.17's update_status would let it)
        senders = self._sessions_of(room, prefill_rank)
        if self.holds.held(room):  # a final status comes after that rank's last write of the room
            if self.holds.answered(room, senders):
                self._fail_now(room)
            return
        if not success:
            self.room_failed(room, reason or "Failed to get kvcache from prefill instance, it might be dead", senders)
            return
        done = self._response_ranks(room)
        if done is None:
            return
        done.add(prefill_rank)
        if len(done) >= self.required_prefill_response_num_table.get(room, 1):
            missing = self._pages_missing(room)
            if missing:
                self.room_failed(room, missing)
                return
            published = self.live_rooms.get(room)
            if published is not None:
                self.kv_fault.apply(room, published.kv_ids)
                if self.kv_digest is not None:  # after the fault: its corruption must show as a digest mismatch
                    self.kv_digest.log_held(room, published.kv_ids)
            self.update_status(room, KVPoll.Success)

    def _response_ranks(self, room: int) -> Optional[set]:
        """SGLang's set of prefill ranks that reported `room` Success, or None once its clear() (on the scheduler
        thread: the status, then this set) took the room since the caller read its status: never created again
        then (0.5.17's defaultdict would leak it, 0.5.23's dict raise KeyError into the receiver thread)."""
        tracker = self.prefill_response_tracker
        done = tracker.get(room)
        if done is not None or not isinstance(tracker, defaultdict):
            return done  # 0.5.23 created it with the room's receiver
        done = tracker.setdefault(room, set())  # 0.5.17 creates it on first use
        if room not in self.request_status:  # cleared meanwhile: clear() popped the status before the set
            if tracker.get(room) is done:
                tracker.pop(room, None)
            return None
        return done

    # ------------------------------------------------------------------ failures held (failure_hold.py)
    def update_status(self, bootstrap_room: int, status: int) -> None:
        """SGLang's and this role's status updates; a failure waits while a prefill may still write one-sided, or
        a scatter of the room is queued on the GPU (`_set_failed`), and a room whose failure waits changes no more."""
        if status == KVPoll.Failed:
            if not (self.holds.held(bootstrap_room) or self._hold(bootstrap_room)):
                self._set_failed(bootstrap_room)
            return
        with self.scatter_gate.lock:  # not between a failure's deferral and its check here
            if not self.scatter_gate.waiting(bootstrap_room):
                super().update_status(bootstrap_room, status)

    def room_failed(self, room: int, reason: str, drained: Iterable[str] = ()) -> None:
        """Fail an open room; `drained`: prefill ranks known to write it no more (they failed it after their
        writes). The first reason of a held room stays."""
        if (self.request_status.get(room) in (None, KVPoll.Failed, KVPoll.Success) or self.holds.held(room)
                or self.scatter_gate.waiting(room)):
            return
        self.record_failure(room, reason)
        if not self._hold(room, drained):
            self._set_failed(room)

    def hold_abort(self, room: int, reason: str) -> bool:
        """SGLang aborts an open `room` (AbortReq): whether its failure is held as the decode's own failures are
        (`_hold`, `_set_failed`), its status kept until no prefill rank may still write its pages and none of its
        scatters is queued on the GPU. With SGLang's deferred release its pages wait for the ABORT_ACKs instead,
        which count once the receivers drained (`_on_abort_ack`). A room not held is forgotten before the gate's
        lock is let go: SGLang's own abort follows, and no scatter of the room may be counted between this look
        and that (`_scatter_queued` asks whether it is still wanted)."""
        with self.scatter_gate.lock:
            held = self._hold_abort(room, reason)
            if not held:
                self.forget_room(room)
            return held

    def _hold_abort(self, room: int, reason: str) -> bool:
        if self.request_status.get(room) in (None, KVPoll.Failed, KVPoll.Success):
            return False
        if self.scatter_gate.waiting(room):
            return True
        if not getattr(self, "enable_deferred_decode_kv_release", False) and self.scatter_gate.pending(room):
            self.room_failed(room, reason)  # held for one-sided writers first, then for the scatters
            published = self.live_rooms.get(room)
            self._tell_failed(room, reason, published.prefills if published is not None else ())
            return True
        if not self.hold_failures:
            return False
        if self.holds.held(room):
            return True
        self.record_failure(room, reason)
        if self._hold(room):
            return True
        with self.failure_lock:
            self.failure_records.pop(room, None)  # Common's abort records its own
        return False

    def _hold(self, room: int, drained: Iterable[str] = ()) -> bool:
        """Hold the failure of `room` if a prefill rank other than `drained` may still write it one-sided: tell
        each (RoomFailed); the room fails once they answered (`_apply_prefill_final`), are gone, or the bound."""
        published = self.live_rooms.get(room)
        if (not self.hold_failures or self.broken is not None or published is None
                or self.request_status.get(room) in (None, KVPoll.Failed, KVPoll.Success)):
            return False
        writers = {s for s in published.prefills
                   if getattr(self.prefills.get(s), "state", "") in ("pending", "accepted") or s in self._maybe_writing}
        writers -= set(drained)
        if not writers:
            return False
        if not self.holds.begin(room, writers):
            return True  # held by another thread's failure of it, which tells the prefill ranks
        with self.failure_lock:
            reason = self.failure_records.get(room, "")
        self._tell_failed(room, reason, writers)
        return True

    def _tell_failed(self, room: int, reason: str, sessions: Iterable[str]) -> None:
        """Tell prefill ranks `room` failed here (RoomFailed), so their senders stop writing or sending it; one that
        cannot be told fails the room by liveness (a hold's bound ends the wait for its answer)."""
        frames = wire.encode(wire.RoomFailed(self.session, room, reason))
        for session in sessions:
            try:
                self.send_to_prefill(session, frames, block=False)
            except ControlError as e:
                logger.warning("p2pnccl: %s", e)

    def _fail_now(self, room: int) -> None:
        """A held room's wait ended: SGLang may take its pages back (once its queued scatters ended too)."""
        self._set_failed(room)

    # ------------------------------------------------------------------ scatters queued on the GPU (scatter_gate.py)
    def _set_failed(self, room: int) -> None:
        """Every Failed of this role goes through here: it waits while a scatter of the room is queued on the GPU
        (`_scatter_ended` applies it), else SGLang sees it now. Under the gate's lock: a scatter is counted only
        for a room still wanted (`_scatter_queued`), so either it is counted first and the failure waits, or the
        failure comes first and it is never queued."""
        with self.scatter_gate.lock:
            if self.scatter_gate.defer(room):
                return
            super().update_status(room, KVPoll.Failed)

    def _scatter_queued(self, room: int) -> bool:
        """A receiver queues a scatter of `room` on the GPU: counted if the room still wants its chunks."""
        with self.scatter_gate.lock:
            if not self.room_wanted(room):
                return False
            self.scatter_gate.queued(room)
            return True

    def _scatter_ended(self, room: int) -> None:
        """A receiver saw a queued scatter of `room` end: the room's waiting failure applies after its last."""
        if self.scatter_gate.ended(room):
            self._set_failed(room)  # nothing of it is counted any more: Failed now

    def scatters_pending(self, room: int) -> bool:
        """Whether a scatter of `room` queued on the GPU may still write its pages (SGLang's waiting timeout
        waits for it: conn.py)."""
        return self.scatter_gate.pending(room)


    def _writer_gone(self, session: str) -> None:
        self._maybe_writing.pop(session, None)
        for room in self.holds.gone(session):
            self._fail_now(room)

    def end_expired_hold(self, room: int) -> bool:
        """Whether `room` is still held (its bound not passed; a passed one fails it now)."""
        for expired in self.holds.expired([room]):
            self._end_at_bound(expired)
        return self.holds.held(room)

    def _end_at_bound(self, room: int) -> None:
        logger.warning("p2pnccl: room %s failed after %.0fs without every prefill rank's word that no write into its "
                       "pages is in flight (SGLANG_P2P_FAILURE_HOLD_S)", room, self.holds.hold_s)
        self._fail_now(room)

    def _sweep(self) -> None:
        for room in self.holds.expired():
            self._end_at_bound(room)
        for room in self.scatter_gate.expired():
            logger.error("p2pnccl: room %s failed after %.0fs although a scatter of its chunks queued on the GPU was "
                         "not seen to end (a stalled GPU stream?); its pages may still be written", room,
                         self.scatter_gate.bound_s)
            self._set_failed(room)  # its counts were dropped with the wait: Failed now
        now = time.monotonic()
        for session, since in list(self._maybe_writing.items()):
            if now - since > self.holds.hold_s:
                self._maybe_writing.pop(session, None)

    def _sessions_of(self, room: int, prefill_rank: int) -> List[str]:
        published = self.live_rooms.get(room)
        return [s for s in (published.prefills if published else ())
                if getattr(self.prefills.get(s), "prefill_rank", None) == prefill_rank]

    def _pages_missing(self, room: int) -> Optional[str]:
        """Why a room reported Success by every prefill rank is not complete here: on a rank that receives only
        two-sided, every published page must have landed (a Success alone never makes wrong KV count)."""
        published = self.live_rooms.get(room)
        if not self.two_sided_only or published is None or not published.kv_ids.size or not published.prefills:
            return None
        got = np.concatenate(published.received) if published.received else np.zeros(0, dtype=np.int32)
        if np.array_equal(got, published.kv_ids):  # one prefill rank's chunks in published order: all there
            return None
        missing = np.setdiff1d(published.kv_ids, got)  # sorts both: 0.14 ms for 1k pages, 10 ms for 16k (dev VM)
        if not missing.size:
            return None
        return (f"prefill reported Success for room {room}, but {missing.size} of its {np.unique(published.kv_ids).size} "
                f"published pages never arrived")

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """Whether the KV digest the prefill server at `bootstrap_addr` wrote into the aux row (SGLang 0.5.23,
        --disaggregation-enable-kv-checksum) covers the bytes this rank holds: an MHA/GQA rank of another attention
        TP holds other heads than the prefill rank digested, a CP-split or pipeline-staged prefill other pages or
        layers. MLA pages are whole at any TP. An unknown server is not vouched for."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is None or info.pp_size != 1 or info.attn_cp_size != 1:
            return False
        return bool(self.agreement.mla) or info.attn_tp_size == self.attn_tp_size

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Common's check; a mismatch fails the requests instead of raising into the decode scheduler, and is
        retried after a while (the prefill may have been restarted with a fixed configuration). What p2pnccl
        cannot pair (KV layouts, head counts) is refused at registration (engine/wire/agreement.py)."""
        reason = self.incompatible(bootstrap_addr)
        if reason is not None:
            self._fail_rooms_of(bootstrap_addr, reason)
            return False
        try:
            ok = super().try_ensure_parallel_info(bootstrap_addr)
        except RuntimeError as e:
            return self._mark_incompatible(bootstrap_addr, str(e))
        return ok

    def incompatible(self, bootstrap_addr: str) -> Optional[str]:
        """Why SGLang's check refused the prefill server at `bootstrap_addr`, while that refusal holds."""
        refused = self.incompatible_prefills.get(bootstrap_addr)
        if refused is None:
            return None
        if time.monotonic() - refused[1] >= _RETRY_REFUSED_S:
            self.incompatible_prefills.pop(bootstrap_addr, None)  # asked again: it may have been fixed
            return None
        return refused[0]

    def _mark_incompatible(self, bootstrap_addr: str, reason: str) -> bool:
        logger.error("p2pnccl: prefill %s cannot serve this decode: %s", bootstrap_addr, reason)
        self.incompatible_prefills[bootstrap_addr] = (reason, time.monotonic())
        self._refused_ranks.pop(bootstrap_addr, None)  # read again: the server may have been restarted
        self._fail_rooms_of(bootstrap_addr, reason)
        return False

    def _fail_rooms_of(self, bootstrap_addr: str, reason: str) -> None:
        rooms = list(self.addr_to_rooms_tracker.get(bootstrap_addr, ()))
        for room in rooms:
            self.room_failed(room, reason)
        self.tell_refused_server(bootstrap_addr, rooms)

    def tell_refused_server(self, bootstrap_addr: str, rooms: List[int]) -> None:
        """SGLang's check refused the prefill server before any registration: register with its ranks anyway
        and publish these rooms to them as dummies (no destination), so each rank refuses this decode rank
        naming the difference and fails its side of them now, not at SGLang's bootstrap timeout."""
        rooms = [r for r in rooms if r not in self._told_rooms]
        if not rooms:
            return
        now = time.monotonic()
        for room in rooms:
            self._told_rooms[room] = now
        for room, at in list(self._told_rooms.items()):
            if now - at > self.config.tombstone_s:
                del self._told_rooms[room]
        if bootstrap_addr not in self._refused_ranks:
            self._refused_ranks[bootstrap_addr] = rank_endpoints(bootstrap_addr)
        for endpoint in self._refused_ranks[bootstrap_addr]:
            try:
                self.ensure_registered(endpoint)
                for room in rooms:
                    self.send_to_prefill(endpoint, wire.encode(wire.RoomMetadata(
                        self.session, self.incarnation, room, b"", -1, [], 1, 0, True)))
            except ControlError as e:
                logger.warning("p2pnccl: could not tell prefill rank %s of the refusal: %s", endpoint, e)


def published_room(kv_indices: np.ndarray, aux_index: Optional[int], states: List[np.ndarray],
                   prefills: List[str]) -> checks.Published:
    return checks.Published(np.asarray(kv_indices, dtype=np.int32).reshape(-1),
                            -1 if aux_index is None else int(aux_index), states, frozenset(prefills))
