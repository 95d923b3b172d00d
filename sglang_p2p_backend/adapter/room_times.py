"""The prefill's steps of each room's transfer, timed (SGLANG_P2P_ROOM_TIMES=1): one log line a room when SGLang's
poll first sees its Success, each step as milliseconds from the room's first chunk queued, where SGLang's
`kv_transfer_latency_ms` starts. In service that figure is a few times the write alone (docs/serving.md); the line
says which step holds the rest. Off (the default) nothing is recorded.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

from sglang_p2p_backend.engine.transport.cuda_ipc import WriteMarks

logger = logging.getLogger(__name__)

#: a room's steps in order: its first chunk queued (SGLang's send()), its last chunk queued, that chunk taken by a
#: transfer worker, its waits (SGLang's event, the page ids' copy) ended, its copy planned (checked and routed, the
#: runtime calls next) and queued on the GPU (these two on the same-host path only: before `launched` is host time,
#: after it the device's and the wait's), written to every decode rank, the room concluded here (Success marked,
#: Status sent) and Success seen by SGLang's poll. `concluded` is missing where the poll saw the Success first (it
#: is marked before the Status goes)
STEPS = ("queued", "last_queued", "picked", "ready", "planned", "launched", "written", "concluded", "seen")
#: after the steps: the CPU time the worker's thread spent from `ready` to `launched` (ms). Below that span's wall
#: time, the rest of it the thread waited (for the GIL, a lock, the OS), not computed
CPU = "cpu_launched"
#: and the time it was ready to run but waited for a CPU from `ready` to `written` (ms; the kernel's run-queue
#: wait, /proc/thread-self/schedstat, where Linux keeps it): the OS's part of those waits; a wait that is neither
#: is a blocked one (the GIL, a lock)
RUNQ = "runq_written"
#: the kernel's per-thread scheduler figures: CPU ns, run-queue wait ns, time slices
_SCHEDSTAT = "/proc/thread-self/schedstat"
#: the prefix of the log line (e2e/room_times.py reads it back)
PREFIX = "p2pnccl: room times"


def runq_wait() -> Optional[float]:
    """This thread's run-queue wait so far (s), None where the kernel does not keep it."""
    try:
        with open(_SCHEDSTAT) as f:
            return int(f.read().split()[1]) / 1e9
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
                if step == "ready":
                    times["ready_cpu"] = self._cpu()
                    # what an earlier chunk's write left
                    for earlier in ("planned", "launched", CPU, RUNQ, "ready_runq", "ready_thread"):
                        times.pop(earlier, None)
                    if runq is not None:
                        times["ready_runq"], times["ready_thread"] = runq, threading.get_ident()
                elif (step == "written" and runq is not None and "ready_runq" in times
                      and times["ready_thread"] == threading.get_ident()):  # one thread's figure: a launched
                    times[RUNQ] = runq - times["ready_runq"]  # chunk's `ready` is SGLang's thread's, not its worker's

    def mark_write(self, room: int, marks: Callable[[], Optional[WriteMarks]]) -> None:
        """`planned` and `launched` of `room`'s chunk from its write's `marks()` (asked only while timing; None:
        the backend does not record them), and the CPU the thread spent from `ready` to `launched`. Marks from
        before the chunk was ready are an earlier write's (this one queued nothing) and are left out."""
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
            if "ready_cpu" in times:
                times[CPU] = m.launched_cpu - times["ready_cpu"]

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
    """`PREFIX room R chunks N: step ms, ...[, cpu_launched ms][, runq_written ms]` (the steps it reached, from
    its first chunk queued; the CPU time and the run-queue wait where both ends were recorded)."""
    t0 = times["queued"]
    steps = [f"{s} {1e3 * (times[s] - t0):.3f}" for s in STEPS[1:] if s in times]
    steps += [f"{k} {1e3 * times[k]:.3f}" for k in (CPU, RUNQ) if k in times]
    return f"{PREFIX} {room} chunks {int(times['chunks'])}: {', '.join(steps)}"
