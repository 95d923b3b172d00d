"""Start driver processes by forking a process that imported SGLang once, instead of a fresh interpreter each.

A driver spends about 13 s of CPU importing SGLang before it does anything; a test pair starts two or three of
them. Python's multiprocessing forkserver imports the modules named below once per test process and forks every
driver from there, so a driver starts in a fraction of a second with the same code paths: each child gets its
own environment, log file and exit code, runs the driver's `main`, and exits as `python -m ...driver` would.
SGLang and this project read their settings from the environment when a manager is built, not at import, so a
child's environment applies in full (tests/sglang/test_forkserver.py checks that).

Only where CUDA is absent by default: CUDA does not survive a fork once initialised, and importing SGLang on a
GPU host asks CUDA about its devices. `P2P_TEST_FORKSERVER=1` forces the fork server, `=0` starts every driver
as a fresh interpreter.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import subprocess
import sys
from typing import Optional

#: imported once by the fork server: everything a driver imports up to its manager, SGLang included
PRELOAD = ["sglang_p2p_backend.testing.preload"]

_CONTEXT: Optional[mp.context.BaseContext] = None


def enabled() -> bool:
    """Whether drivers are forked (`P2P_TEST_FORKSERVER`, else: this host has no CUDA device)."""
    setting = os.environ.get("P2P_TEST_FORKSERVER", "")
    if setting in ("0", "1"):
        return setting == "1"
    if setting:
        raise ValueError(f"P2P_TEST_FORKSERVER={setting!r}: use 1 (fork the drivers) or 0 (a fresh interpreter each)")
    import torch

    return not torch.cuda.is_available()


def _context() -> mp.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _run(main: str, argv: list[str], env: dict, log_path: str) -> None:
    """The child: its own environment and log, then `main(argv)` ("module:function") as a script's `__main__`
    would run it; what `main` returns is the exit code."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    module, _, func = main.partition(":")
    code = getattr(importlib.import_module(module), func)(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)


class ForkedProcess:
    """What PairRun and its tests use of a `subprocess.Popen` (pid, poll, wait, kill, returncode), over a forked child."""

    def __init__(self, proc: mp.process.BaseProcess, argv: list[str]):
        self.proc, self.args, self.pid = proc, argv, proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.exitcode

    def poll(self) -> Optional[int]:
        return self.proc.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()


def start(main: str, argv: list[str], env: dict, log_path: str) -> ForkedProcess:
    """Fork a process that runs `main(argv)` ("module:function") with exactly `env`, its output appended to
    `log_path`."""
    proc = _context().Process(target=_run, args=(main, argv, env, log_path), daemon=False)
    proc.start()
    return ForkedProcess(proc, [main, *argv])
