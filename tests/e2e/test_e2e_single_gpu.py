"""run_all.sh --gpus 1: which GPU, environment and flags every server of each step gets, checked on CPU."""
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from e2e import check, config, perf, report, results, sglang_tests
from e2e.servers import Server, launch_queues

REPO = Path(__file__).resolve().parents[2]
H200_MIB, H100_MIB = 143771, 81559


def _flag(args, name):
    return args[args.index(name) + 1]


def test_gpus_default_to_two_and_come_from_e2e_gpus(monkeypatch):
    monkeypatch.delenv("E2E_GPUS", raising=False)
    assert config.gpus_from_env() == 2
    monkeypatch.setenv("E2E_GPUS", "1")
    assert config.gpus_from_env() == 1
    monkeypatch.setenv("E2E_GPUS", "4")
    with pytest.raises(ValueError):
        config.gpus_from_env()


def test_one_gpu_pair_puts_both_servers_on_gpu0_and_p2pnccl_on_mooncake_tcp_in_perf(tmp_path):
    p, d, lb = config.pd_pair("m", tmp_path / "llama-tiny", "p2pnccl", 40000, config.CHECK_FLAGS, gpus=1, step="perf")
    assert _flag(p.command(), "--base-gpu-id") == _flag(d.command(), "--base-gpu-id") == "0"
    for s in (p, d):
        assert s.env["SGLANG_P2P_TRANSPORT"] == "mooncake" and s.env["MC_FORCE_TCP"] == "1"
        assert s.env["NCCL_NVLS_ENABLE"] == "0" and s.env["SGLANG_HOST_IP"] == "127.0.0.1"
    assert _flag(d.command(), "--disaggregation-transfer-backend") == "p2pnccl"
    assert _flag(lb.command(), "--decode") == d.url


def test_one_gpu_check_runs_p2pnccl_over_nccl_with_a_host_id_per_server(tmp_path, monkeypatch):
    monkeypatch.delenv("E2E_P2P_1GPU", raising=False)
    p, d, _ = config.pd_pair("m", tmp_path / "llama-tiny", "p2pnccl", 40000, config.CHECK_FLAGS, gpus=1)
    assert p.env["SGLANG_P2P_TRANSPORT"] == d.env["SGLANG_P2P_TRANSPORT"] == "nccl"
    assert p.env["NCCL_HOSTID"] != d.env["NCCL_HOSTID"] and p.env["NCCL_SOCKET_IFNAME"] == "lo"
    assert config.transport_info("p2pnccl", 1)["transport"] == "nccl"
    monkeypatch.setenv("E2E_P2P_1GPU", "nccl")  # SGLang's tests: one environment, a host id per server process
    assert config.backend_env("p2pnccl", 1, "sglang_tests")["SGLANG_P2P_ONE_GPU_NCCL"] == "1"
    monkeypatch.setenv("E2E_P2P_1GPU", "mooncake")
    p, d, _ = config.pd_pair("m", tmp_path / "llama-tiny", "p2pnccl", 40000, config.CHECK_FLAGS, gpus=1)
    assert p.env["SGLANG_P2P_TRANSPORT"] == "mooncake" and "NCCL_HOSTID" not in p.env
    monkeypatch.setenv("E2E_P2P_1GPU", "cudaipc")  # the same-host path: two processes on one GPU share pools
    p, d, _ = config.pd_pair("m", tmp_path / "llama-tiny", "p2pnccl", 40000, config.CHECK_FLAGS, gpus=1)
    assert p.env["SGLANG_P2P_TRANSPORT"] == d.env["SGLANG_P2P_TRANSPORT"] == "cudaipc" and "NCCL_HOSTID" not in p.env
    assert config.transport_info("p2pnccl", 1)["transport"] == "cudaipc"


def test_one_gpu_mooncake_runs_on_tcp_without_the_nvlink_settings(tmp_path):
    p, d, _ = config.pd_pair("m", tmp_path / "x", "mooncake", 40100, config.PERF_FLAGS, gpus=1)
    for s in (p, d):
        assert s.gpu == 0 and s.env["MC_FORCE_TCP"] == "1"
        assert "SGLANG_MOONCAKE_CUSTOM_MEM_POOL" not in s.env and "MC_INTRANODE_NVLINK" not in s.env
        assert "SGLANG_P2P_TRANSPORT" not in s.env


