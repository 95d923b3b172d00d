"""How long a background thread waits for the GIL while the main thread runs Python, by switch interval.

An SGLang scheduler's main thread runs Python almost all the time (the launch loop of a forward pass, or the
idle loop's polling). A transfer or control thread of a KV backend that releases the GIL (a CUDA sync, a
socket wait, a queue get) must take it back before its next line of Python, and CPython hands it over only
when the holder releases it or after the switch interval (5 ms by default) has passed. This measures that
wait: the main thread spins in Python; a second thread, 200 times, sleeps 1 ms (GIL released) and records how
much later than 1 ms it runs again. It prints the median and p90 delay per switch interval, and how much the
main thread's loop slowed against running alone.

    python bench/gil/convoy.py [--intervals-ms 5,1,0.5,0.2] [--wakeups 200]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time


def spin(stop: threading.Event, counter: list) -> None:
    n = 0
    while not stop.is_set():
        n += 1  # pure Python: holds the GIL between eval-breaker checks
    counter.append(n)


def measure(interval_s: float, wakeups: int) -> dict:
    sys.setswitchinterval(interval_s)
    delays: list[float] = []

    def waker() -> None:
        for _ in range(wakeups):
            t0 = time.perf_counter()
            time.sleep(0.001)
            delays.append(time.perf_counter() - t0 - 0.001)

    stop, counter = threading.Event(), []
    t = threading.Thread(target=waker)
    t0 = time.perf_counter()
    t.start()
    main = threading.Thread(target=spin, args=(stop, counter))  # the "scheduler": spins until the waker ends
    main.start()
    t.join()
    stop.set()
    main.join()
    wall = time.perf_counter() - t0
    delays.sort()
    return {"switch_interval_ms": interval_s * 1e3, "wakeups": wakeups,
            "gil_wait_ms_p50": round(1e3 * statistics.median(delays), 3),
            "gil_wait_ms_p90": round(1e3 * delays[int(0.9 * len(delays))], 3),
            "spin_iterations_per_s": round(counter[0] / wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    ap.add_argument("--wakeups", type=int, default=200)
    ap.add_argument("--machine", default="unknown")
    a = ap.parse_args()
    rows = [measure(float(ms) / 1e3, a.wakeups) for ms in a.intervals_ms.split(",")]
    print(json.dumps({"machine": a.machine, "python": sys.version.split()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
