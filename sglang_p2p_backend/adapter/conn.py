"""SGLang adapter of the p2pnccl backend: the four classes SGLang's registry hands out.

Shaped like SGLang's Mooncake backend (`disaggregation/mooncake/conn.py`): the Common classes do bootstrap,
rank mapping, heartbeat and timeouts. The KV manager is split by role (manager.py: what both share; prefill.py,
decode.py: each role; `P2pNcclKVManager` here builds the role's), the control protocol lives in engine/ (messages.py: message types and static bounds;
checks.py: bounds against local facts; agreement.py: what both sides compare at registration; auth.py: the
optional HMAC envelope; liveness.py: heartbeats), the data path in engine/ too, free of SGLang imports.

Protocol (all on the ordered control channel, see engine/wire/messages.py):
  decode -> prefill: PeerRegister once per pair (answered by PeerAnswer: accepted or refused, with the
  prefill's agreement), RoomMetadata per request, SGLang's ABORT frames; Heartbeat both ways;
  prefill -> decode, two-sided peer (nccl, tcp): CommOffer/CommAnswer and CommInit, then ChunkHeader before
  each chunk's bytes on the pair channel, AuxData (host rows), then Status. The decode applies a prefill's
  Success only after its own receives of every chunk announced before it (engine/pair/arrivals.py), and after the
  aux row, so SGLang's metadata gate passes;
  prefill -> decode, one-sided peer (mooncake): nothing but Status. Each chunk is one Mooncake batch write into
  the decode's registered memory, done before Status is sent (engine/transport/onesided.py).

The bootstrap server is SGLang's, with its input checked and its writes guarded (bootstrap.py).

Release differences (SGLang 0.5.17 vs 0.5.23) are absorbed here and in the role modules: both have the Common
manager state, `update_status`, `record_failure`, `_prepare_send_indices`, the timeouts and the heartbeat;
everything else (status messages, polling, failure exceptions) is implemented here once for both.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, List, Optional

import numpy as np
import numpy.typing as npt

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_p2p_backend.adapter import tracing
from sglang_p2p_backend.adapter.bootstrap import P2pNcclKVBootstrapServer, signed_writes
from sglang_p2p_backend.adapter.decode import DecodeKVManager, published_room
from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.control import ControlError
from sglang_p2p_backend.adapter.manager import P2pNcclKVManagerBase
from sglang_p2p_backend.adapter.prefill import PrefillKVManager

__all__ = ["P2pNcclKVManager", "P2pNcclKVSender", "P2pNcclKVReceiver", "P2pNcclKVBootstrapServer"]


class P2pNcclKVManager:
    """The manager class SGLang's registry hands out for both roles: calling it builds the role's manager,
    `PrefillKVManager` or `DecodeKVManager` (SGLang only calls it, so no instance of this class exists)."""

    def __new__(
        cls,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: Optional[bool] = False,
        **kwargs: Any,
    ) -> P2pNcclKVManagerBase:
        role = PrefillKVManager if disaggregation_mode == DisaggregationMode.PREFILL else DecodeKVManager
        return role(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)


def _latched_poll(obj, timed_state: int, check_timeout) -> KVPoll:
    """Poll shared by sender and receiver: a concluded state sticks (SGLang polls after conclusion), and
    SGLang's own timeout applies while the room sits in `timed_state`."""
    if obj.conclude_state is not None:
        return obj.conclude_state
    if obj.kv_mgr.broken is not None:
        obj.kv_mgr.room_failed(obj.bootstrap_room, obj.kv_mgr.broken)
    status = obj.kv_mgr.request_status.get(obj.bootstrap_room, KVPoll.Failed)
    if status in (KVPoll.Success, KVPoll.Failed):
        obj.conclude_state = status
    elif status == timed_state:
        timed_out = check_timeout()
        if timed_out is not None:
            return timed_out
    return status


