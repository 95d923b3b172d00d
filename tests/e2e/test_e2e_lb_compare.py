"""e2e/lb_compare.py (our LB vs mini_lb vs smg on the same PD servers) on CPU: its pure parts, and the whole
harness end to end against simulated workers (simworker, standing in for the GPU servers)
with real LB processes, kill -9 and restart; mini_lb and smg join when their virtualenvs exist
(bench/lb_sim/install_peers.sh)."""
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from e2e import config  # noqa: E402
from e2e import lb_compare as lc  # noqa: E402
from e2e.lb_real import Answer  # noqa: E402
from e2e.stats import RequestRecord  # noqa: E402
from support import metrics_server  # noqa: E402

PEERS = Path(os.environ.get("LB_PEERS_DIR", Path.home() / ".cache/sglang-p2p-lb-peers"))


def test_parse_lbs_and_rotation():
    specs = lc.parse_lbs("ours:load_aware, mini_lb,smg:cache_aware")
    assert [s.name for s in specs] == ["ours:load_aware", "mini_lb", "smg:cache_aware"]
    for bad in ("ours", "mini_lb:random", "nginx:x"):
        with pytest.raises(ValueError, match="use ours:<policy>"):
            lc.parse_lbs(bad)
    # our LB with --workers N
    assert [(s.name, s.policy, s.workers) for s in lc.parse_lbs("ours:load_aware:w8,ours:load_aware:w1")] == [
        ("ours:load_aware:w8", "load_aware", 8), ("ours:load_aware", "load_aware", 1)]
    for bad in ("smg:cache_aware:w2", "ours:load_aware:8", "ours:load_aware:w0", "ours:prefix_aware:c1.5", "ours:prefix_aware:cx"):
        with pytest.raises(ValueError, match="process count"):
            lc.parse_lbs(bad)
    # our LB with --cached-token-cost, beside the same policy without it: two LBs, two names, and the flag passed
    a, b = lc.parse_lbs("ours:prefix_aware:c0.25,ours:prefix_aware:w2:c0.5")
    assert (a.name, a.cached_cost, a.workers) == ("ours:prefix_aware:c0.25", 0.25, 1)
    assert (b.name, b.cached_cost, b.workers) == ("ours:prefix_aware:w2:c0.5", 0.5, 2)
    argv, _ = lc.lb_command(a, [("http://127.0.0.1:1", 2)], ["http://127.0.0.1:3"], 4, {}, "k")
    assert argv[argv.index("--cached-token-cost") + 1] == "0.25"
    argv, _ = lc.lb_command(lc.parse_lbs("ours:prefix_aware")[0], [("http://127.0.0.1:1", 2)], ["http://127.0.0.1:3"], 4, {}, "k")
    assert "--cached-token-cost" not in argv
    orders = [[s.name for s in lc.rotated(specs, r)] for r in range(3)]
    assert orders[1] == ["mini_lb", "smg:cache_aware", "ours:load_aware"]
    assert all(sorted(o) == sorted(orders[0]) for o in orders) and len({o[0] for o in orders}) == 3  # each LB goes first once


def test_lb_commands_cover_every_worker():
    from sglang_p2p_lb import cli

    ps, ds = [("http://127.0.0.1:1", 11), ("http://127.0.0.1:2", 12), ("http://127.0.0.1:3", 13)], ["http://127.0.0.1:4"]
    peers = {"mini_lb": lc.Peer(("py", "-m", "sglang_router.launch_router"), (("PYTHONPATH", "/x/minilb"),)), "smg": lc.Peer(("py", "-m", "smg"))}
    argv, env = lc.lb_command(lc.LBSpec("ours", "prefix_aware"), ps, ds, 9000, peers, "key")
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv[3:]))
    assert cfg.prefills == ps and cfg.decodes == ds and cfg.policy == "prefix_aware" and cfg.port == 9000 and cfg.host == "127.0.0.1" and env == {}
    argv, env = lc.lb_command(lc.LBSpec("mini_lb"), ps, ds, 9001, peers, "key")
    assert argv[:5] == ["py", "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb"] and env == {"PYTHONPATH": "/x/minilb"}
    assert argv.count("--prefill") == 3 and argv[argv.index("--prefill") + 1: argv.index("--prefill") + 3] == ["http://127.0.0.1:1", "11"]
    argv, _ = lc.lb_command(lc.LBSpec("smg", "power_of_two"), ps, ds, 9002, peers, "key", prom_port=9100)
    assert argv[3:5] == ["launch", "--pd-disaggregation"] and argv[argv.index("--policy") + 1] == "power_of_two"
    assert argv[argv.index("--prometheus-port") + 1] == "9100" and argv[argv.index("--health-check-interval-secs") + 1] == "2"
    assert lc.lb_command(lc.LBSpec("smg", "cache_aware"), ps, ds, 9003, {}, "key") is None  # peer not installed
    # our tree policies get a tree the size of one prefill's radix cache (98304 tokens x 4 bytes / 64)
    argv, _ = lc.lb_command(lc.LBSpec("ours", "prefix_aware"), ps, ds, 9004, peers, "key", tree=lc.tree_blocks(98304))
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv[3:]))
    assert cfg.prefix.max_tree_size == 6144 and cfg.prefix.eviction_interval == 1.0
    argv, _ = lc.lb_command(lc.LBSpec("ours", "load_aware"), ps, ds, 9005, peers, "key", tree=6144)
    assert "--max-tree-size" not in argv and "--workers" not in argv
    argv, _ = lc.lb_command(lc.parse_lbs("ours:load_aware:w8")[0], ps, ds, 9006, peers, "key")
    assert cli.build_parser().parse_args(argv[3:]).workers == 8 and "--decision-log" not in argv
    # ours logs its routing decisions where the harness asks (its log directory)
    argv, _ = lc.lb_command(lc.LBSpec("ours", "load_aware"), ps, ds, 9007, peers, "key", decisions=Path("/l/d.jsonl"))
    assert cli.config_from_args(cli.build_parser().parse_args(argv[3:])).decision_log == "/l/d.jsonl"


