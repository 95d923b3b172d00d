"""The decode's step time by running batch size, read from SGLang's own decode log.

SGLang's decode scheduler logs a line every ``--decode-log-interval`` steps (40 by default): "Decode batch ...
#running-req: N, ... gen throughput (token/s): X, ...". Over such an interval the batch generates N tokens a
step, so N / X is the mean step time. Lines from one load run (the log's bytes after an offset taken before it)
are grouped by N; what comes out is, per running batch size, the median step time and how many intervals
stand behind it, so two backends can be compared at the same batch size.
"""
from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Optional

_LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?gen throughput \(token/s\): ([0-9.]+)")


def offset(log: Optional[Path]) -> int:
    try:
        return log.stat().st_size if log else 0
    except OSError:
        return 0


def step_times(text: str) -> dict[int, list[float]]:
    """Running batch size -> step times (ms) of every logged interval in `text`."""
    out: dict[int, list[float]] = {}
    for m in _LINE.finditer(text):
        running, tput = int(m.group(1)), float(m.group(2))
        if running > 0 and tput > 0:
            out.setdefault(running, []).append(1e3 * running / tput)
    return out


def summarize(times: dict[int, list[float]]) -> list[dict]:
    """[{running, step_ms_p50, intervals}] by batch size."""
    return [{"running": n, "step_ms_p50": round(statistics.median(v), 3), "intervals": len(v)}
            for n, v in sorted(times.items())]


def read_since(log: Optional[Path], start: int) -> str:
    if not log:
        return ""
    try:
        with open(log, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
