"""SGLang's KV-transfer tracing spans for p2pnccl (`--enable-trace --trace-modules request,p2pnccl`), as SGLang's
Mooncake backend emits its own: one prefill rank feeding two decode ranks (driver processes on 127.0.0.1, CPU).

The prefill driver sets up SGLang's tracing as its scheduler does, with OpenTelemetry's in-memory exporter in
place of OTLP (testing/trace_spans.py), and reports every finished span. Per room: the sender's root span names
the room as SGLang names it, a `p2pnccl_send` per send(), a `p2pnccl_worker_send` per chunk on a transfer worker's
thread span, and in each of them a `p2pnccl_worker_send_session` per decode rank. With `--enable-trace` off, no
span at all and no chunk carries a context. And a tracing step that raises never reaches the transfer.
"""

import logging
import math
from collections import Counter

import pytest

from sglang_p2p_backend.adapter import tracing
from sglang_p2p_backend.testing.launch import run_pair

pytestmark = pytest.mark.sglang

pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
trace = pytest.importorskip("sglang.srt.observability.trace")
if not trace.opentelemetry_imported:
    pytest.skip("SGLang's tracing needs the OpenTelemetry SDK and OTLP exporters (requirements/extra-test.txt)",
                allow_module_level=True)
if not hasattr(trace.TraceReqContext, "copy_for_thread"):  # what carries a request's context to a worker thread
    pytest.skip("this SGLang release has no KV-transfer tracing spans", allow_module_level=True)

PS = 16
REQUESTS = [
    {"room": 0xA1, "tokens": 20 * PS + 3, "chunk_pages": 4},  # 6 sends, partial last page
    {"room": 0xA2, "tokens": 9 * PS, "chunk_pages": 1 << 30},  # one send
]
DECODE_RANKS = 2


def plan(trace_settings: dict) -> dict:
    """MHA with 4 heads, decode TP 2: each chunk goes to both decode ranks (each its heads)."""
    return {
        "pool": {"layout": "mha", "num_layers": 2, "page_size": PS, "num_pages": 200, "head_dim": 64,
                 "total_kv_heads": 4},
        "tp": {"prefill": 1, "decode": DECODE_RANKS},
        "requests": REQUESTS,
        "trace": {"prefill": trace_settings},
        "deadline_s": 40,
    }


def landed(result: dict) -> dict:
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    for side in result["ranks"]["decode"] + result["ranks"]["prefill"]:
        for room, r in side["requests"].items():
            assert r["status"] == "Success", (room, r)
    p = result["prefill"]
    for r in REQUESTS:
        want = math.ceil(math.ceil(r["tokens"] / PS) / r["chunk_pages"])
        assert p["requests"][str(r["room"])]["sends"] == want
    return p


def descendants(spans: list, root: dict) -> list:
    by_parent = {}
    for s in spans:
        by_parent.setdefault(s["parent"], []).append(s)
    out, todo = [], [root["id"]]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child["id"])
    return out


@pytest.mark.slow
def test_transfer_spans_per_room_chunk_and_decode_rank():
    result = run_pair(plan({"enable_trace": True, "trace_modules": "request,p2pnccl"}), timeout=180)
    p = landed(result)
    spans = p["spans"]
    by_id = {s["id"]: s for s in spans}
    sessions = set()
    for r in REQUESTS:
        room, sends = str(r["room"]), p["requests"][str(r["room"])]["sends"]
        assert p["requests"][room]["traced_chunks"] == sends
        # the sender's root span, as SGLang's CommonKVSender makes Mooncake's
        roots = [s for s in spans if s["parent"] is None and s["attributes"].get("bootstrap_room") == hex(r["room"])]
        assert len(roots) == 1, [s["name"] for s in spans if s["parent"] is None]
        root = roots[0]
        assert root["attributes"] == {"rid": hex(r["room"]), "bootstrap_room": hex(r["room"]),
                                      "module": "sglang::p2pnccl"}
        assert root["name"] == f"Sender Req {hex(r['room'])}"
        mine = descendants(spans, root)
        assert all(s["trace_id"] == root["trace_id"] for s in mine)
        names = Counter(s["name"] for s in mine if s["name"].startswith("p2pnccl_"))
        assert names == {"p2pnccl_send": sends, "p2pnccl_worker_send": sends,
                         "p2pnccl_worker_send_session": sends * DECODE_RANKS}, names
        for s in mine:
            if s["name"] == "p2pnccl_worker_send":
                # on a worker's thread span of its own, which ended with the chunk
                thread = by_id[s["parent"]]
                assert thread["parent"] == root["id"] and thread["attributes"]["thread_label"].startswith("p2p-transfer-")
                assert thread["attributes"]["tp_rank"] == 0 and thread["end_ns"] >= s["end_ns"]
                assert s["links"] == 1  # to the send() that queued it
                inner = [c for c in mine if c["parent"] == s["id"]]
                assert [c["name"] for c in inner] == ["p2pnccl_worker_send_session"] * DECODE_RANKS
                chunk_sessions = {c["attributes"]["decode_session"] for c in inner}
                assert len(chunk_sessions) == DECODE_RANKS
                sessions |= chunk_sessions
                assert all(s["start_ns"] <= c["start_ns"] <= c["end_ns"] <= s["end_ns"] for c in inner)
            elif s["name"] == "p2pnccl_send":
                assert by_id[s["parent"]]["attributes"]["thread_label"] == "Prefill Scheduler"
    assert len(sessions) == DECODE_RANKS


@pytest.mark.slow
def test_no_span_with_tracing_off():
    # OpenTelemetry is set up in the process all the same: a span p2pnccl made regardless would be exported
    result = run_pair(plan({"enable_trace": False}), timeout=180)
    p = landed(result)
    assert p["spans"] == []
    assert all(p["requests"][str(r["room"])]["traced_chunks"] == 0 for r in REQUESTS)


class _Broken:
    """A request context whose every step raises (a tracing bug, an exporter gone wrong)."""

    tracing_enable = True

    def __getattr__(self, name):
        raise RuntimeError(f"tracing broke in {name}")


def test_a_tracing_error_is_logged_once_and_never_reaches_the_transfer(caplog, monkeypatch):
    monkeypatch.setattr(tracing, "_warned", False)
    sent = []

    class Sender:
        trace_ctx = _Broken()

        @tracing.traced_send
        def send(self, ids):
            sent.append(ids)
            return "sent"

    with caplog.at_level(logging.WARNING, logger=tracing.__name__):
        assert Sender().send([1, 2]) == "sent" and sent == [[1, 2]]
        assert tracing.for_thread(_Broken()) is tracing.NULL_CONTEXT
        chunk = tracing.chunk_trace(_Broken(), 0, 0)
        tracing.worker_start(chunk)
        tracing.session_slice(chunk, 0.0, "127.0.0.1:1")
        tracing.worker_end(chunk)
        tracing.finish(_Broken(), aborted=True)
    assert [r.getMessage() for r in caplog.records] == ["p2pnccl: a tracing step failed; its spans may be incomplete"]


def test_untraced_chunks_carry_nothing():
    assert tracing.chunk_trace(None, 0, 0) is None
    assert tracing.chunk_trace(tracing.for_thread(tracing.NULL_CONTEXT), 0, 0) is None