def test_bundle_peers_put_each_folder_on_its_own_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/base")
    (tmp_path / "smg").mkdir()
    peers = lc.bundle_peers(tmp_path)
    assert set(peers) == {"smg"} and dict(peers["smg"].env) == {"PYTHONPATH": f"{tmp_path / 'smg'}:/base"}
    assert peers["smg"].argv[1:] == ("-m", "smg")


def test_plan_fits_the_budget_and_drops_workloads_from_the_end():
    # 45 runs: (400 - 80 faults - 3 reps x 2.5 s of LB start side by side - 45 x 1.5 s overhead) / 45 = 5.44 -> 5.4
    p = lc.plan(400, 5, lc.WORKLOADS, 3, 20.0, 4.0, 2.5, 1.5, 80)
    assert p == lc.Plan(5.4, lc.WORKLOADS, 3)
    # a queue that drains in a quarter of the run: 245 / (45 x 1.25) = 4.36 -> 4.3
    assert lc.plan(400, 5, lc.WORKLOADS, 3, 20.0, 4.0, 2.5, 1.5, 80, drain_frac=0.25).run_s == 4.3
    # three workloads leave 1.0 s, two 2.25 s, one (200 - 80 - 7.5 - 22.5) / 15 = 6.0 s
    p = lc.plan(200, 5, lc.WORKLOADS, 3, 20.0, 4.0, 2.5, 1.5, 80)
    assert p.workloads == ("bursty_mixed",) and p.dropped == ("shared_prefix", "long_prefix") and p.run_s == 6.0
    p = lc.plan(50, 5, lc.WORKLOADS, 3, 20.0, 4.0, 2.5, 1.5, 80)
    assert p.workloads == () and "not even one" in p.note
    assert lc.plan(10_000, 2, ["bursty_mixed"], 3, 20.0, 4.0, 2.5, 1.5, 0).run_s == 20.0


def _run(ttft50, ttft99, tput, hit, n=100):
    return {"num_requests": n, "ttft_ms_p50": ttft50, "ttft_ms_p99": ttft99, "e2e_ms_p99": None if ttft99 is None else 2 * ttft99, "output_throughput": tput, "cache_hit_rate": hit, "num_failed": 0}


def test_aggregate_and_targets():
    agg = lc.aggregate([_run(10, 100, 500, 0.5), _run(30, 300, 400, 0.7), _run(20, 90, 450, 0.6), _run(None, None, 0.0, None, n=0)])
    assert agg["reps"] == 3 and agg["empty_runs"] == 1
    assert agg["ttft_ms_p99"] == {"median": 100, "min": 90, "max": 300} and agg["cache_hit_rate"]["median"] == 0.6
    table = {
        "ours:load_aware": {"shared_prefix": lc.aggregate([_run(20, 70, 500, 0.80)])},
        "ours:prefix_aware": {"shared_prefix": lc.aggregate([_run(15, 80, 510, 0.92)])},
        "mini_lb": {"shared_prefix": lc.aggregate([_run(30, 200, 480, 0.6)])},
        "smg:cache_aware": {"shared_prefix": lc.aggregate([_run(16, 100, 505, 0.91)])},
    }
    (row,) = lc.targets(table, ["shared_prefix"])
    assert row["ours"] == "ours:load_aware" and row["best_peer"] == "smg:cache_aware" and row["p99_vs_peer"] == -0.3 and row["p99_met"]
    assert not row["tput_met"]  # load_aware (the best p99) delivers 500 tok/s, smg 505
    assert row["ours_hit"] == "ours:prefix_aware" and row["prefix_met"]  # 0.92 >= 0.91 and 15 ms < 16 ms
    table["ours:prefix_aware"]["shared_prefix"] = lc.aggregate([_run(17, 80, 510, 0.92)])
    assert not lc.targets(table, ["shared_prefix"])[0]["prefix_met"]


