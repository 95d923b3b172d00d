"""Kubernetes pod discovery (smg's --service-discovery): the LB lists and then watches the pods that match
a prefill and a decode label selector, and registers each running pod as a worker at
http://<pod IP>:<--service-discovery-port>, a prefill with the bootstrap port from its
--bootstrap-port-annotation. A new group's leader is added while the LB serves, a deleted or replaced pod
removed: adding a group never restarts the LB.

Pods are registered once they run with an IP, not once they are Ready: the LB's own health checks decide
when a worker gets traffic, and a server whose /health is slow under load stays registered (smg waits for
Ready). Workers given on the command line are never removed by discovery.

The watch follows the Kubernetes list/watch protocol: a list gives the pods and a resourceVersion, the
watch from it streams one JSON event a line (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR); a 410 Gone (the
version fell out of the API server's window) or a broken stream starts over with a fresh list, after a
bounded backoff. Everything in a pod is checked before use: its IP must be an address, the annotation a port.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import quote

import aiohttp
import orjson

from .workers import Role

log = logging.getLogger(__name__)

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # the pod's service account token and CA
DEFAULT_ANNOTATION = "sglang.ai/bootstrap-port"  # smg's default
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; the LB re-watches from its version
MAX_LINE_BYTES = 8 << 20  # one watch event (a pod object); a longer line is a broken stream
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)


class Gone(Exception):
    """410: the resourceVersion is too old; list again."""


@dataclass(frozen=True)
class DiscoveryConfig:
    selectors: dict[Role, dict[str, str]]  # role -> label selector (AND of key=value)
    port: int  # every discovered worker serves HTTP here (smg: one port for all)
    namespace: str | None  # None: every namespace (needs a ClusterRole)
    bootstrap_annotation: str = DEFAULT_ANNOTATION
    api_server: str = ""  # https://host:port; empty: the in-cluster address from the environment
    token_path: str | None = f"{SA_DIR}/token"
    ca_path: str | None = f"{SA_DIR}/ca.crt"
    watch_timeout: int = WATCH_TIMEOUT_S
    backoff: tuple[float, ...] = BACKOFF_S


def parse_selector(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects key=value labels, got {item!r}")
        out[key] = value
    return out


def in_cluster_api_server(environ: dict[str, str] | os._Environ = os.environ) -> str:
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError("--service-discovery outside a pod needs --service-discovery-api-server URL "
                         "(KUBERNETES_SERVICE_HOST is not set)")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def pod_endpoint(pod: Any, role: Role, cfg: DiscoveryConfig) -> tuple[str, int | None] | None:
    """The worker a pod is (URL, bootstrap port), or None while it is not one: not running, no IP yet,
    being deleted, or a prefill without a usable bootstrap port annotation (logged)."""
    if not isinstance(pod, dict):
        return None
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    try:
        ip = ipaddress.ip_address(str(status.get("podIP") or ""))
    except ValueError:
        return None
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    port = None
    if role == "prefill":
        raw = (meta.get("annotations") or {}).get(cfg.bootstrap_annotation)
        if raw is not None:
            if not str(raw).isdigit() or not 0 < int(raw) < 65536:
                log.warning("pod %s: annotation %s=%r is not a port; not registered",
                            meta.get("name"), cfg.bootstrap_annotation, raw)
                return None
            port = int(raw)
    return f"http://{host}:{cfg.port}", port


@dataclass
class PodSet:
    """What the watch of one role knows: pod uid -> its worker, and the callbacks that keep the LB's
    pool equal to it."""

    role: Role
    cfg: DiscoveryConfig
    add: Callable[[Role, str, int | None], Awaitable[None]]
    remove: Callable[[Role, str], Awaitable[None]]
    known: dict[str, tuple[str, int | None]] = field(default_factory=dict)

    async def set(self, uid: str, endpoint: tuple[str, int | None] | None) -> None:
        old = self.known.get(uid)
        if old == endpoint:
            return
        if old is not None:
            del self.known[uid]
            if old[0] not in {e[0] for e in self.known.values()}:
                await self.remove(self.role, old[0])
        if endpoint is not None:
            self.known[uid] = endpoint
            await self.add(self.role, *endpoint)

    async def replace(self, pods: list[Any]) -> None:
        """After a list: exactly these pods."""
        seen = {}
        for pod in pods:
            uid = ((pod or {}).get("metadata") or {}).get("uid")
            if uid:
                seen[uid] = pod_endpoint(pod, self.role, self.cfg)
        for uid in [u for u in self.known if u not in seen]:
            await self.set(uid, None)
        for uid, endpoint in seen.items():
            await self.set(uid, endpoint)

    async def event(self, event: Any) -> str | None:
        """Applies one watch event; returns the resourceVersion it carries."""
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise ValueError(f"malformed watch event: {str(event)[:200]}")
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", "410 Gone"))
            raise ValueError(f"watch error: {obj.get('message', obj)}")
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED") and meta.get("uid"):
            await self.set(meta["uid"], pod_endpoint(obj, self.role, self.cfg))
        elif kind == "DELETED" and meta.get("uid"):
            await self.set(meta["uid"], None)
        elif kind != "BOOKMARK":
            raise ValueError(f"unknown watch event type {kind!r}")
        return meta.get("resourceVersion")


class PodWatcher:
    """List + watch of one role's pods against the API server, until cancelled."""

    def __init__(self, pods: PodSet, session: aiohttp.ClientSession, api_server: str, ssl_ctx: ssl.SSLContext | None):
        self.pods, self.session, self.api, self.ssl = pods, session, api_server.rstrip("/"), ssl_ctx
        self.cfg = pods.cfg
        self.lists = 0  # how many times it listed (tests and logs: re-lists after 410)

    def _url(self, extra: str = "") -> str:
        ns = self.cfg.namespace
        path = f"/api/v1/namespaces/{quote(ns, safe='')}/pods" if ns else "/api/v1/pods"
        selector = ",".join(f"{k}={v}" for k, v in self.cfg.selectors[self.pods.role].items())
        return f"{self.api}{path}?labelSelector={quote(selector, safe='')}{extra}"

    def _headers(self) -> dict[str, str]:
        # re-read every request: projected service account tokens are rotated by the kubelet
        if self.cfg.token_path and os.path.exists(self.cfg.token_path):
            with open(self.cfg.token_path) as f:
                return {"Authorization": f"Bearer {f.read().strip()}"}
        return {}

    async def list(self) -> str:
        async with self.session.get(self._url(), headers=self._headers(), ssl=self.ssl) as r:
            if r.status != 200:
                raise ValueError(f"listing pods: HTTP {r.status}: {(await r.text())[:300]}")
            body = orjson.loads(await r.read())
        self.lists += 1
        await self.pods.replace(body.get("items") or [])
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _lines(self, r: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            if len(buf) > MAX_LINE_BYTES and b"\n" not in buf:
                raise ValueError(f"watch event longer than {MAX_LINE_BYTES} bytes")
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.strip():
                    yield line

    async def watch(self, version: str) -> str:
        """One watch from `version`; returns the last version seen when the server ends it."""
        extra = f"&watch=1&allowWatchBookmarks=true&timeoutSeconds={self.cfg.watch_timeout}&resourceVersion={quote(version)}"
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.cfg.watch_timeout + 30)
        async with self.session.get(self._url(extra), headers=self._headers(), ssl=self.ssl, timeout=timeout) as r:
            if r.status == 410:
                raise Gone("410 Gone")
            if r.status != 200:
                raise ValueError(f"watching pods: HTTP {r.status}: {(await r.text())[:300]}")
            async for line in self._lines(r):
                version = await self.pods.event(orjson.loads(line)) or version
        return version

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                version = await self.list()
                failures = 0
                while True:
                    started = asyncio.get_running_loop().time()
                    version = await self.watch(version)
                    if asyncio.get_running_loop().time() - started < 1.0:
                        # a proxy that ends every watch at once must not turn this into a busy loop
                        await asyncio.sleep(self.cfg.backoff[0])
            except asyncio.CancelledError:
                raise
            except Gone as e:
                log.info("%s pod watch: %s; listing again", self.pods.role, e)
            except Exception as e:  # noqa: BLE001  (never let discovery die: log, back off, list again)
                delay = self.cfg.backoff[min(failures, len(self.cfg.backoff) - 1)]
                failures += 1
                log.warning("%s pod discovery failed (%s: %s); listing again in %.1fs",
                            self.pods.role, type(e).__name__, e, delay)
                await asyncio.sleep(delay)


