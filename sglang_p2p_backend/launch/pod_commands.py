"""The SGLang command of every rendered server pod, replayed from the rendered objects (LeaderWorkerSet or
RoleBasedGroup) as the workload controller and the kubelet will fill it in, so SGLang's own parser can check it."""

from __future__ import annotations

from . import lws, rbg
from .k8s import KubeFile
from .render import Command


def server_pod_commands(files: list[KubeFile]) -> list[Command]:
    """The SGLang command of every server pod in `files`."""
    out = []
    for f in files:
        for obj in f.objects:
            if obj["kind"] == "LeaderWorkerSet":
                out += [pod.command() for pod in lws.pods(obj)]
            elif obj["kind"] == rbg.KIND:
                out += [pod.command() for pod in rbg.pods(obj) if pod.labels.get(rbg.SERVER_LABEL) == "true"]
    return out
