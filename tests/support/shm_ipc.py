"""A CPU stand-in for CUDA IPC (tests only): pools in POSIX shared memory, handles are segment names.

It stands in for hardware CI lacks (a GPU), so that the same-host path's registration exchange, export checks,
mapping per decode process, bounds on every write, aux rows, Status ordering and unmapping on restart run
through SGLang's real classes on a CPU machine. What it does not prove: the CUDA calls and the copy kernel
(tests/gpu/test_cuda_ipc.py and the benchmark do, on a GPU). The test driver installs it in a role's process
before the manager starts when that process's environment carries `IPC_STANDIN`.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import numpy as np
import torch

from sglang_p2p_backend.engine.transport.cuda_ipc import IpcBackend, IpcUnavailable
from sglang_p2p_backend.testing.role import IPC_BACKEND_ENV

_HANDLE_BYTES = 64
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: a role's environment (`PairRun`'s env) in which the test driver installs this stand-in: the driver imports
#: it by name, so tests/ goes on that process's path (last: nothing of the suite may shadow a real module)
IPC_STANDIN = {
    IPC_BACKEND_ENV: "support.shm_ipc:ShmBackend",
    "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), _TESTS) if p),
}


def _address(shm: shared_memory.SharedMemory) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))


class ShmBackend(IpcBackend):
    def __init__(self) -> None:
        self._own: dict[int, shared_memory.SharedMemory] = {}  # base -> segment this process created
        self._opened: dict[int, shared_memory.SharedMemory] = {}  # base -> segment mapped from a peer
        self._lock = threading.Lock()
        self._local = threading.local()  # per transfer thread: when its last write started (`last_queued`)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor in a new shared segment (the pools of a role that exports)."""
        shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        with self._lock:
            self._own[_address(shm)] = shm
        return torch.frombuffer(shm.buf, dtype=torch.uint8)[:nbytes]

    def usable(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def device_id(self, device: torch.device) -> str:
        return "shm"

    def reach(self, device: torch.device, device_id: str) -> Optional[str]:
        return None if device_id == "shm" and device.type == "cpu" else f"not a shared-memory segment ({device_id})"

    def allocation(self, ptr: int) -> tuple[int, int]:
        with self._lock:
            for base, shm in self._own.items():
                if base <= ptr < base + shm.size:
                    return base, shm.size
        raise IpcUnavailable(f"address {ptr:#x} is not in shared memory")

    def get_handle(self, base: int) -> bytes:
        name = self._own[base].name.encode()
        if len(name) > _HANDLE_BYTES:
            raise IpcUnavailable(f"segment name {name!r} is too long for a handle")
        return name.ljust(_HANDLE_BYTES, b"\0")

    def open_handle(self, handle: bytes, device: torch.device) -> int:
        try:
            shm = shared_memory.SharedMemory(name=handle.rstrip(b"\0").decode())
        except (FileNotFoundError, UnicodeDecodeError, ValueError) as e:
            raise IpcUnavailable(f"cannot open shared segment: {e}") from e
        # the creator owns the segment: this process's tracker must not unlink it at exit
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - Python < 3.13 has no track=False
        base = _address(shm)
        with self._lock:
            self._opened[base] = shm
        return base

    def close_handle(self, ptr: int, device: torch.device) -> None:
        with self._lock:
            shm = self._opened.pop(ptr, None)
        if shm is not None:
            shm.close()

    def mapped_count(self) -> int:
        with self._lock:
            return len(self._opened)

    def write(self, device: torch.device, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        self._local.queued_at = time.perf_counter()  # as CudaBackend records its copy queued, before its wait
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            ctypes.memmove(d, s, n)

    def last_queued(self) -> Optional[float]:
        return getattr(self._local, "queued_at", None)

    def close(self) -> None:
        with self._lock:
            own, self._own = list(self._own.values()), {}
        for shm in own:
            shm.unlink()