def test_cold_and_warm_ttft_split_at_the_cold_seconds():
    """Requests sent in the first cold_s seconds (caches flushed at the run's start) and those sent after get a
    p99 each; failed answers count in neither."""
    def a(sent, ttft, ok=True):
        return Answer(RequestRecord(ok, ttft if ok else None, 1.0, 1 if ok else 0, "" if ok else "x"), 10, 0, sent)

    answers = [a(0.1, 2.0), a(2.9, 1.0), a(3.0, 0.2), a(7.0, 0.1), a(8.0, None, ok=False)]
    out = lc.cold_warm(answers, 3.0)
    assert out == {"cold_s": 3.0, "ttft_ms_p99_cold": 1990.0, "cold_requests": 2, "ttft_ms_p99_warm": 199.0, "warm_requests": 2}
    assert lc.cold_warm(answers, 0.0)["cold_requests"] == 0 and lc.cold_warm(answers, 0.0)["ttft_ms_p99_cold"] is None
    # per second of the run: answers, TTFT p50 and p99 (ms) of the requests sent in it
    assert lc.ttft_timeline(answers) == [[0.0, 1, 2000.0, 2000.0], [2.0, 1, 1000.0, 1000.0], [3.0, 1, 200.0, 200.0],
                                         [7.0, 1, 100.0, 100.0]]
    assert lc.ttft_timeline(answers, bin_s=5.0) == [[0.0, 3, 1000.0, 1980.0], [5.0, 1, 100.0, 100.0]]
    # the targets put the steady state beside the headline p99
    table = {"ours:prefix_aware": {"long_prefix": lc.aggregate([{**_run(10, 140, 500, 0.98), "ttft_ms_p99_warm": 50}])},
             "mini_lb": {"long_prefix": lc.aggregate([{**_run(30, 160, 480, 0.85), "ttft_ms_p99_warm": 150}])}}
    (row,) = lc.targets(table, ["long_prefix"])
    assert not row["p99_met"] and row["warm_best_peer"] == "mini_lb" and row["warm_p99_vs_peer"] == -0.667


def _samples(*pairs):
    """LoadSamples from (queue, running) pairs; None stands for a sample that failed."""
    return [None if x is None else lc.LoadSample(*x) for x in pairs]


def test_load_evidence_per_server_and_imbalance():
    ev = lc.load_evidence({"p0": _samples((2, 1), (3, 0), None), "p1": _samples((0, 1), (1, 0)), "p2": _samples(None, None)},
                          {"d0": _samples((0, 4)), "d1": _samples((1, 3))})
    p0, p1, p2 = ev["server_load"]["prefill"]
    assert p0 == {"url": "p0", "samples": 2, "missing": 1, "queue_mean": 2.5, "queue_max": 3, "running_mean": 0.5, "running_max": 1, "load_mean": 3.0,
                  "pd_queue_mean": None, "pd_queue_max": None, "pd_queue_parts_mean": None}
    assert p1["load_mean"] == 1.0
    # only failed samples: counted missing, no figures, and left out of the imbalance
    assert (p2["samples"], p2["missing"], p2["queue_max"], p2["load_mean"]) == (0, 2, None, None)
    assert ev["prefill_imbalance"] == 1.5  # means 3 and 1: 3 / 2
    assert ev["decode_imbalance"] == 1.0 and ev["prefill_queue_max"] == 3 and ev["server_load"]["interval_s"] == lc.SAMPLE_S
    line = lc.evidence_line(ev)
    assert "prefill [q 2.5/3 r 0.5/1, q 0.5/1 r 0.5/1, -] imbalance 1.5" in line and line.endswith("3/9 samples missing")
    assert lc.imbalance([]) is None and lc.imbalance([None]) is None
    assert lc.imbalance([0.0, 0.0]) == 1.0  # idle is even
    assert lc.imbalance([4.0, 0.0, 0.0, 0.0]) == 4.0  # one of four takes everything
    nothing = lc.load_evidence({"p0": []}, {"d0": _samples(None)})
    assert (nothing["prefill_imbalance"], nothing["decode_imbalance"], nothing["prefill_queue_max"]) == (None, None, None)
    assert ev["decode_pd_queue_mean"] is None and nothing["decode_pd_queue_mean"] is None  # no PD gauges exported
    # requests waiting for a decode: the decodes' PD queues summed over the decodes
    full = lc.load_evidence({"p0": [lc.LoadSample(0, 1, 40)]}, {"d0": [lc.LoadSample(0, 34, 38), lc.LoadSample(0, 34, 42)],
                                                                 "d1": [lc.LoadSample(0, 30, 30)], "d2": [lc.LoadSample(0, 1)]})
    assert full["decode_pd_queue_mean"] == 70.0


