"""Drive the p2pnccl backend through SGLang's own classes the way SGLang's schedulers do, one process per role.

`python -m sglang_p2p_backend.testing.driver --role prefill|decode --plan PLAN.json --out RESULT.json`

The plan (shared by both processes) names the pool layout, the requests (room, prompt tokens, chunking,
decode prefix) and optional faults. The prefill process also runs the bootstrap server, as SGLang's prefill
main process does. Each role builds its manager with `get_kv_class(TransferBackend("p2pnccl"), ...)` after
SGLang's plugin loader ran, then polls all its requests in one loop with the scheduler's state machine
(sglang-interface.md §2): prefill: Bootstrapping -> WaitingForInput -> init -> send chunks -> Success |
Failed; decode: ensure prefill info -> init -> WaitingForInput -> send_metadata -> Success (after the aux
metadata gate) | Failed. The decode checks every destination page byte for byte, that no other page changed,
and the aux row. Both report leftovers (rooms, staging, threads) after the run. After an abort it sent, the
decode holds the room's pages as SGLang 0.5.23's deferred release does (until the prefill ranks ACK, or its
timeout) and reports `released_at`, `release_safe` and `changed_after_release`; the prefill reports
`write_done_at`, `ack_sent_at` and `sent_bytes` (what its writes moved) per room (fault `write_delay_s` keeps
each write in flight longer).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch

from sglang_p2p_backend.testing.shm_ipc import IPC_STANDIN_ENV

from sglang_p2p_backend.testing import runtime
from sglang_p2p_backend.testing.launch import one_gpu_env
from sglang_p2p_backend.testing.pools import HostPools, PoolSpec

FIRST_TOKEN = 4242


@dataclass
class Req:
    room: int
    tokens: int
    chunk_pages: int
    prefix: int = 0  # decode prefix tokens (page aligned)
    #: {"side": "prefill"|"decode", "at": ...}: abort this request on that side at that point (prefill: "bootstrap",
    #: "chunk" after `n` chunks, "last" after the last chunk; decode: "init" before its metadata, "transfer" after it)
    abort: Optional[dict] = None
    #: decode: start no sooner than this many seconds into the run, and only once `<after>.ready` exists
    start_after_s: float = 0.0
    after: str = ""
    handle: Any = None
    phase: str = "new"
    pages: Optional[np.ndarray] = None
    aux: int = -1
    state_slot: int = -1
    sent: int = 0
    started: float = 0.0
    hold: Optional[tuple] = None  # decode, deferred release: (required_acks, monotonic deadline)
    snapshot: Optional[list] = None  # decode: the held pages' bytes when they were released
    result: dict = field(default_factory=dict)


def _requests(plan: dict, role: str) -> list[Req]:
    """The plan's requests this role sees (a request may name `roles` to reach only one side)."""
    return [
        Req(r["room"], r["tokens"], r.get("chunk_pages", 1 << 30), r.get("prefix", 0),
            r["abort"] if r.get("abort", {}).get("side") == role else None, r.get("start_after_s", 0.0),
            r.get("after", ""))
        for r in plan["requests"]
        if role in r.get("roles", ("prefill", "decode"))
    ]


