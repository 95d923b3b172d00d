"""The same-host path's runtime calls (engine/copy/stream_ops.py) against a stand-in CUDA runtime on CPU: the
ordering records the event on the caller's current stream and makes the copy stream wait on that very event;
the device is set only where another one is current and given back afterwards; the upload is one host-to-device
copy on the copy stream; a refused call raises, naming the call, the device and CUDA's error."""
from __future__ import annotations

import ctypes

import pytest
import torch

from sglang_p2p_backend.engine.copy.launches import EventLaunch, EventPool
from sglang_p2p_backend.engine.copy.stream_ops import (EVENT_DISABLE_TIMING, MEMCPY_HOST_TO_DEVICE, CudaCallError,
                                                       StreamOps, event_done)

EVENT = 0xE7
CURRENT = {1: 0x5100, 0: 0x5000}  # the caller's current stream on each device
OURS = 0xC0DE


def _value(x):
    return x.value if isinstance(x, (ctypes.c_void_p, ctypes.c_int)) else x


class FakeRuntime:
    """The runtime calls StreamOps makes, recorded as plain values; `device` is the thread's current device and
    `fail` maps a function's name to the error code it returns."""

    def __init__(self, device: int = 1, fail: dict | None = None):
        self.device, self.fail, self.calls = device, fail or {}, []
        for name in ("cudaEventRecord", "cudaStreamWaitEvent", "cudaMemcpyAsync", "cudaStreamSynchronize",
                     "cudaEventDestroy"):
            setattr(self, name, self._recorder(name))
        self.cudaGetErrorString = lambda code: b"an illegal memory access was encountered"
        # plain functions, as a CDLL's are attribute holders: StreamOps sets argtypes / restype on them
        self.cudaGetDevice = lambda out: self._get_device(out)
        self.cudaSetDevice = lambda index: self._set_device(index)
        self.cudaEventCreateWithFlags = lambda out, flags: self._create_event(out, flags)
        self.cudaEventElapsedTime = lambda out, start, end: self.fail.get("cudaEventElapsedTime", 0)

    def _recorder(self, name):
        def call(*args) -> int:
            self.calls.append((name, *(_value(a) for a in args)))
            return self.fail.get(name, 0)
        return call

    def _get_device(self, out) -> int:
        out._obj.value = self.device
        return self.fail.get("cudaGetDevice", 0)

    def _set_device(self, index) -> int:
        self.calls.append(("cudaSetDevice", _value(index)))
        if "cudaSetDevice" in self.fail:
            return self.fail["cudaSetDevice"]
        self.device = _value(index)
        return 0

    def _create_event(self, out, flags) -> int:
        self.calls.append(("cudaEventCreateWithFlags", self.device, flags))
        out._obj.value = EVENT
        return 0


def ops_on(rt: FakeRuntime, index: int = 1) -> StreamOps:
    return StreamOps(rt, torch.device("cuda", index), current_stream=CURRENT.__getitem__)


def test_the_event_is_made_on_the_copies_device_and_the_callers_device_comes_back():
    rt = FakeRuntime(device=0)
    ops = ops_on(rt, 1)
    assert ops.event.value == EVENT
    assert rt.calls == [("cudaSetDevice", 1), ("cudaEventCreateWithFlags", 1, EVENT_DISABLE_TIMING),
                        ("cudaSetDevice", 0)]
    assert rt.device == 0


def test_ordering_records_on_the_callers_current_stream_and_the_copy_stream_waits_on_that_event():
    rt = FakeRuntime(device=1)
    ops = ops_on(rt, 1)
    rt.calls.clear()
    ops.after_current(OURS)
    assert rt.calls == [("cudaEventRecord", EVENT, CURRENT[1]), ("cudaStreamWaitEvent", OURS, EVENT, 0)]


def test_no_ordering_is_queued_where_the_callers_current_stream_is_the_one_ordered():
    rt = FakeRuntime(device=1)
    ops = ops_on(rt, 1)
    rt.calls.clear()
    ops.after_current(CURRENT[1])
    assert rt.calls == []


def test_the_device_is_set_only_where_another_is_current_and_restored():
    rt = FakeRuntime(device=1)
    ops = ops_on(rt, 1)
    rt.calls.clear()
    prev = ops.enter()
    ops.leave(prev)
    assert rt.calls == [] and rt.device == 1  # already current: nothing set
    rt.device = 0
    prev = ops.enter()
    assert rt.device == 1 and prev == 0
    ops.leave(prev)
    assert rt.device == 0 and rt.calls == [("cudaSetDevice", 1), ("cudaSetDevice", 0)]


