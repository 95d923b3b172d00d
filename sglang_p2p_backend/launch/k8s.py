"""Renders a topology as Kubernetes objects: for every prefill and decode group a LeaderWorkerSet (one pod
per node, the leader is node 0) with a headless Service that names its leader, and the load balancer as a
Deployment with a Service. Plain dicts ready for YAML: no cluster, no Kubernetes client needed.

The SGLang flags are the ones `render` gives the node launches; only where a pod runs differs: the
dist-init address and node rank come from the variables LWS injects (filled in by the kubelet), and the
LB dials the leaders' Service names instead of host addresses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from . import lws
from .config import ROLES, ConfigError, LaunchConfig
from .k8s_profile import SHM_VOLUME, KubeSpec
from .render import LB_PROGRAM, SGLANG_PROGRAM, Command, lb_args, server_args
from .validate import problems

BIND_ALL = "0.0.0.0"  # the pod (or, with host networking, the node) is the boundary; probes dial the pod IP
HOST_IP_VAR = "SGLANG_HOST_IP"
DNS_LABEL_MAX = 63
PROBE_PERIOD_S = 10
# The LB keeps in-flight counts and live P/D channels in its process: a second replica would balance on
# half of the picture, so it runs as one pod that the Deployment replaces when it dies.
LB_REPLICAS = 1


@dataclass(frozen=True)
class KubeFile:
    name: str  # file name under --out
    objects: tuple[dict[str, Any], ...]


def base_name(cfg: LaunchConfig) -> str:
    """The topology's name as a DNS-1035 label prefix (Service names must start with a letter)."""
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.name.lower()).strip("-")
    return name if name[:1].isalpha() else f"pd-{name}"


def group_name(cfg: LaunchConfig, role: str, group: int) -> str:
    return f"{base_name(cfg)}-{role}-{group}"


def leader_service(cfg: LaunchConfig, role: str, group: int) -> str:
    return f"{group_name(cfg, role, group)}-leader"  # LWS itself owns a headless Service named like the LWS


def leader_dns(cfg: LaunchConfig, kube: KubeSpec, role: str, group: int) -> str:
    return f"{leader_service(cfg, role, group)}.{kube.namespace}.svc.{kube.cluster_domain}"


def lb_name(cfg: LaunchConfig) -> str:
    return f"{base_name(cfg)}-lb"


def placed(cfg: LaunchConfig) -> LaunchConfig:
    """The topology as Kubernetes places it, for `validate`: every node is a pod of its own (named as LWS
    names it), the LB another pod, and no --base-gpu-id (a pod sees only the GPUs it was given, from 0)."""
    hosts = tuple(lws.pod_name(group_name(cfg, n.role, n.group), 0, n.node_rank) for n in cfg.nodes())
    return replace(
        cfg, hosts=hosts, hosts_source="the pods", lb=replace(cfg.lb, host=lb_name(cfg)),
        prefill=replace(cfg.prefill, base_gpu_id=None), decode=replace(cfg.decode, base_gpu_id=None),
    )


def _name_problems(cfg: LaunchConfig) -> list[str]:
    found = []
    for role in ROLES:
        spec = cfg.role(role)
        last = spec.groups - 1
        longest = (lws.pod_name(group_name(cfg, role, last), 0, spec.nodes - 1), leader_service(cfg, role, last))
        found += [
            f"`{n}` is longer than {DNS_LABEL_MAX} characters (a pod's hostname and a Service's name are DNS "
            f"labels): shorten the topology's `name:`"
            for n in longest if len(n) > DNS_LABEL_MAX
        ]
    return found


def checked(cfg: LaunchConfig) -> LaunchConfig:
    """Validates the topology as placed in pods; raises ConfigError with every problem."""
    view = placed(cfg)
    found = _name_problems(cfg) + problems(view)
    if found:
        raise ConfigError(cfg.source, found)
    return view


