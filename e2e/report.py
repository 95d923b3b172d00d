"""Turn e2e_results.json into the markdown tables for the README (or docs/e2e.md).

    python3 -m e2e.report e2e/results/h200x2-YYYYMMDD.json > table.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from .config import SINGLE_GPU_NOTE
from .results import load as load_result


def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:  # NaN
            return "-"
        if x == float("inf"):
            return "inf"
        # latencies and rates keep one decimal; small figures (logprob differences) keep 3 significant digits
        return f"{x:.{digits}f}" if abs(x) >= 10 else f"{x:.3g}"
    return str(x)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return lines


def machine_line(m: dict[str, Any]) -> str:
    parts = [m.get("kind"), m.get("gpus"), m.get("torch"), m.get("nccl") and f"NCCL {m['nccl']}",
             m.get("sglang") and f"SGLang {m['sglang']}", m.get("date")]
    return "Machine: " + ", ".join(str(p) for p in parts if p) + "."


def check_section(check: dict[str, Any]) -> list[str]:
    rows = []
    for model, e in check.get("models", {}).items():
        sens = e.get("sensitivity", {}).get("min")
        # E2E_CHECK_RELEASE: the same prompts again once both servers released and resumed their KV memory
        passes = [(model, e.get("summary", {}))] + ([(f"{model}, after release/resume", e["after_resume"].get("summary", {}))]
                                                   if "after_resume" in e else [])
        for name, s in passes:
            rows.append([name, e.get("status"), s.get("cases"), s.get("ids_equal"),
                         _g(s.get("max_abs_logprob_diff")), _g(s.get("max_abs_top_logprob_diff")),
                         s.get("bit_identical"), _g(sens), s.get("verdict", "fail")])
    memory = [f"{model}: GPU memory in use {m.get('gpu_mib_before')} MiB, after both servers released their KV "
              f"memory {m.get('gpu_mib_after_release')} MiB, resumed {m.get('gpu_mib_after_resume')} MiB"
              for model, e in check.get("models", {}).items() if (m := e.get("memory_release"))]
    return ["### Correctness: p2pnccl PD through the LB vs one non-PD server (greedy, streaming and not)", "",
            *table(["model", "status", "cases", "ids equal", "max abs dlogprob", "max abs dtop-5", "bit-identical",
                    "sensitivity (nats)", "verdict"], rows), "",
            *([f"Release/resume (memory saver {'on' if check.get('memory_saver') else 'off'}): " + "; ".join(memory)
               + ".", ""] if memory else []),
            "Sensitivity: the smallest logprob change that one changed prompt token caused on the reference; "
            "the check is sharp when it is far above the differences.", ""]


def _g(x: Optional[float]) -> Any:
    return None if x is None else (x if x == float("inf") else float(f"{x:.3g}"))


def sglang_tests_section(t: dict[str, Any]) -> list[str]:
    rows = [[f["file"], tc["id"].split("::")[-1], tc["outcome"], tc["seconds"], tc["message"] or ""]
            for f in t.get("files", []) for tc in (f.get("tests") or [{"id": "-", "outcome": f.get("rc"),
                                                                         "seconds": f.get("seconds"), "message": ""}])]
    return [f"### SGLang's own PD tests, SGLANG_TEST_PD_DISAGG_BACKEND={t.get('backend', 'p2pnccl')}", "",
            *table(["file", "test", "outcome", "s", "reason"], rows), ""]


def perf_section(p: dict[str, Any]) -> list[str]:
    by_key: dict[tuple, dict[str, dict[str, Any]]] = {}
    backends: list[str] = []
    for r in p.get("runs", []):
        by_key.setdefault((r["prompt_tokens"], r["concurrency"]), {})[r["backend"]] = r
        if r["backend"] not in backends:
            backends.append(r["backend"])
    header = ["prompt", "conc."]
    for metric in ("TTFT p50 ms", "TTFT p99 ms", "KV transfer ms", "output tok/s"):
        header += [f"{metric} {b}" for b in backends]
    rows = []
    for (plen, c), per in sorted(by_key.items()):
        row: list[Any] = [plen, c]
        for key in ("ttft_ms_p50", "ttft_ms_p99", "kv_transfer_ms_mean", "output_throughput"):
            row += [per.get(b, {}).get(key) for b in backends]
        rows.append(row)
    failed = sum(r.get("num_failed", 0) or 0 for r in p.get("runs", []))
    out = [f"### p2pnccl vs Mooncake, model {p.get('model')} ({p.get('output_tokens')} output tokens, streaming "
           f"/generate through our LB)", ""]
    if p.get("note"):
        out += [f"{p['note'][0].upper()}{p['note'][1:]}.", ""]
    if not rows:
        return out + ["No load run finished (see Problems).", ""]
    out += [*table(header, rows), "", f"Failed requests over all runs: {failed}. KV transfer: prefill's mean of "
            "sglang:kv_transfer_latency_ms over the run.", ""]
    gb = p.get("genai_bench", {})
    gb_rows = [[b, r.get("concurrency"), r.get("num_requests"), r.get("ttft_ms_p50"), r.get("ttft_ms_p99"),
                r.get("output_throughput")]
               for b, v in gb.items() if isinstance(v, dict) for r in v.get("rows", [])]
    if gb_rows:
        out += ["### genai-bench through the LB", "",
                *table(["backend", "conc.", "requests", "TTFT p50 ms", "TTFT p99 ms", "output tok/s"], gb_rows), ""]
    return out


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:200]


def problems_section(doc: dict[str, Any]) -> list[str]:
    """One line per process that did not come up: what happened and the last line of its log."""
    errors: list[tuple[str, str]] = []
    for model, e in doc.get("check", {}).get("models", {}).items():
        errors += [(name, text) for name, text in (e.get("errors") or {}).items()]
    for backend, e in doc.get("perf", {}).get("backends", {}).items():
        errors += [(name, text) for name, text in (e.get("errors") or {}).items()]
        if e.get("status") == "not_run":
            errors.append((f"perf {backend}", f"not run: {e.get('reason', '')}"))
    if not errors:
        return []
    return ["### Problems", "", *(f"* `{name}`: {str(text).splitlines()[0] if text else ''}; last log line: "
                                  f"`{_last_line(text)}`" for name, text in errors), ""]


def run_gpus(doc: dict[str, Any]) -> Optional[int]:
    """How many GPUs the steps in the file spread their servers over (1 if any step ran on one GPU)."""
    found = {doc[k].get("gpus", 2) for k in ("check", "sglang_tests", "perf") if isinstance(doc.get(k), dict)}
    if isinstance(doc.get("gpus"), int):
        found.add(doc["gpus"])
    return 1 if 1 in found else (2 if found else None)


def transports(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """"<step> <backend>" -> what moved its pages (transport, protocol, env): on one GPU the steps differ."""
    out: dict[str, dict[str, Any]] = {}
    for key in ("check", "sglang_tests"):
        t = doc.get(key, {}).get("transport") if isinstance(doc.get(key), dict) else None
        if t:
            out[f"{key} {doc[key].get('backend', 'p2pnccl')}"] = t
    perf = doc.get("perf") if isinstance(doc.get("perf"), dict) else {}
    for backend, t in (perf.get("transports") or {}).items():
        out[f"perf {backend}"] = t
    return out


def transport_line(ts: dict[str, dict[str, Any]]) -> str:
    parts = []
    for backend, t in ts.items():
        env = " ".join(f"{k}={v}" for k, v in (t.get("env") or {}).items())
        proto = f" ({t['protocol']})" if t.get("protocol") else ""
        parts.append(f"{backend}: {t.get('transport')}{proto}" + (f", {env}" if env else ""))
    return "Transports: " + "; ".join(parts) + "."


def render(doc: dict[str, Any]) -> str:
    gpus = run_gpus(doc)
    where = "one GPU" if gpus == 1 else "two GPUs"
    lines = [f"## End-to-end on {where} (SGLang 0.5.17, PD, p2pnccl vs Mooncake)", "", machine_line(doc.get("machine", {})), ""]
    if gpus == 1:
        lines += [f"**Single-GPU run: {SINGLE_GPU_NOTE}.** SGLang's mooncake backend also ran over tcp "
                  "(MC_FORCE_TCP=1), so in perf the two backends moved pages the same way; figures are not comparable "
                  "with the two-GPU runs (NCCL, NVLink).", ""]
    ts = transports(doc)
    if ts:
        lines += [transport_line(ts), ""]
    if "check" in doc:
        lines += check_section(doc["check"])
    if "sglang_tests" in doc:
        lines += sglang_tests_section(doc["sglang_tests"])
    if "perf" in doc:
        lines += perf_section(doc["perf"])
    lines += problems_section(doc)
    if doc.get("missing_steps"):
        lines += [f"Steps not in this file: {', '.join(doc['missing_steps'])}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    a = ap.parse_args(argv)
    print(render(load_result(a.results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
