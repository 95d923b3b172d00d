"""The pod templates of the servers, shared by the LeaderWorkerSet and RoleBasedGroup renderings: the
SGLang container (flags, env, Secrets, ports, probes, resources, mounts) and the pod around it
(networking, IPC, volumes, scheduling). Only how a pod learns its place in its group differs between the
two workloads: the names of the variables their controllers inject (`Placement`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .config import LaunchConfig
from .k8s_profile import CACHE_PATH, CACHE_VOLUME, CPU_PER_GPU, MEMORY_PER_GPU_GI, SHM_VOLUME, KubeSpec, SecretRef
from .k8s_tuning import TuningFile
from .render import SGLANG_PROGRAM, server_args

BIND_ALL = "0.0.0.0"  # the pod (or, with host networking, the node) is the boundary; probes dial the pod IP
HOST_IP_VAR = "SGLANG_HOST_IP"
PROBE_PERIOD_S = 10
# SGLang's /health runs a one-token generation through the scheduler and waits up to 20 s for it
# (SGLANG_HEALTH_CHECK_TIMEOUT): a probe must wait longer than SGLang itself does
HEALTH_TIMEOUT_S = 25
LIVENESS_TIMEOUT_S = 10
LIVENESS_FAILURES = 6
# /model_info is answered by the leader's HTTP process from what it loaded: no scheduler, no generation.
# Nodes > 0 serve only SGLang's stand-in health server, whose /health answers without generating.
LEADER_LIVENESS_PATH = "/model_info"
WORKER_LIVENESS_PATH = "/health"
TUNING_VOLUME = "tuning"
LEADER_LABEL = "sglang-p2p-backend/leader"  # "true" on each group's node 0: Services and LB discovery select it
GROUP_LABEL = "sglang-p2p-backend/group"  # <role>-<group>: one server's pods (PDBs)
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"  # smg's default --bootstrap-port-annotation
# caches that live under the cache mount whatever the image's defaults are
CACHE_ENV = {"SGLANG_DG_CACHE_DIR": f"{CACHE_PATH}/deep_gemm", "TRITON_CACHE_DIR": f"{CACHE_PATH}/triton"}


@dataclass(frozen=True)
class Placement:
    """The variables a workload controller injects into every container of a group's pods."""

    leader_address: str  # DNS name of the group's node 0
    worker_index: str  # 0 on the leader


def base_name(cfg: LaunchConfig) -> str:
    """The topology's name as a DNS-1035 label prefix (Service names must start with a letter)."""
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.name.lower()).strip("-")
    return name if name[:1].isalpha() else f"pd-{name}"


def labels(cfg: LaunchConfig, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "sglang-pd", "app.kubernetes.io/instance": base_name(cfg),
            "app.kubernetes.io/component": component}


def group_labels(cfg: LaunchConfig, role: str, group: int) -> dict[str, str]:
    return {**labels(cfg, role), GROUP_LABEL: f"{role}-{group}"}


