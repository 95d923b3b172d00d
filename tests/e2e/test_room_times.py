"""SGLANG_P2P_ROOM_TIMES: the prefill's steps of a room timed and logged at Success, read back by the serve phase."""

import os

from e2e import room_times, serve_report

from sglang_p2p_backend.adapter.room_times import RoomTimes, runq_wait
from sglang_p2p_backend.engine.transport.cuda_ipc import WriteMarks


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def timed(enabled: bool = True, limit: int = 4096):
    clock, lines = Clock(), []
    return RoomTimes(enabled, limit, clock, lines.append, runq=lambda: None), clock, lines


def test_a_rooms_steps_are_milliseconds_from_its_first_chunk_and_the_last_chunks_replace_the_earlier():
    times, clock, lines = timed()
    for step, at in [("queued", 0.0), ("picked", 0.4), ("ready", 0.5), ("written", 2.0), ("queued", 3.0),
                     ("picked", 3.25), ("ready", 3.5), ("written", 5.0), ("concluded", 5.125)]:
        clock.t = 100.0 + at / 1e3
        times.mark(7, step)
    clock.t = 100.0 + 6.5 / 1e3
    line = times.seen(7)
    assert line == ("p2pnccl: room times 7 chunks 2: last_queued 3.000, picked 3.250, ready 3.500, written 5.000, "
                    "concluded 5.125, seen 6.500")
    assert lines == [line]
    assert times.seen(7) is None  # forgotten at its Success: a second look logs nothing
    (room,) = room_times.parse("noise\n[2026-11-30 21:00:00] " + line + "\nmore noise")
    assert room == {"room": 7, "chunks": 2.0, "last_queued": 3.0, "picked": 3.25, "ready": 3.5, "written": 5.0,
                    "concluded": 5.125, "seen": 6.5}


def test_a_writes_marks_give_its_host_steps_and_cpu_unless_unknown_or_from_before_the_chunk_was_ready():
    cpu, runq = Clock(), Clock()
    lines: list = []
    clock = Clock()
    times = RoomTimes(True, 4096, clock, lines.append, cpu, runq)
    times.mark(3, "queued")
    clock.t += 0.001
    times.mark(3, "ready")
    times.mark_write(3, lambda: None)  # the backend does not record them
    times.mark_write(3, lambda: WriteMarks(100.0, 100.0005, 0.0))  # an earlier write's: before this chunk was ready
    clock.t += 0.003
    times.mark(3, "written")
    assert times.seen(3) == ("p2pnccl: room times 3 chunks 1: last_queued 0.000, ready 1.000, written 4.000, seen 4.000, "
                             "runq_written 0.000")
    # the write planned 0.5 ms and queued 2.5 ms after ready, its thread busy 0.25 ms of the 2.5
    clock.t, cpu.t = 100.0, 7.0
    times.mark(4, "queued")
    times.mark(4, "ready")
    times.mark_write(4, lambda: WriteMarks(100.0005, 100.0025, 7.00025))
    clock.t, runq.t = 100.004, 100.00125  # and waited 1.25 ms for a CPU from ready to written
    times.mark(4, "written")
    line = times.seen(4)
    assert line.endswith("ready 0.000, planned 0.500, launched 2.500, written 4.000, seen 4.000, cpu_launched 0.250, "
                         "runq_written 1.250"), line
    (room,) = room_times.parse(line)
    assert room["planned"] == 0.5 and room["launched"] == 2.5 and room["cpu_launched"] == 0.25
    assert room["runq_written"] == 1.25 and room_times.summarize([room])["runq_written"] == 1.25
    # a later chunk's ready drops the earlier chunk's write: a chunk that wrote nothing here shows none
    clock.t = 100.0
    times.mark(5, "queued")
    times.mark(5, "ready")
    times.mark_write(5, lambda: WriteMarks(100.0005, 100.001, 7.0005))
    times.mark(5, "queued")
    clock.t = 100.002
    times.mark(5, "ready")
    assert times.seen(5) == "p2pnccl: room times 5 chunks 2: last_queued 0.000, ready 2.000, seen 2.000"


def test_the_run_queue_wait_is_the_kernels_figure_for_this_thread():
    got = runq_wait()
    if got is None:  # a kernel without schedstat: the figure is left out, never guessed
        assert not os.path.exists("/proc/thread-self/schedstat")
        return
    with open("/proc/thread-self/schedstat") as f:
        assert 0 <= got <= int(f.read().split()[1]) / 1e9


