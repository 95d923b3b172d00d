"""Running the LB: one process (`--workers 1`, the default) or a supervisor of N server processes.

With `--workers N` (N > 1) the supervisor starts N children (multiprocessing spawn: a fresh interpreter each,
so prometheus_client sees PROMETHEUS_MULTIPROC_DIR at import). Each child binds the same host:port with
SO_REUSEPORT, so the kernel spreads new connections over them, and runs a whole LoadBalancer of its own
(pool, policy, health checks, load polls, discovery). The supervisor forwards SIGTERM/SIGINT, restarts a
child that dies after it served (a crash-looping or never-ready child stops everything with exit status 1),
and the children die with it (PR_SET_PDEATHSIG), so none is left orphaned. docs/lb.md, "Several worker
processes", says what is per process.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from typing import Any, Callable

from .server import LBConfig, LoadBalancer

log = logging.getLogger("sglang_p2p_lb")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# several processes write to one stream: each line names its writer
PROCESS_LOG_FORMAT = "%(asctime)s %(levelname)s [pid %(process)d] %(name)s: %(message)s"
READY_TIMEOUT_S = 120.0  # a child must bind and finish its first discovery round within this
STOP_GRACE_S = 70.0  # a stopping child drains its requests (aiohttp's 60 s shutdown timeout) before SIGKILL
RESTART_WINDOW_S, MAX_RESTARTS = 60.0, 5  # more deaths than this within the window: a crash loop, give up
_PR_SET_PDEATHSIG = 1


def install_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


async def serve(cfg: LBConfig, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM. `on_ready(url)` once listening; by default the line scripts wait for."""
    lb = LoadBalancer(cfg)
    url = await lb.start()
    log.info("sglang-p2p-lb (%s) on %s: %d prefill, %d decode", cfg.policy, url, len(cfg.prefills), len(cfg.decodes))
    if on_ready is None:
        print(f"sglang-p2p-lb listening on {url}", flush=True)
    else:
        on_ready(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await lb.stop()


def run_single(cfg: LBConfig) -> int:
    install_uvloop()
    asyncio.run(serve(cfg))
    return 0


def per_process(cfg: LBConfig, n: int, index: int) -> LBConfig:
    """The config of child `index` of `n`: the LB-wide admission limits split over the processes (rounded
    up, so the total is at least what was asked), like smg's which are one router's totals. 0 stays
    'unbounded' / 'no queue'."""
    def share(v: int) -> int:
        return math.ceil(v / n) if v > 0 else v

    proxy = dataclasses.replace(cfg.proxy, max_concurrent=share(cfg.proxy.max_concurrent), queue_size=share(cfg.proxy.queue_size))
    return dataclasses.replace(cfg, proxy=proxy, processes=n, process_index=index)


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel sends SIGTERM when the supervisor dies, even by SIGKILL, so no child outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def _child_main(cfg: LBConfig, log_level: str, ready: Any, parent: int) -> None:
    """One server process: its own event loop (uvloop) and LoadBalancer on the shared SO_REUSEPORT port."""
    _die_with_parent(parent)
    logging.basicConfig(level=log_level.upper(), format=PROCESS_LOG_FORMAT)
    install_uvloop()
    asyncio.run(serve(cfg, on_ready=lambda url: ready.set()))


def _reserve(host: str, port: int) -> socket.socket:
    """Bind (not listen) host:port with SO_REUSEPORT: fails at once when another program holds the port,
    resolves port 0 to one port for every child, and keeps that port ours while a child restarts. A socket
    that does not listen is never given connections."""
    family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind(addr)
    except OSError:
        s.close()
        raise
    return s


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclasses.dataclass
class _Child:
    index: int
    proc: Any  # multiprocessing.Process (spawn context)
    ready: Any  # multiprocessing.Event
    started: float
    was_ready: bool = False


class Supervisor:
    """Starts N children, waits until every one serves, restarts one that dies, stops all on a signal."""

    def __init__(self, cfg: LBConfig, n: int, log_level: str = "info") -> None:
        self.cfg, self.n, self.log_level = cfg, n, log_level
        self.ctx = multiprocessing.get_context("spawn")
        self.children: list[_Child] = []
        self.deaths: list[float] = []
        self.stopping: int | None = None  # the signal that asked us to stop
        self.metrics_dir = ""

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stopping is not None:  # a second signal: no more waiting for the children to drain
            for c in self.children:
                if c.proc.is_alive():
                    c.proc.kill()
        self.stopping = signum

    def _start(self, index: int) -> _Child:
        ready = self.ctx.Event()
        proc = self.ctx.Process(target=_child_main, args=(per_process(self.cfg, self.n, index), self.log_level, ready, os.getpid()),
                                name=f"sglang-p2p-lb-{index}", daemon=True)
        proc.start()
        log.info("started server process %d of %d (pid %d)", index + 1, self.n, proc.pid)
        return _Child(index, proc, ready, time.monotonic())

    def _check(self) -> str | None:
        """Note children that became ready, restart dead ones; a reason to stop everything, or None."""
        for i, c in enumerate(self.children):
            if not c.was_ready and c.ready.is_set():
                c.was_ready = True
            if c.proc.is_alive():
                if not c.was_ready and time.monotonic() - c.started > READY_TIMEOUT_S:
                    return f"server process {c.index + 1} (pid {c.proc.pid}) did not start serving within {READY_TIMEOUT_S:g}s"
                continue
            if self.stopping is not None:
                return None  # a Ctrl-C reaches every process of the group at once: not a death to mend
            how = describe_exit(c.proc.exitcode)
            if not c.was_ready:
                return f"server process {c.index + 1} (pid {c.proc.pid}) {how} before it served (see its log above)"
            now = time.monotonic()
            self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW_S] + [now]
            if len(self.deaths) > MAX_RESTARTS:
                return f"server process {c.index + 1} (pid {c.proc.pid}) {how}: {len(self.deaths)} deaths within {RESTART_WINDOW_S:g}s, not restarting"
            self._forget(c)
            log.error("server process %d (pid %d) %s; restarting it (its in-flight requests were lost)", c.index + 1, c.proc.pid, how)
            self.children[i] = self._start(c.index)
        return None

    def _forget(self, c: _Child) -> None:
        """Drop a dead child's live gauges (in-flight requests) from the shared metrics; its counters stay."""
        if self.metrics_dir:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(c.proc.pid, self.metrics_dir)

    def _wait(self, timeout: float) -> None:
        multiprocessing.connection.wait([c.proc.sentinel for c in self.children], timeout)

    def run(self) -> int:
        try:
            reserved = _reserve(self.cfg.host, self.cfg.port)
        except OSError as e:
            log.error("cannot bind %s:%d: %s", self.cfg.host, self.cfg.port, e)
            return 1
        self.cfg = dataclasses.replace(self.cfg, port=reserved.getsockname()[1])
        # one shared metrics directory: /metrics from any child sums every child's counters and histograms
        self.metrics_dir = tempfile.mkdtemp(prefix="sglang-p2p-lb-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        why: str | None = None
        try:
            self.children = [self._start(i) for i in range(self.n)]
            announced = False
            while self.stopping is None:
                why = self._check()
                if why is not None:
                    log.error("%s; stopping every server process", why)
                    return 1
                if not announced and all(c.was_ready for c in self.children):
                    announced = True
                    url = f"http://{self.cfg.host}:{self.cfg.port}"
                    log.info("%d server processes on %s (pids %s)", self.n, url, " ".join(str(c.proc.pid) for c in self.children))
                    print(f"sglang-p2p-lb listening on {url} ({self.n} processes)", flush=True)
                self._wait(0.05 if not announced else 0.5)
            log.info("%s: stopping %d server processes", signal.Signals(self.stopping).name, self.n)
            return 0
        finally:
            self._stop_all()
            for s, h in old.items():
                signal.signal(s, h)
            reserved.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)

    def _stop_all(self) -> None:
        """SIGTERM to every child (each drains like a single LB does), SIGKILL to any left after the grace."""
        for c in self.children:
            if c.proc.is_alive():
                c.proc.terminate()
        end = time.monotonic() + STOP_GRACE_S
        while any(c.proc.is_alive() for c in self.children) and time.monotonic() < end:
            self._wait(max(0.0, min(0.5, end - time.monotonic())))
        for c in self.children:
            if c.proc.is_alive():
                log.warning("server process %d (pid %d) still running after %gs: killing it", c.index + 1, c.proc.pid, STOP_GRACE_S)
                c.proc.kill()
            c.proc.join(5)


def run(cfg: LBConfig, workers: int, log_level: str) -> int:
    """The CLI's entry: `--workers 1` is the one-process LB exactly as before."""
    if workers <= 1:
        return run_single(cfg)
    return Supervisor(cfg, workers, log_level).run()