class Role:
    def __init__(self, role: str, plan: dict, rank: int = 0):
        self.role = role
        self.rank = rank
        self.plan = plan
        self.tp = int(plan.get("tp", {}).get(role, 1))
        self.attn_dp = int(plan.get("attn_dp", {}).get(role, 1))
        self.attn_tp = self.tp // self.attn_dp
        self.dp_rank = rank // self.attn_tp
        self.spec = rank_heads(PoolSpec(**{**plan["pool"], **plan.get("pool_overrides", {}).get(role, {})}),
                               self.attn_tp, rank % self.attn_tp)
        self.seed = int(plan.get("seed", 0))
        self.faults = plan.get("faults", {}).get(role, {})
        self.host = plan.get("host", "127.0.0.1")
        self.bootstrap_port = int(plan["bootstrap_port"])
        self.bootstrap_addr = f"{self.host}:{self.bootstrap_port}"
        self.server_args = runtime.setup(
            role,
            host=self.host,
            bootstrap_port=self.bootstrap_port,
            dist_port=int(plan["dist_ports"][role]),
            page_size=self.spec.page_size,
            tp_size=self.tp,
            tp_rank=rank,
            attn_dp=self.attn_dp,
            # a rank's device is its pools' GPU (two prefill ranks may share one in the tests)
            local_rank=torch.device(self.spec.device).index if self.spec.device.startswith("cuda") else None,
        )
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

        self.KVPoll = KVPoll
        backend = TransferBackend("p2pnccl")
        self.cls = {t: get_kv_class(backend, t) for t in KVClassType}
        self.shm = None
        if plan.get("ipc_standin") or os.environ.get(IPC_STANDIN_ENV) == "1":
            # CPU stand-in for CUDA IPC (testing/shm_ipc.py): pools in shared memory
            from sglang_p2p_backend.engine.transport import cuda_ipc
            from sglang_p2p_backend.testing.shm_ipc import ShmBackend

            self.shm = ShmBackend()
            cuda_ipc.use_backend(self.shm)
        self.pools = HostPools.allocate(self.spec, self.shm.allocate if self.shm else None)
        aux_rows = max(64, len(plan["requests"]) + 2)
        self.meta = runtime.metadata_buffers(aux_rows, int(plan.get("aux_hidden_size", {}).get(role, 16)))
        self.bootstrap = None
        if role == "prefill" and rank == 0:
            self.bootstrap = start_bootstrap_process(self.host, self.bootstrap_port)
            _touch(plan, "bootstrap")
        elif role == "prefill":
            _wait_for(plan, ["bootstrap"])  # every prefill rank registers with the bootstrap server at start
        args = self.cls[KVClassType.KVARGS]()
        args.engine_rank = rank if role == "prefill" else rank % self.attn_tp
        args.pp_rank = 0
        args.system_dp_rank = self.dp_rank
        args.gpu_id = torch.device(self.spec.device).index or 0
        args.page_size = self.spec.page_size
        # what the model runner reports for the pool (bf16 KV for a bf16 model unless --kv-cache-dtype says else)
        args.kv_cache_dtype_str = plan.get("kv_dtype", {}).get(role, "bfloat16")
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = self.pools.kv_lists()
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.state_data_ptrs, args.state_data_lens, args.state_item_lens = self.pools.state_lists()
        args.state_types = ["MAMBA"] if self.spec.state_slots else []
        args.kv_layer_ids = []
        args.num_draft_entries = 0
        args.ib_device = None
        args.prefill_start_layer = 0
        if role == "prefill" and self.spec.layout == "mha":  # as SGLang's prefill scheduler sets them
            args.kv_head_num = self.spec.kv_heads
            args.total_kv_head_num = self.spec.total_kv_heads or self.spec.kv_heads * self.attn_tp
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        self.mgr = self.cls[KVClassType.MANAGER](args, mode, self.server_args, self.spec.layout == "mla")
        if self.faults.get("ipc_export_short") and self.mgr.ipc is not None and self.mgr.ipc.export is not None:
            # a decode whose export does not cover the pool it registers (a forged or buggy peer)
            first = self.mgr.ipc.export.regions[0]
            first.length -= self.spec.item_len
        self.rng = np.random.default_rng(self.seed + (1 if role == "decode" else 2))
        self.free_pages = list(self.rng.permutation(np.arange(1, self.spec.num_pages)))
        self.free_aux = list(range(1, aux_rows))
        self.free_slots = list(range(self.spec.state_slots))
        self.used_pages: set[int] = set()
        self.used_slots: set[int] = set()
        self.write_done_at: dict[int, float] = {}
        self.sent_bytes: dict[int, int] = {}
        self.ack_sent_at: dict[int, float] = {}
        if role == "prefill":
            self.watch_writes(self.faults.get("write_delay_s", 0))
            self.misdirect_aux(self.faults.get("aux_row", {}))

    def misdirect_aux(self, rows: dict) -> None:
        """Prefill fault `aux_row` ({room: row}): the aux row of those rooms is sent to that row of the decode
        instead of the one it published (a buggy or compromised prefill; two-sided transports)."""
        if not rows:
            return
        send_aux = self.mgr.workers._send_aux
        self.mgr.workers._send_aux = lambda session, room, src, dst: send_aux(session, room, src, int(rows.get(str(room), dst)))

    def watch_writes(self, delay) -> None:
        """Prefill: record when each room's last write returned (`write_done_at`) and when its deferred
        ABORT_ACKs went out (`ack_sent_at`). Fault `write_delay_s` (seconds, or {room: seconds}): each write of
        the manager (a Mooncake batch write, a CUDA IPC copy, a pair channel send) starts that much later, so it is in flight
        for that long."""
        from sglang_p2p_backend.engine.pair.pipeline import PairSender

        mgr, current = self.mgr, threading.local()
        process = mgr.workers._process

        def tracked_process(task):
            current.room = task.room
            return process(task)

        def delayed(send):
            def wrapper(*a, **kw):
                room = getattr(current, "room", None)
                pause = float(delay.get(str(room), 0) if isinstance(delay, dict) else delay or 0)
                if pause:
                    time.sleep(pause)
                try:
                    out = send(*a, **kw)
                    if isinstance(out, int):  # bytes the write moved (KV pages, state; aux rows one-sided)
                        self.sent_bytes[room] = self.sent_bytes.get(room, 0) + out
                    return out
                finally:
                    self.write_done_at[room] = time.time()

            return wrapper

        mgr.workers._process = tracked_process
        if getattr(mgr, "one_sided_sender", None) is not None:
            mgr.one_sided_sender.send = delayed(mgr.one_sided_sender.send)
        if getattr(mgr, "ipc", None) is not None:
            mgr.ipc.write = delayed(mgr.ipc.write)
            mgr.ipc.write_pages = delayed(mgr.ipc.write_pages)
        PairSender.send = delayed(PairSender.send)
        if hasattr(mgr, "_send_abort_ack"):  # SGLang 0.5.23+
            send_ack = mgr._send_abort_ack

            def recorded_ack(room, target):
                self.ack_sent_at.setdefault(room, time.time())
                return send_ack(room, target)

            mgr._send_abort_ack = recorded_ack

    # ------------------------------------------------------------------ helpers
    def take_pages(self, n: int) -> np.ndarray:
        if n > len(self.free_pages):
            raise RuntimeError(f"pool of {self.spec.num_pages} pages too small for the plan")
        pages = np.array([self.free_pages.pop() for _ in range(n)], dtype=np.int32)
        self.used_pages.update(int(p) for p in pages)
        return pages

    def finish(self, req: Req, ok: bool, reason: str = "") -> None:
        req.phase = "done"
        req.result.update(status="Success" if ok else "Failed", reason=reason, seconds=time.monotonic() - req.started,
                          ended_at=time.time())

    def aborts_at(self, req: Req, point: str) -> bool:
        """The plan aborts `req` on this side at `point`: abort it as the scheduler would (AbortReq)."""
        if req.abort is None or req.abort.get("at") != point:
            return False
        req.result["aborted_at"] = point
        req.handle.abort()
        req.abort = None
        return True

    def fail(self, req: Req) -> None:
        try:
            req.handle.failure_exception()
            self.finish(req, False, "failure_exception() did not raise")
        except Exception as e:  # KVTransferError: what the scheduler appends to the abort message
            self.finish(req, False, f"{type(e).__name__}: {e}")

    def leftovers(self) -> dict:
        m = self.mgr
        out = {
            "request_status": sorted(m.request_status),
            "staging_in_use": m.staging.in_use,
            "failure_records": sorted(m.failure_records),
            # pair channels still counted by the communicator budget, and the MB they hold
            "comm_live": sorted(m.comm_budget.pool.live()) if m.comm_budget else [],
            "comm_used_mb": m.comm_budget.used_mb() if m.comm_budget else 0.0,
            "comm_peak_mb": m.comm_budget.peak_mb if m.comm_budget else 0.0,
            "comm_stats": dict(m.comm_budget.stats) if m.comm_budget else {},
            "control_sockets": m.control.open_endpoints(),
            "dropped": dict(m.dropped),
            "watched_peers": sorted(m.watch.peers()),
        }
        if self.role == "prefill":
            out["transfer_infos"] = sorted(m.transfer_infos)
            out["req_to_decode_prefix_len"] = sorted(m.req_to_decode_prefix_len)
            # deferred decode KV release (0.5.23+): in-flight counts and ACKs still held
            out["staging_outstanding"] = sorted(getattr(m, "_staging_outstanding", {}))
            out["deferred_ack_targets"] = sorted(getattr(m, "_deferred_ack_targets", {}))
            out["decode_peers"] = sorted(m.decode_peers)
            out["rejected_peers"] = dict(m.rejected_peers)
            out["pending_registrations"] = len(m.pending)
            out["answer_sockets"] = m.answers.open_endpoints()
            out["concluded"] = sorted(m.concluded)
            out["owned_rooms"] = sorted(m.owned_rooms)
            out["ipc_failed"] = dict(m.same_host.failed)
            out["ipc_mapped"] = m.ipc.mapped_peers() if m.ipc is not None else []
        else:
            out["arrivals_pending"] = m.arrivals.pending()
            out["live_rooms"] = sorted(m.live_rooms)
            out["prefills"] = {k: p.state for k, p in m.prefills.items()}
            out["receivers"] = sorted(m.receivers)
            out["deferred_abort_rooms"] = sorted(getattr(m, "_deferred_abort_ack_tracker", {}))
        return out

    # ------------------------------------------------------------------ decode: deferred KV release
    def maybe_hold(self, req: Req) -> None:
        """After an abort this decode sent (AbortReq, waiting timeout), keep the room's pages as SGLang 0.5.23's
        decode does with deferred release (decode.py `_defer_release`): until every prefill rank that could
        write them ACKed, or SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT."""
        if req.pages is None or not getattr(self.mgr, "enable_deferred_decode_kv_release", False):
            return
        if not getattr(req.handle, "abort_notified", False):
            return
        from sglang.srt.environ import envs

        timeout = envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
        req.hold = (len(req.handle.bootstrap_infos), time.monotonic() + timeout)
        req.phase = "held"

    def try_release(self, req: Req) -> None:
        required, deadline = req.hold
        safe = self.mgr.is_abort_release_safe(req.room, required)
        if not safe and time.monotonic() < deadline:
            return
        req.result.update(released_at=time.time(), release_safe=bool(safe))
        self.mgr.clear_deferred_abort_state(req.room)  # as decode.py's _do_release
        req.snapshot = self.held_bytes(req)
        req.phase = "done"

    def held_bytes(self, req: Req) -> list:
        idx = torch.from_numpy(req.pages.astype(np.int64)).to(self.spec.device)
        out = [t[idx].cpu().clone() for t in self.pools.kv]
        if req.state_slot >= 0:
            out.append(self.pools.state[req.state_slot].cpu().clone())
        return out

    # ------------------------------------------------------------------ prefill
    def step_prefill(self, req: Req, now: float) -> None:
        P = self.KVPoll
        if req.phase == "new":
            req.handle = self.cls_sender(req)
            req.phase, req.started = "bootstrap", now
            self.aborts_at(req, "bootstrap")
            return
        status = req.handle.poll()
        if status == P.Failed:
            self.fail(req)
            return
        if req.phase == "bootstrap":
            if status == P.WaitingForInput:
                prefix = req.handle.pop_decode_prefix_len()
                first = prefix // self.spec.page_size
                total = math.ceil(req.tokens / self.spec.page_size)
                req.pages = self.take_pages(total - first)
                self.pools.fill(self.seed, req.room, req.pages, first, total)
                req.aux = self.free_aux.pop()
                self.meta.output_ids[req.aux][0] = FIRST_TOKEN
                self.meta.bootstrap_room[req.aux][0] = req.room
                if self.spec.state_slots:
                    req.state_slot = self.free_slots.pop()
                    self.used_slots.add(req.state_slot)
                    self.pools.fill_state(self.seed, req.room, req.state_slot)
                req.handle.init(len(req.pages), req.aux)
                req.phase = "send"
            elif status != P.Bootstrapping:
                raise RuntimeError(f"unexpected poll state {status} during bootstrap (SGLang raises here too)")
            return
        if req.phase == "send":
            n = min(req.chunk_pages, len(req.pages) - req.sent)
            last = req.sent + n == len(req.pages)
            state = [np.array([req.state_slot], dtype=np.int32)] if last and self.spec.state_slots else None
            if req.sent == 0:
                req.result["first_send_at"] = time.monotonic()
            req.handle.send(req.pages[req.sent : req.sent + n], state)
            req.sent += n
            delay = float(self.faults.get("chunk_delay_s", 0))
            if delay and not last:
                time.sleep(delay)
            if "abort_after_chunks" in self.faults and req.sent >= self.faults["abort_after_chunks"] * req.chunk_pages:
                req.handle.abort()  # an AbortReq reaching the prefill scheduler mid-transfer
                req.phase = "inflight"
                return
            if "exit_after_chunks" in self.faults and req.sent >= self.faults["exit_after_chunks"] * req.chunk_pages:
                time.sleep(0.3)
                os._exit(17)
            if "stop_after_chunks" in self.faults and req.sent >= self.faults["stop_after_chunks"] * req.chunk_pages:
                stop_self(self.plan, self.role)
            if last:
                req.phase = "inflight"
                self.aborts_at(req, "last")
            elif req.abort and req.abort.get("at") == "chunk" and req.sent >= req.abort.get("n", 1) * req.chunk_pages:
                self.aborts_at(req, "chunk")
                req.phase = "inflight"
            return
        if status == P.Success:
            req.handle.clear()
            req.result["bytes"] = req.handle.get_transfer_metric().transfer_total_bytes
            req.result["transfer_s"] = now - req.result["first_send_at"]
            req.result["success_at"] = now
            self.finish(req, True)

    def cls_sender(self, req: Req):
        from sglang.srt.disaggregation.utils import KVClassType

        cls = self.cls[KVClassType.SENDER]
        return cls(mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=req.room, **runtime.sender_kwargs(cls))

    # ------------------------------------------------------------------ decode
    def step_decode(self, req: Req, now: float) -> None:
        from sglang.srt.disaggregation.utils import KVClassType

        P = self.KVPoll
        if req.phase == "held":
            self.try_release(req)
            return
        if req.phase == "new":
            if now - self.t0 < req.start_after_s or (
                    req.after and not os.path.exists(os.path.join(self.plan["workdir"], f"{req.after}.ready"))):
                return
            req.handle = self.cls[KVClassType.RECEIVER](mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=req.room)
            req.phase, req.started = "ensure", now
            req.result["ensure_tries"] = 0
            return
        if req.phase == "ensure":
            if req.handle.poll() == P.Failed:
                self.fail(req)
                return
            if self.mgr.try_ensure_parallel_info(self.bootstrap_addr):
                dp_rank = self.prefill_dp_rank(req)
                if dp_rank is not None:
                    req.handle.init(dp_rank)
                    req.phase = "handshake"
                    self.aborts_at(req, "init")
            else:
                req.result["ensure_tries"] += 1
                if req.result["ensure_tries"] >= 15:  # the scheduler's _max_ensure_retries
                    req.handle.abort()
            return
        status = req.handle.poll()
        if status == P.Failed:
            self.fail(req)
            self.maybe_hold(req)
            return
        if req.phase == "handshake":
            if status == P.WaitingForInput:
                first = req.prefix // self.spec.page_size
                total = math.ceil(req.tokens / self.spec.page_size)
                req.pages = self.take_pages(total - first)
                req.aux = self.free_aux.pop()
                self.meta.bootstrap_room[req.aux][0] = 0
                state = None
                if self.spec.state_slots:
                    req.state_slot = self.free_slots.pop()
                    self.used_slots.add(req.state_slot)
                    state = [np.array([req.state_slot], dtype=np.int32)]
                req.handle.send_metadata(req.pages, req.aux, state, decode_prefix_len=req.prefix)
                req.phase, req.result["metadata_at"] = "transfer", now
            elif status != P.Bootstrapping:
                raise ValueError(f"Unexpected poll case {status} (SGLang raises here too)")
            return
        if "abort_after_s" in self.faults and now - req.result["metadata_at"] >= self.faults["abort_after_s"]:
            req.result["abort_at"] = time.time()
            req.handle.abort()
            return
        if "exit_after_s" in self.faults and now - req.result["metadata_at"] >= self.faults["exit_after_s"]:
            os._exit(17)
        if "stop_after_s" in self.faults and now - req.result["metadata_at"] >= self.faults["stop_after_s"]:
            stop_self(self.plan, self.role)
        # SGLang's metadata gate: Success counts only once the aux row's bootstrap_room landed
        if status == P.Success and int(self.meta.bootstrap_room[req.aux][0]) != 0:
            self.verify(req)
            req.handle.clear()
            self.finish(req, True)
            return
        if req.abort and now - req.result["metadata_at"] >= req.abort.get("after_s", 0):
            self.aborts_at(req, "transfer")

    def prefill_dp_rank(self, req: Req) -> Optional[int]:
        """Which prefill DP rank holds the request, resolved as decode.py's _resolve_prefill_dp_rank does."""
        info = self.mgr.prefill_info_table[self.bootstrap_addr]
        if info.dp_size == 1:
            return 0
        if info.follow_bootstrap_room:
            return req.room % info.dp_size
        found = type(req.handle).query_prefill_dp_ranks(self.bootstrap_addr, [req.room])
        return int(found[str(req.room)]) if str(req.room) in found else None

    def verify(self, req: Req) -> None:
        first = req.prefix // self.spec.page_size
        total = math.ceil(req.tokens / self.spec.page_size)
        bad = self.pools.check(self.seed, req.room, req.pages, first, total)
        room_row = int(self.meta.bootstrap_room[req.aux][0])
        first_token = int(self.meta.output_ids[req.aux][0])
        state_ok = self.pools.check_state(self.seed, req.room, req.state_slot) if self.spec.state_slots else True
        req.result.update(bad_pages=bad[:20], num_bad_pages=len(bad), aux_room_ok=room_row == req.room, first_token=first_token, state_ok=state_ok)

    # ------------------------------------------------------------------ loop
    def run(self, reqs: list[Req], deadline_s: float) -> dict:
        step = self.step_prefill if self.role == "prefill" else self.step_decode
        fds_start, threads_start = _fds(), threading.active_count()
        start = time.monotonic()
        t0 = self.t0 = start
        while any(r.phase != "done" for r in reqs):
            now = time.monotonic()
            if now - start > deadline_s:
                for r in reqs:
                    if r.phase != "done":
                        r.result.update(status="Hung", phase=r.phase)
                        r.phase = "done"
                break
            pending = [r for r in reqs if r.phase != "done"]
            for r in pending[:1] if self.plan.get("serial") else pending:  # serial: one request at a time
                step(r, now)
            time.sleep(0.002)
        elapsed = time.monotonic() - t0
        out = {"role": self.role, "elapsed_s": elapsed, "requests": {str(r.room): r.result for r in reqs}}
        if self.role == "decode":
            out["untouched_violations"] = self.pools.untouched(self.used_pages, self.used_slots)[:20]
        linger = float(self.plan.get("linger_s", {}).get(self.role, 0))
        time.sleep(linger)  # let the peer finish before this role's sockets go away
        for r in reqs:
            if r.snapshot is not None:  # a released page written after its release: the bug deferral prevents
                r.result["changed_after_release"] = any(not torch.equal(a, b) for a, b in zip(r.snapshot, self.held_bytes(r)))
            if r.room in self.write_done_at:
                r.result["write_done_at"] = self.write_done_at[r.room]
                r.result["sent_bytes"] = self.sent_bytes.get(r.room, 0)
            if r.room in self.ack_sent_at:
                r.result["ack_sent_at"] = self.ack_sent_at[r.room]
        out["leftovers"] = self.leftovers()
        out["resources"] = {"fds_start": fds_start, "fds_end": _fds(),
                            "threads_start": threads_start, "threads_end": threading.active_count()}
        self.mgr.close()
        if self.shm is not None:  # every peer's segment unmapped by close(); ours unlinked
            out["shm_mapped_after_close"] = self.shm.mapped_count()
            self.shm.close()
        out["threads_left"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("p2p-"))
        return out


