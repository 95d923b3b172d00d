"""Same-host writes queued by one thread and waited for by another. The prefill's scheduler thread queues a
chunk's copy when SGLang hands the chunk over, and the transfer worker that owns the peer waits for it, then sends
the Status. Each launch records one event on the copy stream behind its copies. A thread's events come from a small
pool of its own: they are reused, not created per chunk, and go back to the pool once waited for.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, List, Optional

from sglang_p2p_backend.engine.copy.stream_ops import EVENT_DISABLE_TIMING, check_call, event_done

_P = ctypes.c_void_p


class Launch:
    """Copies queued without their wait. `wait()`, from any thread, returns once they have run and raises if they
    failed; it may be called again. `done()` says whether they have run, without waiting."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def gpu_ms(self) -> Optional[float]:
        """The copies' own time on the device (ms), where the launch was timed and they have run; else None."""
        return None


class Done(Launch):
    """Copies that had run before their launch returned (a backend that copies at once)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Done()


class EventPool:
    """At most `limit` events of one device, ordering-only unless `timing` (SGLANG_P2P_ROOM_TIMES: a launch then
    also takes one to record before its copies, and the two give their device time). The thread that records them
    takes them, and the threads that wait for them give them back (under a lock)."""

    def __init__(self, rt: Any, index: int, limit: int = 4, timing: bool = False):
        self.rt, self.index, self.limit, self.timing = rt, index, limit, timing
        rt.cudaEventRecord.argtypes = [_P, _P]
        rt.cudaEventQuery.argtypes = [_P]
        rt.cudaEventSynchronize.argtypes = [_P]
        rt.cudaEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), _P, _P]
        for fn in (rt.cudaEventRecord, rt.cudaEventQuery, rt.cudaEventSynchronize, rt.cudaEventCreateWithFlags,
                   rt.cudaEventElapsedTime):
            fn.restype = ctypes.c_int
        self._free: List[_P] = []
        self._all: List[_P] = []
        self._lock = threading.Lock()

    def take(self) -> Optional[_P]:
        """A free event, made if fewer than `limit` exist (the caller has the device current); None when every
        event is still held by a launch nobody has waited for."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if len(self._all) >= self.limit:
                return None
            event = _P()
            flags = 0 if self.timing else EVENT_DISABLE_TIMING  # 0: cudaEventDefault, which keeps a timestamp
            check_call(self.rt, self.rt.cudaEventCreateWithFlags(ctypes.byref(event), flags),
                       "cudaEventCreateWithFlags", self.index)
            self._all.append(event)
            return event

    def give(self, event: _P) -> None:
        with self._lock:
            self._free.append(event)

    def __del__(self) -> None:
        for event in getattr(self, "_all", ()):
            try:
                self.rt.cudaEventDestroy(event)
            except Exception:  # noqa: BLE001 - at interpreter exit the runtime may be gone; nothing is left to free
                pass


class EventLaunch(Launch):
    """The copies a thread queued on its copy stream before `event` was recorded there (CudaBackend.launch); where
    timed, after `start` was recorded there too."""

    def __init__(self, pool: EventPool, event: _P, start: Optional[_P] = None):
        self._pool, self._event, self._start = pool, event, start
        self._lock = threading.Lock()
        self._waited = False
        self._ms: Optional[float] = None

    def done(self) -> bool:
        """Asked by the launching thread only, which alone records events again: until the waiter has given the
        event back, it is this launch's (no lock: a query must not wait behind the waiter's synchronize)."""
        return self._waited or event_done(self._pool.rt, self._event, self._pool.index)

    def wait(self) -> None:
        """Wait for the copies (the GIL is released meanwhile: ctypes drops it); the event goes back to its pool
        once, even when the copies failed (CudaCallError names CUDA's error)."""
        with self._lock:  # one waiter gives the event back, once
            if self._waited:
                return
            try:
                check_call(self._pool.rt, self._pool.rt.cudaEventSynchronize(self._event), "cudaEventSynchronize",
                           self._pool.index)
                self.gpu_ms()  # read before the events go back
            finally:
                self._waited = True
                self._pool.give(self._event)
                if self._start is not None:
                    self._pool.give(self._start)

    def gpu_ms(self) -> Optional[float]:
        """From `start` to `event` on the device, once both have run: read while the events are this launch's (the
        waiter reads it before it gives them back, and later answers come from that reading); None untimed."""
        if self._ms is None and self._start is not None and not self._waited and self.done():
            ms = ctypes.c_float()
            if self._pool.rt.cudaEventElapsedTime(ctypes.byref(ms), self._start, self._event) == 0:
                self._ms = float(ms.value)
        return self._ms
