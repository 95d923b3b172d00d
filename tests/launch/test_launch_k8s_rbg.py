"""The RoleBasedGroup rendering (`launch k8s --workload rbg`) without a cluster: every object of every
shipped topology validates offline (the rbg v0.8.0-alpha.5 CRD schema with undeclared fields rejected,
pod templates through the client's models); the pods the RBG controller makes of each role carry the same
SGLang command as the LeaderWorkerSet rendering's, with RBG's variables; the LB's discovery selectors find
exactly the leaders, one per group; the LB role waits for both server roles."""

from __future__ import annotations

import copy
import gzip

import pytest
import yaml

from k8s_schema import RBG_SCHEMA, RBG_VERSION, problems
from launch_cases import RBG_TOPOLOGIES, TOPOLOGIES, flags, variant  # noqa: F401  (variant is a fixture)
from sglang_p2p_backend.launch import cli, lws, rbg
from sglang_p2p_backend.launch.config import ROLES, ConfigError, load_config
from sglang_p2p_backend.launch.k8s import checked, render_files as render_lws
from sglang_p2p_backend.launch.k8s_profile import kube_spec
from test_launch_k8s import P3X3, RELEASE, TUNING, objects, selected, with_kubernetes




def rendered(path, **options):
    cfg = load_config(path)
    options.setdefault("tuning_dir", TUNING)
    return rbg.render_files(checked(cfg), kube_spec(cfg, RELEASE, **options), RELEASE)


def group_of(files) -> dict:
    (g,) = objects(files, rbg.KIND)
    return g


def test_rbg_schema_is_the_pinned_release():
    text = gzip.decompress(RBG_SCHEMA.read_bytes()).decode()
    assert f"sgl-project/rbg {RBG_VERSION}" in text and "993491fba9bfdf377d3cd18c8833da20ce0ec87b" in text
    assert rbg.API_VERSION == "workloads.x-k8s.io/v1alpha2"


@pytest.mark.parametrize("topology", RBG_TOPOLOGIES, ids=lambda p: p.stem)
def test_every_object_validates(topology):
    files = rendered(topology)
    cfg = load_config(topology)
    kinds = [o["kind"] for o in objects(files)]
    assert kinds.count(rbg.KIND) == 1 and kinds.count("Service") == 1 and "Deployment" not in kinds
    (group,) = objects(files, rbg.KIND)
    assert [(r["name"], r["replicas"]) for r in group["spec"]["roles"]] == [
        ("prefill", cfg.prefill.groups), ("decode", cfg.decode.groups), ("lb", 1)]
    for obj in objects(files):
        assert problems(obj) == [], (obj["kind"], obj["metadata"]["name"])


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda g: g["spec"]["roles"][0]["leaderWorkerPattern"].__setitem__("size", "3"), "'3' is not of type 'integer'"),
        (lambda g: g["spec"]["roles"][0]["leaderWorkerPattern"]["restartPolicyConfig"].__setitem__("type", "RecreateGroupOnPodRestart"), "is not one of"),
        (lambda g: g["spec"]["roles"][0]["leaderWorkerPattern"]["template"]["spec"]["containers"][0].__setitem__("imagePullPolcy", "Always"), "imagePullPolcy"),
        (lambda g: g["spec"]["roles"][0].__setitem__("standalonePattern", {"template": {}}), "exactly one pattern"),
        (lambda g: g["spec"]["roles"][-1]["dependencies"].append("prefill-9"), "no role 'prefill-9'"),
        (lambda g: g["spec"]["roles"][0]["rolloutStrategy"].__setitem__("type", "Recreate"), "is not one of"),
        (lambda g: g["spec"].pop("roles"), "'roles' is a required property"),
        (lambda g: g["spec"]["roles"][0]["leaderWorkerPattern"]["leaderTemplatePatch"]["spec"]["containers"][0]
         .__setitem__("livenessProbe", {"httpGet": {"path": "/x"}, "periodSecs": 1}), "leaderTemplatePatch"),
    ],
)
def test_validation_rejects_what_the_api_server_would(edit, needle):
    g = copy.deepcopy(group_of(rendered(P3X3)))
    edit(g)
    found = problems(g)
    assert any(needle in p for p in found), found


@pytest.mark.parametrize("topology", RBG_TOPOLOGIES, ids=lambda p: p.stem)
def test_pods_run_the_lws_renderings_commands_with_rbgs_variables(topology):
    cfg = load_config(topology)
    kube = kube_spec(cfg, RELEASE, tuning_dir=TUNING)
    files = rbg.render_files(checked(cfg), kube, RELEASE)
    group = group_of(files)
    pods = [p for p in rbg.pods(group) if p.labels.get(rbg.SERVER_LABEL) == "true"]
    lws_pods = [p for s in objects(render_lws(checked(cfg), kube, RELEASE), "LeaderWorkerSet") for p in lws.pods(s)]
    assert len(pods) == len(lws_pods) == cfg.total_nodes
    for pod, twin in zip(pods, lws_pods):
        f, t = flags(pod.command().args), flags(twin.command().args)
        role_name = pod.labels[rbg.ROLE_LABEL]
        instance = pod.name.rsplit("-", 1)[0]  # the group: <name>-<role>-<replica>
        assert twin.name.startswith(f"{group['metadata']['name']}-{role_name}-{instance.rsplit('-', 1)[1]}")
        assert f.pop("--dist-init-addr") == [f"{instance}-0.s-{group['metadata']['name']}-{role_name}.{kube.namespace}:"
                                             f"{cfg.role(role_name).dist_init_port}"]
        t.pop("--dist-init-addr")
        assert f == t  # node rank, sizes, role, ports, every profile flag
        assert pod.container["livenessProbe"] == twin.container["livenessProbe"]  # /model_info on leaders only
        assert {k: v for k, v in pod.env.items() if not k.startswith(("RBG_", "LWS_"))} == \
            {k: v for k, v in twin.env.items() if not k.startswith(("RBG_", "LWS_"))}


