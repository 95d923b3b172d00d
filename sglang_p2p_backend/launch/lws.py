"""What the LeaderWorkerSet controller (LWS v0.10.0) and the kubelet make of a LeaderWorkerSet: the pods'
names and labels, the LWS_* variables injected into every container, and the `$(VAR)` expansion of a
container's args. The renderer names leaders by these rules, and `pod_commands` replays them to get the
exact command every pod will run, so that command can be checked with SGLang's parser before anything
is applied. Mirrors pkg/utils/pod/pod_utils.go (AddLWSVariables) and pkg/webhooks/pod_webhook.go of LWS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from .render import Command

API_VERSION = "leaderworkerset.x-k8s.io/v1"
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # the LWS replica a pod belongs to
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # 0: the leader
LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
GROUP_SIZE = "LWS_GROUP_SIZE"
WORKER_INDEX = "LWS_WORKER_INDEX"

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def pod_name(lws: str, replica: int, worker: int) -> str:
    """The leader is `<lws>-<replica>` (a StatefulSet pod), its workers `<lws>-<replica>-<worker>`."""
    return f"{lws}-{replica}" if worker == 0 else f"{lws}-{replica}-{worker}"


def leader_address(lws: str, replica: int, namespace: str) -> str:
    """LWS_LEADER_ADDRESS under subdomainPolicy Shared: the leader's record in the headless Service that LWS
    creates under the LWS's own name; the pods' DNS search path completes it."""
    return f"{pod_name(lws, replica, 0)}.{lws}.{namespace}"


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's expansion of command/args: `$(VAR)` becomes VAR's value when the container defines
    it, else stays as written; `$$` is a literal `$`."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REFERENCE.sub(one, text)


@dataclass(frozen=True)
class Pod:
    name: str
    labels: Mapping[str, str]
    env: Mapping[str, str]  # literal values only; valueFrom entries are known when the pod runs
    container: Mapping[str, Any]

    def command(self) -> Command:
        """The first container's command line as it runs, $(VAR) references filled in."""
        c = self.container
        return Command(
            label=f"pod {self.name}",
            host=self.name,
            env=dict(self.env),
            program=tuple(expand(t, self.env) for t in c["command"]),
            args=tuple(expand(t, self.env) for t in c.get("args", [])),
        )


def pods(lws: Mapping[str, Any]) -> list[Pod]:
    """Every pod of a LeaderWorkerSet, in replica then worker order."""
    name, namespace = lws["metadata"]["name"], lws["metadata"].get("namespace", "default")
    spec = lws["spec"]
    template = spec["leaderWorkerTemplate"]
    size = template.get("size", 1)
    out = []
    for replica in range(spec.get("replicas", 1)):
        for worker in range(size):
            pod_template = template.get("leaderTemplate") if worker == 0 else None
            pod_template = pod_template or template["workerTemplate"]
            labels = {
                **pod_template.get("metadata", {}).get("labels", {}),
                NAME_LABEL: name, GROUP_INDEX_LABEL: str(replica), WORKER_INDEX_LABEL: str(worker),
            }
            container = pod_template["spec"]["containers"][0]
            # LWS puts its variables first and keeps a container's own only where the name is new
            env = {LEADER_ADDRESS: leader_address(name, replica, namespace), GROUP_SIZE: str(size),
                   WORKER_INDEX: str(worker)}
            for e in container.get("env", []):
                if e["name"] not in env and "value" in e:
                    env[e["name"]] = e["value"]
            out.append(Pod(pod_name(name, replica, worker), labels, env, container))
    return out