def test_prefill_shares_from_each_prefills_counters_before_and_after_a_run():
    before = {"p0": (10.0, 1000.0, 400.0), "p1": (5.0, None, 0.0), "p2": (0.0, 0.0, 0.0)}
    after = {"p0": (16.0, 9000.0, 6400.0), "p1": (8.0, 3000.0, 100.0), "p2": (1.0, 500.0, 0.0)}
    out = lc.prefill_shares(before, after)
    assert out["prefill_counts"] == [
        {"url": "p0", "requests": 6.0, "prompt_tokens": 8000.0, "cached_tokens": 6000.0},
        {"url": "p1", "requests": 3.0, "prompt_tokens": None, "cached_tokens": 100.0},  # missing before: unknown
        {"url": "p2", "requests": 1.0, "prompt_tokens": 500.0, "cached_tokens": 0.0}]
    assert out["prefill_request_share_max"] == 0.6
    # a prefill that did not answer after the run (killed): its counts and the share are unknown, not guessed
    gone = lc.prefill_shares(before, {**after, "p2": None})
    assert gone["prefill_counts"][2]["requests"] is None and gone["prefill_request_share_max"] is None
    # a restarted server's counter starts again at 0: no negative count
    assert lc.prefill_shares({"p0": (50.0, 0.0, 0.0)}, {"p0": (3.0, 0.0, 0.0)})["prefill_counts"][0]["requests"] == 0.0
    # with SGLang's KV transfer histograms: each prefill's mean transfer time (its queue behind other sends
    # included) and the GB/s it made; none where nothing was sent in the run
    kv = lc.prefill_shares({"p0": (0.0, 0.0, 0.0, 100.0, 2.0, 1024.0), "p1": (0.0, 0.0, 0.0, 5.0, 1.0, 0.0)},
                           {"p0": (4.0, 9.0, 0.0, 180.0, 6.0, 3072.0), "p1": (0.0, 0.0, 0.0, 5.0, 1.0, 0.0)})["prefill_counts"]
    assert (kv[0]["kv_transfer_ms_mean"], kv[0]["kv_transfer_gb_s"]) == (20.0, 25.0)  # 2 GB in 4 transfers of 20 ms
    assert "kv_transfer_ms_mean" not in kv[1]
    # with SGLang's waiting-queue histogram: each prefill's requests' mean wait for their first forward
    q = lc.prefill_shares({"p0": (0.0,) * 6 + (1.5, 10.0), "p1": (0.0,) * 6 + (0.2, 4.0), "p2": (0.0,) * 6},
                          {"p0": (4.0,) + (0.0,) * 5 + (2.3, 14.0), "p1": (0.0,) * 6 + (0.2, 4.0), "p2": (1.0,) + (0.0,) * 5})
    assert q["prefill_counts"][0]["queue_ms_mean"] == 200.0  # 0.8 s over 4 requests
    assert "queue_ms_mean" not in q["prefill_counts"][1] and "queue_ms_mean" not in q["prefill_counts"][2]


def test_sglang_prefills_counters_read_from_their_metrics_over_http():
    """SGLangCluster.counts: one /metrics read a prefill, SGLang's counters summed over DP ranks; a prefill that
    does not answer gives no counts, one without the token counters gives its requests only."""
    texts = {"/a/metrics": 'sglang:num_requests_total{dp_rank="0"} 3.0\nsglang:num_requests_total{dp_rank="1"} 4.0\n'
                           'sglang:prompt_tokens_total{dp_rank="0"} 9000.0\nsglang:cached_tokens_total{dp_rank="0"} 4000.0\n'
                           'sglang:kv_transfer_latency_ms_sum 120.0\nsglang:kv_transfer_latency_ms_count 3.0\n'
                           'sglang:kv_transfer_total_mb_sum 1500.0\nsglang:kv_transfer_total_mb_count 3.0\n'
                           'sglang:queue_time_seconds_sum{dp_rank="0"} 0.5\nsglang:queue_time_seconds_count{dp_rank="0"} 5.0\n',
             "/b/metrics": "sglang:num_requests_total 2.0\n"}
    with metrics_server.serving(texts) as base:
        cluster = object.__new__(lc.SGLangCluster)
        cluster.prefills = [(base + "/a", 1), (base + "/b", 2), (base + "/gone", 3)]
        assert cluster.counts() == {base + "/a": (7.0, 9000.0, 4000.0, 120.0, 3.0, 1500.0, 0.5, 5.0),
                                    base + "/b": (2.0,) + (None,) * 7, base + "/gone": (None,) * 8}


