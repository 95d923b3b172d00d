"""Spans copied by the GPU's copy engines: one `cudaMemcpyBatchAsync` a chunk, or `cudaMemcpyAsync` per span.

`CopyEngines(lib)` wraps a loaded CUDA runtime (libcudart, the one torch loaded) and queues a chunk's
(src, dst, length) spans on a stream: with CUDA 12.8 or later as one `cudaMemcpyBatchAsync` (the host hands
the three arrays over as they are, no call per span; two calls past HEAD_SPANS spans), otherwise one `cudaMemcpyAsync(..., cudaMemcpyDefault)`
per span (unified addressing tells the direction, peer copies included). The caller synchronises the stream.

The batch call's signature changed between releases, so the ABI follows the runtime actually loaded
(`cudaRuntimeGetVersion`):
- CUDA 12.8 / 12.9: `cudaMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes, size_t count,
  cudaMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, cudaStream_t stream)`;
- CUDA 13: `cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes, size_t count,
  cudaMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, cudaStream_t stream)` (no `failIdx`).
`cudaMemcpyAttributes` is `{cudaMemcpySrcAccessOrder srcAccessOrder; cudaMemLocation srcLocHint, dstLocHint;
unsigned flags}` with `cudaMemLocation = {cudaMemLocationType type; int id}` in both. One attribute entry covers
the whole batch: sources read in stream order (the forward pass that wrote them was queued before), no location
hints (they apply to managed memory only), and `cudaMemcpyFlagPreferOverlapWithCompute`.

Why by hand: torch has no batched copy; cuda-python (cuda-bindings) is not a dependency of SGLang or of this
plugin, and its module layout and these very signatures moved between 12.x and 13; the project already binds
libcudart through ctypes for its IPC calls (transport/cuda_ipc.py), and two functions do here. Tests drive
this class with a stand-in runtime on CPU (`tests/engine/test_copy_engine_binding.py`) and with the real one on
a GPU (`tests/gpu/test_copy_engine.py`).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Optional

import numpy as np

logger = logging.getLogger(__name__)

#: cudaMemcpySrcAccessOrderStream
SRC_ACCESS_ORDER_STREAM = 1
#: cudaMemcpyFlagPreferOverlapWithCompute: a hint to keep the copy off the compute path
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
#: cudaMemcpyDefault: the direction from unified virtual addressing
MEMCPY_DEFAULT = 4
#: a batch of more spans goes as two calls, its first HEAD_SPANS spans first: the engines start on them while
#: the host hands over the rest (the call costs ~4 us of host time a span). Across NVLink (2 x H200,
#: bench/results/ce_lanes_nvidia-h200-x2_2026-11-29_peer-graphed.log, call to synchronise) a 61-span MLA
#: request went from 0.70 to 0.86 of one copy at 1k tokens and from 0.91 to 0.96 at 4k, a 64-span MHA one
#: from 0.83 to 0.92 at 1k and from 0.92 to 0.97 at 4k; into the prefill's own GPU it changed nothing
HEAD_SPANS = 16
#: runtimes from which cudaMemcpyBatchAsync exists, and from which it lost `failIdx`
BATCH_SINCE = 12080
NO_FAIL_IDX_SINCE = 13000


class CopyEngineError(RuntimeError):
    """A copy-engine call failed (the message names the call and CUDA's error)."""


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", ctypes.c_uint)]


def batch_abi(runtime_version: int) -> Optional[str]:
    """Which cudaMemcpyBatchAsync a runtime of `runtime_version` (e.g. 12080, 13000) has: "12.8" (with failIdx),
    "13" (without), or None (no batch call)."""
    if runtime_version < BATCH_SINCE:
        return None
    return "12.8" if runtime_version < NO_FAIL_IDX_SINCE else "13"


def batch_attributes() -> MemcpyAttributes:
    """The one attribute entry every batch passes (see the module docstring)."""
    a = MemcpyAttributes()
    a.srcAccessOrder = SRC_ACCESS_ORDER_STREAM
    a.flags = FLAG_PREFER_OVERLAP_WITH_COMPUTE
    return a


_P = ctypes.c_void_p
_SZ = ctypes.c_size_t
_PTRS = ctypes.POINTER(ctypes.c_void_p)
_SIZES = ctypes.POINTER(ctypes.c_size_t)


class CopyEngines:
    """Queues span copies on a stream through `lib` (a ctypes CDLL of libcudart, or a stand-in with the same
    functions). `batched` says whether one call takes a whole chunk."""

    def __init__(self, lib: Any):
        self.lib = lib
        version = ctypes.c_int(0)
        code = lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.runtime_version = int(version.value) if code == 0 else 0
        self.abi = batch_abi(self.runtime_version) if hasattr(lib, "cudaMemcpyBatchAsync") else None
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [_P, _P, _SZ, ctypes.c_int, _P]
        if self.abi is not None:
            fn = lib.cudaMemcpyBatchAsync
            fn.restype = ctypes.c_int
            head = [_PTRS, _PTRS, _SIZES, _SZ, ctypes.POINTER(MemcpyAttributes), _SIZES, _SZ]
            fn.argtypes = head + ([_SIZES, _P] if self.abi == "12.8" else [_P])
        self._attrs = batch_attributes()
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self.batch_failed: Optional[str] = None  # set once a batch call failed: later chunks go span by span

    @property
    def batched(self) -> bool:
        return self.abi is not None and self.batch_failed is None

    def _error(self, code: int) -> str:
        try:
            fn = self.lib.cudaGetErrorString
            fn.restype = ctypes.c_char_p
            return f"{fn(code).decode()} (error {code})"
        except Exception:  # noqa: BLE001 - a stand-in runtime may lack it; the code is what matters
            return f"error {code}"

    def copy(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, stream: int) -> int:
        """Queue the copy of every span on the CUDA stream handle `stream` (not the legacy default stream);
        returns the bytes queued. CopyEngineError when the runtime refuses a call (nothing is known to be
        written then; the caller fails the chunk)."""
        src = np.ascontiguousarray(src, dtype=np.uint64).reshape(-1)
        dst = np.ascontiguousarray(dst, dtype=np.uint64).reshape(-1)
        sizes = np.ascontiguousarray(lens, dtype=np.uint64).reshape(-1)
        if not (src.size == dst.size == sizes.size):
            raise ValueError(f"{src.size} sources, {dst.size} destinations and {sizes.size} lengths do not pair up")
        if not sizes.size:
            return 0
        if self.batched:
            code = self._batch_in_two(src, dst, sizes, stream)
            if code == 0:
                return int(sizes.sum())
            # a refused batch is redone span by span: the same bytes to the same places, so copies the batch may
            # have queued before it failed do no harm. Only where those go through is the batch call itself the
            # problem (a driver that does not take it), and later chunks skip it; spans the runtime refuses one by
            # one too (a span reaching across allocations) fail this chunk and leave the batch to the next
            moved = self._each(src, dst, sizes, stream)
            self.batch_failed = f"cudaMemcpyBatchAsync failed: {self._error(code)}"
            logger.warning("p2pnccl: %s; the copy engines take one cudaMemcpyAsync per span from now on",
                           self.batch_failed)
            return moved
        return self._each(src, dst, sizes, stream)

    def _batch_in_two(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: int) -> int:
        """The batch as one call, or as two (HEAD_SPANS, then the rest) where it has more spans; the first
        refusal's code, 0 when both were queued."""
        if sizes.size <= HEAD_SPANS:
            return self._batch(src, dst, sizes, stream)
        k = HEAD_SPANS
        return self._batch(src[:k], dst[:k], sizes[:k], stream) or self._batch(src[k:], dst[k:], sizes[k:], stream)

    def _batch(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: int) -> int:
        args = [dst.ctypes.data_as(_PTRS), src.ctypes.data_as(_PTRS), sizes.ctypes.data_as(_SIZES), sizes.size,
                ctypes.byref(self._attrs), self._attr_idx, 1]
        if self.abi == "12.8":
            fail_idx = ctypes.c_size_t(0)
            args.append(ctypes.byref(fail_idx))
        args.append(_P(stream))
        return int(self.lib.cudaMemcpyBatchAsync(*args))

    def _each(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: int) -> int:
        fn, s = self.lib.cudaMemcpyAsync, _P(stream)
        for d, a, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):
            code = fn(_P(d), _P(a), n, MEMCPY_DEFAULT, s)
            if code != 0:
                raise CopyEngineError(f"cudaMemcpyAsync of {n} bytes to {d:#x} failed: {self._error(code)}")
        return int(sizes.sum())