def test_two_gpu_mapping_is_unchanged(tmp_path):
    p, d, _ = config.pd_pair("m", tmp_path / "x", "p2pnccl", 40000, config.CHECK_FLAGS)
    assert (p.gpu, d.gpu) == (0, 1) and p.env["SGLANG_P2P_TRANSPORT"] == "auto" and "MC_FORCE_TCP" not in p.env
    assert config.transport_info("p2pnccl", 2)["transport"] == "cudaipc"  # auto: the same-host path
    assert config.transport_info("mooncake", 2)["protocol"] == "nvlink_intra"
    assert config.perf_flags(2) == config.PERF_FLAGS


def test_transport_info_names_mooncake_tcp_and_its_env_on_one_gpu():
    t = config.transport_info("p2pnccl", 1, "perf")
    assert (t["transport"], t["protocol"]) == ("mooncake", "tcp")
    assert t["env"] == {"SGLANG_P2P_TRANSPORT": "mooncake", "MC_FORCE_TCP": "1"}
    assert config.transport_info("mooncake", 1)["env"] == {"MC_FORCE_TCP": "1"}


@pytest.mark.parametrize("mib,tokens", [(H200_MIB, "280000"), (H100_MIB, "200000"), (None, "200000")])
def test_one_gpu_perf_flags_cap_the_pool_by_gpu_size(mib, tokens):
    flags = config.perf_flags(1, mib)
    assert _flag(flags, "--max-total-tokens") == tokens and _flag(flags, "--mem-fraction-static") == "0.6"
    assert flags[: len(config.BASE_FLAGS)] == config.BASE_FLAGS
    # the arithmetic of config.py: a pair of llama-anchor servers (128 KiB a token) leaves room on the GPU
    kv_gib = int(tokens) * 128 / 2**20
    gpu_gib = (mib or H100_MIB) / 1024
    assert 2 * (kv_gib + 3) < 0.8 * gpu_gib
    free_for_decode = gpu_gib - 1.5 - kv_gib - 3  # after the prefill took its pool, context and weights
    assert 0.6 * free_for_decode > kv_gib + 1


def test_gpu_mem_mib_reads_run_all_override(monkeypatch):
    monkeypatch.setenv("E2E_GPU_MEM_MIB", str(H200_MIB))
    assert config.gpu_mem_mib() == H200_MIB


def test_launch_lanes_deal_one_gpu_round_robin_and_keep_per_gpu_queues():
    servers = [Server(f"s{i}", 1000 + i, "null", gpu=0) for i in range(6)]
    assert [[s.name for s in q] for q in launch_queues(servers, 3)] == [["s0", "s3"], ["s1", "s4"], ["s2", "s5"]]
    assert [[s.name for s in q] for q in launch_queues(servers)] == [[s.name for s in servers]]
    two = [Server("a", 1, "null", gpu=0), Server("b", 2, "null", gpu=1), Server("c", 3, "null", gpu=0)]
    assert [[s.name for s in q] for q in launch_queues(two)] == [["a", "c"], ["b"]]


class FakeStack:
    """Stands in for servers.Stack: records what would start, and every SGLang server 'fails to start'."""

    launches: list = []

    def __init__(self, logs):
        self.logs = logs

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def launch(self, servers, timeout_s=0, lanes=1):
        FakeStack.launches.append((list(servers), lanes))
        for s in servers:
            s.error = "fake: not started"
        return []

    def launch_lb(self, lb):
        return False


@pytest.fixture
def fake_stack(monkeypatch):
    FakeStack.launches = []
    monkeypatch.setattr(check, "Stack", FakeStack)
    monkeypatch.setattr(perf, "Stack", FakeStack)
    return FakeStack


