"""Kubernetes rendering (`launch k8s`) without a cluster and without SGLang: every object of every shipped
topology validates offline (client models, LWS v0.10.0 CRD schema); the pods that LWS makes of each
LeaderWorkerSet agree on ranks, sizes and the leader address; each leader Service selects exactly its
group's leader; the LB's flags, read by the LB's own parser, dial those Services; the pod specifics the
cluster profile asks for; the CLI's stdout and folder output; broken inputs stop with their fix."""

from __future__ import annotations

import copy
import gzip
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from k8s_schema import LWS_SCHEMA, LWS_VERSION, problems
from launch_cases import REPO, TOPOLOGIES, flags, variant  # noqa: F401  (variant is a fixture)
from sglang_p2p_backend.launch import cli, lws
from sglang_p2p_backend.launch.config import ROLES, ConfigError, load_config
from sglang_p2p_backend.launch.k8s import KubeFile, checked, lb_name, leader_service, render_files
from sglang_p2p_backend.launch.k8s_profile import kube_spec
from sglang_p2p_backend.launch.release import SUPPORTED
from sglang_p2p_lb.cli import build_parser, config_from_args

RELEASE = "0.5.23"
P3X3 = REPO / "configs/topologies/p3x3-d4.yaml"
ONE_HOST = REPO / "configs/topologies/1p1d-one-host.yaml"
TUNING = Path(__file__).parent / "data" / "tuning"  # stand-ins for the EPLB/DeepEP files the profile names


def rendered(path: Path, **kube_options) -> list[KubeFile]:
    cfg = load_config(path)
    kube_options.setdefault("tuning_dir", TUNING)
    return render_files(checked(cfg), kube_spec(cfg, RELEASE, **kube_options), RELEASE)


def objects(files: list[KubeFile], kind: str | None = None) -> list[dict]:
    return [o for f in files for o in f.objects if kind is None or o["kind"] == kind]


def by_name(files: list[KubeFile], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects(files, kind)}


def server_container(lws_obj: dict) -> dict:
    return lws_obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]


def lb_container(files: list[KubeFile]) -> dict:
    (deployment,) = objects(files, "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def selected(selector: dict[str, str], pods: list[lws.Pod]) -> list[str]:
    return [p.name for p in pods if all(p.labels.get(k) == v for k, v in selector.items())]


def lws_template(sets: list[dict], pod: lws.Pod) -> dict:
    """The pod template LWS makes `pod` from."""
    (s,) = [s for s in sets if s["metadata"]["name"] == pod.labels[lws.NAME_LABEL]]
    t = s["spec"]["leaderWorkerTemplate"]
    return t.get("leaderTemplate", t["workerTemplate"]) if pod.labels[lws.WORKER_INDEX_LABEL] == "0" else t["workerTemplate"]


# --------------------------------------------------------------------------- offline schema validation

def test_lws_schema_is_the_pinned_release():
    text = gzip.decompress(LWS_SCHEMA.read_bytes()).decode()
    assert f"kubernetes-sigs/lws {LWS_VERSION}" in text and "2161f38ff333f9e24d3c44adef7cd5d9787cac00" in text
    assert lws.API_VERSION == "leaderworkerset.x-k8s.io/v1"


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda p: p.stem)
def test_every_object_validates(topology):
    files = rendered(topology)
    kinds = [o["kind"] for o in objects(files)]
    cfg = load_config(topology)
    groups = cfg.prefill.groups + cfg.decode.groups
    assert kinds.count("LeaderWorkerSet") == groups and kinds.count("Service") == groups + 1
    assert kinds.count("Deployment") == 1
    for obj in objects(files):
        assert problems(obj) == [], (obj["kind"], obj["metadata"]["name"])


