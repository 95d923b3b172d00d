"""A compute loop timed alone and while a thread writes KV back to back: what a transfer path costs the forward
passes running beside it on the same GPU."""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class Interference:
    alone: list  # what `loop()` returned, alone
    busy: list  # and while the writes ran
    writes: int  # writes completed while `busy` was measured
    wall_s: float  # how long `busy` took
    error: Optional[str]  # the writer's traceback, if a write raised


def during_writes(loop: Callable[[], float], write: Callable[[], Any], reps: int,
                  join_timeout: Optional[float] = None) -> Interference:
    """`loop()` once to warm up, `reps` times alone, then `reps` times while a daemon thread calls `write()`
    back to back (given 50 ms to start)."""
    loop()
    alone = [loop() for _ in range(reps)]
    stop, writes, failure = threading.Event(), [0], []

    def writer() -> None:
        try:
            while not stop.is_set():
                write()
                writes[0] += 1
        except BaseException:  # noqa: BLE001 - reported to the caller
            failure.append(traceback.format_exc())

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    busy = [loop() for _ in range(reps)]
    wall = time.perf_counter() - t0
    stop.set()
    t.join(join_timeout)
    return Interference(alone, busy, writes[0], wall, failure[0] if failure else None)