def test_the_upload_is_one_host_to_device_copy_on_the_copy_stream_and_sync_waits_on_it():
    rt = FakeRuntime()
    ops = ops_on(rt)
    rt.calls.clear()
    ops.upload(0xD000, 0xF000, 4096, OURS)
    ops.synchronize(OURS)
    assert rt.calls == [("cudaMemcpyAsync", 0xD000, 0xF000, 4096, MEMCPY_HOST_TO_DEVICE, OURS),
                        ("cudaStreamSynchronize", OURS)]


@pytest.mark.parametrize("name,call", [
    ("cudaStreamSynchronize", lambda ops: ops.synchronize(OURS)),
    ("cudaStreamWaitEvent", lambda ops: ops.after_current(OURS)),
    ("cudaMemcpyAsync", lambda ops: ops.upload(1, 2, 3, OURS)),
])
def test_a_refused_call_raises_naming_the_call_the_device_and_the_error(name, call):
    rt = FakeRuntime()
    ops = ops_on(rt)
    rt.fail[name] = 700
    with pytest.raises(CudaCallError) as e:
        call(ops)
    assert name in str(e.value) and "cuda:1" in str(e.value)
    assert "illegal memory access" in str(e.value) and "error 700" in str(e.value)


def test_a_refused_device_switch_raises_and_sets_nothing():
    rt = FakeRuntime(device=0)
    ops = ops_on(rt, 0)
    rt.fail["cudaSetDevice"] = 101
    rt.device = 2
    with pytest.raises(CudaCallError, match="cudaSetDevice on cuda:0"):
        ops.enter()
    assert rt.device == 2


class FakeDriver:
    """cuDeviceGet and cuDevicePrimaryCtxGetState: the devices in `active` have a context."""

    def __init__(self, active: set[int]):
        self.active = active

    def cuDeviceGet(self, out, ordinal) -> int:
        out._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxGetState(self, dev, flags, active) -> int:
        active._obj.value = int(dev.value in self.active)
        return 0


@pytest.mark.parametrize("contexts,restored", [({0, 1}, True), ({1}, False)])
def test_the_callers_device_comes_back_only_where_it_has_a_context(contexts, restored):
    """A fresh thread's device is 0; making it current again would make a context on GPU 0 in a process that
    uses GPU 1 only: it stays on GPU 1 then, as torch's device guard does."""
    rt = FakeRuntime(device=1)
    ops = StreamOps(rt, torch.device("cuda", 1), current_stream=CURRENT.__getitem__, drv=FakeDriver(contexts))
    rt.device = 0
    rt.calls.clear()
    ops.leave(ops.enter())
    assert rt.device == (0 if restored else 1)
    assert rt.calls == [("cudaSetDevice", 1)] + ([("cudaSetDevice", 0)] if restored else [])


def test_the_event_is_destroyed_with_the_ops():
    """A thread's copiers go when the thread does: its event with them, not left to the process."""
    rt = FakeRuntime()
    ops = ops_on(rt)
    rt.calls.clear()
    del ops
    assert rt.calls == [("cudaEventDestroy", EVENT)]


def test_a_nested_enter_asks_nothing_and_only_the_outermost_leave_gives_the_device_back():
    rt = FakeRuntime(device=0)
    ops = ops_on(rt, 1)
    rt.calls.clear()
    asked = []
    rt.cudaGetDevice = lambda out: (asked.append(1), rt._get_device(out))[1]
    outer = ops.enter()  # the write: device 1 set, 0 to come back to
    inner = ops.enter()  # the kernel's launch inside it: nothing asked or set
    assert (outer, inner, len(asked)) == (0, 1, 1) and rt.calls == [("cudaSetDevice", 1)]
    ops.leave(inner)
    assert rt.device == 1 and rt.calls == [("cudaSetDevice", 1)]
    ops.leave(outer)
    assert rt.device == 0 and rt.calls == [("cudaSetDevice", 1), ("cudaSetDevice", 0)]
    ops.enter()  # a later write asks again
    assert len(asked) == 2


class _FakeStream:
    def __init__(self, stream_id: int, device_index: int):
        self.stream_id, self.device_index, self.device_type = stream_id, device_index, 1


def test_on_stream_swaps_the_current_stream_with_torchs_entry_points_and_puts_the_old_one_back(monkeypatch):
    """On the thread's current device: the stream set, the one before it set again after (also after an error)."""
    from sglang_p2p_backend.engine.copy.stream_ops import on_stream

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: (77, index, 1), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_setStream", lambda **kw: calls.append(kw), raising=False)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: pytest.fail("torch's context manager on the fast path"))
    s = _FakeStream(5, 1)
    with pytest.raises(RuntimeError, match="inside"):
        with on_stream(s) as got:
            assert got is s
            assert calls == [{"stream_id": 5, "device_index": 1, "device_type": 1}]
            raise RuntimeError("inside")
    assert calls[1:] == [{"stream_id": 77, "device_index": 1, "device_type": 1}]


