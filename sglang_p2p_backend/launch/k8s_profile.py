"""The `kubernetes:` section of a cluster profile: what a pod of this cluster needs beyond the SGLang
command (image, GPU and RDMA resources, host networking, shared memory, volumes, node selection).

Read only when rendering Kubernetes objects, so a launch on hosts never depends on it; every key has a
default, so a profile without the section still renders (one GPU resource per GPU, pod networking).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from .config import ConfigError, LaunchConfig, _Reader

_KEYS = {
    "namespace", "image", "host_network", "gpu_resource", "resources", "shm_size", "capabilities", "privileged",
    "volumes", "node_selector", "env", "startup_timeout_s", "lb_service_type", "cluster_domain",
}
_VOLUME_KEYS = {"name", "path", "host_path", "claim", "read_only"}
_SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
# RFC 1123 label: namespaces, volume names
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
IMAGE_REPOSITORY = "sglang-p2p-backend"  # the tag docs/launch.md builds launch/Dockerfile as
SHM_VOLUME = "dshm"  # the renderer's /dev/shm volume


@dataclass(frozen=True)
class Volume:
    """A host path or a PersistentVolumeClaim mounted at `path` (model weights, EPLB/DeepEP files)."""

    name: str
    path: str
    host_path: str | None
    claim: str | None
    read_only: bool


@dataclass(frozen=True)
class KubeSpec:
    namespace: str
    image: str
    host_network: bool
    gpu_resource: str
    resources: Mapping[str, str]  # extra limits of every server pod, e.g. an RDMA device plugin's resource
    shm_size: str
    capabilities: tuple[str, ...]
    privileged: bool
    volumes: tuple[Volume, ...]
    node_selector: Mapping[str, str]
    env: Mapping[str, str]  # merged over the profiles' env in every server pod (pod-side interface names)
    startup_timeout_s: int
    lb_service_type: str
    cluster_domain: str


def _boolean(r: _Reader, raw: Mapping[str, Any], key: str, default: bool, where: str = "kubernetes") -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        r.problems.append(f"{r.path}: `{where}.{key}` must be true or false, got {value!r}")
        return default
    return value


def _strings(r: _Reader, raw: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        r.problems.append(f"{r.path}: `kubernetes.{key}` must be a list of names, e.g. [IPC_LOCK]")
        return ()
    return tuple(value)


def _volumes(r: _Reader, raw: Any) -> tuple[Volume, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        r.problems.append(f"{r.path}: `kubernetes.volumes` must be a list of {{name, path, host_path or claim}}")
        return ()
    out = []
    for i, item in enumerate(raw):
        where = f"kubernetes.volumes[{i}]"
        v = r.mapping(item, where, _VOLUME_KEYS)
        name, path = r.text(v.get("name"), f"{where}.name", ""), r.text(v.get("path"), f"{where}.path", "")
        host_path, claim = r.text(v.get("host_path"), f"{where}.host_path", None), r.text(v.get("claim"), f"{where}.claim", None)
        if not name or not _DNS_LABEL.match(name) or name == SHM_VOLUME:
            r.problems.append(f"{r.path}: `{where}.name` must be a lowercase DNS label such as `models` other "
                              f"than `{SHM_VOLUME}` (the pod's /dev/shm), got {name!r}")
        if not path or not path.startswith("/"):
            r.problems.append(f"{r.path}: `{where}.path` must be an absolute path in the container, got {path!r}")
        if (host_path is None) == (claim is None):
            r.problems.append(f"{r.path}: `{where}` needs exactly one of `host_path` and `claim` (a PVC name)")
        out.append(Volume(name or "", path or "", host_path, claim, _boolean(r, v, "read_only", False, where)))
    return tuple(out)


def kube_spec(cfg: LaunchConfig, release: str, namespace: str | None = None, image: str | None = None) -> KubeSpec:
    """The section of cfg's cluster profile; `namespace`/`image` (command-line options) replace its values."""
    r = _Reader(Path(cfg.cluster_source))
    raw = r.mapping(dict(cfg.kubernetes), "kubernetes", _KEYS)
    ns = namespace or r.text(raw.get("namespace"), "kubernetes.namespace", "default") or "default"
    if not _DNS_LABEL.match(ns):
        r.problems.append(f"namespace {ns!r} is not a lowercase DNS label (RFC 1123): pick e.g. `sglang-pd`")
    service_type = r.text(raw.get("lb_service_type"), "kubernetes.lb_service_type", "ClusterIP") or "ClusterIP"
    if service_type not in _SERVICE_TYPES:
        r.problems.append(f"{r.path}: `kubernetes.lb_service_type` must be one of {', '.join(_SERVICE_TYPES)}")
    spec = KubeSpec(
        namespace=ns,
        # the image must hold the SGLang release the flags are rendered for
        image=image or r.text(raw.get("image"), "kubernetes.image", None) or f"{IMAGE_REPOSITORY}:{release}",
        host_network=_boolean(r, raw, "host_network", False),
        gpu_resource=r.text(raw.get("gpu_resource"), "kubernetes.gpu_resource", "nvidia.com/gpu") or "nvidia.com/gpu",
        resources=MappingProxyType(r.env(raw.get("resources"), "kubernetes.resources")),
        shm_size=r.text(raw.get("shm_size"), "kubernetes.shm_size", "64Gi") or "64Gi",
        capabilities=_strings(r, raw, "capabilities"),
        privileged=_boolean(r, raw, "privileged", False),
        volumes=_volumes(r, raw.get("volumes")),
        node_selector=MappingProxyType(r.env(raw.get("node_selector"), "kubernetes.node_selector")),
        env=MappingProxyType(r.env(raw.get("env"), "kubernetes.env")),
        startup_timeout_s=r.integer(raw.get("startup_timeout_s"), "kubernetes.startup_timeout_s", 3600, 60) or 3600,
        lb_service_type=service_type,
        cluster_domain=r.text(raw.get("cluster_domain"), "kubernetes.cluster_domain", "cluster.local") or "cluster.local",
    )
    if r.problems:
        raise ConfigError(cfg.source, r.problems)
    return spec