def _raise_failure(obj, mgr: P2pNcclKVManagerBase) -> None:
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
    #: SGLang 0.5.23+: send() may get the chunk's page ids as a pinned host tensor still being copied from the
    #: device, with `indices_event` marking the copy's end; the transfer worker waits for it, so the scheduler
    #: does not block on the forward pass in flight (older releases never pass it)
    supports_host_tensor_indices = True

    def __init__(self, mgr: PrefillKVManager, bootstrap_addr: str, bootstrap_room: int, *args: Any, **kwargs: Any):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        # SGLang's --enable-trace spans (tracing.py); Common builds only a null one, for want of a sender_trace_module
        self.trace_ctx = tracing.sender_context(bootstrap_room)
        if getattr(self, "init_time", None) is None:
            self.init_time = time.time()
        #: when this room's first chunk was queued (perf_counter): its transfer latency runs from there to Success
        self._transfer_start_time: Optional[float] = None
        mgr.room_started(bootstrap_room)  # a decode abort that came first fails the room now

    @tracing.traced_send
    def send(self, kv_indices: npt.NDArray[np.int32], state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None, **kwargs: Any):
        if self.conclude_state is not None:
            return
        kv_indices, index_slice, is_last, skip = self._prepare_send_indices(kv_indices, state_indices)
        if skip:
            return
        if self._transfer_start_time is None and (len(kv_indices) > 0 or state_indices is not None):
            self._transfer_start_time = time.perf_counter()  # as Common's send (0.5.23) and NIXL's (both)
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
            indices_event=kwargs.get("indices_event"),
            trace_ctx=tracing.for_thread(self.trace_ctx),
        )
        self._record_transfer_indices(kv_indices, state_indices)

    def _register_prefill_dp_rank(self):
        with signed_writes(self.kv_mgr.bootstrap_key):  # a keyed bootstrap server takes signed writes only
            return super()._register_prefill_dp_rank()

    def poll(self) -> KVPoll:
        if self.conclude_state is None:
            self.kv_mgr.conclude_launched(self.bootstrap_room)  # a dict lookup unless its last copy was queued here
        status = _latched_poll(self, KVPoll.Bootstrapping, self._check_bootstrap_timeout)
        if status in (KVPoll.Success, KVPoll.Failed):
            tracing.finish(self.trace_ctx)  # the request's root span ends when it concludes, as in Common's poll
        if (status == KVPoll.Success and self._transfer_start_time is not None
                and self._transfer_metric.transfer_latency_s is None):
            # SGLang's kv_transfer_latency_ms: the first chunk queued -> Success, as NIXL reports it (without
            # it SGLang counts from the last chunk's queueing only, which leaves out a chunked request's earlier
            # chunks; 0.5.23 names the choice `reports_transfer_latency`)
            self._transfer_metric.transfer_latency_s = time.perf_counter() - self._transfer_start_time
            self.kv_mgr.room_times.seen(self.bootstrap_room)
        return status

    def failure_exception(self):
        tracing.finish(self.trace_ctx)
        _raise_failure(self, self.kv_mgr)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.room_cleared(self.bootstrap_room)

    def abort(self):
        super().abort()
        tracing.finish(self.trace_ctx, aborted=True)  # 0.5.23's Common did it already (a no-op then), 0.5.17's not
        self.kv_mgr.notify_aborted(self.bootstrap_room)


