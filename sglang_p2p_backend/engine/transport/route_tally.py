"""How many same-host chunks, and bytes, each copy route took: a line in the log at most every `every_s` seconds.

`auto` picks the copy engines or the SM kernel chunk by chunk (engine/copy/ce_plan.py); the first use of each
route is logged once, which says that a route was taken, not how often. The tally adds each chunk and, when the
interval has passed, hands back one summary line for the caller to log, so a serving run's log says what share
of its chunks and bytes went each way (e2e/shape_serve.py collects the lines), and, for the kernel under `auto`,
which threshold kept its chunks there (short spans, or more spans than the cap). Thread-safe: the transfer workers
of one prefill rank share a transport.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Callable, Optional

from sglang_p2p_backend.engine.copy.ce_plan import COPY_ENGINE, KERNEL

#: the routes in the order a summary names them, and their names in it
ROUTE_NAMES = {COPY_ENGINE: "copy engines", KERNEL: "SM copy kernel"}


class RouteTally:
    def __init__(self, prefix: str, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.prefix, self.every_s, self._clock = prefix, every_s, clock
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}
        self._reasons: dict[str, Counter[str]] = {}
        self._next = clock() + every_s

    def add(self, route: str, nbytes: int, reason: str = "") -> Optional[str]:
        """Count one chunk of `nbytes` on `route` (`reason`: why the rule sent it there, ce_plan's
        route_and_reason; "" for none); a summary line when one is due, else None."""
        with self._lock:  # on every chunk's path: nothing built where the entries exist (setdefault's default is)
            c = self._counts.get(route)
            if c is None:
                c = self._counts[route] = [0, 0]
            c[0] += 1
            c[1] += nbytes
            if reason:
                why = self._reasons.get(route)
                if why is None:
                    why = self._reasons[route] = Counter()
                why[reason] += 1
            now = self._clock()
            if now < self._next:
                return None
            self._next = now + self.every_s
            return self._line()

    def counts(self) -> dict[str, dict]:
        """{route: {"chunks": n, "bytes": b, "why": {reason: chunks}}} so far (a test's or a report's view)."""
        with self._lock:
            return {r: {"chunks": c[0], "bytes": c[1], "why": dict(self._reasons.get(r, {}))}
                    for r, c in self._counts.items()}

    def _line(self) -> str:
        order = [r for r in ROUTE_NAMES if r in self._counts] + sorted(set(self._counts) - set(ROUTE_NAMES))
        parts = [f"{ROUTE_NAMES.get(r, r)} {self._counts[r][0]} chunks ({self._counts[r][1] / 2**30:.2f} GiB"
                 + "".join(f"; {n} {why}" for why, n in sorted(self._reasons.get(r, {}).items())) + ")"
                 for r in order]
        return f"{self.prefix} routes so far: " + ", ".join(parts)
