"""The serve phase's own parts on CPU: SGLang decode-log parsing, per-thread CPU from /proc, py-spy output
parsing, TPOT and the median/spread summary, and the OS thread names the backend gives its threads."""
import math
import threading
import time
from pathlib import Path

import pytest

from e2e import decode_log, procstat, serve
from e2e.stats import RequestRecord
from sglang_p2p_backend.engine.threads import set_os_name
from support import metrics_server

# two lines in SGLang 0.5.17's decode format (metrics_reporter.py), one prefill line that must be ignored
LOG = (
    "[2026-11-25 10:00:00 TP0] Decode batch [PP0 TP0], #running-req: 4, #token: 4200, token usage: 0.06, "
    "pre-allocated usage: 0.00, #prealloc-req: 0, #transfer-req: 0, #retracted-req: 0, cuda graph: False, "
    "gen throughput (token/s): 160.00, #queue-req: 0\n"
    "[2026-11-25 10:00:01 TP0] Decode batch [PP0 TP0], #running-req: 4, #token: 4300, token usage: 0.06, "
    "pre-allocated usage: 0.00, #prealloc-req: 0, #transfer-req: 1, #retracted-req: 0, cuda graph: False, "
    "gen throughput (token/s): 200.00, #queue-req: 0\n"
    "[2026-11-25 10:00:01 TP0] Prefill batch, #new-seq: 1, #new-token: 1024, gen throughput (token/s): 5.0\n"
    "[2026-11-25 10:00:02 TP0] Decode batch [PP0 TP0], #running-req: 1, #token: 1100, token usage: 0.02, "
    "cuda graph: True, gen throughput (token/s): 50.00, #queue-req: 0\n"
)


def test_decode_step_time_by_running_batch():
    times = decode_log.step_times(LOG)
    assert times == {4: [25.0, 20.0], 1: [20.0]}
    assert decode_log.summarize(times) == [
        {"running": 1, "step_ms_p50": 20.0, "intervals": 1},
        {"running": 4, "step_ms_p50": 22.5, "intervals": 2},
    ]


def test_decode_log_read_from_an_offset(tmp_path: Path):
    log = tmp_path / "d.log"
    log.write_text(LOG.splitlines(keepends=True)[0])
    start = decode_log.offset(log)
    with open(log, "a") as f:
        f.write(LOG.splitlines(keepends=True)[3])
    assert decode_log.step_times(decode_log.read_since(log, start)) == {1: [20.0]}
    assert decode_log.offset(tmp_path / "missing") == 0 and decode_log.read_since(None, 0) == ""


@pytest.mark.serial  # a busy thread's CPU share: other tests' load lowers it
def test_busy_thread_shows_cpu_and_idle_one_does_not():
    stop = threading.Event()
    tids = {}

    def busy():
        tids["busy"] = threading.get_native_id()
        set_os_name("p2p-test-busy")
        end = time.process_time() + 10
        while not stop.is_set() and time.process_time() < end:
            pass

    def idle():
        tids["idle"] = threading.get_native_id()
        stop.wait(5)

    import os
    threads = [threading.Thread(target=busy), threading.Thread(target=idle)]
    for t in threads:
        t.start()
    while len(tids) < 2:
        time.sleep(0.01)
    before = procstat.thread_cpu(os.getpid())
    time.sleep(0.5)
    after = procstat.thread_cpu(os.getpid())
    comm = Path(f"/proc/{os.getpid()}/task/{tids['busy']}/comm").read_text().strip()
    stop.set()
    for t in threads:
        t.join()
    rows = procstat.cpu_between(before, after, {tids["busy"]: "busy", tids["idle"]: "idle"})
    by_name = {r["name"]: r["cpu_s"] for r in rows}
    assert by_name.get("busy", 0) >= 0.1  # it spun for most of half a second (of CPU it got)
    assert "idle" not in by_name  # under the 10 ms floor
    assert comm == "p2p-test-busy"


