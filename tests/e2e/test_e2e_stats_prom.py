"""Run statistics (TTFT percentiles, throughput) and KV transfer time read from SGLang's Prometheus text."""
import math

from e2e.promparse import KV_TRANSFER_LATENCY, HistogramTotals, histogram_totals, mean_between
from e2e.stats import RequestRecord, percentile, summarize_run

EXPOSITION = """# HELP sglang:kv_transfer_latency_ms Histogram of KV cache transfer latency in ms.
# TYPE sglang:kv_transfer_latency_ms histogram
sglang:kv_transfer_latency_ms_bucket{engine_type="prefill",le="10.0",model_name="m",tp_rank="0"} 3.0
sglang:kv_transfer_latency_ms_sum{engine_type="prefill",model_name="m",tp_rank="0"} 30.0
sglang:kv_transfer_latency_ms_count{engine_type="prefill",model_name="m",tp_rank="0"} 3.0
sglang:kv_transfer_latency_ms_sum{engine_type="prefill",model_name="m",tp_rank="1"} 10.0
sglang:kv_transfer_latency_ms_count{engine_type="prefill",model_name="m",tp_rank="1"} 1.0
sglang:kv_transfer_latency_ms_created{engine_type="prefill",model_name="m",tp_rank="0"} 1.7e9
sglang:kv_transfer_speed_gb_s_sum{engine_type="prefill"} 99.0
"""


def test_percentile_matches_linear_interpolation():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert math.isclose(percentile(xs, 99), 3.97)
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None


def test_summary_ignores_failed_requests_except_in_the_count():
    recs = [RequestRecord(True, 0.010, 0.5, 32), RequestRecord(True, 0.030, 0.7, 32),
            RequestRecord(False, None, 0.1, 0, "HTTP 500: boom")]
    s = summarize_run(recs, duration_s=2.0)
    assert s["num_requests"] == 3 and s["num_failed"] == 1
    assert s["ttft_ms_p50"] == 20.0 and s["ttft_ms_mean"] == 20.0
    assert s["output_throughput"] == 32.0 and s["request_throughput"] == 1.0
    assert s["errors"] == ["HTTP 500: boom"]


def test_histogram_totals_sum_over_label_sets_and_skip_other_series():
    t = histogram_totals(EXPOSITION, KV_TRANSFER_LATENCY)
    assert t == HistogramTotals(40.0, 4.0)
    assert histogram_totals(EXPOSITION, "sglang:absent_metric") is None


def test_mean_between_two_snapshots():
    assert mean_between(HistogramTotals(40.0, 4.0), HistogramTotals(100.0, 10.0)) == 10.0
    assert mean_between(None, HistogramTotals(30.0, 3.0)) == 10.0
    assert mean_between(HistogramTotals(1.0, 1.0), HistogramTotals(1.0, 1.0)) is None  # nothing observed
    assert mean_between(None, None) is None
