"""SIGSTOP a process and wait until the kernel reports it stopped: the signal is delivered asynchronously, and a
test that acts right after os.kill can race a process that is still running."""

import os
import signal
import time


def stop(pid: int, timeout_s: float = 5.0) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the field after "(comm)"
        if state in ("T", "t"):
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} not stopped {timeout_s}s after SIGSTOP")