def test_aggregate_takes_the_median_of_the_servers_evidence():
    runs = [{**_run(10, 100, 500, 0.5), "prefill_imbalance": imb, "prefill_queue_max": q} for imb, q in ((1.2, 4), (1.8, 9), (1.4, 5))]
    agg = lc.aggregate(runs + [_run(10, 100, 500, 0.5)])  # a result from before the sampling has neither
    assert agg["prefill_imbalance"] == {"median": 1.4, "min": 1.2, "max": 1.8} and agg["prefill_queue_max"]["median"] == 5
    assert lc.aggregate([_run(10, 100, 500, 0.5)])["prefill_imbalance"] is None


def test_load_parsed_from_sglang_and_simworker_metrics():
    sglang = "\n".join([
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
        "# TYPE sglang:num_queue_reqs gauge",
        'sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 3.0',
        'sglang:num_queue_reqs{dp_rank="1",model_name="m",tp_rank="0"} 2.0',
        'sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="0"} 7.0',
        'sglang:num_grammar_queue_reqs{model_name="m"} 50.0',  # another gauge whose name starts alike
    ])
    assert lc.parse_load(sglang) == lc.LoadSample(5.0, 7.0)  # summed over the DP ranks
    assert lc.parse_load("sglang:num_queue_reqs 1.0\n") is None  # no running gauge: missing, not idle
    assert lc.parse_load(None) is None
    # PD's own queues (waiting for the decode, for pages, for the KV) summed beside them
    pd = sglang + "\n" + "\n".join(['sglang:num_prefill_bootstrap_queue_reqs{dp_rank="0"} 2.0',
                                    'sglang:num_prefill_inflight_queue_reqs{dp_rank="0"} 1.0'])
    assert lc.parse_load(pd) == lc.LoadSample(5.0, 7.0, 3.0, (2.0, 1.0, None, None))
    load = lc.server_load([lc.LoadSample(1.0, 1.0, 3.0), lc.LoadSample(1.0, 1.0, 1.0), lc.LoadSample(0.0, 0.0)])
    assert (load["pd_queue_mean"], load["pd_queue_max"], load["load_mean"]) == (2.0, 3.0, 1.333)
    # each PD queue's own mean beside the sum: waiting for the decode's pages (bootstrap) apart from sending (inflight)
    parts = lc.server_load([lc.parse_load(pd), lc.LoadSample(0.0, 0.0, 4.0, (0.0, 4.0, None, None))])
    assert parts["pd_queue_parts_mean"] == {"bootstrap": 1.0, "inflight": 2.5} and parts["pd_queue_mean"] == 3.5
    from simworker import SimConfig, SimWorker

    w = SimWorker(SimConfig(role="prefill", dp_size=2))
    w.ranks[0].waiting_reqs, w.ranks[1].waiting_reqs, w.ranks[1].running_reqs = 4, 1, 2
    assert lc.parse_load(w.metrics_text()) == lc.LoadSample(5.0, 2.0)


def test_sampler_counts_failed_probes_as_missing_and_stops_with_the_run():
    import time

    def probe(url):
        if url == "bad":
            raise OSError("refused")
        return None if url == "silent" else lc.LoadSample(1.0, 0.0)

    with lc.LoadSampler(probe, ["ok", "bad", "silent"], interval=0.05) as s:
        time.sleep(0.3)
    n = {u: len(xs) for u, xs in s.samples.items()}
    assert all(3 <= k <= 8 for k in n.values()), n
    assert s.samples["bad"] == [None] * n["bad"] and s.samples["silent"] == [None] * n["silent"]
    time.sleep(0.15)
    assert {u: len(xs) for u, xs in s.samples.items()} == n  # nothing sampled after the run


def test_errors_in_flight_at_a_kill():
    def a(sent, e2e):
        return Answer(RequestRecord(False, None, e2e, 0, "x"), 10, 0, sent)

    kills = [2.0, 4.0]
    assert lc.in_flight_at(a(1.5, 1.0), kills)  # sent before the first kill, answered after it
    assert not lc.in_flight_at(a(0.5, 1.0), kills)  # over before any kill
    assert not lc.in_flight_at(a(2.5, 1.0), kills)  # sent after the first kill, over before the second
    assert lc.in_flight_at(a(3.9, 0.5), kills)


def _peer_args() -> list[str]:
    out = []
    if (PEERS / "sglr/bin/python").exists():
        out += ["--sglang-router-python", str(PEERS / "sglr/bin/python")]
    if (PEERS / "smg/bin/python").exists():
        out += ["--smg-python", str(PEERS / "smg/bin/python")]
    return out


