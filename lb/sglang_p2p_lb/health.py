"""Worker health: the eject / re-admit state machine (pure) and the periodic probes that drive it.

Two probes per worker, each at a fixed rate (a slow probe of one worker never delays the others):
* health (`endpoint`, `/health`): a worker is ejected after `failure_threshold` consecutive failures
  (non-200, refused, or no answer within `timeout`) and re-admitted after `success_threshold` good ones.
  SGLang's `/health` generates a token through the scheduler and may legitimately take up to its own
  SGLANG_HEALTH_CHECK_TIMEOUT (20 s) while a long prefill runs, hence the 25 s default timeout.
* liveness (`liveness_endpoint`, `/model_info`, which SGLang answers from its HTTP process without the
  scheduler): no answer within `liveness_timeout` means the process stopped (SIGSTOP, frozen) or is busy
  (parsing a 50 MB body blocks it for seconds). Both still complete TCP handshakes (the kernel does), so only
  the streak tells them apart: after `timeout_failure_threshold` (3) timeouts in a row the worker counts as
  stopped, is ejected, and the requests in flight on it fail at once (Worker.notify_stalled) so the LB can
  send them elsewhere. Any answer breaks the streak: a liveness or health answer, a load poll
  (Worker.note_answer), a request leg's answer.
A worker with a failure or timeout streak, or ejected or degraded, is probed every `recovery_interval` (0.5 s)
instead of every `interval`: a stopped one is found sooner, a restarted one is back within
success_threshold x recovery_interval of answering.
The last worker of a role that could take a request is never ejected (health, liveness or a request's
transport errors, proxy.py): it is marked degraded and still tried, since ejecting it is a certain outage
while it may only be busy. It is ejected at its next failure once another worker of its role is back.
When a worker answers for the first time its `/get_server_info` is read for its DP size (at most
MAX_DP_SIZE; a larger or malformed one is logged and the worker routed as DP size 1).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
import orjson

from .workers import Worker, WorkerPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthConfig:
    interval: float = 2.0
    timeout: float = 25.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    # a stopped worker is found within about interval + timeout_failure_threshold x (liveness_timeout +
    # recovery_interval): 9.5 s at these defaults
    liveness_endpoint: str = "/model_info"
    liveness_timeout: float = 2.0
    # one slow answer is a busy server, not a stopped one: a 50 MB body held SGLang's HTTP process over 2 s
    timeout_failure_threshold: int = 3
    # a suspect or ejected worker is probed this often, so a stopped one is found and a restarted one is
    # back within success_threshold x recovery_interval of serving (0: at `interval` like the others)
    recovery_interval: float = 0.5
    enabled: bool = True


def _eject_at(w: Worker, count: int, threshold: int, reason: str, spare: bool) -> bool:
    """Eject w once `count` reaches `threshold`, or mark it degraded when no `spare` would take its place."""
    w.consecutive_successes = 0
    w.last_error = reason
    if not w.healthy or count < threshold:
        return False
    if spare:
        w.healthy, w.degraded = False, False
        log.warning("ejecting %s worker %s after %d in a row: %s", w.role, w.url, count, reason)
        return True
    if not w.degraded:
        w.degraded = True
        log.warning("%s worker %s failed %d in a row (%s) but is the last of its role: kept in rotation, degraded", w.role, w.url, count, reason)
    return False


def record_stall(w: Worker, reason: str, threshold: int, spare: bool) -> bool:
    """Count one liveness timeout; True when this one ejects the worker."""
    w.consecutive_timeouts += 1
    return _eject_at(w, w.consecutive_timeouts, threshold, reason, spare)


def record_failure(w: Worker, reason: str, threshold: int, spare: bool) -> bool:
    """Count one failure; True when this one ejects the worker."""
    w.consecutive_failures += 1
    return _eject_at(w, w.consecutive_failures, threshold, reason, spare)


def record_success(w: Worker, threshold: int) -> bool:
    """Count one success; True when this one re-admits an ejected worker (or clears a degraded one)."""
    w.consecutive_failures = w.consecutive_timeouts = 0
    w.consecutive_successes += 1
    if w.consecutive_successes < threshold or w.state == "healthy":
        return False
    log.info("%s %s worker %s", "re-admitting" if not w.healthy else "no longer degraded:", w.role, w.url)
    w.healthy, w.degraded = True, False
    w.last_error = ""
    w.breaker.readmit()
    return True


#: largest DP size taken from a worker's /get_server_info. The LB keeps per-rank lists of that length and
#: looks at every rank for each request; DP attention spans one rank per GPU, far below this.
MAX_DP_SIZE = 1024


async def fetch_server_info(session: aiohttp.ClientSession, w: Worker, timeout: float) -> dict | None:
    try:
        async with session.get(w.url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return None
            # orjson, not r.json(): the json module raises RecursionError on deeply nested answers
            info = orjson.loads(await r.read())
            return info if isinstance(info, dict) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def dp_size_from_info(info: dict) -> int:
    """DP-attention ranks of a server: SGLang reports `dp_size` and `enable_dp_attention`. ValueError
    naming the value when `dp_size` is not an integer in [1, MAX_DP_SIZE]."""
    if not info.get("enable_dp_attention"):
        return 1
    n = info.get("dp_size")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_DP_SIZE:
        raise ValueError(f"dp_size {n!r} is not an integer in [1, {MAX_DP_SIZE}]")
    return n


def _suspect(w: Worker) -> bool:
    """Out of rotation, degraded, or on a failure streak: probed at the recovery pace."""
    return w.state != "healthy" or w.consecutive_failures > 0 or w.consecutive_timeouts > 0


class HealthChecker:
    def __init__(self, pool: WorkerPool, session: aiohttp.ClientSession, cfg: HealthConfig, metrics=None, dp_aware: bool = True) -> None:
        self.pool, self.session, self.cfg, self.metrics, self.dp_aware = pool, session, cfg, metrics, dp_aware
        # keyed by the Worker itself (hashed by identity), not id(w): a removed worker's probe still in
        # flight would otherwise hold back the probes of a new worker that got its id
        self._probing: dict[tuple[Worker, str], asyncio.Task] = {}

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
            if not w.info_read:
                await self.discover(w)
        elif record_failure(w, reason, self.cfg.failure_threshold, self.pool.has_spare(w)):
            self._ejected(w)
        return ok

    def _ejected(self, w: Worker) -> None:
        if self.metrics is not None:
            self.metrics.ejections.labels(w.role).inc()

    async def live(self, w: Worker) -> bool:
        """Liveness: only a timeout counts (a refused connection or an error status is the health probe's)."""
        try:
            async with self.session.get(w.url + self.cfg.liveness_endpoint, timeout=aiohttp.ClientTimeout(total=self.cfg.liveness_timeout)) as r:
                await r.read()
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            reason = f"no answer to {self.cfg.liveness_endpoint} within {self.cfg.liveness_timeout:g}s (stopped or hung)"
            if record_stall(w, reason, self.cfg.timeout_failure_threshold, self.pool.has_spare(w)):
                self._ejected(w)
            if w.consecutive_timeouts >= self.cfg.timeout_failure_threshold:
                # at every timeout past the threshold: a degraded last worker keeps getting requests, and
                # those must end with a clear error too rather than wait out the first-byte timeout
                w.notify_stalled(reason)
            return False
        except aiohttp.ClientError:
            return True  # not a stall; the health probe judges it
        w.consecutive_timeouts = 0
        return True

    async def discover(self, w: Worker) -> None:
        """Read DP size once the worker answers (a server that is still starting is retried next round)."""
        info = await fetch_server_info(self.session, w, self.cfg.timeout)
        if info is None:
            return
        w.info_read = True  # also when its DP size is refused: read once, said once
        if self.dp_aware:
            try:
                w.set_dp_size(dp_size_from_info(info))
            except ValueError as e:
                # DP size 1 is what mini_lb routes with: the room alone picks the rank (SGLang's default
                # follow_bootstrap_room), which is right for any real DP size. Ejecting the worker instead
                # would only last until its next good health check.
                log.warning("%s worker %s: %s; routed as DP size 1", w.role, w.url, e)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.pool))

    def probe_round(self, suspects_only: bool = False) -> None:
        """Start each probe of every worker (or every suspect one) that has none of that kind in flight."""
        for w in self.pool:
            if suspects_only and not _suspect(w):
                continue
            for kind, probe in (("health", self.check), ("live", self.live)):
                key = (w, kind)
                if key not in self._probing:
                    task = asyncio.create_task(probe(w))
                    self._probing[key] = task
                    task.add_done_callback(lambda t, k=key: self._done_probe(k, t))

    def _done_probe(self, key: tuple[Worker, str], task: asyncio.Task) -> None:
        self._probing.pop(key, None)
        if not task.cancelled() and task.exception() is not None:  # never let one bad probe stop checking
            log.error("health check failed unexpectedly", exc_info=task.exception())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        tick = min(self.cfg.interval, self.cfg.recovery_interval) if self.cfg.recovery_interval > 0 else self.cfg.interval
        next_full = loop.time() + self.cfg.interval
        try:
            while True:
                await asyncio.sleep(tick)
                full = loop.time() >= next_full - tick / 2
                if full:
                    next_full += self.cfg.interval
                self.probe_round(suspects_only=not full)
        finally:
            for t in list(self._probing.values()):
                t.cancel()
