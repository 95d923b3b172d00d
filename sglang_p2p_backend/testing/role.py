"""What the driver processes of both roles share: SGLang's process state set up as a scheduler process has it,
the KV manager built through SGLang's own class lookup over host pools (or a stand-in for CUDA IPC), the loop
that steps every request through the role's state machine, and the report of results and leftovers.

The roles' state machines are prefill_role.py and decode_role.py; faults.py holds what a plan injects.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace
import threading
import time
from typing import Any

import numpy as np
import torch

from sglang_p2p_backend.testing import runtime
from sglang_p2p_backend.testing.plan import Req, rank_heads, ready, touch
from sglang_p2p_backend.testing.memory_release import MemoryRelease
from sglang_p2p_backend.testing import sglang_pools
from sglang_p2p_backend.testing.pools import HostPools, PoolSpec

#: names a stand-in for CUDA IPC ("module:Class", an `IpcBackend` that also allocates the pools) this process
#: installs before its manager starts: the suite's shared-memory one runs the same-host path on CPU
IPC_BACKEND_ENV = "P2P_TEST_IPC_BACKEND"


def ipc_standin(name: str) -> Any:
    """Install the stand-in for CUDA IPC that `name` ("module:Class") names, and return it; None for ""."""
    if not name:
        return None
    from sglang_p2p_backend.engine.transport import cuda_ipc

    module, _, cls = name.partition(":")
    backend = getattr(importlib.import_module(module), cls)()
    cuda_ipc.use_backend(backend)
    return backend


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1


class Role:
    """One rank of a role: its manager and pools, and the loop over its requests. A role's class adds its state
    machine (`step`) and what it reports."""

    role = ""
    #: the seed offset of this role's page picks (both roles pick from the same plan seed)
    _rng_offset = 0

    def __init__(self, plan: dict, rank: int = 0):
        role = self.role
        self.rank = rank  # of every process of the role; its TP rank within its replica is `tp_rank`
        self.plan = plan
        self.tp = int(plan.get("tp", {}).get(role, 1))
        self.replicas = int(plan.get("dp", {}).get(role, 1))
        self.replica, self.tp_rank = divmod(rank, self.tp)
        self.attn_dp = int(plan.get("attn_dp", {}).get(role, 1))
        self.attn_tp = self.tp // self.attn_dp
        # the DP rank this process serves, as its server's DP controller numbers them (one of the two DPs is 1)
        self.dp_rank = self.replica if self.replicas > 1 else self.tp_rank // self.attn_tp
        self.num_dp = self.replicas * self.attn_dp
        self.spec = rank_heads(PoolSpec(**{**plan["pool"], **plan.get("pool_overrides", {}).get(role, {})}),
                               self.attn_tp, self.tp_rank % self.attn_tp)
        if self.spec.sglang_pool == "mamba":  # SGLang shards the state over attention TP
            self.spec = replace(self.spec, state_tp=self.attn_tp, state_tp_rank=self.tp_rank % self.attn_tp)
        self.seed = int(plan.get("seed", 0))
        self.faults = plan.get("faults", {}).get(role, {})
        self.host = plan.get("host", "127.0.0.1")
        self.bootstrap_port = int(plan["bootstrap_port"])
        self.bootstrap_addr = f"{self.host}:{self.bootstrap_port}"
        self.before_setup()
        self.server_args = runtime.setup(
            role,
            host=self.host,
            bootstrap_port=self.bootstrap_port,
            dist_port=int(plan["dist_ports"][role][self.replica]),
            page_size=self.spec.page_size,
            tp_size=self.tp,
            tp_rank=self.tp_rank,
            attn_dp=self.attn_dp,
            replicas=self.replicas,
            replica=self.replica,
            load_balance_method=plan.get("load_balance_method", {}).get(role),
            # a rank's device is its pools' GPU (two prefill ranks may share one in the tests)
            local_rank=torch.device(self.spec.device).index if self.spec.device.startswith("cuda") else None,
        )
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

        self.KVPoll = KVPoll
        backend = TransferBackend("p2pnccl")
        self.cls = {t: get_kv_class(backend, t) for t in KVClassType}
        self.shm = ipc_standin(os.environ.get(IPC_BACKEND_ENV, ""))
        if self.spec.sglang_pool:  # SGLang's own pool classes (testing/sglang_pools.py)
            self.pools = sglang_pools.allocate(self.spec)
        else:
            self.pools = HostPools.allocate(self.spec, self.shm.allocate if self.shm else None)
        # row 0 is never handed out; a plan may make the rows few, so they are reused at once (`reuse`)
        aux_rows = int(plan["aux_rows"][role]) + 1 if role in plan.get("aux_rows", {}) else max(64, len(plan["requests"]) + 2)
        self.meta = runtime.metadata_buffers(aux_rows, int(plan.get("aux_hidden_size", {}).get(role, 16)),
                                             bool(plan.get("kv_checksum", {}).get(role)))
        self.before_manager()
        args = self.cls[KVClassType.KVARGS]()
        args.pp_rank = 0
        args.system_dp_rank = self.dp_rank
        args.gpu_id = torch.device(self.spec.device).index or 0
        args.page_size = self.spec.page_size
        # what the model runner reports for the pool (bf16 KV for a bf16 model unless --kv-cache-dtype says else)
        args.kv_cache_dtype_str = plan.get("kv_dtype", {}).get(role, "bfloat16")
        args.kv_layout = plan.get("kv_layout", {}).get(role)  # SGLang 0.5.23's layout label (None: the pool has one)
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        self.pools.describe(args)  # KV regions and state components, as the scheduler describes its pools
        args.kv_layer_ids = []
        args.num_draft_entries = 0
        args.ib_device = None
        args.prefill_start_layer = 0
        self.set_kv_args(args)
        self.mgr = self.cls[KVClassType.MANAGER](args, self.mode(), self.server_args, self.spec.layout == "mla")
        self.rng = np.random.default_rng(self.seed + self._rng_offset)
        self.free_pages = list(self.rng.permutation(np.arange(1, self.spec.num_pages)))
        self.free_aux = list(range(1, aux_rows))
        self.free_state = [list(self.rng.permutation(np.arange(c.first_item, c.num_items))) for c in self.pools.states]
        self.used_pages: set[int] = set()
        self.used_state: list[set[int]] = [set() for _ in self.pools.states]
        release = plan.get("memory_release", {}).get(role)
        self.memory_release = MemoryRelease(self, release) if release else None
        self.after_manager()

    # ------------------------------------------------------------------ the role's part
    def mode(self) -> Any:
        """SGLang's DisaggregationMode of this role."""
        raise NotImplementedError

    def set_kv_args(self, args: Any) -> None:
        """What this role's scheduler sets on KVArgs beyond the pools (its engine rank, say)."""
        raise NotImplementedError

    def before_setup(self) -> None:
        """What must run before SGLang's process state is set up (processes to fork)."""

    def before_manager(self) -> None:
        """What must run before this role's manager starts."""

    def after_manager(self) -> None:
        """What to install on the manager once it runs (instrumentation, faults)."""

    def step(self, req: Req, now: float) -> None:
        """Advance `req` by one poll of the scheduler's state machine."""
        raise NotImplementedError

    def role_leftovers(self) -> dict:
        raise NotImplementedError

    def after_requests(self, out: dict) -> None:
        """Checks once every request concluded, before the linger (the peer may still be running)."""

    def report(self, req: Req) -> None:
        """Add what this role measured of `req` to its result, after the linger."""

    # ------------------------------------------------------------------ helpers
    def take_pages(self, n: int) -> np.ndarray:
        if n > len(self.free_pages):
            raise RuntimeError(f"pool of {self.spec.num_pages} pages too small for the plan")
        pages = np.array([self.free_pages.pop() for _ in range(n)], dtype=np.int32)
        self.used_pages.update(int(p) for p in pages)
        return pages

    def take_state(self, req: Req) -> None:
        """The request's items of every state component (a slot; an SWA window's pages)."""
        req.state_ids = []
        for comp, free, used in zip(self.pools.states, self.free_state, self.used_state):
            if comp.follows is not None:  # SGLang sends it with the KV pages' (or another component's) indices
                ids = req.pages if comp.follows == "kv" else req.state_ids[comp.follows]
                used.update(int(i) for i in ids)
                req.state_ids.append(np.array(ids, dtype=np.int32))
                continue
            if comp.per_request > len(free):
                raise RuntimeError(f"state component of {comp.num_items} items too small for the plan")
            ids = np.array([free.pop() for _ in range(comp.per_request)], dtype=np.int32)
            used.update(int(i) for i in ids)
            req.state_ids.append(ids)

    def may_start(self, req: Req, now: float) -> bool:
        """The plan lets `req` start: `start_after_s` into the run, and once `<after>.ready` exists (each of them,
        for a list)."""
        return now - self.t0 >= req.start_after_s and ready(self.plan, req.after)

    def take_aux(self, req: Req) -> bool:
        """The request's aux row, if one is free (SGLang's scheduler waits for one too)."""
        if not self.free_aux:
            return False
        req.aux = self.free_aux.pop()
        return True

    def recycle(self, req: Req, ok: bool) -> None:
        """Plan `reuse`: the concluded request's aux row, and a failed one's pages, go to the next request at once
        (last in, first out), as SGLang's allocators hand them out."""
        reuse = self.plan.get("reuse", ())
        if "aux" in reuse and req.aux > 0:
            self.free_aux.append(req.aux)
        if "pages" in reuse and not ok and req.pages is not None:
            self.free_pages.extend(int(p) for p in req.pages[::-1])
            req.result["pages_freed_at"] = time.time()

    def finish(self, req: Req, ok: bool, reason: str = "") -> None:
        req.phase = "done"
        req.result.update(status="Success" if ok else "Failed", reason=reason, seconds=time.monotonic() - req.started,
                          ended_at=time.time())
        touch(self.plan, f"{self.role}-{req.key}-done")  # what a later request of the plan may wait for

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
        out.update(self.role_leftovers())
        return out

    # ------------------------------------------------------------------ loop
    def run(self, reqs: list[Req], deadline_s: float) -> dict:
        fds_start, threads_start = _fds(), threading.active_count()
        start = time.monotonic()
        t0 = self.t0 = start
        while any(r.phase != "done" for r in reqs):
            now = time.monotonic()
            if now - start > deadline_s:
                for r in reqs:
                    if r.phase not in ("done", "held"):  # a held request concluded; only its pages are kept
                        r.result.update(status="Hung", phase=r.phase)
                    r.phase = "done"
                break
            if self.memory_release is not None:
                self.memory_release.step()
            pending = [r for r in reqs if r.phase != "done"]
            for r in pending[:1] if self.plan.get("serial") else pending:  # serial: one request at a time
                self.step(r, now)
            time.sleep(0.002)
        elapsed = time.monotonic() - t0
        out = {"role": self.role, "elapsed_s": elapsed, "requests": {r.key: r.result for r in reqs}}
        if self.memory_release is not None:
            out["memory_release"] = self.memory_release.report()
        self.after_requests(out)
        linger = float(self.plan.get("linger_s", {}).get(self.role, 0))
        time.sleep(linger)  # let the peer finish before this role's sockets go away
        for r in reqs:
            self.report(r)
        out["leftovers"] = self.leftovers()
        out["resources"] = {"fds_start": fds_start, "fds_end": _fds(),
                            "threads_start": threads_start, "threads_end": threading.active_count()}
        self.mgr.close()
        if self.shm is not None:  # every peer's segment unmapped by close(); ours unlinked
            out["shm_mapped_after_close"] = self.shm.mapped_count()
            self.shm.close()
        out["threads_left"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("p2p-"))
        return out

