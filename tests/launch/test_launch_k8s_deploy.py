"""What keeps a rendered deployment up on a real GPU cluster, each as the render of a shipped topology and
the objects it yields (or the render error that names the fix): an image a node can pull, tuning files
that exist, a compile cache across group recreations, DeepEP's device access and RoCE settings, pod
scheduling and QoS, disruption budgets, gang scheduling, and keys only from Secrets. The probes are in
test_launch_k8s.py; the LB's own liveness against a real LB with a key is here."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import yaml

from k8s_schema import problems
from launch_cases import REPO, variant  # noqa: F401  (variant is a fixture)
from sglang_p2p_backend.launch import cli, lws
from sglang_p2p_backend.launch.config import ConfigError, load_config
from sglang_p2p_backend.launch.k8s import checked, render_files
from sglang_p2p_backend.launch.k8s_output import stream_text
from sglang_p2p_backend.launch.k8s_profile import kube_spec
from test_launch_k8s import P3X3, RELEASE, TUNING, by_name, lb_container, objects, rendered, with_kubernetes

H800 = yaml.safe_load((REPO / "configs/clusters/h800x8-ib.yaml").read_text())


def render(path: Path, **options):
    cfg = load_config(path)
    return render_files(checked(cfg), kube_spec(cfg, RELEASE, **options), RELEASE)


def render_problems(path: Path, **options) -> list[str]:
    with pytest.raises(ConfigError) as info:
        render(path, **options)
    return info.value.problems


def p2d2(variant, tmp_path, section: dict | None = None, env: dict | None = None, edit=None) -> Path:
    """p2-d2 (2-node groups, DeepEP) on the h800 profile with `section` merged into its kubernetes: keys."""
    change = with_kubernetes(tmp_path, section or {}, env)

    def both(d):
        change(d)
        if edit:
            edit(d)
    return variant("p2-d2", both)


def server_pods(files) -> list[dict]:
    """Every server pod template (leader and worker templates of every LeaderWorkerSet)."""
    out = []
    for s in objects(files, "LeaderWorkerSet"):
        t = s["spec"]["leaderWorkerTemplate"]
        out += [t[k] for k in ("leaderTemplate", "workerTemplate") if k in t]
    return out


# --------------------------------------------------------------------------- 1. image and pull secrets

def test_an_image_without_a_registry_is_a_render_error(variant, tmp_path):
    (problem,) = render_problems(p2d2(variant, tmp_path), image="sglang-p2p-backend:0.5.23")
    assert problem.startswith("image `sglang-p2p-backend:0.5.23` names no registry")
    assert "registry.example.com/sglang-p2p-backend:0.5.23" in problem


def test_no_image_at_all_names_the_options(variant, tmp_path):
    (problem,) = render_problems(p2d2(variant, tmp_path, {"registry": None}))
    assert problem.startswith("no image: build launch/Dockerfile for SGLang 0.5.23")
    assert "`kubernetes.registry`" in problem and "--image" in problem


@pytest.mark.parametrize("image", ["localhost:5000/sglang-p2p-backend:0.5.23", "ghcr.io/team/sglang-p2p:1",
                                   "registry.internal:443/a/b:c"])
def test_images_that_name_a_registry_are_used_as_given(variant, tmp_path, image):
    files = render(p2d2(variant, tmp_path), image=image)
    assert {c["image"] for p in server_pods(files) for c in p["spec"]["containers"]} == {image}
    assert lb_container(files)["image"] == image


def test_registry_and_pull_secrets_reach_every_pod(variant, tmp_path):
    files = render(p2d2(variant, tmp_path, {"registry": "registry.corp.example/ml/", "image_pull_secrets": ["a", "b"],
                                            "image_pull_policy": "IfNotPresent"}))
    pods = [*server_pods(files), objects(files, "Deployment")[0]["spec"]["template"]]
    assert len(pods) == 4 + 1  # 2 groups x (leader, worker) + the LB
    for pod in pods:
        assert pod["spec"]["imagePullSecrets"] == [{"name": "a"}, {"name": "b"}]
        (c,) = pod["spec"]["containers"]
        assert (c["image"], c["imagePullPolicy"]) == ("registry.corp.example/ml/sglang-p2p-backend:0.5.23", "IfNotPresent")


# --------------------------------------------------------------------------- 2. tuning files

def test_tuning_files_named_by_the_profile_must_exist_at_render_time(variant, tmp_path):
    found = render_problems(p2d2(variant, tmp_path, {"tuning_dir": None}))
    assert len(found) == 3
    for flag, path, role in (("init-expert-location", "/workspace/eplb/prefill_in4096.json", "prefill"),
                             ("deepep-config", "/workspace/deepep/prefill_normal.json", "prefill"),
                             ("init-expert-location", "/workspace/eplb/decode_in2000out100.json", "decode")):
        (p,) = [p for p in found if p.startswith(f"`--{flag} {path}` ({role})")]
        assert "--tuning-dir" in p and f"`{flag}: null` under `{role}.args`" in p


def test_a_missing_or_broken_tuning_file_is_named(variant, tmp_path):
    folder = tmp_path / "tuning"
    folder.mkdir()
    (folder / "prefill_in4096.json").write_text((TUNING / "prefill_in4096.json").read_text())
    (folder / "prefill_normal.json").write_text('{"num_sms": 24')  # truncated
    found = render_problems(p2d2(variant, tmp_path), tuning_dir=folder)
    assert len(found) == 2
    assert found[0].startswith(f"`--deepep-config /workspace/deepep/prefill_normal.json` (prefill): {folder / 'prefill_normal.json'} is not valid JSON")
    assert found[1].startswith(f"`--init-expert-location /workspace/eplb/decode_in2000out100.json` (decode): "
                               f"{folder / 'decode_in2000out100.json'} cannot be read (No such file or directory)")


def test_tuning_files_travel_in_a_configmap_mounted_at_the_flags_paths(variant, tmp_path):
    files = render(p2d2(variant, tmp_path))
    (cm,) = objects(files, "ConfigMap")
    assert files[0].name == "p2-d2-tuning.yaml"  # applied before the pods that mount it
    assert cm["data"] == {name: (TUNING / name).read_text() for name in
                          ("prefill_in4096.json", "prefill_normal.json", "decode_in2000out100.json")}
    for s in objects(files, "LeaderWorkerSet"):
        role = s["metadata"]["labels"]["app.kubernetes.io/component"]
        for pod in lws.pods(s):
            f = pod.command().args
            mounts = {m["mountPath"]: m for m in pod.container["volumeMounts"] if m["name"] == "tuning"}
            paths = [f[i + 1] for i, t in enumerate(f) if t in ("--init-expert-location", "--deepep-config")]
            assert sorted(mounts) == sorted(paths) and len(paths) == (2 if role == "prefill" else 1)
            for path, m in mounts.items():
                assert m == {"name": "tuning", "mountPath": path, "subPath": Path(path).name, "readOnly": True}
        volumes = s["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["volumes"]
        assert {"name": "tuning", "configMap": {"name": "p2-d2-tuning"}} in volumes


def test_a_flag_set_to_null_leaves_the_file_out(variant, tmp_path):
    def no_tuning(d):
        d["prefill"]["args"] = {"init-expert-location": None, "deepep-config": None}
        d["decode"]["args"] = {"init-expert-location": None}
    files = render(p2d2(variant, tmp_path, {"tuning_dir": None}, edit=no_tuning))
    assert objects(files, "ConfigMap") == []
    for pod in server_pods(files):
        (c,) = pod["spec"]["containers"]
        assert "--init-expert-location" not in c["args"] and "--deepep-config" not in c["args"]
        assert all(v["name"] != "tuning" for v in pod["spec"]["volumes"])


def test_tuning_files_larger_than_a_configmap_are_refused(variant, tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    for name in ("prefill_in4096.json", "prefill_normal.json", "decode_in2000out100.json"):
        (folder / name).write_text(json.dumps({"x": "0" * 400_000}))
    (problem,) = render_problems(p2d2(variant, tmp_path), tuning_dir=folder)
    assert "more than a ConfigMap's 1048576" in problem


# --------------------------------------------------------------------------- 3. compile cache

def test_jit_deepgemm_without_a_cache_is_a_render_error(variant, tmp_path):
    (problem,) = render_problems(p2d2(variant, tmp_path, {"cache": None}))
    assert problem.startswith("SGLANG_ENABLE_JIT_DEEPGEMM=1 (prefill, decode) compiles DeepGEMM kernels into /root/.cache")
    assert "`kubernetes.cache`" in problem


@pytest.mark.parametrize("cache,volume", [
    ({"host_path": "/var/cache/x"}, {"hostPath": {"path": "/var/cache/x", "type": "DirectoryOrCreate"}}),
    ({"claim": "jit-cache"}, {"persistentVolumeClaim": {"claimName": "jit-cache", "readOnly": False}}),
])
def test_the_cache_survives_group_recreation(variant, tmp_path, cache, volume):
    files = render(p2d2(variant, tmp_path, {"cache": cache}))
    for pod in server_pods(files):
        assert {"name": "cache", **volume} in pod["spec"]["volumes"]
        (c,) = pod["spec"]["containers"]
        assert {"name": "cache", "mountPath": "/root/.cache"} in c["volumeMounts"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["SGLANG_DG_CACHE_DIR"] == "/root/.cache/deep_gemm" and env["TRITON_CACHE_DIR"] == "/root/.cache/triton"


def test_no_jit_no_cache_needed():
    files = rendered(REPO / "configs/topologies/1p1d-one-host.yaml")
    for pod in server_pods(files):
        assert all(v["name"] != "cache" for v in pod["spec"]["volumes"])
        assert "SGLANG_DG_CACHE_DIR" not in {e["name"] for e in pod["spec"]["containers"][0]["env"]}


# --------------------------------------------------------------------------- 5. DeepEP over RoCE

def test_h800_profile_gives_deepep_its_nics_ipc_and_nvshmem_roce_settings():
    files = rendered(P3X3)
    for pod in server_pods(files):
        spec = pod["spec"]
        assert spec["hostIPC"] is True and spec["hostNetwork"] is True
        (c,) = spec["containers"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["NVSHMEM_IB_GID_INDEX"] == env["NCCL_IB_GID_INDEX"] == "3"
        assert env["NVSHMEM_IB_TRAFFIC_CLASS"] and env["NCCL_IB_TC"]  # the fabric's lossless class, for each
        assert env["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "1"
        # two GPUs on each of the four NICs, every GPU of the node mapped
        mapping = [e.split(":") for e in env["NVSHMEM_HCA_PE_MAPPING"].split(",")]
        assert [m[0] for m in mapping] == env["NCCL_IB_HCA"].split(",")
        assert sum(int(m[2]) for m in mapping) == int(c["resources"]["limits"]["nvidia.com/gpu"])


def test_roce_without_nvshmem_gid_is_a_render_error(variant, tmp_path):
    found = render_problems(p2d2(variant, tmp_path, env={"NVSHMEM_IB_GID_INDEX": None}))
    assert len(found) == 2  # prefill and decode groups both span two nodes
    assert found[0].startswith("prefill: NCCL_IB_GID_INDEX=3 (RoCE) but no NVSHMEM_IB_GID_INDEX")


def test_deepep_across_nodes_needs_rdma_device_access(variant, tmp_path):
    found = render_problems(p2d2(variant, tmp_path, {"resources": None}))
    assert len(found) == 2 and "list your RDMA device plugin's resource under `kubernetes.resources`" in found[0]
    found = render_problems(p2d2(variant, tmp_path, {"capabilities": None}))
    assert len(found) == 2 and "add IPC_LOCK to `kubernetes.capabilities`" in found[0]
    # privileged is the other documented way: every device of the node, no device plugin needed
    files = render(p2d2(variant, tmp_path, {"resources": None, "capabilities": None, "privileged": True}))
    for pod in server_pods(files):
        assert pod["spec"]["containers"][0]["securityContext"] == {"privileged": True}


def test_a_single_node_deepep_group_needs_no_rdma(variant, tmp_path):
    def one_node(d):
        d["prefill"]["nodes"] = d["decode"]["nodes"] = 1
    files = render(p2d2(variant, tmp_path, {"resources": None, "capabilities": None}, edit=one_node))
    assert [s["spec"]["leaderWorkerTemplate"]["size"] for s in objects(files, "LeaderWorkerSet")] == [1, 1]


# --------------------------------------------------------------------------- 6. scheduling, QoS, PDB, gang

def test_server_pods_get_tolerations_affinity_priority_and_scheduler(variant, tmp_path):
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["pd"]}]}]}}}
    files = render(p2d2(variant, tmp_path, {"affinity": affinity, "priority_class": "inference-critical",
                                            "scheduler_name": "volcano", "gang": True}))
    for pod in server_pods(files):
        spec = pod["spec"]
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert spec["affinity"] == affinity and spec["priorityClassName"] == "inference-critical"
        assert spec["schedulerName"] == "volcano"
    lb = objects(files, "Deployment")[0]["spec"]["template"]["spec"]
    assert lb["priorityClassName"] == "inference-critical" and "tolerations" not in lb  # the LB runs on CPU nodes
    for obj in objects(files):
        assert problems(obj) == [], obj["kind"]


def test_server_pods_are_not_best_effort():
    """Requests for cpu and memory: without them a GPU pod is BestEffort, the first evicted under pressure."""
    for pod in server_pods(rendered(P3X3)):
        assert pod["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "64", "memory": "1000Gi"}
    one_host = rendered(REPO / "configs/topologies/1p1d-one-host.yaml")  # no requests in the profile: per GPU
    for pod in server_pods(one_host):
        assert pod["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "4", "memory": "64Gi"}


def test_pdb_covers_exactly_one_groups_pods():
    files = rendered(P3X3)
    budgets = by_name(files, "PodDisruptionBudget")
    sets = by_name(files, "LeaderWorkerSet")
    assert sorted(budgets) == sorted(sets)
    all_pods = [p for s in sets.values() for p in lws.pods(s)]
    for name, pdb in budgets.items():
        assert pdb["spec"]["maxUnavailable"] == 0
        match = pdb["spec"]["selector"]["matchLabels"]
        chosen = [p.name for p in all_pods if all(p.labels.get(k) == v for k, v in match.items())]
        assert chosen == [p.name for p in lws.pods(sets[name])]


def test_gang_needs_a_scheduler(variant, tmp_path):
    (problem,) = render_problems(p2d2(variant, tmp_path, {"gang": True}))
    assert problem.startswith("`kubernetes.gang: true` needs a gang scheduler: set `kubernetes.scheduler_name`")


# --------------------------------------------------------------------------- 6. keys only from Secrets

def test_a_key_in_plain_env_is_a_render_error(variant, tmp_path):
    (problem,) = render_problems(p2d2(variant, tmp_path, env={"SGLANG_P2P_AUTH_KEY": "hunter2"}))
    assert problem.startswith("SGLANG_P2P_AUTH_KEY (prefill, decode env) would be written into the YAML in plain text")
    assert "`kubernetes.secret_env`" in problem


def test_keys_come_from_secrets_and_never_appear_in_the_yaml(variant, tmp_path):
    def lb_key(d):
        d["lb"] = {"args": {"api-key": "$(LB_CLIENT_KEY)"}}
    section = {"secret_env": {"SGLANG_P2P_AUTH_KEY": "pd-keys/auth"},
               "lb_secret_env": {"SGLANG_P2P_LB_ADMIN_KEY": "pd-keys/lb-admin", "LB_CLIENT_KEY": "pd-keys/lb-client"}}
    files = render(p2d2(variant, tmp_path, section, edit=lb_key))
    for pod in server_pods(files):
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["SGLANG_P2P_AUTH_KEY"] == {"name": "SGLANG_P2P_AUTH_KEY",
                                              "valueFrom": {"secretKeyRef": {"name": "pd-keys", "key": "auth"}}}
    lb = lb_container(files)
    assert {e["name"]: e["valueFrom"]["secretKeyRef"] for e in lb["env"]} == {
        "SGLANG_P2P_LB_ADMIN_KEY": {"name": "pd-keys", "key": "lb-admin"},
        "LB_CLIENT_KEY": {"name": "pd-keys", "key": "lb-client"}}
    args = lb["args"]
    assert args[args.index("--api-key") + 1] == "$(LB_CLIENT_KEY)"  # the kubelet fills it in from the Secret
    text = stream_text(files, "test")
    assert "pd-keys" in text and "hunter2" not in text
    for obj in objects(files):
        assert problems(obj) == [], obj["kind"]


@pytest.mark.parametrize("args,needle", [
    ({"api-key": "s3cret"}, "`lb.args.api-key` would be written into the YAML in plain text"),
    ({"admin-api-key": "$(NOT_A_SECRET)"}, "`lb.args.admin-api-key` would be written into the YAML in plain text"),
])
def test_lb_keys_in_plain_args_are_a_render_error(variant, tmp_path, args, needle):
    (problem,) = render_problems(p2d2(variant, tmp_path, edit=lambda d: d.__setitem__("lb", {"args": args})))
    assert problem.startswith(needle) and "`kubernetes.lb_secret_env`" in problem


def test_lb_liveness_path_answers_without_the_key_on_a_real_lb():
    """The rendered liveness probe against the LB itself, started with --api-key on 127.0.0.1."""
    from sglang_p2p_lb.cli import build_parser, config_from_args
    from sglang_p2p_lb.server import LoadBalancer

    c = lb_container(rendered(P3X3))
    live, ready = c["livenessProbe"]["httpGet"]["path"], c["readinessProbe"]["httpGet"]["path"]
    args = build_parser().parse_args(["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
                                      "--host", "127.0.0.1", "--port", "0", "--api-key", "client-key",
                                      "--disable-health-check", "--load-poll-interval-secs", "0"])

    async def probe() -> dict[str, int]:
        lb = LoadBalancer(config_from_args(args))
        url = await lb.start()
        try:
            async with aiohttp.ClientSession() as s:
                out = {}
                for path in (live, ready, "/workers"):
                    async with s.get(url + path) as r:  # as the kubelet asks: no Authorization header
                        out[path] = r.status
                return out
        finally:
            await lb.stop()

    status = asyncio.run(asyncio.wait_for(probe(), 20))
    assert status[live] == 200  # alive whatever the workers' state
    assert status["/workers"] == 401  # what the old liveness path answered: a restart loop
    assert status[ready] in (200, 503)


# --------------------------------------------------------------------------- CLI

def test_cli_names_the_missing_tuning_files(capsys):
    assert cli.run(["k8s", "--config", str(P3X3), "--no-check", "--sglang-version", RELEASE], {}) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "3 problems, nothing was started" in err and "configs/tuning/prefill_in4096.json cannot be read" in err
