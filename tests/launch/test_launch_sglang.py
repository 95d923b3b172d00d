"""Every rendered server command of every shipped config against SGLang's own argument parser, with the
p2pnccl plugin loaded through SGLang's plugin loader (runs against each supported SGLang release), and
configs SGLang would reject stopped with an actionable message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch_cases import REPO, TOPOLOGIES, variant  # noqa: F401  (variant is a fixture)
from sglang_p2p_backend.launch import cli
from sglang_p2p_backend.launch.config import ConfigError, load_config
from sglang_p2p_backend.launch.release import installed_release
from sglang_p2p_backend.launch.render import server_command, topology_commands
from sglang_p2p_backend.launch.sglang_parser import checker

pytestmark = pytest.mark.sglang

RELEASE = installed_release()


def server_commands(path):
    return [c for c in topology_commands(load_config(path), RELEASE) if "sglang.launch_server" in c.program]


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda p: p.stem)
def test_every_rendered_command_is_accepted(topology):
    chk = checker()
    assert chk.release == RELEASE
    commands = server_commands(topology)
    assert commands
    for cmd in commands:
        assert chk.problems(cmd) == [], cmd.shell()
        ns = chk.parser.parse_args(list(cmd.args))
        # what SGLang will run with, read back from its own namespace
        assert ns.disaggregation_transfer_backend == "p2pnccl"
        assert ns.disaggregation_mode in ("prefill", "decode")


def test_parsed_values_match_the_topology():
    cfg = load_config(REPO / "configs/topologies/p3x3-d4.yaml")
    ns = checker().parser.parse_args(list(server_command(cfg, cfg.group_nodes("decode", 0)[1], RELEASE).args))
    assert (ns.tp_size, ns.nnodes, ns.node_rank, ns.dist_init_addr) == (32, 4, 1, "10.10.0.10:5757")
    assert ns.moe_a2a_backend == "deepep" and ns.deepep_mode == "low_latency"
    assert ns.cuda_graph_bs_decode == [256] and ns.max_running_requests == 8192
    if RELEASE == "0.5.17":
        assert (ns.dp_size, ns.enable_dp_attention) == (32, True)
    else:
        assert (ns.attn_dp_size, ns.dp_size) == (32, 1)


def rejected(variant, args: dict) -> str:
    path = variant("p2-d2", lambda d: d["decode"].__setitem__("args", args))
    with pytest.raises(ConfigError) as info:
        checker().check(server_commands(path), str(path))
    decode_problems = [p for p in info.value.problems if p.startswith("decode")]
    assert len(decode_problems) == len(info.value.problems) == 2  # both decode nodes, no prefill node
    return decode_problems[0]


def test_unknown_old_flag_names_its_current_form(variant):
    msg = rejected(variant, {"enable-deepep-moe": True})
    assert f"unknown flag `--enable-deepep-moe` for SGLang {RELEASE}" in msg
    assert "moe-a2a-backend: deepep" in msg


def test_misspelled_flag(variant):
    msg = rejected(variant, {"enable-two-batch-overlapp": True})
    assert "unknown flag `--enable-two-batch-overlapp`" in msg and "spelling" in msg


def test_abbreviated_flag_is_rejected(variant):
    msg = rejected(variant, {"mem-fraction": 0.8})
    assert "unknown flag `--mem-fraction`" in msg and "only abbreviates --mem-fraction-static" in msg


def test_deprecated_flag_is_rejected(variant):
    msg = rejected(variant, {"disable-cuda-graph": True})
    assert "`--disable-cuda-graph` is deprecated" in msg and "cuda-graph-backend-decode: disabled" in msg


def test_bad_value_is_rejected_with_sglangs_reason(variant):
    msg = rejected(variant, {"deepep-mode": "fast"})
    assert "rejects the command" in msg and "invalid choice: 'fast'" in msg


def test_node_command_stops_on_an_unknown_flag_before_exec(variant, monkeypatch, capsys):
    monkeypatch.setattr(cli.os, "execvpe", lambda *a: pytest.fail("a broken config must not start anything"))
    path = variant("p2-d2", lambda d: d["decode"].__setitem__("args", {"enable-deepep-moe": True}))
    # rank 0 is a prefill node: it must still refuse, so no half of the topology starts
    assert cli.run(["node", "--config", str(path), "--rank", "0"], {}) == cli.EXIT_CONFIG
    assert "unknown flag `--enable-deepep-moe`" in capsys.readouterr().err


def test_sglang_environment_names_exist_in_this_release():
    from sglang.srt import environ

    import sglang

    src = os.path.dirname(sglang.__file__)
    names = {k for p in TOPOLOGIES for c in topology_commands(load_config(p), RELEASE) for k in c.env}
    ours = {n for n in names if n.startswith("SGLANG_P2P_")}
    theirs = sorted(n for n in names if n.startswith("SGLANG_") and n not in ours)
    assert "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK" in theirs
    missing = [n for n in theirs if not hasattr(environ.Envs, n) and not _in_source(src, n)]
    assert missing == [], f"SGLang {RELEASE} reads none of {missing}"


def _in_source(root: str, name: str) -> bool:
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py") and name in open(os.path.join(dirpath, f), errors="ignore").read():
                return True
    return False


def test_fresh_process_with_sglangs_plugin_loader_accepts_the_commands():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_p2p_backend.launch", "check", "--config",
         str(REPO / "configs/topologies/p3x3-d4.yaml")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"accepted by SGLang {RELEASE}'s parser with the p2pnccl plugin loaded" in proc.stdout