@pytest.mark.parametrize(
    "kind,edit,needle",
    [
        ("LeaderWorkerSet", lambda o: server_container(o).__setitem__("imagePullPolcy", "Always"),
         "'imagePullPolcy' was unexpected"),
        ("LeaderWorkerSet", lambda o: o["spec"]["leaderWorkerTemplate"].__setitem__("size", "3"),
         "'3' is not of type 'integer'"),
        ("LeaderWorkerSet", lambda o: o["spec"]["leaderWorkerTemplate"].pop("workerTemplate"),
         "'workerTemplate' is a required property"),
        ("LeaderWorkerSet", lambda o: o["spec"].__setitem__("startupPolicy", "WorkersFirst"), "is not one of"),
        ("LeaderWorkerSet", lambda o: server_container(o)["resources"]["limits"].__setitem__("nvidia.com/gpu", 8),
         "nvidia.com/gpu"),
        ("Service", lambda o: o["spec"]["ports"][0].__setitem__("port", "30000"), "spec.ports.0.port"),
        ("Service", lambda o: o["spec"].__setitem__("clusterIp", "None"), "spec.clusterIp"),
        ("Deployment", lambda o: o["spec"].pop("selector"), "spec.selector"),
        ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0].pop("name"), "containers.0.name"),
    ],
)
def test_validation_rejects_what_the_api_server_would(kind, edit, needle):
    obj = copy.deepcopy(objects(rendered(P3X3), kind)[0])
    edit(obj)
    found = problems(obj)
    assert any(needle in p for p in found), found


# --------------------------------------------------------------------------- pods, Services and the LB agree

