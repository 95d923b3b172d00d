"""e2e/lb_layout.py (where lb_compare's servers run, their pools, the calibrated rates) and the calibration
end to end against simulated workers on 127.0.0.1."""
from pathlib import Path

import pytest

from e2e import lb_layout as ll

pytest.importorskip("aiohttp")

from e2e import lb_compare as lc  # noqa: E402


def test_one_server_per_gpu_prefills_first():
    assert ll.placement("2p2d", 4) == [("prefill", 0, 0), ("prefill", 1, 1), ("decode", 0, 2), ("decode", 1, 3)]
    assert ll.placement("3p1d", 4) == [("prefill", 0, 0), ("prefill", 1, 1), ("prefill", 2, 2), ("decode", 0, 3)]
    assert ll.placement("3p1d", 1) == [("prefill", 0, 0), ("prefill", 1, 0), ("prefill", 2, 0), ("decode", 0, 0)]
    with pytest.raises(ValueError, match="needs 1 or 4 GPUs, not 2"):
        ll.placement("2p2d", 2)


def test_pools_fit_an_80gb_h100_and_the_long_prefixes_overflow_one_prefill():
    four = ll.LAYOUTS[4]
    assert ll.KV_BYTES_PER_TOKEN["llama-anchor"] == 128 * 1024 and ll.KV_BYTES_PER_TOKEN["llama-tiny"] == 2048
    assert ll.pool_gib(four, "prefill") == 12.0 and ll.pool_gib(four, "decode") == 56.0
    # 56 GiB + 0.45 GiB of weights within 0.88 of ~78.5 GiB free; not within 0.88 of 60 GiB
    assert ll.fits(four, "3p1d", 78.5) and ll.fits(four, "2p2d", 78.5) and not ll.fits(four, "3p1d", 60.0)
    # every server of the one-GPU layout on GPU 0: 3 x (0.1875 + 0.01) + (0.5 + 0.01) GiB
    assert ll.fits(ll.LAYOUTS[1], "3p1d", 8.0) and not ll.fits(ll.LAYOUTS[1], "3p1d", 5.0)
    wp = lc.WorkloadParams(**dict(four.workload))
    assert wp.long_prefixes * wp.long_prefix == 120_000
    assert four.prefill_tokens < wp.long_prefixes * wp.long_prefix < 2 * four.prefill_tokens


def test_burst_size_and_rates():
    assert ll.burst_size(2, 12400, 98304) == 7  # half of two 98k pools in flight
    assert ll.burst_size(3, 900, 98304) == 24  # 8 per prefill
    assert ll.burst_size(2, 100_000, 98304) == 4  # at least 2 per prefill
    table = ll.rates({"bursty_mixed": 200_000.0, "long_prefix": 100_000.0}, {"bursty_mixed": 2000.0, "long_prefix": 12500.0}, ll.LOADS, 60.0)
    # bursty: 100 req/s of capacity, 0.8 of it is 80, capped at 60; long_prefix: 8 req/s, 5 x 8 = 40 req/s = 13.3 chats/s
    assert table == {"bursty_mixed": {"capacity_rps": 100.0, "offered_rps": 60.0, "capped": True, "bursty_rate": 60.0},
                     "long_prefix": {"capacity_rps": 8.0, "offered_rps": 40.0, "capped": False, "long_rate": 13.333}}


def test_calibrated_rates_replace_only_the_rate_fields():
    wp = lc.WorkloadParams(long_prefix=1000, long_prefixes=4)
    mean = lc.mean_prompt("long_prefix", wp)
    assert 1100 <= mean <= 1400  # 1000 + 100 a turn + 150 for each earlier turn, 3 turns
    new, table = lc.calibrated(wp, {"long_prefix": 12 * mean}, {"long_prefix": 1.5}, 60.0)
    assert table["long_prefix"]["capacity_rps"] == 12.0 and new.long_rate == 6.0  # 1.5 x 12 req/s over 3 turns
    assert (new.bursty_rate, new.chat_rate, new.long_prefix) == (wp.bursty_rate, wp.chat_rate, 1000)
    same, why = lc.calibrated(wp, {"long_prefix": 0.0}, {"long_prefix": 1.5}, 60.0)
    assert same == wp and "default rates stay" in why["error"]


def test_bursty_lengths_follow_the_layout():
    big = lc.make_workload("bursty_mixed", 30.0, 1, lc.WorkloadParams(**dict(ll.LAYOUTS[4].workload)))
    small = lc.make_workload("bursty_mixed", 30.0, 1, lc.WorkloadParams())
    assert max(len(r.input_ids) for r in big) <= 14000 and max(len(r.input_ids) for r in small) <= 6000
    assert sum(len(r.input_ids) for r in big) > 2 * sum(len(r.input_ids) for r in small)


@pytest.mark.serial  # a few simulated workers and an LB process
def test_capacity_measured_through_a_round_robin_lb(tmp_path: Path):
    """The warm-up's calibration against 2 prefills of 0.05 ms a token: a burst of fresh prompts of the mean
    length, every one answered, and a capacity that bounds what the simulated prefills can do."""
    cluster = lc.SimCluster(2, 1, ["--prefill-ms-per-token", "0.05", "--decode-ms-per-token", "1"], tmp_path)
    try:
        assert len(cluster.launch()) == 3
        h = lc.Harness(cluster, {}, tmp_path, lc.WorkloadParams(long_prefix=2000, long_prefixes=3))
        out = h.warm_up(["long_prefix"], 1.0, calibrate_pool=20000)
    finally:
        cluster.stop()
    cap = out["capacity_tok_s"]["long_prefix"]
    # two prefills of 20k tokens/s each at most (0.05 ms a token); an LB hop and the client take some of it
    assert 2000 < cap <= 40000, cap
    assert out["long_prefix"]["num_failed"] == 0


