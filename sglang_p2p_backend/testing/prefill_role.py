"""The prefill role's driver process: SGLang's prefill scheduler loop over its requests, the bootstrap server
beside it as SGLang's prefill main process runs one, and a watch over the manager's writes.

A request goes Bootstrapping -> WaitingForInput -> init -> send chunks -> Success | Failed, polled as SGLang's
prefill scheduler polls it. The pages a request sends are filled with the plan's seeded contents
first (testing/pools.py), so the decode can check them byte for byte. Per room the prefill reports
`write_done_at`, `ack_sent_at` and `sent_bytes` (what its writes moved), its `sends` and `traced_chunks`; a plan's
`trace` adds the process's tracing spans (testing/trace_spans.py).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import socket
import threading
import time
import urllib.request
from typing import Any, Callable

import numpy as np

from sglang_p2p_backend.testing import faults, kv_checksum, runtime
from sglang_p2p_backend.testing.plan import Req, first_token, ready, touch, wait_for
from sglang_p2p_backend.testing.role import Role
from sglang_p2p_backend.testing.trace_spans import TraceSpans


class _HeldLaunch:
    """A launched copy as the faults have it run: done `ready_at` (fault `write_delay_s` after its launch), and
    noticed by its worker's wait only at `woken_at` (plus fault `worker_wake_s`: a worker woken late, as one
    waiting for the GIL is); `done_at(when)` records when it ended for the room's `write_done_at`."""

    def __init__(self, launch: Any, ready_at: float, woken_at: float, done_at: Callable[[float], None]):
        self.launch, self.ready_at, self.woken_at, self._done_at = launch, ready_at, woken_at, done_at
        self._ended = False

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._done_at(time.time())

    def done(self) -> bool:
        ran = time.monotonic() >= self.ready_at and self.launch.done()
        if ran:
            self._end()
        return ran

    def wait(self) -> None:
        time.sleep(max(0.0, self.woken_at - time.monotonic()))
        try:
            self.launch.wait()
        finally:
            self._end()


class _IdsLanding:
    """Stands for the CUDA event after SGLang's device-to-host copy of a chunk's page ids: `synchronize()`
    lands the ids (the copy ends) and records which thread waited."""

    def __init__(self, ids: Any, pages: np.ndarray):
        self.ids, self.pages, self.waited_by = ids, pages, None

    def synchronize(self) -> None:
        if self.waited_by is None:
            import torch

            self.ids.copy_(torch.from_numpy(np.asarray(self.pages, dtype=np.int64)))
            self.waited_by = threading.current_thread().name

    def query(self) -> bool:
        """As CUDA's: whether the copy has ended, without waiting (it ends only when a thread waits here)."""
        return self.waited_by is not None


def _serve_bootstrap(host: str, port: int, parent: int) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    get_kv_class(TransferBackend("p2pnccl"), KVClassType.BOOTSTRAP_SERVER)(host=host, port=port)
    while os.getppid() == parent:  # live exactly as long as the "scheduler" process
        time.sleep(0.2)