def test_roles_and_discovery_find_one_leader_per_group(monkeypatch):
    from sglang_p2p_lb.cli import build_parser, config_from_args

    cfg = load_config(P3X3)
    files = rendered(P3X3)
    group = group_of(files)
    roles = {r["name"]: r for r in group["spec"]["roles"]}
    assert list(roles) == ["prefill", "decode", "lb"] and roles["lb"]["dependencies"] == ["prefill", "decode"]
    for name in ROLES:
        role = roles[name]
        lwp = role["leaderWorkerPattern"]
        assert (role["replicas"], lwp["size"]) == (cfg.role(name).groups, cfg.role(name).nodes)
        assert role["rolloutStrategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
        assert lwp["restartPolicyConfig"]["type"] == "RecreateRoleInstanceOnPodRestart"
        (container,) = lwp["leaderTemplatePatch"]["spec"]["containers"]
        assert container == {"name": "sglang", "livenessProbe": container["livenessProbe"]}
        assert container["livenessProbe"]["httpGet"]["path"] == "/model_info"
    pods = rbg.pods(group)
    servers = [p for p in pods if p.labels.get(rbg.SERVER_LABEL) == "true"]
    assert len(servers) == cfg.total_nodes
    (lb_pod,) = [p for p in pods if p.labels.get(rbg.SERVER_LABEL) != "true"]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # as in every pod
    lb_cfg = config_from_args(build_parser().parse_args(lb_pod.container["args"]))
    for role in ROLES:
        leaders = selected(lb_cfg.discovery.selectors[role], servers)
        assert leaders == [f"p3x3-d4-{role}-{g}-0" for g in range(cfg.role(role).groups)]
    assert lb_cfg.discovery.port == cfg.prefill.port == cfg.decode.port
    prefill = rbg.leader_template(roles["prefill"]["leaderWorkerPattern"])
    assert prefill["metadata"]["annotations"] == {lb_cfg.discovery.bootstrap_annotation: str(cfg.prefill.bootstrap_port)}
    (service,) = objects(files, "Service")
    assert selected(service["spec"]["selector"], [lb_pod]) == [lb_pod.name] and selected(service["spec"]["selector"], servers) == []
    assert lb_pod.container["livenessProbe"]["httpGet"]["path"] == "/metrics"
    assert lb_pod.container.get("env") is None and "serviceAccountName" in roles["lb"]["standalonePattern"]["template"]["spec"]
    budgets = {b["metadata"]["name"]: b for b in objects(files, "PodDisruptionBudget")}
    for role in ROLES:  # one budget a role covers every server pod of that role
        match = budgets[f"p3x3-d4-{role}"]["spec"]["selector"]["matchLabels"]
        assert selected(match, servers) == [p.name for p in servers if p.labels[rbg.ROLE_LABEL] == role]


def test_gang_scheduling_is_the_groups_annotation(variant, tmp_path):
    path = variant("p2-d2", with_kubernetes(tmp_path, {"gang": True, "scheduler_name": "volcano"}))
    group = group_of(rendered(path))
    assert group["metadata"]["annotations"] == {"rbg.workloads.x-k8s.io/group-gang-scheduling": "true"}
    assert problems(group) == []


def test_roles_on_different_ports_cannot_be_discovered():
    one_host = next(p for p in TOPOLOGIES if p.stem == "1p1d-one-host")
    with pytest.raises(ConfigError) as info:
        rendered(one_host)
    (problem,) = info.value.problems
    assert "prefill serves on 30000 and decode on 30001: give both roles one `port:`" in problem


def test_names_too_long_for_rbg(variant):
    path = variant("p3x3-d4", lambda d: d.__setitem__("name", "deepseek-v3-" + "x" * 43))
    cfg = load_config(path)
    with pytest.raises(ConfigError) as info:
        rbg.render_files(cfg, kube_spec(cfg, RELEASE, tuning_dir=TUNING), RELEASE)
    assert any("(RoleBasedGroup service or pod name) is longer than 63 characters" in p for p in info.value.problems)


def test_cli_workload_rbg(capsys):
    args = ["k8s", "--config", str(P3X3), "--no-check", "--sglang-version", RELEASE, "--workload", "rbg",
            "--tuning-dir", str(TUNING)]
    assert cli.run(args, {}) == 0
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == objects(rendered(P3X3))
