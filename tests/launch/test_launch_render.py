"""Rendering of the shipped topologies: exact flags of server and LB commands, per-release spelling,
scaling of per-rank values, node identity, and what the node/lb commands hand to exec. No SGLang needed."""

from __future__ import annotations

import pytest

from sglang_p2p_backend.launch import cli
from sglang_p2p_backend.launch.config import load_config
from sglang_p2p_backend.launch.identity import resolve_node
from sglang_p2p_backend.launch.render import dry_run_text, lb_command, server_command, topology_commands
from sglang_p2p_backend.launch.validate import validate

from launch_cases import EXPECTED_TOPOLOGIES, REPO, TOPOLOGIES, flags

P3X3 = REPO / "configs/topologies/p3x3-d4.yaml"


def test_every_required_topology_ships_and_validates():
    assert {p.stem for p in TOPOLOGIES} == EXPECTED_TOPOLOGIES
    for path in TOPOLOGIES:
        validate(load_config(path))


@pytest.mark.parametrize(
    "name,groups",
    [("p3x3-d4", [(3, 3, 24), (1, 4, 32)]), ("p3x2-d4", [(3, 2, 16), (1, 4, 32)]), ("p4x2-d4", [(4, 2, 16), (1, 4, 32)]),
     ("p4-d6", [(1, 4, 32), (1, 6, 48)]), ("p4-d9", [(1, 4, 32), (1, 9, 72)]), ("p2-d2", [(1, 2, 16), (1, 2, 16)])],
)
def test_topology_shapes(name, groups):
    cfg = load_config(REPO / f"configs/topologies/{name}.yaml")
    for spec, (n_groups, nodes, tp) in zip((cfg.prefill, cfg.decode), groups):
        assert (spec.groups, spec.nodes, spec.tp) == (n_groups, nodes, tp)


def test_prefill_node_command_p3x3_second_group_last_node():
    cfg = load_config(P3X3)
    node = cfg.group_nodes("prefill", 1)[2]
    cmd = server_command(cfg, node, "0.5.23")
    f = flags(cmd.args)
    assert cmd.program == ("python3", "-m", "sglang.launch_server")
    assert f["--disaggregation-mode"] == ["prefill"]
    assert f["--disaggregation-transfer-backend"] == ["p2pnccl"]
    assert f["--dist-init-addr"] == ["10.10.0.4:5757"]  # group 1's node 0, not the node itself
    assert (f["--nnodes"], f["--node-rank"], f["--tp-size"], f["--attn-dp-size"]) == (["3"], ["2"], ["24"], ["24"])
    assert f["--disaggregation-bootstrap-port"] == ["8998"]
    assert f["--moe-a2a-backend"] == ["deepep"] and f["--deepep-mode"] == ["normal"]
    # per-rank values of the source (16384 tokens, 256 requests per rank) times 24 attention-DP ranks
    assert f["--chunked-prefill-size"] == [str(16384 * 24)]
    assert f["--max-running-requests"] == [str(256 * 24)]
    assert f["--cuda-graph-backend-prefill"] == f["--cuda-graph-backend-decode"] == ["disabled"]
    assert "--enable-dp-attention" not in f and "--dp-size" not in f
    assert cmd.env["NCCL_IB_GID_INDEX"] == "3" and cmd.env["SGLANG_ENABLE_JIT_DEEPGEMM"] == "1"
    assert "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK" not in cmd.env  # decode-only


def test_decode_node_command_p3x3_on_0517_spells_attention_dp_the_old_way():
    cfg = load_config(P3X3)
    node = cfg.group_nodes("decode", 0)[3]
    f = flags(server_command(cfg, node, "0.5.17").args)
    assert (f["--tp-size"], f["--dp-size"], f["--enable-dp-attention"]) == (["32"], ["32"], [])
    assert "--attn-dp-size" not in f and "--disaggregation-bootstrap-port" not in f
    assert f["--dist-init-addr"] == ["10.10.0.10:5757"] and f["--node-rank"] == ["3"]
    assert f["--deepep-mode"] == ["low_latency"] and f["--cuda-graph-bs-decode"] == ["256"]
    assert f["--max-running-requests"] == [str(256 * 32)]
    assert f["--num-reserved-decode-tokens"] == ["102"]


