"""The same two-process engine pipeline as the GPU test, over the tcp transport on CPU (what CI can run)."""

from bench.transfer.engine_pair import Case, run_cases


def test_two_process_pipeline_over_tcp_is_byte_exact():
    cases = [Case("mla", 1, 90, reps=2, slot_mb=1), Case("mha", 16, 200, reps=1, slot_mb=1)]
    times, verdicts = run_cases(cases, io_timeout=30)
    assert verdicts == [{"bad_pages": 0, "errors": []}] * 2
    assert [len(t) for t in times] == [2, 1]