def test_off_nothing_is_kept_and_a_room_opens_only_at_its_first_chunk_queued():
    off, clock, lines = timed(enabled=False)
    off.mark(1, "queued")
    assert off.seen(1) is None and lines == [] and not off._rooms
    on, clock, lines = timed()
    on.mark(2, "picked")  # queued before the times were on (or dropped for the bound): not timed
    assert on.seen(2) is None and lines == []


def test_at_most_limit_rooms_are_kept_the_oldest_dropped_and_a_forgotten_room_logs_nothing():
    times, clock, lines = timed(limit=2)
    for room in (1, 2, 3):
        times.mark(room, "queued")
    assert list(times._rooms) == [2, 3]
    times.forget(3)
    assert times.seen(1) is None and times.seen(3) is None and times.seen(2) is not None
    assert len(lines) == 1 and lines[0] == "p2pnccl: room times 2 chunks 1: last_queued 0.000, seen 0.000"


def test_a_runs_rooms_summarize_to_each_steps_median_and_the_gaps_between_steps():
    rooms = [{"chunks": 1.0, "last_queued": 0.0, "picked": p, "ready": p, "written": p + 1.6, "concluded": p + 1.7,
              "seen": p + 2.0 + s} for p, s in [(0.2, 0.0), (0.6, 1.0), (0.4, 0.5)]]
    got = room_times.summarize(rooms)
    assert got["rooms"] == 3 and got["chunks_p50"] == 1.0
    assert got["at"]["picked"] == 0.4 and got["at"]["seen"] == 2.9
    assert got["gaps"] == {"queued->last_queued": 0.0, "last_queued->picked": 0.4, "picked->ready": 0.0,
                           "written->concluded": 0.1, "concluded->seen": 0.8, "ready->written": 1.6}
    assert room_times.summarize([]) is None


def test_the_report_shows_the_decode_batch_and_the_room_steps_of_each_backend():
    summary = room_times.summarize([{"chunks": 1.0, "last_queued": 0.0, "picked": 0.5, "ready": 0.5, "written": 2.0,
                                     "concluded": 2.25, "seen": 4.0}])
    steps = [{"running": 10, "step_ms_p50": 5.0, "intervals": 3}, {"running": 20, "step_ms_p50": 6.0, "intervals": 1}]
    cells = [{"backend": "p2pnccl", "input_len": 4096, "concurrency": 1, "cuda_graph": True,
              "reps": [{"output_tok_s": 1.0, "decode_steps": steps, "room_times_ms": summary}]},
             {"backend": "nixl", "input_len": 4096, "concurrency": 1, "cuda_graph": True,
              "reps": [{"output_tok_s": 1.0}]}]
    (row,) = serve_report.table(cells)
    p = row["backends"]["p2pnccl"]
    assert p["running_batch"] == {"mean": 12.5, "median": 10, "intervals": 4}
    assert p["room_steps"]["rooms"] == 1 and p["room_steps"]["seen"] == 4.0
    assert p["room_steps"]["gaps"]["ready->written"] == 1.5
    md = serve_report.batch_markdown([row]).splitlines()
    # NIXL's run logged neither: no row
    # no `planned` or `launched` (not the same-host path): their gaps, the CPU and the wait are "-", the write whole is there
    assert md[2:] == ["| yes | 4096 | 1 | p2pnccl | 12.5 (10) | 1 | 0.000 | 0.500 | 0.000 | - | - | - | - | 1.500 "
                      "| 0.250 | 1.750 | - | - | 4.000 | - |"]
    assert serve_report.batch_markdown(serve_report.table(cells[1:])) == ""