def test_check_on_one_gpu_starts_everything_on_gpu0_in_three_lanes_and_says_so(tmp_path, fake_stack):
    res = check.run(tmp_path / "models", tmp_path / "logs", ["llama-tiny", "mla-tiny"], 0.02, gpus=1)
    [(servers, lanes)] = fake_stack.launches
    assert lanes == config.CHECK_LANES_1GPU and len(servers) == 6 and {s.gpu for s in servers} == {0}
    pd = [s for s in servers if s.mode in ("prefill", "decode")]
    assert {s.env["SGLANG_P2P_TRANSPORT"] for s in pd} == {"nccl"}  # over loopback sockets, a host id each
    for model in ("llama-tiny", "mla-tiny"):  # the two ends of a pair must look like two hosts to NCCL
        ends = [s for s in pd if s.name.startswith(model)]
        assert len({s.env["NCCL_HOSTID"] for s in ends}) == 2, ends
    assert all(s.args == config.CHECK_FLAGS for s in servers)  # reference and P/D keep identical flags
    assert res["gpus"] == 1 and res["note"] == config.SINGLE_GPU_NOTE
    assert res["transport"]["transport"] == "nccl" and "loopback" in res["transport"]["protocol"]
    assert {m["status"] for m in res["models"].values()} == {"servers_failed"}


def test_check_of_the_hybrid_swa_model_alone_gives_its_servers_its_flags_on_one_gpu(tmp_path, fake_stack):
    """E2E_CHECK_ONLY=swa-tiny: its three servers only, each with CHECK_FLAGS plus the MoE runner it
    needs (identical on the reference and P/D); the default check still runs without it."""
    res = check.run(tmp_path / "models", tmp_path / "logs", ["swa-tiny"], 0.02, gpus=1)
    [(servers, _)] = fake_stack.launches
    assert sorted(s.mode for s in servers) == ["decode", "null", "prefill"] and {s.gpu for s in servers} == {0}
    assert all(s.args == [*config.CHECK_FLAGS, "--moe-runner-backend", "triton"] for s in servers)
    assert _flag(servers[0].args, "--attention-backend") == "triton"  # has sinks and the sliding window
    assert res["flags_by_model"] == {"swa-tiny": config.check_flags("swa-tiny")}
    assert "swa-tiny" not in check.MODELS and check.BASE_PORT["swa-tiny"] not in {check.BASE_PORT[m] for m in check.MODELS}


def test_run_all_check_builds_the_models_it_checks():
    text = (REPO / "e2e/run_all.sh").read_text()
    assert 'make_tiny_models "$MODELS" --only "${E2E_CHECK_ONLY:-llama-tiny,mla-tiny}"' in text


def test_check_on_two_gpus_keeps_references_spread_and_one_lane(tmp_path, fake_stack):
    check.run(tmp_path / "models", tmp_path / "logs", ["llama-tiny", "mla-tiny"], 0.02)
    [(servers, lanes)] = fake_stack.launches
    assert lanes == 1
    assert {s.name: s.gpu for s in servers if s.mode == "null"} == {"llama-tiny-reference": 0, "mla-tiny-reference": 1}
    assert {s.gpu for s in servers if s.mode == "decode"} == {1}


def test_perf_on_one_gpu_runs_the_pairs_one_after_the_other(tmp_path, fake_stack, monkeypatch):
    monkeypatch.setenv("E2E_GPU_MEM_MIB", str(H200_MIB))
    res = perf.run(tmp_path, tmp_path / "logs", ["p2pnccl", "mooncake"], None, time.monotonic() + 600, gpus=1)
    assert [[s.name for s in servers] for servers, _ in fake_stack.launches] == [
        ["llama-anchor-p2pnccl-prefill", "llama-anchor-p2pnccl-decode"],
        ["llama-anchor-mooncake-prefill", "llama-anchor-mooncake-decode"]]
    assert {s.gpu for servers, _ in fake_stack.launches for s in servers} == {0}
    assert _flag(res["flags"], "--max-total-tokens") == "280000" and res["gpus"] == 1
    assert res["transports"]["p2pnccl"]["env"]["SGLANG_P2P_TRANSPORT"] == "mooncake"
    assert res["transports"]["mooncake"]["protocol"] == "tcp" and config.SINGLE_GPU_NOTE in res["note"]
    assert res["genai_bench"]["status"] == "skipped"


