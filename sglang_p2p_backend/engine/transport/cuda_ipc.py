"""Same-host one-sided transport: the decode's pools mapped into the prefill through CUDA IPC, one copy kernel a chunk.

Decode side, once at start: `export_regions` turns every KV and state region into (allocation handle, offset,
length); the export travels in the registration (`messages.IpcExport`). Prefill side, once per decode process:
`IpcMapping` opens each allocation (cudaIpcOpenMemHandle) and from then on translates destination addresses of
the decode's address space into this process, refusing any span that is not wholly inside a region the decode
exported. `CudaIpcTransport.write` then copies a chunk's descriptors with one launch (span_copy.py) on its own
stream and synchronises before it returns, so the Status the caller sends next can never overtake the data;
the decode does nothing per chunk. With `SGLANG_P2P_COPY_ENGINE` on (or auto, where engine/copy/ce_plan.py's
rule says so for the chunk) the same checked spans go to the GPU's copy engines instead of the SMs
(`IpcBackend.write_copy_engines`: one cudaMemcpyBatchAsync, engine/copy/copy_engine.py), synchronised the same way.

What the pool's memory must be: `cudaIpcGetMemHandle` works on memory from `cudaMalloc`, which is what PyTorch's
caching allocator hands out by default (SGLang's KV pools are plain torch tensors). Memory from the CUDA VMM API
is not exportable this way: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, `--enable-memory-saver`
(torch_memory_saver) and NCCL/symmetric-memory pools. The decode finds out at start (the export fails) and then
offers no `cudaipc`, so its prefills use NCCL; the log line says why.

How memory is shared is one small object (`IpcBackend`: find an address's allocation, make/open/close a
handle, reach a device, copy); `CudaBackend` is the real one. CPU tests install the shared-memory stand-in of
`tests/support/shm_ipc.py` with `use_backend`, so the exchange, checks, mapping and unmapping run through SGLang's
classes without a GPU.

Why ctypes over the CUDA runtime and driver by hand: torch exposes CUDA IPC only for whole storages it
allocated (the pools arrive as raw addresses from SGLang), and SGLang's `CudaRTLibrary` has neither
`cudaIpcCloseMemHandle` nor the allocation's base address (`cuMemGetAddressRange`), both needed here.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence, TypeVar

import numpy as np
import torch

from sglang_p2p_backend.engine.config import COPY_ENGINE_MODES
from sglang_p2p_backend.engine.copy.ce_plan import (ALONE, COPY_ENGINE, KERNEL, SHORT_SPANS, SPLIT, SplitRoute, coalesce,
                                                   page_chunk_shape, page_spans, pages_reaching, route_and_reason,
                                                   route_split, thresholds)
from sglang_p2p_backend.engine.copy.launches import DONE, EventLaunch, EventPool, Launch
from sglang_p2p_backend.engine.copy.plan import out_of_range_id, page_runs, run_breaks
from sglang_p2p_backend.engine.copy.stream_ops import cuda_libraries
from sglang_p2p_backend.engine.wire.messages import IpcExport, IpcRegion
from sglang_p2p_backend.engine.transport.base import OneSidedTransport, TransportError
from sglang_p2p_backend.engine.transport.route_tally import ROUTE_NAMES, RouteTally

if TYPE_CHECKING:
    from sglang_p2p_backend.engine.copy.span_copy import PageCopier, SpanCopier
    from sglang_p2p_backend.engine.copy.stream_ops import StreamOps

logger = logging.getLogger(__name__)
T = TypeVar("T")
_P = ctypes.c_void_p
#: what the log line of a route's first use starts with (e2e/shape_serve.py collects these lines)
ROUTE_LOG = "p2pnccl: same-host chunks on the"

NAME = "cudaipc"
_VMM_HINT = (": the KV pool is not cudaMalloc memory (PYTORCH_CUDA_ALLOC_CONF=expandable_segments, "
             "--enable-memory-saver and symmetric-memory pools cannot be shared through CUDA IPC)")
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class IpcUnavailable(TransportError):
    """CUDA IPC cannot serve this memory or this pair (the message says why and what to change)."""


class _Handle(ctypes.Structure):
    # raw bytes, not c_char (which ctypes reads and writes as a C string, cut at the first zero byte)
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]

    def raw(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), 64)

    @classmethod
    def of(cls, handle: bytes) -> "_Handle":
        if len(handle) != 64:
            raise IpcUnavailable(f"a CUDA IPC handle has 64 bytes, got {len(handle)}")
        h = cls()
        ctypes.memmove(ctypes.addressof(h), handle, 64)
        return h


def boot_id() -> str:
    """Names this kernel boot: two processes with the same value run on one host (containers included)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


#: the host steps of a page write the transport notes before its copy is `planned` (`IpcBackend.note`): the write
#: entered, its ids checked against both pools, its route chosen
WRITE_STEPS = ("entered", "checked", "routed")


class WriteMarks(NamedTuple):
    """A same-host write's host steps as the writing thread recorded them (`IpcBackend.last_write`): its copy
    planned (checked and routed, the runtime calls next) and queued on the device (perf_counter), and the thread's
    CPU time at the second. `steps`: (step, perf_counter, CPU time) of each step noted before `planned`
    (WRITE_STEPS, those the write passed), then `planned` itself."""

    planned: float
    launched: float
    launched_cpu: float
    steps: tuple[tuple[str, float, float], ...] = ()


