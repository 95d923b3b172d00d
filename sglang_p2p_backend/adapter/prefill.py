"""Prefill role of the p2pnccl KV manager: registrations, room destinations, transfer workers.

A decode rank registers once per pair (PeerRegister: its agreement, pools, transports and pair secret). The
registration is compared with this rank's agreement and answered (PeerAnswer) either way, so a mismatch is
refused on both sides; a refusal names what differs and nothing else of this rank's configuration (one that
failed authentication, nothing of it at all), and carries no pair secret. A matching registration costs no slot
and no socket of the live peers until the decode confirms it from the address it claimed (its first message
carrying this rank's pair secret, engine/wire/pair_secret.py): until then it waits in a small table of its own,
answered from a small pool of sockets, both bounded apart from the live peers, so registrations from addresses
nobody answers at cannot take a live peer's place. A live registration is never replaced by another process
claiming its session (a restarted decode is accepted once the old one was declared dead); with
SGLANG_P2P_MAX_PEERS live, an idle one gives its slot to a new one, never one at work (peer_slots.py). Refusals
are logged rate-limited. Only registered decode ranks may publish destinations (RoomMetadata), each checked
against the pools they declared; the decode ranks that published a room own it, and only they may fail or
abort it (a refused decode may tell of rooms nobody published). Anything else is dropped before a byte, a
socket or a table entry is spent on it. Whatever fails a room here, the decode ranks that own it are told.
Chunks move on transfer workers sharded by decode peer (one peer's chunks stay ordered, transfer_workers.py): two-sided (NCCL, tcp) through `PairSender`, one-sided (Mooncake, and
CUDA IPC to a same-host decode: same_host.py) through `OneSidedSender`, then Status. A decode's ABORT and the
ACK SGLang's deferred decode KV release waits for are deferred_release.py's; a decode's RoomFailed is answered
once no write of the room is in flight. Destinations of a room's next attempt that come before its concluded
attempt was cleared wait for the clear (next_attempts.py). A decode silent for
SGLANG_P2P_PEER_TIMEOUT is dead: its rooms fail, its pair channel is aborted (not waited on) and its
registration, budget and socket are released.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import numpy.typing as npt

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_p2p_backend.engine.wire import checks
from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.agreement import differences, pair_state_spans, redacted
from sglang_p2p_backend.engine.wire.control import ControlChannel, ControlError
from sglang_p2p_backend.engine.wire.pair_secret import IssuedSecrets
from sglang_p2p_backend.engine.copy.heads import HeadsError, PairHeads, pair_heads
from sglang_p2p_backend.engine.copy.state_slices import StateSliceError
from sglang_p2p_backend.engine.transport.onesided import OneSidedSender
from sglang_p2p_backend.engine.transport.select import PeerFacts, TransportSelector
from sglang_p2p_backend.adapter.bounded import Bounded
from sglang_p2p_backend.adapter.deferred_release import DeferredRelease
from sglang_p2p_backend.adapter.peer_slots import PeerSlots
from sglang_p2p_backend.adapter.manager import P2pNcclKVManagerBase
from sglang_p2p_backend.adapter.next_attempts import NextAttempts
from sglang_p2p_backend.adapter.room_times import RoomTimes
from sglang_p2p_backend.adapter import tracing
from sglang_p2p_backend.engine.pair.channels import PairChannels
from sglang_p2p_backend.adapter.same_host import SameHostPath
from sglang_p2p_backend.adapter.transfer_workers import TransferInfo, TransferTask, TransferWorkers

logger = logging.getLogger(__name__)

#: registrations waiting for their decode's confirmation, and the sockets their answers go out on
_PENDING = 64
#: how long an answer to an unconfirmed registration may wait for its decode to connect, after its socket closed
_ANSWER_LINGER_MS = 500


class PrefillKVManager(P2pNcclKVManagerBase):
    """The prefill role: registrations and room destinations here; chunks on `workers`, the same-host path in
    `same_host`, decode aborts and their held ACKs in `release`."""

    _role = "prefill"

    def _init_role(self) -> None:
        if self.system_dp_size > 1:
            # plain DP (--dp-size without DP attention): the DP controller hands rooms to replicas and the bootstrap
            # server files each replica's ranks under its replica index, but Common's sender checks a room's DP rank
            # against, and registers it as, `attn_dp_rank`, which is 0 on every replica: rooms of the other replicas
            # would fail ("follow_bootstrap_room conflict") or be looked up on replica 0
            self.attn_dp_rank = self.system_dp_rank
        self.decode_peers: Dict[str, wire.PeerRegister] = {}
        #: per decode rank with a different attention TP (MHA/GQA): the heads it takes from this rank
        self.peer_heads: Dict[str, Optional[PairHeads]] = {}
        #: per decode rank with a different attention TP: its spans of every state component's items
        self.peer_state: Dict[str, tuple] = {}
        self.rejected_peers: Dict[str, str] = Bounded(self.config.max_peers)
        #: why a decode rank stopped being live here (declared dead, released): a chunk that finds it gone names it
        self.departed_peers: Dict[str, str] = Bounded(self.config.max_peers)
        self.slots = PeerSlots(self.config.max_peers)
        #: registrations answered but not yet confirmed by their decode, and the secrets issued to them
        self.pending: Dict[str, wire.PeerRegister] = Bounded(_PENDING)
        self.pending_secrets = IssuedSecrets(_PENDING)
        #: answers to registrations go out here, never on a live peer's socket budget
        self.answers = ControlChannel(send_timeout_s=0.5, max_sockets=_PENDING, auth=self.auth, linger_ms=_ANSWER_LINGER_MS,
                                      pack=False)
        #: session -> when it was last answered: its answer socket closes a moment later (the sweep)
        self._answered: Dict[str, float] = Bounded(4 * _PENDING)
        self._pending_at: Dict[str, float] = Bounded(4 * _PENDING)
        self.refusals = 0
        self.releases = 0
        self.selector = TransportSelector(self.config.transport)
        # pair communicators live within a GPU-memory budget (engine/pair/comm_budget.py); `auto` asks it whether
        # one more fits before choosing NCCL over Mooncake for a peer
        self.channels = (
            PairChannels(self.two_sided, self.staging, self.copier, self.control, self.session, self.config)
            if self.two_sided else None
        )
        self.comm_budget = self.channels.budget if self.channels else None
        self.nccl_admits: Callable[[str], bool] = self.channels.admits if self.channels else (lambda s: True)
        self.one_sided_sender = OneSidedSender(self.one_sided, self.local_memory) if self.one_sided else None
        #: rooms concluded here before their destinations arrived: late RoomMetadata is answered Failed
        self.concluded: Dict[int, tuple] = Bounded(1 << 16)
        self.owned_rooms: set = set()  # rooms with a live sender on this rank
        self.next_attempts = NextAttempts(1 << 12)
        self._born: Dict[int, float] = {}  # room -> when its first destinations arrived
        self.same_host = SameHostPath(self.ipc, self.local_memory, self.device, self.decode_peers,
                                      self._common_transports, self.config.max_peers)
        self.release = DeferredRelease(self, self.decode_peers, self._fail_or_bury, self.drop)
        self.room_times = RoomTimes(self.config.room_times)
        self.same_host.timed = self.room_times.enabled
        self.workers = TransferWorkers(
            count=self.config.workers,
            spawn=self._spawn,
            request_status=self.request_status,
            destinations=self.transfer_infos,
            peers=self.decode_peers,
            rejected=self.rejected_peers,
            departed=self.departed_peers,
            heads=self.peer_heads,
            state=self.peer_state,
            route=self._route,
            channels=self.channels,
            same_host=self.same_host,
            released=lambda: self.kv_released,
            one_sided=self.one_sided_sender,
            release=self.release,
            control=self.control,
            session=self.session,
            prefill_rank=self.prefill_rank,
            local=self.local_memory,
            fail_room=self._fail_room,
            succeed=self._succeed,
            times=self.room_times,
            launch_in_add=self.config.ipc_launch == "scheduler",
            alone=self._alone if self.config.alone_kernel else (lambda room: False),
            conclude_in_poll=self.config.conclude_in_poll,
        )

    # ------------------------------------------------------------------ SGLang's sender
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
        indices_event: Any = None,
        trace_ctx: Any = None,
        **_: Any,
    ) -> None:
        """Queue one chunk of `bootstrap_room` (P2pNcclKVSender.send); dropped when the room is not live.
        `indices_event`: `kv_indices` is a host tensor whose values land when the event completes (SGLang's
        copy from the device): the worker reads them after waiting for it, unless the test-only digest, which
        records them here, is on. `trace_ctx`: the sender's request context copied for the worker thread (as
        SGLang passes Mooncake's), which traces the chunk when tracing is on (tracing.py)."""
        if indices_event is not None and self.kv_digest is not None:
            indices_event.synchronize()
            indices_event = None
        if self.kv_digest is not None:
            self.kv_digest.sent(bootstrap_room, kv_indices)
        self.room_times.mark(bootstrap_room, "queued")
        self.workers.add(TransferTask(
            bootstrap_room,
            kv_indices if indices_event is not None else np.array(kv_indices, dtype=np.int32, copy=True),
            index_slice,
            is_last_chunk,
            aux_index,
            state_indices,
            wait_event,
            indices_event,
            tracing.chunk_trace(trace_ctx, self.attn_tp_rank, self.attn_dp_rank),
        ))

    # ------------------------------------------------------------------ routes
    def _route(self, session: str) -> str:
        """Which transport serves this decode rank now (logged once per peer, and when it changes)."""
        reg = self.decode_peers[session]
        facts = PeerFacts(
            same_host=reg.hostname == self.hostname,
            rdma_present=self.transports.mooncake == "rdma",
            nccl_fits=lambda: self.nccl_admits(session),
            gpu=self.device.type == "cuda",
            mooncake_available=self.one_sided is not None,
            peer_offers=tuple(self._common_transports(reg)),
            ipc=lambda: self.same_host.usable(session),
        )
        return self.selector.choose(session, facts).transport

    def _alone(self, room: int) -> bool:
        """Whether `room` is the only request on this rank: every request SGLang holds here, from its bootstrap to
        its transfer's end, has a live sender (`owned_rooms`), so no other forward pass runs or waits."""
        owned = self.owned_rooms
        return len(owned) == 1 and room in owned

    def _common_transports(self, reg: wire.PeerRegister) -> List[str]:
        offered = [t for t in reg.transports if (t != "mooncake" or reg.mooncake_session) and (t != "cudaipc" or reg.ipc)]
        return [t for t in self.transports.names() if t in offered]

    # ------------------------------------------------------------------ inbound
    def _admit(self, msg: wire.Message, secret: Optional[bytes]) -> bool:
        """A registration needs no secret; anything else the one issued to its session, by a live registration
        or by an acceptance (then it is the decode's confirmation, which makes the registration live). A refused
        decode holds none: its RoomMetadata may only fail rooms nobody owns (`_on_metadata`)."""
        if isinstance(msg, wire.PeerRegister):
            return True
        if self.pending_secrets.matches(msg.session, secret):
            if msg.session in self.pending:
                self._confirm(msg.session)
            return True
        if isinstance(msg, wire.RoomMetadata) and msg.session in self.rejected_peers:
            return True
        return self.issued.matches(msg.session, secret)

    def _secret_owner(self, secret: Optional[bytes]) -> Optional[str]:
        return self.issued.owner(secret)  # SGLang's frames (ABORT) only from live decode ranks

    def _unauthenticated(self, frames: List[bytes], problem: str) -> None:
        """Keys differ: a registration is refused naming only that; the rooms a refused decode tells of fail here
        if nobody owns them."""
        _, msg = self._unauthenticated_message(frames)
        if isinstance(msg, wire.PeerRegister) and not self.watch.alive(msg.session):  # never answer for a live peer
            self._refuse(msg, f"control messages fail authentication: {problem}; set the same SGLANG_P2P_AUTH_KEY "
                              f"(or _FILE) on every prefill and decode", unauthenticated=True)
        elif isinstance(msg, wire.RoomMetadata) and msg.session in self.rejected_peers:
            self._fail_or_bury(msg.room, f"control messages of decode rank {msg.session} fail authentication: "
                                         f"{problem}", msg.session)

    def _on_message(self, msg: wire.Message) -> None:
        peer = self.decode_peers.get(getattr(msg, "session", ""))
        if isinstance(msg, wire.PeerRegister):
            self._on_register(msg)
        elif isinstance(msg, wire.RoomMetadata):
            self._on_metadata(msg)
        elif peer is None:
            self.drop("unregistered", msg.session, f"{type(msg).__name__} from a decode rank that is not registered")
        elif isinstance(msg, wire.Heartbeat):
            if msg.incarnation == peer.incarnation:
                self.watch.seen(msg.session)
        elif isinstance(msg, (wire.CommAnswer, wire.CommRelease, wire.ChunkRefused)) and self.channels is None:
            self.drop("unexpected", msg.session, f"{type(msg).__name__}: this prefill rank runs no pair channels")
        elif isinstance(msg, wire.CommAnswer):
            self.channels.answered(msg)
        elif isinstance(msg, wire.CommRelease):
            self.channels.released(msg.session)
        elif isinstance(msg, wire.ChunkRefused):
            if self._owns(msg.session, msg.room, "ChunkRefused"):
                self.channels.abort(msg.session, msg.generation, f"decode rank refused a chunk: {msg.reason}")
                self._fail_room(msg.room, f"decode rank {msg.session} refused a chunk: {msg.reason}", cause=msg.session)
        elif isinstance(msg, wire.RoomFailed):
            reason = f"decode rank {msg.session} failed the room: {msg.reason}"
            if msg.session in (self.transfer_infos.get(msg.room) or {}):  # only a room it is a destination of
                self._fail_room(msg.room, reason, cause=msg.session)
            elif not self._fail_or_bury(msg.room, reason, msg.session):  # its destinations never came here
                return
            self._confirm_failed(msg)
        else:
            self.drop("unexpected", msg.session, f"{type(msg).__name__} is not for a prefill rank")

    def _answer(self, reg: wire.PeerRegister, problem: str = "", secret: Optional[bytes] = None,
                anonymous: bool = False) -> None:
        """Answer a registration from the answers' own sockets, carrying the decode's secret (so only the process
        that registered reads it as an answer) and ours when given. A refusal carries only what differs;
        `anonymous`, nothing of this rank (the decode's own agreement back)."""
        if anonymous:
            answer = wire.PeerAnswer(self.session, 0, 0, reg.agreement, problem)
        else:
            agreement = redacted(self.agreement, reg.agreement) if problem else self.agreement
            answer = wire.PeerAnswer(self.session, self.incarnation, self.prefill_rank, agreement, problem,
                                     self.attn_tp_rank, secret or b"")
        self._send_answer(reg, answer)

    def _send_answer(self, reg: wire.PeerRegister, msg: wire.Message) -> None:
        self.answers.set_secret(reg.session, reg.secret)
        self._answered[reg.session] = time.monotonic()
        try:
            self.answers.send(reg.session, msg, block=False)
        except ControlError as e:
            self.log_limited(self.refusals, logging.WARNING, "%s", e)

    def _refuse(self, reg: wire.PeerRegister, problem: str, unauthenticated: bool = False) -> None:
        """Refuse a registration naming why (no secret: a refusal grants nothing); the rooms the decode tells of
        later fail here too, if nobody owns them."""
        self.refusals += 1
        self.log_limited(self.refusals, logging.ERROR, "decode rank %s refused (#%d): %s", reg.session, self.refusals, problem)
        self.pending.pop(reg.session, None)
        self.pending_secrets.forget(reg.session)
        if reg.session not in self.decode_peers:
            self.rejected_peers[reg.session] = problem
        self._answer(reg, problem, anonymous=unauthenticated)

    def _heads_for(self, reg: wire.PeerRegister) -> Optional[PairHeads]:
        """The heads this rank sends decode rank `reg` (None: whole pages). Raises HeadsError."""
        if self.agreement.mla or reg.agreement.mla:
            return None
        return pair_heads(total=self.kv_total_heads, page_size=self.agreement.page_size, src_tp=self.attn_tp_size,
                          src_rank=self.attn_tp_rank, dst_tp=reg.agreement.attn_tp_size, dst_rank=reg.engine_rank)

    def _state_for(self, reg: wire.PeerRegister) -> tuple:
        """This rank's spans of every state component's items for decode rank `reg` (() : whole items). Raises
        StateSliceError."""
        return pair_state_spans(self.agreement, self.attn_tp_rank, reg.agreement, reg.engine_rank)

    def _check_peer(self, reg: wire.PeerRegister) -> Optional[str]:
        problems = differences(self.agreement, reg.agreement, "prefill", "decode")
        if not problems:
            try:
                self._heads_for(reg)
            except HeadsError as e:
                problems.append(f"KV heads cannot be paired: {e}")
            try:
                self._state_for(reg)
            except StateSliceError as e:
                problems.append(f"state cannot be paired: {e}")
        common = self._common_transports(reg)
        only_ipc = self.config.transport == "cudaipc" or common == ["cudaipc"]
        if only_ipc and not problems:  # nothing to fall back to: refuse now, naming why
            ipc = self.same_host.problem(reg)
            if ipc:
                problems.append(f"SGLANG_P2P_TRANSPORT=cudaipc cannot serve this pair: {ipc}; use auto or nccl")
        if not common:
            problems.append(
                f"no transport in common: this prefill rank moves pages with {self.transports.names()}, the decode "
                f"rank receives with {list(reg.transports)}; set the same SGLANG_P2P_TRANSPORT on prefill and decode"
            )
        return "; ".join(problems) or None

    def _on_register(self, reg: wire.PeerRegister) -> None:
        old = self.decode_peers.get(reg.session)
        if old is not None and old.incarnation != reg.incarnation and self.watch.alive(reg.session):
            # never replace a live registration: a second process claiming the session is refused until the
            # registered one has been silent for SGLANG_P2P_PEER_TIMEOUT (a real restart takes longer)
            # (not answered: the answer would go to the live process, which drops it, not carrying its secret)
            self.drop("duplicate-session", reg.session, f"registration for a session a live decode process holds; a "
                      f"restarted decode is accepted once the old one is silent for {self.watch.timeout_s:g}s")
            return
        problem = self._check_peer(reg)
        if problem:
            self._refuse(reg, problem)
            return
        # answered, but not live until the decode confirms it from the address it claims
        self.rejected_peers.pop(reg.session, None)
        self.pending[reg.session] = reg
        self._pending_at[reg.session] = time.monotonic()
        self._answer(reg, secret=self.pending_secrets.issue(reg.session))

    def _confirm(self, session: str) -> None:
        """The decode of a pending registration answered from its address: it becomes a live peer. With
        SGLANG_P2P_MAX_PEERS live, an idle one gives up its slot; when every one carries a known room, refused."""
        reg = self.pending.pop(session)
        old = self.decode_peers.get(session)
        if old is None and len(self.decode_peers) >= self.config.max_peers:
            victim = self.slots.victim(list(self.decode_peers), self._busy_peers())
            if victim is None:
                self._refuse(reg, f"this prefill rank has {len(self.decode_peers)} decode ranks registered, each "
                                  f"with requests in flight (SGLANG_P2P_MAX_PEERS)")
                return
            self._release_peer(victim)
        self.slots.confirmed(session)
        self.issued.adopt(session, self.pending_secrets.get(session))
        self.pending_secrets.forget(session)
        self.answers.forget(session)
        self.control.set_secret(session, reg.secret)
        self.rejected_peers.pop(session, None)
        self.departed_peers.pop(session, None)
        self.peer_heads[session] = self._heads_for(reg)
        self.peer_state[session] = self._state_for(reg)
        self.decode_peers[session] = reg
        self.watch.watch(session)
        if old is None or old.incarnation != reg.incarnation:
            self.selector.forget(session)
            self.same_host.registered(session)
            if self.one_sided is not None and reg.mooncake_session:
                # a failed Mooncake session is skipped until its decode rank registers again (or for a while): now
                self.one_sided.peer_registered(reg.mooncake_session)
            # a new process behind the session: its old pair channel is gone; the owning worker creates a
            # fresh one on its next chunk
            self.workers.reset_peer(session)

    def _on_metadata(self, msg: wire.RoomMetadata) -> None:
        room, peer = msg.room, self.decode_peers.get(msg.session)
        if peer is None:
            problem = self.rejected_peers.get(msg.session)
            if problem is None:
                self.drop("unregistered", msg.session, f"RoomMetadata of room {room} from an unregistered decode rank")
            else:  # the decode failed the room when it read our answer; fail our side too (if nobody owns it)
                self._fail_or_bury(room, f"decode rank {msg.session} refused: {problem}", msg.session)
            return
        if msg.incarnation != peer.incarnation:
            self.drop("stale", msg.session, f"RoomMetadata of room {room} from decode process {msg.incarnation}, "
                                            f"registered is {peer.incarnation}")
            return
        self.watch.seen(msg.session)
        if self.next_attempts.hold(msg, lambda: self._previous_attempt(room, msg.session)):
            return
        if room in self.concluded:
            self._control_send(msg.session, wire.Status(self.session, room, self.prefill_rank, int(KVPoll.Failed), self.concluded[room][0]))
            return
        infos = self.transfer_infos.get(room) or {}
        if msg.session not in infos and infos and len(infos) >= infos[next(iter(infos))].required_dst_info_num:
            self._owns(msg.session, room, "RoomMetadata")  # room taken: dropped, and its sender told
            self._control_send(msg.session, wire.Status(self.session, room, self.prefill_rank, int(KVPoll.Failed),
                                                        f"room {room} already has its destinations on prefill rank "
                                                        f"{self.session}, from other decode ranks"), block=False)
            return
        try:
            dst = checks.room_metadata(msg, peer)
        except wire.WireError as e:
            self.drop("bounds", msg.session, f"RoomMetadata of room {room}: {e}")
            reason = f"decode rank {msg.session} published invalid destinations: {e}"
            self._control_send(msg.session, wire.Status(self.session, room, self.prefill_rank, int(KVPoll.Failed), reason))
            if self._owns(msg.session, room, "RoomMetadata"):
                self._fail_room(room, reason, cause=msg.session)
            return
        infos = self.transfer_infos.setdefault(room, {})
        infos[msg.session] = TransferInfo(
            msg.session, room, dst.kv_ids, msg.aux_index, dst.state_ids, msg.required_dst_info_num,
            msg.decode_prefix_len, msg.is_dummy,
        )
        self._born.setdefault(room, time.monotonic())
        if room in self.owned_rooms:
            self.slots.worked([msg.session])
        if len(infos) == msg.required_dst_info_num:
            self.resolve_kv_replica_factor(infos)
            self.req_to_decode_prefix_len[room] = msg.decode_prefix_len
            self.update_status(room, KVPoll.WaitingForInput)

    def _on_sglang_frames(self, frames: List[bytes], sender: Optional[str]) -> None:
        if frames and frames[0] == b"ABORT":
            self.release.on_abort(frames, sender)
        else:  # a junk frame may be many MiB: summarised only if the rate-limited line is logged
            self.drop("unexpected", sender or "?", checks.Unparsed(frames, "frames not for a prefill rank"))

    # ------------------------------------------------------------------ peers
    def _peer_dead(self, session: str, reason: str) -> None:
        if session not in self.decode_peers:
            return
        # recorded before the peer leaves the table: a worker that finds it gone in between names this reason
        self.departed_peers[session] = reason
        reg = self.decode_peers.pop(session, None)
        if reg is None:
            return
        logger.error("p2pnccl: %s", reason)
        for room, infos in list(self.transfer_infos.items()):
            info = infos.get(session)
            if info is not None and not info.is_dummy:
                self._fail_room(room, f"KV transfer to decode rank {session} failed: {reason}", block=False)
        self._forget_peer(session, reason, reg)

    def _forget_peer(self, session: str, reason: str, reg: Optional[wire.PeerRegister] = None) -> None:
        self.departed_peers[session] = reason
        reg = self.decode_peers.pop(session, None) or reg
        if reg is not None and reg.mooncake_session and self.one_sided is not None:
            self.one_sided.forget_peer(reg.mooncake_session)  # a restarted decode comes back under a new session
        self.peer_heads.pop(session, None)
        self.peer_state.pop(session, None)
        self.same_host.forget(session)
        self.slots.forget(session)
        if self.channels is not None:
            self.channels.abort(session, None, reason)  # a worker blocked on the peer returns now
        self.workers.reset_peer(session)
        self.selector.forget(session)
        self.control.forget(session)
        self.issued.forget(session)

    def _busy_peers(self) -> set:
        """Live peers that carry a room the scheduler knows (a sender exists for it)."""
        return {s for room in list(self.owned_rooms) for s in (self.transfer_infos.get(room) or {})}

    def _release_peer(self, session: str) -> None:
        """Give an idle live peer's slot to a new one: it is told (from the answers' sockets: its own is closed
        now) and registers again before its next room; destinations it published stay."""
        reason = (f"prefill rank {self.session} released this idle registration for a new decode rank "
                  f"(SGLANG_P2P_MAX_PEERS={self.config.max_peers}); register again")
        self.releases += 1
        self.log_limited(self.releases, logging.WARNING, "decode rank %s (#%d): %s", session, self.releases, reason)
        self._send_answer(self.decode_peers[session], wire.PeerReleased(self.session, reason))
        self.watch.forget(session)
        self._forget_peer(session, reason)

    def _sweep(self) -> None:
        now, ttl = time.monotonic(), self.config.tombstone_s
        # an answer is out within a moment (or its decode is not there): close its socket; a registration not
        # confirmed within SGLANG_P2P_PEER_TIMEOUT is forgotten (its decode registers again if it exists)
        for session, at in list(self._answered.items()):
            if now - at > 1.0:
                self._answered.pop(session, None)
                self.answers.forget(session)
        for session, reg in list(self.pending.items()):
            if now - self._pending_at.get(session, 0.0) > self.watch.timeout_s and self.pending.pop(session, None) is reg:
                self.pending_secrets.forget(session)
        for room, (_, at) in list(self.concluded.items()):
            if now - at > ttl:
                self.concluded.pop(room, None)
        # destinations of a room this rank never started (its sender was never created): forget them
        for room, born in list(self._born.items()):
            if room in self.owned_rooms:
                continue
            if room not in self.transfer_infos:
                self._born.pop(room, None)
            elif now - born > ttl:
                self._fail_room(room, f"prefill rank {self.session} never started room {room} within {ttl:g}s", block=False)
                for table in (self.transfer_infos, self.request_status, self.req_to_decode_prefix_len, self._born):
                    table.pop(room, None)

    def room_started(self, room: int) -> None:
        """A sender for `room` exists on this rank (P2pNcclKVSender)."""
        self.owned_rooms.add(room)
        self.slots.worked(self.transfer_infos.get(room) or {})
        reason = self.concluded.pop(room, (None,))[0]
        if reason:
            self._fail_room(room, reason)

    def _previous_attempt(self, room: int, session: str) -> bool:
        """Whether a RoomMetadata of `room` from `session` is for its next attempt: the sender of this one is not
        cleared yet, and it concluded with that decode rank's destinations (or is being cleared)."""
        if room not in self.owned_rooms:
            return False
        status = self.request_status.get(room)
        return status is None or (status in (KVPoll.Success, KVPoll.Failed) and session in (self.transfer_infos.get(room) or {}))

    def room_cleared(self, room: int) -> None:
        """The room's sender was cleared: destinations of its next attempt that came meanwhile are published now."""
        def cleared() -> None:
            self.owned_rooms.discard(room)
            self._born.pop(room, None)

        if self.kv_digest is not None:
            self.kv_digest.forget(room)  # a failed room's pages (a succeeded one's went at its Success)
        self.room_times.forget(room)
        self.workers.forget(room)

        for msg in self.next_attempts.release(room, cleared):
            self._on_metadata(msg)

    def _close_role(self) -> None:
        self.workers.stop()
        for t in self._threads:
            t.join(timeout=5)
        if self.channels is not None:
            self.channels.close()
        self.answers.close()

    # ------------------------------------------------------------------ status
    def _owns(self, session: str, room: int, what: str) -> bool:
        """Whether decode rank `session` may act on `room`: it published it, or nobody did yet (dropped if not)."""
        owners = self.transfer_infos.get(room) or {}
        if not owners or session in owners:
            return True
        self.drop("not-owner", session, f"{what} of room {room}, which other decode ranks published")
        return False

    def _fail_room(self, room: int, reason: str, notify: bool = True, block: bool = True,
                   cause: Optional[str] = None) -> None:
        """Fail `room` here (if still open) and tell every real decode rank of it (once) but `cause`."""
        already = self.request_status.get(room) == KVPoll.Failed
        self.room_failed(room, reason)
        if notify and not already:
            self._notify_decode(room, KVPoll.Failed, reason, block, skip=cause)

    def _stop_transfers(self, reason: str) -> None:
        """Released: a chunk a transfer worker takes from now on fails its room (`TransferWorkers._process`); wait
        for the ones already reading the pools, bounded by the I/O timeout."""
        left = self.release.wait_drained(float(self.config.io_timeout))
        if left:
            logger.error("p2pnccl: transfers of rooms %s still ran %ss after the KV memory was released; they may "
                         "read unmapped memory", left[:8], self.config.io_timeout)

    def _fatal(self, reason: str) -> None:
        super()._fatal(reason)
        for room in list(self.transfer_infos):
            self._notify_decode(room, KVPoll.Failed, reason, block=False)

    def _succeed(self, room: int, now: bool = False,
                 first: Optional[Dict[str, wire.Message]] = None) -> Optional[Callable[[], None]]:
        """The room's last chunk reached every decode rank: Success here, then Status to them. Marked first: a
        decode may publish the room's next attempt as soon as it reads the Status, and only a room marked
        concluded here keeps those destinations for the next sender (next_attempts.py). `now` (SGLang's poll, which
        must not wait on a peer): a Status that cannot go at once is returned unsent, as what sends it. `first`: a
        message (the room's aux row, read before) that goes to that decode rank ahead of its Status, in the same frame."""
        send = self._status_sender(room, KVPoll.Success, now=now, first=first)
        if self.kv_digest is not None:
            self._log_digest(room)
        self.update_status(room, KVPoll.Success)
        return send()

    def conclude_launched(self, room: int) -> None:
        """SGLang's poll of `room`'s sender: conclude it now if its last copy has run (transfer_workers.py)."""
        self.workers.conclude_launched(room)

    def _log_digest(self, room: int) -> None:
        """The test-only digest of the pages this rank sent for `room`, while SGLang still holds them (before
        Success); none where every destination is a dummy (another prefill rank sends the room's KV)."""
        if any(not info.is_dummy for info in list((self.transfer_infos.get(room) or {}).values())):
            self.kv_digest.log_sent(room)
        else:
            self.kv_digest.forget(room)

    def _notify_decode(self, room: int, status: int, reason: str = "", block: bool = True,
                       skip: Optional[str] = None) -> None:
        """Status to the room's real decode ranks but `skip`; a failure only once no write of the room is in
        flight (the decode frees a failed room's pages at once: a write still running would land in another's)."""
        send = self._status_sender(room, status, reason, block, skip)
        if status == KVPoll.Failed:
            self.release.after_drain(room, send)
        else:
            send()

    def _status_sender(self, room: int, status: int, reason: str = "", block: bool = True,
                       skip: Optional[str] = None, now: bool = False,
                       first: Optional[Dict[str, wire.Message]] = None) -> Callable[[], Optional[Callable[[], None]]]:
        """What sends the room's Status to its real decode ranks but `skip`, taken from the room's destinations
        now (a clear may drop them before it runs), each behind its rank's message in `first` if any, in one frame.
        `now`: only those that go without waiting (`ControlChannel.send_now`); it returns what sends the others
        (None: none is left)."""
        infos = [info for info in list((self.transfer_infos.get(room) or {}).values())
                 if not info.is_dummy and info.session != skip]
        first = first or {}

        def send() -> Optional[Callable[[], None]]:
            left = []
            for info in infos:  # each names the chunk headers it was sent, counted when the Status goes
                if info.session in self.decode_peers:
                    msgs = (wire.Status(self.session, room, self.prefill_rank, int(status), reason, info.next_seq.sent),)
                    if info.session in first:
                        msgs = (first[info.session], *msgs)
                    if now and not self.control.send_now(info.session, *msgs):
                        left.append((info.session, msgs))
                    elif not now:
                        self._control_send_all(info.session, msgs, block)
            return (lambda: [self._control_send_all(s, m, block) for s, m in left]) if left else None

        return send

    def _confirm_failed(self, msg: wire.RoomFailed) -> None:
        """Answer a decode rank that failed a room on its side once no write of the room is in flight: it may hold
        the room's pages until then (adapter/failure_hold.py). Never after a write that could not prove it stopped:
        the decode's bound ends its hold then."""
        status = wire.Status(self.session, msg.room, self.prefill_rank, int(KVPoll.Failed),
                             f"decode rank {msg.session} failed the room: {msg.reason}")

        def send() -> None:
            if not self.release.unsettled(msg.room):
                self._control_send(msg.session, status, block=False)

        self.release.after_drain(msg.room, send)

    def _fail_or_bury(self, room: int, reason: str, cause: str) -> bool:
        """Decode rank `cause` ends `room`: fail it here, or, if its sender does not exist yet, when it does
        (P2pNcclKVSender); the room's other decode ranks are told. Only an owner may (False: dropped)."""
        if not self._owns(cause, room, "the end"):
            return False
        if room in self.request_status:
            self._fail_room(room, reason, cause=cause)
            return True
        self.concluded[room] = (reason, time.monotonic())
        self._notify_decode(room, KVPoll.Failed, reason, block=False, skip=cause)
        # the scheduler's thread may have started the sender between the check above and the tombstone, and
        # found none (room_started): whichever of the two pops the tombstone fails the room, once
        if room in self.request_status and self.concluded.pop(room, None) is not None:
            self._fail_room(room, reason, cause=cause)
        return True

    def notify_aborted(self, room: int) -> None:
        reason = "Aborted on prefill by AbortReq"
        if self.transfer_infos.get(room):
            self._notify_decode(room, KVPoll.Failed, reason)
            return
        self.concluded[room] = (reason, time.monotonic())  # the decode's destinations, when they come, answered Failed
        # unless they came between the check above and the tombstone (_on_metadata saw none): tell them now
        if self.transfer_infos.get(room) and self.concluded.pop(room, None) is not None:
            self._notify_decode(room, KVPoll.Failed, reason)