def test_p4d9_reproduces_the_source_totals():
    cfg = load_config(REPO / "configs/topologies/p4-d9.yaml")
    p = flags(server_command(cfg, cfg.nodes()[0], "0.5.23").args)
    d = flags(server_command(cfg, cfg.group_nodes("decode", 0)[0], "0.5.23").args)
    # sgl-project/sglang#6017 on the same shape: 524288 / 8192 on prefill TP32, 18432 on decode TP72
    assert p["--chunked-prefill-size"] == ["524288"] and p["--max-running-requests"] == ["8192"]
    assert d["--max-running-requests"] == ["18432"]


def test_lb_command_lists_every_group_master_with_bootstrap_ports():
    cmd = lb_command(load_config(P3X3))
    assert cmd.program == ("python3", "-m", "sglang_p2p_lb")
    assert list(cmd.args) == [
        "--prefill", "http://10.10.0.1:30000", "8998",
        "--prefill", "http://10.10.0.4:30000", "8998",
        "--prefill", "http://10.10.0.7:30000", "8998",
        "--decode", "http://10.10.0.10:30000",
        "--host", "0.0.0.0", "--port", "8000",
    ]


def test_one_host_1p1d_uses_both_gpus_and_distinct_ports():
    cfg = load_config(REPO / "configs/topologies/1p1d-one-host.yaml")
    p, d = (flags(server_command(cfg, n, "0.5.23").args) for n in cfg.nodes())
    assert (p["--base-gpu-id"], d["--base-gpu-id"]) == (["0"], ["1"])
    assert (p["--port"], d["--port"]) == (["30000"], ["30001"])
    assert (p["--dist-init-addr"], d["--dist-init-addr"]) == (["127.0.0.1:5757"], ["127.0.0.1:5767"])
    assert "--attn-dp-size" not in p and p["--tp-size"] == ["1"]
    assert list(lb_command(cfg).args)[:5] == ["--prefill", "http://127.0.0.1:30000", "8998", "--decode", "http://127.0.0.1:30001"]


def test_hostfile_replaces_hosts_in_rank_order(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# slurm\n" + "\n".join(f"gpu{i:02d}" for i in range(4)) + "\n")
    cfg = load_config(REPO / "configs/topologies/p2-d2.yaml", hostfile=hostfile)
    assert [n.host for n in cfg.nodes()] == ["gpu00", "gpu01", "gpu02", "gpu03"]
    assert "--decode" in lb_command(cfg).args and "http://gpu02:30000" in lb_command(cfg).args


def test_dry_run_prints_every_node_and_the_lb():
    cfg = load_config(P3X3)
    text = dry_run_text(cfg, "0.5.23")
    assert text.count("python3 -m sglang.launch_server") == 13
    assert text.count("python3 -m sglang_p2p_lb") == 1
    for rank in range(13):
        assert f"(rank {rank}) on 10.10.0.{rank + 1}\n" in text
    assert len(topology_commands(cfg, "0.5.23")) == 14


@pytest.mark.parametrize(
    "environ,expected",
    [({"RANK": "9", "WORLD_SIZE": "13"}, ("decode", 0, 0)), ({"SLURM_PROCID": "5", "SLURM_NTASKS": "13"}, ("prefill", 1, 2))],
)
def test_node_identity_from_environment(environ, expected):
    node = resolve_node(load_config(P3X3), environ)
    assert (node.role, node.group, node.node_rank) == expected


def test_node_subcommand_execs_the_rendered_command(monkeypatch):
    seen = []
    monkeypatch.setattr(cli.os, "execvpe", lambda file, argv, env: seen.append((file, argv, env)))
    rc = cli.run(["node", "--config", str(P3X3), "--no-check", "--sglang-version", "0.5.23",
                  "--role", "prefill", "--group", "2", "--node-rank", "1"], {})
    assert rc == 0
    (file, argv, env), = seen
    assert file == "python3" and argv[:3] == ["python3", "-m", "sglang.launch_server"]
    f = flags(tuple(argv[3:]))
    assert f["--dist-init-addr"] == ["10.10.0.7:5757"] and f["--node-rank"] == ["1"]
    assert env["NCCL_SOCKET_IFNAME"] == "bond0" and env["SGLANG_P2P_TRANSPORT"] == "auto"


def test_lb_subcommand_execs_the_lb(monkeypatch):
    seen = []
    monkeypatch.setattr(cli.os, "execvpe", lambda file, argv, env: seen.append(argv))
    assert cli.run(["lb", "--config", str(P3X3)], {}) == 0
    assert seen[0][:3] == ["python3", "-m", "sglang_p2p_lb"] and seen[0].count("--prefill") == 3
