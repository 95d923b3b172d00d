"""Renders a topology as one RoleBasedGroup (workloads.x-k8s.io/v1alpha2, sgl-project/rbg), the form
SGLang's docs recommend for PD: every prefill and decode group is a role of its own (leaderWorkerPattern,
one pod per node, replicas 1), and the LB is a role that depends on all of them, so the controller starts
it once the servers' roles are ready and rolls the group out as a whole. The pods are the LeaderWorkerSet
rendering's (k8s_pod), with the variables RBG injects instead of LWS's; the leader Services, PDBs and the
LB's Service and RBAC are the same objects.

`pods` replays what the RBG controller and the kubelet make of the roles (names, labels, RBG_LWP_*
variables, the leader template patch), so each pod's command can be checked with SGLang's parser.
Mirrors api/workloads/constants/env.go and pkg/discovery/env_builder.go of rbg v0.8.0-alpha.5.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from .config import ROLES, ConfigError, LaunchConfig
from .k8s import (
    DNS_LABEL_MAX, KubeFile, deployable, disruption_budget, lb_objects, leader_service_object, tuning_file,
)
from .k8s_pod import LEADER_LABEL, Placement, base_name, group_labels, labels, meta, server_template
from .k8s_profile import KubeSpec
from .lws import Pod

API_VERSION = "workloads.x-k8s.io/v1alpha2"
KIND = "RoleBasedGroup"
LEADER_ADDRESS = "RBG_LWP_LEADER_ADDRESS"
WORKER_INDEX = "RBG_LWP_WORKER_INDEX"
GROUP_SIZE = "RBG_LWP_GROUP_SIZE"
GANG_ANNOTATION = "rbg.workloads.x-k8s.io/group-gang-scheduling"
SERVER_LABEL = "sglang-p2p-backend/server"  # on the replayed pods of server roles only
RBG_PLACEMENT = Placement(leader_address=LEADER_ADDRESS, worker_index=WORKER_INDEX)
LB_ROLE = "lb"
# a crash-looping member recreates its role instance, with RBG's backoff between recreations instead of
# recreating it as fast as it fails
RESTART = {"type": "RecreateRoleInstanceOnPodRestart", "baseDelaySeconds": 30, "maxDelaySeconds": 600}


def role_name(role: str, group: int) -> str:
    return f"{role}-{group}"


def _name_problems(cfg: LaunchConfig) -> list[str]:
    rbg, found = base_name(cfg), []
    for role in ROLES:
        spec = cfg.role(role)
        r = role_name(role, spec.groups - 1)
        for n in (f"s-{rbg}-{r}", f"{rbg}-{r}-0-{spec.nodes - 1}"):
            if len(n) > DNS_LABEL_MAX:
                found.append(f"`{n}` (RoleBasedGroup service or pod name) is longer than {DNS_LABEL_MAX} "
                             f"characters: shorten the topology's `name:`")
    return found


def _leader_patch(leader: dict[str, Any], worker: dict[str, Any]) -> dict[str, Any]:
    """What the leader's template adds to the workers': its labels, annotations and liveness probe."""
    (lc,), (wc,) = leader["spec"]["containers"], worker["spec"]["containers"]
    patch: dict[str, Any] = {"metadata": {k: v for k, v in leader["metadata"].items() if k != "labels"}}
    patch["metadata"]["labels"] = {LEADER_LABEL: leader["metadata"]["labels"][LEADER_LABEL]}
    changed = {k: v for k, v in lc.items() if wc.get(k) != v}
    if changed:
        patch["spec"] = {"containers": [{"name": lc["name"], **changed}]}
    return patch


def _server_role(cfg: LaunchConfig, kube: KubeSpec, role: str, group: int, release: str, tuning) -> dict[str, Any]:
    spec = cfg.role(role)
    leader = server_template(cfg, kube, role, group, release, RBG_PLACEMENT, True, tuning)
    worker = server_template(cfg, kube, role, group, release, RBG_PLACEMENT, False, tuning)
    return {
        "name": role_name(role, group),
        "replicas": 1,  # one SGLang server per role; more groups are more roles
        "leaderWorkerPattern": {
            "size": spec.nodes,
            "restartPolicyConfig": dict(RESTART),
            "template": worker,
            "leaderTemplatePatch": _leader_patch(leader, worker),
        },
    }


def _lb_role(cfg: LaunchConfig, kube: KubeSpec, servers: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The LB as a standalone role after every server role; its Service and RBAC stay plain objects."""
    others = lb_objects(cfg, kube)
    (deployment,) = [o for o in others if o["kind"] == "Deployment"]
    role = {"name": LB_ROLE, "replicas": 1, "dependencies": servers,
            "standalonePattern": {"template": copy.deepcopy(deployment["spec"]["template"])}}
    return role, [o for o in others if o["kind"] != "Deployment"]


