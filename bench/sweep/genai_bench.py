"""genai-bench: command lines for a concurrency sweep and the reader of its per-run JSON files.

genai-bench takes one ``--max-requests-per-run`` for all concurrencies of an invocation, so the sweep makes
one invocation per distinct request count (low concurrencies that share the minimum go together).  Each run
writes ``<D32_8>_text-to-text_num_concurrency_<C>_time_<T>s.json`` (T = measured seconds, so the reader
globs).  Units: latencies in ``_time_unit`` (seconds unless ``--metrics-time-unit ms``).
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .records import SweepRow
from .scenarios import Scenario, requests_for, scenario_from_genai_bench
from .slo import RequestSample, Slo, goodput
from .stats import num

TOOL = "genai-bench"
RUN_FILE = re.compile(r"_num_concurrency_(\d+)_time_\d+s\.json$")


@dataclass(frozen=True)
class Invocation:
    folder: str  # experiment folder name under the base dir
    concurrencies: tuple[int, ...]
    max_requests: int


def plan(concurrencies: Sequence[int], requests_per_user: int, min_requests: int) -> list[Invocation]:
    groups: dict[int, list[int]] = defaultdict(list)
    for c in concurrencies:
        groups[requests_for(c, requests_per_user, min_requests)].append(c)
    return [Invocation(f"n{n}_c{'-'.join(map(str, cs))}", tuple(cs), n) for n, cs in sorted(groups.items())]


def command(
    exe: str, *, base_url: str, model: str, tokenizer: str, api_key: str, scenarios: Sequence[Scenario],
    inv: Invocation, max_minutes: int, base_dir: Path, log_dir: Path, extra: Sequence[str] = (),
) -> list[str]:
    cmd = [
        exe, "benchmark",
        # click validates --api-key in a callback that needs --api-backend already parsed: keep this order
        "--api-backend", "sglang", "--api-key", api_key,
        "--api-base", base_url, "--task", "text-to-text",
        "--api-model-name", model, "--model-tokenizer", tokenizer, "--server-engine", "SGLang",
    ]
    for c in inv.concurrencies:
        cmd += ["--num-concurrency", str(c)]
    for s in scenarios:
        cmd += ["--traffic-scenario", s.genai_bench_spec]
    cmd += [
        "--max-time-per-run", str(max_minutes), "--max-requests-per-run", str(inv.max_requests),
        "--experiment-base-dir", str(base_dir), "--experiment-folder-name", inv.folder,
        "--log-dir", str(log_dir), *extra,
    ]
    return cmd


def scrub_api_key(base_dir: Path, api_key: str) -> None:
    """genai-bench stores its command line, API key included, in experiment_metadata.json."""
    for meta in base_dir.rglob("experiment_metadata.json"):
        text = meta.read_text()
        if api_key in text:
            meta.write_text(text.replace(api_key, "***"))


def _samples(requests: list[dict[str, Any]], unit: float) -> list[RequestSample]:
    return [
        RequestSample(
            ok=r.get("error_code") is None,
            ttft_s=None if r.get("ttft") is None else r["ttft"] * unit,
            itl_s=None if r.get("tpot") is None else r["tpot"] * unit,
            output_tokens=int(r.get("num_output_tokens") or 0),
        )
        for r in requests
    ]


def row_from_run(doc: dict[str, Any], scenarios: Sequence[Scenario], slo: Slo) -> SweepRow:
    agg = doc["aggregated_metrics"]
    st = agg["stats"]
    unit = 1e-3 if doc.get("_time_unit") == "ms" else 1.0  # -> seconds
    ms = unit * 1e3

    def stat(name: str, q: str, scale: float) -> float:
        return num(st.get(name, {}).get(q), scale)

    duration = num(agg.get("run_duration"))
    gp = goodput(_samples(doc.get("individual_request_metrics", []), unit), duration, slo)
    return SweepRow(
        tool=TOOL,
        scenario=scenario_from_genai_bench(agg["scenario"], list(scenarios)),
        concurrency=int(agg["num_concurrency"]),
        num_requests=int(agg.get("num_requests", 0)),
        num_failed=int(agg.get("num_error_requests", 0)),
        duration_s=duration,
        request_throughput=num(agg.get("requests_per_second")),
        input_throughput=num(agg.get("mean_input_throughput_tokens_per_s")),
        output_throughput=num(agg.get("mean_output_throughput_tokens_per_s")),
        mean_input_tokens=stat("num_input_tokens", "mean", 1.0),
        mean_output_tokens=stat("num_output_tokens", "mean", 1.0),
        ttft_ms_mean=stat("ttft", "mean", ms), ttft_ms_p50=stat("ttft", "p50", ms),
        ttft_ms_p90=stat("ttft", "p90", ms), ttft_ms_p99=stat("ttft", "p99", ms),
        tpot_ms_mean=stat("tpot", "mean", ms), tpot_ms_p50=stat("tpot", "p50", ms),
        tpot_ms_p99=stat("tpot", "p99", ms),
        # genai-bench measures no per-token gaps; its per-request TPOT is that request's mean ITL
        itl_ms_mean=stat("tpot", "mean", ms), itl_ms_p50=stat("tpot", "p50", ms),
        itl_ms_p99=stat("tpot", "p99", ms),
        e2e_s_p50=stat("e2e_latency", "p50", unit), e2e_s_p99=stat("e2e_latency", "p99", unit),
        slo_attainment=gp.attainment, goodput_req_s=gp.requests_per_s, goodput_tok_s=gp.output_tokens_per_s,
    )


def read_results(base_dir: Path, scenarios: Sequence[Scenario], slo: Slo) -> list[SweepRow]:
    """Every run JSON under base_dir -> rows; ValueError when there is none (the tool produced nothing)."""
    files = sorted(p for p in base_dir.rglob("*.json") if RUN_FILE.search(p.name))
    if not files:
        raise ValueError(f"no genai-bench run files (*_num_concurrency_*_time_*s.json) under {base_dir}")
    return [row_from_run(json.loads(p.read_text()), scenarios, slo) for p in files]