@pytest.mark.serial  # kill times in seconds and a 30 s bound
def test_compare_end_to_end_against_simulated_workers(tmp_path):
    """The harness as the GPU host runs it, at small counts: 3 repetitions per LB in rotated order, two
    workloads, every LB at once through kill -9 and restart of a prefill and a decode, one JSON, a plot."""
    peers = _peer_args()
    lbs = ["ours:load_aware", "ours:prefix_aware"]
    if "--sglang-router-python" in peers:
        lbs.append("mini_lb")
    if "--smg-python" in peers:
        lbs.append("smg:cache_aware")
    out = tmp_path / "cmp.json"
    rc = lc.main(["--sim", "--sim-knobs", "--prefill-ms-per-token 0.02 --decode-ms-per-token 2 --prefix-cache-tokens 2000",
                  "--topology", "3p1d", "--out", str(out), "--logs", str(tmp_path / "logs"), "--lbs", ",".join(lbs), "--reps", "3",
                  "--workloads", "bursty_mixed,long_prefix", "--budget-s", str(30 * len(lbs)), "--max-run-s", "1.5", "--min-run-s", "1",
                  "--lb-start-s", "1", "--run-overhead-s", "0.5", "--warmup-s", "1", "--fault-s", "4", "--restart-s", "2",
                  "--bursty-rate", "16", "--long-rate", "3", "--long-prefix", "600", "--long-prefixes", "8", "--turn-gap", "0.4", *peers])
    doc = json.loads(out.read_text())
    assert rc == 0, doc.get("error")
    assert doc["topology"] == "3p1d" and doc["plan"]["workloads"] == ["bursty_mixed", "long_prefix"] and doc["plan"]["reps"] == 3
    assert [o[0] for o in doc["order"]] == lbs[:3] if len(lbs) >= 3 else True
    assert set(doc["aggregate"]) == set(lbs) and doc["skipped"] == {}
    for name in lbs:
        for wl in ("bursty_mixed", "long_prefix"):
            runs = doc["runs"][name][wl]
            assert len(runs) == 3 and sum(r["num_requests"] for r in runs) > 0
            assert sum(r["num_failed"] for r in runs) == 0, (name, wl, [r["errors"] for r in runs])
        assert doc["aggregate"][name]["bursty_mixed"]["ttft_ms_p99"]["min"] <= doc["aggregate"][name]["bursty_mixed"]["ttft_ms_p99"]["max"]
        for r in doc["runs"][name]["bursty_mixed"]:  # every answer counted once, cold or warm
            assert r["cold_requests"] + r["warm_requests"] == r["num_requests"] - r["num_failed"] and r["cold_s"] == lc.COLD_S
            assert sum(b[1] for b in r["ttft_timeline"]) == r["num_requests"] - r["num_failed"]
    assert any(doc["runs"][n]["long_prefix"][k]["cache_hit_rate"] for n in lbs for k in range(3))  # the sims' radix caches hit
    # ours left a decision log per repetition beside its log, a line per request it routed (the peers none)
    for name in ("ours-load_aware", "ours-prefix_aware"):
        for k in range(3):
            lines = (tmp_path / "logs" / f"lb-{name}-rep{k}-decisions.jsonl").read_bytes().splitlines()
            assert len(lines) >= sum(doc["runs"][name.replace("-", ":", 1)][wl][k]["num_requests"] for wl in ("bursty_mixed", "long_prefix"))
    # the servers' own load, sampled from every sim's /metrics during every run
    for name in lbs:
        for wl in ("bursty_mixed", "long_prefix"):
            for r in doc["runs"][name][wl]:
                load = r["server_load"]
                assert [len(load["prefill"]), len(load["decode"])] == [3, 1] and load["interval_s"] == 0.5
                assert all(x["samples"] > 0 and x["queue_max"] >= 0 and x["running_max"] >= 0 for x in load["prefill"] + load["decode"]), load
                assert r["prefill_imbalance"] >= 1.0 and r["decode_imbalance"] == 1.0 and r["prefill_queue_max"] >= 0
                # each sim's request counter: what every prefill took in the run adds up to what was sent there
                counts = r["prefill_counts"]
                assert len(counts) == 3 and len({c["url"] for c in counts}) == 3
                assert sum(c["requests"] for c in counts) == r["num_requests"]
                assert all(c["prompt_tokens"] is None for c in counts)  # the sims export no token counters
                assert 1 / 3 <= r["prefill_request_share_max"] <= 1.0
            agg = doc["aggregate"][name][wl]
            assert agg["prefill_imbalance"]["median"] >= 1.0 and agg["prefill_queue_max"]["median"] >= 0
    assert any(x["running_max"] > 0 for n in lbs for r in doc["runs"][n]["bursty_mixed"]
               for x in r["server_load"]["prefill"] + r["server_load"]["decode"])  # the sims report load, not only zeros
    assert {t["workload"] for t in doc["targets"]} <= {"bursty_mixed", "long_prefix"}
    f = doc["faults"]
    assert [(k["role"], k["index"]) for k in f["killed"]] == [("prefill", 0), ("decode", 0)] and len(f["restarted"]) == 2
    assert set(f["per_lb"]) == set(lbs)
    for name in ("ours:load_aware", "ours:prefix_aware"):
        lb = f["per_lb"][name]
        # only requests in flight on a killed worker may fail (the message names what failed, and when)
        assert lb["errors_beyond_in_flight"] == 0, (lb["errors"], lb["error_sent_at_s"], f["killed"])
        assert all(v is not None for v in lb["back_in_rotation_s"].values()), lb  # both restarted servers used again
    from e2e import plot_lb_compare

    plot_lb_compare.main([str(out), str(tmp_path / "cmp.png")])
    assert (tmp_path / "cmp.png").stat().st_size > 10_000


