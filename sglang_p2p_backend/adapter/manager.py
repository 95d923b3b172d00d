"""The p2pnccl KV manager: what both roles share (memory, transports, control channel, auth, liveness).

SGLang builds one manager class for both roles (`get_kv_class(..., KVClassType.MANAGER)(args, mode, ...)`);
that class, conn.py's `P2pNcclKVManager`, builds the role's: `prefill.PrefillKVManager` or
`decode.DecodeKVManager`, both subclasses of `P2pNcclKVManagerBase` here, as vLLM's connector splits scheduler
and worker roles.

Inbound control traffic (ours and SGLang's own ABORT / ABORT_ACK frames) arrives on the PULL socket SGLang's
Common manager binds. One thread reads it: it opens the frame lists packed into one frame (engine/wire/packing.py)
and, for each in order, the authenticated envelope when a key is set
(engine/wire/auth.py), checks the pair secret (engine/wire/pair_secret.py: every message after registration must carry the
one this rank issued to the session it names), decodes and bound-checks our messages (engine/wire/messages.py,
engine/wire/checks.py), drops what fails with a counted, rate-limited log line naming the peer and the problem,
refreshes the sender's liveness and hands the message to the role. A second thread sends heartbeats to every watched peer and
declares peers silent for `SGLANG_P2P_PEER_TIMEOUT` seconds dead (engine/pair/liveness.py); the role then fails
their rooms, aborts their pair channels and forgets them. Every loop catches, logs and goes on; a loop that
cannot go on marks the manager broken, and every room then fails with that reason instead of hanging.
"""

from __future__ import annotations

import importlib.util
import logging
import socket
import threading
import time
from collections import Counter
from typing import Any, Callable, List, Optional, Sequence

import torch
import zmq

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_p2p_backend.adapter import contract
from sglang_p2p_backend.adapter.bootstrap import signed_writes
from sglang_p2p_backend.adapter.kv_digest import DigestLabel, KVDigest
from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.agreement import local_agreement
from sglang_p2p_backend.engine.wire.auth import AUTH_MAGIC, AuthError, Authenticator, key_from_env
from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.wire.control import ControlChannel, ControlError, limit_inbound, max_frame_bytes
from sglang_p2p_backend.engine.copy.copier import PageCopier
from sglang_p2p_backend.engine.pair.liveness import PeerWatch
from sglang_p2p_backend.engine.copy.memory import page_views, regions_from_lists
from sglang_p2p_backend.engine.transport.local_memory import LocalMemory
from sglang_p2p_backend.engine.wire.packing import unpack
from sglang_p2p_backend.engine.wire.pair_secret import IssuedSecrets, open_frames
from sglang_p2p_backend.engine.pair.staging import StagingPool
from sglang_p2p_backend.engine.threads import enter_thread, shorten_gil_switch
from sglang_p2p_backend.engine.transport import one_sided_transport, two_sided_transport
from sglang_p2p_backend.engine.transport.cuda_ipc import CudaIpcTransport
from sglang_p2p_backend.engine.transport.cuda_ipc import backend as ipc_backend
from sglang_p2p_backend.engine.transport.base import OneSidedTransport, TransportError, TwoSidedTransport
from sglang_p2p_backend.engine.transport.select import process_transports, rdma_present

logger = logging.getLogger(__name__)

_POLL_MS = 100
_CHECK_S = 0.5  # how often peers' silence is checked
_LOG_FIRST = 20  # dropped messages of one kind logged one by one, then every 1,000th


def _no_staging(nbytes: int) -> torch.Tensor:
    raise TransportError("this rank runs no two-sided transport (SGLANG_P2P_TRANSPORT=mooncake): no staging")


def _state_shards(args: Any, components: int) -> dict:
    """KVArgs' per-tensor state sharding as the agreement carries it: per component, the sliced axis's size, the
    rows before it (SGLang reads a missing count as 1) and the conv sub-blocks ([] for None)."""
    dims = [list(d or []) for d in (getattr(args, "state_dim_per_tensor", None) or [])][:components]
    outer = [list(o or []) for o in (getattr(args, "state_slice_outer_counts", None) or [])][:components]
    groups = [[list(g or []) for g in (comp or [])] for comp in (getattr(args, "state_conv_shard_groups", None) or [])]
    outer = [o if o else [1] * len(d) for d, o in zip(dims, outer + [[]] * (len(dims) - len(outer)))]
    groups = [g if g else [[]] * len(d) for d, g in zip(dims, groups + [[]] * (len(dims) - len(groups)))]
    return {"state_dims": dims, "state_outer_counts": outer, "state_conv_groups": groups}


