"""A loopback PD stack for smoke sweeps: one simulated prefill, one simulated decode and the project's LB.

Uses the project's simulated worker, ``python -m simworker`` (it runs no model; latency follows its timing flags)
and ``python -m sglang_p2p_lb``.  Everything binds 127.0.0.1 on free ports and is stopped on exit.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from .errors import SweepError

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def default_python() -> str:
    # the LB's dependencies live in the project's .venv, not in the tools' venv
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


@dataclass(frozen=True)
class StackPorts:
    prefill: int
    bootstrap: int
    decode: int
    lb: int

    @classmethod
    def pick(cls) -> "StackPorts":
        ports: set[int] = set()
        while len(ports) < 4:
            ports.add(free_port())
        return cls(*sorted(ports))


def commands(python: str, ports: StackPorts, sim_args: Sequence[str] = ()) -> dict[str, list[str]]:
    sim = [python, "-m", "simworker", "--host", HOST]
    return {
        "prefill": [*sim, "--role", "prefill", "--port", str(ports.prefill), "--bootstrap-port", str(ports.bootstrap), *sim_args],
        "decode": [*sim, "--role", "decode", "--port", str(ports.decode), *sim_args],
        "lb": [python, "-m", "sglang_p2p_lb", "--prefill", f"http://{HOST}:{ports.prefill}", str(ports.bootstrap),
               "--decode", f"http://{HOST}:{ports.decode}", "--host", HOST, "--port", str(ports.lb)],
    }


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SweepError(f"{url}: process exited with {proc.returncode}; log {log}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1.0):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise SweepError(f"{url} not healthy after {timeout_s:.0f} s; log {log}")


@contextmanager
def local_stack(log_dir: Path, python: str | None = None, sim_args: Sequence[str] = (),
                timeout_s: float = 30.0) -> Iterator[str]:
    """Start prefill, decode and LB; yield the LB's base URL; stop all three."""
    if not (REPO / "simworker" / "__main__.py").exists():
        raise SweepError("simworker/ is missing: --launch-sim needs the project's simulated worker")
    python = python or default_python()
    ports = StackPorts.pick()
    # the simulated worker is a package at the repository root, the LB's lives under lb/
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "lb")]), PYTHONUNBUFFERED="1")
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        for name, cmd in commands(python, ports, sim_args).items():
            log = log_dir / f"{name}.log"
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                              stdin=subprocess.DEVNULL, cwd=REPO))
            port = getattr(ports, name)
            wait_healthy(f"http://{HOST}:{port}", procs[-1], log, timeout_s)
        yield f"http://{HOST}:{ports.lb}"
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
