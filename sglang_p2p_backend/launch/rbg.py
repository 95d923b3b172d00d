"""Renders a topology as one RoleBasedGroup (workloads.x-k8s.io/v1alpha2, sgl-project/rbg), the form
SGLang's docs recommend for PD: a `prefill` and a `decode` role whose replicas are the groups (each a
leaderWorkerPattern instance, one pod per node), and the LB as a role that depends on both, so the
controller starts it once the servers are ready. A group more or fewer is the role's `replicas`; a new
template rolls over the role one group at a time. The pods are the LeaderWorkerSet rendering's (k8s_pod),
with the variables RBG injects instead of LWS's.

The LB always finds the leaders by label (its pod discovery): RBG names a group's pods after an instance
it creates, so there is no stable per-group Service name to list.

`pods` replays what the RBG controller and the kubelet make of the roles (names, labels, RBG_LWP_*
variables, the leader template patch), so each pod's command can be checked with SGLang's parser.
Mirrors api/workloads/constants/env.go and pkg/discovery/env_builder.go of rbg v0.8.0-alpha.5; the
instance names `<group>-<role>-<replica>` are this replay's, for the parser check and messages.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Mapping

from .config import ROLES, ConfigError, LaunchConfig
from .k8s import DNS_LABEL_MAX, KubeFile, deployable, disruption_budget, lb_objects, tuning_file
from .k8s_pod import LEADER_LABEL, Placement, base_name, labels, meta, server_template
from .k8s_profile import KubeSpec
from .lws import Pod

API_VERSION = "workloads.x-k8s.io/v1alpha2"
KIND = "RoleBasedGroup"
LEADER_ADDRESS = "RBG_LWP_LEADER_ADDRESS"
WORKER_INDEX = "RBG_LWP_WORKER_INDEX"
GROUP_SIZE = "RBG_LWP_GROUP_SIZE"
GANG_ANNOTATION = "rbg.workloads.x-k8s.io/group-gang-scheduling"
ROLE_LABEL = "rbg.workloads.x-k8s.io/role-name"
SERVER_LABEL = "sglang-p2p-backend/server"  # on the replayed pods of server roles only
RBG_PLACEMENT = Placement(leader_address=LEADER_ADDRESS, worker_index=WORKER_INDEX)
LB_ROLE = "lb"
# a crash-looping member recreates its role instance, with RBG's backoff between recreations instead of
# recreating it as fast as it fails
RESTART = {"type": "RecreateRoleInstanceOnPodRestart", "baseDelaySeconds": 30, "maxDelaySeconds": 600}
# one group at a time, and no extra group during the update: a surge group needs a whole set of GPU nodes
ROLLOUT = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}


def _name_problems(cfg: LaunchConfig) -> list[str]:
    rbg, found = base_name(cfg), []
    for role in ROLES:
        spec = cfg.role(role)
        for n in (f"s-{rbg}-{role}", f"{rbg}-{role}-{spec.groups - 1}-{spec.nodes - 1}"):
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


def _server_role(cfg: LaunchConfig, kube: KubeSpec, role: str, release: str, tuning) -> dict[str, Any]:
    spec = cfg.role(role)
    leader = server_template(cfg, kube, role, None, release, RBG_PLACEMENT, True, tuning)
    worker = server_template(cfg, kube, role, None, release, RBG_PLACEMENT, False, tuning)
    return {
        "name": role,
        "replicas": spec.groups,  # one SGLang server per replica
        "rolloutStrategy": copy.deepcopy(ROLLOUT),
        "leaderWorkerPattern": {
            "size": spec.nodes,
            "restartPolicyConfig": dict(RESTART),
            "template": worker,
            "leaderTemplatePatch": _leader_patch(leader, worker),
        },
    }


def render_files(cfg: LaunchConfig, kube: KubeSpec, release: str) -> list[KubeFile]:
    """The tuning ConfigMap's file (if any), then one file with the PDBs, the LB's Service and RBAC and the
    RoleBasedGroup. Raises ConfigError when the cluster could not run it."""
    found = _name_problems(cfg)
    if found:
        raise ConfigError(cfg.source, found)
    kube = replace(kube, lb_discovery=True)
    tuning = deployable(cfg, kube, release)
    name = base_name(cfg)
    roles = [_server_role(cfg, kube, role, release, tuning) for role in ROLES]
    budgets = [disruption_budget(kube, f"{name}-{role}", labels(cfg, role)) for role in ROLES] if kube.pdb else []
    lb_others = lb_objects(cfg, kube)
    (deployment,) = [o for o in lb_others if o["kind"] == "Deployment"]
    lb_role = {"name": LB_ROLE, "replicas": 1, "dependencies": list(ROLES),
               "standalonePattern": {"template": deployment["spec"]["template"]}}
    metadata = meta(name, kube, labels(cfg, "group"))
    if kube.gang:  # the controller makes one PodGroup of all roles' pods for its configured scheduler
        metadata["annotations"] = {GANG_ANNOTATION: "true"}
    group = {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": {"roles": [*roles, lb_role]}}
    objects = (*budgets, *(o for o in lb_others if o["kind"] != "Deployment"), group)
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
    """Every pod of a RoleBasedGroup's leaderWorkerPattern and standalone roles, in role, replica, worker
    order."""
    name, namespace = group["metadata"]["name"], group["metadata"].get("namespace", "default")
    out = []
    for role in group["spec"]["roles"]:
        lwp = role.get("leaderWorkerPattern")
        for replica in range(role.get("replicas", 1)):
            instance = f"{name}-{role['name']}-{replica}"
            if lwp is None:
                template = role["standalonePattern"]["template"]
                container = template["spec"]["containers"][0]
                env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
                out.append(Pod(instance, {**template["metadata"].get("labels", {}), ROLE_LABEL: role["name"]},
                               env, container))
                continue
            size = lwp.get("size", 1)
            for worker in range(size):
                template = lwp["template"] if worker else leader_template(lwp)
                container = template["spec"]["containers"][0]
                # RBG's variables come first in the container's env, so the user's args may refer to them
                env = {LEADER_ADDRESS: f"{instance}-0.s-{name}-{role['name']}.{namespace}", WORKER_INDEX: str(worker),
                       GROUP_SIZE: str(size)}
                for e in container.get("env", []):
                    if e["name"] not in env and "value" in e:
                        env[e["name"]] = e["value"]
                pod_labels = {**template["metadata"].get("labels", {}), SERVER_LABEL: "true", ROLE_LABEL: role["name"]}
                out.append(Pod(f"{instance}-{worker}", pod_labels, env, container))
    return out