def test_perf_on_two_gpus_starts_both_pairs_together(tmp_path, fake_stack):
    res = perf.run(tmp_path, tmp_path / "logs", ["p2pnccl", "mooncake"], None, time.monotonic() + 600)
    [(servers, _)] = fake_stack.launches
    assert [s.gpu for s in servers] == [0, 1, 0, 1] and res["flags"] == config.PERF_FLAGS


def _done(backend):
    return {"backend": backend, "prompt_tokens": 1024, "concurrency": 1, "ttft_ms_p50": 1.0}


def test_perf_on_one_gpu_keeps_a_backend_an_earlier_call_finished(tmp_path, fake_stack, monkeypatch):
    monkeypatch.setenv("E2E_GPU_MEM_MIB", str(H200_MIB))
    flags = config.perf_flags(1, H200_MIB)
    previous = {"gpus": 1, "flags": flags, "backends": {"p2pnccl": {"status": "ok"}, "mooncake": {"status": "ok"}},
                "runs": [_done("p2pnccl"), {**_done("mooncake"), "skipped": "deadline"}]}
    res = perf.run(tmp_path, tmp_path / "logs", ["p2pnccl", "mooncake"], None, time.monotonic() + 600,
                   gpus=1, previous=previous)
    assert [[s.name for s in servers] for servers, _ in fake_stack.launches] == [
        ["llama-anchor-mooncake-prefill", "llama-anchor-mooncake-decode"]]
    assert res["backends"]["p2pnccl"] == {"status": "ok", "from_earlier_call": True}
    assert [r["backend"] for r in res["runs"]] == ["p2pnccl"]
    # other flags (another GPU size) or a two-GPU file: nothing is kept
    assert perf.done_backends({**previous, "flags": config.perf_flags(1, H100_MIB)}, flags) == {}
    assert perf.done_backends({**previous, "gpus": 2}, flags) == {}


def test_perf_on_one_gpu_without_time_for_a_pair_says_to_run_again(tmp_path, fake_stack):
    res = perf.run(tmp_path, tmp_path / "logs", ["p2pnccl", "mooncake"], None, time.monotonic() + 30, gpus=1)
    assert fake_stack.launches == []
    assert {b["status"] for b in res["backends"].values()} == {"not_run"}
    assert "--phase perf again" in res["backends"]["mooncake"]["reason"]


def test_sglang_tests_on_one_gpu_move_decode_to_gpu0_and_cap_the_pools(tmp_path):
    env = sglang_tests.test_env(tmp_path / "llama-tiny", gpus=1)
    assert env["SGLANG_P2P_TRANSPORT"] == "mooncake" and env["MC_FORCE_TCP"] == "1"
    extra = shlex.split(env["E2E_TEST_EXTRA_ARGS"])
    # appended after the fixture's own "--base-gpu-id 1": argparse keeps the last value
    assert extra[-4:] == ["--base-gpu-id", "0", "--max-total-tokens", "131072"]
    assert shlex.split(sglang_tests.test_env(tmp_path / "m")["E2E_TEST_EXTRA_ARGS"]) == sglang_tests.EXTRA_ARGS


def test_sglang_tests_on_one_gpu_without_mooncake_are_skipped_with_the_reason_not_passed(tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_tests, "mooncake_importable", lambda: False)
    root = tmp_path / "sgl"
    for rel, _ in sglang_tests.TEST_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    res = sglang_tests.run(root, tmp_path / "llama-tiny", tmp_path / "logs", time.monotonic() + 600, gpus=1)
    assert {f["rc"] for f in res["files"]} == {"skipped"}
    assert res["summary"]["skipped"] == len(sglang_tests.TEST_FILES) and res["summary"]["passed"] == 0
    assert "Mooncake is not importable" in res["files"][0]["tests"][0]["message"]
    assert res["gpus"] == 1 and res["extra_server_args"][-2:] == ["--max-total-tokens", "131072"]


def test_sglang_tests_results_of_the_other_gpu_mode_are_not_kept():
    previous = {"gpus": 2, "files": [{"file": "a.py", "tests": [{"outcome": "passed"}]}]}
    assert sglang_tests.already_run(previous, gpus=1) == {}
    assert "a.py" in sglang_tests.already_run(previous, gpus=2)
    assert "a.py" in sglang_tests.already_run({"files": previous["files"]})  # files from before --gpus: two GPUs