def test_children_and_scheduler_pid_of_a_process_tree():
    import os
    import subprocess
    import sys
    # a child whose command line names a scheduler, under a parent: found two levels down
    # the child retitles itself as SGLang's scheduler does (its argv[0] in /proc/PID/cmdline)
    child = "import time; time.sleep(30)"
    code = ("import subprocess, sys, time; p = subprocess.Popen(['sglang::scheduler_TP0', '-c', %r], "
            "executable=sys.executable); time.sleep(30)" % child)
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        found = None
        while found is None and time.monotonic() < deadline:
            found = procstat.scheduler_pid(parent.pid)
            time.sleep(0.05)
        assert found is not None and found in procstat.children(parent.pid)
        assert "sglang::scheduler_TP0" in procstat.cmdline(found)
        assert procstat.scheduler_pid(os.getpid()) in (None, found)  # our own tree: only that child matches
    finally:
        for pid in procstat.children(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


def test_pyspy_dump_and_collapsed_stacks_are_read():
    dump = ('Process 100: sglang::scheduler\nPython v3.12.3 (/usr/bin/python3.12)\n\n'
            'Thread 100 (active): "MainThread"\n    event_loop (scheduler.py:10)\n'
            'Thread 0x7F3A4C9E1740 (idle): "no-os-id"\n'
            'Thread 117 (idle): "p2p-decode-control"\n    _control_step (manager.py:211)\n')
    assert procstat.parse_dump(dump) == {100: "MainThread", 117: "p2p-decode-control"}
    raw = ("thread (0x1);run (a.py:1);launch (b.py:2) 30\n"
           "thread (0x1);run (a.py:1);poll (c.py:3) 10\n"
           "thread (0x2);loop (m.py:5);sleep (m.py:6) 5\n"
           "garbage line\n")
    summary = procstat.summarize_collapsed(raw)
    assert [t["thread"] for t in summary] == ["thread (0x1)", "thread (0x2)"]
    assert summary[0]["samples"] == 40
    assert summary[0]["top_self"][0] == {"frame": "launch (b.py:2)", "samples": 30}


def _run_row() -> dict:
    """What a stand-in for serve.one_run returns: every figure measure() reads."""
    return {k: 1.0 for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "output_tok_s", "kv_ms")} | {
        "failed": 0}


def test_samples_within_count_a_sample_once_per_module_and_name_the_inclusive_frames():
    """Whose code the scheduler thread was in: a sample inside our plugin counts once for it however many of its
    frames the stack holds, SGLang's disaggregation code on its own line, and the inclusive frames rank by samples."""
    raw = ("thread (0x1);event_loop (sglang/srt/managers/scheduler.py:1);poll (sglang_p2p_backend/adapter/conn.py:128);"
           "_latched_poll (sglang_p2p_backend/adapter/conn.py:60) 7\n"
           "thread (0x1);event_loop (sglang/srt/managers/scheduler.py:1);forward (model.py:9) 90\n"
           "thread (0x1);event_loop (sglang/srt/managers/scheduler.py:1);"
           "process_disagg (sglang/srt/disaggregation/prefill.py:5);send (sglang_p2p_backend/adapter/conn.py:105) 3\n"
           "thread (0x2);_transfer_step (sglang_p2p_backend/adapter/transfer_workers.py:170) 4\n")
    out = procstat.samples_within(raw, ("sglang_p2p_backend/", "sglang/srt/disaggregation/"))
    main = out[0]
    assert main["thread"] == "thread (0x1)" and main["samples"] == 100
    assert main["within"] == {"sglang_p2p_backend/": 10, "sglang/srt/disaggregation/": 3}
    top = {f["frame"]: f["samples"] for f in main["top_inclusive"]}
    assert top == {"poll (sglang_p2p_backend/adapter/conn.py:128)": 7,
                   "_latched_poll (sglang_p2p_backend/adapter/conn.py:60)": 7,
                   "process_disagg (sglang/srt/disaggregation/prefill.py:5)": 3,
                   "send (sglang_p2p_backend/adapter/conn.py:105)": 3}
    assert out[1]["within"] == {"sglang_p2p_backend/": 4, "sglang/srt/disaggregation/": 0}


def test_a_record_across_subprocesses_names_each_thread_with_its_innermost_process():
    """`py-spy record --subprocesses` puts every process from the root down before the thread; a spawned child's
    command line holds a ';' (python -c "...; ..."), which must not split it into frames."""
    raw = ('process 8:"python3 bench.py --x";process 9:"python3 -c from m import f; f(fd=3)";thread (12): p2p-recv;'
           'run (sglang_p2p_backend/engine/pair/pipeline.py:418);_post (sglang_p2p_backend/engine/transport/nccl.py:231) 5\n'
           'process 8:"python3 bench.py --x";thread (8): MainThread;main (bench.py:1) 2\n')
    out = procstat.samples_within(raw, ("sglang_p2p_backend/",))
    assert [(t["thread"], t["samples"], t["within"]["sglang_p2p_backend/"]) for t in out] == [
        ("process 9 thread (12): p2p-recv", 5, 5), ("process 8 thread (8): MainThread", 2, 0)]
    assert {f["frame"] for f in out[0]["top_inclusive"]} == {
        "run (sglang_p2p_backend/engine/pair/pipeline.py:418)", "_post (sglang_p2p_backend/engine/transport/nccl.py:231)"}


