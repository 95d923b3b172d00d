"""Renders a topology as Kubernetes objects: for every prefill and decode group a LeaderWorkerSet (one pod
per node, the leader is node 0) with a headless Service that names its leader, the tuning files in a
ConfigMap, optional PodDisruptionBudgets, and the load balancer as a Deployment with a Service (and, when
it discovers the servers itself, the ServiceAccount and Role that let it watch pods). Plain dicts ready
for YAML: no cluster, no Kubernetes client needed. `rbg` renders the same pods as a RoleBasedGroup.

The SGLang flags are the ones `render` gives the node launches; only where a pod runs differs: the
dist-init address and node rank come from the variables LWS injects (filled in by the kubelet), and the
LB dials the leaders' Service names (or finds the leader pods by label) instead of host addresses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from . import k8s_checks, lws
from .config import ROLES, ConfigError, LaunchConfig, Node
from .k8s_pod import (
    BIND_ALL, BOOTSTRAP_ANNOTATION, LEADER_LABEL, Placement, base_name, group_labels, image_fields, labels, meta,
    http_probe, pull_secrets, secret_env, server_template, tuning_configmap,
)
from .k8s_profile import KubeSpec
from .k8s_tuning import TuningFile, tuning_files
from .render import LB_PROGRAM, flag_tokens, lb_args
from .validate import problems

DNS_LABEL_MAX = 63
# The LB keeps in-flight counts and live P/D channels in its process: a second replica would balance on
# half of the picture, so it runs as one pod that the Deployment replaces when it dies.
LB_REPLICAS = 1
LWS_PLACEMENT = Placement(leader_address=lws.LEADER_ADDRESS, worker_index=lws.WORKER_INDEX)


@dataclass(frozen=True)
class KubeFile:
    name: str  # file name under --out
    objects: tuple[dict[str, Any], ...]


def group_name(cfg: LaunchConfig, role: str, group: int) -> str:
    return f"{base_name(cfg)}-{role}-{group}"


def leader_service(cfg: LaunchConfig, role: str, group: int) -> str:
    return f"{group_name(cfg, role, group)}-leader"  # LWS itself owns a headless Service named like the LWS


def leader_dns(cfg: LaunchConfig, kube: KubeSpec, role: str, group: int) -> str:
    return f"{leader_service(cfg, role, group)}.{kube.namespace}.svc.{kube.cluster_domain}"


def service_node(cfg: LaunchConfig, kube: KubeSpec, role: str, group: int) -> Node:
    """A group's leader as the LB dials it in the cluster: its Service's DNS name and the role's ports."""
    spec = cfg.role(role)
    return Node(-1, role, group, 0, leader_dns(cfg, kube, role, group), port=spec.port,
                bootstrap_port=spec.bootstrap_port, dist_init_port=spec.dist_init_port)


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


def deployable(cfg: LaunchConfig, kube: KubeSpec, release: str) -> list[TuningFile]:
    """What the cluster needs beyond a valid topology (image, cache, device access, Secrets, the tuning
    files); returns the tuning files, raises ConfigError with every problem."""
    tuning, found = tuning_files(cfg, kube.tuning_dir)
    found = k8s_checks.problems(cfg, kube, release) + found
    if found:
        raise ConfigError(cfg.source, found)
    return tuning


def leader_service_object(cfg: LaunchConfig, kube: KubeSpec, role: str, group: int,
                          selector: dict[str, str]) -> dict[str, Any]:
    spec = cfg.role(role)
    ports = [{"name": "http", "port": spec.port, "targetPort": spec.port}]
    if role == "prefill":
        ports.append({"name": "bootstrap", "port": spec.bootstrap_port, "targetPort": spec.bootstrap_port})
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": meta(leader_service(cfg, role, group), kube, group_labels(cfg, role, group)),
        "spec": {
            "clusterIP": "None",  # headless: the name resolves to the leader pod's own address
            # the LB health-checks the servers itself; the name must not vanish when /health is slow under load
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": ports,
        },
    }