def meta(name: str, kube: KubeSpec, lbls: Mapping[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": kube.namespace, "labels": dict(lbls)}


def http_probe(port: int, path: str, failures: int, timeout_s: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": timeout_s, "failureThreshold": failures}


def secret_env(refs: Mapping[str, SecretRef]) -> list[dict[str, Any]]:
    return [{"name": k, "valueFrom": {"secretKeyRef": {"name": r.secret, "key": r.key}}} for k, r in refs.items()]


def image_fields(kube: KubeSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"image": kube.image}
    if kube.image_pull_policy:
        out["imagePullPolicy"] = kube.image_pull_policy
    return out


def pull_secrets(kube: KubeSpec) -> dict[str, Any]:
    return {"imagePullSecrets": [{"name": s} for s in kube.image_pull_secrets]} if kube.image_pull_secrets else {}


def _requests(kube: KubeSpec, gpus: int) -> dict[str, str]:
    # without cpu/memory requests a pod is BestEffort: the first the kubelet evicts under memory pressure
    return {"cpu": str(CPU_PER_GPU * gpus), "memory": f"{MEMORY_PER_GPU_GI * gpus}Gi", **kube.requests}


def _probes(spec_port: int, kube: KubeSpec, leader: bool) -> dict[str, Any]:
    return {
        # loading weights and JIT-compiling takes far longer than any liveness budget (nodes > 0 open their
        # health port only once their schedulers are up), so liveness starts after the first success
        "startupProbe": http_probe(spec_port, "/health", math.ceil(kube.startup_timeout_s / PROBE_PERIOD_S),
                                   HEALTH_TIMEOUT_S),
        # not ready takes the pod out of Service endpoints only; the leader Services publish not-ready
        # addresses and the LB health-checks the servers itself
        "readinessProbe": http_probe(spec_port, "/health", 3, HEALTH_TIMEOUT_S),
        # a failed liveness restarts the pod and the controller recreates the whole group (a member of a
        # torch.distributed group cannot rejoin): ask something that never generates, so a server busy with
        # a long prefill is not mistaken for a dead one
        "livenessProbe": http_probe(spec_port, LEADER_LIVENESS_PATH if leader else WORKER_LIVENESS_PATH,
                                    LIVENESS_FAILURES, LIVENESS_TIMEOUT_S),
    }


def _container(cfg: LaunchConfig, kube: KubeSpec, role: str, release: str, placement: Placement, leader: bool,
               tuning: list[TuningFile]) -> dict[str, Any]:
    spec = cfg.role(role)
    args = server_args(
        cfg, role, release, bind_host=BIND_ALL,
        dist_init_addr=f"$({placement.leader_address}):{spec.dist_init_port}", node_rank=f"$({placement.worker_index})",
        base_gpu_id=None, port=spec.port, bootstrap_port=spec.bootstrap_port,
    )
    env = {k: v for k, v in {**spec.env, **kube.env}.items() if k != HOST_IP_VAR}
    if kube.cache is not None:
        env = {**CACHE_ENV, **env}
    ports = [{"name": "http", "containerPort": spec.port}]
    if role == "prefill":
        ports.append({"name": "bootstrap", "containerPort": spec.bootstrap_port})
    ports.append({"name": "dist-init", "containerPort": spec.dist_init_port})
    mounts = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    if kube.cache is not None:
        mounts.append({"name": CACHE_VOLUME, "mountPath": kube.cache.path})
    mounts += [{"name": v.name, "mountPath": v.path, "readOnly": v.read_only} for v in kube.volumes]
    # one file each, at the path the flag names, so the folder around it stays the image's
    mounts += [{"name": TUNING_VOLUME, "mountPath": f.path, "subPath": f.key, "readOnly": True}
               for f in tuning if f.role == role]
    container: dict[str, Any] = {
        "name": "sglang",
        **image_fields(kube),
        "command": [cfg.python, *SGLANG_PROGRAM],
        "args": args,
        "env": [
            # Secrets first: a plain value may refer to one as $(NAME)
            *secret_env(kube.secret_env),
            *({"name": k, "value": v} for k, v in env.items()),
            # the address SGLang hands peers (bootstrap registration, KV transfer): the pod's own, whatever
            # a profile wrote for hosts (e.g. 127.0.0.1 on one host)
            {"name": HOST_IP_VAR, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "ports": ports,
        # extended resources (GPUs, RDMA devices) default their request to the limit
        "resources": {"requests": _requests(kube, spec.gpus),
                      "limits": {kube.gpu_resource: str(spec.gpus), **kube.resources}},
        **_probes(spec.port, kube, leader),
        "volumeMounts": mounts,
    }
    security: dict[str, Any] = {}
    if kube.capabilities:  # IPC_LOCK: RDMA registration pins memory
        security["capabilities"] = {"add": list(kube.capabilities)}
    if kube.privileged:
        security["privileged"] = True
    if security:
        container["securityContext"] = security
    return container


def _volumes(cfg: LaunchConfig, kube: KubeSpec, role: str, tuning: list[TuningFile]) -> list[dict[str, Any]]:
    # NCCL's shared-memory transport and torch's shared tensors between the node's ranks; the runtime's
    # default /dev/shm is 64 MB
    out: list[dict[str, Any]] = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": kube.shm_size}}]
    if kube.cache is not None:
        out.append(_volume(kube.cache.name, kube.cache.host_path, kube.cache.claim, False, "DirectoryOrCreate"))
    out += [_volume(v.name, v.host_path, v.claim, v.read_only, "Directory") for v in kube.volumes]
    if any(f.role == role for f in tuning):
        out.append({"name": TUNING_VOLUME, "configMap": {"name": tuning_name(cfg)}})
    return out


def _volume(name: str, host_path: str | None, claim: str | None, read_only: bool, kind: str) -> dict[str, Any]:
    if host_path is not None:
        return {"name": name, "hostPath": {"path": host_path, "type": kind}}
    return {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}


def scheduling(kube: KubeSpec) -> dict[str, Any]:
    """Pod-spec fields that place server pods: node selection, taints, affinity, priority, scheduler."""
    out: dict[str, Any] = {}
    if kube.node_selector:
        out["nodeSelector"] = dict(kube.node_selector)
    if kube.tolerations:
        out["tolerations"] = [dict(t) for t in kube.tolerations]
    if kube.affinity:
        out["affinity"] = dict(kube.affinity)
    if kube.priority_class:
        out["priorityClassName"] = kube.priority_class
    if kube.scheduler_name:
        out["schedulerName"] = kube.scheduler_name
    return out


def server_template(cfg: LaunchConfig, kube: KubeSpec, role: str, group: int | None, release: str,
                    placement: Placement, leader: bool, tuning: list[TuningFile]) -> dict[str, Any]:
    """The pod template of a group's leader (node 0) or of its workers: one command, the node rank from
    `placement`; they differ in the liveness path and the leader's discovery label and annotation.
    `group` None: a template every group of the role shares (labelled by role only)."""
    spec = cfg.role(role)
    pod: dict[str, Any] = {
        "containers": [_container(cfg, kube, role, release, placement, leader, tuning)],
        "volumes": _volumes(cfg, kube, role, tuning),
        **pull_secrets(kube),
    }
    if kube.host_network:
        # RDMA/NCCL/DeepEP peers dial the node's own interfaces; ClusterFirstWithHostNet keeps cluster DNS
        # (the leader address, the prefill leaders' names the LB hands to decode) resolvable
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    if kube.host_ipc:
        pod["hostIPC"] = True
    pod.update(scheduling(kube))
    metadata: dict[str, Any] = {"labels": labels(cfg, role) if group is None else group_labels(cfg, role, group)}
    if leader:
        metadata["labels"][LEADER_LABEL] = "true"
        if role == "prefill":
            metadata["annotations"] = {BOOTSTRAP_ANNOTATION: str(spec.bootstrap_port)}
    return {"metadata": metadata, "spec": pod}


def tuning_name(cfg: LaunchConfig) -> str:
    return f"{base_name(cfg)}-tuning"


def tuning_configmap(cfg: LaunchConfig, kube: KubeSpec, tuning: list[TuningFile]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(tuning_name(cfg), kube, labels(cfg, "tuning")),
            "data": {f.key: f.text for f in tuning}}
