"""The CUDA runtime calls the same-host write path makes around each copy, on the libcudart torch loaded.

A same-host write (transport/cuda_ipc.py) orders its copy stream after the caller's current stream (the forward
pass wrote the pages there), queues the page ids' upload and the copy, and waits for the stream. `StreamOps`
does the ordering, the upload and the wait with one runtime call each, on stream handles, for one thread and
device (its event must not be shared: a second thread's record could come between this one's record and wait).

Why by hand: torch's `Stream.wait_stream`, `copy_(non_blocking=True)` under `torch.cuda.stream(...)` and
`Stream.synchronize` each set and restore the current device around the call; a 4k-token write spent 14-40 us
in the ordering alone and 18-35 us in the device and stream context managers on 4 x H200 hosts (docs/bench.md),
where these calls take a microsecond or two. The current stream's raw handle is torch's own
(`torch._C._cuda_getCurrentRawStream`, what torch's compiler-generated code calls).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable, Optional

import torch

#: cudaEventDisableTiming: an event that only orders (recording it costs less)
EVENT_DISABLE_TIMING = 2
#: cudaMemcpyHostToDevice
MEMCPY_HOST_TO_DEVICE = 1

_P = ctypes.c_void_p


@functools.lru_cache(maxsize=None)
def cuda_libraries() -> tuple[Any, Any]:
    """(libcudart, libcuda) as torch loaded them (the soname of torch's CUDA major returns the copy already
    mapped), once a process; OSError where either is missing."""
    major = (torch.version.cuda or "").split(".")[0]
    rt, drv = ctypes.CDLL(f"libcudart.so.{major}"), ctypes.CDLL("libcuda.so.1")
    rt.cudaGetErrorString.restype = ctypes.c_char_p
    rt.cudaMemcpyAsync.argtypes = [_P, _P, ctypes.c_size_t, ctypes.c_int, _P]
    rt.cudaEventRecord.argtypes = [_P, _P]
    rt.cudaEventQuery.argtypes = [_P]
    for fn in (rt.cudaMemcpyAsync, rt.cudaEventRecord, rt.cudaEventQuery, rt.cudaEventCreateWithFlags):
        fn.restype = ctypes.c_int
    return rt, drv


def check_call(rt: Any, code: int, what: str, index: int) -> None:
    """Raise CudaCallError naming `what`, the device and the runtime's reason where `code` is an error."""
    if code != 0:
        try:
            rt.cudaGetErrorString.restype = ctypes.c_char_p
            why = f"{rt.cudaGetErrorString(code).decode()} (error {code})"
        except Exception:  # noqa: BLE001 - a stand-in runtime may lack it; the code is what matters
            why = f"error {code}"
        raise CudaCallError(f"{what} on cuda:{index} failed: {why}")


#: cudaEventQuery's answer while the work before the event has not run yet
EVENT_NOT_READY = 600


def event_done(rt: Any, event: Any, index: int) -> bool:
    """Whether the work queued before `event` has run (an event never recorded reads as done), without waiting;
    CudaCallError for any other answer of cudaEventQuery (a failed copy)."""
    code = rt.cudaEventQuery(event)
    if code == EVENT_NOT_READY:
        return False
    check_call(rt, code, "cudaEventQuery", index)
    return True


def upload_untracked(rt: Any, dst: int, src: int, nbytes: int, stream: int, index: int) -> None:
    """Queue a copy of `nbytes` from pinned host memory at `src` to device memory at `dst` on `stream` (raw
    handles) with the runtime itself. For pinned buffers kept for the process's life: torch's `copy_` from a pinned
    tensor adds the stream to the pinned block's uses, and freeing a block with uses records an event on each
    stream then, which aborts the process where the CUDA context is already gone (at interpreter exit; seen on 2 x
    H200, docs/nccl.md, session 30)."""
    check_call(rt, rt.cudaMemcpyAsync(_P(dst), _P(src), nbytes, MEMCPY_HOST_TO_DEVICE, _P(stream)),
               "cudaMemcpyAsync (upload)", index)


class on_stream:
    """`torch.cuda.stream(stream)` for a block: `stream` the calling thread's current stream on its device, the
    one before it current again after. Where that device is the thread's current one (a transfer thread's: each
    makes its rank's GPU current at its start, engine/threads.use_device), with torch's own two C entry points each
    way: torch's context manager also builds a Stream object for the stream it replaces and compares devices, 15-19
    us a use on the H200 hosts (bench/transfer/nccl_post.py's pieces), and the NCCL path takes two or three a chunk.
    Elsewhere, or where torch lacks those entry points, it is torch's context manager. None: nothing changes."""

    __slots__ = ("stream", "_prev", "_torch")

    def __init__(self, stream: Optional["torch.cuda.Stream"]):
        self.stream = stream
        self._prev: Optional[tuple] = None
        self._torch: Any = None

    def __enter__(self) -> Optional["torch.cuda.Stream"]:
        s = self.stream
        if s is None:
            return None
        get = getattr(torch._C, "_cuda_getCurrentStream", None)
        if get is None or torch._C._cuda_getDevice() != s.device_index:
            self._torch = torch.cuda.stream(s)
            self._torch.__enter__()
            return s
        self._prev = get(s.device_index)
        torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        return s

    def __exit__(self, *exc: Any) -> None:
        if self._torch is not None:
            ctx, self._torch = self._torch, None
            ctx.__exit__(*exc)
        elif self._prev is not None:
            prev, self._prev = self._prev, None
            torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])