def test_sglang_servers_of_each_topology():
    class NoStack:
        servers: list = []

    flags = lc._with_max_tokens(lc.lb_real.FLAGS, 65536)
    assert flags[flags.index("--max-total-tokens") + 1] == "65536" and lc.lb_real.FLAGS[lc.lb_real.FLAGS.index("--max-total-tokens") + 1] == "131072"
    for topo, (n_p, n_d) in lc.TOPOLOGIES.items():
        for gpus, transport in ((1, "nccl"), (1, "cudaipc"), (4, "auto")):
            where = lc.lb_layout.placement(topo, gpus)
            c = lc.SGLangCluster(NoStack(), Path("/models/m"), where, flags, lc._with_max_tokens(flags, 262144), transport)
            assert len(c.prefills) == n_p and len(c.decodes) == n_d
            ports = [s.port for s in c.servers.values()] + [bp for _, bp in c.prefills]
            assert len(set(ports)) == len(ports)  # no two servers (or bootstrap servers) share a port
            for (role, i), s in c.servers.items():
                cmd = s.command()
                gpu = 0 if gpus == 1 else (i if role == "prefill" else n_p + i)
                assert cmd[cmd.index("--disaggregation-mode") + 1] == role and cmd[cmd.index("--base-gpu-id") + 1] == str(gpu)
                assert cmd[cmd.index("--max-total-tokens") + 1] == ("65536" if role == "prefill" else "262144")
                assert cmd[cmd.index("--model-path") + 1] == "/models/m"
                assert s.env["SGLANG_P2P_TRANSPORT"] == transport and (("NCCL_HOSTID" in s.env) == (transport == "nccl"))
    assert lc.servers_text(lc.lb_layout.placement("3p1d", 4)) == "prefill 0 on GPU 0, prefill 1 on GPU 1, prefill 2 on GPU 2, decode 0 on GPU 3"
    assert lc.servers_text(lc.lb_layout.placement("2p2d", 1)) == "2 prefill + 2 decode on GPU 0"
    assert config.with_flag(lc.lb_real.FLAGS, "--mem-fraction-static", "0.88")[lc.lb_real.FLAGS.index("--mem-fraction-static") + 1] == "0.88"
    with pytest.raises(ValueError, match="nccl, cudaipc or auto"):
        lc.transport_env("mooncake", "x")


def test_compare_starts_no_run_that_would_end_after_its_deadline(tmp_path):
    import time

    h = lc.Harness(cluster=None, peers={}, logs=tmp_path, wp=lc.WorkloadParams())
    doc: dict = {}
    h.compare([lc.LBSpec("ours", "load_aware")], lc.Plan(1.0, ("bursty_mixed",), 2), 0, doc, stop_at=time.monotonic() + 5, lb_run_s=10, log=lambda _: None)
    assert doc["cut_short"].startswith("out of time before rep 0: 10.0 s a repetition, ")
    assert doc["aggregate"] == {} and doc["targets"] == [] and doc["runs"] == {"ours:load_aware": {"bursty_mixed": []}}


class _StubProc:
    url = "http://127.0.0.1:1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_a_repetition_starts_only_when_every_lb_gets_its_turn(tmp_path, monkeypatch):
    """Runs that drain longer than planned: the first repetition's measured length stops the second before it
    starts, so both LBs keep one run each (medians over equal counts), instead of the first LB running again."""
    import time

    h = lc.Harness(cluster=None, peers={}, logs=tmp_path, wp=lc.WorkloadParams())
    monkeypatch.setattr(h, "_start_all", lambda specs, rep, skipped: [(s, _StubProc()) for s in specs])

    def slow_run(url, reqs):
        time.sleep(0.4)
        return {**_run(10, 100, 500, 0.5), "server_load": {"prefill": [], "decode": []}, "prefill_imbalance": None,
                "decode_imbalance": None}

    monkeypatch.setattr(h, "_run", slow_run)
    doc: dict = {}
    specs = [lc.LBSpec("ours", "load_aware"), lc.LBSpec("mini_lb", "")]
    # planned: 0.1 s an LB run, so rep 1 would look as if it fitted; measured: ~0.8 s a repetition
    h.compare(specs, lc.Plan(0.1, ("bursty_mixed",), 3), 0, doc, stop_at=time.monotonic() + 1.3, lb_run_s=0.1,
              rep_s_planned=0.2, log=lambda _: None)
    assert doc["cut_short"].startswith("out of time before rep 1: 0.8 s a repetition, ")
    assert {name: len(by["bursty_mixed"]) for name, by in doc["runs"].items()} == {"ours:load_aware": 1, "mini_lb": 1}