def test_only_the_first_repetition_of_a_profiled_cell_records(monkeypatch, tmp_path: Path):
    """`record`: every backend's first run of the named cells gets a py-spy file of its own; other cells and
    later repetitions none."""
    asked: list = []

    def fake_run(pair, mode, plen, conc, seed, pyspy, rounds=2, record=None, how=serve.Recording(), output_tokens=64):
        asked.append((pair, plen, record.name if record else None, (how.gil, how.rate, output_tokens)))
        return _run_row()

    monkeypatch.setattr(serve, "one_run", fake_run)
    serve.measure({"a": "a", "b": "b"}, ["graph"], [(1024, 16), (4096, 1)], ["a", "b"], {}, 2, {"cells": []},
                  lambda: None, "py-spy", deadline=serve.time.monotonic() + 60, record=(tmp_path, frozenset({(1024, 16)})),
                  how=serve.Recording(gil=True, rate=1000), output_tokens=1)
    named = [(p, n, r) for p, n, r, _ in asked if r]
    assert named == [("a", 1024, "pyspy-a-prefill-graph-1024x16.txt"), ("b", 1024, "pyspy-b-prefill-graph-1024x16.txt")]
    # every run with the recording's settings and the answers' length it was given
    assert len(asked) == 8 and all(how == (True, 1000, 1) for *_, how in asked)


def test_a_gil_record_samples_only_the_gils_holder(monkeypatch, tmp_path: Path):
    """`--profile-gil`: py-spy is asked for the GIL's holder only (`--gil`), beside the usual flags."""
    started: list = []

    class Proc:
        def __init__(self, argv, **kw):
            started.append(argv)

    monkeypatch.setattr(procstat.subprocess, "Popen", Proc)
    assert procstat.record(42, "py-spy", 4, tmp_path / "a.txt", gil=True) == ""
    assert procstat.record(42, "py-spy", 4, tmp_path / "b.txt") == ""
    assert "--gil" in started[0] and "--gil" not in started[1]
    assert started[0][:4] == ["py-spy", "record", "--pid", "42"] and "--nonblocking" in started[0]
    # native frames: py-spy takes them only while it pauses the process, so without --nonblocking
    assert procstat.record(42, "py-spy", 4, tmp_path / "c.txt", rate=1000, native=True) == ""
    assert "--native" in started[2] and "--nonblocking" not in started[2]
    assert started[2][started[2].index("--rate") + 1] == "1000"


def test_without_pyspy_the_profile_says_why():
    assert procstat.python_thread_names(1, None) == ({}, "no py-spy")
    assert procstat.record(1, None, 1, Path("/nonexistent")) == "no py-spy"


def test_tpot_cells_and_spread():
    recs = [RequestRecord(True, 0.1, 0.1 + 63 * 0.02, 64), RequestRecord(True, 0.2, 0.2 + 63 * 0.03, 64),
            RequestRecord(True, 0.1, 0.2, 1), RequestRecord(False, None, 1.0, 0, "boom")]
    assert serve.tpot_ms_p50(recs) == 25.0
    assert serve.parse_cells("1024x1,4096x64") == [(1024, 1), (4096, 64)]
    assert serve.requests_for(1) == 6 and serve.requests_for(64) == 128
    assert serve.requests_for(1, 6) == 18 and serve.requests_for(16, 6) == 96  # --rounds 6: steadier medians
    assert serve.median_spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert serve.median_spread([None]) == {"median": None, "min": None, "max": None}
    cells = [{"backend": "p2pnccl", "input_len": 1024, "concurrency": 1, "cuda_graph": False,
              "reps": [{"ttft_p50_ms": 40.0, "output_tok_s": 50.0, "kv_ms": 3.0},
                       {"ttft_p50_ms": 44.0, "output_tok_s": 48.0, "kv_ms": None}]}]
    (row,) = serve.summarize_cells(cells)
    assert row["ttft_p50_ms"] == {"median": 42.0, "min": 40.0, "max": 44.0}
    assert row["kv_ms"] == {"median": 3.0, "min": 3.0, "max": 3.0}
    assert row["tpot_p50_ms"]["median"] is None and row["backend"] == "p2pnccl"


def test_every_backend_gets_the_same_flags_and_the_modes_differ_only_in_decode_graphs(tmp_path: Path):
    pairs = {b: serve.Pair(b, tmp_path, ["nograph", "graph"]) for b in ("p2pnccl", "nixl")}
    for p in pairs.values():
        assert p.prefill.args == pairs["nixl"].prefill.args
        assert "--cuda-graph-backend-decode" in p.decode["nograph"].args
        assert "--cuda-graph-backend-decode" not in p.decode["graph"].args
        assert p.lb["graph"].lb_decode is p.decode["graph"] and p.lb["graph"].lb_prefill is p.prefill
    ports = [s.port for p in pairs.values() for s in [*p.servers(), *p.lb.values()]]
    ports += [p.prefill.bootstrap_port for p in pairs.values()]
    assert len(ports) == len(set(ports))
    assert pairs["p2pnccl"].prefill.env["SGLANG_P2P_TRANSPORT"] == "auto"
    variant = serve.Pair("p2pnccl-gil5", tmp_path, ["nograph"])
    assert variant.prefill.backend == "p2pnccl" and variant.decode["nograph"].env["SGLANG_P2P_GIL_SWITCH_MS"] == "0"
    assert "--disaggregation-transfer-backend p2pnccl" in " ".join(variant.prefill.command())