def disruption_budget(kube: KubeSpec, name: str, lbls: dict[str, str]) -> dict[str, Any]:
    """No voluntary eviction of any pod of a group: evicting one recreates the whole group, so a drain
    waits until the group is removed on purpose (`kubectl delete -f` its file)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta(name, kube, lbls),
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": lbls}}}


def _lws_group_file(cfg: LaunchConfig, kube: KubeSpec, role: str, group: int, release: str,
                    tuning: list[TuningFile]) -> KubeFile:
    spec = cfg.role(role)
    name = group_name(cfg, role, group)
    # group-index too: a replica added by `kubectl scale` is not this group's leader
    selector = {lws.NAME_LABEL: name, lws.GROUP_INDEX_LABEL: "0", lws.WORKER_INDEX_LABEL: "0"}
    template = {"size": spec.nodes, "restartPolicy": "RecreateGroupOnPodRestart"}
    template["leaderTemplate"] = server_template(cfg, kube, role, group, release, LWS_PLACEMENT, True, tuning)
    if spec.nodes > 1:
        template["workerTemplate"] = server_template(cfg, kube, role, group, release, LWS_PLACEMENT, False, tuning)
    else:  # the CRD requires a workerTemplate even for size 1; LWS then uses it for nothing
        template["workerTemplate"] = template.pop("leaderTemplate")
    leader_worker_set = {
        "apiVersion": lws.API_VERSION, "kind": "LeaderWorkerSet",
        "metadata": meta(name, kube, group_labels(cfg, role, group)),
        "spec": {
            "replicas": 1,  # one SGLang server; more groups are more LeaderWorkerSets
            # workers start with the leader: the leader's server needs every node before it can serve
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "Shared"},  # the LWS_LEADER_ADDRESS form lws.py expects
            "leaderWorkerTemplate": template,
        },
    }
    objects = [leader_service_object(cfg, kube, role, group, selector), leader_worker_set]
    if kube.pdb:
        objects.append(disruption_budget(kube, name, group_labels(cfg, role, group)))
    return KubeFile(f"{name}.yaml", tuple(objects))


# --------------------------------------------------------------------------- the load balancer

def discovery_args(cfg: LaunchConfig, kube: KubeSpec) -> list[str]:
    """smg's --service-discovery flags: the leaders of this topology's groups, by label, in this namespace."""
    instance = f"app.kubernetes.io/instance={base_name(cfg)}"
    return [
        "--service-discovery",
        "--prefill-selector", instance, "app.kubernetes.io/component=prefill", f"{LEADER_LABEL}=true",
        "--decode-selector", instance, "app.kubernetes.io/component=decode", f"{LEADER_LABEL}=true",
        "--service-discovery-namespace", kube.namespace,
        "--service-discovery-port", str(cfg.prefill.port),
        "--bootstrap-port-annotation", BOOTSTRAP_ANNOTATION,
    ]


def lb_args_for(cfg: LaunchConfig, kube: KubeSpec) -> list[str]:
    if not kube.lb_discovery:
        return lb_args(cfg, lambda role, group: service_node(cfg, kube, role, group), BIND_ALL)
    args = [*discovery_args(cfg, kube), "--host", BIND_ALL, "--port", str(cfg.lb.port)]
    if cfg.lb.policy:
        args += ["--policy", cfg.lb.policy]
    return args + flag_tokens(cfg.lb.args, 1)


def _rbac(cfg: LaunchConfig, kube: KubeSpec, name: str, lbls: dict[str, str]) -> list[dict[str, Any]]:
    """Read access to the namespace's pods, nothing else: what the LB's pod watch needs."""
    subject = {"kind": "ServiceAccount", "name": name, "namespace": kube.namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(name, kube, lbls)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(name, kube, lbls),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(name, kube, lbls),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [subject]},
    ]


def lb_pod_spec(cfg: LaunchConfig, kube: KubeSpec) -> dict[str, Any]:
    port = cfg.lb.port
    container: dict[str, Any] = {
        "name": "lb",
        **image_fields(kube),
        "command": [cfg.python, *LB_PROGRAM],
        "args": lb_args_for(cfg, kube),
        "ports": [{"name": "http", "containerPort": port}],
        # /health is 503 until one prefill and one decode are healthy: no client traffic before that
        "readinessProbe": http_probe(port, "/health", 3, 5),
        # ... which is why liveness asks /metrics: it answers whenever the event loop runs, needs no key
        # (with --api-key every route but /health and /metrics does), so the LB is not restarted in a loop
        # while the servers load for tens of minutes
        "livenessProbe": http_probe(port, "/metrics", 6, 5),
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},  # one asyncio process
    }
    if kube.lb_secret_env:
        container["env"] = secret_env(kube.lb_secret_env)
    spec: dict[str, Any] = {"containers": [container], **pull_secrets(kube)}
    if kube.priority_class:  # without the LB nothing is served: it must not be preempted before the servers
        spec["priorityClassName"] = kube.priority_class
    if kube.lb_discovery:
        spec["serviceAccountName"] = lb_name(cfg)
    return spec


def lb_objects(cfg: LaunchConfig, kube: KubeSpec) -> list[dict[str, Any]]:
    name, lbls, port = lb_name(cfg), labels(cfg, "lb"), cfg.lb.port
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(name, kube, lbls),
        "spec": {"replicas": LB_REPLICAS, "selector": {"matchLabels": lbls},
                 "template": {"metadata": {"labels": lbls}, "spec": lb_pod_spec(cfg, kube)}},
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta(name, kube, lbls),
        "spec": {"type": kube.lb_service_type, "selector": lbls,
                 "ports": [{"name": "http", "port": port, "targetPort": port}]},
    }
    return [*(_rbac(cfg, kube, name, lbls) if kube.lb_discovery else []), deployment, service]


def tuning_file(cfg: LaunchConfig, kube: KubeSpec, tuning: list[TuningFile]) -> list[KubeFile]:
    if not tuning:
        return []
    return [KubeFile(f"{base_name(cfg)}-tuning.yaml", (tuning_configmap(cfg, kube, tuning),))]


def render_files(cfg: LaunchConfig, kube: KubeSpec, release: str) -> list[KubeFile]:
    """The tuning ConfigMap's file (if any), one file per group (its Service, LeaderWorkerSet and PDB),
    prefill groups first, then the LB's. Raises ConfigError when the cluster could not run it."""
    tuning = deployable(cfg, kube, release)
    groups = [_lws_group_file(cfg, kube, role, g, release, tuning)
              for role in ROLES for g in range(cfg.role(role).groups)]
    return [*tuning_file(cfg, kube, tuning), *groups, KubeFile(f"{lb_name(cfg)}.yaml", tuple(lb_objects(cfg, kube)))]
