"""Command lines, plugin discovery files and the shell entry points of the GPU check, checked on CPU."""
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from e2e import config, distinfo
from e2e.servers import Server

REPO = Path(__file__).resolve().parents[2]


def test_pd_pair_commands_carry_backend_bootstrap_gpu_and_env(tmp_path):
    p, d, lb = config.pd_pair("m", tmp_path / "llama-tiny", "p2pnccl", 40000, config.CHECK_FLAGS)
    pc, dc, lc = p.command(), d.command(), lb.command()
    assert pc[1:3] == ["-m", "sglang.launch_server"]
    assert pc[pc.index("--disaggregation-mode") + 1] == "prefill"
    assert pc[pc.index("--disaggregation-bootstrap-port") + 1] == "40003"
    assert dc[dc.index("--base-gpu-id") + 1] == "1" and "--disaggregation-bootstrap-port" not in dc
    assert dc[dc.index("--disaggregation-transfer-backend") + 1] == "p2pnccl"
    assert lc[lc.index("--prefill") + 1: lc.index("--prefill") + 3] == ["http://127.0.0.1:40000", "40003"]
    assert lc[lc.index("--decode") + 1] == "http://127.0.0.1:40001"
    assert p.env["SGLANG_P2P_TRANSPORT"] == "auto" and p.env["NCCL_NVLS_ENABLE"] == "0"
    mp, _, _ = config.pd_pair("m", tmp_path / "x", "mooncake", 40100, config.PERF_FLAGS)
    assert mp.env["SGLANG_MOONCAKE_CUSTOM_MEM_POOL"] == "INTRA_NODE_NVLINK" and mp.env["MC_INTRANODE_NVLINK"] == "true"


def test_reference_server_is_not_disaggregated(tmp_path):
    cmd = config.reference("m", tmp_path / "llama-tiny", 40010, 1, config.CHECK_FLAGS).command()
    assert "--disaggregation-mode" not in cmd and cmd[cmd.index("--base-gpu-id") + 1] == "1"
    assert cmd[cmd.index("--served-model-name") + 1] == "llama-tiny"


def test_dist_info_makes_the_entry_point_discoverable(tmp_path):
    folder = distinfo.write(tmp_path)
    assert folder.name == "sglang_p2p_backend-0.1.0.dist-info"
    dists = [d for d in metadata.distributions(path=[str(tmp_path)])]
    eps = {(e.group, e.name): e.value for d in dists for e in d.entry_points}
    assert eps[("sglang.srt.plugins", "p2pnccl")] == "sglang_p2p_backend.plugin:load"
    assert dists[0].version == "0.1.0"


@pytest.mark.parametrize("script", ["e2e/run_all.sh", "e2e/build_bundle.sh"])
def test_shell_scripts_parse_and_pass_shellcheck(script):
    subprocess.run(["bash", "-n", str(REPO / script)], check=True)
    sc = shutil.which("shellcheck") or (REPO / ".venv/bin/shellcheck")
    if not Path(sc).exists():
        pytest.skip("shellcheck not installed")
    subprocess.run([str(sc), str(REPO / script)], check=True)


def test_run_all_without_a_bundle_says_what_to_carry(tmp_path):
    env = {**os.environ, "E2E_ROOT": str(tmp_path / "root"), "E2E_BUNDLE": str(tmp_path / "none")}
    p = subprocess.run(["bash", str(REPO / "e2e/run_all.sh"), "--phase", "check"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 3 and "carry .bundle/sglang.tar.xz" in p.stderr


def test_run_all_rejects_an_unknown_phase():
    p = subprocess.run(["bash", str(REPO / "e2e/run_all.sh"), "--phase", "nope"], capture_output=True, text=True)
    assert p.returncode == 2 and "--phase must be" in p.stderr


def test_sglang_router_shim_runs_our_lb():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "e2e/shims"), str(REPO / "lb"), str(REPO)])}
    p = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode == 0 and "--prefill" in p.stdout and "load_aware" in p.stdout
