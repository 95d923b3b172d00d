"""Run a prefill-role and a decode-role driver process for one plan and collect their results."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from sglang_p2p_backend.testing import forkserver


DRIVER = "sglang_p2p_backend.testing.driver"
_SPAN = 12000
_next_port: Optional[int] = None


def _port_range() -> tuple[int, int]:
    """This process's share of the ports below the kernel's ephemeral range: each pytest-xdist worker has a
    slice of its own, so two workers never pick the same port between one's check and the other's bind."""
    low = 20000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = max(low, min(int(f.read().split()[0]), 32768) - _SPAN)
    except OSError:
        pass
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker) % count if worker.isdigit() else 0
    width = _SPAN // count
    return low + index * width, low + (index + 1) * width


def free_port() -> int:
    """A free port below the kernel's ephemeral range: ports the OS hands out for binds to port 0 (ZMQ's
    random rank ports, client sockets) come from that range, so a port picked here cannot be taken by one of
    them between this check and the process that binds it. Ports are handed out in turn from a random start,
    never twice until the slice wraps: several picked for one run (bootstrap, process-group stores) are
    bound only later, so a free check alone would let two of them be the same port."""
    global _next_port
    low, high = _port_range()
    if _next_port is None or not low <= _next_port < high:
        _next_port = random.Random().randrange(low, high)
    for _ in range(high - low):
        port = _next_port
        _next_port = low + (_next_port + 1 - low) % (high - low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


def one_gpu_env(name: str) -> dict:
    """What lets the two ranks of a pair share one GPU over NCCL: NCCL refuses two ranks of one communicator on
    one GPU of one host ("Duplicate GPU detected"), so each process names a host of its own (NCCL_HOSTID) and
    NCCL moves the bytes through its socket transport on loopback. Real NCCL, real code paths; not NVLink speed."""
    return {"NCCL_HOSTID": f"p2p-{name}-{os.getpid()}", "NCCL_SOCKET_IFNAME": "lo"}


#: how long a rank may take to come up: a driver started as a fresh interpreter imports SGLang (about 13 s of
#: CPU), as does the fork server before its first driver, and several starting side by side on a 2-core machine
#: take minutes; a test's deadlines count from there, since no test asserts on start-up time
STARTUP_S = 240.0


class PairRun:
    """A prefill-role and a decode-role driver (one process per rank) running one plan on 127.0.0.1."""

    def __init__(self, plan: dict, env: Optional[dict] = None, workdir: Optional[str] = None):
        self.workdir = workdir or tempfile.mkdtemp(prefix="p2p-pair-")
        plan = dict(plan)
        plan.setdefault("bootstrap_port", free_port())
        # one process group (gloo store) per replica of a server; each rank's process is `rank = replica * tp + tp rank`
        procs = {role: int(plan.get("tp", {}).get(role, 1)) * int(plan.get("dp", {}).get(role, 1))
                 for role in ("prefill", "decode")}
        replicas = {role: int(plan.get("dp", {}).get(role, 1)) for role in procs}
        plan.setdefault("dist_ports", {role: [free_port() for _ in range(n)] for role, n in replicas.items()})
        plan["workdir"] = self.workdir
        self.plan = plan
        plan_path = os.path.join(self.workdir, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        # every address SGLang hands out stays on loopback
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", SGLANG_HOST_IP="127.0.0.1", **(env or {}))
        self.procs, self.outs, self.logs = {}, {}, {}
        self.env = full_env
        for role in ("prefill", "decode"):
            for rank in range(procs[role]):
                self.outs[(role, rank)] = os.path.join(self.workdir, f"{role}-{rank}.json")
                self.procs[(role, rank)] = self.start(role, rank, plan_path, self.outs[(role, rank)])

    def start(self, role: str, rank: int, plan_path: str, out: str, env: Optional[dict] = None) -> Any:
        """One more driver process (a restarted server, say) on another plan; its log goes next to `out`.
        Returns a `subprocess.Popen` or what stands for one (testing/forkserver.py)."""
        log_path = out.removesuffix(".json") + ".log"
        argv = ["--role", role, "--rank", str(rank), "--plan", plan_path, "--out", out]
        full_env = {**self.env, **(env or {})}
        if forkserver.enabled():
            open(log_path, "w").close()
            return forkserver.start(f"{DRIVER}:main", argv, full_env, log_path)
        log = open(log_path, "w")
        self.logs[(role, rank, out)] = log
        return subprocess.Popen(
            [sys.executable, "-m", DRIVER, *argv],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _session_path(self, role: str, rank: int) -> str:
        return os.path.join(self.workdir, f"{role}-{rank}.session")

    def _up(self, key: tuple) -> bool:
        """A rank's manager is up (it wrote its session) or the rank has ended."""
        path = self._session_path(*key)
        return (os.path.exists(path) and bool(open(path).read())) or self.procs[key].poll() is not None

    def session(self, role: str, rank: int = 0, timeout: float = STARTUP_S) -> str:
        """The control endpoint ("ip:port") of a rank, once its manager is up."""
        path = self._session_path(role, rank)
        deadline = time.monotonic() + timeout
        while not os.path.exists(path) or not open(path).read():
            if time.monotonic() > deadline or self.procs[(role, rank)].poll() is not None:
                raise RuntimeError(f"{role} rank {rank} did not start (see {self.workdir})")
            time.sleep(0.05)
        return open(path).read()

    def wait(self, timeout: float = 120.0, roles: tuple = ("prefill", "decode")) -> dict:
        """Wait for the ranks of `roles` (the others are killed once those ended), return {"prefill": result|None,
        "decode": result|None, "returncodes": {...}}. A rank that died (a fault plan) has result None.
        `timeout` counts from when every rank is up: start-up has its own allowance (`STARTUP_S`)."""
        up_by = time.monotonic() + STARTUP_S
        while not all(self._up(key) for key in self.procs) and time.monotonic() < up_by:
            time.sleep(0.05)
        deadline = time.monotonic() + timeout
        codes = {}
        order = sorted(self.procs, key=lambda k: k[0] not in roles)
        for key in order:
            p = self.procs[key]
            try:
                codes[key] = p.wait(max(1.0, deadline - time.monotonic()) if key[0] in roles else 0.1)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes[key] = "timeout" if key[0] in roles else "killed"
        result = {"workdir": self.workdir, "ranks": {"prefill": [], "decode": []}}
        for log in self.logs.values():
            log.close()
        for key in self.procs:
            out = self.outs[key]
            result["ranks"][key[0]].append(json.load(open(out)) if os.path.exists(out) else None)
            if not os.path.exists(out):  # shown by pytest when the test then fails: why this rank has no result
                print(f"{key[0]} rank {key[1]} ended ({codes[key]}) without a result; its log ends:\n"
                      f"{_tail(out.removesuffix('.json') + '.log')}", file=sys.stderr)
        # rank 0 of each role, the common case of one rank a server
        result["returncodes"] = {role: codes[(role, 0)] for role in ("prefill", "decode")}
        result["prefill"], result["decode"] = result["ranks"]["prefill"][0], result["ranks"]["decode"][0]
        return result


def log_tails(result: dict, lines: int = 25) -> str:
    """The last `lines` of every rank's log of a finished run (`run_pair`'s result): an assertion's message, so a
    failure seen once on a loaded CI machine shows what each rank did last."""
    workdir = result.get("workdir", "")
    names = sorted(n for n in os.listdir(workdir) if n.endswith(".log")) if os.path.isdir(workdir) else []
    return "\n".join(f"--- {name}:\n{_tail(os.path.join(workdir, name), lines)}" for name in names)


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def run_pair(plan: dict, timeout: float = 120.0, env: Optional[dict] = None, workdir: Optional[str] = None) -> dict:
    """Start both roles on 127.0.0.1, wait for them, return their results (see `PairRun.wait`)."""
    return PairRun(plan, env, workdir).wait(timeout)