def render_files(cfg: LaunchConfig, kube: KubeSpec, release: str) -> list[KubeFile]:
    """The tuning ConfigMap's file (if any), then one file with the leader Services, PDBs, the LB's
    Service (and RBAC) and the RoleBasedGroup. Raises ConfigError when the cluster could not run it."""
    found = _name_problems(cfg)
    if found:
        raise ConfigError(cfg.source, found)
    tuning = deployable(cfg, kube, release)
    name = base_name(cfg)
    roles, services, budgets = [], [], []
    for role in ROLES:
        for g in range(cfg.role(role).groups):
            roles.append(_server_role(cfg, kube, role, g, release, tuning))
            selector = {**group_labels(cfg, role, g), LEADER_LABEL: "true"}
            services.append(leader_service_object(cfg, kube, role, g, selector))
            if kube.pdb:
                budgets.append(disruption_budget(cfg, kube, role, g))
    lb_role, lb_others = _lb_role(cfg, kube, [r["name"] for r in roles])
    metadata = meta(name, kube, labels(cfg, "group"))
    if kube.gang:  # the controller makes one PodGroup of all roles' pods for its configured scheduler
        metadata["annotations"] = {GANG_ANNOTATION: "true"}
    group = {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": {"roles": [*roles, lb_role]}}
    objects = (*services, *budgets, *lb_others, group)
    return [*tuning_file(cfg, kube, tuning), KubeFile(f"{name}.yaml", objects)]


def _merged(template: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """A strategic merge patch as far as the leader patch uses it: maps merged, containers by name."""
    out = copy.deepcopy(dict(template))
    for key, value in patch.items():
        if key == "containers":
            by_name = {c["name"]: c for c in out.get("containers", [])}
            for c in value:
                by_name.setdefault(c["name"], {}).update(copy.deepcopy(c))
            out["containers"] = list(by_name.values())
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def leader_template(lwp: Mapping[str, Any]) -> dict[str, Any]:
    """The pod template of a leaderWorkerPattern's leader: the template with the leader patch applied."""
    return _merged(lwp["template"], lwp.get("leaderTemplatePatch", {}))


def pods(group: Mapping[str, Any]) -> list[Pod]:
    """Every pod of a RoleBasedGroup's leaderWorkerPattern and standalone roles, in role order."""
    name, namespace = group["metadata"]["name"], group["metadata"].get("namespace", "default")
    out = []
    for role in group["spec"]["roles"]:
        lwp = role.get("leaderWorkerPattern")
        if lwp is None:
            template = role["standalonePattern"]["template"]
            for replica in range(role.get("replicas", 1)):
                container = template["spec"]["containers"][0]
                env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
                out.append(Pod(f"{name}-{role['name']}-{replica}", template["metadata"].get("labels", {}), env, container))
            continue
        size = lwp.get("size", 1)
        service = f"s-{name}-{role['name']}"
        for replica in range(role.get("replicas", 1)):
            instance = f"{name}-{role['name']}-{replica}"
            for worker in range(size):
                template = lwp["template"] if worker else leader_template(lwp)
                container = template["spec"]["containers"][0]
                # RBG's variables come first in the container's env, so the user's args may refer to them
                env = {LEADER_ADDRESS: f"{instance}-0.{service}.{namespace}", WORKER_INDEX: str(worker),
                       GROUP_SIZE: str(size)}
                for e in container.get("env", []):
                    if e["name"] not in env and "value" in e:
                        env[e["name"]] = e["value"]
                pod_labels = {**template["metadata"].get("labels", {}), SERVER_LABEL: "true",
                              "rbg.workloads.x-k8s.io/role-name": role["name"]}
                out.append(Pod(f"{instance}-{worker}", pod_labels, env, container))
    return out