def test_report_says_plainly_it_was_one_gpu_and_names_the_transports():
    check_res = {"backend": "p2pnccl", "gpus": 1, "transport": config.transport_info("p2pnccl", 1), "models": {}}
    perf_res = {"model": "llama-anchor", "gpus": 1, "note": config.SINGLE_GPU_NOTE + "; pairs one after the other",
                "transports": {b: config.transport_info(b, 1, "perf") for b in ("p2pnccl", "mooncake")},
                "backends": {"mooncake": {"status": "not_run", "reason": "no time left"}}, "runs": []}
    doc = results.merge({"kind": "nvidia-h200"}, {"check": check_res, "perf": perf_res})
    assert doc["gpus"] == 1
    md = report.render(doc)
    assert md.startswith("## End-to-end on one GPU")
    assert config.SINGLE_GPU_NOTE in md and "NCCL's socket transport on loopback" in md
    assert ("Transports: check p2pnccl: nccl (socket transport on loopback (one GPU, NCCL_HOSTID per server)), "
            "SGLANG_P2P_TRANSPORT=nccl NCCL_SOCKET_IFNAME=lo; perf p2pnccl: mooncake (tcp), "
            "SGLANG_P2P_TRANSPORT=mooncake MC_FORCE_TCP=1; perf mooncake: mooncake (tcp), MC_FORCE_TCP=1.") in md
    assert "`perf mooncake`: not run: no time left" in md


def test_report_of_a_two_gpu_file_keeps_its_title():
    md = report.render(results.merge({}, {"check": {"models": {}}}))
    assert md.startswith("## End-to-end on two GPUs") and "one GPU" not in md


def _run_all(*args, tmp_path, env_extra=None):
    env = {**os.environ, "E2E_ROOT": str(tmp_path / "root"), "E2E_BUNDLE": str(tmp_path / "none"), **(env_extra or {})}
    return subprocess.run(["bash", str(REPO / "e2e/run_all.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_run_all_rejects_a_gpu_count_it_has_no_layout_for(tmp_path):
    p = _run_all("--gpus", "3", tmp_path=tmp_path)
    assert p.returncode == 2 and "--gpus must be 1, 2 or 4" in p.stderr
    p = _run_all(tmp_path=tmp_path, env_extra={"E2E_GPUS": "8"})
    assert p.returncode == 2
    p = _run_all("--phase", "shapes", tmp_path=tmp_path)  # the miniatures need the 4-GPU host
    assert p.returncode == 2 and "--phase shapes needs a 4-GPU host (--gpus 4)" in p.stderr


def test_run_all_unpack_phase_needs_no_sglang_bundle(tmp_path):
    p = _run_all("--phase", "unpack", tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    p = _run_all("--gpus", "1", "--phase", "mooncake-bench", tmp_path=tmp_path)
    assert p.returncode == 3 and "carry .bundle/sglang.tar.xz" in p.stderr


def test_run_all_help_documents_single_gpu_mode():
    p = subprocess.run(["bash", str(REPO / "e2e/run_all.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert "--gpus 1" in p.stdout and "mooncake-bench" in p.stdout


def test_results_json_of_one_gpu_steps_round_trips(tmp_path):
    (tmp_path / "check.json").write_text(json.dumps({"gpus": 1, "models": {}}))
    (tmp_path / "perf.json").write_text(json.dumps({"gpus": 1, "runs": []}))
    assert results.merge({}, results.load_steps(tmp_path))["gpus"] == 1


def test_a_one_gpu_call_whose_steps_did_not_run_still_reports_one_gpu(tmp_path):
    """run_all.sh passes --gpus to e2e.results: a call that ran no step (no Mooncake) still says one GPU."""
    out = tmp_path / "r.json"
    assert results.main(["--state", str(tmp_path), "--machine-json", str(tmp_path / "m.json"), "--out", str(out),
                         "--gpus", "1"]) == 0
    doc = json.loads(out.read_text())
    assert doc["gpus"] == 1 and report.render(doc).startswith("## End-to-end on one GPU")
    assert "gpus" not in results.merge({}, {})
