"""evalscope perf: command lines for one (scenario, concurrency) run and the reader of its output folders.

One invocation per (scenario, concurrency) so each run gets ``--warmup-num`` = its concurrency (evalscope
takes one warmup count per invocation, and without warmup the first burst inflates TTFT p99).  Layout:
``<base>/<scenario>/c<C>/parallel_<C>_number_<N>/`` with ``benchmark_summary.json``,
``benchmark_percentile.json`` and ``benchmark_data.db`` (SQLite, one row per measured request; warmup
requests are not in it).
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Sequence

from .records import SweepRow
from .scenarios import Scenario
from .slo import RequestSample, Slo, goodput
from .stats import num, pick

TOOL = "evalscope"


def command(
    exe: str, *, base_url: str, model: str, tokenizer: str, api_key: str, scenario: Scenario,
    concurrency: int, number: int, base_dir: Path, extra: Sequence[str] = (),
) -> list[str]:
    return [
        exe, "perf", "--api", "openai",
        "--url", f"{base_url}/v1/chat/completions", "--model", model, "--api-key", api_key,
        # random token ids cut to the exact length with the given tokenizer: no dataset download
        "--dataset", "random", "--tokenizer-path", tokenizer,
        "--min-prompt-length", str(scenario.input_tokens), "--max-prompt-length", str(scenario.input_tokens),
        "--max-tokens", str(scenario.output_tokens), "--min-tokens", str(scenario.output_tokens),
        "--parallel", str(concurrency), "--number", str(number), "--warmup-num", str(concurrency),
        # same output length on every request, as genai-bench's sglang backend asks
        "--extra-args", json.dumps({"ignore_eos": True}),
        "--outputs-dir", str(base_dir / scenario.name), "--name", f"c{concurrency}", "--no-timestamp",
        *extra,
    ]


def _percentiles(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["Percentiles"]: r for r in rows}


def _samples(db: Path) -> list[RequestSample]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        cur = con.execute(
            "select success, first_chunk_latency, time_per_output_token, completion_tokens from result"
        )
        return [
            RequestSample(ok=bool(ok), ttft_s=ttft, itl_s=tpot, output_tokens=int(out or 0))
            for ok, ttft, tpot, out in cur
        ]
    finally:
        con.close()


def row_from_run(run_dir: Path, scenario: str, slo: Slo) -> SweepRow:
    s = json.loads((run_dir / "benchmark_summary.json").read_text())
    pct = _percentiles(json.loads((run_dir / "benchmark_percentile.json").read_text()))

    def p(q: str, key: str, scale: float = 1.0) -> float:
        return pick(pct.get(q, {}), key, scale=scale)

    duration = pick(s, "Test Duration (s)", "Time taken for tests (s)")
    out_tp = pick(s, "Output Throughput (tok/s)", "Output token throughput (tok/s)")
    # evalscope 1.14 reports "Input Throughput" 0.0 for chat runs: derive it from total - output
    in_tp = pick(s, "Total Throughput (tok/s)", "Total token throughput (tok/s)") - out_tp
    db = run_dir / "benchmark_data.db"
    gp = goodput(_samples(db) if db.exists() else [], duration, slo)
    return SweepRow(
        tool=TOOL, scenario=scenario,
        concurrency=int(pick(s, "Concurrency", "Number of concurrency")),
        num_requests=int(pick(s, "Total Requests", "Total requests")),
        num_failed=int(pick(s, "Failed Requests", "Failed requests")),
        duration_s=duration,
        request_throughput=pick(s, "Req Throughput (req/s)", "Request throughput (req/s)"),
        input_throughput=in_tp, output_throughput=out_tp,
        mean_input_tokens=pick(s, "Avg Input Tokens", "Average input tokens per request"),
        mean_output_tokens=pick(s, "Avg Output Tokens", "Average output tokens per request"),
        ttft_ms_mean=pick(s, "Avg TTFT (ms)"), ttft_ms_p50=p("50%", "TTFT (ms)"),
        ttft_ms_p90=p("90%", "TTFT (ms)"), ttft_ms_p99=p("99%", "TTFT (ms)"),
        tpot_ms_mean=pick(s, "Avg TPOT (ms)"), tpot_ms_p50=p("50%", "TPOT (ms)"), tpot_ms_p99=p("99%", "TPOT (ms)"),
        itl_ms_mean=pick(s, "Avg ITL (ms)"), itl_ms_p50=p("50%", "ITL (ms)"), itl_ms_p99=p("99%", "ITL (ms)"),
        e2e_s_p50=p("50%", "Latency (s)"), e2e_s_p99=p("99%", "Latency (s)"),
        slo_attainment=gp.attainment, goodput_req_s=gp.requests_per_s, goodput_tok_s=gp.output_tokens_per_s,
    )


def read_results(base_dir: Path, slo: Slo) -> list[SweepRow]:
    """Every ``<scenario>/c<C>/parallel_*_number_*`` run under base_dir -> rows; ValueError when none."""
    runs = sorted(p.parent for p in base_dir.glob("*/*/parallel_*_number_*/benchmark_summary.json"))
    if not runs:
        raise ValueError(f"no evalscope runs (<scenario>/c<C>/parallel_*_number_*/benchmark_summary.json) under {base_dir}")
    return [row_from_run(r, r.relative_to(base_dir).parts[0], slo) for r in runs]
