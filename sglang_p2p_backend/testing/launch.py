"""Run a prefill-role and a decode-role driver process for one plan and collect their results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(plan: dict, timeout: float = 120.0, env: Optional[dict] = None, workdir: Optional[str] = None) -> dict:
    """Start both roles on 127.0.0.1, wait for them, return {"prefill": result|None, "decode": result|None,
    "returncodes": {...}}. A role that died (a fault plan) has result None."""
    workdir = workdir or tempfile.mkdtemp(prefix="p2p-pair-")
    plan = dict(plan)
    plan.setdefault("bootstrap_port", free_port())
    plan.setdefault("dist_ports", {"prefill": free_port(), "decode": free_port()})
    plan["ready_files"] = {r: os.path.join(workdir, f"{r}.ready") for r in ("prefill", "decode")}
    plan_path = os.path.join(workdir, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    # every address SGLang hands out stays on loopback
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", SGLANG_HOST_IP="127.0.0.1", **(env or {}))
    procs, outs, logs = {}, {}, {}
    for role in ("prefill", "decode"):
        outs[role] = os.path.join(workdir, f"{role}.json")
        logs[role] = open(os.path.join(workdir, f"{role}.log"), "w")
        procs[role] = subprocess.Popen(
            [sys.executable, "-m", "sglang_p2p_backend.testing.driver", "--role", role, "--plan", plan_path, "--out", outs[role]],
            env=full_env,
            stdout=logs[role],
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + timeout
    codes = {}
    for role, p in procs.items():
        try:
            codes[role] = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            codes[role] = "timeout"
    result = {"returncodes": codes, "workdir": workdir}
    for role in procs:
        logs[role].close()
        result[role] = json.load(open(outs[role])) if os.path.exists(outs[role]) else None
    return result
