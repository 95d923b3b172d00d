"""The Python parts of e2e/lb_real.py (the real multi-instance LB run) on CPU: workloads, summary, the
open-loop client against fake SGLang servers, and the LB command line it builds."""
import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from e2e import lb_real  # noqa: E402
from e2e.servers import Server  # noqa: E402
from e2e.stats import RequestRecord  # noqa: E402
from sglang_p2p_backend.testing.launch import free_port  # noqa: E402

FAKE = Path(__file__).with_name("fake_sglang.py")


def test_workloads_are_seeded_bursty_and_share_prefixes():
    a, b = lb_real.bursty_mixed(20, 16.0, seed=3), lb_real.bursty_mixed(20, 16.0, seed=3)
    assert a == b and 200 < len(a) < 450  # ~16 req/s on average
    assert all(0 <= r.at < 20 and lb_real.VOCAB_LOW <= min(r.input_ids) and max(r.input_ids) < lb_real.VOCAB_HIGH for r in a)
    burst = sum(1 for r in a if r.at % 4 >= 3)
    assert burst > 0.35 * len(a)  # a quarter of the time carries half the requests
    assert any(len(r.input_ids) >= 2000 for r in a) and any(len(r.input_ids) < 600 for r in a)
    assert {r.max_new_tokens for r in a} <= set(range(16, 65)) and a == lb_real.bursty_mixed(20, 16.0, seed=3, output_max=64)
    short = lb_real.bursty_mixed(20, 16.0, seed=3, output_max=8)  # what a 3P1D run asks so that its decode keeps up
    assert {r.max_new_tokens for r in short} == set(range(2, 9))
    chats = lb_real.shared_prefix(20, 3.0, seed=1)
    assert [r.at for r in chats] == sorted(r.at for r in chats)
    heads = {tuple(r.input_ids[:2000]) for r in chats}
    assert len(heads) <= 6 and len(chats) > 5 * len(heads)
    # a later turn resends the earlier one as its prefix
    head = next(iter(heads))
    by_head = sorted((r for r in chats if tuple(r.input_ids[:2000]) == head), key=lambda r: len(r.input_ids))
    assert any(r2.input_ids[: len(r1.input_ids)] == r1.input_ids for r1 in by_head for r2 in by_head if len(r2.input_ids) > len(r1.input_ids))


def test_summary_counts_hits_errors_and_p99():
    ok = [lb_real.Answer(RequestRecord(True, 0.01 * (i + 1), 0.1 * (i + 1), 10), 100, 40, i) for i in range(10)]
    bad = [lb_real.Answer(RequestRecord(False, None, 0.5, 0, "HTTP 502: x"), 100, 0, 3.0)]
    s = lb_real.summarize(ok + bad, 2.0)
    assert s["num_requests"] == 11 and s["num_failed"] == 1 and s["errors"] == ["HTTP 502: x"]
    assert s["cache_hit_rate"] == 0.4 and s["prompt_tokens"] == 1000
    assert s["output_throughput"] == 50.0 and abs(s["e2e_ms_p99"] - 991.0) < 1e-6 and s["ttft_ms_p50"] == 55.0


def test_open_loop_against_fake_sglang_reads_cached_tokens():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        reqs = lb_real.shared_prefix(3.0, 4.0, seed=2, prefix_len=64, question=8, answer=4, gap=0.5)
        answers, wall = asyncio.run(lb_real.open_loop(url, reqs))
        s = lb_real.summarize(answers, wall)
        assert s["num_requests"] == len(reqs) and s["num_failed"] == 0
        assert s["output_tokens"] == 32 * len(reqs)
        assert 0 < s["cache_hit_rate"] < 1  # repeats of a prefix came back with cached tokens
        assert wall >= max(r.at for r in reqs)  # open loop: sent on schedule, not back to back
        # an unreachable LB is a counted error, not an exception
        bad, _ = asyncio.run(lb_real.open_loop(f"http://127.0.0.1:{free_port()}", reqs[:2]))
        assert all(not a.record.ok and a.record.error for a in bad)
    finally:
        proc.terminate()
        proc.wait(10)


def test_lb_command_covers_every_pair_and_parses():
    from sglang_p2p_lb import cli

    ps = [Server(f"p{i}", 33000 + i, "prefill", bootstrap_port=33010 + i) for i in range(2)]
    ds = [Server(f"d{i}", 33002 + i, "decode") for i in range(2)]
    argv = lb_real.lb_server("prefix_aware", 33020, ps, ds, "k").command()
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv[3:]))
    assert cfg.prefills == [("http://127.0.0.1:33000", 33010), ("http://127.0.0.1:33001", 33011)]
    assert cfg.decodes == ["http://127.0.0.1:33002", "http://127.0.0.1:33003"]
    assert cfg.policy == "prefix_aware" and cfg.auth.admin_keys and cfg.host == "127.0.0.1"
