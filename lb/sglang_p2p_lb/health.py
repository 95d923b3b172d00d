"""Worker health: the eject / re-admit state machine (pure) and the periodic checker that drives it.

A worker is ejected after `failure_threshold` consecutive failed checks, or after the same number of
consecutive transport failures seen by requests (passive); it is re-admitted after `success_threshold`
consecutive good checks. When a worker answers for the first time its `/get_server_info` is read for
its DP size.
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
    interval: float = 5.0
    timeout: float = 3.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    enabled: bool = True


def record_failure(w: Worker, reason: str, threshold: int) -> bool:
    """Count one failure; True when this one ejects the worker."""
    w.consecutive_successes = 0
    w.consecutive_failures += 1
    w.last_error = reason
    if w.healthy and w.consecutive_failures >= threshold:
        w.healthy = False
        log.warning("ejecting %s worker %s after %d failures: %s", w.role, w.url, w.consecutive_failures, reason)
        return True
    return False


def record_success(w: Worker, threshold: int) -> bool:
    """Count one success; True when this one re-admits an ejected worker."""
    w.consecutive_failures = 0
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

    async def check(self, w: Worker) -> bool:
        try:
            async with self.session.get(w.url + self.cfg.endpoint, timeout=aiohttp.ClientTimeout(total=self.cfg.timeout)) as r:
                ok, reason = r.status == 200, f"health check returned {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            ok, reason = False, f"health check failed: {type(e).__name__}: {e}"
        if self.metrics is not None:
            self.metrics.health_checks.labels(w.role, "ok" if ok else "fail").inc()
        if ok:
            record_success(w, self.cfg.success_threshold)
            if id(w) not in self._info_done:
                await self.discover(w)
        elif record_failure(w, reason, self.cfg.failure_threshold) and self.metrics is not None:
            self.metrics.ejections.labels(w.role).inc()
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

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval)
            try:
                await self.check_all()
            except Exception:  # never let one bad round stop health checking
                log.exception("health check round failed")
