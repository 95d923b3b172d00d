"""The decode role's driver process: SGLang's decode scheduler loop over its requests, the check of what
landed, and SGLang 0.5.23's deferred release of an aborted room's pages.

A request goes ensure prefill info -> init -> WaitingForInput -> send_metadata -> Success (after the aux
metadata gate) | Failed, polled as SGLang's decode scheduler polls it. On Success the decode checks every
destination page byte for byte and the aux row; after the run, that no other page changed. After an abort it
sent, or a failure (armed then, as SGLang's `pop_transferred` does), it holds the room's pages until the prefill
ranks ACK (or the timeout) and reports `released_at`, `release_safe` and `changed_after_release`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import numpy as np
import torch

from sglang_p2p_backend.testing import faults, kv_checksum
from sglang_p2p_backend.testing.plan import Req, first_token, touch
from sglang_p2p_backend.testing.role import Role

#: how often the scheduler retries an unanswered prefill-info lookup before it aborts (_max_ensure_retries)
_ENSURE_TRIES = 15


class DecodeRole(Role):
    role = "decode"
    _rng_offset = 1

    def mode(self) -> Any:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        return DisaggregationMode.DECODE

    def set_kv_args(self, args: Any) -> None:
        args.engine_rank = self.tp_rank % self.attn_tp

    def after_manager(self) -> None:
        if self.faults.get("ipc_export_short"):
            faults.shorten_ipc_export(self.mgr, self.spec.item_len)
        faults.fail_metadata_part_way(self.mgr, self.faults.get("metadata_fails_after", {}))

    # ------------------------------------------------------------------ state machine
    def step(self, req: Req, now: float) -> None:
        from sglang.srt.disaggregation.utils import KVClassType

        P = self.KVPoll
        if req.phase == "held":
            self.try_release(req)
            return
        if req.phase == "new":
            if not self.may_start(req, now):
                return
            req.handle = self.cls[KVClassType.RECEIVER](mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=req.room)
            req.phase, req.started = "ensure", now
            req.result["ensure_tries"] = 0
            return
        if req.phase == "ensure":
            self.ensure(req)
            return
        status = req.handle.poll()
        if status == P.Failed:
            self.fail(req)
            self.maybe_hold(req)
            if req.phase == "done":
                self.recycle(req, False)
            return
        if req.phase == "handshake":
            if status == P.WaitingForInput:
                if self.take_aux(req):
                    self.publish(req)
                    req.phase, req.result["metadata_at"] = "transfer", now
                    req.result["metadata_at_wall"] = time.time()
            elif status != P.Bootstrapping:
                raise ValueError(f"Unexpected poll case {status} (SGLang raises here too)")
            return
        if faults.decode_after_metadata(self.faults, self.plan, req, now):
            return
        # SGLang's metadata gate: Success counts only once the aux row's bootstrap_room landed
        if status == P.Success and int(self.meta.bootstrap_room[req.aux][0]) != 0:
            self.verify(req)
            req.handle.clear()
            mismatch = self.verify_checksum(req)
            self.finish(req, mismatch is None, mismatch or "")
            self.recycle(req, mismatch is None)
            return
        if req.abort and now - req.result["metadata_at"] >= req.abort.get("after_s", 0):
            self.aborts_at(req, "transfer")

    def ensure(self, req: Req) -> None:
        """The prefill server's parallel info, then init() with the prefill DP rank that holds the request."""
        if req.handle.poll() == self.KVPoll.Failed:
            self.fail(req)
            return
        if self.mgr.try_ensure_parallel_info(self.bootstrap_addr):
            dp_rank = self.prefill_dp_rank(req)
            if dp_rank is not None:
                req.result["prefill_dp_rank"] = dp_rank
                req.handle.init(dp_rank)
                req.phase = "handshake"
                self.aborts_at(req, "init")
        else:
            req.result["ensure_tries"] += 1
            if req.result["ensure_tries"] >= _ENSURE_TRIES:
                req.handle.abort()

    def prefill_dp_rank(self, req: Req) -> Optional[int]:
        """Which prefill DP rank holds the request, resolved as decode.py's _resolve_prefill_dp_rank does."""
        info = self.mgr.prefill_info_table[self.bootstrap_addr]
        if info.dp_size == 1:
            return 0
        if info.follow_bootstrap_room:
            return req.room % info.dp_size
        found = type(req.handle).query_prefill_dp_ranks(self.bootstrap_addr, [req.room])
        return int(found[str(req.room)]) if str(req.room) in found else None

    def publish(self, req: Req) -> None:
        """Take the request's pages (past the decode prefix) and state slot, clear its aux row; send_metadata()."""
        first = req.prefix // self.spec.page_size
        total = math.ceil(req.tokens / self.spec.page_size)
        req.pages = self.take_pages(total - first)
        self.meta.bootstrap_room[req.aux][0] = 0
        if self.pools.states:
            self.take_state(req)
        req.handle.send_metadata(req.pages, req.aux, req.state_ids, decode_prefix_len=req.prefix)
        touch(self.plan, f"decode-{req.key}-published")  # what a later step of the plan may wait for

    def verify(self, req: Req) -> None:
        first = req.prefix // self.spec.page_size
        total = math.ceil(req.tokens / self.spec.page_size)
        bad = self.pools.check(self.seed, req.room, req.pages, first, total)
        room_row = int(self.meta.bootstrap_room[req.aux][0])
        token = int(self.meta.output_ids[req.aux][0])
        state_ok = self.pools.check_state(self.seed, req.room, req.state_ids) if req.state_ids else True
        req.result.update(bad_pages=bad[:20], num_bad_pages=len(bad), aux_room_ok=room_row == req.room, first_token=token,
                          first_token_ok=token == first_token(req.room), state_ok=state_ok)

    def verify_checksum(self, req: Req) -> Optional[str]:
        """SGLang's check of the KV checksum before the request decodes (--disaggregation-enable-kv-checksum):
        the abort message on a mismatch, else None."""
        if getattr(self.meta, "kv_checksum", None) is None:
            return None
        faults.corrupt_after_arrival(self.faults, self.pools, req)
        comparable = self.mgr.should_verify_kv_checksum(self.bootstrap_addr)
        req.result.update(checksum_row=list(self.meta.get_kv_checksum(req.aux)), checksum_comparable=comparable)
        actual = kv_checksum.digest(self.pools, req.pages, req.state_ids)
        return kv_checksum.mismatch(self.meta, req.aux, req.room, actual, kv_checksum.signature(self.mgr.kv_args), comparable)

    # ------------------------------------------------------------------ deferred KV release
    def maybe_hold(self, req: Req) -> None:
        """After a failed transfer, keep the room's pages as SGLang 0.5.23's decode does with deferred release
        (decode.py `pop_transferred`, `_defer_release`): the abort armed (an AbortReq, the waiting timeout), or armed
        now for any other failure; held until every prefill rank that could write them ACKed, or
        SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT."""
        if req.pages is None or not getattr(self.mgr, "enable_deferred_decode_kv_release", False):
            return
        if not req.handle.abort_notified:
            # a failure this decode did not start by aborting holds the pages too (pop_transferred's force_arm)
            req.handle.ensure_abort_notified(force_arm=True)
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
        self.recycle(req, False)

    def held_bytes(self, req: Req) -> list:
        idx = torch.from_numpy(req.pages.astype(np.int64)).to(self.spec.device)
        out = [t[idx].cpu().clone() for t in self.pools.kv]
        return out + (self.pools.state_bytes(req.state_ids) if req.state_ids else [])

    # ------------------------------------------------------------------ report
    def after_requests(self, out: dict) -> None:
        out["untouched_violations"] = self.pools.untouched(self.used_pages, self.used_state)[:20]
        # the state components as KVArgs described them to the manager (SGLang's own pools: its setup_state_kv_args)
        out["state_types"] = [getattr(t, "value", t) for t in getattr(self.mgr.kv_args, "state_types", [])]

    def report(self, req: Req) -> None:
        if "pages" in self.plan.get("reuse", ()) and req.result.get("status") == "Success":
            # pages of failed requests were handed out again at once: a late write into them shows here
            first = req.prefix // self.spec.page_size
            bad = self.pools.check(self.seed, req.room, req.pages, first, math.ceil(req.tokens / self.spec.page_size))
            req.result["bad_pages_at_end"] = bad[:20]
        if req.snapshot is not None:  # a released page written after its release: the bug deferral prevents
            req.result["changed_after_release"] = any(not torch.equal(a, b) for a, b in zip(req.snapshot, self.held_bytes(req)))

    def role_leftovers(self) -> dict:
        m = self.mgr
        return {
            "arrivals_pending": m.arrivals.pending(),
            "live_rooms": sorted(m.live_rooms),
            "prefills": {k: p.state for k, p in m.prefills.items()},
            "receivers": sorted(m.channels.receivers) if m.channels else [],
            "deferred_abort_rooms": sorted(getattr(m, "_deferred_abort_ack_tracker", {})),
            "scatter_gate": m.scatter_gate.state(),  # SGLANG_P2P_DEVICE_SCATTER's counts (adapter/scatter_gate.py)
        }