class CudaCallError(RuntimeError):
    """A runtime call failed (the message names the call and CUDA's error)."""


class StreamOps:
    """Ordering, upload and wait on one device through `rt` (a ctypes CDLL of libcudart, or a stand-in with the
    same functions); one per thread and device."""

    def __init__(self, rt: Any, device: torch.device, current_stream: Optional[Callable[[int], int]] = None,
                 drv: Any = None):
        self.rt = rt
        #: libcuda (ctypes), to ask whether a device has a context before making it current again (`leave`);
        #: None: always restore
        self.drv = drv
        self.index = device.index or 0
        #: the raw handle of the calling thread's current stream on a device (torch's; a stand-in in CPU tests)
        self.current_stream = current_stream or torch._C._cuda_getCurrentRawStream
        rt.cudaEventRecord.argtypes = [_P, _P]
        rt.cudaStreamWaitEvent.argtypes = [_P, _P, ctypes.c_uint]
        rt.cudaMemcpyAsync.argtypes = [_P, _P, ctypes.c_size_t, ctypes.c_int, _P]
        rt.cudaStreamSynchronize.argtypes = [_P]
        rt.cudaSetDevice.argtypes = [ctypes.c_int]
        for fn in (rt.cudaEventRecord, rt.cudaStreamWaitEvent, rt.cudaMemcpyAsync, rt.cudaStreamSynchronize,
                   rt.cudaSetDevice, rt.cudaGetDevice, rt.cudaEventCreateWithFlags):
            fn.restype = ctypes.c_int
        #: how many `enter`s of this thread are open: a nested one (the kernel's launch inside a write) asks
        #: nothing of the runtime (a ctypes call is 2-4 us on the GPU hosts' CPUs)
        self._depth = 0
        event = _P()
        prev = self.enter()
        try:
            self.check(rt.cudaEventCreateWithFlags(ctypes.byref(event), EVENT_DISABLE_TIMING),
                        "cudaEventCreateWithFlags")
        finally:
            self.leave(prev)
        self.event = event  # destroyed with this object (the thread's copiers go when the thread does)

    def __del__(self) -> None:
        event, self.event = getattr(self, "event", None), None
        if event is not None and event.value:
            try:
                self.rt.cudaEventDestroy(event)
            except Exception:  # noqa: BLE001 - at interpreter exit the runtime may be gone; nothing is left to free
                pass

    def check(self, code: int, what: str) -> None:
        check_call(self.rt, code, what, self.index)

    def enter(self) -> int:
        """Make this device the calling thread's current one (a launch needs it); returns the device that was,
        for `leave`. Nothing is set where it already is (the transfer threads' case)."""
        if self._depth:
            self._depth += 1
            return self.index
        cur = ctypes.c_int(-1)
        self.check(self.rt.cudaGetDevice(ctypes.byref(cur)), "cudaGetDevice")
        if cur.value != self.index:
            self.check(self.rt.cudaSetDevice(self.index), "cudaSetDevice")
        self._depth = 1
        return cur.value

    def leave(self, prev: int) -> None:
        """Make `prev` current again, where it has a context: a thread that never used it (a fresh thread's
        device is 0) keeps this one, as torch's device guard does, since setting it would make a context on a
        GPU this process does not use. So a transfer thread sets its device once, on its first write. Every
        `enter` is paired with one `leave` (try/finally); only the outermost one restores."""
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        if prev != self.index and prev >= 0 and self._has_context(prev):
            self.check(self.rt.cudaSetDevice(prev), "cudaSetDevice")

    def _has_context(self, index: int) -> bool:
        if self.drv is None:
            return True
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if self.drv.cuDeviceGet(ctypes.byref(dev), index) != 0:
            return False
        if self.drv.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
            return False
        return bool(active.value)

    def after_current(self, stream: int) -> None:
        """Order work queued next on `stream` after everything queued so far on this thread's current stream
        (nothing to do where that is `stream` itself)."""
        current = self.current_stream(self.index)
        if current == stream:
            return
        self.check(self.rt.cudaEventRecord(self.event, _P(current)), "cudaEventRecord")
        self.check(self.rt.cudaStreamWaitEvent(_P(stream), self.event, 0), "cudaStreamWaitEvent")

    def upload(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of `nbytes` from pinned host memory at `src` to device memory at `dst` on `stream`."""
        upload_untracked(self.rt, dst, src, nbytes, stream, self.index)

    def synchronize(self, stream: int) -> None:
        """Wait until everything queued on `stream` has run (the GIL is released meanwhile: ctypes drops it)."""
        self.check(self.rt.cudaStreamSynchronize(_P(stream)), "cudaStreamSynchronize")
