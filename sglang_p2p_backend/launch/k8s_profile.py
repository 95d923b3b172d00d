"""The `kubernetes:` section of a cluster profile: what a pod of this cluster needs beyond the SGLang
command (image and pull secrets, GPU and RDMA resources, CPU/memory requests, host networking and IPC,
shared memory, the compile cache, volumes, Secrets, scheduling and disruption rules).

Read only when rendering Kubernetes objects, so a launch on hosts never depends on it. Every key but the
image has a default, so a profile without the section renders once an image is named (`--image`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from .config import ConfigError, LaunchConfig, _Reader

_KEYS = {
    "namespace", "image", "registry", "image_pull_secrets", "image_pull_policy", "host_network", "host_ipc",
    "gpu_resource", "resources", "requests", "shm_size", "capabilities", "privileged", "volumes", "cache",
    "tuning_dir", "node_selector", "tolerations", "affinity", "priority_class", "scheduler_name", "gang",
    "pdb", "env", "secret_env", "lb_secret_env", "lb_discovery", "startup_timeout_s", "lb_service_type",
    "cluster_domain",
}
_VOLUME_KEYS = {"name", "path", "host_path", "claim", "read_only"}
_CACHE_KEYS = {"path", "host_path", "claim"}
_REQUEST_KEYS = {"cpu", "memory"}
_SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# RFC 1123 label: namespaces, volume names, Secret names
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
IMAGE_REPOSITORY = "sglang-p2p-backend"  # the repository docs/launch.md builds launch/Dockerfile as
SHM_VOLUME = "dshm"  # the renderer's /dev/shm volume
CACHE_VOLUME = "cache"  # kernels compiled at startup (DeepGEMM JIT, Triton), kept across group recreations
CACHE_PATH = "/root/.cache"  # SGLang's image runs as root: ~/.cache holds SGLang's and DeepGEMM's caches
# what the CPU/memory requests default to per GPU of a pod when the profile gives none: enough for the
# scheduler processes, tokenizer and detokenizer of one rank each, and the page cache of weight loading
CPU_PER_GPU = 4
MEMORY_PER_GPU_GI = 64


@dataclass(frozen=True)
class Volume:
    """A host path or a PersistentVolumeClaim mounted at `path` (model weights, the compile cache)."""

    name: str
    path: str
    host_path: str | None
    claim: str | None
    read_only: bool


@dataclass(frozen=True)
class SecretRef:
    """An environment variable read from a key of a Secret, never written into the YAML."""

    secret: str
    key: str


@dataclass(frozen=True)
class KubeSpec:
    namespace: str
    image: str | None  # None: no image named; `k8s_checks` stops the render with the fix
    image_pull_secrets: tuple[str, ...]
    image_pull_policy: str | None
    host_network: bool
    host_ipc: bool
    gpu_resource: str
    resources: Mapping[str, str]  # extra limits of every server pod, e.g. an RDMA device plugin's resource
    requests: Mapping[str, str]  # cpu/memory of every server pod; empty: per-GPU defaults
    shm_size: str
    capabilities: tuple[str, ...]
    privileged: bool
    volumes: tuple[Volume, ...]
    cache: Volume | None
    tuning_dir: Path | None
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]
    priority_class: str | None
    scheduler_name: str | None
    gang: bool
    pdb: bool
    env: Mapping[str, str]  # merged over the profiles' env in every server pod (pod-side interface names)
    secret_env: Mapping[str, SecretRef]  # server pods
    lb_secret_env: Mapping[str, SecretRef]  # the LB pod (its keys: SGLANG_P2P_LB_API_KEY, ..._ADMIN_KEY)
    lb_discovery: bool
    startup_timeout_s: int
    lb_service_type: str
    cluster_domain: str


def _boolean(r: _Reader, raw: Mapping[str, Any], key: str, default: bool, where: str = "kubernetes") -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        r.problems.append(f"{r.path}: `{where}.{key}` must be true or false, got {value!r}")
        return default
    return value


def _strings(r: _Reader, raw: Mapping[str, Any], key: str, example: str) -> tuple[str, ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        r.problems.append(f"{r.path}: `kubernetes.{key}` must be a list of names, e.g. [{example}]")
        return ()
    return tuple(value)


def _volume(r: _Reader, item: Any, where: str, keys: set[str], default_path: str | None) -> Volume:
    v = r.mapping(item, where, keys)
    name = r.text(v.get("name"), f"{where}.name", CACHE_VOLUME if default_path else "")
    path = r.text(v.get("path"), f"{where}.path", default_path)
    host_path, claim = r.text(v.get("host_path"), f"{where}.host_path", None), r.text(v.get("claim"), f"{where}.claim", None)
    if not name or not _DNS_LABEL.match(name) or name == SHM_VOLUME:
        r.problems.append(f"{r.path}: `{where}.name` must be a lowercase DNS label such as `models` other "
                          f"than `{SHM_VOLUME}` (the pod's /dev/shm), got {name!r}")
    if not path or not path.startswith("/"):
        r.problems.append(f"{r.path}: `{where}.path` must be an absolute path in the container, got {path!r}")
    if (host_path is None) == (claim is None):
        r.problems.append(f"{r.path}: `{where}` needs exactly one of `host_path` and `claim` (a PVC name)")
    return Volume(name or "", path or "", host_path, claim, _boolean(r, v, "read_only", False, where))


def _volumes(r: _Reader, raw: Any) -> tuple[Volume, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        r.problems.append(f"{r.path}: `kubernetes.volumes` must be a list of {{name, path, host_path or claim}}")
        return ()
    out = tuple(_volume(r, item, f"kubernetes.volumes[{i}]", _VOLUME_KEYS, None) for i, item in enumerate(raw))
    if any(v.name == CACHE_VOLUME for v in out):
        r.problems.append(f"{r.path}: `kubernetes.volumes`: the name `{CACHE_VOLUME}` is the compile cache's: "
                          f"set it under `kubernetes.cache`")
    return out


def _secret_env(r: _Reader, raw: Any, key: str) -> Mapping[str, SecretRef]:
    """`VAR: secret-name/key`: the variable comes from that Secret's key (kubectl create secret generic)."""
    out = {}
    for name, ref in r.mapping(raw, f"kubernetes.{key}", None).items():
        secret, _, item = str(ref).partition("/")
        if not _ENV_NAME.match(str(name)) or not _DNS_SUBDOMAIN.match(secret) or not _SECRET_KEY.match(item):
            r.problems.append(f"{r.path}: `kubernetes.{key}.{name}` must read `<secret-name>/<key>`, e.g. "
                              f"`sglang-p2p-keys/auth-key`, got {ref!r}")
            continue
        out[str(name)] = SecretRef(secret, item)
    return MappingProxyType(out)


