"""Broken topologies stop before anything starts, with a message that names the problem and the fix.
Checks that need no SGLang (addresses, sizes, ports, GPUs, launcher-owned flags, config typos, ranks)."""

from __future__ import annotations

import pytest

from launch_cases import REPO, variant  # noqa: F401  (variant is a fixture)
from sglang_p2p_backend.launch import cli
from sglang_p2p_backend.launch.config import ConfigError, load_config
from sglang_p2p_backend.launch.identity import resolve_node
from sglang_p2p_backend.launch.release import UnsupportedReleaseError, resolve_release
from sglang_p2p_backend.launch.validate import validate


def problems_of(path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(load_config(path))
    assert "nothing was started" in str(info.value)
    return info.value.problems


def only(problems: list[str], *needles: str) -> str:
    """The single problem reported, checked for every needle."""
    assert len(problems) == 1, problems
    for needle in needles:
        assert needle in problems[0], (needle, problems[0])
    return problems[0]


def test_missing_address(variant):
    path = variant("p2-d2", lambda d: d.__setitem__("hosts", d["hosts"][:3]))
    only(problems_of(path), "missing address", "decode group 0 node 1 (rank 3)", "--hostfile", "4 addresses")


def test_missing_address_as_empty_entry(variant):
    def edit(d):
        d["hosts"][1] = None
    only(problems_of(variant("p2-d2", edit)), "missing address", "prefill group 0 node 1 (rank 1)")


def test_tp_not_dividing_the_group_gpus(variant):
    path = variant("p3x3-d4", lambda d: d["prefill"].__setitem__("tp", 7))
    only(problems_of(path), "prefill: tp 7 does not divide the group's 24 GPUs (3 nodes x 8 GPUs)", "set `tp` to 24")


def test_tp_leaving_gpus_idle(variant):
    path = variant("p2-d2", lambda d: d["decode"].__setitem__("tp", 8))
    only(problems_of(path), "decode: tp 8 leaves GPUs", "`tp: 16`")


def test_port_clash_between_servers_sharing_a_host(variant):
    path = variant("1p1d-one-host", lambda d: d["decode"].__setitem__("port", 30000))
    only(problems_of(path), "port clash on 127.0.0.1", "prefill group 0 node 0 HTTP", "decode group 0 node 0 HTTP")


def test_bootstrap_port_inside_the_dist_init_ports(variant):
    path = variant("p2-d2", lambda d: d["prefill"].__setitem__("bootstrap_port", 5760))
    only(problems_of(path), "port clash on 10.10.0.1", "ports 5757-5763", "bootstrap server", "`bootstrap_port`")


def test_lb_port_clash_with_a_server(variant):
    path = variant("p2-d2", lambda d: d.__setitem__("lb", {"port": 30000}))
    only(problems_of(path), "port clash on 10.10.0.1", "load balancer", "`lb.port`")


def test_gpu_clash_on_a_shared_host(variant):
    path = variant("1p1d-one-host", lambda d: d["decode"].__setitem__("base_gpu_id", 0))
    only(problems_of(path), "GPU clash on 127.0.0.1", "`base_gpu_id`")


def test_launcher_owned_flag_in_args(variant):
    path = variant("p2-d2", lambda d: d["prefill"].__setitem__("args", {"tp-size": 8}))
    only(problems_of(path), "prefill: `tp-size` in args is set by the launcher", "`tp:` of the role")


def test_sleep_on_idle_refused_where_attention_dp_would_wait_for_a_sleeping_rank(variant):
    def edit(d):
        d["decode"]["args"]["sleep-on-idle"] = True
        d["prefill"]["args"] = {"sleep-on-idle": True}  # TP-1 prefills have plain attention: nothing waits there
    only(problems_of(variant("mini-a-serve", edit)), "decode: `sleep-on-idle` with attention DP over 2 ranks",
         "up to 1 s", "remove `sleep-on-idle`")


def test_redundant_experts_that_do_not_split_over_ep(variant):
    path = variant("p3x3-d4", lambda d: d["decode"].__setitem__("args", {"ep-num-redundant-experts": 30}))
    only(problems_of(path), "decode: 256 routed + 30 redundant experts = 286 do not split over EP 32")


def test_typo_in_a_key_is_not_ignored(variant):
    path = variant("p2-d2", lambda d: d["prefill"].__setitem__("nodse", 3))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    only(info.value.problems, "unknown key `nodse` in `prefill`", "nodes")


def test_several_problems_are_reported_together(variant):
    def edit(d):
        d["prefill"]["tp"] = 5
        d["hosts"] = d["hosts"][:3]
    assert len(problems_of(variant("p2-d2", edit))) == 2


def test_world_size_must_match_the_topology():
    cfg = load_config(REPO / "configs/topologies/p2-d2.yaml")
    with pytest.raises(ConfigError) as info:
        resolve_node(cfg, {"SLURM_PROCID": "0", "SLURM_NTASKS": "8"})
    only(info.value.problems, "8 tasks", "4 nodes", "one task per node")


def test_node_without_identity_says_how_to_give_it():
    cfg = load_config(REPO / "configs/topologies/p2-d2.yaml")
    with pytest.raises(ConfigError) as info:
        resolve_node(cfg, {})
    only(info.value.problems, "--rank", "RANK and WORLD_SIZE")


def test_unsupported_sglang_release():
    with pytest.raises(UnsupportedReleaseError, match="SGLang 0.4.8 is not supported.*0.5.17, 0.5.23"):
        resolve_release("0.4.8")


@pytest.mark.parametrize("command", ["node", "lb"])
def test_cli_stops_before_exec(variant, monkeypatch, capsys, command):
    monkeypatch.setattr(cli.os, "execvpe", lambda *a: pytest.fail("a broken config must not start anything"))
    path = variant("p3x3-d4", lambda d: d["prefill"].__setitem__("tp", 7))
    extra = ["--rank", "0"] if command == "node" else []
    assert cli.run([command, "--config", str(path), "--no-check", *extra], {}) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "error:" in err and "tp 7 does not divide" in err and "nothing was started" in err