class P2pNcclKVReceiver(CommonKVReceiver):
    def __init__(self, mgr: DecodeKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None, **kwargs: Any):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, **kwargs)
        reason = mgr.incompatible(bootstrap_addr)
        if reason:
            mgr.record_failure(bootstrap_room, reason)
            mgr.update_status(bootstrap_room, KVPoll.Failed)
            mgr.tell_refused_server(bootstrap_addr, [bootstrap_room])

    def _connect_to_bootstrap_server(self, bootstrap_info: dict):
        """SGLang's own frames to a prefill rank (ABORT; BOOTSTRAP) go through the control channel, so they
        are authenticated like ours and share its bounded sockets."""
        return _ControlSocket(self.kv_mgr, f"{bootstrap_info['rank_ip']}:{bootstrap_info['rank_port']}"), nullcontext()

    def _register_kv_args(self) -> bool:
        for info in self.bootstrap_infos:
            endpoint = f"{info['rank_ip']}:{info['rank_port']}"
            try:
                self.kv_mgr.ensure_registered(endpoint)
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
            raise NotImplementedError("p2pnccl receives into device KV pages only (no decode host receive: "
                                      "--disaggregation-decode-host-receive-threshold must stay 1)")
        if device_kv_indices is not None:
            raise NotImplementedError("p2pnccl writes one page list per room; separate device page ids "
                                      "(device_kv_indices, --enable-hisparse) are not supported")
        mgr: DecodeKVManager = self.kv_mgr
        room = self.bootstrap_room
        if getattr(self, "bootstrap_infos", None) is None:
            mgr.record_failure(room, f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}")
            mgr.update_status(room, KVPoll.Failed)
            return
        kv = np.asarray(kv_indices, dtype=np.int32).reshape(-1)
        state_arrays = [np.asarray(s if s is not None else [], dtype=np.int32).reshape(-1) for s in (state_indices or [])]
        endpoints = [f"{i['rank_ip']}:{i['rank_port']}" for i in self.bootstrap_infos]
        real = [e for e, i in zip(endpoints, self.bootstrap_infos) if not i.get("is_dummy", False)]
        if mgr.kv_released is not None:  # its pages may be unmapped: nothing is published, so nothing lands
            mgr.refuse_released(room, endpoints)
            return
        mgr.publish(room, published_room(kv, aux_index, state_arrays, real))
        ids, states = kv.tobytes(), [s.tobytes() for s in state_arrays]
        for endpoint, info in zip(endpoints, self.bootstrap_infos):
            dummy = bool(info.get("is_dummy", False))
            msg = wire.RoomMetadata(
                session=mgr.session,
                incarnation=mgr.incarnation,
                room=room,
                kv_ids=b"" if dummy else ids,
                aux_index=-1 if dummy or aux_index is None else int(aux_index),
                state_ids=[] if dummy else states,
                required_dst_info_num=int(self.required_dst_info_num),
                decode_prefix_len=int(decode_prefix_len or 0),
                is_dummy=dummy,
            )
            try:
                mgr.ensure_registered(endpoint)  # again after a refusal or a peer's death
                mgr.send_room(endpoint, room, wire.encode(msg))  # even to a refusing prefill: it fails its side
            except ControlError as e:
                # not concluded here: ranks that already have the room may write it one-sided, and the
                # manager holds the failure until they answered (without SGLang's deferred release)
                mgr.record_failure(room, f"send_metadata to prefill rank {endpoint} failed: {e}")
                mgr.update_status(room, KVPoll.Failed)
                return
        for endpoint in endpoints:
            refused = mgr.refusal(endpoint)
            if refused:
                mgr.room_failed(room, refused)
        self.init_time = time.time()

    def poll(self) -> KVPoll:
        return _latched_poll(self, KVPoll.WaitingForInput, self._check_waiting_timeout)

    def _check_waiting_timeout(self) -> Optional[KVPoll]:
        """Common's waiting timeout, except for a room whose failure is held (decode.py `_hold`), or with a scatter
        of its chunks queued on the GPU (`scatters_pending`): it turns Failed once its prefill ranks answered, its
        scatters ended or the bound passed, not while a write into its pages may run."""
        if self.kv_mgr.end_expired_hold(self.bootstrap_room) or self.kv_mgr.scatters_pending(self.bootstrap_room):
            return None
        timed_out = super()._check_waiting_timeout()
        return None if self.kv_mgr.holds.held(self.bootstrap_room) else timed_out

    def failure_exception(self):
        _raise_failure(self, self.kv_mgr)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_room(self.bootstrap_room, succeeded=self.conclude_state == KVPoll.Success)

    def abort(self):
        # Without SGLang's deferred release (0.5.17, or turned off) SGLang frees an aborted room's pages once its
        # receiver polls Failed: a room a prefill may still write one-sided is held like the decode's own
        # failures (its prefill ranks told, Failed once they answered after their last write)
        if self.conclude_state is None and self.kv_mgr.hold_abort(self.bootstrap_room, "Aborted by AbortReq."):
            return
        # forgotten first (hold_abort forgot an open room already): nothing to hold (with deferred release SGLang
        # holds the pages itself)
        self.kv_mgr.forget_room(self.bootstrap_room)
        super().abort()


class _ControlSocket:
    """What SGLang's receiver code expects of a socket (`send_multipart`), sending on the control channel."""

    def __init__(self, mgr: P2pNcclKVManagerBase, endpoint: str):
        self._mgr, self._endpoint = mgr, endpoint

    def send_multipart(self, frames: List[bytes]) -> None:
        self._mgr.send_to_prefill(self._endpoint, [bytes(f) for f in frames])
