"""The prefill's room-times lines (SGLANG_P2P_ROOM_TIMES=1, sglang_p2p_backend/adapter/room_times.py) read back
from a server log: per step, the median milliseconds from a room's first chunk queued over the rooms of one load
run, and the median gap from each step to the next, so a run's results say which step holds SGLang's KV time.
"""
from __future__ import annotations

import re
import statistics
from typing import Optional

from sglang_p2p_backend.adapter.room_times import BY_POLL, CPU, CPU_STEPS, GPU_COPY, LOOKS, PREFIX, RUNQ, STEPS
from sglang_p2p_backend.engine.transport.cuda_ipc import WRITE_STEPS

#: the steps of a write on the thread that queued its copy, in order: each gap's wall time and CPU time
#: (`host_steps`)
HOST_STEPS = ("ready", *WRITE_STEPS, "planned", "launched")
_LINE = re.compile(re.escape(PREFIX) + r" (\d+) chunks (\d+): ([^\n]*)")
_STEP = re.compile(r"(\w+) (-?[0-9.]+)")


def parse(text: str) -> list[dict[str, float]]:
    """Each room's line in `text` as {"room": its id, "chunks": n, step: ms from its first chunk queued, ...,
    "cpu_launched", "cpu_<step>", "runq_written" and "gpu_copy": ms where the line has them, "looks": the poll's
    looks at a running copy where it looked, "by_poll": 1.0 where SGLang's poll concluded the room}, the steps in
    the line's order."""
    rooms = []
    for m in _LINE.finditer(text):
        steps = {k: float(v) for k, v in _STEP.findall(m.group(3))
                 if k in STEPS or k in (CPU, *CPU_STEPS, RUNQ, GPU_COPY, LOOKS)}
        by_poll = {"by_poll": 1.0} if m.group(3).rstrip().endswith(BY_POLL) else {}
        rooms.append({"room": int(m.group(1)), "chunks": float(m.group(2)), **steps, **by_poll})
    return rooms


def concluders(rooms: list[dict[str, float]]) -> Optional[dict[str, dict[str, object]]]:
    """Where SGLang's poll concluded any room: {"poll": ..., "worker": ...}, each {"rooms": n, "concluded" and
    "seen": median ms, and where its rooms have them "looked->written": median ms from the poll's last look at the
    running copy to the copy seen done, "looks": median looks, "copy_end->written": median ms from the copy's end
    (`planned` plus its device time `gpu_copy`, where the GPU was idle before it) to the copy seen done} over the
    rooms that one concluded (None where no line says `by poll`: the poll concluded none, or the servers predate
    the mark)."""
    if not any(r.get("by_poll") for r in rooms):
        return None
    out: dict[str, dict[str, object]] = {}
    for who, mine in (("poll", [r for r in rooms if r.get("by_poll")]),
                      ("worker", [r for r in rooms if not r.get("by_poll")])):
        out[who] = {"rooms": len(mine)}
        for step in ("concluded", "seen"):
            xs = [r[step] for r in mine if step in r]
            out[who][step] = round(statistics.median(xs), 3) if xs else None
        late = copy_end_seen(mine)
        if late is not None:
            out[who]["copy_end->written"] = late
        looked = [r for r in mine if "looked" in r and "written" in r]
        if looked:
            out[who]["looked->written"] = round(statistics.median(r["written"] - r["looked"] for r in looked), 3)
            out[who][LOOKS] = statistics.median(r.get(LOOKS, 1.0) for r in looked)
    return out


def copy_end_seen(rooms: list[dict[str, float]]) -> Optional[float]:
    """The median ms from a launched copy's end to its end seen (`written`), over the rooms whose copy was timed
    (`gpu_copy`): the copy is taken to end `gpu_copy` after `planned`, which holds where the GPU was idle before it
    (a request alone); None without such rooms."""
    xs = [r["written"] - r["planned"] - r[GPU_COPY] for r in rooms
          if all(k in r for k in ("written", "planned", GPU_COPY))]
    return round(statistics.median(xs), 3) if xs else None


def summarize(rooms: list[dict[str, float]]) -> Optional[dict[str, object]]:
    """{"rooms": n, "chunks_p50", "at": {step: median ms}, "gaps": {"a->b": median of b - a}} over the rooms that
    reached both steps, and "cpu_launched", each "cpu_<step>", "runq_written" and "gpu_copy" (the medians of the
    rooms that have them) where any has, "copy_end->written" (`copy_end_seen`) where copies were timed,
    "concluded_by" (`concluders`) where the poll concluded any; None without rooms (the servers did not log them)."""
    if not rooms:
        return None
    at = {s: round(statistics.median(r[s] for r in rooms if s in r), 3)
          for s in STEPS[1:] if any(s in r for r in rooms)}
    gaps = {}
    # and the write's host part, SGLang's thread's whole launch and the write whole, with or without the steps between
    # (steps a room may lack: the copy queued by its worker returns to no thread, a copy the poll never saw running
    # has no look)
    for a, b in [*zip(STEPS, STEPS[1:]), ("ready", "launched"), ("ready", "returned"), ("ready", "written"),
                 ("launched", "written"), ("returned", "written")]:
        xs = [r[b] - r.get(a, 0.0) for r in rooms if b in r and (a in r or a == STEPS[0])]
        if xs:
            gaps[f"{a}->{b}"] = round(statistics.median(xs), 3)
    out = {"rooms": len(rooms), "chunks_p50": statistics.median(r["chunks"] for r in rooms), "at": at, "gaps": gaps}
    for k in (CPU, *CPU_STEPS, RUNQ, GPU_COPY):
        xs = [r[k] for r in rooms if k in r]
        if xs:
            out[k] = round(statistics.median(xs), 3)
    late = copy_end_seen(rooms)
    if late is not None:
        out["copy_end->written"] = late
    host = host_steps(rooms)
    if host:
        out["host_steps"] = host
    by = concluders(rooms)
    if by:
        out["concluded_by"] = by
    return out


def _cpu(room: dict[str, float], step: str) -> Optional[float]:
    """The queuing thread's CPU ms from `ready` to `step` in `room` (0 at `ready`), None where not recorded."""
    return 0.0 if step == "ready" and CPU in room else room.get(f"cpu_{step}")


def host_steps(rooms: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per gap between neighbouring HOST_STEPS: {"wall": median ms, "cpu": median ms of the thread's CPU} over
    the rooms that recorded both ends of both; where wall time passes without CPU the thread waited (the GIL, a
    lock)."""
    out = {}
    for a, b in zip(HOST_STEPS, HOST_STEPS[1:]):
        pairs = [(r[b] - r[a], _cpu(r, b) - _cpu(r, a)) for r in rooms
                 if a in r and b in r and _cpu(r, a) is not None and _cpu(r, b) is not None]
        if pairs:
            out[f"{a}->{b}"] = {"wall": round(statistics.median(p[0] for p in pairs), 3),
                                "cpu": round(statistics.median(p[1] for p in pairs), 3)}
    return out
