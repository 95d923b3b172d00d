"""The common result row of a sweep (one per tool x scenario x concurrency) and its CSV/JSON files.

Both readers (genai_bench, evalscope_perf) produce these rows so the plots and the goodput do not care
which tool measured.  Latencies are in milliseconds, throughputs in tokens/s or requests/s.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable


@dataclass
class SweepRow:
    tool: str
    scenario: str
    concurrency: int
    num_requests: int
    num_failed: int
    duration_s: float
    request_throughput: float  # req/s
    input_throughput: float  # prompt tok/s
    output_throughput: float  # generated tok/s, whole server
    mean_input_tokens: float
    mean_output_tokens: float
    ttft_ms_mean: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    tpot_ms_mean: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    # genai-bench has no per-token ITL: there the ITL columns are the per-request mean ITL (= TPOT)
    itl_ms_mean: float
    itl_ms_p50: float
    itl_ms_p99: float
    e2e_s_p50: float
    e2e_s_p99: float
    slo_attainment: float  # fraction of requests meeting TTFT and ITL SLOs
    goodput_req_s: float
    goodput_tok_s: float


COLUMNS: list[str] = [f.name for f in fields(SweepRow)]
_INT_COLUMNS = {"concurrency", "num_requests", "num_failed"}
_STR_COLUMNS = {"tool", "scenario"}


def _clean(v: Any) -> Any:
    # JSON has no NaN: a metric a tool did not report is written as null
    return None if isinstance(v, float) and math.isnan(v) else v


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        # 6 significant digits: far below the run-to-run noise, and the CSV stays readable
        return "" if math.isnan(v) else f"{v:.6g}"
    return v


def sort_rows(rows: Iterable[SweepRow]) -> list[SweepRow]:
    return sorted(rows, key=lambda r: (r.tool, r.scenario, r.concurrency))


def write_csv(rows: Iterable[SweepRow], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in sort_rows(rows):
            w.writerow({k: _cell(v) for k, v in asdict(r).items()})


def read_csv(path: Path) -> list[SweepRow]:
    """Inverse of write_csv; raises ValueError on a missing column."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(COLUMNS) - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        return [_row_from_strings(d) for d in reader]


def _row_from_strings(d: dict[str, str]) -> SweepRow:
    kw: dict[str, Any] = {}
    for k in COLUMNS:
        v = d[k]
        if k in _STR_COLUMNS:
            kw[k] = v
        elif k in _INT_COLUMNS:
            kw[k] = int(v)
        else:
            kw[k] = float(v) if v != "" else math.nan
    return SweepRow(**kw)


def write_json(rows: Iterable[SweepRow], meta: dict[str, Any], path: Path) -> None:
    doc = {"meta": meta, "columns": COLUMNS,
           "rows": [{k: _clean(v) for k, v in asdict(r).items()} for r in sort_rows(rows)]}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def read_json(path: Path) -> tuple[dict[str, Any], list[SweepRow]]:
    doc = json.loads(path.read_text())
    rows = [SweepRow(**{k: (math.nan if v is None else v) for k, v in r.items()}) for r in doc["rows"]]
    return doc["meta"], rows