def test_medians_cover_only_the_repetitions_every_lb_completed():
    doc = {"runs": {"ours:prefix_aware": {"long_prefix": [_run(10, 100, 500, 0.9), _run(10, 300, 500, 0.9)]},
                    "mini_lb": {"long_prefix": [_run(10, 200, 500, 0.8), _run(10, 200, 500, 0.8), _run(10, 900, 500, 0.8)]}}}
    lc.summarize_compare(doc, ["long_prefix"])
    assert doc["reps_compared"] == {"long_prefix": 2}
    assert doc["aggregate"]["mini_lb"]["long_prefix"]["reps"] == 2  # its third run stays in `runs` only
    assert doc["aggregate"]["mini_lb"]["long_prefix"]["ttft_ms_p99"]["max"] == 200
    assert len(doc["runs"]["mini_lb"]["long_prefix"]) == 3


def test_chat_turns_ask_for_the_layouts_output_length():
    four = lc.WorkloadParams(**dict(lc.lb_layout.LAYOUTS[4].workload))
    for wl in ("shared_prefix", "long_prefix"):
        assert {r.max_new_tokens for r in lc.make_workload(wl, 5.0, 1, four)} == {8}
        assert {r.max_new_tokens for r in lc.make_workload(wl, 5.0, 1, lc.WorkloadParams())} == {32}


def test_an_lb_that_does_not_start_is_skipped_once_and_for_all(tmp_path):
    """A peer that exits at once is noted and not started again in later repetitions."""
    import time

    broken = {"smg": lc.Peer((sys.executable, "-c", "raise SystemExit(3)"))}
    h = lc.Harness(cluster=lc.SimCluster(1, 1, [], tmp_path), peers=broken, logs=tmp_path, wp=lc.WorkloadParams())
    doc: dict = {}
    t0 = time.monotonic()
    h.compare([lc.LBSpec("smg", "cache_aware")], lc.Plan(1.0, ("bursty_mixed",), 3), 0, doc, log=lambda _: None)
    assert doc["skipped"] == {"smg:cache_aware": "rep 0: LB exited with 3 before serving"}
    assert doc["runs"]["smg:cache_aware"]["bursty_mixed"] == [] and time.monotonic() - t0 < 30
    assert len(list(tmp_path.glob("lb-smg-cache_aware-rep*.log"))) == 1  # tried in rep 0 only


def test_fault_errors_split_before_and_after_the_restart(tmp_path):
    """3P1D: the one decode killed at 4 s. Until it is back, a request sent then fails for want of a decode;
    once the restart's time is known, one sent after it counts against the LB."""
    class ThreeOne:
        prefills = [("p0", 1), ("p1", 2), ("p2", 3)]
        decodes = ["d0"]

    def a(sent, e2e, ok=False):
        return Answer(RequestRecord(ok, 0.01 if ok else None, e2e, 4 if ok else 0, "" if ok else "x"), 10, 0, sent)

    answers = [a(1.9, 0.5), a(5.0, 0.1), a(1.0, 0.5, ok=True), a(0.5, 0.2)]
    h = lc.Harness(cluster=ThreeOne(), peers={}, logs=tmp_path, wp=lc.WorkloadParams())
    out: dict = {}
    h._split_errors(out, {"lb": (answers, 6.0)}, [2.0, 4.0], [("prefill", 0), ("decode", 0)], None)
    row = out["per_lb"]["lb"]
    assert out["no_server_of_a_role_s"] == [[4.0, None]]
    assert (row["client_errors"], row["errors_in_flight_at_a_kill"], row["errors_while_no_server_of_a_role"], row["errors_beyond_in_flight"]) == (3, 1, 1, 1)
    h._split_errors(out, {"lb": (answers, 6.0)}, [2.0, 4.0], [("prefill", 0), ("decode", 0)], 4.5)
    assert out["no_server_of_a_role_s"] == [[4.0, 4.5]]
    assert (row["errors_while_no_server_of_a_role"], row["errors_beyond_in_flight"]) == (0, 2)
