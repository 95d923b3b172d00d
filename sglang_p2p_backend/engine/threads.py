"""OS-level names for the backend's threads, so `top -H`, `/proc/PID/task/*/comm` and profilers show them.

Python's `threading.Thread(name=...)` names a thread for Python only (before 3.14); inside an SGLang scheduler
every thread would otherwise show as the process's title. Linux keeps 15 bytes of a thread name.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Optional

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
