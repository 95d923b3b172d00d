"""The RoleBasedGroup rendering (`launch k8s --workload rbg`) without a cluster: every object of every
shipped topology validates offline (the rbg v0.8.0-alpha.5 CRD schema with undeclared fields rejected,
pod templates through the client's models); the pods the RBG controller makes of each role carry the same
SGLang command as the LeaderWorkerSet rendering's, with RBG's variables; the leader Services and the LB's
discovery selectors find exactly the leaders; the LB role waits for every server role."""

from __future__ import annotations

import copy

import pytest
import yaml

from k8s_schema import RBG_SCHEMA, RBG_VERSION, problems
from launch_cases import TOPOLOGIES, flags, variant  # noqa: F401  (variant is a fixture)
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
    text = RBG_SCHEMA.read_text()
    assert f"sgl-project/rbg {RBG_VERSION}" in text and "993491fba9bfdf377d3cd18c8833da20ce0ec87b" in text
    assert rbg.API_VERSION == "workloads.x-k8s.io/v1alpha2"


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda p: p.stem)
def test_every_object_validates(topology):
    files = rendered(topology)
    cfg = load_config(topology)
    groups = cfg.prefill.groups + cfg.decode.groups
    kinds = [o["kind"] for o in objects(files)]
    assert kinds.count(rbg.KIND) == 1 and kinds.count("Service") == groups + 1 and "Deployment" not in kinds
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


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda p: p.stem)
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
        role_name = pod.labels["rbg.workloads.x-k8s.io/role-name"]
        instance = f"{group['metadata']['name']}-{role_name}-0"
        assert f.pop("--dist-init-addr") == [f"{instance}-0.s-{group['metadata']['name']}-{role_name}.{kube.namespace}:"
                                             f"{cfg.role(f['--disaggregation-mode'][0]).dist_init_port}"]
        t.pop("--dist-init-addr")
        assert f == t  # node rank, sizes, role, ports, every profile flag
        assert pod.container["livenessProbe"] == twin.container["livenessProbe"]  # /model_info on leaders only
        assert {k: v for k, v in pod.env.items() if not k.startswith(("RBG_", "LWS_"))} == \
            {k: v for k, v in twin.env.items() if not k.startswith(("RBG_", "LWS_"))}


def test_roles_leader_services_and_discovery_find_the_leaders():
    cfg = load_config(P3X3)
    files = rendered(P3X3)
    group = group_of(files)
    roles = {r["name"]: r for r in group["spec"]["roles"]}
    assert list(roles) == ["prefill-0", "prefill-1", "prefill-2", "decode-0", "lb"]
    assert roles["lb"]["dependencies"] == ["prefill-0", "prefill-1", "prefill-2", "decode-0"]
    for name in ("prefill-0", "decode-0"):
        lwp = roles[name]["leaderWorkerPattern"]
        assert (roles[name]["replicas"], lwp["size"]) == (1, cfg.role(name.split("-")[0]).nodes)
        assert lwp["restartPolicyConfig"]["type"] == "RecreateRoleInstanceOnPodRestart"
        patch = lwp["leaderTemplatePatch"]
        (container,) = patch["spec"]["containers"]
        assert container == {"name": "sglang", "livenessProbe": container["livenessProbe"]}
        assert container["livenessProbe"]["httpGet"]["path"] == "/model_info"
    pods = rbg.pods(group)
    servers = [p for p in pods if p.labels.get(rbg.SERVER_LABEL) == "true"]
    leaders = [p for p in servers if p.labels["rbg.workloads.x-k8s.io/role-name"] and p.name.endswith("-0-0")]
    services = {s["metadata"]["name"]: s for s in objects(files, "Service")}
    for role in ROLES:
        for g in range(cfg.role(role).groups):
            svc = services[f"p3x3-d4-{role}-{g}-leader"]
            assert selected(svc["spec"]["selector"], servers) == [f"p3x3-d4-{role}-{g}-0-0"]
    (lb_pod,) = [p for p in pods if p.labels.get(rbg.SERVER_LABEL) != "true"]
    args = lb_pod.container["args"]
    for role in ROLES:
        flag = args.index(f"--{role}-selector")
        selector = dict(a.split("=", 1) for a in args[flag + 1:flag + 4])
        assert sorted(selected(selector, servers)) == sorted(
            p.name for p in leaders if p.labels["app.kubernetes.io/component"] == role)
    assert selected(services["p3x3-d4-lb"]["spec"]["selector"], [lb_pod]) == [lb_pod.name]
    assert selected(services["p3x3-d4-lb"]["spec"]["selector"], servers) == []
    assert lb_pod.container["livenessProbe"]["httpGet"]["path"] == "/metrics"


def test_gang_scheduling_is_the_groups_annotation(variant, tmp_path):
    path = variant("p2-d2", with_kubernetes(tmp_path, {"gang": True, "scheduler_name": "volcano"}))
    group = group_of(rendered(path))
    assert group["metadata"]["annotations"] == {"rbg.workloads.x-k8s.io/group-gang-scheduling": "true"}
    assert problems(group) == []


def test_names_too_long_for_rbg(variant):
    path = variant("p3x3-d4", lambda d: d.__setitem__("name", "deepseek-v3-" + "x" * 38))
    cfg = load_config(path)
    with pytest.raises(ConfigError) as info:
        rbg.render_files(cfg, kube_spec(cfg, RELEASE, tuning_dir=TUNING), RELEASE)
    assert any("(RoleBasedGroup service or pod name) is longer than 63 characters" in p for p in info.value.problems)


def test_cli_workload_rbg(capsys):
    args = ["k8s", "--config", str(P3X3), "--no-check", "--sglang-version", RELEASE, "--workload", "rbg",
            "--tuning-dir", str(TUNING)]
    assert cli.run(args, {}) == 0
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == objects(rendered(P3X3))
