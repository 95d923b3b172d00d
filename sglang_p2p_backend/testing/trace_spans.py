"""SGLang's request tracing in a driver process, set up as its scheduler process does, with the spans kept in memory.

A plan's `trace` ({role: {"enable_trace": bool, "trace_modules": str}}) turns it on for that role: the settings go
into SGLang's published config (`--enable-trace`, `--trace-modules`), then `process_tracing_init` runs with its OTLP
exporter swapped for OpenTelemetry's in-memory one, and the main thread is labelled as SGLang's scheduler labels
it. OpenTelemetry is set up even with `enable_trace` false, so a span made regardless would be caught.
`report()` lists the finished spans for the result (tests/sglang/test_trace_spans.py reads them).
"""

from __future__ import annotations

from typing import Any


class TraceSpans:
    def __init__(self, settings: dict, tp_rank: int, dp_rank: int, label: str = "Prefill Scheduler"):
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from sglang.srt import runtime_context as rc
        from sglang.srt.observability import trace

        rc.get_context().override("p2pnccl test driver", enable_trace=bool(settings.get("enable_trace")),
                                  trace_modules=settings.get("trace_modules", "request"))
        obs = rc.get_observability()
        self.exporter = InMemorySpanExporter()
        trace.get_otlp_span_exporter = lambda endpoint: self.exporter  # nothing leaves the process
        trace.process_tracing_init(obs.otlp_traces_endpoint, "sglang", trace_modules=obs.trace_modules)
        trace.trace_set_thread_info(label, tp_rank, dp_rank)

    def report(self) -> list[dict[str, Any]]:
        """Every finished span: name, ids (hex), parent id, attributes, links."""
        from opentelemetry import trace as otel

        otel.get_tracer_provider().force_flush()
        return [
            {
                "name": s.name,
                "id": f"{s.context.span_id:x}",
                "parent": f"{s.parent.span_id:x}" if s.parent is not None else None,
                "trace_id": f"{s.context.trace_id:x}",
                "attributes": dict(s.attributes or {}),
                "links": len(s.links or ()),
                "start_ns": s.start_time,
                "end_ns": s.end_time,
            }
            for s in self.exporter.get_finished_spans()
        ]