def test_on_stream_of_another_device_is_torchs_context_manager_and_none_is_nothing(monkeypatch):
    from sglang_p2p_backend.engine.copy.stream_ops import on_stream

    seen = []

    class Ctx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            seen.append(("enter", self.s.stream_id))

        def __exit__(self, *exc):
            seen.append(("exit", self.s.stream_id))

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: pytest.fail("fast path"), raising=False)
    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    with on_stream(_FakeStream(9, 1)):
        pass
    assert seen == [("enter", 9), ("exit", 9)]
    with on_stream(None) as got:
        assert got is None
    assert seen == [("enter", 9), ("exit", 9)]


def test_an_events_answer_reads_as_run_not_yet_or_a_failure_named_with_its_call():
    codes = iter([600, 0, 700])
    rt = FakeRuntime()
    rt.cudaEventQuery = lambda event: next(codes)
    assert event_done(rt, EVENT, 1) is False  # cudaErrorNotReady: queued work still running
    assert event_done(rt, EVENT, 1) is True
    with pytest.raises(CudaCallError, match="cudaEventQuery on cuda:1 failed: an illegal memory access"):
        event_done(rt, EVENT, 1)


def test_a_launch_is_waited_for_once_its_event_going_back_to_a_bounded_pool():
    rt = FakeRuntime()
    answers = [600]
    rt.cudaEventQuery = lambda event: answers[-1]
    rt.cudaEventSynchronize = lambda event: rt.calls.append(("cudaEventSynchronize", _value(event))) or 0
    pool = EventPool(rt, 1, limit=2)
    first, second = pool.take(), pool.take()
    assert pool.take() is None  # every event held by a launch nobody waited for: the caller does not launch
    launch = EventLaunch(pool, first)
    assert launch.done() is False
    launch.wait()
    launch.wait()  # a second wait asks nothing more
    assert [c for c in rt.calls if c[0] == "cudaEventSynchronize"] == [("cudaEventSynchronize", EVENT)]
    answers.append(700)  # waited for: done without asking the event, which is the pool's again
    assert launch.done() is True and pool.take() is first
    pool.give(second)


def timed_runtime(elapsed_code: int = 0) -> FakeRuntime:
    """A runtime whose events are distinct handles, done once synchronized, 0.25 ms apart."""
    rt = FakeRuntime()
    made = iter(range(0x100, 0x200))

    def create(out, flags) -> int:
        rt.calls.append(("cudaEventCreateWithFlags", rt.device, flags))
        out._obj.value = next(made)
        return 0

    def elapsed(out, start, end) -> int:
        rt.calls.append(("cudaEventElapsedTime", _value(start), _value(end)))
        out._obj.value = 0.25
        return elapsed_code

    done = [600]
    rt.cudaEventCreateWithFlags, rt.cudaEventElapsedTime = create, elapsed
    rt.cudaEventQuery = lambda event: done[-1]
    rt.cudaEventSynchronize = lambda event: done.append(0) or 0
    return rt


def test_a_timed_launch_gives_its_copies_device_time_read_before_its_two_events_go_back():
    """SGLANG_P2P_ROOM_TIMES: a timed launch's pool makes timing events (cudaEventDefault, 0), and the launch gives
    the device time from its start event to its end once both ran, read before the wait gives the events back."""
    rt = timed_runtime()
    pool = EventPool(rt, 1, limit=8, timing=True)
    end, start = pool.take(), pool.take()
    assert [c[2] for c in rt.calls if c[0] == "cudaEventCreateWithFlags"] == [0, 0]
    launch = EventLaunch(pool, end, start)
    assert launch.gpu_ms() is None  # still running: not asked
    assert not [c for c in rt.calls if c[0] == "cudaEventElapsedTime"]
    launch.wait()
    assert launch.gpu_ms() == 0.25 and launch.gpu_ms() == 0.25
    assert [c for c in rt.calls if c[0] == "cudaEventElapsedTime"] == [("cudaEventElapsedTime", 0x101, 0x100)]
    assert {_value(pool.take()), _value(pool.take())} == {0x100, 0x101}  # both back, none made anew
    assert len([c for c in rt.calls if c[0] == "cudaEventCreateWithFlags"]) == 2


def test_an_untimed_launch_or_a_failed_reading_gives_no_device_time():
    rt = timed_runtime()
    pool = EventPool(rt, 1)
    launch = EventLaunch(pool, pool.take())
    launch.wait()
    assert launch.gpu_ms() is None and not [c for c in rt.calls if c[0] == "cudaEventElapsedTime"]
    assert [c[2] for c in rt.calls if c[0] == "cudaEventCreateWithFlags"] == [EVENT_DISABLE_TIMING]
    rt = timed_runtime(elapsed_code=1)  # e.g. a start event never recorded: cudaErrorInvalidValue
    pool = EventPool(rt, 1, timing=True)
    launch = EventLaunch(pool, pool.take(), pool.take())
    launch.wait()
    assert launch.gpu_ms() is None