def test_two_gpu_layout_puts_every_decode_on_gpu_1_with_the_pool_asked_for(tmp_path: Path):
    """--decode-gpu 1 (run_all.sh --gpus 2): prefills on GPU 0, decodes on GPU 1, so the KV crosses NVLink;
    --max-total-tokens replaces the pool cap on every server, nothing else changes."""
    one = serve.Pair("nixl", tmp_path, ["graph"])
    two = serve.Pair("nixl", tmp_path, ["graph"], decode_gpu=1, max_total_tokens=262144)
    assert (one.prefill.gpu, one.decode["graph"].gpu) == (0, 0) and (two.prefill.gpu, two.decode["graph"].gpu) == (0, 1)
    cmd = two.decode["graph"].command()
    assert cmd[cmd.index("--base-gpu-id") + 1] == "1" and cmd[cmd.index("--max-total-tokens") + 1] == "262144"
    assert cmd.count("--max-total-tokens") == 1
    assert [a for a in two.prefill.args if a != "262144"] == [a for a in one.prefill.args if a != "65536"]


def test_a_prefill_chunk_given_reaches_every_server_once_and_none_leaves_sglangs_default(tmp_path: Path):
    """--chunked-prefill-size (16,384 for 16k prompts: one chunk, so kv_transfer_latency_ms is the transfer's on every
    backend) goes to the prefill and the decodes alike; without it no server gets the flag."""
    plain = serve.Pair("p2pnccl", tmp_path, ["graph"])
    chunk = serve.Pair("p2pnccl", tmp_path, ["graph"], chunked_prefill_size=16384)
    assert "--chunked-prefill-size" not in plain.prefill.command()
    for s in (chunk.prefill, chunk.decode["graph"]):
        cmd = s.command()
        assert cmd.count("--chunked-prefill-size") == 1 and cmd[cmd.index("--chunked-prefill-size") + 1] == "16384"
    assert serve.server_flags(65536, 16384) == [*serve.server_flags(65536), "--chunked-prefill-size", "16384"]


def test_report_pools_repetitions_across_files_and_compares_with_nixl(tmp_path: Path):
    import json

    from e2e import serve_report

    def doc(reps_p, reps_n):
        cell = lambda b, reps: {"backend": b, "input_len": 1024, "concurrency": 64, "cuda_graph": True,  # noqa: E731
                                "reps": [{"output_tok_s": x, "kv_ms": 1.0, "decode_steps": [
                                    {"running": 40, "step_ms_p50": x / 100, "intervals": 2}]} for x in reps]}
        return {"machine": "m", "cells": [cell("p2pnccl", reps_p), cell("nixl", reps_n)]}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(doc([300.0], [200.0])))
    b.write_text(json.dumps(doc([330.0, 360.0], [220.0, 210.0])))
    machines, cells = serve_report.load([a, b])
    (row,) = serve_report.table(cells)
    assert machines == ["m"] and row["backends"]["p2pnccl"]["reps"] == 3
    assert row["backends"]["p2pnccl"]["output_tok_s"] == (330.0, 300.0, 360.0)
    assert row["p2pnccl_over_nixl"]["output_tok_s"] == round(330.0 / 210.0, 3)
    assert row["step_ms_same_batch"] == {40: (3.3, 2.1)}
    md = serve_report.markdown([row])
    assert "| yes | 1024 | 64 | p2pnccl | 3 | 330.0 (300.0-360.0) |" in md
    # the last column: p2pnccl's step over NIXL's at batch 40 (3.3 against 2.1 ms), six intervals each
    # and with one run of each side left out, every pair in turn: the medians of the two runs kept, 3.15-3.45
    # against 2.05-2.15 ms
    spread = (round(3.15 / 2.15, 3), round(3.45 / 2.05, 3))
    assert row["p2pnccl_step_ratio"] == {"nixl": {"ratio": round(3.3 / 2.1, 3), "sizes": 1, "intervals": 6,
                                                  "without_one": spread}}
    last = [line.rsplit("|", 2)[-2].strip() for line in md.splitlines()[2:]]
    assert last == [f"{3.3 / 2.1:.3f} (6; {spread[0]:.3f}-{spread[1]:.3f})", "-"]  # nixl's row, p2pnccl's
    assert row["backends"]["p2pnccl"]["stages_ms"] == {}  # results from before stages were recorded
    # paired by repetition within each file: 300/200, 330/220, 360/210 (not the medians' 330/210)
    pair = row["over_nixl"]["p2pnccl"]["paired_tok_s"]
    assert pair == {"ratio": round((300 / 200 * 330 / 220 * 360 / 210) ** (1 / 3), 3), "pairs": 3, "higher": 3}
    p_row = next(line for line in md.splitlines() if "| p2pnccl |" in line)
    assert f"| {pair['ratio']:.3f} (3 of 3) | {3.3 / 2.1:.3f} (6; {spread[0]:.3f}-{spread[1]:.3f}) |" in p_row