def _wait_port_free(host: str, port: int, timeout_s: float = 10.0) -> None:
    """A prefill started again at once finds its predecessor's bootstrap server still listening for a moment
    (it follows its parent within 0.2 s): its own would fail to bind, and the health check below would be
    answered by the one about to go."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bootstrap port {host}:{port} still taken after {timeout_s:g}s") from None
        time.sleep(0.05)


def start_bootstrap_process(host: str, port: int) -> Any:
    """SGLang runs the bootstrap server in the prefill's main process, apart from the scheduler process;
    so does the driver, so a stopped or killed scheduler leaves (or takes down) the bootstrap as in SGLang.
    Forked before this process set anything up (no threads, no process groups, no CUDA yet), so it starts with
    whatever SGLang modules the driver already imported instead of importing them again."""
    _wait_port_free(host, port)
    proc = mp.get_context("fork").Process(target=_serve_bootstrap, args=(host, port, os.getpid()), daemon=True)
    proc.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"bootstrap server on {host}:{port} did not come up")


class PrefillRole(Role):
    role = "prefill"
    _rng_offset = 2

    def mode(self) -> Any:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        return DisaggregationMode.PREFILL

    def before_setup(self) -> None:
        self.bootstrap = None
        if self.rank == 0:  # one bootstrap server for every replica of the server
            self.bootstrap = start_bootstrap_process(self.host, self.bootstrap_port)
            touch(self.plan, "bootstrap")

    def before_manager(self) -> None:
        if self.rank != 0:
            wait_for(self.plan, ["bootstrap"])  # every prefill rank registers with the bootstrap server at start
        settings = self.plan.get("trace", {}).get(self.role)
        self.trace_spans = TraceSpans(settings, self.tp_rank, self.dp_rank) if settings is not None else None

    def set_kv_args(self, args: Any) -> None:
        args.engine_rank = self.tp_rank
        if self.spec.layout == "mha":  # as SGLang's prefill scheduler sets them
            args.kv_head_num = self.spec.kv_heads
            args.total_kv_head_num = self.spec.total_kv_heads or self.spec.kv_heads * self.attn_tp

    def after_manager(self) -> None:
        self.write_done_at: dict[int, float] = {}
        self.sent_bytes: dict[int, int] = {}
        self.ack_sent_at: dict[int, float] = {}
        self.traced_chunks: dict[int, int] = {}
        #: request key -> the stand-in events of its chunks' page ids (`send_as_host_tensor`)
        self.landings: dict[str, list] = {}
        self.watch_writes(self.faults.get("write_delay_s", 0), float(self.faults.get("worker_wake_s", 0)))
        faults.misdirect_aux(self.mgr, self.faults.get("aux_row", {}))
        faults.delay_success_mark(self.mgr, self.faults.get("mark_delay_s", {}))

    def watch_writes(self, delay, wake: float = 0.0) -> None:
        """Record when each room's last write returned (`write_done_at`) and when its deferred ABORT_ACKs went
        out (`ack_sent_at`). Fault `write_delay_s` (seconds, or {room: seconds}): each write of the manager (a
        Mooncake batch write, a CUDA IPC copy, a pair channel send) starts that much later, so it is in flight
        for that long. `wake` (fault `worker_wake_s`): a worker waiting for a copy SGLang's thread queued
        notices its end that much later."""
        from sglang_p2p_backend.engine.pair.pipeline import PairSender

        mgr, current = self.mgr, threading.local()
        process = mgr.workers._process

        launch = mgr.workers._launch

        def pause_of(room) -> float:
            return float(delay.get(str(room), 0) if isinstance(delay, dict) else delay or 0)

        def tracked_launch(task, info):
            """A chunk whose copy SGLang's thread queues (SGLANG_P2P_IPC_LAUNCH=scheduler): its write is in flight
            from here until the delay passed (a copy runs from its launch, whenever its worker gets to waiting
            for it, or SGLang's poll sees it done)."""
            current.room, current.launching = task.room, True
            room, ready_at = task.room, time.monotonic() + pause_of(task.room)
            try:
                return launch(task, info)
            finally:
                current.launching = False
                if task.launch is not None:
                    task.launch = _HeldLaunch(task.launch, ready_at, ready_at + wake,
                                              lambda when: self.write_done_at.__setitem__(room, when))

        def tracked_process(task):
            current.room = task.room
            if getattr(task, "trace", None) is not None:  # chunks that carry a trace context (test_trace_spans.py)
                self.traced_chunks[task.room] = self.traced_chunks.get(task.room, 0) + 1
            return process(task)

        def delayed(send: Callable) -> Callable:
            def wrapper(*a, **kw):
                room = getattr(current, "room", None)
                # queued only (a launch): its delay and its end are its worker's wait's (tracked_process)
                queued_only = getattr(current, "launching", False)
                pause = 0.0 if queued_only else pause_of(room)
                if pause:
                    time.sleep(pause)
                try:
                    out = send(*a, **kw)
                    if isinstance(out, int):  # bytes the write moved (KV pages, state; aux rows one-sided)
                        self.sent_bytes[room] = self.sent_bytes.get(room, 0) + out
                    return out
                finally:
                    if not queued_only:
                        self.write_done_at[room] = time.time()

            return wrapper

        mgr.workers._process = tracked_process
        mgr.workers._launch = tracked_launch
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

    # ------------------------------------------------------------------ state machine
    def step(self, req: Req, now: float) -> None:
        P = self.KVPoll
        if req.phase == "new":
            if not self.may_start(req, now):
                return
            req.handle = self.sender(req)
            req.phase, req.started = "bootstrap", now
            self.aborts_at(req, "bootstrap")
            return
        status = req.handle.poll()
        if status == P.Failed:
            self.fail(req)
            self.recycle(req, False)
            return
        if req.phase == "bootstrap":
            if status == P.WaitingForInput:
                if not ready(self.plan, self.plan.get("send_after", {}).get(str(req.room), ())):
                    return  # plan `send_after`: the scheduler has not run this request's prefill yet
                if self.take_aux(req):
                    self.prepare(req)
                    req.phase = "send"
            elif status != P.Bootstrapping:
                raise RuntimeError(f"unexpected poll state {status} during bootstrap (SGLang raises here too)")
            return
        if req.phase == "send":
            self.send(req)
            return
        if status == P.Success:
            if faults.clear_later(self.faults, req, now):
                return
            req.result["cleared_at"] = time.time()
            req.handle.clear()
            metric = req.handle.get_transfer_metric()
            req.result["bytes"] = metric.transfer_total_bytes
            req.result["latency_s"] = metric.transfer_latency_s  # what SGLang's kv_transfer_latency_ms shows
            req.result["transfer_s"] = now - req.result["first_send_at"]
            req.result["success_at"] = now
            self.finish(req, True)
            self.recycle(req, True)

    def sender(self, req: Req) -> Any:
        from sglang.srt.disaggregation.utils import KVClassType

        cls = self.cls[KVClassType.SENDER]
        return cls(mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=req.room, **runtime.sender_kwargs(cls))

    def prepare(self, req: Req) -> None:
        """The decode's prefix is known: take and fill the request's pages, fill its aux row, take its state slot,
        init()."""
        prefix = req.handle.pop_decode_prefix_len()
        first = prefix // self.spec.page_size
        total = math.ceil(req.tokens / self.spec.page_size)
        req.pages = self.take_pages(total - first)
        self.pools.fill(self.seed, req.room, req.pages, first, total)
        self.meta.output_ids[req.aux][0] = first_token(req.room)
        self.meta.bootstrap_room[req.aux][0] = req.room
        if self.pools.states:
            self.take_state(req)
            self.pools.fill_state(self.seed, req.room, req.state_ids)
        if getattr(self.meta, "kv_checksum", None) is not None:  # --disaggregation-enable-kv-checksum (0.5.23)
            row = [kv_checksum.digest(self.pools, req.pages, req.state_ids), kv_checksum.signature(self.mgr.kv_args)]
            kv_checksum.write(self.meta, req.aux, *row)
            req.result["checksum_row"] = row
        req.handle.init(len(req.pages), req.aux)

    def send_as_host_tensor(self, req: Req, pages: np.ndarray, state: Any) -> None:
        """send() as SGLang 0.5.23's prefill calls it for a sender with `supports_host_tensor_indices`: the page
        ids in a host tensor whose copy from the device is still running, `indices_event` marking its end. Here
        the tensor holds -1 until a thread of the sender waits on the event (`_IdsLanding`): a sender that read
        the ids before waiting would send page -1."""
        import torch

        req.result["host_tensor_indices"] = bool(getattr(req.handle, "supports_host_tensor_indices", False))
        if not req.result["host_tensor_indices"]:
            req.handle.send(pages, state)
            return
        ids = torch.full((len(pages),), -1, dtype=torch.int64)
        landing = _IdsLanding(ids, pages)
        req.handle.send(ids, state, indices_event=landing)
        self.landings.setdefault(req.key, []).append(landing)

    def send(self, req: Req) -> None:
        """One send() of the request's next chunk (with the state slot on the last one)."""
        n = min(req.chunk_pages, len(req.pages) - req.sent)
        last = req.sent + n == len(req.pages)
        state = req.state_ids if last and req.state_ids else None
        if req.sent == 0:
            req.result["first_send_at"] = time.monotonic()
        pages = req.pages[req.sent : req.sent + n]
        req.result["sends"] = req.result.get("sends", 0) + 1
        if self.plan.get("host_tensor_indices"):
            self.send_as_host_tensor(req, pages, state)
        else:
            req.handle.send(pages, state)
        req.sent += n
        if faults.prefill_after_send(self.faults, self.plan, req, last):
            req.phase = "inflight"
            return
        if last:
            req.phase = "inflight"
            self.aborts_at(req, "last")
        elif req.abort and req.abort.get("at") == "chunk" and req.sent >= req.abort.get("n", 1) * req.chunk_pages:
            self.aborts_at(req, "chunk")
            req.phase = "inflight"

    # ------------------------------------------------------------------ report
    def report(self, req: Req) -> None:
        if req.room in self.write_done_at:
            req.result["write_done_at"] = self.write_done_at[req.room]
            req.result["sent_bytes"] = self.sent_bytes.get(req.room, 0)
        if req.room in self.ack_sent_at:
            req.result["ack_sent_at"] = self.ack_sent_at[req.room]
        req.result["traced_chunks"] = self.traced_chunks.get(req.room, 0)
        landings = self.landings.get(req.key)
        if landings:  # which thread waited for each chunk's ids (None: nobody did)
            req.result["indices_waited_by"] = [x.waited_by for x in landings]

    def run(self, reqs: list[Req], deadline_s: float) -> dict:
        out = super().run(reqs, deadline_s)
        if self.trace_spans is not None:  # after the manager closed: every worker's spans have ended
            out["spans"] = self.trace_spans.report()
        return out

    def role_leftovers(self) -> dict:
        m = self.mgr
        return {
            "transfer_infos": sorted(m.transfer_infos),
            "req_to_decode_prefix_len": sorted(m.req_to_decode_prefix_len),
            # deferred decode KV release (0.5.23+): in-flight counts and ACKs still held
            "staging_outstanding": sorted(getattr(m, "_staging_outstanding", {})),
            "deferred_ack_targets": sorted(getattr(m, "_deferred_ack_targets", {})),
            "decode_peers": sorted(m.decode_peers),
            "rejected_peers": dict(m.rejected_peers),
            "pending_registrations": len(m.pending),
            "answer_sockets": m.answers.open_endpoints(),
            "concluded": sorted(m.concluded),
            "owned_rooms": sorted(m.owned_rooms),
            "ipc_failed": dict(m.same_host.failed),
            "ipc_mapped": m.ipc.mapped_peers() if m.ipc is not None else [],
            "ipc_routes": m.ipc.route_counts() if m.ipc is not None else {},
            "poll_tables": m.workers.rooms_held(),
            "concluded_in_poll": m.workers.concluded_in_poll,
        }
