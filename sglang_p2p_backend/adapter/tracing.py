"""SGLang's KV-transfer tracing spans (`--enable-trace --trace-modules request,p2pnccl`) for p2pnccl.

Shaped like SGLang's Mooncake backend: a sender's request context (module "p2pnccl", role "Sender") with a
`p2pnccl_send` slice per send(); each chunk carries a copy of it to its transfer worker, which opens
`p2pnccl_worker_send` around the chunk and one `p2pnccl_worker_send_session` in it per decode rank. With tracing
off the contexts are null and every hook is a flag check; a tracing error is logged once and never reaches a
transfer.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

MODULE = "p2pnccl"

# both supported releases (plugin.py) have these; without OpenTelemetry installed, SGLang's trace module reports
# tracing off itself
from sglang.srt.observability.req_time_stats import RequestStageConfig, convert_time_to_realtime_ns
from sglang.srt.observability.trace import (
    TraceNullContext,
    TraceReqContext,
    get_global_tracing_enabled,
    trace_set_thread_info,
)
from sglang.srt.runtime_context import get_observability


class P2pNcclRequestStage:
    """The slices p2pnccl adds to a prefill request's trace (as SGLang's `MooncakeRequestStage`)."""

    P2PNCCL_SEND = RequestStageConfig("p2pnccl_send", level=1)
    P2PNCCL_WORKER_SEND = RequestStageConfig("p2pnccl_worker_send", level=1)
    P2PNCCL_WORKER_SEND_SESSION = RequestStageConfig("p2pnccl_worker_send_session", level=2)


NULL_CONTEXT = TraceNullContext()
_warned = False


def _guarded(step: Callable[[], Any]) -> Any:
    """Run one tracing step; an error in it is logged (once) and swallowed: a span is never worth a transfer."""
    global _warned
    try:
        return step()
    except Exception:
        if not _warned:
            _warned = True
            logger.warning("p2pnccl: a tracing step failed; its spans may be incomplete", exc_info=True)
        return None


def sender_context(bootstrap_room: int) -> Any:
    """The sender's request context, started, as SGLang's CommonKVSender builds it for a backend that names a
    `sender_trace_module`; the null context unless `--enable-trace` is on and the module is traced."""
    # OpenTelemetry set up in this process first (SGLang's process_tracing_init): the one check when tracing is off
    if not get_global_tracing_enabled():
        return NULL_CONTEXT

    def start() -> Any:
        if not get_observability().enable_trace:
            return NULL_CONTEXT
        ctx = TraceReqContext(rid=str(hex(bootstrap_room)), bootstrap_room=bootstrap_room, role="Sender",
                              module_name=MODULE)
        if not ctx.tracing_enable:
            return NULL_CONTEXT
        ctx.trace_req_start()
        return ctx

    return _guarded(start) or NULL_CONTEXT


def traced_send(send: Callable) -> Callable:
    """Wrap a sender's send() in a `p2pnccl_send` slice (SGLang's `mooncake_trace_func`)."""
    stage = P2pNcclRequestStage.P2PNCCL_SEND

    @functools.wraps(send)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = self.trace_ctx
        if not ctx.tracing_enable:
            return send(self, *args, **kwargs)
        _guarded(lambda: ctx.trace_slice_start(stage.stage_name, stage.level))
        try:
            return send(self, *args, **kwargs)
        finally:
            _guarded(lambda: ctx.trace_slice_end(stage.stage_name, stage.level))

    return wrapper


def for_thread(ctx: Any) -> Any:
    """The copy of a sender's context a chunk carries to its worker thread (null when not tracing)."""
    if not ctx.tracing_enable:
        return NULL_CONTEXT
    return _guarded(lambda: ctx.copy_for_thread()) or NULL_CONTEXT


def finish(ctx: Any, aborted: bool = False) -> None:
    """End the request's root span (again is a no-op), marking it aborted when `aborted`."""
    if not ctx.tracing_enable:
        return
    if aborted:
        _guarded(lambda: ctx.abort(abort_info={"reason": "Aborted"}))
    _guarded(lambda: ctx.trace_req_finish())


@dataclass
class ChunkTrace:
    """A chunk's copy of its sender's context, and the ranks its worker thread's span is labelled with."""

    ctx: Any
    tp_rank: Optional[int]
    dp_rank: Optional[int]


def chunk_trace(ctx: Any, tp_rank: Optional[int], dp_rank: Optional[int]) -> Optional[ChunkTrace]:
    """What a transfer task carries for tracing: None when the chunk is not traced."""
    if ctx is None or not ctx.tracing_enable:
        return None
    return ChunkTrace(ctx, tp_rank, dp_rank)


def worker_start(trace: ChunkTrace) -> None:
    """On the worker thread, before the chunk: its thread span, then `p2pnccl_worker_send`."""
    stage = P2pNcclRequestStage.P2PNCCL_WORKER_SEND

    def start() -> None:
        # SGLang keeps a thread's first label: one call per worker thread registers it
        trace_set_thread_info(threading.current_thread().name, tp_rank=trace.tp_rank, dp_rank=trace.dp_rank)
        # this thread's span, not the sender's: 0.5.17's copy keeps the sender thread's id (0.5.23 resets it here)
        trace.ctx.pid = threading.get_native_id()
        trace.ctx.rebuild_thread_context()
        trace.ctx.trace_slice_start(stage.stage_name, stage.level)

    _guarded(start)


def worker_end(trace: ChunkTrace) -> None:
    """After the chunk (sent, skipped or failed): end `p2pnccl_worker_send` and the worker's thread span."""
    stage = P2pNcclRequestStage.P2PNCCL_WORKER_SEND
    _guarded(lambda: trace.ctx.trace_slice_end(stage.stage_name, stage.level, thread_finish_flag=True))


def session_slice(trace: ChunkTrace, started: float, session: str) -> None:
    """One decode rank's part of the chunk, from `started` (time.perf_counter()) to now, naming the rank."""
    stage = P2pNcclRequestStage.P2PNCCL_WORKER_SEND_SESSION

    def record() -> None:
        trace.ctx.trace_slice_start(stage.stage_name, stage.level, convert_time_to_realtime_ns(started))
        trace.ctx.trace_slice_end(stage.stage_name, stage.level, attrs={"decode_session": session})

    _guarded(record)

