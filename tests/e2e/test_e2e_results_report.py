"""Results merging and the markdown report, on fabricated step outputs shaped like the real ones."""
import json
from pathlib import Path

from e2e import report, results
from e2e.sglang_tests import parse_junit

MACHINE = {"kind": "nvidia-h200-x2", "gpus": "2 x NVIDIA H200, 143771 MiB", "torch": "2.11.0+cu130",
           "nccl": "2.28.9", "sglang": "0.5.17", "date": "2026-11-23"}
CHECK = {"backend": "p2pnccl", "models": {
    "llama-tiny": {"status": "ok", "summary": {"cases": 18, "ids_equal": 18, "passed": 18, "max_abs_logprob_diff": 0.0,
                                               "max_abs_top_logprob_diff": 0.0, "bit_identical": True, "verdict": "pass"},
                   "sensitivity": {"min": 0.41}},
    "mla-tiny": {"status": "servers_failed", "errors": {
        "mla-tiny-p2pnccl-prefill": "exited with 1 before serving\n$ python -m sglang.launch_server\nValueError: no MLA\n"}}}}
PERF = {"model": "llama-anchor", "output_tokens": 32, "backends": {"p2pnccl": {"status": "ok"}, "mooncake": {"status": "ok"}},
        "runs": [{"backend": b, "prompt_tokens": 1024, "concurrency": c, "ttft_ms_p50": p50, "ttft_ms_p99": p50 * 2,
                  "kv_transfer_ms_mean": kv, "output_throughput": 100.0 * c, "num_failed": 0}
                 for b, p50, kv in (("p2pnccl", 30.0, 2.0), ("mooncake", 45.0, 9.0)) for c in (1, 16, 64)],
        "genai_bench": {"p2pnccl": {"status": "ok", "rows": [{"concurrency": 1, "num_requests": 16, "ttft_ms_p50": 31.0,
                                                              "ttft_ms_p99": 40.0, "output_throughput": 95.0}]}}}
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1" tests="3">
<testcase classname="test_disaggregation_peer_liveness_abort.TestDisaggregationPeerLivenessAbort" name="test_peer_failures_abort_without_hanging" time="61.2"/>
<testcase classname="x.TestClean" name="test_clean_generate_and_explicit_abort_by_rid" time="3.0"><failure message="AssertionError: 500 != 200&#10;more">trace</failure></testcase>
<testcase classname="x.TestSkip" name="test_s" time="0"><skipped message="needs 4 GPUs"/></testcase>
</testsuite></testsuites>"""


def test_merge_keeps_step_order_and_names_missing_steps(tmp_path):
    (tmp_path / "perf.json").write_text(json.dumps(PERF))
    (tmp_path / "check.json").write_text(json.dumps(CHECK))
    doc = results.merge(MACHINE, results.load_steps(tmp_path))
    assert list(doc) == ["schema", "machine", "check", "perf", "missing_steps"]
    assert doc["missing_steps"] == ["sglang_tests"]


def test_unreadable_step_file_is_reported_not_fatal(tmp_path):
    (tmp_path / "check.json").write_text("{half")
    assert results.load_steps(tmp_path)["check"]["status"] == "unreadable"


def test_parse_junit_outcomes_and_first_line_of_reason():
    tests = parse_junit(JUNIT)
    assert [t["outcome"] for t in tests] == ["passed", "failed", "skipped"]
    assert tests[1]["message"] == "AssertionError: 500 != 200" and tests[0]["seconds"] == 61.2


def test_report_has_machine_correctness_tests_and_perf_tables():
    files = [{"file": "test_x.py", "rc": 1, "tests": parse_junit(JUNIT)}, {"file": "test_y.py", "rc": "timeout", "tests": []}]
    doc = results.merge(MACHINE, {"check": CHECK, "sglang_tests": {"backend": "p2pnccl", "files": files}, "perf": PERF})
    md = report.render(doc)
    assert "Machine: nvidia-h200-x2, 2 x NVIDIA H200" in md and "NCCL 2.28.9" in md
    assert "| llama-tiny | ok | 18 | 18 | 0 | 0 | True | 0.41 | pass |" in md
    assert "| mla-tiny | servers_failed |" in md and "| fail |" in md
    assert "| test_x.py | test_clean_generate_and_explicit_abort_by_rid | failed | 3 | AssertionError: 500 != 200 |" in md
    assert "| test_y.py | - | timeout |" in md
    header = next(line for line in md.splitlines() if line.startswith("| prompt"))
    assert header.startswith("| prompt | conc. | TTFT p50 ms p2pnccl | TTFT p50 ms mooncake |")
    assert "| 1024 | 64 | 30.0 | 45.0 | 60.0 | 90.0 | 2 | 9 | 6400.0 | 6400.0 |" in md
    assert "### genai-bench through the LB" in md and "| p2pnccl | 1 | 16 | 31.0 | 40.0 | 95.0 |" in md
    assert "Steps not in this file" not in md
    assert "* `mla-tiny-p2pnccl-prefill`: exited with 1 before serving; last log line: `ValueError: no MLA`" in md


def test_report_cli_reads_a_file(tmp_path, capsys):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(results.merge(MACHINE, {"check": CHECK})))
    assert report.main([str(p)]) == 0
    out = capsys.readouterr().out
    assert "### Correctness" in out and "Steps not in this file: sglang_tests, perf." in out


def test_sglang_tests_skip_what_does_not_fit_and_keep_what_an_earlier_call_ran(tmp_path):
    import time

    from e2e import sglang_tests

    root = tmp_path / "site"
    for rel, _ in sglang_tests.TEST_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    first_name = Path(sglang_tests.TEST_FILES[0][0]).name
    previous = {"files": [{"file": first_name, "rc": 0, "tests": [{"id": "a::b", "outcome": "passed", "seconds": 1}]}]}
    res = sglang_tests.run(root, tmp_path / "llama-tiny", tmp_path / "logs", deadline=time.monotonic() + 60,
                           previous=previous)
    assert res["files"][0] == previous["files"][0]  # kept, not rerun
    assert res["files"][1]["rc"].startswith("not run: needs ~300 s") and res["files"][1]["tests"] == []
    assert res["summary"] == {"passed": 1, "failed": 0, "error": 0, "skipped": 0}
