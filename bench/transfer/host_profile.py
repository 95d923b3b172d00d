"""Where a call's host time goes: cProfile over repeated calls, the functions that took the most time of their
own, per call. The transfer benchmark records it for a small request's write (the fixed cost a GPU run must
explain function by function); profiling slows the calls, so the shares matter, not the totals."""

from __future__ import annotations

import cProfile
import pstats
from typing import Any, Callable


def host_profile(fn: Callable[[], Any], calls: int = 100, top: int = 12) -> list[dict]:
    """[{"function", "calls_per_op", "own_us_per_op", "cum_us_per_op"}] of the `top` functions by own time over
    `calls` calls of `fn` (this thread only), most first."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return profile_rows(prof, calls, top)


def profile_rows(prof: cProfile.Profile, calls: int, top: int = 12) -> list[dict]:
    """`host_profile`'s rows from a profile the caller enabled around `calls` calls itself (only around the
    calls, where each needs work outside it, such as waiting for what it queued)."""
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{name} ({file.rsplit('/', 1)[-1]}:{line})", "calls_per_op": n / calls,
             "own_us_per_op": own * 1e6 / calls, "cum_us_per_op": cum * 1e6 / calls}
            for (file, line, name), (_, n, own, cum, _) in rows]


def render(rows: list[dict], limit: int = 8) -> list[str]:
    """Lines of the table the benchmark prints."""
    return [f"    {r['own_us_per_op']:8.1f} us own {r['cum_us_per_op']:8.1f} us cum {r['calls_per_op']:6.1f}x  "
            f"{r['function']}" for r in rows[:limit]]