def rank_heads(spec: PoolSpec, attn_tp: int, attn_tp_rank: int) -> PoolSpec:
    """An MHA pool of `total_kv_heads` heads as attention TP rank `attn_tp_rank` of `attn_tp` holds it: its
    `max(1, total // tp)` heads, contiguous blocks, or head `rank // (tp // total)` when heads are replicated
    (SGLang's MHA pool on a TP rank)."""
    if spec.layout != "mha" or not spec.total_kv_heads:
        return spec
    total = spec.total_kv_heads
    n = max(1, total // attn_tp)
    first = attn_tp_rank * n if total >= attn_tp else attn_tp_rank // (attn_tp // total)
    return replace(spec, kv_heads=n, heads_lo=first)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1


def stop_self(plan: dict, role: str) -> None:
    """Fault: this process stops (SIGSTOP) as a hung or frozen server would; the time goes to `stopped_at`."""
    with open(os.path.join(plan["workdir"], f"{role}.stopped_at"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def _serve_bootstrap(host: str, port: int, parent: int) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    get_kv_class(TransferBackend("p2pnccl"), KVClassType.BOOTSTRAP_SERVER)(host=host, port=port)
    while os.getppid() == parent:  # live exactly as long as the "scheduler" process
        time.sleep(0.2)


def start_bootstrap_process(host: str, port: int):
    """SGLang runs the bootstrap server in the prefill's main process, apart from the scheduler process;
    so does the driver, so a stopped or killed scheduler leaves (or takes down) the bootstrap as in SGLang."""
    import multiprocessing as mp
    import urllib.request

    proc = mp.get_context("spawn").Process(target=_serve_bootstrap, args=(host, port, os.getpid()), daemon=True)
    proc.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"bootstrap server on {host}:{port} did not come up")


def _touch(plan: dict, name: str) -> None:
    open(os.path.join(plan["workdir"], f"{name}.ready"), "w").close()


def _wait_for(plan: dict, names: list[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(plan["workdir"], f"{n}.ready")) for n in names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"peers {names} not ready after {timeout:.0f}s")
        time.sleep(0.05)


def dp_rank_of(plan: dict, role: str, room: int, dp: int) -> int:
    """The DP rank a role's DP controller picks for `room`: the prefill's default follows the bootstrap room
    (`room % dp`, what the decode's bootstrap lookup assumes); the decode's may be anything SGLang's load
    balancer picks, so the plan may name it per room (`decode_dp_rank`), else `room % dp` too."""
    if role == "decode":
        chosen = plan.get("decode_dp_rank", {}).get(str(room))
        if chosen is not None:
            return int(chosen)
    return room % dp


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--rank", type=int, default=0, help="TP rank of this process in its server")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args(argv)
    with open(ns.plan) as f:
        plan = json.load(f)
    # a role still running past its deadline prints every thread's stack (then its parent may kill it)
    faulthandler.dump_traceback_later(float(plan.get("deadline_s", 60)) + 20, exit=False)
    if plan.get("share_gpu"):  # both roles on one GPU over NCCL: before anything starts NCCL
        os.environ.update(one_gpu_env(f"{ns.role}{ns.rank}"))
    os.environ.update(plan.get("env", {}).get(ns.role, {}))  # per-role settings (mismatch tests)
    role = Role(ns.role, plan, ns.rank)
    with open(os.path.join(plan["workdir"], f"{ns.role}-{ns.rank}.session"), "w") as f:
        f.write(role.mgr.session)  # where a test's hostile sender finds this rank's control socket
    _touch(plan, f"{ns.role}-{ns.rank}")
    if ns.role == "decode":
        _wait_for(plan, [f"prefill-{r}" for r in range(int(plan.get("tp", {}).get("prefill", 1)))])
    if ns.role == "prefill" and plan.get("faults", {}).get("prefill", {}).get("stop_self"):
        os.kill(os.getpid(), signal.SIGSTOP)  # a prefill that registered, then never answers
    reqs = _requests(plan, ns.role)
    if role.attn_dp > 1:  # each side's DP controller hands the request to one DP rank
        reqs = [r for r in reqs if dp_rank_of(plan, ns.role, r.room, role.attn_dp) == role.dp_rank]
    result = role.run(reqs, float(plan.get("deadline_s", 60)))
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
