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

from sglang_p2p_backend.engine.copy.launches import Launch
from sglang_p2p_backend.engine.transport.cuda_ipc import IpcBackend, IpcUnavailable, WriteMarks
from sglang_p2p_backend.testing.role import IPC_BACKEND_ENV

_HANDLE_BYTES = 64
#: the "GPU" this process's segments are on (`device_id`): every role's is "shm" unless a test names another, which
#: puts prefill and decode on two "GPUs" of one host (the same-host path's cross-GPU rules apply)
DEVICE_ENV = "P2P_TEST_SHM_DEVICE"
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: a role's environment (`PairRun`'s env) in which the test driver installs this stand-in: the driver imports
#: it by name, so tests/ goes on that process's path (last: nothing of the suite may shadow a real module)
IPC_STANDIN = {
    IPC_BACKEND_ENV: "support.shm_ipc:ShmBackend",
    "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), _TESTS) if p),
}


def _address(shm: shared_memory.SharedMemory) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))


def _move(spans: list) -> None:
    for s, d, n in spans:
        ctypes.memmove(d, s, n)


class _Deferred(Launch):
    """Spans queued by `ShmBackend.launch`: copied by the first `wait()` or `done()`, on its thread (the GPU's part:
    a copy asked about has run, as a GPU's short copy has by the time anyone asks). Until then nothing moved, so
    anything that concludes a room before either would leave its pages unwritten."""

    def __init__(self, spans: list):
        self._spans, self._done = spans, False
        self._lock = threading.Lock()

    def done(self) -> bool:
        self.wait()
        return True

    def wait(self) -> None:
        with self._lock:
            if not self._done:
                _move(self._spans)
                self._done = True


class ShmBackend(IpcBackend):
    def __init__(self) -> None:
        self._own: dict[int, shared_memory.SharedMemory] = {}  # base -> segment this process created
        self._opened: dict[int, shared_memory.SharedMemory] = {}  # base -> segment mapped from a peer
        self._lock = threading.Lock()
        self._local = threading.local()  # per transfer thread: its last write's marks (`last_write`)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor in a new shared segment (the pools of a role that exports)."""
        shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        with self._lock:
            self._own[_address(shm)] = shm
        return torch.frombuffer(shm.buf, dtype=torch.uint8)[:nbytes]

    def usable(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def device_id(self, device: torch.device) -> str:
        return os.environ.get(DEVICE_ENV, "shm")

    def reach(self, device: torch.device, device_id: str) -> Optional[str]:
        return (None if device_id.startswith("shm") and device.type == "cpu"
                else f"not a shared-memory segment ({device_id})")

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
        now = time.perf_counter()  # as CudaBackend records its copy planned and queued, before its wait
        self._local.marks = WriteMarks(now, now, time.thread_time())
        spans = list(zip(src.tolist(), dst.tolist(), lens.tolist()))
        pending = getattr(self._local, "pending", None)
        if pending is not None:  # inside `launch`: the bytes move when the launch is waited for, as a GPU's would
            pending.extend(spans)
            return
        _move(spans)

    def launch(self, device: torch.device, write, timed: bool = False):
        """As CudaBackend's: the writes queued (here: kept) and left to the returned launch, which copies them when
        waited for, on the waiting thread; refused while this thread's last launch has not been waited for."""
        last = getattr(self._local, "launched", None)
        if last is not None and not last.done():
            return None
        self._local.pending = pending = []
        try:
            result = write()
        except BaseException:
            _move(pending)  # what was queued runs before the error is raised (nothing left running)
            raise
        finally:
            self._local.pending = None
        self._local.launched = launched = _Deferred(pending)
        return result, launched

    def last_write(self) -> Optional[WriteMarks]:
        return getattr(self._local, "marks", None)

    def close(self) -> None:
        with self._lock:
            own, self._own = list(self._own.values()), {}
        for shm in own:
            shm.unlink()