def _meta(name: str, kube: KubeSpec, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": kube.namespace, "labels": labels}


def _labels(cfg: LaunchConfig, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "sglang-pd", "app.kubernetes.io/instance": base_name(cfg),
            "app.kubernetes.io/component": component}


def _http_probe(port: int, path: str, failures: int, timeout_s: int = 5) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": timeout_s, "failureThreshold": failures}


def _server_container(cfg: LaunchConfig, kube: KubeSpec, role: str, release: str) -> dict[str, Any]:
    spec = cfg.role(role)
    args = server_args(
        cfg, role, release, bind_host=BIND_ALL,
        dist_init_addr=f"$({lws.LEADER_ADDRESS}):{spec.dist_init_port}", node_rank=f"$({lws.WORKER_INDEX})",
        base_gpu_id=None,
    )
    env = {k: v for k, v in {**spec.env, **kube.env}.items() if k != HOST_IP_VAR}
    ports = [{"name": "http", "containerPort": spec.port}]
    if role == "prefill":
        ports.append({"name": "bootstrap", "containerPort": spec.bootstrap_port})
    ports.append({"name": "dist-init", "containerPort": spec.dist_init_port})
    container: dict[str, Any] = {
        "name": "sglang",
        "image": kube.image,
        "command": [cfg.python, *SGLANG_PROGRAM],
        "args": args,
        "env": [
            *({"name": k, "value": v} for k, v in env.items()),
            # the address SGLang hands peers (bootstrap registration, KV transfer): the pod's own, whatever
            # a profile wrote for hosts (e.g. 127.0.0.1 on one host)
            {"name": HOST_IP_VAR, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "ports": ports,
        # extended resources (GPUs, RDMA devices) default their request to the limit
        "resources": {"limits": {kube.gpu_resource: str(spec.gpus), **kube.resources}},
        # nodes > 0 serve /health only once their schedulers are up: loading weights and JIT-compiling
        # takes far longer than any liveness budget, so liveness starts after the first success
        "startupProbe": _http_probe(spec.port, "/health", math.ceil(kube.startup_timeout_s / PROBE_PERIOD_S)),
        "readinessProbe": _http_probe(spec.port, "/health", 3),
        # a failed liveness restarts the pod, and LWS then recreates the whole group (one member of a
        # torch.distributed group cannot rejoin): only a server that stopped answering for a minute
        "livenessProbe": _http_probe(spec.port, "/health", 6, timeout_s=10),
        "volumeMounts": [
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
            *({"name": v.name, "mountPath": v.path, "readOnly": v.read_only} for v in kube.volumes),
        ],
    }
    security: dict[str, Any] = {}
    if kube.capabilities:  # IPC_LOCK: RDMA registration pins memory
        security["capabilities"] = {"add": list(kube.capabilities)}
    if kube.privileged:
        security["privileged"] = True
    if security:
        container["securityContext"] = security
    return container


def _volumes(kube: KubeSpec) -> list[dict[str, Any]]:
    # NCCL's shared-memory transport and torch's shared tensors between the node's ranks; the runtime's
    # default /dev/shm is 64 MB
    out: list[dict[str, Any]] = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": kube.shm_size}}]
    for v in kube.volumes:
        if v.host_path is not None:
            out.append({"name": v.name, "hostPath": {"path": v.host_path, "type": "Directory"}})
        else:
            out.append({"name": v.name, "persistentVolumeClaim": {"claimName": v.claim, "readOnly": v.read_only}})
    return out


def _server_pod_spec(cfg: LaunchConfig, kube: KubeSpec, role: str, release: str) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [_server_container(cfg, kube, role, release)], "volumes": _volumes(kube)}
    if kube.host_network:
        # RDMA/NCCL/DeepEP peers dial the node's own interfaces; ClusterFirstWithHostNet keeps cluster DNS
        # (LWS_LEADER_ADDRESS, the prefill leaders' names the LB hands to decode) resolvable
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    if kube.node_selector:
        pod["nodeSelector"] = dict(kube.node_selector)
    return pod


def _group_file(cfg: LaunchConfig, kube: KubeSpec, role: str, group: int, release: str) -> KubeFile:
    spec = cfg.role(role)
    name = group_name(cfg, role, group)
    labels = _labels(cfg, role)
    ports = [{"name": "http", "port": spec.port, "targetPort": spec.port}]
    if role == "prefill":
        ports.append({"name": "bootstrap", "port": spec.bootstrap_port, "targetPort": spec.bootstrap_port})
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(leader_service(cfg, role, group), kube, labels),
        "spec": {
            "clusterIP": "None",  # headless: the name resolves to the leader pod's own address
            # the LB health-checks the servers itself; the name must not vanish when /health is slow under load
            "publishNotReadyAddresses": True,
            # group-index too: a replica added by `kubectl scale` is not this group's leader
            "selector": {lws.NAME_LABEL: name, lws.GROUP_INDEX_LABEL: "0", lws.WORKER_INDEX_LABEL: "0"},
            "ports": ports,
        },
    }
    leader_worker_set = {
        "apiVersion": lws.API_VERSION, "kind": "LeaderWorkerSet", "metadata": _meta(name, kube, labels),
        "spec": {
            "replicas": 1,  # one SGLang server; more groups are more LeaderWorkerSets, each listed in the LB
            # workers start with the leader: the leader's server needs every node before it can serve
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "Shared"},  # the LWS_LEADER_ADDRESS form lws.py expects
            "leaderWorkerTemplate": {
                "size": spec.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                # leader and workers run the same command: the node rank comes from LWS_WORKER_INDEX
                "workerTemplate": {"metadata": {"labels": labels}, "spec": _server_pod_spec(cfg, kube, role, release)},
            },
        },
    }
    return KubeFile(f"{name}.yaml", (service, leader_worker_set))


def _lb_file(cfg: LaunchConfig, kube: KubeSpec) -> KubeFile:
    name, labels, port = lb_name(cfg), _labels(cfg, "lb"), cfg.lb.port
    container = {
        "name": "lb",
        "image": kube.image,
        "command": [cfg.python, *LB_PROGRAM],
        "args": lb_args(cfg, lambda role, group: leader_dns(cfg, kube, role, group), BIND_ALL),
        "ports": [{"name": "http", "containerPort": port}],
        # /health is 503 until one prefill and one decode are healthy: no client traffic before that
        "readinessProbe": _http_probe(port, "/health", 3),
        # ... which is why liveness asks /workers: it answers whenever the event loop runs, so the LB is not
        # restarted in a loop while the servers load for tens of minutes
        "livenessProbe": _http_probe(port, "/workers", 6),
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},  # one asyncio process
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, kube, labels),
        "spec": {"replicas": LB_REPLICAS, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}},
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(name, kube, labels),
        "spec": {"type": kube.lb_service_type, "selector": labels,
                 "ports": [{"name": "http", "port": port, "targetPort": port}]},
    }
    return KubeFile(f"{name}.yaml", (deployment, service))


def render_files(cfg: LaunchConfig, kube: KubeSpec, release: str) -> list[KubeFile]:
    """One file per group (its Service and LeaderWorkerSet), prefill groups first, then the LB's."""
    groups = [_group_file(cfg, kube, role, g, release) for role in ROLES for g in range(cfg.role(role).groups)]
    return [*groups, _lb_file(cfg, kube)]


def server_pod_commands(files: list[KubeFile]) -> list[Command]:
    """The SGLang command of every pod, as LWS and the kubelet will fill it in."""
    return [
        pod.command()
        for f in files for obj in f.objects if obj["kind"] == "LeaderWorkerSet"
        for pod in lws.pods(obj)
    ]
