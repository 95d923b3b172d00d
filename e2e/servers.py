"""Start real SGLang servers and our LB on 127.0.0.1, wait until they serve, and stop them all.

Servers that share a GPU start one after the other: SGLang sizes its KV pool from the GPU memory that is
free when the process starts, so a second server that starts while the first is still loading sees memory
vanish under it and fails ("Loaded weights leave no GPU memory for the KV cache"). The next server on a GPU
therefore starts once the previous one logged "Memory pool end" (its pool is allocated). Servers on
different GPUs start in parallel. Every process runs in its own session so that the whole tree (scheduler,
detokenizer) is ended with one killpg. Because such a session outlives its parent, every started pid is also
appended to ``$E2E_PIDFILE``: run_all.sh ends whatever a killed step left behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

POOL_READY = "Memory pool end"
PIDFILE_ENV = "E2E_PIDFILE"
LAUNCH_TIMEOUT_S = 300.0


#: how far a server's --nccl-port lies from its HTTP port (`nccl_port`): the e2e servers' ports are 30000-36000
NCCL_PORT_DELTA = 20000


def nccl_port(port: int) -> int:
    """The --nccl-port of the SGLang server on HTTP port `port`: distinct for distinct ports, inside 1024-65535."""
    return port + NCCL_PORT_DELTA if port + NCCL_PORT_DELTA <= 65535 else port - NCCL_PORT_DELTA


@dataclass
class Server:
    """One SGLang server (mode "null" = not disaggregated) or one LB (mode "lb")."""

    name: str
    port: int
    mode: str
    model: Optional[Path] = None
    gpu: int = 0
    backend: Optional[str] = None
    bootstrap_port: Optional[int] = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    lb_prefill: Optional["Server"] = None
    lb_decode: Optional["Server"] = None
    #: the command as given (a server started by the launcher from a topology); None: built from the fields
    argv: Optional[list[str]] = None
    proc: Optional[subprocess.Popen] = None
    log: Optional[Path] = None
    error: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if self.argv is not None:
            return list(self.argv)
        if self.mode == "lb":
            assert self.lb_prefill and self.lb_decode
            return [sys.executable, "-m", "sglang_p2p_lb",
                    "--prefill", self.lb_prefill.url, str(self.lb_prefill.bootstrap_port),
                    "--decode", self.lb_decode.url, "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "warning", *self.args]
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model),
               "--served-model-name", self.model.name if self.model else self.name,
               "--host", "127.0.0.1", "--port", str(self.port), "--base-gpu-id", str(self.gpu)]
        if self.mode != "null":
            cmd += ["--disaggregation-mode", self.mode, "--disaggregation-transfer-backend", str(self.backend)]
            if self.mode == "prefill":
                cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if "--nccl-port" not in self.args:
            # SGLang's default is a port the OS found free a moment before: two servers started together once drew
            # the same one and the later failed to start (EADDRINUSE, 1 x H200, session 38); one derived from this
            # server's own port cannot collide with another's
            cmd += ["--nccl-port", str(nccl_port(self.port))]
        return cmd + self.args

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        if not self.log or not self.log.exists():
            return ""
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-n:])


def http_ok(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def record_pid(pid: int) -> None:
    """Note a process-group leader for run_all.sh's clean-up (no-op outside run_all.sh)."""
    path = os.environ.get(PIDFILE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{pid}\n")


def exit_on_sigterm() -> None:
    """Turn SIGTERM (run_all.sh's per-step timeout) into SystemExit, so `with Stack` stops its servers."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _log_has(path: Path, marker: str) -> bool:
    try:
        return marker in path.read_text(errors="replace")
    except OSError:
        return False


class Stack:
    """The processes of one step; a context manager that always stops them."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.servers: list[Server] = []

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, s: Server) -> None:
        s.log = self.log_dir / f"{s.name}.log"
        env = {**os.environ, **s.env}
        with open(s.log, "w") as f:
            f.write("$ " + " ".join(s.command()) + "\n")
            f.flush()
            s.proc = subprocess.Popen(s.command(), stdout=f, stderr=subprocess.STDOUT, env=env,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        record_pid(s.proc.pid)
        self.servers.append(s)

    def _start_after_pool(self, queue: Sequence[Server], deadline: float) -> None:
        for i, s in enumerate(queue):
            self.start(s)
            if i == len(queue) - 1:
                break
            while time.monotonic() < deadline and s.alive() and not _log_has(s.log, POOL_READY):
                time.sleep(1.0)

    def launch(self, sglang: Sequence[Server], timeout_s: float = LAUNCH_TIMEOUT_S, lanes: int = 1) -> list[Server]:
        """Start SGLang servers (staggered per GPU), wait for /health; returns those that came up.

        ``lanes`` > 1 deals each GPU's servers round-robin into that many queues that start side by side, each
        queue still staggered: only for servers whose --max-total-tokens cap is far below what the GPU has free
        (single-GPU check, see config.py), where a neighbour's start cannot take a pool's memory away."""
        deadline = time.monotonic() + timeout_s
        queues = launch_queues(sglang, lanes)
        threads = [threading.Thread(target=self._start_after_pool, args=(q, deadline)) for q in queues]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.wait_healthy(sglang, deadline)

    def wait_healthy(self, servers: Sequence[Server], deadline: float) -> list[Server]:
        pending = list(servers)
        up: list[Server] = []
        while pending and time.monotonic() < deadline:
            for s in list(pending):
                if not s.alive():
                    s.error = f"exited with {s.proc.returncode if s.proc else '?'} before serving"
                    pending.remove(s)
                elif http_ok(s.url + "/health"):
                    up.append(s)
                    pending.remove(s)
            time.sleep(1.0)
        for s in pending:
            s.error = s.error or f"not healthy within the launch timeout ({s.name})"
        return up

    def launch_lb(self, lb: Server, timeout_s: float = 60.0) -> bool:
        self.start(lb)
        return bool(self.wait_healthy([lb], time.monotonic() + timeout_s))

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every server's process group, SIGKILL each after `grace_s` whether or not its leader is gone
        (SGLang's scheduler can outlive the launcher; a group left behind keeps its ports, and a later server
        picking one failed with EADDRINUSE: docs/serving.md, session 30), then wait for every group to be gone."""
        groups = [s.proc.pid for s in self.servers if s.proc is not None]
        for pgid in groups:
            _signal_group(pgid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        for s in self.servers:
            while s.alive() and time.monotonic() < end:
                time.sleep(0.2)
        kill_groups(groups)
        for s in self.servers:
            if s.proc is not None:
                s.proc.poll()  # reaps the leader, so its pid does not linger as a zombie
        self.servers.clear()


def kill_groups(pgids: Sequence[int], wait_s: float = 10.0) -> None:
    """SIGKILL every process group in `pgids`, also one whose leader has already gone, and wait up to `wait_s` until
    none of their processes is left (their ports free again)."""
    for pgid in pgids:
        _signal_group(pgid, signal.SIGKILL)
    end = time.monotonic() + wait_s
    while any(_group_alive(g) for g in pgids) and time.monotonic() < end:
        time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` other than a zombie is left (a zombie holds no ports, and where nothing
    reaps it a signal 0 would see it for ever). Linux: read from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after its closing parenthesis
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def launch_queues(sglang: Sequence[Server], lanes: int = 1) -> list[list[Server]]:
    """Per GPU, its servers in order dealt into ``lanes`` queues (one queue per GPU when lanes == 1)."""
    by_gpu: dict[int, list[Server]] = {}
    for s in sglang:
        by_gpu.setdefault(s.gpu, []).append(s)
    queues = []
    for servers in by_gpu.values():
        n = max(1, min(lanes, len(servers)))
        queues += [servers[i::n] for i in range(n)]
    return queues


def failure_report(servers: Sequence[Server]) -> dict[str, str]:
    """name -> error and the last log lines, for every server that did not come up."""
    return {s.name: f"{s.error}\n{s.log_tail()}" for s in servers if s.error}