def test_paired_ratio_matches_runs_of_one_repetition_and_skips_a_missing_one(tmp_path: Path):
    import json

    from e2e import serve_report

    def doc(reps):
        return {"machine": "m", "cells": [
            {"backend": b, "input_len": 16384, "concurrency": 16, "cuda_graph": True,
             "reps": [{"output_tok_s": x} for x in xs if x is not None]} for b, xs in reps.items()]}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    # file a: the split variant's second repetition was not run (a step limit), so only its first pairs
    a.write_text(json.dumps(doc({"p2pnccl-split": [440.0], "nixl": [400.0, 500.0]})))
    b.write_text(json.dumps(doc({"p2pnccl-split": [450.0, 480.0], "nixl": [500.0, 400.0]})))
    _, cells = serve_report.load([a, b])
    (row,) = serve_report.table(cells)
    got = row["over_nixl"]["p2pnccl-split"]["paired_tok_s"]
    assert got == {"ratio": round((440 / 400 * 450 / 500 * 480 / 400) ** (1 / 3), 3), "pairs": 3, "higher": 2}
    assert "p2pnccl_step_ratio" not in row and row["over_nixl"]["p2pnccl-split"]["step"] is None
    nixl_only = [c for c in cells if c["backend"] == "nixl"]
    assert serve_report.paired(nixl_only[0], {"reps": []}) is None


def test_report_takes_the_median_of_each_stage_over_the_repetitions():
    from e2e import serve_report

    reps = [{"stages_ms": {"decode": {"decode_waiting": w, "decode_bootstrap": 2.0}, "prefill": {"chunked_prefill": 150.0}}}
            for w in (10.0, 40.0, 20.0)] + [{"stages_ms": {"decode": {"decode_waiting": 99.0}}}, {}]
    assert serve_report.stages({"reps": reps}) == {
        "decode": {"decode_bootstrap": 2.0, "decode_waiting": 30.0}, "prefill": {"chunked_prefill": 150.0}}


def test_report_names_the_busiest_prefill_and_the_profiles_runs_carry():
    """Per cell, the busiest prefill's share and the slowest / fastest forward (medians over repetitions); a run's
    py-spy profile is listed with its module counts, or its error; runs from before either was recorded add none."""
    from e2e import serve_report

    fwd = lambda a, b: [{"requests": 30, "stages_ms": {"prefill_forward": a}},  # noqa: E731
                        {"requests": 10, "stages_ms": {"prefill_forward": b}}]
    reps = [{"prefills": fwd(300.0, 250.0), "pyspy_prefill": [{"thread": "t (0x1)", "samples": 800, "top_inclusive": [],
                                                              "within": {"sglang_p2p_backend/": 12}}]},
            {"prefills": fwd(340.0, 260.0)}, {"prefills": [{"requests": 20, "stages_ms": {}}] * 2}, {}]
    cell = {"backend": "p2pnccl", "input_len": 1024, "concurrency": 16, "reps": reps}
    assert serve_report.prefill_spread(cell) == {"busiest_share": 0.75, "forward_max_ms": 320.0, "forward_min_ms": 255.0}
    assert serve_report.prefill_spread({"reps": [{}]}) == {}
    other = {"backend": "nixl", "input_len": 1024, "concurrency": 16, "reps": [{"pyspy_prefill": {"error": "no py-spy"}}]}
    other["reps"].append({"pyspy_prefill": [{"thread": "t (0x2)", "samples": 90, "within": {}}], "pyspy_prefill_gil": True})
    assert serve_report.profiles([cell, other]) == [
        {"backend": "p2pnccl", "input_len": 1024, "concurrency": 16, "rep": 0, "gil": False,
         "threads": [{"thread": "t (0x1)", "samples": 800, "within": {"sglang_p2p_backend/": 12}}]},
        {"backend": "nixl", "input_len": 1024, "concurrency": 16, "rep": 0, "gil": False, "error": "no py-spy"},
        {"backend": "nixl", "input_len": 1024, "concurrency": 16, "rep": 1, "gil": True,
         "threads": [{"thread": "t (0x2)", "samples": 90, "within": {}}]}]


