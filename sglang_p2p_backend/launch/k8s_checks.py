"""What would keep a rendered deployment from starting or staying up on a real cluster, found before
anything is written: an image no node can pull, JIT kernels recompiled at every group recreation, DeepEP
across nodes without RDMA device access or with the wrong RoCE GID, keys written into the YAML in plain
text, gang scheduling without a scheduler, and discovery that cannot reach both roles on one port.
Pure: reads the LaunchConfig and the KubeSpec only; every message names the fix.
"""

from __future__ import annotations

import re

from .config import ROLES, LaunchConfig
from .k8s_profile import CACHE_PATH, IMAGE_REPOSITORY, KubeSpec

# what a variable's or flag's name looks like when its value is a credential
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)$", re.I)
_ENV_REFERENCE = re.compile(r"^\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)$")
LB_KEY_FLAGS = ("api-key", "admin-api-key", "control-plane-api-keys")
SERVER_KEY_FLAGS = ("api-key", "admin-api-key")
JIT_DEEPGEMM = "SGLANG_ENABLE_JIT_DEEPGEMM"


def has_registry(image: str) -> bool:
    """Docker's rule: the first path component names a registry when it has a dot or a port, or is localhost."""
    first, sep, _ = image.partition("/")
    return bool(sep) and ("." in first or ":" in first or first == "localhost")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _image_problems(cfg: LaunchConfig, kube: KubeSpec, release: str) -> list[str]:
    example = f"registry.example.com/{IMAGE_REPOSITORY}:{release}"
    if kube.image is None:
        return [f"no image: build launch/Dockerfile for SGLang {release}, push it to a registry the nodes can "
                f"pull from, then set `kubernetes.registry` (or `kubernetes.image`) in {cfg.cluster_source} "
                f"or pass --image, e.g. --image {example}"]
    if not has_registry(kube.image):
        return [f"image `{kube.image}` names no registry, so every node would try Docker Hub: push it to your "
                f"registry and name it in full, e.g. {example} (`localhost:5000/...` for a local one)"]
    return []


def _cache_problems(cfg: LaunchConfig, kube: KubeSpec) -> list[str]:
    if kube.cache is not None:
        return []
    jit = [role for role in ROLES if _truthy({**cfg.role(role).env, **kube.env}.get(JIT_DEEPGEMM))]
    if not jit:
        return []
    return [f"{JIT_DEEPGEMM}=1 ({', '.join(jit)}) compiles DeepGEMM kernels into {CACHE_PATH} at every start, "
            f"and a group recreation starts every pod afresh: set `kubernetes.cache` (`host_path:` on each "
            f"node, or `claim:` of a ReadWriteMany PVC) so the kernels survive"]


def _deepep_problems(cfg: LaunchConfig, kube: KubeSpec) -> list[str]:
    found = []
    for role in ROLES:
        spec = cfg.role(role)
        if spec.args.get("moe-a2a-backend") != "deepep" or spec.nodes < 2:
            continue
        env = {**spec.env, **kube.env}
        if not kube.privileged and not kube.resources:
            found.append(f"{role}: DeepEP across {spec.nodes} nodes needs the RDMA NICs in the pod: list your "
                         f"RDMA device plugin's resource under `kubernetes.resources` (with `capabilities: "
                         f"[IPC_LOCK]`), or set `kubernetes.privileged: true`")
        elif not kube.privileged and "IPC_LOCK" not in kube.capabilities:
            found.append(f"{role}: DeepEP's NVSHMEM registers pinned memory with the NICs: add IPC_LOCK to "
                         f"`kubernetes.capabilities`")
        if "NCCL_IB_GID_INDEX" in env and "NVSHMEM_IB_GID_INDEX" not in env:
            found.append(f"{role}: NCCL_IB_GID_INDEX={env['NCCL_IB_GID_INDEX']} (RoCE) but no NVSHMEM_IB_GID_INDEX: "
                         f"DeepEP's NVSHMEM does not read NCCL's variable and would pick GID 0 (RoCE v1, not "
                         f"routable); set NVSHMEM_IB_GID_INDEX to the same index in the cluster profile's env")
    return found


def _plain_key_problems(cfg: LaunchConfig, kube: KubeSpec) -> list[str]:
    found = []
    plain: dict[str, list[str]] = {}
    for role in ROLES:
        for name in {**cfg.role(role).env, **kube.env}:
            plain.setdefault(name, []).append(role)
    for name, roles in sorted(plain.items()):
        if name in kube.secret_env:
            found.append(f"{name} is both a plain env value and in `kubernetes.secret_env`: keep only the Secret")
        elif _SECRET_NAME.search(name):
            found.append(f"{name} ({', '.join(roles)} env) would be written into the YAML in plain text: store it "
                         f"in a Secret and name it under `kubernetes.secret_env` ({name}: <secret>/<key>) instead")
    for role in ROLES:
        found += _flag_key_problems(dict(cfg.role(role).args), SERVER_KEY_FLAGS, kube.secret_env, f"{role}.args",
                                    "secret_env")
    found += _flag_key_problems(dict(cfg.lb.args), LB_KEY_FLAGS, kube.lb_secret_env, "lb.args", "lb_secret_env")
    return found


def _flag_key_problems(args: dict, flags: tuple[str, ...], secret_env, where: str, section: str) -> list[str]:
    found = []
    for flag in flags:
        value = args.get(flag)
        if value is None or value is False:
            continue
        m = _ENV_REFERENCE.match(str(value))
        if m is None or m.group(1) not in secret_env:
            found.append(f"`{where}.{flag}` would be written into the YAML in plain text: put the key in a Secret, "
                         f"name it under `kubernetes.{section}` (e.g. API_KEY: <secret>/<key>) and write "
                         f"`{flag}: $(API_KEY)`, which the kubelet fills in")
    return found


def _scheduling_problems(cfg: LaunchConfig, kube: KubeSpec) -> list[str]:
    found = []
    if kube.gang and not kube.scheduler_name:
        found.append("`kubernetes.gang: true` needs a gang scheduler: set `kubernetes.scheduler_name` (e.g. "
                     "`volcano`, with the LWS/RBG controller configured for it)")
    if kube.lb_discovery and cfg.prefill.port != cfg.decode.port:
        found.append(f"`kubernetes.lb_discovery` gives the LB one port for every discovered pod "
                     f"(--service-discovery-port), but prefill serves on {cfg.prefill.port} and decode on "
                     f"{cfg.decode.port}: give both roles one `port:`")
    return found


def problems(cfg: LaunchConfig, kube: KubeSpec, release: str) -> list[str]:
    return (_image_problems(cfg, kube, release) + _cache_problems(cfg, kube) + _deepep_problems(cfg, kube)
            + _plain_key_problems(cfg, kube) + _scheduling_problems(cfg, kube))