class P2pNcclKVManagerBase(CommonKVManager):
    """What the prefill and decode managers share; each role subclasses it (prefill.py, decode.py)."""

    # SGLang 0.5.23+ may hold an aborted room's decode pages until every prefill rank ACKs that no write
    # into them is in flight (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE); unused by 0.5.17
    supports_deferred_decode_kv_release = True
    # SGLang 0.5.23's name for what the sender reports (conn.py poll): transfer_latency_s from the first chunk
    # queued to Success, as NIXL; 0.5.17 reads the reported value the same way and does not ask
    reports_transfer_latency = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: Optional[bool] = False,
        **kwargs: Any,
    ):
        # before anything binds, registers or starts: a setting p2pnccl cannot serve fails the server here
        contract.check(args, server_args, str(getattr(disaggregation_mode, "value", disaggregation_mode)))
        self.config = EngineConfig.from_env()
        shorten_gil_switch(self.config.gil_switch_ms)
        key = key_from_env()
        #: signs this rank's writes to a keyed bootstrap server (bootstrap.py)
        self.bootstrap_key = key
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._limit_inbound()  # a decode rank: before it registers anywhere (a prefill did in register_to_bootstrap)
        self.session = f"{self.local_ip}:{self.rank_port}"
        #: this process's start: a peer tells a restarted process at the same session by a new value
        self.incarnation = time.time_ns()
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
            rdma_present=rdma_present(force_tcp=self.config.mooncake_force_tcp),
            mooncake_available=importlib.util.find_spec("mooncake") is not None,
            ipc_capable=ipc_backend().usable(self.device),
        )
        self.two_sided: Optional[TwoSidedTransport] = None
        if self.transports.two_sided:
            self.two_sided = two_sided_transport(
                self.transports.two_sided, self.device, self.local_ip, self.config
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
                # a failed session is tried again once a dead peer would have been noticed (and forgotten)
                self.config.peer_timeout,
            )
            # both sides register: the decode so the prefill may write into it, the prefill so RDMA may read
            # its sources; aux rows included (they travel in the last chunk's batch)
            self.one_sided.register(self.local_memory.regions())
        #: same-host path (engine/transport/cuda_ipc.py): the decode exports its pools, the prefill maps peers'
        c = self.config
        self.ipc: Optional[CudaIpcTransport] = CudaIpcTransport(
            self.device, c.copy_engine, c.ipc_programs, c.ce_min_span_bytes, c.ce_max_spans
        ) if self.transports.ipc else None
        self.auth = Authenticator(key, self.session, self.incarnation) if key else None
        #: the model's KV head count (MHA/GQA; SGLang sets it on the prefill only): heads.py pairs ranks by it
        self.kv_total_heads = 0 if is_mla_backend else int(
            getattr(args, "total_kv_head_num", 0) or int(getattr(args, "kv_head_num", 0) or 0) * self.attn_tp_size
        )
        self.control = ControlChannel(max_sockets=self.config.max_peers, auth=self.auth)
        self.agreement = local_agreement(
            page_size=args.page_size,
            kv_dtype=args.kv_cache_dtype_str,
            kv_item_lens=[r.item_len for r in self.kv_regions],
            state_item_lens=[[r.item_len for r in comp] for comp in self.state_regions],
            slot_bytes=self.staging.slot_bytes,
            auth=self.auth is not None,
            mla=bool(is_mla_backend),
            attn_tp_size=self.attn_tp_size,
            kv_total_heads=self.kv_total_heads,
            aux_item_lens=args.aux_item_lens,
            # SGLang 0.5.23's layout labels; 0.5.17 sets neither
            kv_layout=getattr(args, "kv_layout", None),
            swa_kv_cache_layout=getattr(args, "swa_kv_cache_layout", None),
            state_types=contract.state_type_names(args) or [],
            mha_layout="" if is_mla_backend else contract.mha_page_layout(),
            # how SGLang shards each state tensor over TP (what slicing across attention TP pairs by)
            **_state_shards(args, len(self.state_regions)),
            state_tp_size=int(getattr(self, "state_tp_size", 0) or 0),  # Common, 0.5.23
            hybrid_mla=bool(getattr(args, "is_hybrid_mla_backend", False)),
        )
        #: the test-only KV digest (kv_digest.py), None unless SGLANG_P2P_TEST_KV_DIGEST=1: the roles check only this
        self.kv_digest: Optional[KVDigest] = KVDigest(
            DigestLabel(self._role, int(args.engine_rank), int(self.attn_tp_rank), int(self.attn_tp_size),
                        bool(is_mla_backend), int(args.page_size)),
            self.views[0],
        ) if self.config.test_kv_digest else None
        #: the pair secrets this rank issued to its peers (one per registration)
        self.issued = IssuedSecrets(2 * self.config.max_peers)
        self.watch = PeerWatch(self.config.peer_timeout)
        self._last_beat = 0.0
        self.dropped: Counter = Counter()  # dropped inbound messages by kind (tests, metrics)
        #: set when a background loop cannot go on: every room then fails with this reason
        self.broken: Optional[str] = None
        #: set between SGLang's release and resume of the KV memory: why no transfer may touch the pools meanwhile
        self.kv_released: Optional[str] = None
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._init_role()
        self._spawn(self._control_step, f"p2p-{self._role}-control")
        self._spawn(self._liveness_step, f"p2p-{self._role}-liveness")

    _role = "manager"
    #: off unless SGLANG_P2P_TEST_KV_DIGEST=1 (set in __init__); a class default for managers built without it
    kv_digest: Optional[KVDigest] = None
    kv_released: Optional[str] = None  # likewise (set in __init__)

    def register_to_bootstrap(self) -> None:
        self._limit_inbound()  # before the endpoint is announced: the listener is bound again
        with signed_writes(self.bootstrap_key):  # a keyed bootstrap server takes signed writes only
            super().register_to_bootstrap()

    def _limit_inbound(self) -> None:
        """ZMQ drops a control frame larger than any this rank's pools allow before it is read
        (engine/wire/control.py `max_frame_bytes`): a stranger's frame of GiBs never reaches memory."""
        if getattr(self, "_inbound_limited", False):
            return
        self._inbound_limited = True
        a = self.kv_args

        def pages(ptrs: Any, lens: Any, items: Any) -> int:
            return max((r.num_items for r in regions_from_lists(ptrs or [], lens or [], items or [])), default=0)

        states = [pages(*lists) for lists in zip(getattr(a, "state_data_ptrs", None) or [],
                                                 getattr(a, "state_data_lens", None) or [],
                                                 getattr(a, "state_item_lens", None) or [])]
        aux = sum(int(i) for i in (getattr(a, "aux_item_lens", None) or []))
        bound = limit_inbound(self.server_socket,
                              max_frame_bytes(pages(a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens), states, aux))
        port = int(bound.rpartition(":")[2]) if bound else self.rank_port
        if port != int(self.rank_port):  # another process took the port while the listener was bound again
            logger.warning("the control socket's port %s was taken by another process while it was bound again with "
                           "its frame limit; this rank listens on port %s instead and announces that one",
                           self.rank_port, port)
            self.rank_port = port

    def _init_role(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ threads
    def _kv_device(self, args: KVArgs) -> torch.device:
        if self.config.transport != "tcp" and torch.cuda.is_available():
            return torch.device("cuda", int(getattr(args, "gpu_id", 0) or 0))
        return torch.device("cpu")

    def _spawn(self, step: Callable[[], None], name: str) -> threading.Thread:
        """Run `step` until close(): an exception is logged and the loop goes on; anything that is not an
        Exception (the interpreter is going down, memory is gone) marks the manager broken, loudly."""

        def loop() -> None:
            enter_thread(name, self.device)  # this rank's GPU: the copy paths' fast stream helpers need it current
            while not self._stop.is_set():
                try:
                    step()
                except Exception:
                    logger.exception("p2pnccl: %s: error (the thread goes on)", name)
                except BaseException as e:
                    self._fatal(f"p2pnccl thread {name} stopped: {e!r}")
                    raise

        t = threading.Thread(target=loop, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _fatal(self, reason: str) -> None:
        logger.critical("%s; every room of this rank fails from now on", reason)
        self.broken = reason
        for room in list(self.request_status):
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)

    def _control_step(self) -> None:
        if not self.server_socket.poll(_POLL_MS, zmq.POLLIN):
            return
        try:
            frame_lists = unpack(self.server_socket.recv_multipart())
        except wire.WireError as e:
            self.drop("malformed", "?", str(e))
            return
        for frames in frame_lists:  # in the order sent, each checked and handled as if it had come alone
            try:
                self._control_frames(frames)
            except Exception:  # as the thread's loop does for a frame of its own: the lists behind it still count
                logger.exception("p2pnccl: control message: error (the thread goes on)")

    def _control_frames(self, frames: List[bytes]) -> None:
        """One frame list from the control socket: authenticated, its pair secret admitted, decoded, handled."""
        sender = None
        if self.auth is not None:
            try:
                sender, frames = self.auth.open(frames)
            except AuthError as e:
                self.drop("auth", "?", str(e))
                if e.kind:
                    self._unauthenticated(frames, f"this {self._role} rank has SGLANG_P2P_AUTH_KEY set and the peer "
                                                  + ("sends none" if e.kind == "none" else "a different one"))
                return
        elif frames and frames[0] == AUTH_MAGIC:
            problem = f"the peer has SGLANG_P2P_AUTH_KEY set, this {self._role} rank has none"
            self.drop("auth", "?", problem)
            self._unauthenticated(frames, problem)
            return
        secret, frames = open_frames(frames)
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            self.drop("malformed", sender or "?", str(e))
            return
        if msg is None:
            owner = self._secret_owner(secret)
            if sender is not None and owner is not None and owner != sender:
                self.drop("impersonation", sender, f"SGLang frames with the pair secret of {owner}")
                return
            self._on_sglang_frames(frames, owner)
            return
        claimed = msg.session
        if sender is not None and claimed != sender:
            self.drop("impersonation", sender, f"{type(msg).__name__} claims session {claimed}")
            return
        if not self._admit(msg, secret):
            self.drop("secret", claimed, f"{type(msg).__name__} without the pair secret this rank issued to {claimed}")
            return
        self._on_message(msg)

    def _admit(self, msg: wire.Message, secret: Optional[bytes]) -> bool:
        """Whether `msg` carries the secret this rank issued to the session it names (the role admits first
        contacts too: a registration, an answer to ours)."""
        return self.issued.matches(msg.session, secret)

    def _secret_owner(self, secret: Optional[bytes]) -> Optional[str]:
        return self.issued.owner(secret)

    def _unauthenticated(self, frames: List[bytes], problem: str) -> None:
        """A frame list that failed authentication: keys differ between this rank and a peer, or a stranger. The
        role may act on the registration or the room it names, when it carries a pair secret this rank issued
        (so only the peer this rank registered with, at its address, can), to refuse on both sides at once."""

    def _unauthenticated_message(self, frames: List[bytes]) -> tuple[Optional[bytes], Optional[wire.Message]]:
        """(pair secret, message) inside frames that failed authentication (auth envelope removed), or Nones."""
        if frames and frames[0] == AUTH_MAGIC:
            frames = frames[3:]
        secret, inner = open_frames(frames)
        try:
            return secret, wire.decode(inner)
        except wire.WireError:
            return None, None

    def _liveness_step(self) -> None:
        # silence is checked every _CHECK_S, so a dead peer is noticed within timeout + _CHECK_S
        if self._stop.wait(min(_CHECK_S, self.watch.interval_s)):
            return
        now = time.monotonic()
        if now - self._last_beat >= self.watch.interval_s:
            self._last_beat = now
            beat = wire.Heartbeat(self.session, self.incarnation)
            for peer in self.heartbeat_peers():
                try:
                    self.control.send(peer, beat, block=False)
                except ControlError:
                    pass  # a full queue to a peer is its silence, which expired() reports
        for peer, silent in self.watch.expired():
            self._peer_dead(
                peer,
                f"peer {peer} stopped answering: no message for {silent:.1f}s (SGLANG_P2P_PEER_TIMEOUT="
                f"{self.watch.timeout_s:g}); it is dead, hung or unreachable",
            )
        self._sweep()

    def heartbeat_peers(self) -> List[str]:
        """The peers this rank sends heartbeats to: every watched one, unless a role says otherwise."""
        return self.watch.peers()

    def drop(self, kind: str, peer: str, detail: str) -> None:
        """Count and log a dropped inbound message (rate-limited: a flood must not flood the log)."""
        self.dropped[kind] += 1
        self.log_limited(self.dropped[kind], logging.WARNING, "dropped a control message (%s #%d) from %s: %s",
                         kind, self.dropped[kind], peer, detail)

    @staticmethod
    def log_limited(n: int, level: int, fmt: str, *args: Any) -> None:
        """Log the `n`th event of a kind a stranger can cause: the first ones one by one, then every 1,000th."""
        if n <= _LOG_FIRST or n % 1000 == 0:
            logger.log(level, "p2pnccl: " + fmt, *args)

    # ------------------------------------------------------------------ role hooks
    def _on_message(self, msg: wire.Message) -> None:
        raise NotImplementedError

    def _on_sglang_frames(self, frames: List[bytes], sender: Optional[str]) -> None:
        raise NotImplementedError

    def _peer_dead(self, peer: str, reason: str) -> None:
        raise NotImplementedError

    def _sweep(self) -> None:
        """Periodic clean-up of the role's tables (expired tombstones, orphans)."""

    def _close_role(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ sending
    def _control_send(self, session: str, msg: wire.Message, block: bool = True) -> bool:
        return self._control_send_all(session, (msg,), block)

    def _control_send_all(self, session: str, msgs: Sequence[wire.Message], block: bool = True) -> bool:
        """Best effort, in one frame where packed (ControlChannel.send_all): a peer that cannot be reached is
        logged; its rooms fail by liveness or timeouts."""
        try:
            self.control.send_all(session, msgs, block)
            return True
        except ControlError as e:
            logger.warning("p2pnccl: %s", e)
            return False

    def _send_multipart_locked(self, endpoint: str, parts: List[bytes], is_ipv6: bool = False) -> None:
        """SGLang's own frames (ABORT_ACK, status) go through the control channel too, so they are
        authenticated like ours and share its bounded sockets."""
        self.control.send_frames(endpoint.removeprefix("tcp://"), parts)

    def room_failed(self, room: int, reason: str) -> None:
        """Fail a room of this rank that is still open (nothing is recorded for a concluded room)."""
        if self.request_status.get(room) not in (None, KVPoll.Failed, KVPoll.Success):
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)

    # ------------------------------------------------------------------ memory saver
    def deregister_buffer_to_engine(self) -> None:
        """SGLang releases this rank's KV memory (`release_memory_occupation`; with --enable-memory-saver its pages
        are unmapped right after this returns, until `resume_memory_occupation`). SGLang releases an idle server,
        or a paused one whose waiting requests have sent no KV yet. From here to the resume nothing of this backend
        reads or writes the pools: the role stops its transfers (`_stop_transfers`), the GPU work queued so far
        ends, and the Mooncake registration goes (it names pages that are going). Rooms with no transfer work
        stay open: a paused engine's waiting requests go on after the resume."""
        if self.kv_released is not None:
            return
        self.kv_released = ("this rank's KV memory is released (SGLang's release_memory_occupation); "
                            "call resume_memory_occupation before sending it requests")
        self._stop_transfers(self.kv_released)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a gather or scatter queued before the release has ended
        if self.one_sided is not None:
            self.one_sided.unregister()
        logger.info("p2pnccl: KV memory released; transfers refused until it is resumed")

    def register_buffer_to_engine(self) -> None:
        """SGLang resumed this rank's KV memory (`resume_memory_occupation`): register it again, move KV again."""
        if self.kv_released is None:
            return
        if self.one_sided is not None:
            try:
                self.one_sided.register(self.local_memory.regions())
            except TransportError as e:  # every room fails with this, not with the release's reason
                self._fatal(f"p2pnccl: the KV memory could not be registered with Mooncake again after "
                            f"resume_memory_occupation ({e}); restart this server")
        self._memory_resumed()
        self.kv_released = None
        logger.info("p2pnccl: KV memory resumed; transfers accepted again")

    def _stop_transfers(self, reason: str) -> None:
        """The role's part of a release: no transfer of its own touches the pools once this returns."""
        raise NotImplementedError

    def _memory_resumed(self) -> None:
        """A role's check of its memory after a resume (decode.py: its CUDA IPC export still names it)."""

    def close(self) -> None:
        """Stop this manager's threads and release its channels, staging and sockets (tests, shutdown)."""
        if self._stop.is_set():
            return
        self._stop.set()
        # unblock anything waiting on a peer first (pending accepts, staging waits), then stop the threads
        if self.two_sided is not None:
            self.two_sided.close()
        self.staging.close()
        self._close_role()
        for t in self._threads:
            t.join(timeout=5)
        # after the workers stopped: deregistering memory under a running write is not safe
        if self.one_sided is not None:
            self.one_sided.close()
        if self.ipc is not None:
            self.ipc.close()
        self.control.close()