def test_requests_alone_keep_every_ttft_in_order_and_busier_runs_keep_none():
    from e2e.stats import RequestRecord

    recs = [RequestRecord(True, 0.1574, 0.6, 64), RequestRecord(False, None, 0.2, 0, "500"),
            RequestRecord(True, 0.2021, 0.64, 64)]
    assert serve.alone_ttfts_ms(recs, 1) == [157.4, None, 202.1]
    assert serve.alone_ttfts_ms(recs, 16) is None


def test_stage_times_are_the_runs_means_per_stage_summed_over_servers():
    """SGLang's per-stage histogram: the prefills' texts summed stage by stage (over their DP ranks too), then the
    mean of what a run added, in ms; a server that did not answer adds nothing, a stage nobody passed is left out."""
    def text(wait_sum, wait_n, boot_sum, boot_n):
        return (f'sglang:per_stage_req_latency_seconds_sum{{dp_rank="0",stage="decode_waiting"}} {wait_sum}\n'
                f'sglang:per_stage_req_latency_seconds_count{{dp_rank="0",stage="decode_waiting"}} {wait_n}\n'
                f'sglang:per_stage_req_latency_seconds_bucket{{dp_rank="0",stage="decode_waiting",le="0.1"}} {wait_n}\n'
                f'sglang:per_stage_req_latency_seconds_sum{{dp_rank="1",stage="decode_bootstrap"}} {boot_sum}\n'
                f'sglang:per_stage_req_latency_seconds_count{{dp_rank="1",stage="decode_bootstrap"}} {boot_n}\n')
    before = serve.stage_totals([text(1.0, 10, 0.5, 10), None])
    after = serve.stage_totals([text(1.2, 12, 0.5, 10), text(0.06, 2, 0.0, 0)])
    assert after["decode_waiting"].count == 14
    assert serve.stage_means_ms(before, after) == {"decode_waiting": 65.0}  # (0.2 + 0.06) s over 4 requests
    assert serve.stage_means_ms({}, {}) == {}


def test_the_waiting_queue_time_is_a_stage_of_its_own():
    """SGLang observes a prefill's time in its waiting queue only as sglang:queue_time_seconds (its per-stage
    histogram leaves `prefill_waiting` out): summed over the servers that have it, as the stage `queue_time`."""
    def text(q_sum, q_n):
        return (f'sglang:queue_time_seconds_sum{{dp_rank="0"}} {q_sum}\n'
                f'sglang:queue_time_seconds_count{{dp_rank="0"}} {q_n}\n'
                f'sglang:queue_time_seconds_bucket{{dp_rank="0",le="0.1"}} {q_n}\n'
                'sglang:per_stage_req_latency_seconds_sum{stage="prefill_forward"} 1.0\n'
                'sglang:per_stage_req_latency_seconds_count{stage="prefill_forward"} 10\n')
    before = serve.stage_totals([text(2.0, 10), text(0.0, 0)])
    after = serve.stage_totals([text(2.9, 13), text(0.3, 3), "sglang:other 1\n"])
    assert after["queue_time"].sum == pytest.approx(3.2) and after["queue_time"].count == 16
    assert serve.stage_means_ms(before, after) == {"queue_time": 200.0}  # (0.9 + 0.3) s over 6 requests


def test_a_probe_snapshot_reads_each_server_once_for_kv_and_stages():
    """Probe's snapshot over real HTTP: one /metrics request a server gives the prefills' KV transfer histogram
    summed and the per-stage histograms of each role; a prefill that does not answer adds nothing."""
    from types import SimpleNamespace

    texts = {
        "/p0/metrics": ('sglang:kv_transfer_latency_ms_sum 30.0\nsglang:kv_transfer_latency_ms_count 3\n'
                        'sglang:per_stage_req_latency_seconds_sum{stage="chunked_prefill"} 0.3\n'
                        'sglang:per_stage_req_latency_seconds_count{stage="chunked_prefill"} 3\n'),
        "/p1/metrics": 'sglang:kv_transfer_latency_ms_sum 10.0\nsglang:kv_transfer_latency_ms_count 1\n',
        "/d/metrics": ('sglang:per_stage_req_latency_seconds_sum{stage="decode_waiting"} 0.2\n'
                       'sglang:per_stage_req_latency_seconds_count{stage="decode_waiting"} 4\n')}
    hits: list[str] = []
    with metrics_server.serving(texts, hits) as base:
        probe = object.__new__(serve.Probe)
        probe.mode = "graph"
        probe.pair = SimpleNamespace(prefills=[SimpleNamespace(url=f"{base}/{p}") for p in ("p0", "p1", "gone")],
                                     decode={"graph": SimpleNamespace(url=f"{base}/d")})
        kv, stages, each = probe._snapshot()  # noqa: SLF001
    assert (kv.sum, kv.count) == (40.0, 4.0)
    assert {k: (v.sum, v.count) for k, v in stages["prefill"].items()} == {"chunked_prefill": (0.3, 3.0)}
    assert {k: (v.sum, v.count) for k, v in stages["decode"].items()} == {"decode_waiting": (0.2, 4.0)}
    assert sorted(hits) == ["/d/metrics", "/gone/metrics", "/p0/metrics", "/p1/metrics"]
    # each prefill on its own: p0's stage, p1 without the request counter, the silent one with nothing
    assert [n for n, _ in each] == [None, None, None]
    assert {k: (v.sum, v.count) for k, v in each[0][1].items()} == {"chunked_prefill": (0.3, 3.0)}
    assert each[1][1] == {} and each[2][1] == {}


