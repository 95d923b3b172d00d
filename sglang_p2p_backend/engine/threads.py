"""What the backend's threads need of the process they run in: OS-level names (`top -H`, `/proc/PID/task/*/comm`
and profilers show them), their rank's GPU as their current device, and a GIL switch interval short enough for
them to get the GIL back promptly.

Python's `threading.Thread(name=...)` names a thread for Python only (before 3.14); inside an SGLang scheduler
every thread would otherwise show as the process's title. Linux keeps 15 bytes of a thread name.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15
_libc: Optional[ctypes.CDLL] = None


def set_os_name(name: str) -> None:
    """Name the calling thread for the OS (Linux; elsewhere, or when libc cannot be loaded, nothing happens)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def use_device(device: Optional[torch.device]) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for None or a CPU device); once, at a
    transfer thread's start. The runtime's current device is per thread and a new thread's is device 0, whatever
    the scheduler set in its own, so on a rank of GPU 1 every stream helper (copy/stream_ops.py's StreamOps and
    on_stream) took its slow path: torch's device and stream context managers, three a chunk on the decode's
    receiver, and the device set back to 0 after each use where GPU 0 had a context (the receiver's profile on
    2 x H200, docs/nccl.md, session 32)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def enter_thread(name: str, device: Optional[torch.device]) -> None:
    """What every transfer thread does first: its OS name, then `device` as its current device. A device that
    cannot be made current is logged and the thread goes on: its first CUDA call then fails the chunk it serves,
    the usual way, rather than the thread dying silently."""
    set_os_name(name)
    try:
        use_device(device)
    except Exception:
        logger.exception("p2pnccl: thread %s cannot use %s (it goes on)", threading.current_thread().name, device)


def shorten_gil_switch(ms: float) -> None:
    """Lower this process's GIL switch interval to `ms` (never raise it; 0 leaves it). A backend thread that
    released the GIL (CUDA sync, socket wait) otherwise waits up to 5 ms for a thread running Python without
    pause (an SGLang scheduler's main thread) to hand it back: once per chunk step on the prefill, once per
    Status on the decode. The running thread is asked to switch only when another thread waits, so the number
    of switches stays that of the backend's wake-ups; only the wait shrinks. The KV manager applies
    SGLANG_P2P_GIL_SWITCH_MS at start; the transfer benchmarks apply it too, so they run as the service does."""
    if ms > 0 and sys.getswitchinterval() > ms / 1e3:
        logger.info("p2pnccl: GIL switch interval %.3g ms -> %.3g ms (SGLANG_P2P_GIL_SWITCH_MS)",
                    sys.getswitchinterval() * 1e3, ms)
        sys.setswitchinterval(ms / 1e3)