def test_rooms_the_poll_concluded_say_so_and_the_report_counts_and_times_them_apart_from_the_workers():
    """SGLANG_P2P_CONCLUDE_IN_POLL: a room SGLang's poll concluded ends its line `by poll`; a run's summary gives
    each concluder's rooms and median span to Success, and the report's batch table shows both."""
    times, clock, lines = timed()
    for room, by_poll, seen in [(1, True, 1.5), (2, False, 2.0), (3, True, 1.25), (4, False, 3.0)]:
        clock.t = 100.0
        times.mark(room, "queued")
        clock.t = 100.0 + 1e-3
        times.mark(room, "written")
        if by_poll:
            times.by_poll(room)
        times.mark(room, "concluded")
        clock.t = 100.0 + seen / 1e3
        times.seen(room)
    assert lines[0] == ("p2pnccl: room times 1 chunks 1: last_queued 0.000, written 1.000, concluded 1.000, "
                        "seen 1.500, by poll")
    assert lines[1] == "p2pnccl: room times 2 chunks 1: last_queued 0.000, written 1.000, concluded 1.000, seen 2.000"
    times.by_poll(9)  # a room not timed: nothing
    rooms = room_times.parse("\n".join(lines))
    assert [r.get("by_poll") for r in rooms] == [1.0, None, 1.0, None]
    got = room_times.summarize(rooms)
    assert got["concluded_by"] == {"poll": {"rooms": 2, "concluded": 1.0, "seen": 1.375},
                                   "worker": {"rooms": 2, "concluded": 1.0, "seen": 2.5}}
    assert "concluded_by" not in room_times.summarize(rooms[1::2])  # the poll concluded none (or an older log)
    cells = [{"backend": "p2pnccl-times", "input_len": 4096, "concurrency": 1, "cuda_graph": True,
              "reps": [{"output_tok_s": 1.0, "room_times_ms": got}, {"output_tok_s": 1.0, "room_times_ms": got}]}]
    (row,) = serve_report.table(cells)
    assert row["backends"]["p2pnccl-times"]["room_steps"]["concluded_by"] == {"poll": {"rooms": 4, "seen": 1.375},
                                                                             "worker": {"rooms": 4, "seen": 2.5}}
    md = serve_report.batch_markdown([row]).splitlines()
    assert md[2].endswith("| 4 (1.375) / 4 (2.500) |"), md
    assert md[0].count("|") == md[1].count("|") == md[2].count("|"), md  # one column more everywhere


def test_a_writes_noted_steps_give_each_host_step_with_the_cpu_the_thread_spent_to_it():
    """The steps the transport noted before `planned` (entered, checked, routed) go on the line in order with the
    queuing thread's CPU time from `ready` to each; a step noted before the chunk was ready (an earlier write that
    failed) is left out; the serve phase reads each gap's wall and CPU time back."""
    cpu, clock, lines = Clock(), Clock(), []
    times = RoomTimes(True, 4096, clock, lines.append, cpu, runq=lambda: None)
    clock.t, cpu.t = 100.0, 7.0
    times.mark(6, "queued")
    times.mark(6, "ready")
    steps = (("routed", 99.9, 6.9), ("entered", 100.0001, 7.0001), ("checked", 100.0003, 7.0002),
             ("routed", 100.0006, 7.0003), ("planned", 100.0008, 7.0004))
    times.mark_write(6, lambda: WriteMarks(100.0008, 100.0018, 7.0009, steps))
    clock.t = 100.002
    times.mark(6, "returned")
    clock.t = 100.004
    times.mark(6, "written")
    line = times.seen(6)
    assert line == ("p2pnccl: room times 6 chunks 1: last_queued 0.000, ready 0.000, entered 0.100, checked 0.300, "
                    "routed 0.600, planned 0.800, launched 1.800, returned 2.000, written 4.000, seen 4.000, "
                    "cpu_launched 0.900, cpu_entered 0.100, cpu_checked 0.200, cpu_routed 0.300, cpu_planned 0.400")
    (room,) = room_times.parse(line)
    got = room_times.summarize([room])
    assert got["gaps"]["ready->returned"] == 2.0 and got["gaps"]["launched->returned"] == 0.2
    host = got["host_steps"]
    assert host == {"ready->entered": {"wall": 0.1, "cpu": 0.1}, "entered->checked": {"wall": 0.2, "cpu": 0.1},
                    "checked->routed": {"wall": 0.3, "cpu": 0.1}, "routed->planned": {"wall": 0.2, "cpu": 0.1},
                    "planned->launched": {"wall": 1.0, "cpu": 0.5}}
    cells = [{"backend": "p2pnccl-times", "input_len": 4096, "concurrency": 1, "cuda_graph": True,
              "reps": [{"output_tok_s": 1.0, "room_times_ms": got}]}]
    md = serve_report.host_steps_markdown(serve_report.table(cells)).splitlines()
    assert md[2] == ("| yes | 4096 | 1 | p2pnccl-times | 0.100 / 0.100 | 0.200 / 0.100 | 0.300 / 0.100 | 0.200 / 0.100 "
                     "| 1.000 / 0.500 |"), md
    # a room without the steps (another path, an older log) has no row
    del cells[0]["reps"][0]["room_times_ms"]["host_steps"]
    assert serve_report.host_steps_markdown(serve_report.table(cells)) == ""