def test_workload_order_per_layout():
    assert ll.LAYOUTS[1].workloads == lc.WORKLOADS
    assert ll.LAYOUTS[4].workloads == ("bursty_mixed", "long_prefix", "shared_prefix")  # shared_prefix dropped first


@pytest.mark.serial  # four SGLang processes that fail on a missing model
def test_four_gpu_run_wires_its_layout_into_the_servers(tmp_path):
    """--gpus 4 as run_all.sh calls it, with no model there: the servers fail to start, and the results and the
    servers' command lines show the layout (llama-anchor, one GPU each, 0.88 and the pools, CUDA IPC)."""
    import json
    import subprocess
    import sys

    out, logs = tmp_path / "o.json", tmp_path / "logs"
    p = subprocess.run([sys.executable, "-m", "e2e.lb_compare", "--gpus", "4", "--models", str(tmp_path / "models"), "--topology", "3p1d",
                        "--out", str(out), "--logs", str(logs), "--machine", "test-x4"], capture_output=True, text=True, timeout=200)
    assert p.returncode == 1, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc["error"]) == {"lbc-prefill0", "lbc-prefill1", "lbc-prefill2", "lbc-decode0"}
    assert (doc["machine"], doc["gpus"], doc["model"], doc["pool_gib"]) == ("test-x4", 4, "llama-anchor", {"prefill": 12.0, "decode": 56.0})
    assert doc["transport"].startswith("p2pnccl, SGLANG_P2P_TRANSPORT=auto")
    assert doc["workload_params"]["long_max"] == 14000 and doc["workload_params"]["chat_prefix"] == 4000
    assert doc["workload_params"]["chat_output"] == 8  # the decodes turn over fast enough that the prefills queue
    for name, gpu, tokens in (("lbc-prefill2", 2, 98304), ("lbc-decode0", 3, 458752)):
        cmd = (logs / f"{name}.log").read_text().splitlines()[0].split()
        assert cmd[cmd.index("--base-gpu-id") + 1] == str(gpu) and cmd[cmd.index("--max-total-tokens") + 1] == str(tokens)
        assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.88" and cmd[cmd.index("--model-path") + 1] == str(tmp_path / "models/llama-anchor")


@pytest.mark.serial  # simulated workers and an LB process, ~10 s
def test_calibrated_rates_drive_the_comparison(tmp_path):
    """lb_compare --calibrate on simulated workers: the warm-up measures each workload's capacity, the rates
    follow it (capped at --max-rps), and the comparison's workloads are generated at those rates."""
    import json

    out = tmp_path / "o.json"
    rc = lc.main(["--sim", "--sim-knobs", "--prefill-ms-per-token 0.05 --decode-ms-per-token 1 --prefix-cache-tokens 2000", "--calibrate",
                  "--max-rps", "1000", "--loads", "bursty_mixed=0.5,long_prefix=0.5", "--out", str(out), "--logs", str(tmp_path / "logs"),
                  "--lbs", "ours:load_aware", "--reps", "1", "--workloads", "bursty_mixed,long_prefix", "--long-prefix", "600",
                  "--long-prefixes", "4", "--budget-s", "20", "--max-run-s", "2", "--min-run-s", "1", "--warmup-s", "1", "--fault-s", "0",
                  "--turn-gap", "0.3"])
    doc = json.loads(out.read_text())
    assert rc == 0, doc.get("error")
    cap = doc["warmup"]["capacity_tok_s"]
    assert set(cap) == {"bursty_mixed", "long_prefix"} and min(cap.values()) > 0
    for wl, field in (("bursty_mixed", "bursty_rate"), ("long_prefix", "long_rate")):
        row = doc["rates"][wl]
        assert abs(row["offered_rps"] - 0.5 * row["capacity_rps"]) <= 0.01  # both rounded to 0.01
        assert doc["workload_params"][field] == row[field] and not row["capped"]
    assert doc["runs"]["ours:load_aware"]["bursty_mixed"][0]["num_failed"] == 0


def test_run_all_lb_on_four_gpus_refuses_to_run_without_the_peers(tmp_path):
    """run_all.sh --gpus 4 --phase lb on a machine where lb.tar.xz was never unpacked stops at once (a 10-minute
    call for our LB alone would be wasted) and says what to carry."""
    import os
    import subprocess

    pytest.importorskip("sglang")  # the preflight imports it
    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "root/sglang").mkdir(parents=True)
    (tmp_path / "root/sglang/.unpacked").write_text("x")
    env = {**os.environ, "E2E_ROOT": str(tmp_path / "root"), "E2E_BUNDLE": str(tmp_path / "none"), "OUT": str(tmp_path / "out"),
           "E2E_KIND": "cpu-test"}
    env.pop("E2E_LB_ARGS", None)
    p = subprocess.run(["bash", str(repo / "e2e/run_all.sh"), "--gpus", "4", "--phase", "lb"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1 and "no lb.tar.xz unpacked on this machine" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert "lb_compare: start" not in p.stdout and "models: start" not in p.stdout