def test_per_prefill_figures_split_a_run_by_prefill():
    """Each prefill's requests and stage means over a run: the busier one shows its own queue, not the mean of
    both; a prefill whose counter was not read has requests None, never 0."""
    H = serve.promparse.HistogramTotals
    before = [(10.0, {"queue_time": H(1.0, 10)}), (4.0, {"queue_time": H(0.0, 4)}), (None, {})]
    after = [(22.0, {"queue_time": H(4.6, 22), "prefill_forward": H(3.0, 12)}), (6.0, {"queue_time": H(0.04, 6)}),
             (5.0, {})]
    rows = serve.per_prefill(before, after)
    assert rows[0] == {"requests": 12, "stages_ms": {"prefill_forward": 250.0, "queue_time": 300.0}}
    assert rows[1] == {"requests": 2, "stages_ms": {"queue_time": 20.0}}
    assert rows[2] == {"requests": None, "stages_ms": {}}


def test_a_run_that_would_end_past_the_deadline_is_not_started(monkeypatch):
    """The second run of a cell whose first took 100 s is not started with 60 s left (the step would be killed
    in it, losing it whole); res["stopped"] names it. A shorter cell still runs while it fits."""
    now = [0.0]
    monkeypatch.setattr(serve.time, "monotonic", lambda: now[0])
    lengths = {1024: 100.0, 128: 5.0}
    ran: list[tuple[str, int]] = []

    def fake_run(pair, mode, plen, conc, seed, pyspy, rounds=2, record=None, how=serve.Recording(), output_tokens=64):
        ran.append((pair, plen))
        now[0] += lengths[plen]
        return _run_row()

    monkeypatch.setattr(serve, "one_run", fake_run)
    res: dict = {"cells": []}
    saved: list[int] = []
    serve.measure({"a": "a", "b": "b"}, ["graph"], [(1024, 64)], ["a", "b"], {}, 3, res, lambda: saved.append(1),
                  None, deadline=160.0)
    assert ran == [("a", 1024)]  # b's run would end at 200 s
    assert res["stopped"].startswith("deadline in repetition 0: b 1024x64 not started") and "100 s" in res["stopped"]
    now[0], ran[:] = 0.0, []
    res = {"cells": []}
    serve.measure({"a": "a", "b": "b"}, ["graph"], [(128, 1)], ["a", "b"], {}, 2, res, lambda: None, None,
                  deadline=17.0)
    assert ran == [("a", 128), ("b", 128), ("b", 128)]  # 15 s in, a fourth 5 s run would end at 20 s
    assert "repetition 1: a 128x1" in res["stopped"]


def test_the_warm_up_runs_each_loaded_cell_once_per_backend(monkeypatch):
    """After the compile rounds, one round of each cell to be measured above concurrency 1 (its prompts, its
    users, 8 tokens), for every backend and mode: the first repetition meets no new batch shape."""
    from types import SimpleNamespace

    sent: list[tuple[str, int, int, int, int]] = []

    async def fake_loop(url, prompts, conc, tokens):
        sent.append((url, prompts[0], len(prompts), conc, tokens))
        return [], 0.0

    monkeypatch.setattr(serve.client, "closed_loop", fake_loop)
    monkeypatch.setattr(serve.client, "random_prompts", lambda n, plen, seed: [plen] * n)
    ready = {b: SimpleNamespace(lb={"graph": SimpleNamespace(url=f"http://{b}")}) for b in ("p2pnccl", "nixl")}
    serve.warm_up(ready, ["graph"], [(1024, 64), (4096, 1), (1024, 64), (4096, 16)])
    for b in ("p2pnccl", "nixl"):
        mine = [s[1:] for s in sent if s[0] == f"http://{b}"]
        assert mine == [(4096, 8, 4, 8), (1024, 16, 16, 8), (1024, 64, 64, 8), (4096, 16, 16, 8)]  # each cell once


