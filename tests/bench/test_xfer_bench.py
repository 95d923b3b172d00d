"""bench/transfer/xfer_bench.py on CPU: its cases, ids, page hash, repetition budget, crossover and verdicts
(bench/transfer/xfer_cases.py), the clean skip without CUDA, and the whole driver run with --quick (the
shared-memory stand-in of CUDA IPC, the tcp transport for the NCCL path): every section runs and every
destination page it wrote is verified."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pytest
import torch

from bench.transfer import xfer_bench
from bench.transfer import xfer_cases as xc
from sglang_p2p_backend.engine.copy.page_hash import page_hash


def test_the_issue_35_case_list():
    cases = xc.cases()
    assert len(cases) == 3 * 4 * 2
    assert cases[0].name == "mha_p1_128_contiguous" and cases[-1].name == "mla_p64_16384_scattered"
    by = {s.name: s for s in xc.SHAPES}
    assert by["mha_p1"].regions * by["mha_p1"].token_bytes == 128 << 10  # 128 KiB of KV a token
    assert by["mla_p64"].nbytes(4096) == 61 * 576 * 2 * 4096
    assert by["mha_p16"].nbytes(16384) == 2 << 30  # 16k tokens of MHA: 2 GiB, the size the transfer targets are stated for
    assert xc.pool_pages(by["mha_p16"]) == (1024, 2048)


def test_page_ids_contiguous_and_scattered():
    shape = xc.Shape("t", 2, 8, 16)
    s, d = xc.page_ids(xc.Case(shape, 64, "contiguous"), 8, 16)
    assert s.tolist() == [0, 1, 2, 3] and d.tolist() == [4, 5, 6, 7]
    s, d = xc.page_ids(xc.Case(shape, 64, "scattered"), 8, 16)
    assert s.dtype == d.dtype == np.int64 and len(set(s.tolist())) == len(set(d.tolist())) == 4
    assert s.max() < 8 and d.max() < 16
    again = xc.page_ids(xc.Case(shape, 64, "scattered"), 8, 16)
    assert again[0].tolist() == s.tolist() and again[1].tolist() == d.tolist()  # seeded: the same every run
    with pytest.raises(ValueError, match="do not fit"):
        xc.page_ids(xc.Case(shape, 256, "contiguous"), 8, 16)


def test_page_ids_in_runs_land_in_that_many_separate_runs():
    shape = xc.Shape("t", 2, 8, 1)
    for runs in (1, 3, 4):
        s, d = xc.page_ids(xc.Case(shape, 10, f"runs{runs}"), 10, 20)
        assert s.tolist() == list(range(10)) and len(set(d.tolist())) == 10 and d.max() < 20
        breaks = int((np.diff(d) != 1).sum())
        assert breaks == runs - 1 and (np.diff(d) >= 1).all()  # in order, apart: never merged into fewer runs
        lens = np.diff(np.flatnonzero(np.concatenate(([1], np.diff(d) != 1, [1]))))
        assert lens.max() - lens.min() <= 1
    with pytest.raises(ValueError, match="do not fit"):
        xc.page_ids(xc.Case(shape, 10, "runs4"), 10, 12)  # 10 pages and 3 gaps need 13
    for bad in ("runs0", "runsx", "rows4"):
        with pytest.raises(ValueError, match="runs<N>"):
            xc.run_count(bad)


def test_mixed_pages_land_in_four_long_runs_and_single_pages_apart():
    shape = xc.Shape("t", 2, 8, 1)
    s, d = xc.page_ids(xc.Case(shape, 40, "mixed"), 40, 80)
    assert s.tolist() == list(range(40)) and len(set(d.tolist())) == 40 and (np.diff(d) >= 1).all()
    lens = np.diff(np.flatnonzero(np.concatenate(([1], np.diff(d) != 1, [1]))))
    # 30 pages in runs of 8, 8, 7, 7, each followed by its share of the 10 single pages
    assert lens.tolist() == [8, 1, 1, 1, 8, 1, 1, 1, 7, 1, 1, 7, 1, 1]
    with pytest.raises(ValueError, match="do not fit"):
        xc.page_ids(xc.Case(shape, 40, "mixed"), 40, 50)  # 40 pages and 13 gaps need 53


def test_the_drivers_page_hash_is_the_backends_and_sees_a_flipped_byte():
    rng = np.random.default_rng(0)
    regions = [torch.from_numpy(rng.integers(0, 256, size=(5, 32), dtype=np.uint8)) for _ in range(3)]
    ids = np.array([4, 0, 2])
    want = page_hash([r.numpy()[ids].view(np.int64) for r in regions])
    assert xfer_bench.pool_hash(regions, ids).tolist() == want.tolist()
    # one flipped byte changes its page's hash only
    regions[1][2, 17] ^= 1
    got = xfer_bench.pool_hash(regions, ids)
    assert (got != want).tolist() == [False, False, True]


def test_phase_offsets_time_each_step_from_its_requests_start():
    """Both ends' steps as (end, step, room, time): per room the offset from the prefill's start, the k-th
    recurrence of a step (one per chunk) named apart; medians over the rooms, in time order; a room whose start
    was not traced is left out."""
    ev = [("prefill", "start", 1, 10.0), ("prefill", "header", 1, 10.0001), ("decode", "header", 1, 10.0002),
          ("prefill", "header", 1, 10.0003), ("decode", "header", 1, 10.0004),
          ("prefill", "start", 2, 20.0), ("prefill", "header", 2, 20.0003), ("decode", "header", 2, 20.0004),
          ("prefill", "header", 2, 20.0005), ("decode", "header", 2, 20.0006),
          ("decode", "landed", 3, 30.0)]
    out = xc.phase_offsets(ev)
    assert [name for name, _ in out] == ["prefill start 0", "prefill header 0", "decode header 0", "prefill header 1",
                                         "decode header 1"]
    assert dict(out) == pytest.approx({"prefill start 0": 0.0, "prefill header 0": 200.0, "decode header 0": 300.0,
                                       "prefill header 1": 400.0, "decode header 1": 500.0}, abs=0.2)


def test_chunk_steps_turn_a_timeline_into_each_chunks_step_durations():
    """Session 30's 4k trace, its first two chunks (docs/nccl.md): each step's duration per chunk, how long after
    the previous chunk landed both ends had posted this one, and '-' (None) for a step the trace lacks."""
    timeline = [("prefill start 0", 0.0), ("prefill handed 0", 50.2), ("decode header 0", 109.4),
                ("decode slot 0", 115.9), ("prefill gather 0", 231.6), ("decode post 0", 276.6),
                ("prefill post 0", 309.6), ("decode checked 0", 351.5), ("prefill handed 1", 356.2),
                ("prefill gather 1", 412.9), ("prefill post 1", 472.4), ("decode readied 0", 661.4),
                ("decode header 1", 689.6), ("decode slot 1", 694.7), ("decode landed 0", 851.0),
                ("decode post 1", 881.5), ("decode launched 0", 940.8), ("decode checked 1", 936.8),
                ("decode landed 1", 1255.1)]
    rows = xc.chunk_steps(timeline)
    assert [r["chunk"] for r in rows] == [0, 1]
    assert rows[0] == {"chunk": 0, "hop": 59.2, "p_gather": 181.4, "p_post": 78.0, "d_post": 160.7, "d_check": 74.9,
                       "d_ready": 309.9, "d_launch": 89.8, "link_wait": None}
    assert rows[1]["hop"] == 333.4 and rows[1]["d_post"] == 186.8 and rows[1]["d_check"] == 55.3
    assert rows[1]["d_ready"] is None and rows[1]["d_launch"] is None  # not in this timeline
    assert rows[1]["link_wait"] == 30.5  # the decode's receive posted 30.5 us after chunk 0 landed
    assert xc.chunk_steps([("prefill start 0", 0.0)]) == []


def test_budget_bounds_repetitions():
    calls = []
    times = xc.Budget(seconds=1.0, min_reps=3, max_reps=10, warmup=2).run(lambda: calls.append(1) or 0.6)
    assert times == [0.6, 0.6, 0.6] and len(calls) == 5  # two untimed warm-ups; stops once 1 s is spent
    assert len(xc.Budget(seconds=1.0, min_reps=3, max_reps=10, warmup=0).run(lambda: 0.01)) == 10
    assert xc.stats_us([0.001, 0.002, 0.003]) == {"p50": 2000.0, "p99": pytest.approx(2980.0), "min": 1000.0, "n": 3}


def _row(case, mode, p50, spans, nbytes):
    return {"case": case, "mode": mode, "write_us": {"p50": p50}, "spans": spans, "mean_span": nbytes / spans}


def test_crossover_names_the_winner_of_each_case_and_the_span_bounds():
    rows = [_row("a", "kernel", 100.0, 64, 64 << 20), _row("a", "copy_engine", 80.0, 64, 64 << 20),
            _row("b", "kernel", 50.0, 4096, 8 << 20), _row("b", "copy_engine", 90.0, 4096, 8 << 20),
            _row("c", "kernel", 200.0, 976, 72 << 20), _row("c", "copy_engine", 150.0, 976, 72 << 20),
            _row("d", "kernel", 10.0, 8, 1 << 20)]  # no copy-engine row: left out
    r = xc.crossover(rows)
    assert r["winner"] == {"a": "copy_engine", "b": "kernel", "c": "copy_engine"}
    assert r["min_mean_span_won"] == (72 << 20) / 976
    assert r["max_mean_span_lost"] == (8 << 20) / 4096
    assert r["max_spans_won"] == 976


def test_verdicts_against_the_targets():
    ref = {"gpu_us": {"p50": 1000.0}}
    ipc = [{"case": "x_4096_s", "tokens": 4096, "mode": "kernel", "write_us": {"p50": 1600.0}, "ratio": 0.62,
            "bad_pages": 0, "ref": ref},
           {"case": "x_4096_s", "tokens": 4096, "mode": "copy_engine", "write_us": {"p50": 1100.0}, "ratio": 0.91,
            "bad_pages": 0, "ref": ref},
           {"case": "x_128_s", "tokens": 128, "mode": "kernel", "write_us": {"p50": 30.0}, "ratio": 0.1,
            "bad_pages": 0, "ref": ref}]
    v = xfer_bench.verdicts({"ipc": ipc, "fixed_cost": {"m": {"end_to_end_us": 250.0}},
                             "interference": [{"mode": "kernel", "case": "c", "slowdown": 0.05}],
                             "nccl": [{"tokens": 4096, "ratio": 0.9, "bad_pages": 0}]})
    assert v == {"verified": True, "ipc_ratio": True, "ipc_4k_ms": True, "ipc_16k_ms": True,
                 "small_request_us": True, "interference": {"kernel:c": False}, "nccl_ratio_4k": True}
    # the NCCL target is judged as deployed: the configured slot size, not a --slot-mib pass beside it
    nccl = [{"tokens": 4096, "ratio": 0.5, "bad_pages": 0, "slot_mib": 128},
            {"tokens": 4096, "ratio": 0.9, "bad_pages": 0, "slot_mib": 256}]
    assert xfer_bench.verdicts({"nccl": nccl, "nccl_slot_mib_default": 128})["nccl_ratio_4k"] is False
    # ... nor a --first-chunk-mib pass (its rows are named by their cap; the configured cap's are not)
    nccl = [{"tokens": 4096, "ratio": 0.5, "bad_pages": 0, "slot_mib": 128},
            {"tokens": 4096, "ratio": 0.9, "bad_pages": 0, "slot_mib": 128, "first_chunk_mib": 16}]
    assert xfer_bench.verdicts({"nccl": nccl, "nccl_slot_mib_default": 128})["nccl_ratio_4k"] is False
    ipc[1]["bad_pages"] = 3
    assert xfer_bench.verdicts({"ipc": ipc})["verified"] is False


def test_without_cuda_it_skips_cleanly_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "x.json"
    assert xfer_bench.main(["--out", str(out)]) == 0
    assert "skipped: no CUDA device here" in capsys.readouterr().out
    assert not out.exists()


def test_plan_section_records_every_case_with_exact_span_counts(tmp_path):
    out = tmp_path / "plan.json"
    assert xfer_bench.main(["--quick", "--sections", "plan", "--out", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["plan"]}
    assert len(rows) == 24 + 3
    # contiguous pages: one span a region; scattered page-1 MHA: one span a page and region
    assert rows["mha_p1_4096_contiguous"]["ce_spans"] == 64
    assert rows["mla_p64_4096_contiguous"]["ce_spans"] == 61
    assert rows["mha_p1_128_scattered"]["descriptors"] == 128 * 64
    assert rows["mha_p16_16384_contiguous"]["nccl_chunks"] == 16  # 2 GiB in 128 MiB staging slots


def test_the_programs_flag_and_the_request_sizes_it_measures():
    assert xfer_bench.parse_programs("") == []
    assert xfer_bench.parse_programs("16, 32,66,132") == [16, 32, 66, 132]
    for bad in ("0", "16,x", "-4", "8.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="program counts >= 1"):
            xfer_bench.parse_programs(bad)
    with pytest.raises(SystemExit):
        xfer_bench.main(["--quick", "--programs", "0"])
    assert xfer_bench.parse_slot_mib("256,512") == [256, 512]
    with pytest.raises(argparse.ArgumentTypeError, match="slot sizes in MiB"):
        xfer_bench.parse_slot_mib("0")
    assert xfer_bench.parse_ipc_modes("kernel, split") == ["kernel", "split"]
    for bad in ("", "kernel,ce", "gpu"):
        with pytest.raises(argparse.ArgumentTypeError, match="ipc modes of kernel, copy_engine, split"):
            xfer_bench.parse_ipc_modes(bad)
    assert xfer_bench.parse_first_chunk_mib("0, 16,64") == [0, 16, 64] and xfer_bench.parse_first_chunk_mib("") == []
    for bad in ("-1", "16,x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="first-chunk caps in MiB >= 0"):
            xfer_bench.parse_first_chunk_mib(bad)
    assert xfer_bench.programs_tokens(xc.TOKENS) == [4096, 16384]
    assert xfer_bench.programs_tokens(xc.QUICK_TOKENS) == [1024]  # --quick: the largest, so the section runs
    # --programs-case: serving's page-1 chunks instead of the default 4k/16k page-16 requests
    assert xfer_bench.parse_programs_case("mha_p1:1024, 4096") == ("mha_p1", (1024, 4096))
    assert xfer_bench.programs_tokens(xc.TOKENS, (1024,)) == [1024]
    for bad, why in (("mhx:1024", "the shape is one of mha_p1, mha_p16, mla_p64"), ("mha_p1:", "request sizes"),
                     ("mha_p1:0", "request sizes")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            xfer_bench.parse_programs_case(bad)


def test_the_programs_case_picks_the_shape_the_grid_section_measures(tmp_path):
    out = tmp_path / "p1.json"
    rc = xfer_bench.main(["--quick", "--out", str(out), "--case-s", "0.02", "--max-reps", "5", "--sections", "ipc",
                          "--shapes", "mha_p1", "--tokens", "1024", "--dests", "runs4", "--programs", "4,8",
                          "--programs-case", "mha_p1:1024"])
    assert rc == 0
    rows = json.loads(out.read_text())["programs"]
    assert [(r["case"], r["programs"], r["bad_pages"]) for r in rows] == [("mha_p1_1024_runs4", 4, 0),
                                                                          ("mha_p1_1024_runs4", 8, 0)]


@pytest.mark.slow
def test_quick_run_of_every_section_verifies_every_page(tmp_path, capsys):
    out = tmp_path / "quick.json"
    rc = xfer_bench.main(["--quick", "--out", str(out), "--case-s", "0.02", "--max-reps", "6", "--programs", "4,16",
                          "--slot-mib", "256", "--first-chunk-mib", "1"])
    result = json.loads(out.read_text())
    assert rc == 0 and result["pass"]["verified"] is True
    assert result["machine"].startswith("cpu-") and result["meta"]["quick"] is True
    # both processes hand the GIL over as a server's KV manager makes its process do (SGLANG_P2P_GIL_SWITCH_MS)
    assert result["gil_switch_ms"] == pytest.approx(0.5) and result["decode"]["gil_switch_ms"] == pytest.approx(0.5)
    n = len(xc.QUICK_SHAPES) * len(xc.QUICK_TOKENS) * 2
    assert len(result["ipc"]) == 2 * n and {r["mode"] for r in result["ipc"]} == {"kernel", "copy_engine"}
    # every NCCL case without the engine's overlap, with it at 256 MiB slots (--slot-mib), with a 1 MiB first chunk
    # (--first-chunk-mib, its rows named by it), and as configured
    default = result["nccl_slot_mib_default"]
    by_case: dict = {}
    for r in result["nccl"]:
        by_case.setdefault(r["case"], []).append((r["overlap"], r["slot_mib"], r.get("first_chunk_mib")))
    assert len(by_case) == n and default != 256 and result["nccl_first_chunk_mib_default"] == 0
    assert all(p == [(False, default, None), (True, 256, None), (True, default, 1), (True, default, None)]
               for p in by_case.values())
    assert all(r["bad_pages"] == 0 for k in ("ipc", "nccl") for r in result[k])
    assert [r["mode"] for r in result["interference"]] == ["kernel", "copy_engine", "kernel", "copy_engine", "nccl"]
    assert all(r["error"] is None and r["writes_during"] > 0 for r in result["interference"])
    assert set(result["fixed_cost"]) == {"mla_p64", "mha_p16"}
    assert all(f["end_to_end_us"] > 0 for f in result["fixed_cost"].values())
    # where the small write's host time goes, by function: the transport's checks among them
    assert all(any(r["function"].startswith("plan_pages (cuda_ipc.py") and r["calls_per_op"] == 1.0
                   for r in f["write_profile"]) for f in result["fixed_cost"].values())
    # ... timed under the default route, split, as the service writes
    assert all(f["mode"] == "split" for f in result["fixed_cost"].values())
    # the larger contiguous request on both routes (on CPU: the writes only; the GPU time needs CUDA)
    large = [f["large"] for f in result["fixed_cost"].values()]
    assert sorted(x["case"] for x in large) == ["mha_p16_1024_contiguous", "mla_p64_1024_contiguous"]
    assert all(x[m]["write_us"]["n"] >= 5 and "gpu_us" not in x[m] for x in large for m in ("kernel", "copy_engine"))
    assert result["skipped"] == [] and result["rule"]["winner"]
    # --programs: the kernel with each grid bound, on every destination of the (quick) request size
    rows = result["programs"]
    assert [(r["case"], r["programs"]) for r in rows] == [(f"mha_p16_1024_{d}", n) for d in xc.DESTS for n in (4, 16)]
    assert all(r["mode"] == "kernel" and r["bad_pages"] == 0 and r["write_us"]["n"] >= 5 and r["ratio"] > 0
               and r["error"] is None and r["writes_during"] > 0 and r["matmul_ms_during"] > 0 for r in rows)
    out_text = capsys.readouterr().out
    assert "== programs: kernel grid vs write time and matmul slowdown" in out_text
    # the steps of a 1k-token request on both ends, in order on one clock: each end's steps in its own order, and
    # the header handed to the control channel before the decode takes it
    phases = result["nccl_phases"]
    assert [r["case"] for r in phases] == [f"{s.name}_1024_scattered" for s in xc.QUICK_SHAPES]
    for r in phases:
        t = dict(r["phases_us"])
        assert t["prefill start 0"] == 0.0 and r["send_us"]["n"] >= 5
        # the header goes out before the gather, so the decode posts its receive while the prefill gathers
        assert t["prefill header 0"] <= t["prefill gather 0"] <= t["prefill post 0"] <= t["prefill sent 0"]
        assert t["prefill header 0"] <= t["decode header 0"] <= t["decode post 0"] <= t["decode landed 0"] \
            <= t["decode scattered 0"] <= t["decode reported 0"]
        # each end's host time by function: the decode's profiled in its receiver thread (the pipe reader's would
        # show no function of the pipeline)
        assert any("(pipeline.py:" in p["function"] for p in r["send_profile"])
        assert any("(pipeline.py:" in p["function"] for p in r["recv_profile"]), r["recv_profile"]
    assert "== nccl phases of" in out_text and "== each chunk's steps of" in out_text


@pytest.mark.slow
def test_run_all_transfer_bench_phase_needs_no_sglang_bundle(tmp_path):
    """run_all.sh --phase transfer-bench runs without the SGLang bundle, writes $OUT/xfer_$KIND.{json,log}, and
    on a machine without CUDA says it measured nothing."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "E2E_ROOT": str(tmp_path / "root"), "E2E_BUNDLE": str(tmp_path / "none"),
           "OUT": str(tmp_path / "out"), "E2E_KIND": "cpu-test"}
    p = subprocess.run(["bash", str(repo / "e2e/run_all.sh"), "--phase", "transfer-bench"], capture_output=True,
                       text=True, env=env, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "skipped: no CUDA device here" in (tmp_path / "out/xfer_cpu-test.log").read_text()
    assert not (tmp_path / "out/xfer_cpu-test.json").exists()
    # the GPU tests it runs first (skipped here): with the split communicator (the default), its abort path too
    import re

    def skipped() -> int:
        return int(re.search(r"(\d+) skipped", (tmp_path / "out/xfer_tests.log").read_text()).group(1))

    split = skipped()
    p = subprocess.run(["bash", str(repo / "e2e/run_all.sh"), "--phase", "transfer-bench"], capture_output=True,
                       text=True, env={**env, "SGLANG_P2P_NCCL_SPLIT": "0"}, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert skipped() == split - 4  # the four peer-death cases (decode or prefill killed, cuMem on or off)
    env["E2E_XFER_ARGS"] = "--quick --sections plan"
    p = subprocess.run(["bash", str(repo / "e2e/run_all.sh"), "--phase", "transfer-bench"], capture_output=True,
                       text=True, env=env, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads((tmp_path / "out/xfer_cpu-test.json").read_text())
    assert doc["machine"] == "cpu-test" and len(doc["plan"]) == 27 and doc["pass"] == {"verified": True}


def test_host_profile_names_the_function_that_takes_the_time():
    from bench.transfer.host_profile import host_profile, render

    def slow_part():
        return sum(i * i for i in range(3000))

    def quick_part():
        return 1

    def op():
        quick_part()
        slow_part()

    rows = host_profile(op, calls=20, top=40)
    by = {r["function"].split(" ")[0]: r for r in rows}
    assert by["slow_part"]["calls_per_op"] == 1.0 and by["quick_part"]["calls_per_op"] == 1.0
    assert by["slow_part"]["cum_us_per_op"] > 20 * by["quick_part"]["cum_us_per_op"]
    assert rows == sorted(rows, key=lambda r: r["own_us_per_op"], reverse=True)
    assert "slow_part" in "\n".join(render(rows, limit=40))


def test_gather_host_says_it_measured_nothing_without_cuda(capsys, monkeypatch):
    from bench.transfer import gather_host

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gather_host.main(["--tokens", "128"]) == 0
    assert "no CUDA device here: nothing measured" in capsys.readouterr().out


def test_host_timeline_names_every_step_in_order_with_the_copiers_own_inside():
    """The `fixed` section's step-by-step split of a write: each step's time from the end of the one before,
    the copier's own marks (PageCopier.trace) between the steps around them, and its trace unset afterwards."""

    class Copier:
        trace = None

        def copy(self):
            self.trace("prepared")
            time.sleep(0.002)
            self.trace("launched")

    copier = Copier()
    steps = [("waited", lambda: time.sleep(0.001)), ("returned", copier.copy), ("synchronized", lambda: None)]
    out = xfer_bench.host_timeline(steps, xc.Budget(0.0, min_reps=5, max_reps=5, warmup=0), copier=copier)
    assert list(out) == ["waited", "prepared", "launched", "returned", "synchronized"]
    assert out["waited"] >= 1000 and out["launched"] >= 2000 and out["returned"] < 1000
    assert copier.trace is None
    assert xfer_bench._steps({"a": 1.26, "b": 10.0}) == "a 1.3, b 10.0"  # noqa: SLF001


def test_the_fixed_table_prints_a_gpu_runs_step_timelines_and_4k_split():
    """What a GPU run adds to `fixed` (the step timelines, the 4k request's GPU and host time) reaches the
    printed table, and a step timeline is not mistaken for a p50/p99 row."""
    f = {"case": "mha_p16_128_scattered", "pages": 8, "regions": 64, "plan_us": {"p50": 1.0, "p99": 2.0},
         "end_to_end_us": 3.0, "nccl": {"plan_and_header_us": {"p50": 1.0}},
         "steps_us": {"kernel": {"planned": 3.0, "launched": 40.0}, "copy_engine": {"called": 20.0}},
         "large": {"case": "mha_p16_4096_contiguous", "mib": 512.0,
                   "kernel": {"write_us": {"p50": 1850.0, "p99": 1900.0}, "gpu_us": {"p50": 1543.0},
                              "host_us": 307.0, "steps_us": {"launched": 45.0}}}}
    text = xfer_bench.tables({"machine": "m", "fixed_cost": {"mha_p16": f}})
    assert "kernel write step by step (us, each from the one before): planned 3.0, launched 40.0" in text
    assert "mha_p16_4096_contiguous (512 MiB) kernel: write 1850.0 us p50, GPU 1543.0 us, host around it 307.0 us" in text
    assert "steps_us" not in text


def test_the_driver_refuses_an_unknown_destination_shape_or_size(capsys):
    """--dests, --shapes and --tokens name what they refuse and the choices (exit 2, before anything runs)."""
    from bench.transfer import xfer_bench

    for argv, said in ((["--dests", "contiguous,rows4"], "runs<N>"), (["--shapes", "mha_p2"], "mha_p1,mha_p16,mla_p64"),
                       (["--tokens", "512"], "unknown tokens ['512']")):
        with pytest.raises(SystemExit) as e:
            xfer_bench.main(["--quick", "--sections", "plan", *argv])
        assert e.value.code == 2
        assert said in capsys.readouterr().err


def test_quick_run_writes_pages_landing_in_runs_byte_exact(tmp_path):
    """A runs<N> destination goes through the same driver: N spans a region, every page checked on the decode."""
    from bench.transfer import xfer_bench

    out = tmp_path / "runs.json"
    assert xfer_bench.main(["--quick", "--sections", "ipc", "--shapes", "mha_p1", "--tokens", "1024", "--dests",
                            "runs2", "--case-s", "0.02", "--max-reps", "6", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["ipc"]
    regions = next(s.regions for s in xc.QUICK_SHAPES if s.name == "mha_p1")
    assert {(r["case"], r["mode"]) for r in rows} == {("mha_p1_1024_runs2", "kernel"), ("mha_p1_1024_runs2", "copy_engine")}
    assert all(r["spans"] == 2 * regions and r["bad_pages"] == 0 for r in rows)


def test_the_split_route_on_mixed_pages_is_timed_checked_and_run_beside_the_matmul(tmp_path):
    """--ipc-modes kernel,split --dests mixed: the ipc rows of both routes verify every page, and the interference
    loop runs beside each (on CPU with the stand-in: the driver's walk, not a measurement)."""
    out = tmp_path / "split.json"
    rc = xfer_bench.main(["--quick", "--out", str(out), "--case-s", "0.02", "--max-reps", "5", "--sections",
                          "ipc,interference", "--shapes", "mha_p1", "--tokens", "1024", "--dests", "mixed",
                          "--ipc-modes", "kernel,split"])
    result = json.loads(out.read_text())
    assert rc == 0 and result["pass"]["verified"] is True
    assert [(r["case"], r["mode"], r["bad_pages"]) for r in result["ipc"]] == [
        ("mha_p1_1024_mixed", "kernel", 0), ("mha_p1_1024_mixed", "split", 0)]
    # 4 long runs and 256 single pages, a span a region each
    regions = next(sh.regions for sh in xc.QUICK_SHAPES if sh.name == "mha_p1")
    assert result["ipc"][1]["spans"] == (4 + 256) * regions
    assert [r["mode"] for r in result["interference"] if r["case"] == "mha_p1_1024_mixed"] == ["kernel", "split"]


def test_only_the_copy_engines_row_is_held_to_few_repetitions_by_its_spans():
    """split's row counts the kernel's spans too (a 4k page-1 chunk: 65,792), but the engines take only its long
    runs: it is timed as often as the kernel's, not ten times like a million-span copy-engine batch."""
    assert xfer_bench.engine_spans("copy_engine", 262144) == 262144
    assert xfer_bench.engine_spans("split", 262144) == xfer_bench.engine_spans("kernel", 262144) == 0


def test_interleave_times_each_mode_once_a_round_and_checks_each_modes_own_write(tmp_path, capsys):
    """--interleave: one row a mode (a mode named twice is timed once), each with as many timed writes as the
    other (one of each a round), its own write checked page by page, and the table says the modes ran in turn."""
    out = tmp_path / "interleave.json"
    rc = xfer_bench.main(["--quick", "--out", str(out), "--case-s", "0.02", "--max-reps", "7", "--sections", "ipc",
                          "--shapes", "mha_p16", "--tokens", "1024", "--dests", "scattered,contiguous",
                          "--ipc-modes", "kernel,split,kernel", "--interleave"])
    result = json.loads(out.read_text())
    assert rc == 0 and result["pass"]["verified"] is True
    rows = result["ipc"]
    assert [(r["case"], r["mode"]) for r in rows] == [
        ("mha_p16_1024_scattered", "kernel"), ("mha_p16_1024_scattered", "split"),
        ("mha_p16_1024_contiguous", "kernel"), ("mha_p16_1024_contiguous", "split")]
    assert all(r["interleaved"] and r["bad_pages"] == 0 for r in rows)
    for case in ("mha_p16_1024_scattered", "mha_p16_1024_contiguous"):
        assert len({r["write_us"]["n"] for r in rows if r["case"] == case}) == 1
    assert "(modes in turn, --interleave)" in capsys.readouterr().out


def test_idle_ms_sleeps_before_every_timed_write_and_needs_interleave(tmp_path, capsys):
    """--idle-ms: each write of a round finds the devices idle for that long first (a sleep outside the timed write,
    as between requests at concurrency 1); the rows and the table say so. Without --interleave it is refused."""
    out = tmp_path / "idle.json"
    rc = xfer_bench.main(["--quick", "--out", str(out), "--case-s", "0.02", "--max-reps", "4", "--sections", "ipc",
                          "--shapes", "mha_p16", "--tokens", "1024", "--dests", "contiguous",
                          "--ipc-modes", "kernel,split", "--interleave", "--idle-ms", "30"])
    rows = json.loads(out.read_text())["ipc"]
    assert rc == 0 and [r["idle_ms"] for r in rows] == [30.0, 30.0]
    # every write of every round, the two warm-up rounds' too, slept first
    assert [r["idle_waits"] for r in rows] == [r["write_us"]["n"] + xc.Budget(0).warmup for r in rows]
    assert rows[0]["write_us"]["n"] > 0 and rows[0]["write_us"]["p50"] < 30e3  # the sleep is not timed
    assert "(modes in turn, --interleave, 30 ms idle before each write)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        xfer_bench.main(["--quick", "--sections", "ipc", "--idle-ms", "30"])
