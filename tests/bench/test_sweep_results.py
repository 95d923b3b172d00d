"""Readers of the tools' real output, the common CSV/JSON, and the API key scrub."""
from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest

from bench.sweep import evalscope_perf, genai_bench
from bench.sweep.records import COLUMNS, read_csv, read_json, write_csv, write_json
from bench.sweep.scenarios import NAMED
from bench.sweep.slo import Slo

SLO = Slo()
SCENARIOS = [NAMED["smoke"]]


def _genai_file(raw: Path) -> Path:
    return next((raw / "genai-bench").rglob("*_num_concurrency_2_*.json"))


def test_genai_bench_run_parses(raw_copy: Path) -> None:
    [row] = genai_bench.read_results(raw_copy / "genai-bench", SCENARIOS, SLO)
    assert (row.tool, row.scenario, row.concurrency) == ("genai-bench", "smoke", 2)
    assert row.num_requests == 28 and row.num_failed == 0
    assert 5 < row.ttft_ms_p50 < 500 and row.ttft_ms_p50 <= row.ttft_ms_p99  # seconds became ms
    assert 1 < row.tpot_ms_p50 < 100 and row.itl_ms_p50 == row.tpot_ms_p50
    assert row.mean_output_tokens == 8 and row.output_throughput > 0 and row.input_throughput > 0
    assert row.slo_attainment == 1.0 and row.goodput_tok_s == pytest.approx(row.output_throughput)


def test_genai_bench_goodput_drops_failed_and_slow_requests(raw_copy: Path) -> None:
    f = _genai_file(raw_copy)
    doc = json.loads(f.read_text())
    reqs = doc["individual_request_metrics"]
    reqs[0]["error_code"] = 500
    reqs[1]["ttft"] = 3.0
    reqs[2]["tpot"] = 0.2
    f.write_text(json.dumps(doc))
    [row] = genai_bench.read_results(raw_copy / "genai-bench", SCENARIOS, SLO)
    assert row.slo_attainment == pytest.approx(25 / 28)
    assert row.goodput_req_s == pytest.approx(25 / row.duration_s)


def test_genai_bench_ms_time_unit(raw_copy: Path) -> None:
    f = _genai_file(raw_copy)
    doc = json.loads(f.read_text())
    [ref] = genai_bench.read_results(raw_copy / "genai-bench", SCENARIOS, SLO)
    doc["_time_unit"] = "ms"
    for st in ("ttft", "tpot", "e2e_latency"):
        doc["aggregated_metrics"]["stats"][st] = {k: v * 1e3 for k, v in doc["aggregated_metrics"]["stats"][st].items()}
    for r in doc["individual_request_metrics"]:
        r["ttft"], r["tpot"] = r["ttft"] * 1e3, r["tpot"] * 1e3
    f.write_text(json.dumps(doc))
    [row] = genai_bench.read_results(raw_copy / "genai-bench", SCENARIOS, SLO)
    assert row.ttft_ms_p99 == pytest.approx(ref.ttft_ms_p99) and row.e2e_s_p50 == pytest.approx(ref.e2e_s_p50)
    assert row.slo_attainment == 1.0


def test_evalscope_run_parses(raw_copy: Path) -> None:
    [row] = evalscope_perf.read_results(raw_copy / "evalscope", SLO)
    assert (row.tool, row.scenario, row.concurrency, row.num_requests) == ("evalscope", "smoke", 2, 4)
    assert 5 < row.ttft_ms_p50 <= row.ttft_ms_p99 < 500
    assert 1 < row.itl_ms_p50 < 100 and 1 < row.tpot_ms_mean < 100
    # evalscope reports input throughput 0 for chat: the reader derives it from total - output
    assert row.input_throughput > 0 and row.output_throughput > 0
    assert row.slo_attainment == 1.0 and row.goodput_req_s == pytest.approx(4 / row.duration_s)


def test_evalscope_goodput_reads_per_request_rows(raw_copy: Path) -> None:
    db = next((raw_copy / "evalscope").rglob("benchmark_data.db"))
    con = sqlite3.connect(db)
    con.execute("update result set first_chunk_latency = 5.0 where rowid = (select min(rowid) from result)")
    con.commit()
    con.close()
    [row] = evalscope_perf.read_results(raw_copy / "evalscope", SLO)
    assert row.slo_attainment == pytest.approx(3 / 4)
    assert row.goodput_tok_s == pytest.approx(3 * 8 / row.duration_s)


def test_readers_fail_clearly_on_missing_output(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no genai-bench run files"):
        genai_bench.read_results(tmp_path, SCENARIOS, SLO)
    with pytest.raises(ValueError, match="no evalscope runs"):
        evalscope_perf.read_results(tmp_path, SLO)


def test_csv_and_json_round_trip(raw_copy: Path, tmp_path: Path) -> None:
    rows = genai_bench.read_results(raw_copy / "genai-bench", SCENARIOS, SLO)
    rows += evalscope_perf.read_results(raw_copy / "evalscope", SLO)
    rows[0].e2e_s_p99 = math.nan  # a metric a tool did not report
    write_csv(rows, tmp_path / "s.csv")
    header = (tmp_path / "s.csv").read_text().splitlines()[0].split(",")
    assert header == COLUMNS
    back = read_csv(tmp_path / "s.csv")
    assert [(r.tool, r.concurrency) for r in back] == [("evalscope", 2), ("genai-bench", 2)]
    assert back[1].ttft_ms_p50 == pytest.approx(rows[0].ttft_ms_p50, rel=1e-5)
    assert math.isnan(back[1].e2e_s_p99)
    write_json(rows, {"target": "x"}, tmp_path / "s.json")
    json.loads((tmp_path / "s.json").read_text())  # strict JSON: NaN written as null
    meta, jrows = read_json(tmp_path / "s.json")
    assert meta == {"target": "x"} and len(jrows) == 2 and math.isnan(jrows[1].e2e_s_p99)
    (tmp_path / "bad.csv").write_text("tool,scenario\nx,y\n")
    with pytest.raises(ValueError, match="missing columns"):
        read_csv(tmp_path / "bad.csv")


def test_api_key_is_scrubbed_from_genai_bench_metadata(tmp_path: Path) -> None:
    meta = tmp_path / "n4" / "experiment_metadata.json"
    meta.parent.mkdir()
    meta.write_text(json.dumps({"cmd": "genai-bench --api-key sk-real-123 --api-base x"}))
    genai_bench.scrub_api_key(tmp_path, "sk-real-123")
    assert "sk-real-123" not in meta.read_text() and "***" in meta.read_text()
