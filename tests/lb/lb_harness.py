"""Helpers for the LB tests: simulated workers and the LB served in-process on 127.0.0.1 (real HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import orjson
from aiohttp import web

from sglang_p2p_lb.health import HealthConfig
from sglang_p2p_lb.proxy import ProxyConfig
from sglang_p2p_lb.server import LBConfig, LoadBalancer
from simworker import SimConfig, SimWorker
from sglang_p2p_backend.testing.launch import free_port

# every test body runs under this bound, well inside pytest's own timeout
TEST_TIMEOUT = 30.0
ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def run(coro_fn: Callable[[], Awaitable[Any]], timeout: float = TEST_TIMEOUT) -> Any:
    async def bounded():
        return await asyncio.wait_for(coro_fn(), timeout)

    return asyncio.run(bounded())


@dataclasses.dataclass
class Cluster:
    lb: LoadBalancer
    url: str
    prefills: list[SimWorker]
    decodes: list[SimWorker]
    http: aiohttp.ClientSession

    async def post(self, path: str, body: Any, raw: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes, Any]:
        data = raw if raw is not None else orjson.dumps(body)
        async with self.http.post(self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
            content = await r.read()
            try:
                parsed = orjson.loads(content)
            except orjson.JSONDecodeError:
                parsed = None
            return r.status, content, parsed

    async def get(self, path: str, headers: dict | None = None) -> tuple[int, Any]:
        async with self.http.get(self.url + path, headers=headers) as r:
            content = await r.read()
            try:
                return r.status, orjson.loads(content)
            except orjson.JSONDecodeError:
                return r.status, content

    def worker_for(self, url: str) -> SimWorker:
        return next(w for w in self.prefills + self.decodes if w.url == url)


FAST_SIM = dict(prefill_base_ms=1.0, prefill_ms_per_token=0.01, decode_ms_per_token=1.0, bootstrap_timeout=10.0, record_output=True)


@contextlib.asynccontextmanager
async def cluster(
    n_prefill: int = 1,
    n_decode: int = 1,
    sim: dict | None = None,
    prefill_sim: list[dict] | None = None,
    decode_sim: list[dict] | None = None,
    policy: str = "load_aware",
    health: HealthConfig | None = None,
    proxy: ProxyConfig | None = None,
    load_poll_interval: float = 0.0,
    **lb_kw: Any,
) -> AsyncIterator[Cluster]:
    base = {**FAST_SIM, **(sim or {})}
    prefills = [SimWorker(SimConfig(role="prefill", **{**base, **((prefill_sim or [{}] * n_prefill)[i])})) for i in range(n_prefill)]
    decodes = [SimWorker(SimConfig(role="decode", **{**base, **((decode_sim or [{}] * n_decode)[i])})) for i in range(n_decode)]
    for w in prefills + decodes:
        await w.start()
    cfg = LBConfig(
        prefills=[(w.url, w.cfg.bootstrap_port) for w in prefills],
        decodes=[w.url for w in decodes],
        host="127.0.0.1",
        port=0,
        policy=policy,
        health=health or HealthConfig(enabled=False),
        proxy=proxy or ProxyConfig(request_timeout=20.0, connect_timeout=2.0),
        load_poll_interval=load_poll_interval,
        **lb_kw,
    )
    lb = LoadBalancer(cfg)
    url = await lb.start()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
    try:
        yield Cluster(lb, url, prefills, decodes, http)
    finally:
        await http.close()
        await lb.stop()
        for w in prefills + decodes:
            await w.stop()


async def serve_local(app: web.Application, **runner_kwargs: Any) -> tuple[web.AppRunner, str]:
    """`app` served on 127.0.0.1 at a free port: its runner (cleanup() stops it) and its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, **runner_kwargs)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def wait_until(pred: Callable[[], bool], timeout: float = 5.0, step: float = 0.02) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if pred():
            return True
        await asyncio.sleep(step)
    return pred()


@dataclasses.dataclass
class SimProcess:
    """A simworker in its own process, so that SIGSTOP freezes it (and only it) as it would a real server."""

    proc: subprocess.Popen
    url: str
    bootstrap_port: int | None
    frozen: bool = False

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.frozen = False

    async def answering(self, http: aiohttp.ClientSession, timeout: float = 20.0) -> bool:
        """Whether its /health answers within `timeout` (a process start on a loaded machine takes seconds)."""

        async def up() -> bool:
            try:
                async with http.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            if await up():
                return True
            await asyncio.sleep(0.1)
        return False


@contextlib.contextmanager
def sim_process(role: str, *flags: str) -> Iterator[SimProcess]:
    port = free_port()
    boot = free_port() if role == "prefill" else None
    cmd = [sys.executable, "-m", "simworker", "--role", role, "--host", "127.0.0.1", "--port", str(port), *flags]
    if boot is not None:
        cmd += ["--bootstrap-port", str(boot)]
    sim = SimProcess(subprocess.Popen(cmd), f"http://127.0.0.1:{port}", boot)
    try:
        yield sim
    finally:
        if sim.frozen:
            sim.thaw()
        sim.proc.terminate()
        sim.proc.wait(10)
