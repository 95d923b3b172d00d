"""The copy-engine binding (engine/copy/copy_engine.py) against a stand-in CUDA runtime on CPU: which
cudaMemcpyBatchAsync signature each runtime version gets, the exact arguments the batch call receives (pointer
arrays, sizes, the one attribute entry, failIdx only before CUDA 13, the stream), the span-by-span fallback,
and bytes landing in host memory through both."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from sglang_p2p_backend.engine.copy.copy_engine import (CopyEngineError, CopyEngines, MemcpyAttributes, batch_abi,
                                                        batch_attributes)

STREAM = 0xABC0


class FakeRuntime:
    """cudaRuntimeGetVersion, cudaMemcpyAsync and (from 12.8) cudaMemcpyBatchAsync over host memory: each call
    is recorded as decoded values, and the copies are done with memmove."""

    def __init__(self, version: int, batch_code: int = 0, async_code: int = 0):
        self.version, self.batch_code, self.async_code = version, batch_code, async_code
        self.calls: list[tuple] = []
        # plain functions, as a CDLL's are attribute holders: the binding sets argtypes / restype on them
        self.cudaMemcpyAsync = lambda *a: self._async(*a)
        self.cudaGetErrorString = lambda code: self._error_string(code)
        if version >= 12080:
            self.cudaMemcpyBatchAsync = lambda *a: self._batch(*a)

    def cudaRuntimeGetVersion(self, out) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = self.version
        return 0

    def _async(self, dst, src, n, kind, stream) -> int:
        self.calls.append(("async", dst.value, src.value, n, kind, stream.value))
        if self.async_code:
            return self.async_code
        ctypes.memmove(dst.value, src.value, n)
        return 0

    def _batch(self, *args) -> int:
        dsts, srcs, sizes, count, attrs, idxs, num = args[:7]
        rest = args[7:]
        n = int(count)
        as_u64 = lambda p: [ctypes.cast(p, ctypes.POINTER(ctypes.c_uint64))[i] for i in range(n)]  # noqa: E731
        attr = ctypes.cast(attrs, ctypes.POINTER(MemcpyAttributes))[0]
        record = ("batch", as_u64(dsts), as_u64(srcs), as_u64(sizes), n,
                  (attr.srcAccessOrder, attr.srcLocHint.type, attr.srcLocHint.id, attr.dstLocHint.type,
                   attr.dstLocHint.id, attr.flags), list(idxs[:num]), num, len(rest), rest[-1].value)
        self.calls.append(record)
        if self.batch_code:
            return self.batch_code
        for d, s, k in zip(record[1], record[2], record[3]):
            ctypes.memmove(d, s, k)
        return 0

    @staticmethod
    def _error_string(code):
        return b"invalid argument"


def test_batch_abi_by_runtime_version():
    assert [batch_abi(v) for v in (12060, 12079, 12080, 12090, 12099, 13000, 13010)] == [
        None, None, "12.8", "12.8", "12.8", "13", "13"]


def test_attribute_entry_layout_and_values():
    assert ctypes.sizeof(MemcpyAttributes) == 24  # int + 2 x {int, int} + unsigned, as driver_types.h lays it out
    a = batch_attributes()
    assert (a.srcAccessOrder, a.srcLocHint.type, a.srcLocHint.id, a.dstLocHint.type, a.dstLocHint.id, a.flags) == (
        1, 0, 0, 0, 0, 1)


def _buffers():
    src = (ctypes.c_uint8 * 256)(*range(256))
    dst = (ctypes.c_uint8 * 256)()
    return src, dst, ctypes.addressof(src), ctypes.addressof(dst)


@pytest.mark.parametrize("version, trailing", [(12080, 2), (12090, 2), (13000, 1), (13020, 1)])
def test_one_batch_call_with_the_versions_signature(version, trailing):
    rt = FakeRuntime(version)
    ce = CopyEngines(rt)
    assert ce.batched and ce.abi == batch_abi(version)
    src, dst, a, b = _buffers()
    moved = ce.copy(np.array([a, a + 100]), np.array([b + 8, b + 200]), np.array([16, 40]), STREAM)
    assert moved == 56
    assert rt.calls == [("batch", [b + 8, b + 200], [a, a + 100], [16, 40], 2, (1, 0, 0, 0, 0, 1), [0], 1,
                         trailing, STREAM)]
    assert bytes(dst[8:24]) == bytes(range(16)) and bytes(dst[200:240]) == bytes(range(100, 140))
    assert bytes(dst[:8]) == bytes(8) and bytes(dst[24:200]) == bytes(176)
    assert rt.cudaMemcpyBatchAsync.argtypes[-1] is ctypes.c_void_p and len(rt.cudaMemcpyBatchAsync.argtypes) == 7 + trailing


def test_without_the_batch_call_every_span_is_one_async_copy():
    rt = FakeRuntime(12060)
    ce = CopyEngines(rt)
    assert not ce.batched and ce.abi is None
    src, dst, a, b = _buffers()
    assert ce.copy(np.array([a + 1, a + 50]), np.array([b, b + 128]), np.array([7, 9]), STREAM) == 16
    assert rt.calls == [("async", b, a + 1, 7, 4, STREAM), ("async", b + 128, a + 50, 9, 4, STREAM)]
    assert bytes(dst[0:7]) == bytes(range(1, 8)) and bytes(dst[128:137]) == bytes(range(50, 59))


def test_a_refused_batch_is_redone_span_by_span_and_not_tried_again():
    rt = FakeRuntime(13000, batch_code=1)
    ce = CopyEngines(rt)
    src, dst, a, b = _buffers()
    assert ce.copy(np.array([a]), np.array([b]), np.array([32]), STREAM) == 32
    assert [c[0] for c in rt.calls] == ["batch", "async"]
    assert bytes(dst[:32]) == bytes(range(32))
    assert not ce.batched and "invalid argument (error 1)" in ce.batch_failed
    ce.copy(np.array([a]), np.array([b]), np.array([8]), STREAM)
    assert [c[0] for c in rt.calls] == ["batch", "async", "async"]


def test_spans_refused_by_the_batch_and_one_by_one_fail_the_chunk_but_keep_the_batch_for_the_next():
    rt = FakeRuntime(13000, batch_code=1, async_code=1)
    ce = CopyEngines(rt)
    with pytest.raises(CopyEngineError, match="cudaMemcpyAsync of 8 bytes"):
        ce.copy(np.array([0x10]), np.array([0x40]), np.array([8]), STREAM)
    assert ce.batched and ce.batch_failed is None  # the spans were the problem, not the batch call
    rt.batch_code = rt.async_code = 0
    src, dst, a, b = _buffers()
    assert ce.copy(np.array([a]), np.array([b]), np.array([16]), STREAM) == 16
    assert [c[0] for c in rt.calls] == ["batch", "async", "batch"] and bytes(dst[:16]) == bytes(range(16))


def test_a_batch_of_more_than_head_spans_goes_as_two_calls_its_head_first():
    from sglang_p2p_backend.engine.copy.copy_engine import HEAD_SPANS

    rt = FakeRuntime(13000)
    ce = CopyEngines(rt)
    src, dst, a, b = _buffers()
    n = HEAD_SPANS + 3
    s, d = np.arange(n) * 4 + a, np.arange(n) * 8 + b
    assert ce.copy(s, d, np.full(n, 4), STREAM) == 4 * n
    assert [(c[0], c[4]) for c in rt.calls] == [("batch", HEAD_SPANS), ("batch", 3)]
    assert rt.calls[0][2] == s[:HEAD_SPANS].tolist() and rt.calls[1][2] == s[HEAD_SPANS:].tolist()
    assert rt.calls[1][1] == d[HEAD_SPANS:].tolist()
    for i in range(n):
        assert bytes(dst[8 * i: 8 * i + 4]) == bytes(range(4 * i, 4 * i + 4))
    rt.calls.clear()
    ce.copy(s[:HEAD_SPANS], d[:HEAD_SPANS], np.full(HEAD_SPANS, 4), STREAM)
    assert [(c[0], c[4]) for c in rt.calls] == [("batch", HEAD_SPANS)]


def test_a_failed_async_copy_raises_naming_it():
    rt = FakeRuntime(12060, async_code=1)
    ce = CopyEngines(rt)
    with pytest.raises(CopyEngineError, match=r"cudaMemcpyAsync of 8 bytes to 0x40 failed: invalid argument \(error 1\)"):
        ce.copy(np.array([0x10]), np.array([0x40]), np.array([8]), STREAM)


def test_nothing_to_copy_makes_no_call_and_mismatched_arrays_are_refused():
    rt = FakeRuntime(13000)
    ce = CopyEngines(rt)
    assert ce.copy(np.zeros(0), np.zeros(0), np.zeros(0), STREAM) == 0
    assert rt.calls == []
    with pytest.raises(ValueError, match="do not pair up"):
        ce.copy(np.array([1]), np.array([1, 2]), np.array([1]), STREAM)
