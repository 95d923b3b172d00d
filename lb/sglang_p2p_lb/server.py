"""The LB's HTTP application: PD routes, info/admin routes, and the background health and load loops."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from . import auth, discovery, payload
from .circuit import BreakerConfig
from .decision_log import DecisionLog
from .discovery import DiscoveryConfig
from .health import HealthChecker, HealthConfig
from .loads import LoadPoller
from .metrics import Metrics
from .policy import Policy
from .policy_registry import make_pd_policy
from .prefix_policy import PrefixParams
from .proxy import Dispatcher, ProxyConfig, error_response
from .workers import Worker, WorkerPool

#: seconds an idle pooled connection to a worker is kept (below the workers' own HTTP keep-alive)
WORKER_KEEPALIVE_S = 2.0

log = logging.getLogger(__name__)


@dataclass
class LBConfig:
    prefills: list[tuple[str, int | None]] = field(default_factory=list)
    decodes: list[str] = field(default_factory=list)
    nodes: dict[str, str] = field(default_factory=dict)
    host: str = "0.0.0.0"
    port: int = 30000
    policy: str = "load_aware"
    prefill_policy: str | None = None  # None: `policy`
    decode_policy: str | None = None
    prefix: PrefixParams = field(default_factory=PrefixParams)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    load_poll_interval: float = 1.0
    info_timeout: float = 10.0
    max_body_bytes: int = 64 * 1024 * 1024
    dp_aware: bool = True
    health_generate_timeout: float = 30.0
    auth: auth.AuthConfig = field(default_factory=auth.AuthConfig)
    # Forwarded to workers as a bearer token, as smg forwards --api-key (SGLang servers run with --api-key).
    worker_api_key: str | None = None
    # Closes a connection that has not sent complete request headers this long after it opened or after
    # its previous response (aiohttp's keep-alive timer), and idle keep-alive connections: slowloris.
    header_timeout: float = 15.0
    # Kubernetes pod discovery (--service-discovery): workers come and go with the cluster's pods
    discovery: DiscoveryConfig | None = None
    # --workers: this is server process `process_index` of `processes`, each with a pool of its own on one
    # SO_REUSEPORT port (processes.py); 1 is the single-process LB
    processes: int = 1
    process_index: int = 0
    # --decision-log: a JSON line per routing decision (decision_log.py); PATH.<index> per server process
    decision_log: str | None = None


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


class LoadBalancer:
    """Owns the pool, policy, HTTP client session and background tasks; `app()` builds the server."""

    def __init__(self, cfg: LBConfig, policy: Policy | None = None) -> None:
        self.cfg = cfg
        self.pool = WorkerPool(cfg.breaker)
        for url, port in cfg.prefills:
            self.pool.add(Worker(url, "prefill", port, node=cfg.nodes.get(url.rstrip("/"), "")))
        for url in cfg.decodes:
            self.pool.add(Worker(url, "decode", node=cfg.nodes.get(url.rstrip("/"), "")))
        self.policy = policy or make_pd_policy(cfg.policy, cfg.prefill_policy, cfg.decode_policy, prefix=cfg.prefix)
        self.metrics = Metrics(self.pool, multiprocess=cfg.processes > 1)
        self.session: aiohttp.ClientSession | None = None
        self.dispatcher: Dispatcher | None = None
        self.health: HealthChecker | None = None
        self.loads: LoadPoller | None = None
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------ lifecycle
    async def _startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.proxy.request_timeout, connect=self.cfg.proxy.connect_timeout)
        # no per-host cap: the LB must not queue requests behind a connection limit of its own
        headers = {"Authorization": f"Bearer {self.cfg.worker_api_key}"} if self.cfg.worker_api_key else None
        # idle connections are dropped before SGLang's uvicorn closes them (SGLANG_TIMEOUT_KEEP_ALIVE, 5 s):
        # reusing one the server just closed fails the request with ServerDisconnectedError, and a decode leg
        # cannot be retried once its prefill started (seen once in ~400 requests on a real decode)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=WORKER_KEEPALIVE_S)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False, headers=headers)
        decisions = None
        if self.cfg.decision_log:
            path = self.cfg.decision_log if self.cfg.processes == 1 else f"{self.cfg.decision_log}.{self.cfg.process_index}"
            decisions = DecisionLog(path)
        self.dispatcher = Dispatcher(self.pool, self.policy, self.session, self.cfg.proxy, self.metrics, decisions)
        self.health = HealthChecker(self.pool, self.session, self.cfg.health, self.metrics, self.cfg.dp_aware)
        self.loads = LoadPoller(self.pool, self.session, self.cfg.load_poll_interval)
        # one discovery round before serving, so DP sizes are known for the first requests
        await asyncio.gather(*(self.health.discover(w) for w in self.pool))
        if self.cfg.health.enabled:
            self._tasks.append(asyncio.create_task(self.health.run()))
        if self.cfg.load_poll_interval > 0:
            self._tasks.append(asyncio.create_task(self.loads.run()))
        if self.cfg.discovery is not None:
            self._tasks.append(asyncio.create_task(discovery.serve(self, self.cfg.discovery)))

    async def _cleanup(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.dispatcher:
            await self.dispatcher.close()
        if self.session:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[auth.middleware(self.cfg.auth, error_response)])
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        r = app.router
        for route in payload.ROUTES:
            r.add_post("/" + route, self._generate_handler(route))
        r.add_get("/health", self.health_route)
        r.add_get("/health_generate", self.health_generate)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics_route)
        r.add_get("/workers", self.list_workers)
        r.add_post("/workers", self.add_worker)
        r.add_delete("/workers", self.remove_worker)
        r.add_get("/get_loads", self.list_workers)
        return app

    async def start(self) -> str:
        """Serve on cfg.host:cfg.port (port 0 picks a free one); returns the base URL."""
        for warning in auth.startup_warnings(self.cfg.auth, self.cfg.host):
            log.warning("%s", warning)
        self._runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, keepalive_timeout=self.cfg.header_timeout,
            # after answering early (408, 413) aiohttp drains the unread body before closing; 10 s by default
            lingering_time=1.0,
        )
        await self._runner.setup()
        # several processes accept on one port: the kernel spreads new connections over their sockets
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, backlog=4096, reuse_port=True if self.cfg.processes > 1 else None)
        await site.start()
        self.cfg.port = self._runner.addresses[0][1]
        return f"http://{self.cfg.host}:{self.cfg.port}"

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    # ------------------------------------------------------------ PD routes
    def _generate_handler(self, route: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            assert self.dispatcher is not None
            return await self.dispatcher.handle(route, request)

        return handle

    # ------------------------------------------------------------ health
    async def health_route(self, request: web.Request) -> web.Response:
        """200 while each role has a worker in rotation ("degraded" when that is only a failing last one)."""
        out: dict[str, Any] = {"status": "ok"}
        for role in ("prefill", "decode"):
            ws = self.pool.routable(role)  # type: ignore[arg-type]
            fine = sum(not w.degraded for w in ws)
            out[f"healthy_{role}"], out[f"degraded_{role}"] = fine, len(ws) - fine
            if not ws:
                out["status"] = "unavailable"
            elif not fine and out["status"] == "ok":
                out["status"] = "degraded"
        return _json(out, 503 if out["status"] == "unavailable" else 200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token through a real pair (mini_lb only pings the workers, sglang #8063)."""
        assert self.dispatcher is not None
        req = _InternalRequest(orjson.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}))
        try:
            resp = await asyncio.wait_for(self.dispatcher.handle(payload.GENERATE, req), self.cfg.health_generate_timeout)  # type: ignore[arg-type]
        except asyncio.TimeoutError:
            return error_response(503, f"health generate timed out after {self.cfg.health_generate_timeout}s")
        if resp.status == 200:
            return web.Response(status=200)
        return error_response(503, f"health generate failed with {resp.status}: {getattr(resp, 'text', '')}")

    # ------------------------------------------------------------ fan-out / proxy info routes
    async def _fanout(self, method: str, path: str) -> list[tuple[Worker, int | None, Any]]:
        assert self.session is not None

        async def one(w: Worker):
            try:
                async with self.session.request(method, w.url + path, timeout=aiohttp.ClientTimeout(total=self.cfg.info_timeout)) as r:
                    raw = await r.read()
                    try:
                        return w, r.status, orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        return w, r.status, raw.decode(errors="replace")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return w, None, f"{type(e).__name__}: {e}"

        return await asyncio.gather(*(one(w) for w in self.pool))

    async def flush_cache(self, request: web.Request) -> web.Response:
        results = await self._fanout("POST", "/flush_cache")
        failed = [{"url": w.url, "status": s, "detail": b} for w, s, b in results if s != 200]
        if failed:
            return _json({"error": {"message": f"flush_cache failed on {len(failed)} of {len(results)} workers", "code": 502}, "failed": failed}, 502)
        return _json({"status": "ok", "flushed": len(results)})

    async def server_info(self, request: web.Request) -> web.Response:
        results = await self._fanout("GET", "/get_server_info")
        info: dict[str, Any] = {"prefill": [], "decode": [], "internal_states": []}
        for w, status, body in results:
            entry = body if status == 200 and isinstance(body, dict) else {"url": w.url, "error": body, "status": status}
            info[w.role].append(entry)
            if w.role == "decode" and status == 200 and isinstance(body, dict):
                info["internal_states"].extend(body.get("internal_states") or [])
        if not info["internal_states"]:
            # bench_one_batch_server reads this key; mini_lb returns the same placeholder
            info["internal_states"] = [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}]
        return _json(info)

    async def _proxy_get(self, path: str) -> web.Response:
        assert self.session is not None
        workers = self.pool.routable("prefill") or self.pool.all("prefill")
        errors = []
        for w in workers:
            try:
                async with self.session.get(w.url + path, timeout=aiohttp.ClientTimeout(total=self.cfg.info_timeout)) as r:
                    raw = await r.read()
                    if r.status == 200:
                        return web.Response(status=200, body=raw, content_type="application/json")
                    errors.append(f"{w.url}: status {r.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                errors.append(f"{w.url}: {type(e).__name__}")
        return error_response(503 if not workers else 502, f"{path} unavailable: " + ("; ".join(errors) or "no prefill worker registered"))

    async def model_info(self, request: web.Request) -> web.Response:
        return await self._proxy_get("/get_model_info")

    async def models(self, request: web.Request) -> web.Response:
        return await self._proxy_get("/v1/models")

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ------------------------------------------------------------ admin
    async def list_workers(self, request: web.Request) -> web.Response:
        out: dict[str, Any] = {"policy": self.policy.name, "workers": [w.snapshot() for w in self.pool]}
        if self.cfg.processes > 1:
            # the answer is one process's view (its in-flight counts, its health checks): say whose
            out["process"] = {"pid": os.getpid(), "index": self.cfg.process_index, "of": self.cfg.processes}
        return _json(out)

    def _single_process_only(self, what: str) -> web.Response | None:
        """With --workers > 1 each process has a pool of its own and a request reaches one of them: a change
        made there would leave the others' pools different, so it is refused instead."""
        if self.cfg.processes <= 1:
            return None
        return error_response(409, f"{what} is not available with --workers {self.cfg.processes}: each server process keeps its own "
                                   "worker list and this request reaches only one of them. Run the LB with --workers 1 to add or remove "
                                   "workers at run time, or restart it with the new --prefill/--decode list (or use --service-discovery)",
                              "ConflictError")

    async def add_worker(self, request: web.Request) -> web.Response:
        """POST /workers {"url": ..., "role": "prefill"|"decode", "bootstrap_port": int|null, "node": str}."""
        if (refused := self._single_process_only("POST /workers")) is not None:
            return refused
        try:
            body = payload.parse_json_object(await request.read())
            role = body.get("role")
            if role not in ("prefill", "decode"):
                raise payload.BadRequest("'role' must be 'prefill' or 'decode'")
            port = body.get("bootstrap_port")
            if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
                raise payload.BadRequest("'bootstrap_port' must be an integer port or null")
            url = body.get("url")
            if not isinstance(url, str):
                raise payload.BadRequest("'url' must be a string like http://host:port")
            w = Worker(url, role, port if role == "prefill" else None, node=str(body.get("node") or ""))
        except (payload.BadRequest, ValueError) as e:
            return error_response(400, str(e))
        try:
            self.pool.add(w)
        except KeyError as e:
            return error_response(409, e.args[0])
        assert self.health is not None
        # a new worker must pass a health check before it gets traffic
        w.healthy = False
        if await self.health.check(w):
            w.healthy = True
        if self.loads is not None:
            await self.loads.poll(w)
        log.info("added %s worker %s (healthy=%s)", role, w.url, w.healthy)
        return _json({"status": "added", "worker": w.snapshot()})

    async def remove_worker(self, request: web.Request) -> web.Response:
        """DELETE /workers?url=...[&role=...] (or the same as a JSON body)."""
        if (refused := self._single_process_only("DELETE /workers")) is not None:
            return refused
        params: dict[str, Any] = dict(request.query)
        if not params.get("url") and request.can_read_body:
            try:
                params.update(payload.parse_json_object(await request.read()))
            except payload.BadRequest as e:
                return error_response(400, str(e))
        url, role = params.get("url"), params.get("role")
        if not isinstance(url, str) or role not in (None, "prefill", "decode"):
            return error_response(400, "give 'url' (and optionally 'role': prefill|decode)")
        try:
            gone = self.pool.remove(url, role)
        except ValueError as e:
            return error_response(400, str(e))
        if not gone:
            return error_response(404, f"no worker registered at {url}")
        # in-flight requests keep their Worker object and finish normally
        return _json({"status": "removed", "workers": [w.url for w in gone]})


class _InternalRequest:
    """Just enough of web.Request for Dispatcher.handle on a non-streamed request made by the LB itself."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    async def read(self) -> bytes:
        return self._body
