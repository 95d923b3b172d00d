"""Worker health: the eject / re-admit state machine (pure) and the periodic checker that drives it.

A worker is ejected after `failure_threshold` consecutive failed checks, after `timeout_failure_threshold`
consecutive checks that time out (default 1: a server that accepts the connection but cannot answer
`/health` within the timeout is stopped or hung, and waiting for more rounds only lengthens the time its
requests hang), or after `failure_threshold` consecutive transport failures seen by requests (passive).
An ejection by probe timeout also fails the requests in flight on that worker (Worker.notify_stalled).
It is re-admitted after `success_threshold` consecutive good checks. Probes run at a fixed rate: a slow
probe of one worker never delays the others, so a stall is seen within interval + timeout. When a
worker answers for the first time its `/get_server_info` is read for its DP size.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

from .workers import Worker, WorkerPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthConfig:
    # interval + timeout bounds the time to eject a stalled worker: 4 s at these defaults
    interval: float = 2.0
    timeout: float = 2.0
    failure_threshold: int = 3
    timeout_failure_threshold: int = 1
    success_threshold: int = 2
    endpoint: str = "/health"
    enabled: bool = True


def record_failure(w: Worker, reason: str, threshold: int, timed_out: bool = False, timeout_threshold: int | None = None) -> bool:
    """Count one failure; True when this one ejects the worker (timeouts also count against their own threshold)."""
    w.consecutive_successes = 0
    w.consecutive_failures += 1
    w.consecutive_timeouts = w.consecutive_timeouts + 1 if timed_out else 0
    w.last_error = reason
    over = w.consecutive_failures >= threshold or (timeout_threshold is not None and w.consecutive_timeouts >= timeout_threshold)
    if w.healthy and over:
        w.healthy = False
        log.warning("ejecting %s worker %s after %d failures: %s", w.role, w.url, w.consecutive_failures, reason)
        return True
    return False


def record_success(w: Worker, threshold: int) -> bool:
    """Count one success; True when this one re-admits an ejected worker."""
    w.consecutive_failures = w.consecutive_timeouts = 0
    w.consecutive_successes += 1
    if not w.healthy and w.consecutive_successes >= threshold:
        w.healthy = True
        w.last_error = ""
        log.info("re-admitting %s worker %s", w.role, w.url)
        return True
    return False


async def fetch_server_info(session: aiohttp.ClientSession, w: Worker, timeout: float) -> dict | None:
    try:
        async with session.get(w.url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return None
            info = await r.json(content_type=None)
            return info if isinstance(info, dict) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def dp_size_from_info(info: dict) -> int:
    """DP-attention ranks of a server: SGLang reports `dp_size` and `enable_dp_attention`."""
    if not info.get("enable_dp_attention"):
        return 1
    n = info.get("dp_size") or 1
    return int(n) if isinstance(n, int) and n > 0 else 1


class HealthChecker:
    def __init__(self, pool: WorkerPool, session: aiohttp.ClientSession, cfg: HealthConfig, metrics=None, dp_aware: bool = True) -> None:
        self.pool, self.session, self.cfg, self.metrics, self.dp_aware = pool, session, cfg, metrics, dp_aware
        self._info_done: set[int] = set()
        self._probing: dict[int, asyncio.Task] = {}

    async def check(self, w: Worker) -> bool:
        timed_out = False
        try:
            async with self.session.get(w.url + self.cfg.endpoint, timeout=aiohttp.ClientTimeout(total=self.cfg.timeout)) as r:
                ok, reason = r.status == 200, f"health check returned {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            timed_out = isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError))
            ok = False
            reason = f"health check timed out after {self.cfg.timeout:g}s (stopped or hung)" if timed_out else f"health check failed: {type(e).__name__}: {e}"
        if self.metrics is not None:
            self.metrics.health_checks.labels(w.role, "ok" if ok else "fail").inc()
        if ok:
            record_success(w, self.cfg.success_threshold)
            if id(w) not in self._info_done:
                await self.discover(w)
        elif record_failure(w, reason, self.cfg.failure_threshold, timed_out, self.cfg.timeout_failure_threshold):
            if self.metrics is not None:
                self.metrics.ejections.labels(w.role).inc()
            if timed_out:
                w.notify_stalled(reason)
        return ok

    async def discover(self, w: Worker) -> None:
        """Read DP size once the worker answers (a server that is still starting is retried next round)."""
        info = await fetch_server_info(self.session, w, self.cfg.timeout)
        if info is None:
            return
        self._info_done.add(id(w))
        if self.dp_aware:
            w.set_dp_size(dp_size_from_info(info))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.pool))

    def probe_round(self) -> None:
        """Start a probe of every worker that has none in flight (fixed rate: no round waits on a slow one)."""
        for w in self.pool:
            if id(w) not in self._probing:
                task = asyncio.create_task(self.check(w))
                self._probing[id(w)] = task
                task.add_done_callback(lambda t, k=id(w): self._done_probe(k, t))

    def _done_probe(self, key: int, task: asyncio.Task) -> None:
        self._probing.pop(key, None)
        if not task.cancelled() and task.exception() is not None:  # never let one bad probe stop checking
            log.error("health check failed unexpectedly", exc_info=task.exception())

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.cfg.interval)
                self.probe_round()
        finally:
            for t in list(self._probing.values()):
                t.cancel()