def _tolerations(r: _Reader, raw: Any) -> tuple[Mapping[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        r.problems.append(f"{r.path}: `kubernetes.tolerations` must be a list of pod tolerations, e.g. "
                          f"[{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]")
        return ()
    return tuple(MappingProxyType(dict(t)) for t in raw)


def kube_spec(
    cfg: LaunchConfig, release: str, namespace: str | None = None, image: str | None = None,
    tuning_dir: str | Path | None = None,
) -> KubeSpec:
    """The section of cfg's cluster profile; `namespace`/`image`/`tuning_dir` (command-line options)
    replace its values. A profile's `tuning_dir` is relative to the profile's own folder."""
    r = _Reader(Path(cfg.cluster_source))
    raw = r.mapping(dict(cfg.kubernetes), "kubernetes", _KEYS)
    ns = namespace or r.text(raw.get("namespace"), "kubernetes.namespace", "default") or "default"
    if not _DNS_LABEL.match(ns):
        r.problems.append(f"namespace {ns!r} is not a lowercase DNS label (RFC 1123): pick e.g. `sglang-pd`")
    service_type = r.text(raw.get("lb_service_type"), "kubernetes.lb_service_type", "ClusterIP") or "ClusterIP"
    if service_type not in _SERVICE_TYPES:
        r.problems.append(f"{r.path}: `kubernetes.lb_service_type` must be one of {', '.join(_SERVICE_TYPES)}")
    pull_policy = r.text(raw.get("image_pull_policy"), "kubernetes.image_pull_policy", None)
    if pull_policy is not None and pull_policy not in _PULL_POLICIES:
        r.problems.append(f"{r.path}: `kubernetes.image_pull_policy` must be one of {', '.join(_PULL_POLICIES)}")
    registry = r.text(raw.get("registry"), "kubernetes.registry", None)
    # the image must hold the SGLang release the flags are rendered for
    chosen = image or r.text(raw.get("image"), "kubernetes.image", None)
    if chosen is None and registry:
        chosen = f"{registry.rstrip('/')}/{IMAGE_REPOSITORY}:{release}"
    cache = None
    if raw.get("cache") is not None:
        cache = _volume(r, raw["cache"], "kubernetes.cache", _CACHE_KEYS, CACHE_PATH)
    profile_tuning = r.text(raw.get("tuning_dir"), "kubernetes.tuning_dir", None)
    tuning = Path(tuning_dir) if tuning_dir is not None else (
        Path(os.path.normpath(Path(cfg.cluster_source).parent / profile_tuning)) if profile_tuning else None)
    requests = r.env(raw.get("requests"), "kubernetes.requests")
    for key in requests:
        if key not in _REQUEST_KEYS:
            r.problems.append(f"{r.path}: `kubernetes.requests` takes `cpu` and `memory` (GPUs and devices go "
                              f"in `gpu_resource`/`resources`), got `{key}`")
    affinity = raw.get("affinity") or {}
    if not isinstance(affinity, dict):
        r.problems.append(f"{r.path}: `kubernetes.affinity` must be a pod affinity mapping (nodeAffinity, ...)")
        affinity = {}
    spec = KubeSpec(
        namespace=ns,
        image=chosen,
        image_pull_secrets=_strings(r, raw, "image_pull_secrets", "regcred"),
        image_pull_policy=pull_policy,
        host_network=_boolean(r, raw, "host_network", False),
        host_ipc=_boolean(r, raw, "host_ipc", False),
        gpu_resource=r.text(raw.get("gpu_resource"), "kubernetes.gpu_resource", "nvidia.com/gpu") or "nvidia.com/gpu",
        resources=MappingProxyType(r.env(raw.get("resources"), "kubernetes.resources")),
        requests=MappingProxyType(requests),
        shm_size=r.text(raw.get("shm_size"), "kubernetes.shm_size", "64Gi") or "64Gi",
        capabilities=_strings(r, raw, "capabilities", "IPC_LOCK"),
        privileged=_boolean(r, raw, "privileged", False),
        volumes=_volumes(r, raw.get("volumes")),
        cache=cache,
        tuning_dir=tuning,
        node_selector=MappingProxyType(r.env(raw.get("node_selector"), "kubernetes.node_selector")),
        tolerations=_tolerations(r, raw.get("tolerations")),
        affinity=MappingProxyType(dict(affinity)),
        priority_class=r.text(raw.get("priority_class"), "kubernetes.priority_class", None),
        scheduler_name=r.text(raw.get("scheduler_name"), "kubernetes.scheduler_name", None),
        gang=_boolean(r, raw, "gang", False),
        pdb=_boolean(r, raw, "pdb", False),
        env=MappingProxyType(r.env(raw.get("env"), "kubernetes.env")),
        secret_env=_secret_env(r, raw.get("secret_env"), "secret_env"),
        lb_secret_env=_secret_env(r, raw.get("lb_secret_env"), "lb_secret_env"),
        lb_discovery=_boolean(r, raw, "lb_discovery", False),
        startup_timeout_s=r.integer(raw.get("startup_timeout_s"), "kubernetes.startup_timeout_s", 3600, 60) or 3600,
        lb_service_type=service_type,
        cluster_domain=r.text(raw.get("cluster_domain"), "kubernetes.cluster_domain", "cluster.local") or "cluster.local",
    )
    if r.problems:
        raise ConfigError(cfg.source, r.problems)
    return spec