def _ssl_context(cfg: DiscoveryConfig, api: str) -> ssl.SSLContext | None:
    if not api.startswith("https://"):
        return None
    ctx = ssl.create_default_context()
    if cfg.ca_path and os.path.exists(cfg.ca_path):
        ctx.load_verify_locations(cfg.ca_path)
    return ctx


async def run(cfg: DiscoveryConfig, add: Callable[[Role, str, int | None], Awaitable[None]],
              remove: Callable[[Role, str], Awaitable[None]], watchers: list[PodWatcher] | None = None) -> None:
    """Watches every role with a selector until cancelled; `watchers` (if given) receives them."""
    api = cfg.api_server or in_cluster_api_server()
    async with aiohttp.ClientSession() as session:
        made = [PodWatcher(PodSet(role, cfg, add, remove), session, api, _ssl_context(cfg, api))
                for role in cfg.selectors]
        if watchers is not None:
            watchers.extend(made)
        await asyncio.gather(*(w.run() for w in made))


async def serve(lb: Any, cfg: DiscoveryConfig, watchers: list[PodWatcher] | None = None) -> None:
    """Keeps `lb`'s pool (a server.LoadBalancer) equal to the discovered pods plus its static workers."""
    from .workers import Worker

    ours: set[tuple[Role, str]] = set()  # what discovery added: the only workers it may remove
    checks: set[asyncio.Task] = set()  # first health checks in flight (held so they are not collected)

    async def add(role: Role, url: str, port: int | None) -> None:
        if lb.pool.get(role, url) is not None:
            return  # given on the command line, or the same address seen twice
        w = Worker(url, role, port)
        w.healthy = False  # traffic only after a health check passes, as for POST /workers
        lb.pool.add(w)
        ours.add((role, url))
        log.info("discovered %s worker %s (bootstrap port %s)", role, url, port)
        task = asyncio.create_task(_first_check(lb, w))
        checks.add(task)
        task.add_done_callback(checks.discard)

    async def remove(role: Role, url: str) -> None:
        if (role, url) in ours:
            ours.discard((role, url))
            lb.pool.remove(url, role)  # in-flight requests keep their Worker object and finish
            log.info("%s worker %s is gone from the cluster", role, url)

    try:
        await run(cfg, add, remove, watchers)
    except Exception:  # the watchers never end; anything else is a bug that must not pass silently
        log.exception("pod discovery stopped: workers are no longer added or removed")
        raise
    finally:
        for task in list(checks):
            task.cancel()


async def _first_check(lb: Any, w: Any) -> None:
    try:
        if await lb.health.check(w):
            w.healthy = True
        if lb.loads is not None:
            await lb.loads.poll(w)
    except Exception:  # noqa: BLE001  (the periodic health loop checks it again)
        log.exception("first health check of %s failed", w.url)