@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda p: p.stem)
def test_pods_services_and_lb_agree(topology, monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # what every pod has: the API server's Service
    cfg = load_config(topology)
    kube = kube_spec(cfg, RELEASE, tuning_dir=TUNING)
    files = render_files(checked(cfg), kube, RELEASE)
    sets, services = objects(files, "LeaderWorkerSet"), by_name(files, "Service")
    all_pods = [p for s in sets for p in lws.pods(s)]
    assert len(all_pods) == cfg.total_nodes
    leaders: dict[str, lws.Pod] = {}  # Service DNS name -> the pod it selects
    for role in ROLES:
        spec = cfg.role(role)
        role_sets = [s for s in sets if s["metadata"]["labels"]["app.kubernetes.io/component"] == role]
        assert len(role_sets) == spec.groups
        for group, s in enumerate(role_sets):
            name = s["metadata"]["name"]
            pods = lws.pods(s)
            gpus = int(server_container(s)["resources"]["limits"][kube.gpu_resource])
            assert len(pods) == spec.nodes == s["spec"]["leaderWorkerTemplate"]["size"] and gpus == spec.gpus
            leader_addr = f"{pods[0].name}.{name}.{kube.namespace}"  # the leader's record in LWS's Service
            for worker, pod in enumerate(pods):
                f = flags(pod.command().args)
                assert f["--node-rank"] == [str(worker)] and pod.labels[lws.WORKER_INDEX_LABEL] == str(worker)
                assert f["--nnodes"] == [str(spec.nodes)] == [pod.env[lws.GROUP_SIZE]]
                assert f["--dist-init-addr"] == [f"{leader_addr}:{spec.dist_init_port}"]
                assert f["--tp-size"] == [str(spec.nodes * gpus)] and f["--disaggregation-mode"] == [role]
                assert f["--host"] == ["0.0.0.0"] and "--base-gpu-id" not in f
            service = services[leader_service(cfg, role, group)]
            assert service["spec"]["clusterIP"] == "None"
            assert selected(service["spec"]["selector"], all_pods) == [pods[0].name]
            fqdn = f"{service['metadata']['name']}.{kube.namespace}.svc.{kube.cluster_domain}"
            leaders[fqdn] = pods[0]
    lb_cfg = config_from_args(build_parser().parse_args(lb_container(files)["args"]))
    if kube.lb_discovery:  # the LB's selectors find exactly the leaders, on their port and bootstrap port
        assert lb_cfg.prefills == [] and lb_cfg.decodes == [] and lb_cfg.discovery.namespace == kube.namespace
        for role in ROLES:
            leader_pods = [p for p in all_pods if selected(lb_cfg.discovery.selectors[role], [p])]
            assert sorted(p.name for p in leader_pods) == sorted(
                p.name for p in leaders.values() if flags(p.command().args)["--disaggregation-mode"] == [role])
            for pod in leader_pods:
                f = flags(pod.command().args)
                assert f["--port"] == [str(lb_cfg.discovery.port)]
                annotations = lws_template(sets, pod)["metadata"].get("annotations", {})
                if role == "prefill":
                    assert annotations == {lb_cfg.discovery.bootstrap_annotation: f["--disaggregation-bootstrap-port"][0]}
                else:
                    assert annotations == {}
        leaders.clear()
    dialed = [(url, port, "prefill") for url, port in lb_cfg.prefills] + [(u, None, "decode") for u in lb_cfg.decodes]
    assert len(dialed) == len(leaders)
    for url, bootstrap, role in dialed:
        parts = urlsplit(url)
        pod = leaders.pop(parts.hostname)  # each leader dialed exactly once
        f = flags(pod.command().args)
        assert f["--disaggregation-mode"] == [role] and f["--port"] == [str(parts.port)]
        if role == "prefill":
            assert f["--disaggregation-bootstrap-port"] == [str(bootstrap)]
    lb_service = services[lb_name(cfg)]
    assert lb_cfg.port == cfg.lb.port == lb_service["spec"]["ports"][0]["targetPort"]
    assert selected(lb_service["spec"]["selector"], all_pods) == []  # the LB Service never reaches a server
    (deployment,) = objects(files, "Deployment")
    lb_pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (lb_service["spec"]["selector"], deployment["spec"]["selector"]["matchLabels"]):
        assert selector and all(lb_pod_labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------- what the profiles ask for

def test_p3x3_d4_pods_get_the_h800_profiles_network_resources_and_env():
    files = rendered(P3X3)
    assert [f.name for f in files] == [
        "p3x3-d4-tuning.yaml", "p3x3-d4-prefill-0.yaml", "p3x3-d4-prefill-1.yaml", "p3x3-d4-prefill-2.yaml",
        "p3x3-d4-decode-0.yaml", "p3x3-d4-lb.yaml",
    ]
    sets = by_name(files, "LeaderWorkerSet")
    decode = sets["p3x3-d4-decode-0"]
    template = decode["spec"]["leaderWorkerTemplate"]
    assert (template["size"], template["restartPolicy"], decode["spec"]["startupPolicy"]) == (
        4, "RecreateGroupOnPodRestart", "LeaderCreated")
    pod = template["workerTemplate"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H800"}
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/rdma_shared_device_a": "1"}
    assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert {"name": "models", "hostPath": {"path": "/models", "type": "Directory"}} in pod["volumes"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NCCL_SOCKET_IFNAME"]["value"] == "bond0" and env["NCCL_IB_HCA"]["value"] == "mlx5_0,mlx5_1,mlx5_2,mlx5_3"
    assert env["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"]["value"] == "128"  # decode-only DeepEP knob
    assert "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK" not in {
        e["name"] for e in server_container(sets["p3x3-d4-prefill-0"])["env"]}
    assert env["SGLANG_HOST_IP"] == {"name": "SGLANG_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert c["image"] == "registry.example.com/inference/sglang-p2p-backend:0.5.23" and decode["metadata"]["namespace"] == "sglang-pd"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 30000, "dist-init": 5757}
    prefill_ports = {p["name"]: p["port"] for p in by_name(files, "Service")["p3x3-d4-prefill-1-leader"]["spec"]["ports"]}
    assert prefill_ports == {"http": 30000, "bootstrap": 8998}


def test_probes_never_generate_for_liveness_and_wait_longer_than_sglangs_health():
    """SGLang's /health generates one token and waits up to 20 s: liveness on it recreated busy groups."""
    files = rendered(P3X3)
    template = by_name(files, "LeaderWorkerSet")["p3x3-d4-decode-0"]["spec"]["leaderWorkerTemplate"]
    leader, worker = (template[k]["spec"]["containers"][0] for k in ("leaderTemplate", "workerTemplate"))
    # the leader's /model_info is the HTTP process alone; nodes > 0 run SGLang's stand-in health server
    assert leader["livenessProbe"]["httpGet"] == {"path": "/model_info", "port": 30000}
    assert worker["livenessProbe"]["httpGet"] == {"path": "/health", "port": 30000}
    for c in (leader, worker):
        assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["readinessProbe"]["timeoutSeconds"] > 20
        startup = c["startupProbe"]
        assert startup["httpGet"]["path"] == "/health" and startup["timeoutSeconds"] > 20
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600  # the profile's startup_timeout_s
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 60  # only a server silent for a minute
    assert {k: v for k, v in leader.items() if k != "livenessProbe"} == {k: v for k, v in worker.items() if k != "livenessProbe"}
    lb = lb_container(files)
    assert lb["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    # /metrics needs no key even with --api-key (/workers does: liveness would fail and restart the LB)
    assert lb["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": 8000}
    from sglang_p2p_lb.auth import OPEN_PATHS
    assert "/metrics" in OPEN_PATHS and "/workers" not in OPEN_PATHS


def test_one_host_profile_renders_plain_pods_without_host_addresses():
    files = rendered(ONE_HOST)
    sets = by_name(files, "LeaderWorkerSet")
    assert sorted(sets) == ["pd-1p1d-one-host-decode-0", "pd-1p1d-one-host-prefill-0"]  # names start with a letter
    decode = sets["pd-1p1d-one-host-decode-0"]
    pod = decode["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    assert "hostNetwork" not in pod and "securityContext" not in pod["containers"][0]
    (cmd,) = [p.command() for p in lws.pods(decode)]
    f = flags(cmd.args)
    # the profile pins decode to GPU 1 of a shared host; a pod sees its one GPU as GPU 0
    assert "--base-gpu-id" not in f and f["--port"] == ["30001"] and f["--host"] == ["0.0.0.0"]
    assert "SGLANG_HOST_IP" not in cmd.env  # the profile's 127.0.0.1 is replaced by the pod's own address
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert decode["metadata"]["namespace"] == "default"


def test_namespace_and_image_options_reach_every_name():
    files = rendered(P3X3, namespace="team-a", image="registry.example/sglang-p2p:1")
    assert {o["metadata"]["namespace"] for o in objects(files)} == {"team-a"}
    assert {server_container(s)["image"] for s in objects(files, "LeaderWorkerSet")} == {"registry.example/sglang-p2p:1"}
    assert lb_container(files)["image"] == "registry.example/sglang-p2p:1"
    args = lb_container(files)["args"]
    assert args[args.index("--service-discovery-namespace") + 1] == "team-a"
    (binding,) = objects(files, "RoleBinding")
    assert binding["subjects"][0]["namespace"] == "team-a"  # the LB's service account, where it runs
    static = rendered(ONE_HOST, namespace="team-a")  # a profile without discovery dials the leader Services
    urls = [a for a in lb_container(static)["args"] if a.startswith("http://")]
    assert urls and all(".team-a.svc.cluster.local:" in u for u in urls)
    pod = lws.pods(objects(files, "LeaderWorkerSet")[0])[1]
    assert flags(pod.command().args)["--dist-init-addr"] == ["p3x3-d4-prefill-0-0.p3x3-d4-prefill-0.team-a:5757"]


def test_kubelet_expansion():
    env = {"A": "x", "LWS_WORKER_INDEX": "2"}
    assert lws.expand("$(LWS_WORKER_INDEX)", env) == "2"
    assert lws.expand("$(A):$(A)", env) == "x:x"
    assert lws.expand("$$(A)", env) == "$(A)"  # escaped
    assert lws.expand("$(UNSET)", env) == "$(UNSET)"  # left as written, as the kubelet does


# --------------------------------------------------------------------------- CLI output

def test_cli_stdout_is_the_objects_as_one_yaml_stream(capsys):
    assert cli.run(["k8s", "--config", str(P3X3), "--no-check", "--sglang-version", RELEASE,
                    "--tuning-dir", str(TUNING)], {}) == 0
    out = capsys.readouterr().out
    assert list(yaml.safe_load_all(out)) == [o for o in objects(rendered(P3X3))]
    assert "&id" not in out and "*id" not in out  # no YAML aliases for shared label maps


def test_cli_folder_output_applies_per_group_and_names_stale_files(tmp_path, capsys):
    (tmp_path / "p3x3-d4-prefill-3.yaml").write_text("# a group of an earlier render\n")
    args = ["k8s", "--config", str(P3X3), "--no-check", "--sglang-version", RELEASE, "--out", str(tmp_path),
            "--tuning-dir", str(TUNING)]
    assert cli.run(args, {}) == 0
    out = capsys.readouterr().out
    for f in rendered(P3X3):
        assert list(yaml.safe_load_all((tmp_path / f.name).read_text())) == list(f.objects)
        assert f"# wrote {tmp_path / f.name}" in out
    assert f"not part of this topology: {tmp_path / 'p3x3-d4-prefill-3.yaml'}" in out


def test_cli_needs_no_host_addresses_for_kubernetes(variant, capsys):
    path = variant("p2-d2", lambda d: d.pop("hosts"))
    assert cli.run(["node", "--config", str(path), "--rank", "0", "--print-only", "--no-check"], {}) == cli.EXIT_CONFIG
    assert "missing address" in capsys.readouterr().err
    assert cli.run(["k8s", "--config", str(path), "--no-check", "--tuning-dir", str(TUNING)], {}) == 0
    assert "kind: LeaderWorkerSet" in capsys.readouterr().out


# --------------------------------------------------------------------------- broken inputs

def k8s_problems(path: Path) -> list[str]:
    cfg = load_config(path)
    with pytest.raises(ConfigError) as info:
        render_files(checked(cfg), kube_spec(cfg, RELEASE, tuning_dir=TUNING), RELEASE)
    return info.value.problems


def with_kubernetes(tmp_path: Path, section: dict, env: dict | None = None):
    """An edit for `variant`: the h800 cluster profile with keys of its kubernetes: section replaced
    (None: removed), its tuning_dir the tests' stand-ins, and `env` merged into its env."""
    cluster = yaml.safe_load((REPO / "configs/clusters/h800x8-ib.yaml").read_text())
    merged = {**cluster["kubernetes"], "tuning_dir": str(TUNING), **section}
    cluster["kubernetes"] = {k: v for k, v in merged.items() if v is not None}
    cluster["env"] = {k: v for k, v in {**cluster["env"], **(env or {})}.items() if v is not None}
    out = tmp_path / "cluster.yaml"
    out.write_text(yaml.safe_dump(cluster))
    return lambda d: d.__setitem__("cluster", str(out))


def test_name_too_long_for_a_pod_hostname(variant):
    # 47 characters: `<name>-prefill-2-leader` has 64, `<name>-decode-0-leader` exactly 63 (allowed)
    (problem,) = k8s_problems(variant("p3x3-d4", lambda d: d.__setitem__("name", "deepseek-v3-" + "x" * 35)))
    assert problem.startswith(f"`deepseek-v3-{'x' * 35}-prefill-2-leader` is longer than 63 characters")
    assert "shorten the topology's `name:`" in problem


def test_port_clash_inside_a_pod_names_the_pod(variant):
    (problem,) = k8s_problems(variant("p2-d2", lambda d: d["prefill"].__setitem__("bootstrap_port", 5760)))
    assert problem.startswith("port clash on p2-d2-prefill-0-0:") and "ports 5757-5763" in problem


@pytest.mark.parametrize(
    "section,needle",
    [
        ({"hostNetwork": True}, "unknown key `hostNetwork` in `kubernetes`"),
        ({"volumes": [{"name": "models", "path": "/models", "host_path": "/m", "claim": "pvc"}]},
         "needs exactly one of `host_path` and `claim`"),
        ({"lb_service_type": "Ingress"}, "must be one of ClusterIP, NodePort, LoadBalancer"),
        ({"volumes": [{"name": "dshm", "path": "/data", "claim": "pvc"}]}, "other than `dshm`"),
        ({"namespace": "Team_A"}, "is not a lowercase DNS label"),
        ({"host_network": "yes"}, "`kubernetes.host_network` must be true or false"),
    ],
)
def test_broken_kubernetes_section(variant, tmp_path, section, needle):
    (problem,) = k8s_problems(variant("p2-d2", with_kubernetes(tmp_path, section)))
    assert needle in problem


def test_cli_writes_nothing_for_a_broken_topology(variant, tmp_path, capsys):
    path = variant("p2-d2", lambda d: d["decode"].__setitem__("tp", 8))
    out = tmp_path / "out"
    assert cli.run(["k8s", "--config", str(path), "--no-check", "--out", str(out)], {}) == cli.EXIT_CONFIG
    assert "decode: tp 8 leaves GPUs" in capsys.readouterr().err and not out.exists()


# --------------------------------------------------------------------------- the image

def test_dockerfile_installs_the_project_on_a_supported_sglang_image():
    text = (REPO / "launch/Dockerfile").read_text()
    (base,) = re.findall(r"^ARG SGLANG_IMAGE=lmsysorg/sglang:v(\S+)$", text, re.M)
    assert base in SUPPORTED
    # the repository and tag the docs build and push
    assert kube_spec(load_config(P3X3), base).image == f"registry.example.com/inference/sglang-p2p-backend:{base}"
    copied = {src for line in re.findall(r"^COPY (.+) \S+$", text, re.M) for src in line.split()}
    pyproject = (REPO / "pyproject.toml").read_text()
    roots = re.search(r'where = \[(.*)\]', pyproject).group(1).replace('"', "").replace(" ", "").split(",")
    needed = {"pyproject.toml", "README.md", "sglang_p2p_backend"} | {r for r in roots if r != "."}
    assert needed <= copied and all((REPO / c).exists() for c in copied)
    assert "pip install --no-cache-dir --no-deps" in text and "sglang.srt.plugins" in text