class IpcBackend:
    """How one process shares memory with another on the same host (the CUDA one below; a CPU stand-in in tests)."""

    def usable(self, device: torch.device) -> bool:
        """Whether pools on `device` can be shared at all (decides whether the path starts)."""
        raise NotImplementedError

    def device_id(self, device: torch.device) -> str:
        raise NotImplementedError

    def reach(self, device: torch.device, device_id: str) -> Optional[str]:
        """Why memory on `device_id` cannot be written from `device` (None: it can)."""
        raise NotImplementedError

    def allocation(self, ptr: int) -> tuple[int, int]:
        raise NotImplementedError

    def get_handle(self, base: int) -> bytes:
        raise NotImplementedError

    def open_handle(self, handle: bytes, device: torch.device) -> int:
        raise NotImplementedError

    def close_handle(self, ptr: int, device: torch.device) -> None:
        raise NotImplementedError

    def write(self, device: torch.device, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        """Copy every span and return once the bytes are in place."""
        raise NotImplementedError

    def write_pages(self, device: torch.device, src_bases: np.ndarray, dst_bases: np.ndarray, item_bytes: np.ndarray,
                    src_ids: np.ndarray, dst_ids: np.ndarray, max_programs: Optional[int] = None) -> None:
        """Copy pages src_ids -> dst_ids of every region (bases checked by the caller) and return once they are
        in place. `max_programs`: the page kernel's grid bound (None: its default). Default: as spans (what the
        CUDA backend's page kernel does in one launch; a copy without a kernel has no grid to bound)."""
        from sglang_p2p_backend.engine.copy.span_copy import expand_pages

        self.write(device, *expand_pages(src_bases, dst_bases, item_bytes, src_ids, dst_ids))

    def copy_engines_batched(self) -> bool:
        """Whether one copy-engine call takes a whole chunk (`ce_plan.choose` then allows more spans a chunk)."""
        return True

    def write_copy_engines(self, device: torch.device, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        """Copy every span with the GPU's copy engines instead of SMs and return once the bytes are in place.
        Default: `write` (what a stand-in without copy engines does)."""
        self.write(device, src, dst, lens)

    def write_split(self, device: torch.device, pages: "PageWrite", spans: tuple[np.ndarray, np.ndarray, np.ndarray],
                    max_programs: Optional[int] = None) -> None:
        """`write_pages` of `pages` (the page kernel) and `write_copy_engines` of `spans` as one write, returning
        once both are in place (SGLANG_P2P_COPY_ENGINE=split). Default: one after the other."""
        self.write_pages(device, *pages, max_programs=max_programs)
        self.write_copy_engines(device, *spans)

    def last_write(self) -> Optional["WriteMarks"]:
        """This thread's last write's host steps (its copy planned, queued on the device before its wait); None
        where the backend does not record them (a stand-in)."""
        return None

    def note(self, step: str, first: bool = False) -> None:
        """This thread's write reached host step `step` (`first`: the write's first step, earlier notes are
        dropped); `last_write` gives them back in its `steps`. Default: nothing kept."""

    def launch(self, device: torch.device, write: Callable[[], T], timed: bool = False) -> Optional[tuple[T, Launch]]:
        """Run `write` (writes of this backend on this thread) with their waits left to the returned Launch,
        which any thread may wait on; `write`'s result beside it. None, nothing run, where this thread cannot
        launch now. `timed`: the Launch also gives the copies' device time (`gpu_ms`; SGLANG_P2P_ROOM_TIMES).
        Default: the writes run as they are (a stand-in that copies at once) and nothing is left."""
        return write(), DONE


class CudaBackend(IpcBackend):
    """The few CUDA runtime/driver calls this transport needs, on the libraries torch already loaded, and the
    fused copy kernel (span_copy.py) on a stream of this backend's own, synchronised per write."""

    def __init__(self) -> None:
        # a copier (pinned tile table) and a stream per transfer thread and device: workers serving different
        # decode peers copy at the same time without sharing a table
        self._local = threading.local()
        self._rt = self._drv = None
        self._engines = None  # CopyEngines over the same libcudart, made by the first copy-engine write
        self._engines_lock = threading.Lock()

    @property
    def rt(self) -> ctypes.CDLL:
        """libcudart, loaded on first use (CPU-only hosts construct this backend but never call CUDA)."""
        if self._rt is None:
            try:
                self._rt, self._drv = cuda_libraries()
            except OSError as e:
                raise IpcUnavailable(f"CUDA libraries not found: {e}") from e
        return self._rt

    @property
    def drv(self) -> ctypes.CDLL:
        self.rt  # noqa: B018 - loads both
        return self._drv

    def usable(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def device_id(self, device: torch.device) -> str:
        return str(torch.cuda.get_device_properties(device).uuid)

    def reach(self, device: torch.device, device_id: str) -> Optional[str]:
        if device.type != "cuda":
            return "this rank's KV pool is not on a CUDA device"
        for i in range(torch.cuda.device_count()):
            if self.device_id(torch.device("cuda", i)) == device_id:
                if i == (device.index or 0) or torch.cuda.can_device_access_peer(device.index or 0, i):
                    return None
                return f"GPU {device_id} has no peer access from cuda:{device.index}"
        return f"the decode's GPU {device_id} is not visible to this process (CUDA_VISIBLE_DEVICES)"

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise IpcUnavailable(f"{what} failed: {self.rt.cudaGetErrorString(code).decode()} (error {code})")

    def allocation(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation that holds `ptr`."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        code = self.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if code != 0:
            raise IpcUnavailable(f"cuMemGetAddressRange({ptr:#x}) failed (CUresult {code}){_VMM_HINT}")
        return base.value, size.value

    def get_handle(self, base: int) -> bytes:
        h = _Handle()
        self.check(self.rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base)), "cudaIpcGetMemHandle")
        return h.raw()

    def open_handle(self, handle: bytes, device: torch.device) -> int:
        h = _Handle.of(handle)
        ptr = ctypes.c_void_p()
        with torch.cuda.device(device):
            self.check(self.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS)),
                       "cudaIpcOpenMemHandle")
        return int(ptr.value or 0)

    def close_handle(self, ptr: int, device: torch.device) -> None:
        with torch.cuda.device(device):
            self.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))

    def _copiers(self, device: torch.device) -> "Copiers":
        """This thread's copiers, stream and runtime calls on `device`."""
        mine = self._local.__dict__.setdefault("copiers", {})
        if device not in mine:
            from sglang_p2p_backend.engine.copy.span_copy import PageCopier, SpanCopier  # Triton: imported by the first copy, not at start
            from sglang_p2p_backend.engine.copy.stream_ops import StreamOps

            ops = StreamOps(self.rt, device, drv=self.drv)
            # priority 0 is CUDA's lowest: the forward passes of this process go first where both are ready
            mine[device] = Copiers(SpanCopier(device), PageCopier(device, ops=ops),
                                   torch.cuda.Stream(device=device, priority=0), ops, EventPool(self.rt, ops.index),
                                   EventPool(self.rt, ops.index, limit=8, timing=True))
        return mine[device]

    def ordered(self, device: torch.device) -> "Copiers":
        """This thread's copiers on `device`, their stream ordered after the work queued so far on the current
        stream (SGLang's forward pass wrote the sources there)."""
        c = self._copiers(device)
        c.ops.after_current(c.stream.cuda_stream)
        return c

    def note(self, step: str, first: bool = False) -> None:
        # ~0.5 us a step (two clocks): kept on every write, so room times need no switch down here
        notes = self._local.__dict__.setdefault("notes", [])
        if first:
            notes.clear()
        notes.append((step, time.perf_counter(), time.thread_time()))

    def _write_ordered(self, device: torch.device, queue: Callable[["Copiers"], None]) -> None:
        """One write: this thread's copy stream ordered after the current one, the copy queued (`queue`), the
        wait for it (inside `launch`: the Launch's); `device` current throughout (a launch needs it)."""
        self.note("planned")
        notes, self._local.notes = self._local.notes, []
        c = self._copiers(device)
        prev = c.ops.enter()
        try:
            c.ops.after_current(c.stream.cuda_stream)
            start = getattr(self._local, "start", None)
            if start is not None:  # a timed launch's: after the wait for the sources, before its first copies
                c.ops.check(c.timed.rt.cudaEventRecord(start, _P(c.stream.cuda_stream)), "cudaEventRecord")
                self._local.start = None
            queue(c)
            # `last_write`: a write's host time and device time apart (SGLANG_P2P_ROOM_TIMES)
            self._local.marks = WriteMarks(notes[-1][1], time.perf_counter(), time.thread_time(), tuple(notes))
            if getattr(self._local, "launching", None) != device:
                c.ops.synchronize(c.stream.cuda_stream)
        finally:
            c.ops.leave(prev)

    def launch(self, device: torch.device, write: Callable[[], T], timed: bool = False) -> Optional[tuple[T, Launch]]:
        """`write` with its copies' wait left to one event recorded behind them on this thread's copy stream
        (`timed`: two timing events of their own pool, one recorded right before the copies). Refused (None)
        while this thread's last launch still runs: its page ids wait in this thread's pinned memory for their
        upload, which the next write would overwrite; and when this thread's events are all held by launches
        nobody waited for yet. A write that raises leaves nothing running (its queued copies are waited for
        here first)."""
        last = getattr(self._local, "launched", None)
        if last is not None and not last.done():
            return None
        c = self._copiers(device)
        pool = c.timed if timed else c.events
        prev = c.ops.enter()
        try:
            event = pool.take()
            start = pool.take() if timed and event is not None else None
            if event is None or (timed and start is None):
                if event is not None:
                    pool.give(event)
                return None
            self._local.launching, self._local.start = device, start
            try:
                result = write()
                c.ops.check(pool.rt.cudaEventRecord(event, _P(c.stream.cuda_stream)), "cudaEventRecord")
            except BaseException:
                for e in (event, start):
                    if e is not None:
                        pool.give(e)
                c.ops.synchronize(c.stream.cuda_stream)
                raise
            finally:
                self._local.launching = self._local.start = None
        finally:
            c.ops.leave(prev)
        self._local.launched = launched = EventLaunch(pool, event, start)
        return result, launched

    def last_write(self) -> Optional["WriteMarks"]:
        return getattr(self._local, "marks", None)

    def write(self, device: torch.device, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        self._write_ordered(device, lambda c: c.spans.copy(src, dst, lens, c.stream))

    def write_pages(self, device: torch.device, src_bases: np.ndarray, dst_bases: np.ndarray, item_bytes: np.ndarray,
                    src_ids: np.ndarray, dst_ids: np.ndarray, max_programs: Optional[int] = None) -> None:
        self._write_ordered(device, lambda c: c.pages.copy(src_bases, dst_bases, item_bytes, src_ids, dst_ids,
                                                           c.stream, max_programs))

    def copy_engines(self):
        """The copy-engine binding over this backend's libcudart (engine/copy/copy_engine.py), made once."""
        with self._engines_lock:
            if self._engines is None:
                from sglang_p2p_backend.engine.copy.copy_engine import CopyEngines

                self._engines = CopyEngines(self.rt)
            return self._engines

    def copy_engines_batched(self) -> bool:
        return self.copy_engines().batched

    def queue_copy_engines(self, c: "Copiers", src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        """Queue the spans on the copy engines behind `c`'s stream (its device current meanwhile)."""
        prev = c.ops.enter()
        try:
            self.copy_engines().copy(src, dst, lens, c.stream.cuda_stream)
        finally:
            c.ops.leave(prev)

    def _queue_engines_checked(self, c: "Copiers", src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        """`queue_copy_engines`, a refusal raised as TransportError once what was queued before it has settled."""
        from sglang_p2p_backend.engine.copy.copy_engine import CopyEngineError

        try:
            self.queue_copy_engines(c, src, dst, lens)
        except CopyEngineError as e:
            c.ops.synchronize(c.stream.cuda_stream)  # what was queued before the refused call lands or fails now
            raise TransportError(str(e)) from e

    def write_copy_engines(self, device: torch.device, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        self._write_ordered(device, lambda c: self._queue_engines_checked(c, src, dst, lens))

    def write_split(self, device: torch.device, pages: "PageWrite", spans: tuple[np.ndarray, np.ndarray, np.ndarray],
                    max_programs: Optional[int] = None) -> None:
        def queue(c: Copiers) -> None:
            # the kernel's short runs first: its launch is one call, and the engines' batch (a few us of host time
            # a span) is queued while it runs; one stream, one wait for both
            c.pages.copy(*pages, c.stream, max_programs)
            self._queue_engines_checked(c, *spans)

        self._write_ordered(device, queue)


class Copiers(NamedTuple):
    """One thread's same-host copy machinery on one device (CudaBackend._copiers)."""

    spans: "SpanCopier"
    pages: "PageCopier"
    #: the copies' own stream (lowest priority)
    stream: torch.cuda.Stream
    #: ordering, upload and wait by runtime calls on the stream's handle
    ops: "StreamOps"
    #: the events of this thread's launches (`CudaBackend.launch`)
    events: EventPool
    #: and of its timed launches (SGLANG_P2P_ROOM_TIMES), two a launch
    timed: EventPool


_backend: Optional[IpcBackend] = None
_backend_lock = threading.Lock()


def backend() -> IpcBackend:
    """The installed backend (CUDA unless a test installed another)."""
    global _backend
    b = _backend  # set once: the lock only for the first call (a write asks for it a few times)
    if b is not None:
        return b
    with _backend_lock:
        if _backend is None:
            _backend = CudaBackend()
        return _backend


def use_backend(b: Optional[IpcBackend]) -> None:
    """Install `b` (tests: the CPU stand-in); None goes back to CUDA."""
    global _backend
    with _backend_lock:
        _backend = b


def export_regions(regions: Sequence[tuple[int, int]], device: torch.device) -> IpcExport:
    """The IPC export of `regions` ((address, length), KV regions then state regions): one handle per allocation
    they live in. Raises IpcUnavailable when the memory is not exportable (see the module docstring)."""
    lib = backend()
    if not lib.usable(device):
        raise IpcUnavailable(f"the KV pool is on {device}, which this path cannot share")
    bases: dict[int, int] = {}
    handles: list[bytes] = []
    sizes: list[int] = []
    out: list[IpcRegion] = []
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for ptr, length in regions:
            base, size = lib.allocation(ptr)
            if ptr + length > base + size:
                raise IpcUnavailable(f"region {ptr:#x}+{length} spans several allocations{_VMM_HINT}")
            if base not in bases:
                try:
                    handles.append(lib.get_handle(base))
                except IpcUnavailable as e:
                    raise IpcUnavailable(f"{e}{_VMM_HINT}") from e
                bases[base] = len(handles) - 1
                sizes.append(size)
            out.append(IpcRegion(ptr=ptr, alloc=bases[base], offset=ptr - base, length=length))
    return IpcExport(device_uuid=lib.device_id(device), boot_id=boot_id(), pid=os.getpid(), handles=handles,
                     alloc_sizes=sizes, regions=out)


def _read_only(a: np.ndarray) -> np.ndarray:
    """`a`, no longer writable: a cached plan's arrays are shared by every chunk after it."""
    a.flags.writeable = False
    return a


def reachable(export: IpcExport, device: torch.device) -> Optional[str]:
    """Why this process cannot map `export` (None: it can try): another host, or a GPU it cannot see or reach."""
    if not export.boot_id or export.boot_id != boot_id():
        return "the decode runs on another host (boot ids differ)"
    if export.pid == os.getpid():
        return "the decode is this process (CUDA IPC needs two processes)"
    return backend().reach(device, export.device_uuid)


@dataclass(frozen=True)
class RegionTable:
    """Exported regions sorted by their decode address, with where each lives in this process: the bounds every
    destination span is checked against (pure: tests build one without CUDA)."""

    starts: np.ndarray  # decode addresses, sorted
    ends: np.ndarray  # decode address past each region's last byte
    delta: np.ndarray  # this process's address of a region's byte minus the decode's

    @classmethod
    def build(cls, regions: Sequence[IpcRegion], alloc_bases: Sequence[int]) -> "RegionTable":
        order = sorted(range(len(regions)), key=lambda i: regions[i].ptr)
        starts = np.array([regions[i].ptr for i in order], dtype=np.int64)
        lengths = np.array([regions[i].length for i in order], dtype=np.int64)
        mapped = np.array([alloc_bases[regions[i].alloc] + regions[i].offset for i in order], dtype=np.int64)
        return cls(starts, starts + lengths, mapped - starts)

    def translate(self, dst: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """This process's addresses of decode spans (dst[i], lens[i]); TransportError naming the first span that
        is not wholly inside one exported region (nothing is written then)."""
        dst = np.asarray(dst, dtype=np.int64)
        lens = np.asarray(lens, dtype=np.int64)
        if not dst.size:
            return dst
        if not self.starts.size:
            raise TransportError("the decode exported no regions; nothing was written")
        i = np.searchsorted(self.starts, dst, side="right") - 1
        j = np.maximum(i, 0)
        # dst >= starts[j] where i >= 0, so ends - dst cannot overflow (dst + lens could)
        ok = (i >= 0) & (lens >= 0) & (lens <= np.take(self.ends, j) - dst)
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            raise TransportError(f"write of {int(lens[k])} bytes at decode address {int(dst[k]):#x} is outside every "
                                 f"region the decode exported; nothing was written")
        return dst + np.take(self.delta, j)


def check_export(export: IpcExport, expected: Sequence[tuple[int, int]]) -> Optional[str]:
    """Why `export` does not describe the decode's registered regions (address, minimum length), if it does not."""
    if len(export.alloc_sizes) != len(export.handles):
        return f"the export has {len(export.handles)} handles but {len(export.alloc_sizes)} allocation sizes"
    if len(export.regions) != len(expected):
        return f"the export has {len(export.regions)} regions, the registration {len(expected)}"
    for r, (ptr, need) in zip(export.regions, expected):
        if r.ptr != ptr or r.length < need:
            return f"exported region {r.ptr:#x}+{r.length} does not cover registered {ptr:#x}+{need}"
        if r.alloc >= len(export.handles) or r.offset + r.length > export.alloc_sizes[r.alloc]:
            return f"exported region {r.ptr:#x} lies outside its allocation"
    return None


#: bytes the page kernel keeps in flight an SM where prefill and decode share a GPU, within these programs an SM.
#: The kernel alone against one device-to-device copy's GPU time (bench/transfer/page_kernel_sweep.py, 1 x H200,
#: 2026-12-02, session 43): 32 KiB in flight an SM copied as fast as 64 KiB or more, 2 KiB pages (MHA at page 1)
#: at 16 programs an SM (289-295 us for 4k tokens, 331-334 at 8), pages of 32 KiB and up at 4 (4k MLA 170-180 us,
#: 16k MHA page 16 1,175-1,179 us; at 8: 169-176 and 1,189-1,193; at 2: 188-199 and 1,324-1,340). And each program
#: kept resident is an SM's share a forward pass beside the copy cannot have: with 4 programs an SM instead of 8, a
#: bf16 matmul beside back-to-back 16k MHA writes slowed 59-63% instead of 146-153%, the writes as fast
#: (bench/transfer/ipc_bench.py --programs, two rounds). Over NVLink fewer still pay (span_copy.default_programs).
SAME_GPU_IN_FLIGHT_PER_SM = 32 << 10
SAME_GPU_PROGRAMS_PER_SM = (4, 16)


def same_gpu_programs_per_sm(item_bytes: Sequence[int]) -> int:
    """Programs an SM for a page copy into the prefill's own GPU: about SAME_GPU_IN_FLIGHT_PER_SM over the
    kernel's loop step (the largest page, rounded up to a power of two, at most 8 KiB), within
    SAME_GPU_PROGRAMS_PER_SM."""
    item = int(np.max(item_bytes)) if len(item_bytes) else 1  # one numpy call: this runs every chunk
    step = min(8 << 10, 1 << (max(1, item) - 1).bit_length())
    lo, hi = SAME_GPU_PROGRAMS_PER_SM
    return max(lo, min(hi, SAME_GPU_IN_FLIGHT_PER_SM // step))


class IpcMapping:
    """One decode process's exported allocations opened in this process; close() unmaps them."""

    def __init__(self, export: IpcExport, device: torch.device):
        self.export = export
        self.device = device
        self._bases: list[int] = []
        try:
            for h in export.handles:
                self._bases.append(backend().open_handle(h, device))
        except IpcUnavailable:
            self.close()
            raise
        self.table = RegionTable.build(export.regions, self._bases)
        #: the decode's pool is on this rank's own GPU (prefill and decode sharing it)
        self.same_gpu = export.device_uuid == backend().device_id(device)

    def close(self) -> None:
        for base in self._bases:
            backend().close_handle(base, self.device)
        self._bases = []


class PageWrite(NamedTuple):
    """A checked whole-page write: this rank's region bases, the decode's translated into this process, item
    bytes of every region, and the paired page ids (int64)."""

    src_bases: np.ndarray
    dst_bases: np.ndarray
    item_bytes: np.ndarray
    src_ids: np.ndarray
    dst_ids: np.ndarray


class PoolFacts(NamedTuple):
    """What a chunk's route and grid need of its pool's item sizes (`CudaIpcTransport._per_pool`)."""

    #: bytes a page of every region
    page_bytes: int
    #: the page kernel's programs an SM into this GPU (`same_gpu_programs_per_sm`)
    same_gpu_per_sm: int
    #: the smallest item, which sets the run length split needs (ce_plan.pages_reaching)
    least_item: int


class CudaIpcTransport(OneSidedTransport):
    """Decode: exports its regions (`register`, `export`). Prefill: maps peers (`open_peer`, `forget_peer`) and
    writes chunks (`write`). Each peer is used by the one transfer worker that owns it; the lock only guards
    the table of peers."""

    name = NAME

    def __init__(self, device: torch.device, copy_engine: str = COPY_ENGINE_MODES[0], programs: Optional[int] = None,
                 ce_min_span: Optional[int] = None, ce_max_spans: Optional[int] = None):
        self.device = device
        #: SGLANG_P2P_COPY_ENGINE: split (the default; per page run: ce_plan.split_runs), auto (per chunk:
        #: ce_plan.choose), off (the SM kernel), on (copy engines)
        self.copy_engine = copy_engine
        #: the copy engines' thresholds, split's and auto's (bytes, spans; SGLANG_P2P_CE_MIN_SPAN_KIB,
        #: SGLANG_P2P_CE_MAX_SPANS); None: ce_plan's
        self.ce_min_span, self.ce_max_spans = ce_min_span, ce_max_spans
        #: the route `auto` took first, logged once per route: which one a serving run used shows in its log
        self._routes_seen: set[str] = set()
        #: chunks and bytes each route took, a summary in the log at most every 30 s: what share went each way
        self._route_tally = RouteTally(ROUTE_LOG)
        #: this GPU's SM count, for the same-GPU grid (read on first use: CPU-only hosts never ask)
        self._sms: Optional[int] = None
        #: SGLANG_P2P_IPC_PROGRAMS: the page kernel's grid bound, the SMs a write may take from the forward
        #: pass beside it (None: span_copy.default_programs, about 8 KiB in flight an SM)
        self.programs = programs
        self.export: Optional[IpcExport] = None
        self.unavailable: Optional[str] = None
        self._peers: dict[str, IpcMapping] = {}
        #: per peer, its pools as the last chunk named them, checked and translated (`_pool`): the regions are the
        #: same for every chunk of a registration, so only the page ids are checked per chunk
        self._pools: dict[str, tuple[IpcMapping, tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        #: the last read-only item-size array `_per_pool` saw, with what it derived from it
        self._pool_items: Optional[tuple[np.ndarray, PoolFacts]] = None
        #: split's thresholds (most spans, least span) by what they depend on (`_split_thresholds`)
        self._split_limits: dict[tuple, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        try:
            self.export = export_regions(regions, self.device)
        except IpcUnavailable as e:
            self.export, self.unavailable = None, str(e)
            logger.warning("p2pnccl: same-host CUDA IPC path off for this rank, prefills use NCCL: %s", e)

    def export_changed(self, regions: Sequence[tuple[int, int]]) -> Optional[str]:
        """Why the export sent to prefills no longer names `regions`' memory (None: it still does). After SGLang
        paused and resumed the pools: a prefill's mapping holds the allocation it opened, so had the pause freed
        it, every write would land in the old memory while the pools read the new."""
        if self.export is None:
            return None
        try:
            now = export_regions(regions, self.device)
        except IpcUnavailable as e:
            return f"the pools cannot be exported any more ({e})"
        old = self.export
        if now.handles != old.handles or now.alloc_sizes != old.alloc_sizes or now.regions != old.regions:
            return "the pools live in other allocations than the ones exported at start"
        return None

    def session_id(self) -> str:
        return ""

    def open_peer(self, session: str, export: IpcExport) -> None:
        """Map the decode process behind `session` (again: a restarted process replaces the old mapping)."""
        self.forget_peer(session)
        mapping = IpcMapping(export, self.device)
        with self._lock:
            self._peers[session] = mapping

    def mapped(self, session: str, export: IpcExport) -> bool:
        with self._lock:
            m = self._peers.get(session)
        return m is not None and m.export is export

    def mapped_peers(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    def forget_peer(self, session: str) -> None:
        """Unmap a peer's memory; the caller guarantees no copy of it is in flight (writes are synchronous)."""
        with self._lock:
            m = self._peers.pop(session, None)
            self._pools.pop(session, None)
        if m is not None:
            m.close()

    def write(self, session: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> int:
        """Copy the spans into peer `session`'s memory (dst: its addresses) and wait; returns the bytes copied."""
        with self._lock:
            m = self._peers.get(session)
        if m is None:
            raise TransportError(f"decode rank {session} is not mapped through CUDA IPC")
        lens = np.asarray(lengths, dtype=np.int64)
        mapped = m.table.translate(np.asarray(dst, dtype=np.int64), lens)
        src = np.asarray(src, dtype=np.int64)
        if self.copy_engine != "off":
            spans = coalesce(src, mapped, lens)
            if self._copy_engines_take(spans[2].size, int(lens.sum()), m.same_gpu):
                backend().write_copy_engines(self.device, *spans)
                return int(lens.sum())
        backend().write(self.device, src, mapped, lens)
        return int(lens.sum())

    def _copy_engines_take(self, spans: int, nbytes: int, same_gpu: bool) -> bool:
        """The per-chunk rule (engine/copy/ce_plan.py) for a chunk of `spans` spans and `nbytes` bytes, the
        chunk counted on the route it takes."""
        route, reason = self._rule(spans, nbytes, same_gpu)
        self._count(route, spans, nbytes, reason)
        return route == COPY_ENGINE

    def _rule(self, spans: int, nbytes: int, same_gpu: bool) -> tuple[str, str]:
        return route_and_reason(self.copy_engine, spans, nbytes, backend().copy_engines_batched(),
                                self.ce_min_span, self.ce_max_spans, same_gpu)

    def _count(self, route: str, spans: int, nbytes: int, reason: str = "") -> None:
        """A chunk on `route` (`reason`: why the rule sent it there): its first use logged, the tally added to (and
        its summary logged when due)."""
        if route not in self._routes_seen:
            self._routes_seen.add(route)
            logger.info("%s %s from now on where SGLANG_P2P_COPY_ENGINE=%s picks it (first: %d spans, %d bytes)",
                        ROUTE_LOG, ROUTE_NAMES.get(route, route), self.copy_engine, spans, nbytes)
        line = self._route_tally.add(route, nbytes, reason)
        if line is not None:
            logger.info("%s", line)

    def route_counts(self) -> dict[str, dict]:
        """The chunks and bytes each copy route took so far, and why (route_tally.RouteTally.counts)."""
        return self._route_tally.counts()

    def write_pages(self, session: str, src_bases: Sequence[int], dst_bases: Sequence[int], item_bytes: Sequence[int],
                    src_ids: np.ndarray, dst_ids: np.ndarray, src_pages: int, dst_pages: int,
                    alone: bool = False) -> int:
        """Copy pages src_ids of this rank's regions into pages dst_ids of peer `session`'s (dst_bases: its
        addresses, each region `dst_pages` items long) with one launch, and wait; returns the bytes copied.
        Checked before anything moves (TransportError, nothing written): the id arrays pair up, every id is
        inside its pool, and every destination region lies wholly inside a region the decode exported.
        `alone`: nothing runs on this GPU's SMs beside this copy (`copy_pages`)."""
        backend().note("entered", first=True)
        plan = self.plan_pages(session, src_bases, dst_bases, item_bytes, src_ids, dst_ids, src_pages, dst_pages)
        if plan is None:
            return 0
        backend().note("checked")
        same_gpu = self._same_gpu(session)
        return self.copy_pages(plan, self._grid(same_gpu, plan.item_bytes), same_gpu, alone)

    def _same_gpu(self, session: str) -> bool:
        """Whether peer `session`'s pools are on this rank's GPU (False for a peer not mapped)."""
        with self._lock:
            m = self._peers.get(session)
        return m is not None and m.same_gpu

    def _grid(self, same_gpu: bool, item_bytes: Sequence[int] = ()) -> Optional[int]:
        """The page kernel's grid bound for writes of pages of `item_bytes` to a decode, on this GPU when
        `same_gpu` (`_same_gpu`): SGLANG_P2P_IPC_PROGRAMS, else, where the decode shares this GPU,
        `same_gpu_programs_per_sm` programs an SM (a copy within HBM needs more bytes in flight than one over
        NVLink), else the kernel's default (None)."""
        if self.programs:
            return self.programs
        if same_gpu and self.device.type == "cuda":
            if self._sms is None:  # asked once, not every chunk
                self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            return self._per_pool(item_bytes).same_gpu_per_sm * self._sms
        return None

    def _per_pool(self, item_bytes: Sequence[int]) -> "PoolFacts":
        """What the route and the grid need of a pool's item sizes: kept for the last read-only array (`_pool`'s,
        the same object for every chunk of a peer), else computed (3 us a chunk on the dev VM for the numpy
        reductions)."""
        last = self._pool_items
        if last is not None and item_bytes is last[0]:
            return last[1]
        items = np.asarray(item_bytes, dtype=np.int64)
        derived = PoolFacts(int(items.sum()), same_gpu_programs_per_sm(items), int(items.min()) if items.size else 0)
        if isinstance(item_bytes, np.ndarray) and not item_bytes.flags.writeable and item_bytes.base is None:
            self._pool_items = (item_bytes, derived)
        return derived

    def plan_pages(self, session: str, src_bases: Sequence[int], dst_bases: Sequence[int], item_bytes: Sequence[int],
                   src_ids: np.ndarray, dst_ids: np.ndarray, src_pages: int, dst_pages: int) -> Optional["PageWrite"]:
        """The host half of `write_pages`: every check, and the destination regions translated into this
        process; None when there is nothing to copy. Nothing is copied (the benchmark times it alone)."""
        with self._lock:
            m = self._peers.get(session)
        if m is None:
            raise TransportError(f"decode rank {session} is not mapped through CUDA IPC")
        src_ids = np.asarray(src_ids, dtype=np.int64).reshape(-1)
        dst_ids = np.asarray(dst_ids, dtype=np.int64).reshape(-1)
        regions = len(item_bytes)
        if src_ids.size != dst_ids.size:
            raise TransportError(f"{src_ids.size} source pages but {dst_ids.size} destination pages; nothing was written")
        if not (len(src_bases) == len(dst_bases) == regions):
            raise TransportError(f"{len(src_bases)} source regions, {len(dst_bases)} destination regions and "
                                 f"{regions} item sizes do not pair up; nothing was written")
        if not src_ids.size or not regions:
            return None
        for name, ids, bound in (("destination", dst_ids, dst_pages), ("source", src_ids, src_pages)):
            bad = out_of_range_id(ids, bound)
            if bad is not None:
                raise TransportError(f"{name} page {bad} is outside the pool's {bound} pages; nothing was written")
        src, mapped, items = self._pool(session, m, src_bases, dst_bases, item_bytes, dst_pages)
        return PageWrite(src, mapped, items, src_ids, dst_ids)

    def _pool(self, session: str, m: IpcMapping, src_bases: Sequence[int], dst_bases: Sequence[int],
              item_bytes: Sequence[int], dst_pages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source bases, destination bases in this process, item bytes) of peer `session`'s chunk, read-only:
        translated once per registration and pool, not per chunk (the same values give the same result; a
        remapped peer has a new mapping, and its first chunk translates again). The item sizes become an array
        only then: a chunk of the same pool compares the caller's sequences and converts nothing."""
        # the caller's sequences as they are (an int and a numpy int of one value compare equal)
        key = (tuple(src_bases), tuple(dst_bases), tuple(item_bytes), int(dst_pages))
        hit = self._pools.get(session)
        if hit is not None and hit[0] is m and hit[1] == key:
            return hit[2]
        items = np.asarray(item_bytes, dtype=np.int64)
        # one span per destination region, the whole pool: inside the export, or nothing moves
        mapped = m.table.translate(np.asarray(dst_bases, dtype=np.int64), items * int(dst_pages))
        pool = tuple(_read_only(a) for a in (np.array(src_bases, dtype=np.int64), mapped, np.array(items)))
        with self._lock:
            if self._peers.get(session) is m:  # not forgotten meanwhile
                self._pools[session] = (m, key, pool)
        return pool

    def copy_pages(self, plan: "PageWrite", grid: Optional[int] = None, same_gpu: bool = False,
                   alone: bool = False) -> int:
        """The device half of `write_pages`: copy a checked plan (the kernel, its grid bounded by `grid`, else by
        SGLANG_P2P_IPC_PROGRAMS; or the copy engines where SGLANG_P2P_COPY_ENGINE says so for this chunk, into a
        decode on this GPU when `same_gpu`) and wait; returns the bytes copied. `alone` (the caller knows no
        forward pass of this rank runs beside this copy): into another GPU, `split` and `auto` give the chunk whole
        to the kernel, which is queued in ~0.1 ms of host time where the copy engines took 0.5-0.7 ms for a 4k
        request's 64 spans in service (docs/serving.md, session 38); the SMs it takes, nobody else wanted then. A
        decode on this GPU may be running its own steps on them, so there the rule stands."""
        nbytes = int(plan.src_ids.size) * self._per_pool(plan.item_bytes).page_bytes
        if alone and not same_gpu and self.copy_engine in (SPLIT, "auto"):
            # the chunk's spans are counted only for the kernel's first log line
            spans = (page_chunk_shape(plan.src_ids, plan.dst_ids, plan.item_bytes)[0] if KERNEL not in self._routes_seen
                     else int(plan.item_bytes.size))
            backend().note("routed")
            self._count(KERNEL, spans, nbytes, ALONE)
            backend().write_pages(self.device, *plan, max_programs=grid or self.programs)
            return nbytes
        if self.copy_engine == SPLIT:
            self._copy_split(plan, nbytes, grid or self.programs, same_gpu)
            return nbytes
        breaks = self._copy_engine_runs(plan, nbytes, same_gpu)
        backend().note("routed")
        if breaks is not None:
            backend().write_copy_engines(self.device, *page_spans(*plan, runs=page_runs(plan.src_ids, plan.dst_ids,
                                                                                          breaks)))
        else:
            backend().write_pages(self.device, *plan, max_programs=grid or self.programs)
        return nbytes

    def split_route(self, plan: "PageWrite", same_gpu: bool = False) -> SplitRoute:
        """`split`'s plan for a checked chunk (ce_plan.route_split) under this transport's thresholds; the kernel's
        first use looks for the chunk's breaks, for its log line's exact spans. Planning only: nothing counted or
        copied (the transfer benchmark times it as the step before the copy)."""
        limit, min_span = self._split_thresholds(same_gpu)
        return route_split(plan.src_ids, plan.dst_ids, plan.item_bytes, min_span, limit,
                           exact=KERNEL not in self._routes_seen,
                           need=pages_reaching(self._per_pool(plan.item_bytes).least_item, min_span))

    def _split_thresholds(self, same_gpu: bool) -> tuple[int, int]:
        """ce_plan.thresholds for `split_route`, kept by what they depend on (the backend's batch call, the
        destination, the two knobs): on 1 x H200 the route's step took 6.5-11 us of every write against the
        kernel's 2-3.6, most of it asking the backend and reducing the item sizes again for each chunk."""
        b = backend()
        key = (b, same_gpu, self.ce_min_span, self.ce_max_spans)
        got = self._split_limits.get(key)
        if got is None:
            got = self._split_limits[key] = thresholds(b.copy_engines_batched(), same_gpu, self.ce_min_span,
                                                       self.ce_max_spans)
        return got

    def _copy_split(self, plan: "PageWrite", nbytes: int, grid: Optional[int], same_gpu: bool) -> None:
        """SGLANG_P2P_COPY_ENGINE=split: the chunk's long page runs to the copy engines, its short ones to the
        kernel (`split_route`), as one write; each part counted on its route."""
        route = self.split_route(plan, same_gpu)
        backend().note("routed")
        if not route.engines_take_any:
            self._count(KERNEL, route.kernel_spans, nbytes, SHORT_SPANS)
            backend().write_pages(self.device, *plan, max_programs=grid)
            return
        page_bytes, cut = nbytes // int(plan.src_ids.size), route.cut
        chosen = route.runs[cut.picked]  # the engines' spans straight from their runs: no second search of the ids
        spans = page_spans(*plan, runs=chosen)
        self._count(COPY_ENGINE, int(spans[2].size), int(chosen[:, 2].sum()) * page_bytes)
        if not cut.kernel_runs:
            backend().write_copy_engines(self.device, *spans)
            return
        rest = plan._replace(src_ids=plan.src_ids[~cut.engines], dst_ids=plan.dst_ids[~cut.engines])
        self._count(KERNEL, cut.kernel_runs * int(plan.item_bytes.size), int(rest.src_ids.size) * page_bytes,
                    SHORT_SPANS)
        backend().write_split(self.device, rest, spans, max_programs=grid)

    def _copy_engine_runs(self, plan: "PageWrite", nbytes: int, same_gpu: bool) -> Optional[np.ndarray]:
        """The page runs' breaks (plan.run_breaks) where the rule sends this whole-page chunk to the copy engines,
        else None (the chunk counted on its route either way). A chunk has at least one span a region and the
        rule refuses more spans and shorter ones, so where that many already leave a chunk on the kernel (every
        128-token request; into the prefill's own GPU, anything under 16 MiB a region) its runs are not looked
        for: on 2 x H200 the step between the checks and the copy (this rule and the grid) took 16 us of a
        128-token MLA write. The kernel's first use is still logged with the chunk's exact spans."""
        if self.copy_engine == "off":
            return None
        regions = int(plan.item_bytes.size)
        if KERNEL in self._routes_seen:
            route, reason = self._rule(regions, nbytes, same_gpu)
            if route == KERNEL:  # at one span a region already too short or too many: so with more
                self._count(KERNEL, regions, nbytes, reason)
                return None
        breaks = run_breaks(plan.src_ids, plan.dst_ids)
        take = self._copy_engines_take(*page_chunk_shape(plan.src_ids, plan.dst_ids, plan.item_bytes, breaks),
                                       same_gpu)
        return breaks if take else None

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            self._pools.clear()
        for m in peers:
            m.close()
