"""The prefill's room-times lines (SGLANG_P2P_ROOM_TIMES=1, sglang_p2p_backend/adapter/room_times.py) read back
from a server log: per step, the median milliseconds from a room's first chunk queued over the rooms of one load
run, and the median gap from each step to the next, so a run's results say which step holds SGLang's KV time.
"""
from __future__ import annotations

import re
import statistics
from typing import Optional

from sglang_p2p_backend.adapter.room_times import CPU, PREFIX, RUNQ, STEPS

_LINE = re.compile(re.escape(PREFIX) + r" (\d+) chunks (\d+): ([^\n]*)")
_STEP = re.compile(r"(\w+) (-?[0-9.]+)")


def parse(text: str) -> list[dict[str, float]]:
    """Each room's line in `text` as {"room": its id, "chunks": n, step: ms from its first chunk queued, ...,
    "cpu_launched" and "runq_written": ms where the line has them}, the steps in the line's order."""
    rooms = []
    for m in _LINE.finditer(text):
        steps = {k: float(v) for k, v in _STEP.findall(m.group(3)) if k in STEPS or k in (CPU, RUNQ)}
        rooms.append({"room": int(m.group(1)), "chunks": float(m.group(2)), **steps})
    return rooms


def summarize(rooms: list[dict[str, float]]) -> Optional[dict[str, object]]:
    """{"rooms": n, "chunks_p50", "at": {step: median ms}, "gaps": {"a->b": median of b - a}} over the rooms that
    reached both steps, and "cpu_launched" and "runq_written" (the medians of the rooms that have them) where any
    has; None without rooms (the servers did not log them)."""
    if not rooms:
        return None
    at = {s: round(statistics.median(r[s] for r in rooms if s in r), 3)
          for s in STEPS[1:] if any(s in r for r in rooms)}
    gaps = {}
    # and the write's host part and the write whole, with or without the steps between
    for a, b in [*zip(STEPS, STEPS[1:]), ("ready", "launched"), ("ready", "written")]:
        xs = [r[b] - r.get(a, 0.0) for r in rooms if b in r and (a in r or a == STEPS[0])]
        if xs:
            gaps[f"{a}->{b}"] = round(statistics.median(xs), 3)
    out = {"rooms": len(rooms), "chunks_p50": statistics.median(r["chunks"] for r in rooms), "at": at, "gaps": gaps}
    for k in (CPU, RUNQ):
        xs = [r[k] for r in rooms if k in r]
        if xs:
            out[k] = round(statistics.median(xs), 3)
    return out