def test_the_polls_last_look_at_a_running_copy_reads_back_and_each_concluder_gets_its_span_to_the_copy_seen_done():
    """`looked` (SGLang's poll found the copy still running, counted in `looks`) comes back from the line, and each
    concluder's `looked -> written` goes to the run's summary and the report: how late the loop saw a copy's end."""
    times, clock, lines = timed()
    for room, by_poll, looked, written in [(1, True, 0.5, 1.0), (2, False, 0.25, 1.5), (3, True, 0.75, 1.0)]:
        clock.t = 100.0
        times.mark(room, "queued")
        times.mark(room, "ready")
        for k in range(room):  # room r looked r times
            clock.t = 100.0 + (looked - 0.125 * (room - 1 - k)) / 1e3
            times.mark(room, "looked")
        clock.t = 100.0 + written / 1e3
        times.mark(room, "written")
        if by_poll:
            times.by_poll(room)
        times.mark(room, "concluded")
        times.seen(room)
    assert lines[1] == ("p2pnccl: room times 2 chunks 1: last_queued 0.000, ready 0.000, looked 0.250, written 1.500, "
                        "concluded 1.500, seen 1.500, looks 2")
    rooms = room_times.parse("\n".join(lines))
    assert [(r["looked"], r["looks"]) for r in rooms] == [(0.5, 1.0), (0.25, 2.0), (0.75, 3.0)]
    got = room_times.summarize(rooms)
    assert got["concluded_by"]["poll"]["looked->written"] == 0.375  # rooms 1 and 3: 0.5 and 0.25
    assert got["concluded_by"]["poll"]["looks"] == 2.0 and got["concluded_by"]["worker"]["looked->written"] == 1.25
    assert got["gaps"]["looked->written"] == 0.5 and got["gaps"]["ready->written"] == 1.0
    cells = [{"backend": "p2pnccl-times", "input_len": 4096, "concurrency": 1, "cuda_graph": True,
              "reps": [{"output_tok_s": 1.0, "room_times_ms": got}]}]
    (row,) = serve_report.table(cells)
    assert row["backends"]["p2pnccl-times"]["room_steps"]["concluded_by"]["poll"] == {
        "rooms": 2, "seen": 1.0, "looked->written": 0.375}


def test_a_timed_copy_reads_back_and_says_how_long_after_its_end_it_was_seen():
    """`gpu_copy` (the launched copy's device time) comes back from the line; with `planned` it places the copy's end,
    and the summary gives the median from there to `written`, for the run and for each concluder."""
    lines = [
        "p2pnccl: room times 1 chunks 1: last_queued 0.000, ready 0.100, planned 0.300, launched 0.400, "
        "written 1.200, concluded 1.350, seen 1.360, gpu_copy 0.400, by poll",
        "p2pnccl: room times 2 chunks 1: last_queued 0.000, ready 0.100, planned 0.300, launched 0.400, "
        "written 1.500, concluded 1.700, seen 2.000, gpu_copy 0.300",
        "p2pnccl: room times 3 chunks 1: last_queued 0.000, ready 0.100, written 1.000, seen 1.500",
    ]
    rooms = room_times.parse("\n".join(lines))
    assert [r.get("gpu_copy") for r in rooms] == [0.4, 0.3, None]
    got = room_times.summarize(rooms)
    assert got["gpu_copy"] == 0.35 and got["copy_end->written"] == 0.7  # 0.5 and 0.9
    assert got["concluded_by"]["poll"]["copy_end->written"] == 0.5
    assert got["concluded_by"]["worker"]["copy_end->written"] == 0.9  # room 3 was not timed
    assert room_times.copy_end_seen(rooms[2:]) is None
    cells = [{"backend": "p2pnccl-times", "input_len": 4096, "concurrency": 1, "cuda_graph": True,
              "reps": [{"output_tok_s": 1.0, "room_times_ms": got}, {"output_tok_s": 1.0, "room_times_ms": got}]}]
    steps = serve_report.table(cells)[0]["backends"]["p2pnccl-times"]["room_steps"]
    assert steps["gpu_copy"] == 0.35 and steps["copy_end->written"] == 0.7  # the runs' medians, in the report
    assert steps["concluded_by"]["poll"]["copy_end->written"] == 0.5
    assert steps["concluded_by"]["worker"]["copy_end->written"] == 0.9
