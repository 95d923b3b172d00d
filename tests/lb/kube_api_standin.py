"""A stand-in for the Kubernetes API server's pod list/watch, on 127.0.0.1, for the LB's discovery tests.
No kube-apiserver can run on the CPU test machine (none is packaged for pip or Debian), so this speaks
the protocol the LB relies on, as the API server does:

- GET /api/v1/namespaces/NS/pods?labelSelector=k=v,... : a PodList whose metadata.resourceVersion is the
  store's version at that moment;
- the same with watch=1&resourceVersion=RV : a chunked stream, one JSON event a line (ADDED, MODIFIED,
  DELETED, BOOKMARK with only the version), every change after RV of a pod that matches the selector,
  ended after timeoutSeconds;
- a watch from a version older than the compacted window: HTTP 200 and then an ERROR event whose object is
  a Status with code 410 (what the API server sends for "too old resource version"), or, in `gone_status`
  mode, an HTTP 410 answer;
- Authorization: Bearer TOKEN required when a token is set (401 otherwise).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from lb_harness import serve_local


@dataclass
class ApiStandin:
    token: str | None = None
    gone_status: bool = False  # answer too-old watches with HTTP 410 instead of an ERROR event
    version: int = 1
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    log: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)  # (version, type, pod)
    compacted: int = 0  # watches from versions below this get 410
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (path, query) of every request
    _changed: asyncio.Condition | None = None
    _uids = itertools.count(1)
    _runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> str:
        self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self.pods_route)
        # a watch whose client went away ends at once, as the API server's does
        self._runner, self.url = await serve_local(app, access_log=None, shutdown_timeout=1.0)
        return self.url

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    # ------------------------------------------------------------ changes, as the cluster makes them
    async def _record(self, kind: str, pod: dict[str, Any]) -> None:
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        self.log.append((self.version, kind, orjson.loads(orjson.dumps(pod))))
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def add_pod(self, name: str, labels: dict[str, str], ip: str | None, phase: str = "Running",
                      annotations: dict[str, str] | None = None, namespace: str = "pd") -> dict[str, Any]:
        pod = {"kind": "Pod", "apiVersion": "v1",
               "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{next(self._uids)}",
                            "labels": dict(labels), "annotations": dict(annotations or {})},
               "spec": {"containers": [{"name": "sglang"}]},
               "status": {"phase": phase, **({"podIP": ip} if ip else {})}}
        self.pods[(namespace, name)] = pod
        await self._record("ADDED", pod)
        return pod

    async def modify_pod(self, name: str, namespace: str = "pd", **status: Any) -> None:
        pod = self.pods[(namespace, name)]
        pod["status"].update(status)
        await self._record("MODIFIED", pod)

    async def delete_pod(self, name: str, namespace: str = "pd", record: bool = True) -> None:
        pod = self.pods.pop((namespace, name))
        if record:
            await self._record("DELETED", pod)
        else:  # a change the LB can only learn by listing again (it fell out of the watch window)
            self.version += 1

    async def compact(self) -> None:
        """Drop the event history: every open watch ends with 410 and watchers must list again."""
        self.compacted = self.version + 1
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------ the API
    @staticmethod
    def _matches(pod: dict[str, Any], ns: str, selector: str) -> bool:
        if pod["metadata"]["namespace"] != ns:
            return False
        labels = pod["metadata"]["labels"]
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    async def pods_route(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.path, dict(request.query)))
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        ns, q = request.match_info["ns"], request.query
        selector = q.get("labelSelector", "")
        if q.get("watch") not in ("1", "true"):
            items = [p for p in self.pods.values() if self._matches(p, ns, selector)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": items})
        since = int(q.get("resourceVersion") or self.version)
        if since < self.compacted and self.gone_status:
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired"}, status=410)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        deadline = asyncio.get_running_loop().time() + float(q.get("timeoutSeconds", 30))
        sent = since
        assert self._changed is not None
        while True:
            if sent < self.compacted:
                status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired",
                          "message": f"too old resource version: {sent} ({self.compacted})"}
                await resp.write(orjson.dumps({"type": "ERROR", "object": status}) + b"\n")
                break
            for version, kind, pod in self.log:
                if version > sent and self._matches(pod, ns, selector):
                    await resp.write(orjson.dumps({"type": kind, "object": pod}) + b"\n")
            if self.log:
                sent = max(sent, self.log[-1][0])
            if q.get("allowWatchBookmarks") == "true":
                bookmark = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}}
                await resp.write(orjson.dumps({"type": "BOOKMARK", "object": bookmark}) + b"\n")
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        await resp.write_eof()
        return resp
