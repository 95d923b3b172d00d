"""The prefill's steps of each room's transfer, timed (SGLANG_P2P_ROOM_TIMES=1): one log line a room when SGLang's
poll first sees its Success, each step as milliseconds from the room's first chunk queued, where SGLang's
`kv_transfer_latency_ms` starts. In service that figure is a few times the write alone (docs/serving.md); the line
says which step holds the rest. Off (the default) nothing is recorded.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable, Optional

from sglang_p2p_backend.engine.copy.launches import Launch
from sglang_p2p_backend.engine.transport.cuda_ipc import WRITE_STEPS, WriteMarks

logger = logging.getLogger(__name__)

#: a room's steps in order: its first chunk queued (SGLang's send()), its last chunk queued, that chunk taken by a
#: transfer worker, its waits (SGLang's event, the page ids' copy) ended, its page write entered, its ids checked
#: and its route chosen (cuda_ipc.WRITE_STEPS), its copy planned (the runtime calls next) and queued on the GPU
#: (these on the same-host path only: before `launched` is host time, after it the device's and the wait's), the
#: launch returned to SGLang's thread (a chunk that thread queued), SGLang's poll's last look that found that copy
#: still running, written to every decode rank (its worker's wait returned, or SGLang's poll found the copy done:
#: SGLANG_P2P_CONCLUDE_IN_POLL; a queued copy's aux row goes after it), the room concluded here (Success marked,
#: Status sent) and Success seen by SGLang's poll. `concluded` is missing where the poll saw the Success first (it
#: is marked before the Status goes). A chunk SGLang's thread queued is `ready` before `picked`
STEPS = ("queued", "last_queued", "picked", "ready", *WRITE_STEPS, "planned", "launched", "returned", "looked",
         "written", "concluded", "seen")
#: after the steps: the CPU time the queuing thread spent from `ready` to `launched` (ms). Below that span's wall
#: time, the rest of it the thread waited (for the GIL, a lock, the OS), not computed
CPU = "cpu_launched"
#: and from `ready` to each host step of the write before it (ms): where the CPU went
CPU_STEPS = tuple(f"cpu_{s}" for s in (*WRITE_STEPS, "planned"))
#: and the time it was ready to run but waited for a CPU from `ready` to `written` (ms; the kernel's run-queue
#: wait, /proc/thread-self/schedstat, where Linux keeps it): the OS's part of those waits; a wait that is neither
#: is a blocked one (the GIL, a lock)
RUNQ = "runq_written"
#: the kernel's per-thread scheduler figures: CPU ns, run-queue wait ns, time slices
_SCHEDSTAT = "/proc/thread-self/schedstat"
#: the prefix of the log line (e2e/room_times.py reads it back)
PREFIX = "p2pnccl: room times"
#: the line's last words where SGLang's poll concluded the room (SGLANG_P2P_CONCLUDE_IN_POLL), not its worker
BY_POLL = "by poll"
#: after the steps: how many times SGLang's poll looked at the room's queued copy and found it still running (the
#: last of them is `looked`): with `looked -> written`, how late SGLang's loop comes back to see a copy's end
LOOKS = "looks"
#: and the device time of the copy SGLang's thread queued (ms): from its stream reaching the copy (after the wait for
#: SGLang's own stream) to the copy's end. Where the GPU was idle, the copy ended `gpu_copy` after `planned`, so
#: `written` minus that is how late its end was seen
GPU_COPY = "gpu_copy"


class _ThreadFile:
    """A file descriptor that one thread keeps open (in `_open`, a threading.local): closed when the thread ends."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self) -> None:
        os.close(self.fd)


_open = threading.local()


