"""The same two-process engine pipeline as the GPU test, over the tcp transport on CPU (what CI can run)."""

from bench.transfer.engine_pair import Case, run_cases


def test_two_process_pipeline_over_tcp_is_byte_exact():
    cases = [Case("mla", 1, 90, reps=2, slot_mb=1), Case("mha", 16, 200, reps=1, slot_mb=1)]
    times, verdicts = run_cases(cases, io_timeout=30)
    # every room checked against its published pages as the decode does; on CPU no ids go to a device
    # (no side stream on tcp: nothing is queued on a device, SGLANG_P2P_DEVICE_SCATTER or not)
    clean = {"bad_pages": 0, "bad_others": 0, "errors": [], "room_uploads": 0, "queued": 0, "ended": 0,
             "slots_in_use": 0}
    assert verdicts == [{**clean, "rooms": 3}, {**clean, "rooms": 2}]
    assert [len(t) for t in times] == [2, 1]


def test_a_prefill_that_stops_sending_after_a_header_fails_the_room_and_nothing_else():
    """The fault the GPU test puts under a scatter queued on the device: the prefill's fourth send raises after
    its chunk's header went out. The decode fails the room at the receive's deadline, no page outside the room's
    destinations changes, and every staging slot comes back."""
    (v,) = run_cases([Case("mla", 16, 200, reps=1, slot_mb=1, fail_send_at=3)], io_timeout=5.0)[1]
    assert v["errors"] and all("broke" in e for e in v["errors"]), v
    assert v["bad_others"] == 0 and v["slots_in_use"] == 0, v


def test_the_trace_gives_each_step_of_each_chunk_in_order_without_the_warm_up():
    """A request of several chunks (1 MiB slots): both ends' steps come back as one timeline from the sender's
    start, the decode's header after the prefill handed it on, its post before the chunk lands, the report
    after the landing, a step of every chunk numbered."""
    case = Case("mha", 16, 48, reps=2, slot_mb=1)  # 64 regions x 3 pages of 32 KiB: 6 MiB, 6 chunks
    times, verdicts = run_cases([case], io_timeout=30, trace=True)
    assert verdicts[0]["bad_pages"] == 0 and verdicts[0]["errors"] == []
    steps = [name for name, _ in verdicts[0]["phases_us"]]
    at = dict(verdicts[0]["phases_us"])
    assert steps[0] == "prefill start 0"
    for first, later in (("prefill handed 0", "decode header 0"), ("decode post 0", "decode landed 0"),
                         ("decode landed 0", "decode reported 0"), ("prefill header 1", "prefill handed 1")):
        assert at[first] <= at[later], (first, later, verdicts[0]["phases_us"])
    assert "decode reported 1" in at