def test_a_run_killed_by_the_step_limit_is_named_in_the_saved_result(monkeypatch):
    """The step's SIGTERM ends the run in progress (SystemExit 143): the result saved says which run was lost,
    and the exit goes on."""
    def fake_run(pair, mode, plen, conc, seed, pyspy, rounds=2, record=None, how=serve.Recording(), output_tokens=64):
        if pair == "b":
            raise SystemExit(143)
        return _run_row()

    monkeypatch.setattr(serve, "one_run", fake_run)
    res: dict = {"cells": []}
    saved: list[str] = []
    with pytest.raises(SystemExit):
        serve.measure({"a": "a", "b": "b"}, ["graph"], [(4096, 64)], ["a", "b"], {}, 3, res,
                      lambda: saved.append(res.get("stopped", "")), None, deadline=serve.time.monotonic() + 60)
    assert res["stopped"] == "killed (exit 143) in repetition 0 during b 4096x64: that run is lost"
    assert saved[-1] == res["stopped"] and len(res["cells"][0]["reps"]) == 1


def test_step_ratio_weighs_every_shared_batch_size_and_leaves_out_idle_gaps():
    """p2pnccl's decode step over a peer's at equal running batch: a geometric mean over the batch sizes both
    logged, each weighted by the fewer intervals; a size where one log shows a wait (2x or more) is left out,
    and sizes only one backend reached do not count."""
    from e2e import serve_report

    def cell(steps):
        return {"reps": [{"decode_steps": [{"running": n, "step_ms_p50": ms, "intervals": k} for n, ms, k in steps]}]}

    mine = cell([(8, 1.5, 4), (16, 4.4, 1), (3, 10.0, 1), (40, 9.0, 5)])
    theirs = cell([(8, 1.0, 2), (16, 4.0, 3), (3, 5.0, 2), (24, 6.0, 9)])
    got = serve_report.step_ratio(mine, theirs)
    # sizes 8 (ratio 1.5, weight 2) and 16 (ratio 1.1, weight 1); 3 (2x) is a wait, 24 and 40 are not shared
    want = round(math.exp((2 * math.log(1.5) + math.log(1.1)) / 3), 3)
    assert got == {"ratio": want, "sizes": 2, "intervals": 3}  # one run a side: no range without one
    assert serve_report.step_ratio(mine, cell([(24, 6.0, 9)])) is None


def test_step_ratio_says_how_far_one_run_of_each_side_moves_it():
    """Two runs a side: the ratio over all of them, and its lowest and highest with one run of each side left out
    (each pair in turn), so a cell that rests on one slow run shows it."""
    from e2e import serve_report

    def cell(*runs):
        return {"reps": [{"decode_steps": [{"running": 16, "step_ms_p50": ms, "intervals": 1}]} for ms in runs]}

    got = serve_report.step_ratio(cell(2.0, 4.0), cell(2.0, 2.0))
    # all runs: medians 3.0 against 2.0. Without one: 2.0 against 2.0, or 4.0 against 2.0, which is twice the
    # other and so read as a wait (IDLE_GAP_RATIO): those pairs share no size and give no ratio
    assert got == {"ratio": 1.5, "sizes": 1, "intervals": 2, "without_one": (1.0, 1.0)}
    got = serve_report.step_ratio(cell(2.0, 3.0), cell(2.0, 2.0))
    assert got == {"ratio": 1.25, "sizes": 1, "intervals": 2, "without_one": (1.0, 1.5)}


def test_stage_table_shows_each_backends_stage_medians_and_an_outlier_runs_range():
    from e2e import serve_report

    def rep(queue: float, transferred: float) -> dict:
        return {"output_tok_s": 1.0, "stages_ms": {"prefill": {"queue_time": queue, "prefill_forward": 50.0},
                                                   "decode": {"decode_transferred": transferred}}}

    cells = [{"backend": "p2pnccl", "input_len": 4096, "concurrency": 16, "cuda_graph": True,
              "reps": [rep(13.4, 84.0), rep(45.8, 170.4), rep(19.0, 103.0)]},
             {"backend": "nixl", "input_len": 4096, "concurrency": 16, "cuda_graph": True, "reps": [{"output_tok_s": 1.0}]}]
    (row,) = serve_report.table(cells)
    assert row["backends"]["p2pnccl"]["stage_spread"] == {"prefill queue": (19.0, 13.4, 45.8),
                                                          "prefill forward": (50.0, 50.0, 50.0),
                                                          "decode transferred": (103.0, 84.0, 170.4)}
    md = serve_report.stages_markdown([row]).splitlines()
    assert md[0].startswith("| graphs | prompt | conc. | backend | prefill queue ms | prefill bootstrap ms |")
    # nixl's runs recorded no stages: no row; a stage a backend lacks is "-"
    assert md[2:] == ["| yes | 4096 | 16 | p2pnccl | 19.0 (13.4-45.8) | - | 50.0 | - | 103.0 (84.0-170.4) |"]
    assert serve_report.stages_markdown([serve_report.table(cells[1:])[0]]) == ""
