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


class Done(Launch):
    """Copies that had run before their launch returned (a backend that copies at once)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Done()


class EventPool:
    """At most `limit` ordering-only events of one device. The thread that records them takes them, and the threads
    that wait for them give them back (under a lock)."""

    def __init__(self, rt: Any, index: int, limit: int = 4):
        self.rt, self.index, self.limit = rt, index, limit
        rt.cudaEventRecord.argtypes = [_P, _P]
        rt.cudaEventQuery.argtypes = [_P]
        rt.cudaEventSynchronize.argtypes = [_P]
        for fn in (rt.cudaEventRecord, rt.cudaEventQuery, rt.cudaEventSynchronize, rt.cudaEventCreateWithFlags):
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
            check_call(self.rt, self.rt.cudaEventCreateWithFlags(ctypes.byref(event), EVENT_DISABLE_TIMING),
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
    """The copies a thread queued on its copy stream before `event` was recorded there (CudaBackend.launch)."""

    def __init__(self, pool: EventPool, event: _P):
        self._pool, self._event = pool, event
        self._lock = threading.Lock()
        self._waited = False

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
            finally:
                self._waited = True
                self._pool.give(self._event)
