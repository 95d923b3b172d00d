"""Several servers of a topology on one multi-GPU host (the miniature topologies): groups of a role side by
side on their host, attention DP only where a server has more than one rank, servers sharing GPUs only when
the topology says so, and extra LB flags after `--`. No SGLang needed."""

from __future__ import annotations

import pytest

from sglang_p2p_backend.launch import cli
from sglang_p2p_backend.launch.config import ConfigError, load_config
from sglang_p2p_backend.launch.render import lb_command, server_command
from sglang_p2p_backend.launch.validate import validate

from launch_cases import REPO, flags, variant  # noqa: F401  (variant is a fixture)

MINI_A = REPO / "configs/topologies/mini-a-2p-dpdecode.yaml"


@pytest.mark.parametrize("release,dp_flags", [("0.5.17", {"--dp-size": ["2"], "--enable-dp-attention": []}),
                                              ("0.5.23", {"--attn-dp-size": ["2"]})])
def test_two_prefill_groups_on_one_host_take_the_next_gpu_and_ports(release, dp_flags):
    cfg = validate(load_config(MINI_A))
    p0, p1, d = (flags(server_command(cfg, n, release).args) for n in cfg.nodes())
    assert (p0["--base-gpu-id"], p0["--port"], p0["--disaggregation-bootstrap-port"], p0["--dist-init-addr"]) == (
        ["0"], ["30100"], ["8100"], ["127.0.0.1:5100"])
    # the second group: one GPU further, each port one further, dist-init past the 7 ports the first reserves
    assert (p1["--base-gpu-id"], p1["--port"], p1["--disaggregation-bootstrap-port"], p1["--dist-init-addr"]) == (
        ["1"], ["30101"], ["8101"], ["127.0.0.1:5107"])
    # a TP-1 prefill has plain attention; the TP-2 decode gets attention DP 2 (and its chunk scaled by it)
    for f in (p0, p1):
        assert not {"--dp-size", "--attn-dp-size", "--enable-dp-attention"} & f.keys()
        assert f["--chunked-prefill-size"] == ["64"]
    assert {k: d[k] for k in dp_flags} == dp_flags
    assert (d["--base-gpu-id"], d["--tp-size"], d["--ep-size"], d["--chunked-prefill-size"]) == (
        ["2"], ["2"], ["2"], ["128"])
    lb = lb_command(cfg).args
    assert " ".join(lb).startswith("--prefill http://127.0.0.1:30100 8100 --prefill http://127.0.0.1:30101 8101 "
                                   "--decode http://127.0.0.1:30110 ")


def test_groups_that_no_longer_fit_their_host_are_refused(variant):
    path = variant("mini-a-2p-dpdecode", lambda t: t["prefill"].update(groups=5, base_gpu_id=0))
    path.write_text(path.read_text().replace("hosts:\n", "hosts:\n- 127.0.0.1\n- 127.0.0.1\n- 127.0.0.1\n", 1))
    with pytest.raises(ConfigError) as err:
        validate(load_config(path))
    assert any("prefill: 1 GPUs from GPU 4 do not fit a node of 4 GPUs (its groups share a host side by side)" in p
               for p in err.value.problems), err.value.problems


def test_servers_share_gpus_only_when_the_topology_says_so(variant):
    assert validate(load_config(REPO / "configs/topologies/mini-c-tp1-tp4.yaml")).shared_gpus
    path = variant("mini-c-tp1-tp4", lambda t: t.pop("shared_gpus"))
    with pytest.raises(ConfigError) as err:
        validate(load_config(path))
    assert err.value.problems == [
        "GPU clash on 127.0.0.1: decode group 0 node 0 (rank 1) uses GPUs 0-3 and prefill group 0 node 0 (rank 0) "
        "uses 0-0: set `base_gpu_id` so they do not overlap"]
    bad = variant("mini-c-tp1-tp4", lambda t: t.update(shared_gpus="yes"))
    with pytest.raises(ConfigError, match="`shared_gpus` must be true or false"):
        load_config(bad)


def test_lb_subcommand_appends_the_flags_after_the_separator(monkeypatch):
    seen = []
    monkeypatch.setattr(cli.os, "execvpe", lambda file, argv, env: seen.append(argv))
    assert cli.run(["lb", "--config", str(MINI_A), "--", "--policy", "round_robin", "--log-level", "warning"], {}) == 0
    assert seen[0][-6:] == ["--port", "8010", "--policy", "round_robin", "--log-level", "warning"]