def runq_wait() -> Optional[float]:
    """This thread's run-queue wait so far (s), None where the kernel does not keep it. Each thread keeps the file
    open and reads it again from its start: opening it took ~80 us of a launch on SGLang's thread in service
    (py-spy, docs/serving.md, session 38), a read of the open file ~3 us."""
    try:
        f = getattr(_open, "schedstat", None)
        if f is None:
            f = _open.schedstat = _ThreadFile(_SCHEDSTAT)
        return int(os.pread(f.fd, 256, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class RoomTimes:
    """Per room, when each step happened: `queued` of its first chunk, the other steps of its latest chunk (each
    chunk's replace the one's before); at most `limit` rooms, the oldest dropped first (a room that fails is never
    seen, and its clear forgets it). `cpu`: the marking thread's CPU clock (read at `ready`)."""

    def __init__(self, enabled: bool, limit: int = 4096, clock: Callable[[], float] = time.perf_counter,
                 log: Callable[[str], None] = logger.info, cpu: Callable[[], float] = time.thread_time,
                 runq: Callable[[], Optional[float]] = runq_wait):
        self.enabled = enabled
        self.limit = limit
        self._clock = clock
        self._cpu = cpu
        self._runq = runq
        self._log = log
        self._lock = threading.Lock()
        self._rooms: "collections.OrderedDict[int, dict[str, float]]" = collections.OrderedDict()

    def mark(self, room: int, step: str) -> None:
        """Step `step` of `room` now; `queued` opens the room (its later chunks' count as `last_queued`), `ready`
        also reads this thread's CPU clock and run-queue wait (the thread that then plans and queues the copy: the
        worker, or SGLang's for a launched chunk), `written` the wait again where it is the same thread."""
        if not self.enabled:
            return
        now = self._clock()
        runq = self._runq() if step in ("ready", "written") else None
        with self._lock:
            times = self._room(room, step)
            if times is None:
                return
            if step == "queued":
                times.setdefault("queued", now)
                times["last_queued"] = now
                times["chunks"] += 1
            else:
                times[step] = now
                if step == "looked":
                    times[LOOKS] = times.get(LOOKS, 0.0) + 1
                elif step == "ready":
                    times["ready_cpu"] = self._cpu()
                    # what an earlier chunk's write left
                    for earlier in (*WRITE_STEPS, "planned", "launched", "returned", "looked", LOOKS, GPU_COPY, CPU,
                                    *CPU_STEPS, RUNQ, "ready_runq", "ready_thread"):
                        times.pop(earlier, None)
                    if runq is not None:
                        times["ready_runq"], times["ready_thread"] = runq, threading.get_ident()
                elif (step == "written" and runq is not None and "ready_runq" in times
                      and times["ready_thread"] == threading.get_ident()):  # one thread's figure: a launched
                    times[RUNQ] = runq - times["ready_runq"]  # chunk's `ready` is SGLang's thread's, not its worker's

    def mark_write(self, room: int, marks: Callable[[], Optional[WriteMarks]]) -> None:
        """`planned`, `launched` and the write's noted steps of `room`'s chunk from its write's `marks()` (asked
        only while timing; None: the backend does not record them), and the CPU the thread spent from `ready` to
        each. Marks from before the chunk was ready are an earlier write's (this one queued nothing, or a step
        an earlier write that failed noted) and are left out."""
        if not self.enabled:
            return
        m = marks()
        if m is None:
            return
        with self._lock:
            times = self._rooms.get(room)
            if times is None or m.planned < times.get("ready", m.planned):
                return
            times["planned"], times["launched"] = m.planned, m.launched
            cpu0 = times.get("ready_cpu")
            if cpu0 is not None:
                times[CPU] = m.launched_cpu - cpu0
            for step, wall, cpu in m.steps:
                if wall >= times.get("ready", wall):
                    times[step] = wall
                    if cpu0 is not None:
                        times[f"cpu_{step}"] = cpu - cpu0

    def mark_copy(self, room: int, launch: Launch) -> None:
        """The device time of `room`'s launched copy, found done (`launch.gpu_ms()`; None where it was not timed).
        A measurement only: it never raises into the conclusion that asks for it."""
        if not self.enabled:
            return
        try:
            ms = launch.gpu_ms()
        except Exception:  # noqa: BLE001 - a copy that failed is its concluder's to report, not this line's
            return
        if ms is not None:
            with self._lock:
                times = self._rooms.get(room)
                if times is not None:
                    times[GPU_COPY] = ms / 1e3

    def by_poll(self, room: int) -> None:
        """SGLang's poll, not a worker, concluded `room`: its line says so."""
        if self.enabled:
            with self._lock:
                times = self._rooms.get(room)
                if times is not None:
                    times["by_poll"] = 1.0

    def _room(self, room: int, step: str) -> Optional[dict[str, float]]:
        """`room`'s record (under the lock), opened by `queued`; None where it was not opened (before this was on,
        or dropped for the bound)."""
        times = self._rooms.get(room)
        if times is None and step == "queued":
            times = self._rooms[room] = {"chunks": 0.0}
            if len(self._rooms) > self.limit:
                self._rooms.popitem(last=False)
        return times

    def seen(self, room: int) -> Optional[str]:
        """SGLang's poll saw `room` succeed: its line (also logged), and the room forgotten; None when not timed."""
        if not self.enabled:
            return None
        self.mark(room, "seen")
        with self._lock:
            times = self._rooms.pop(room, None)
        if times is None or "queued" not in times:
            return None
        line = line_of(room, times)
        self._log(line)
        return line

    def forget(self, room: int) -> None:
        if self.enabled:
            with self._lock:
                self._rooms.pop(room, None)


def line_of(room: int, times: dict[str, float]) -> str:
    """`PREFIX room R chunks N: step ms, ...[, cpu_launched ms, cpu_<step> ms...][, runq_written ms][, gpu_copy
    ms][, looks N][, by poll]` (the steps it reached, from its first chunk queued; the CPU times and the run-queue
    wait where both ends were recorded; the launched copy's device time where timed; the poll's looks at a running
    copy where it looked; BY_POLL where SGLang's poll concluded the room)."""
    t0 = times["queued"]
    steps = [f"{s} {1e3 * (times[s] - t0):.3f}" for s in STEPS[1:] if s in times]
    steps += [f"{k} {1e3 * times[k]:.3f}" for k in (CPU, *CPU_STEPS, RUNQ, GPU_COPY) if k in times]
    steps += [f"{LOOKS} {int(times[LOOKS])}"] if LOOKS in times else []
    steps += [BY_POLL] if times.get("by_poll") else []
    return f"{PREFIX} {room} chunks {int(times['chunks'])}: {', '.join(steps)}"
