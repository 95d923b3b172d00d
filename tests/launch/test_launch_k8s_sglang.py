"""The SGLang command of every pod of every shipped topology's Kubernetes rendering, as LWS and the kubelet
fill it in, through SGLang's own parser with the p2pnccl plugin loaded (each supported release), read back
from SGLang's namespace; and `launch k8s` runs that check before it writes anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_cases import RBG_TOPOLOGIES, TOPOLOGIES, variant  # noqa: F401  (variant is a fixture)
from sglang_p2p_backend.launch import cli, lws, rbg
from sglang_p2p_backend.launch.config import load_config
from sglang_p2p_backend.launch.k8s import checked, render_files
from sglang_p2p_backend.launch.k8s_profile import kube_spec
from sglang_p2p_backend.launch.release import installed_release
from sglang_p2p_backend.launch.sglang_parser import checker

pytestmark = pytest.mark.sglang

RELEASE = installed_release()
TUNING = Path(__file__).parent / "data" / "tuning"


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda p: p.stem)
def test_every_pod_command_parses_to_the_pods_place_in_its_group(topology):
    cfg = load_config(topology)
    kube = kube_spec(cfg, RELEASE, tuning_dir=TUNING)
    chk = checker()
    sets = [o for f in render_files(checked(cfg), kube, RELEASE) for o in f.objects if o["kind"] == "LeaderWorkerSet"]
    assert len(sets) == cfg.prefill.groups + cfg.decode.groups
    for s in sets:
        name = s["metadata"]["name"]
        role = s["metadata"]["labels"]["app.kubernetes.io/component"]
        spec = cfg.role(role)
        pods = lws.pods(s)
        assert len(pods) == spec.nodes
        for worker, pod in enumerate(pods):
            cmd = pod.command()
            assert chk.problems(cmd) == [], cmd.shell()
            ns = chk.parser.parse_args(list(cmd.args))
            assert (ns.node_rank, ns.nnodes, ns.tp_size) == (worker, spec.nodes, spec.tp)
            assert ns.dist_init_addr == f"{pods[0].name}.{name}.{kube.namespace}:{spec.dist_init_port}"
            assert (ns.disaggregation_mode, ns.disaggregation_transfer_backend) == (role, "p2pnccl")
            assert (ns.host, ns.port, ns.base_gpu_id) == ("0.0.0.0", spec.port, 0)
            if role == "prefill":
                assert ns.disaggregation_bootstrap_port == spec.bootstrap_port


@pytest.mark.parametrize("topology", RBG_TOPOLOGIES, ids=lambda p: p.stem)
def test_every_rbg_pod_command_parses_to_the_pods_place_in_its_group(topology):
    cfg = load_config(topology)
    kube = kube_spec(cfg, RELEASE, tuning_dir=TUNING)
    chk = checker()
    files = rbg.render_files(checked(cfg), kube, RELEASE)
    (group,) = [o for f in files for o in f.objects if o["kind"] == rbg.KIND]
    servers = [p for p in rbg.pods(group) if p.labels.get(rbg.SERVER_LABEL) == "true"]
    assert len(servers) == cfg.total_nodes
    for pod in servers:
        cmd = pod.command()
        assert chk.problems(cmd) == [], cmd.shell()
        ns = chk.parser.parse_args(list(cmd.args))
        assert str(ns.node_rank) == pod.env[rbg.WORKER_INDEX] and str(ns.nnodes) == pod.env[rbg.GROUP_SIZE]
        assert ns.dist_init_addr.startswith(pod.env[rbg.LEADER_ADDRESS] + ":")


def test_sglang_reads_the_cache_variables_the_pods_set():
    """The compile cache mount only helps if SGLang's DeepGEMM wrapper reads SGLANG_DG_CACHE_DIR."""
    from sglang_p2p_backend.launch.k8s_pod import CACHE_ENV
    from sglang.srt.environ import envs

    assert hasattr(envs, "SGLANG_DG_CACHE_DIR") and "SGLANG_DG_CACHE_DIR" in CACHE_ENV


@pytest.mark.parametrize("workload", ["lws", "rbg"])
def test_cli_checks_every_pod_command(capsys, workload):
    topology = next(p for p in TOPOLOGIES if p.stem == "p4-d9")
    assert cli.run(["k8s", "--config", str(topology), "--workload", workload, "--tuning-dir", str(TUNING)], {}) == 0
    assert f"accepted by SGLang {RELEASE}'s parser with the p2pnccl plugin loaded" in capsys.readouterr().out


def test_cli_writes_nothing_when_sglang_rejects_a_pod_command(variant, tmp_path, capsys):
    path = variant("p2-d2", lambda d: d["decode"].__setitem__("args", {"enable-deepep-moe": True}))
    out = tmp_path / "out"
    assert cli.run(["k8s", "--config", str(path), "--out", str(out), "--tuning-dir", str(TUNING)], {}) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    for pod in ("p2-d2-decode-0-0", "p2-d2-decode-0-0-1"):  # the leader and its worker, named as LWS names them
        assert f"pod {pod}: unknown flag `--enable-deepep-moe`" in err
    assert "pod p2-d2-prefill" not in err and not out.exists()
